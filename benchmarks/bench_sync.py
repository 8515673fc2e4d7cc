"""Weight sync: distload's channel inside one job and across two jobs, against a flat broadcast.

    python benchmarks/bench_sync.py                      # ~530 MiB Llama-shaped bf16, 3 repeats
    python benchmarks/bench_sync.py --size-mib 128 --repeats 2

In ONE run, over the same many-tensor Llama-shaped bf16 state (sync-demo's model), a trainer
rank sends to two inference ranks on gloo:

- ``flat``: one torchrun job of 3 ranks, one broadcast of all bytes already packed in one
  buffer (the transport's ceiling);
- ``per-tensor``: the same job, one broadcast per tensor (the naive way);
- ``one job``: the same job, ``WeightSync.push``/``receive``;
- ``two jobs``: a trainer job (1 rank) and an inference job (2 ranks), started as two torchrun
  commands, meeting at a ``tcp://`` address: ``SyncChannel.push``/``receive``, whole tensors;
- ``two jobs, verify``: the same with a checksum per bucket;
- ``two jobs, TP 2``: the inference job keeps the decoder spec's TP 2 slices: each rank
  receives only its slices (the trainer scatters);
- ``two jobs, TP 2 by broadcast``: the alternative: every rank receives whole tensors and cuts
  its slices locally (what the trainer-scatters choice is measured against).

Seconds are the trainer's (a push ends when every receiver has its update), or for the one-job
broadcasts the slowest rank's, median of ``--repeats`` after one warm-up. Bytes are each
inference rank's received bytes. Results: benchmarks/results/sync.{json,md}.
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_job(args: argparse.Namespace) -> None:
    """3 ranks of one job: flat, per-tensor and WeightSync."""
    import torch.distributed as dist

    from distload.cli.sync_demo import demo_state
    from distload.workers.group import WorkerGroup
    from distload.live.sync import WeightSync

    with WorkerGroup(device="cpu") as group:
        state = demo_state(args.size_mib, 1 if group.rank == 0 else 0, group.device, args.hidden)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        sync = WeightSync([0], group=group, bucket_bytes=args.bucket_mib * 2**20)
        flat = torch.empty(nbytes, dtype=torch.uint8)
        times: dict[str, list[float]] = {"flat": [], "per-tensor": [], "one job": []}
        for _ in range(args.repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            dist.broadcast(flat, src=0)
            times["flat"].append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            for tensor in state.values():
                dist.broadcast(tensor, src=0)
            times["per-tensor"].append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            if group.rank == 0:
                sync.push(state, 1)
            else:
                sync.receive(state)
            times["one job"].append(time.perf_counter() - start)
        sync.close()
        every = group.exchange(times)
        if group.rank == 0:
            slowest = {m: [max(r[m][i] for r in every) for i in range(1, args.repeats + 1)] for m in times}
            _write_part(args, "one_job", {"nbytes": nbytes, "num_tensors": len(state), "seconds": slowest})


def trainer(args: argparse.Namespace) -> None:
    from distload.cli.sync_demo import demo_state
    from distload.live.channel import SyncChannel

    state = demo_state(args.size_mib, 1, torch.device("cpu"), args.hidden)
    with SyncChannel(args.rendezvous, "trainer", rank=0, size=1, device="cpu", timeout_s=300,
                     bucket_bytes=args.bucket_mib * 2**20, verify=args.verify) as channel:
        seconds: dict[bool, list[float]] = {False: [], True: []}
        # With --interleave-verify, verified and plain pushes alternate in the same two jobs
        # (after one warm-up of each), so that the verify cost is not a difference between two
        # runs of a noisy machine.
        modes = [False, True] if args.interleave_verify else [args.verify]
        for version in range(len(modes) * (args.repeats + 1)):
            channel.verify = modes[version % len(modes)]
            seconds[channel.verify].append(channel.push(state, version).seconds)
    _write_part(args, f"{args.case}-trainer", {"seconds": seconds[args.verify][1:], "plain": seconds[False][1:],
                                               "verified": seconds[True][1:]})


def inference(args: argparse.Namespace) -> None:
    from distload.cli.sync_demo import demo_config, demo_state, kept_slices
    from distload.workers.group import WorkerGroup
    from distload.live.channel import SyncChannel

    with WorkerGroup(device="cpu") as group:
        tp = args.tensor_parallel_size
        whole = demo_state(args.size_mib, 0, group.device, args.hidden)
        slices = kept_slices(whole, tp, group.rank % tp, args.hidden)
        held = whole if args.locally else slices
        channel_tp = 1 if args.locally else tp
        with SyncChannel(args.rendezvous, "inference", rank=group.rank, size=group.world_size, device="cpu",
                         timeout_s=300, tensor_parallel_size=channel_tp,
                         sharding="decoder" if channel_tp > 1 else None,
                         model_config=demo_config(args.hidden) if channel_tp > 1 else None) as channel:
            received, seconds = [], []
            for _ in range((2 if args.interleave_verify else 1) * (args.repeats + 1)):
                start = time.perf_counter()
                stats = channel.receive(held)
                if args.locally:  # cut this rank's slices out of the whole tensors, into its own
                    for name, piece in kept_slices(held, tp, group.rank % tp, args.hidden).items():
                        slices[name].copy_(piece)
                seconds.append(time.perf_counter() - start)
                received.append(stats.wire_bytes)
        slice_bytes = sum(t.numel() * t.element_size() for t in slices.values())
        every = group.exchange({"received": received[1:], "slice_bytes": slice_bytes, "seconds": seconds[1:]})
        if group.rank == 0:
            _write_part(args, f"{args.case}-inference", {"ranks": every})


def _write_part(args: argparse.Namespace, name: str, value: dict) -> None:
    with open(os.path.join(args.scratch, f"{name}.json"), "w") as f:
        json.dump(value, f)


def _torchrun(nproc: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            os.path.abspath(__file__), *extra]


def _common(args: argparse.Namespace) -> list[str]:
    return ["--size-mib", str(args.size_mib), "--hidden", str(args.hidden), "--bucket-mib", str(args.bucket_mib), "--repeats",
            str(args.repeats), "--scratch", args.scratch]


def _two_jobs(args: argparse.Namespace, case: str, tp: int = 1, verify: bool = False, locally: bool = False,
              interleave_verify: bool = False) -> None:
    address = f"tcp://127.0.0.1:{_free_port()}"
    base = _common(args) + ["--rendezvous", address, "--case", case]
    inference_cmd = _torchrun(2, "--part", "inference", "--tensor-parallel-size", str(tp), *base,
                              *(["--locally"] if locally else []),
                              *(["--interleave-verify"] if interleave_verify else []))
    trainer_cmd = _torchrun(1, "--part", "trainer", *base, *(["--verify"] if verify else []),
                            *(["--interleave-verify"] if interleave_verify else []))
    jobs = [subprocess.Popen(inference_cmd), subprocess.Popen(trainer_cmd)]
    for job in jobs:
        if job.wait(timeout=1800) != 0:
            raise SystemExit(f"{case}: a job failed ({job.args})")


def _verify_cost(args: argparse.Namespace) -> tuple[dict, float]:
    """Plain and verified pushes interleaved in one pair of jobs: their rows and the cost."""
    _two_jobs(args, "two_jobs", interleave_verify=True)
    sent = json.load(open(os.path.join(args.scratch, "two_jobs-trainer.json")))
    plain, verified = statistics.median(sent["plain"]), statistics.median(sent["verified"])
    return {"two jobs": plain, "two jobs, verify": verified}, verified / plain - 1


def orchestrate(args: argparse.Namespace) -> None:
    os.makedirs(args.scratch, exist_ok=True)
    if args.only_verify:
        seconds, cost = _verify_cost(args)
        print(f"plain {seconds['two jobs']:.4f} s, verified {seconds['two jobs, verify']:.4f} s: "
              f"verify costs {cost * 100:.1f}% (median of {args.repeats} each, interleaved)", flush=True)
        return
    if subprocess.run(_torchrun(3, "--part", "one-job", *_common(args)), timeout=1800).returncode:
        raise SystemExit("the one-job part failed")
    seconds, verify_cost = _verify_cost(args)
    cases = [("two jobs, TP 2", {"tp": 2}), ("two jobs, TP 2 by broadcast", {"tp": 2, "locally": True})]
    for case, options in cases:
        _two_jobs(args, case.replace(" ", "_").replace(",", ""), **options)
    one = json.load(open(os.path.join(args.scratch, "one_job.json")))
    nbytes = one["nbytes"]
    rows = {}
    for method, times in one["seconds"].items():
        rows[method] = {"seconds": statistics.median(times), "received_per_rank": nbytes}
    got = json.load(open(os.path.join(args.scratch, "two_jobs-inference.json")))["ranks"]
    for case, value in seconds.items():
        rows[case] = {"seconds": value, "slice_bytes": max(r["slice_bytes"] for r in got),
                      "received_per_rank": max(max(r["received"]) for r in got) if "verify" in case else
                      max(min(r["received"]) for r in got)}
    for case, _ in cases:
        key = case.replace(" ", "_").replace(",", "")
        sent = json.load(open(os.path.join(args.scratch, f"{key}-trainer.json")))
        got = json.load(open(os.path.join(args.scratch, f"{key}-inference.json")))["ranks"]
        rows[case] = {"seconds": statistics.median(sent["seconds"]),
                      "received_per_rank": max(statistics.median(r["received"]) for r in got),
                      "slice_bytes": max(r["slice_bytes"] for r in got)}
        if "TP 2" in case:  # the receivers' own clock: the local cut happens after the push ends
            rows[case]["seconds"] = max(statistics.median(r["seconds"]) for r in got)
    flat = rows["flat"]["seconds"]
    for row in rows.values():
        row["gb_per_s"] = round(nbytes / 1e9 / row["seconds"], 3)
        row["vs_flat"] = round(flat / row["seconds"], 3)
        row["seconds"] = round(row["seconds"], 4)
        if "slice_bytes" in row:
            row["received_vs_slices"] = round(row["received_per_rank"] / row["slice_bytes"], 4)
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
           "backend": "gloo", "nbytes": nbytes, "num_tensors": one["num_tensors"], "bucket_mib": args.bucket_mib,
           "repeats": args.repeats, "results": rows, "verify_cost": round(verify_cost, 4),
           "two_jobs_vs_flat": rows["two jobs"]["vs_flat"]}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sync.json"), "w") as f:
        json.dump(out, f, indent=2)
    lines = [f"Weight sync on gloo, 1 trainer rank -> 2 inference ranks, {nbytes / 2**20:.0f} MiB in "
             f"{one['num_tensors']} bf16 tensors (sync-demo's Llama shape, hidden {args.hidden}), buckets of {args.bucket_mib} MiB, "
             f"median of {args.repeats} after a warm-up; {os.cpu_count()} CPUs, torch {torch.__version__}, "
             f"{platform.platform()}.", "",
             "| method | seconds | GB/s (whole state) | vs flat | bytes received per inference rank | vs its slices |",
             "|---|---|---|---|---|---|"]
    for method, r in rows.items():
        ratio = r.get("received_vs_slices", "")
        lines.append(f"| {method} | {r['seconds']} | {r['gb_per_s']} | {r['vs_flat']} | "
                     f"{r['received_per_rank'] / 2**20:.1f} MiB | {ratio} |")
    lines += ["", f"Across two jobs vs the flat broadcast inside one: {rows['two jobs']['vs_flat']}x; "
                  f"verify costs {verify_cost * 100:.1f}% (plain and verified pushes interleaved in the same two "
                  f"jobs, median of {args.repeats} each)."]
    with open(os.path.join(args.out, "sync.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=560, help="approximate state size (560: just over 512 MiB at hidden 2048)")
    parser.add_argument("--hidden", type=int, default=2048,
                        help="hidden size: 2048 gives real models' tens-of-MiB tensors, 512 many small ones")
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--scratch", default=f"/tmp/distload-bench-sync-{os.getpid()}")
    parser.add_argument("--part", choices=("one-job", "trainer", "inference"), help=argparse.SUPPRESS)
    parser.add_argument("--rendezvous", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--locally", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--interleave-verify", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--only-verify", action="store_true",
                        help="run only the verified and plain two-job pushes, interleaved (the verify cost)")
    args = parser.parse_args()
    parts = {"one-job": one_job, "trainer": trainer, "inference": inference}
    if args.part:
        parts[args.part](args)
    else:
        orchestrate(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
