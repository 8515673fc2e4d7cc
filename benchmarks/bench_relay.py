"""Relay chains on this machine: one trainer process pushing to N inference processes at one
place over the socket path, with relay chains (``pairing.CHAIN_MEMBERS``, the default) against
the trainer sending every receiver every byte itself (chains of one member: the fan-out before
relays), in the same run::

    python benchmarks/bench_relay.py --receivers 3 --mib 256 --pushes 4 --json benchmarks/results/relay.json

Each case is a fresh trainer and N fresh inference processes (plain processes with explicit ranks,
``transport="socket"``: no same-host handoff, so the receivers are chained as on other hosts).
The cases alternate (A B A B ...), and each reports per push the trainer's seconds, the slowest
receiver's seconds and the bytes the trainer put on the wire; full pushes (``delta=False``), so
that every push moves every byte. All processes share this machine's CPUs and its loopback: a
relay's pass-on is a copy through the kernel here, where on a cluster it is the receiver's own
link. What relays change at scale (a trainer rank's link carries its bytes once per chain, not once
per replica) is modelled in bench_scale.py; this measures what they cost where nothing is gained.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state(mib: int, version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    per = 16  # MiB a tensor
    return {f"w{i}": torch.randn(per * 2**20 // 4, generator=gen) for i in range(max(1, mib // per))}


def part(args: argparse.Namespace) -> None:
    from distload.live import pairing
    from distload.live.channel import SyncChannel
    pairing.CHAIN_MEMBERS = args.chain  # every member of the session uses the same
    role = "trainer" if args.part == "trainer" else "inference"
    size = 1 if role == "trainer" else args.receivers
    rows = []
    with SyncChannel(args.address, role, rank=args.rank, size=size, device="cpu", timeout_s=300,
                     transport="socket", delta=False, verify=True) as channel:
        if role == "trainer":
            for version in range(1, args.pushes + 1):
                stats = channel.push(_state(args.mib, version), version)
                rows.append({"version": version, "seconds": stats.seconds, "wire_bytes": stats.wire_bytes})
        else:
            target = {k: torch.zeros_like(v) for k, v in _state(args.mib, 0).items()}
            for version in range(1, args.pushes + 1):
                stats = channel.receive(target)
                exact = all(torch.equal(target[k], v) for k, v in _state(args.mib, version).items())
                rows.append({"version": version, "seconds": stats.seconds, "exact": exact,
                             "pairs": sorted(channel._session.pairs)})
    with open(args.out, "w") as f:
        json.dump(rows, f)


def _case(args: argparse.Namespace, chain: int, scratch: str) -> dict:
    address = f"tcp://127.0.0.1:{_free_port()}"
    base = [sys.executable, __file__, "--address", address, "--chain", str(chain), "--mib", str(args.mib),
            "--pushes", str(args.pushes), "--receivers", str(args.receivers)]
    outs = [os.path.join(scratch, f"{chain}-{r}.json") for r in range(args.receivers + 1)]
    procs = [subprocess.Popen(base + ["--part", "trainer", "--rank", "0", "--out", outs[0]])]
    procs += [subprocess.Popen(base + ["--part", "inference", "--rank", str(r), "--out", outs[r + 1]])
              for r in range(args.receivers)]
    for proc in procs:
        if proc.wait(900):
            raise SystemExit(f"a member of the chain-{chain} case failed (exit {proc.returncode})")
    trainer, *receivers = [json.load(open(path)) for path in outs]
    if not all(row["exact"] for rows in receivers for row in rows):
        raise SystemExit(f"chain-{chain} case: a receiver did not end with the trainer's bytes")
    # the first push connects the pairs: the rest are the steady state
    return {"push_s": [row["seconds"] for row in trainer[1:]],
            "receive_s": [max(rows[i]["seconds"] for rows in receivers) for i in range(1, args.pushes)],
            "trainer_wire_bytes": trainer[-1]["wire_bytes"],
            "receiver_pairs": [rows[-1]["pairs"] for rows in receivers]}


def orchestrate(args: argparse.Namespace) -> None:
    import tempfile
    from distload.live import pairing
    cases = {"relays": pairing.CHAIN_MEMBERS, "fan-out": 1}
    runs: dict[str, list[dict]] = {name: [] for name in cases}
    load_before = os.getloadavg()
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        for _ in range(args.repeats):
            for name, chain in cases.items():
                runs[name].append(_case(args, chain, scratch))
    result = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "platform": platform.platform(),
                          "load_average_before": load_before, "load_average_after": os.getloadavg()},
              "receivers": args.receivers, "state_mib": args.mib, "pushes": args.pushes, "repeats": args.repeats,
              "seconds": time.monotonic() - start, "cases": {}}
    for name, rs in runs.items():
        result["cases"][name] = {
            "chain_members": cases[name],
            "push_s_median": statistics.median(s for r in rs for s in r["push_s"]),
            "receive_s_median": statistics.median(s for r in rs for s in r["receive_s"]),
            "trainer_wire_bytes": rs[-1]["trainer_wire_bytes"], "receiver_pairs": rs[-1]["receiver_pairs"]}
    relays, fan = result["cases"]["relays"], result["cases"]["fan-out"]
    result["relays_vs_fan_out_push_time"] = relays["push_s_median"] / fan["push_s_median"]
    result["relays_vs_fan_out_trainer_bytes"] = relays["trainer_wire_bytes"] / fan["trainer_wire_bytes"]
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        m = result["machine"]
        lines = [f"Relay chains against the trainer's own fan-out (benchmarks/bench_relay.py): 1 trainer process -> "
                 f"{args.receivers} inference processes at one place, socket path, {args.mib} MiB of fp32 a push, full "
                 f"pushes, verified; {args.repeats} runs of each case alternating, {args.pushes - 1} timed pushes each "
                 f"(the first connects the pairs). {m['cpus']} CPUs shared by all {args.receivers + 1} processes, "
                 f"torch {m['torch']}, {m['platform']}; load average {m['load_average_before'][0]:.2f} before, "
                 f"{m['load_average_after'][0]:.2f} after.", "",
                 "| case | chain members | push s (median) | slowest receive s (median) | trainer's bytes on the wire | "
                 "receivers' pairs (session ranks) |", "|---|---|---|---|---|---|"]
        for name, c in result["cases"].items():
            lines.append(f"| {name} | {c['chain_members']} | {c['push_s_median']:.3f} | {c['receive_s_median']:.3f} | "
                         f"{c['trainer_wire_bytes'] / 2**20:.0f} MiB | {c['receiver_pairs']} |")
        lines += ["", f"Relays / fan-out: push time {result['relays_vs_fan_out_push_time']:.2f}x, the trainer's bytes "
                      f"{result['relays_vs_fan_out_trainer_bytes']:.2f}x."]
        with open(os.path.splitext(args.json)[0] + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--receivers", type=int, default=3)
    parser.add_argument("--mib", type=int, default=256, help="the state's size")
    parser.add_argument("--pushes", type=int, default=4, help="pushes a case (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each case, alternating")
    parser.add_argument("--json", help="write the figures here, and a .md beside it")
    parser.add_argument("--part", choices=["trainer", "inference"], help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--chain", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:
        part(args)
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
