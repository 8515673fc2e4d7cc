"""Weight sync: distload's channel inside one job and across two jobs, against a flat broadcast.

    python benchmarks/bench_sync.py                      # ~530 MiB Llama-shaped bf16, 3 repeats
    python benchmarks/bench_sync.py --size-mib 128 --repeats 2

In ONE run, over the same many-tensor Llama-shaped bf16 state (sync-demo's model), a trainer
rank sends to two inference ranks on gloo:

- ``flat``: one torchrun job of 3 ranks, one broadcast of all bytes already packed in one
  buffer (the transport's ceiling);
- ``per-tensor``: the same job, one broadcast per tensor (the naive way);
- ``one job``: the same job, ``WeightSync.push``/``receive`` (its ranks share this host: its pairs
  hand off through shared memory, the default);
- ``two jobs``: a trainer job (1 rank) and an inference job (2 ranks), started as two torchrun
  commands, meeting at a ``tcp://`` address: ``SyncChannel.push``/``receive``, whole tensors;
- ``two jobs, verify``: the same with a checksum per bucket;
- ``two jobs, TP 2``: the inference job keeps the decoder spec's TP 2 slices: each rank
  receives only its slices (the trainer scatters);
- ``two jobs, TP 2 by broadcast``: the alternative: every rank receives whole tensors and cuts
  its slices locally (what the trainer-scatters choice is measured against);
- ``same host: shm`` / ``same host: socket`` (and ``, verify``): another pair of jobs holding two
  channels, one handing off through shared memory (the default for a same-host pair,
  distload/live/handoff.py), one forced onto the socket (``transport="socket"``), pushes of the
  same state alternating between them; every receive checked bit-exact against the trainer's
  state. The ``two jobs`` rows above are forced onto the socket too (the path across hosts).

Seconds are the trainer's (a push ends when every receiver has its update), or for the one-job
broadcasts the slowest rank's, median of ``--repeats`` after one warm-up. Bytes are each
inference rank's received bytes. Results: benchmarks/results/sync.{json,md}. These are full
pushes (``delta=False``; ``verify`` as each case says).

    python benchmarks/bench_sync.py --choice --size-mib 256 --hidden 512   # delta channel vs full, by change

pushes sync-demo's state with every element, half, 4% and 0.1% of them changed through the
default (delta) channel and a full one, alternating: the delta channel's time and bytes against
the full push's (benchmarks/results/sync_choice.{json,md}).

    python benchmarks/bench_sync.py --deltas             # delta updates of real optimizer steps

measures delta updates (distload/live/delta.py) on a transformers Llama's AdamW steps: the
encodings, then full and delta pushes of the same steps in the same jobs, whole and TP 2
(needs ``transformers`` and ``zstandard``: the ``bench`` extra). Results:
benchmarks/results/sync_delta.{json,md}.
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
from typing import Any

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
        sync = WeightSync([0], group=group, bucket_bytes=args.bucket_mib * 2**20, verify=False, delta=False)
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
    if args.case == "same_host":
        return same_host_trainer(args, state)
    with SyncChannel(args.rendezvous, "trainer", rank=0, size=1, device="cpu", timeout_s=300,
                     bucket_bytes=args.bucket_mib * 2**20, verify=args.verify, delta=False,
                     transport="socket") as channel:
        seconds: dict[Any, list[float]] = {False: [], True: [], UNKEYED: []}
        # With --interleave-verify, verified and plain pushes alternate in the same two jobs
        # (after one warm-up of each), so that the verify cost is not a difference between two
        # runs of a noisy machine; with --tags, verified pushes with the unkeyed sums too.
        modes = _modes(args) or [args.verify]
        for version in range(len(modes) * (args.repeats + 1)):
            mode = modes[version % len(modes)]
            channel.verify = bool(mode)
            _use_sums(mode)
            seconds[mode].append(channel.push(state, version).seconds)
    _write_part(args, f"{args.case}-trainer", {"seconds": seconds[args.verify][1:], "plain": seconds[False][1:],
                                               "verified": seconds[True][1:], "unkeyed": seconds[UNKEYED][1:]})


UNKEYED = "unkeyed"  # a verified push checked with the sums buckets had before they were keyed


def _modes(args: argparse.Namespace) -> list[Any]:
    """Each round's pushes, in order: plain (False), verified (True), verified unkeyed."""
    if args.tags:
        return [False, True, UNKEYED]
    return [False, True] if args.interleave_verify else []


def _unkeyed_sums(data: torch.Tensor, key: Any = None, extra: bytes = b"") -> torch.Tensor:
    """The bucket check before it was keyed with the job secret (the baseline of --tags): two
    int64 words, the wrapping sum of the 8-byte words and of the 4 KiB row sums weighted by their
    position, in numpy. A check against transport faults, not against an adversary."""
    import numpy as np

    from distload.tensor_io import host_view

    raw = np.frombuffer(host_view(data), dtype=np.uint8)
    words = raw.size // 8
    whole_rows = words // 512
    view = raw[:words * 8].view(np.int64)
    rows = view[:whole_rows * 512].reshape(whole_rows, 512).sum(axis=1)
    tail = int(view[whole_rows * 512:].sum()) + int(raw[words * 8:].sum(dtype=np.int64))
    plain = int(rows.sum()) + tail
    weighted = int(np.dot(rows, np.arange(1, whole_rows + 1, dtype=np.int64))) + tail * (whole_rows + 1)
    wrap = [(v + (1 << 63)) % (1 << 64) - (1 << 63) for v in (plain, weighted)]
    return torch.tensor(wrap, dtype=torch.int64)


def _use_sums(mode: Any) -> None:
    """Check this push's buckets with the keyed tags (the code's) or, for UNKEYED, the old sums:
    both sides switch alike, push by push."""
    import distload.live.channel as channel_module
    from distload.live.transfer import checksum

    channel_module.checksum = _unkeyed_sums if mode == UNKEYED else checksum


def inference(args: argparse.Namespace) -> None:
    from distload.cli.sync_demo import demo_config, demo_state, kept_slices
    from distload.workers.group import WorkerGroup
    from distload.live.channel import SyncChannel

    with WorkerGroup(device="cpu") as group:
        if args.case == "same_host":
            return same_host_inference(args, group)
        tp = args.tensor_parallel_size
        whole = demo_state(args.size_mib, 0, group.device, args.hidden)
        slices = kept_slices(whole, tp, group.rank % tp, args.hidden)
        held = whole if args.locally else slices
        channel_tp = 1 if args.locally else tp
        with SyncChannel(args.rendezvous, "inference", rank=group.rank, size=group.world_size, device="cpu",
                         timeout_s=300, tensor_parallel_size=channel_tp, verify=False, transport="socket",
                         sharding="decoder" if channel_tp > 1 else None,
                         model_config=demo_config(args.hidden) if channel_tp > 1 else None) as channel:
            received, seconds = [], []
            modes = _modes(args)
            for number in range(max(1, len(modes)) * (args.repeats + 1)):
                if modes:
                    _use_sums(modes[number % len(modes)])
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


# One round: (path, verify, the receivers' rollback). Rollback (receive's default for a dict) costs
# each receiver a copy of the old bytes, on either path: without it is what the paths themselves cost.
SAME_HOST_MODES = [(path, verify, rollback) for verify, rollback in ((False, True), (True, True), (False, False))
                   for path in ("shm", "socket")]


def _mode(path: str, verify: bool, rollback: bool) -> str:
    return path + (", verify" if verify else "") + ("" if rollback else ", no rollback")


def same_host_trainer(args: argparse.Namespace, state: dict) -> None:
    """Two channels in these jobs, one per path; each round pushes the same state over each, plain
    and verified, alternating (after one warm-up round), so both paths see the same machine."""
    from distload.live.channel import SyncChannel

    shm_address, socket_address = args.rendezvous.split(",")
    options = {"rank": 0, "size": 1, "device": "cpu", "timeout_s": 300, "bucket_bytes": args.bucket_mib * 2**20,
               "delta": False}
    seconds: dict[str, list[float]] = {}
    with SyncChannel(shm_address, "trainer", **options) as shm, \
            SyncChannel(socket_address, "trainer", transport="socket", **options) as sock:
        channels = {"shm": shm, "socket": sock}
        for version in range(args.repeats + 1):
            for number, (path, verify, rollback) in enumerate(SAME_HOST_MODES):
                channels[path].verify = verify
                _ready(args, version * len(SAME_HOST_MODES) + number)  # the receivers' checks are not timed
                stats = channels[path].push(state, version)
                assert stats.transport == path, (path, stats.transport)
                if version:
                    seconds.setdefault(_mode(path, verify, rollback), []).append(stats.seconds)
    _write_part(args, "same_host-trainer", {"seconds": seconds})


def same_host_inference(args: argparse.Namespace, group) -> None:
    from distload.cli.sync_demo import demo_state
    from distload.live.channel import SyncChannel

    shm_address, socket_address = args.rendezvous.split(",")
    held = demo_state(args.size_mib, 0, group.device, args.hidden)
    want = demo_state(args.size_mib, 1, group.device, args.hidden)
    options = {"rank": group.rank, "size": group.world_size, "device": "cpu", "timeout_s": 300, "verify": False}
    exact, transports = [], set()
    with SyncChannel(shm_address, "inference", **options) as shm, \
            SyncChannel(socket_address, "inference", transport="socket", **options) as sock:
        channels = {"shm": shm, "socket": sock}
        for version in range(args.repeats + 1):
            for number, (path, _verify, rollback) in enumerate(SAME_HOST_MODES):
                for tensor in held.values():  # not the last push's bytes: this push must write every one
                    tensor.view(torch.uint8).view(-1)[::4096] ^= 0xFF
                _ready(args, version * len(SAME_HOST_MODES) + number, group.rank)
                stats = channels[path].receive(held, rollback=rollback)
                transports.add(stats.transport)
                exact.append(all(torch.equal(held[n].view(torch.uint8), t.view(torch.uint8)) for n, t in want.items()))
    every = group.exchange({"exact": all(exact), "transports": sorted(transports)})
    if group.rank == 0:
        _write_part(args, "same_host-inference", {"ranks": every})


def _same_host(args: argparse.Namespace) -> dict[str, float]:
    """The same-host rows: shm and socket pushes alternating in one pair of jobs, every receive exact."""
    addresses = f"tcp://127.0.0.1:{_free_port()},tcp://127.0.0.1:{_free_port()}"
    base = _common(args) + ["--rendezvous", addresses, "--case", "same_host"]
    jobs = [subprocess.Popen(_torchrun(2, "--part", "inference", *base)),
            subprocess.Popen(_torchrun(1, "--part", "trainer", *base))]
    for job in jobs:
        if job.wait(timeout=1800) != 0:
            raise SystemExit(f"same host: a job failed ({job.args})")
    got = json.load(open(os.path.join(args.scratch, "same_host-inference.json")))["ranks"]
    if not all(r["exact"] for r in got) or any(r["transports"] != ["shm", "socket"] for r in got):
        raise SystemExit(f"same host: a receiver was not exact, or a path not the one asked for: {got}")
    sent = json.load(open(os.path.join(args.scratch, "same_host-trainer.json")))["seconds"]
    return {f"same host: {mode}": statistics.median(times) for mode, times in sent.items()}


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
    base = _common(args) + ["--rendezvous", address, "--case", case] + (["--tags"] if args.tags else [])
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


def tag_cost(args: argparse.Namespace) -> None:
    """Plain pushes, verified ones with the keyed tags and verified ones with the old unkeyed sums,
    interleaved in one pair of jobs (1 trainer -> 2 inference ranks, the socket path):
    results/sync_tags.{json,md}."""
    load_before = os.getloadavg()[0]
    _two_jobs(args, "two_jobs")
    sent = json.load(open(os.path.join(args.scratch, "two_jobs-trainer.json")))
    load_after = os.getloadavg()[0]
    median = {k: statistics.median(sent[k]) for k in ("plain", "verified", "unkeyed")}
    keyed_cost = median["verified"] / median["unkeyed"] - 1
    result = {"machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}, {platform.platform()}", "size_mib": args.size_mib, "bucket_mib": args.bucket_mib, "repeats": args.repeats,
              "load_average": [load_before, load_after], "seconds": sent, "median": median,
              "keyed_vs_unkeyed": keyed_cost}
    with open(os.path.join(args.out, "sync_tags.json"), "w") as f:
        json.dump(result, f, indent=2)
    lines = [f"Bucket checks keyed with the job secret (NH + HMAC-SHA256, transfer.checksum) against the unkeyed "
             f"sums they replaced: 1 trainer rank -> 2 inference ranks, two jobs on the socket path, "
             f"{args.size_mib} MiB bf16 (sync-demo's Llama shape), buckets of {args.bucket_mib} MiB; plain, keyed and "
             f"unkeyed pushes interleaved in the same jobs, median of {args.repeats} each after a warm-up; "
             f"{result['machine']}; load average {load_before:.2f} before, {load_after:.2f} after.", "",
             "| push | seconds (median) | vs unkeyed verified |", "|---|---|---|"]
    for label, key in (("plain (no check)", "plain"), ("verified, unkeyed sums (before)", "unkeyed"),
                       ("verified, keyed tags (now)", "verified")):
        lines.append(f"| {label} | {median[key]:.4f} | {median[key] / median['unkeyed']:.3f} |")
    lines += ["", f"The keyed tags cost {keyed_cost * 100:+.1f}% of a verified push against the unkeyed sums "
                  f"(every push: {', '.join(f'{k} ' + ' '.join(f'{x:.3f}' for x in v) for k, v in sent.items() if k != 'seconds')})."]
    with open(os.path.join(args.out, "sync_tags.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def orchestrate(args: argparse.Namespace) -> None:
    os.makedirs(args.scratch, exist_ok=True)
    if args.tags:
        return tag_cost(args)
    if args.only_verify:
        seconds, cost = _verify_cost(args)
        print(f"plain {seconds['two jobs']:.4f} s, verified {seconds['two jobs, verify']:.4f} s: "
              f"verify costs {cost * 100:.1f}% (median of {args.repeats} each, interleaved)", flush=True)
        return
    if subprocess.run(_torchrun(3, "--part", "one-job", *_common(args)), timeout=1800).returncode:
        raise SystemExit("the one-job part failed")
    load_before = os.getloadavg()
    seconds, verify_cost = _verify_cost(args)
    same_host = _same_host(args)
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
    for case, value in same_host.items():
        rows[case] = {"seconds": value, "received_per_rank": nbytes}
    flat = rows["flat"]["seconds"]
    for row in rows.values():
        row["gb_per_s"] = round(nbytes / 1e9 / row["seconds"], 3)
        row["vs_flat"] = round(flat / row["seconds"], 3)
        row["seconds"] = round(row["seconds"], 4)
        if "slice_bytes" in row:
            row["received_vs_slices"] = round(row["received_per_rank"] / row["slice_bytes"], 4)
    load = [round(x, 2) for x in load_before + os.getloadavg()]
    handoff_ratio = {mode: round(same_host[f"same host: socket{mode}"] / same_host[f"same host: shm{mode}"], 3)
                     for mode in ("", ", verify", ", no rollback")}
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                       "load_average_before_after": load},
           "backend": "gloo", "nbytes": nbytes, "num_tensors": one["num_tensors"], "bucket_mib": args.bucket_mib,
           "repeats": args.repeats, "results": rows, "verify_cost": round(verify_cost, 4),
           "two_jobs_vs_flat": rows["two jobs"]["vs_flat"],
           "same_host_shm_speedup": {"plain": handoff_ratio[""], "verify": handoff_ratio[", verify"],
                                     "no rollback": handoff_ratio[", no rollback"]}}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sync.json"), "w") as f:
        json.dump(out, f, indent=2)
    lines = [f"Weight sync on gloo, 1 trainer rank -> 2 inference ranks, {nbytes / 2**20:.0f} MiB in "
             f"{one['num_tensors']} bf16 tensors (sync-demo's Llama shape, hidden {args.hidden}), buckets of {args.bucket_mib} MiB, "
             f"median of {args.repeats} after a warm-up; {os.cpu_count()} CPUs, torch {torch.__version__}, "
             f"{platform.platform()}; load average {load[0]} before, {load[3]} after (1-minute; the machine is "
             f"shared with other work).", "",
             "| method | seconds | GB/s (whole state) | vs flat | bytes received per inference rank | vs its slices |",
             "|---|---|---|---|---|---|"]
    for method, r in rows.items():
        ratio = r.get("received_vs_slices", "")
        lines.append(f"| {method} | {r['seconds']} | {r['gb_per_s']} | {r['vs_flat']} | "
                     f"{r['received_per_rank'] / 2**20:.1f} MiB | {ratio} |")
    lines += ["", f"Across two jobs vs the flat broadcast inside one: {rows['two jobs']['vs_flat']}x; "
                  f"verify costs {verify_cost * 100:.1f}% (plain and verified pushes interleaved in the same two "
                  f"jobs, median of {args.repeats} each).",
              "", f"Same host, shared memory against the socket in the same jobs (pushes alternating, every receive "
                  f"bit-exact): {handoff_ratio['']}x as fast plain, {handoff_ratio[', verify']}x verified, "
                  f"{handoff_ratio[', no rollback']}x with the receivers' rollback off (`receive(rollback=False)`: no "
                  f"copy of the old bytes, which costs each receiver a copy of the state on either path). The "
                  f"`two jobs` rows take the socket (forced), as across hosts; `one job` (WeightSync) hands off "
                  f"through shared memory, its default on one host."]
    with open(os.path.join(args.out, "sync.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


# -- delta updates (--deltas): real optimizer steps -------------------------------------------------
# A small Llama from transformers (fp32 master weights), AdamW steps at several learning rates from
# one initialisation, each version cast to bf16 (what an inference engine serves). In one run:
# the encodings measured on every step, then the channel's pushes of the same steps across two
# jobs (1 trainer rank -> 2 inference ranks, whole and TP 2): full push (verify off, on) and delta
# push, each against the other in the same jobs. Results: benchmarks/results/sync_delta.{json,md}.

LLAMA = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
         "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32000, "tie_word_embeddings": False}
LRS = (1e-6, 1e-5)
STEPS = 3  # per learning rate, from the same initialisation
if os.environ.get("BENCH_SYNC_TINY"):  # a quick check of the script itself, not a measurement
    LLAMA.update(hidden_size=128, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=1000)
_ENCODINGS = ("chunked uint16 + flips", "int32 positions + values", "bitmask + values", "XOR + zstd-1",
              "XOR + zstd-3")


def _versions(scratch: str) -> list[str]:
    """Train and save every version (v0, then each learning rate's steps); their file names."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    names = _versions_names()
    if all(os.path.exists(os.path.join(scratch, f"{n}.safetensors")) for n in names):
        return names
    torch.manual_seed(0)
    init = LlamaForCausalLM(LlamaConfig(**LLAMA)).state_dict()
    save_file({n: t.to(torch.bfloat16).contiguous() for n, t in init.items()}, os.path.join(scratch, "v0.safetensors"))
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, LLAMA["vocab_size"], (2, 64), generator=gen) for _ in range(STEPS)]
    for lr in LRS:
        model = LlamaForCausalLM(LlamaConfig(**LLAMA))
        model.load_state_dict(init)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        for k, batch in enumerate(batches, start=1):
            optimizer.zero_grad()
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            save_file({n: t.detach().to(torch.bfloat16).contiguous() for n, t in model.state_dict().items()},
                      os.path.join(scratch, f"lr{lr:g}-step{k}.safetensors"))
    return names


def _load(scratch: str, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(scratch, f"{name}.safetensors"))


def _transitions(names: list[str]) -> list[tuple[str, str]]:
    """(from, to) of each measured step: each learning rate's steps from v0."""
    out = []
    for lr in LRS:
        chain = ["v0"] + [f"lr{lr:g}-step{k}" for k in range(1, STEPS + 1)]
        out += list(zip(chain, chain[1:]))
    return out


def encodings(args: argparse.Namespace) -> dict:
    """Every measured encoding's bytes and encode seconds on every step, in this process."""
    import zstandard

    from distload.live import delta as deltas

    rows = {}
    for old_name, new_name in _transitions(_versions(args.scratch)):
        old, new = _load(args.scratch, old_name), _load(args.scratch, new_name)
        total = sum(t.numel() * t.element_size() for t in new.values())
        numel = sum(t.numel() for t in new.values())
        sizes = dict.fromkeys(_ENCODINGS, 0)
        seconds = dict.fromkeys(_ENCODINGS + ("compare",), 0.0)
        changed = 0
        for name, tensor in new.items():
            start = time.perf_counter()
            patch = deltas.diff(tensor, old[name])
            seconds["compare"] += time.perf_counter() - start
            k, n, size = patch.positions.numel(), tensor.numel(), tensor.element_size()
            changed += k
            start = time.perf_counter()
            encoded = deltas.encoded_size(n, k, size)
            if k and deltas.pays(n, k, size):
                deltas.encode(torch.empty(encoded, dtype=torch.uint8), n, patch)
            seconds["chunked uint16 + flips"] += time.perf_counter() - start
            sizes["chunked uint16 + flips"] += min(encoded, n * size)
            sizes["int32 positions + values"] += min(k * (4 + size), n * size)
            sizes["bitmask + values"] += min(-(-n // 8) + k * size, n * size) if k else 0
            xor = (deltas.flat_ints(tensor) ^ deltas.flat_ints(old[name])).numpy().tobytes()
            for level in (1, 3):
                start = time.perf_counter()
                out = zstandard.ZstdCompressor(level=level).compress(xor)
                seconds[f"XOR + zstd-{level}"] += time.perf_counter() - start
                sizes[f"XOR + zstd-{level}"] += min(len(out), n * size)
        rows[new_name] = {"from": old_name, "changed_fraction": round(changed / numel, 5), "state_bytes": total,
                          "bytes_vs_state": {e: round(b / total, 5) for e, b in sizes.items()},
                          "vs_changed_fraction": {e: round(b / total / (changed / numel), 3) for e, b in sizes.items()},
                          "encode_seconds": {e: round(v, 4) for e, v in seconds.items()}}
        print(new_name, rows[new_name], flush=True)
    return rows


def _timed_checks() -> dict[str, float]:
    """Wrap the delta checks (patch sums, audits, data checksums) and the trainer's compare to
    add up their seconds."""
    from distload.live import delta as deltas

    spent = {"checks": 0.0, "compare": 0.0, "apply": 0.0}
    time_stages(deltas, {"patch_sum": "checks", "sent_audit": "checks", "held_audit": "checks",
                         "checksum": "checks", "diff": "compare", "decode": "apply", "apply": "apply"},
                spent, time.perf_counter)
    return spent


def time_stages(module, stages: dict, spent: dict, clock) -> None:
    """Wrap each function ``module`` has of ``stages`` (name -> what it counts as) so that its
    ``clock`` seconds add up in ``spent[what]``; a name ``module`` lacks is left out."""
    for fn, what in stages.items():
        real = getattr(module, fn, None)
        if real is None:
            continue

        def timed(*a, _real=real, _what=what, **k):
            start = clock()
            try:
                return _real(*a, **k)
            finally:
                spent[_what] += clock() - start
        setattr(module, fn, timed)


def _scan_seconds(state: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> float:
    """Seconds of the least a delta's trainer must do: read the state and its base once (the
    8-byte word compare of delta.py, without looking into any difference)."""
    import numpy as np

    from distload.live import delta as deltas

    start = time.perf_counter()
    for name, tensor in state.items():
        a, b = deltas.host_ints(tensor), deltas.host_ints(base[name])
        words = a.size * a.itemsize // 8
        mask = np.empty(min(words, deltas._SCAN), dtype=bool)
        a64, b64 = a[:words * 8 // a.itemsize].view(np.int64), b[:words * 8 // a.itemsize].view(np.int64)
        for at in range(0, words, deltas._SCAN):
            np.not_equal(a64[at:at + deltas._SCAN], b64[at:at + deltas._SCAN], out=mask[:min(deltas._SCAN, words - at)])
    return time.perf_counter() - start


def _ready(args: argparse.Namespace, number: int, rank: int | None = None) -> None:
    """Inference ranks say they are ready for schedule entry ``number`` (their checks of the
    previous one done); the trainer (``rank`` None) waits for both, so no push's time includes them."""
    if rank is not None:
        open(os.path.join(args.scratch, f"ready-{args.case}-{number}-{rank}"), "w").close()
        return
    while not all(os.path.exists(os.path.join(args.scratch, f"ready-{args.case}-{number}-{r}")) for r in (0, 1)):
        time.sleep(0.01)


def _schedule() -> list[tuple[str, bool]]:
    """(version to push, measured): each step pushed 3 times, its previous version between."""
    out = [("v0", False)]
    for old, new in _transitions(_versions_names()):
        if out[-1][0] != old:
            out.append((old, False))
        out += [(new, True), (old, False), (new, True), (old, False), (new, True)]
    return out


def _versions_names() -> list[str]:
    return ["v0"] + [f"lr{lr:g}-step{k}" for lr in LRS for k in range(1, STEPS + 1)]


def delta_trainer(args: argparse.Namespace) -> None:
    from distload.live.channel import SyncChannel

    spent = _timed_checks()
    delta_address, full_address = args.rendezvous.split(",")
    rows = []
    with SyncChannel(delta_address, "trainer", rank=0, size=1, device="cpu", timeout_s=600,
                     bucket_bytes=args.bucket_mib * 2**20) as delta, \
            SyncChannel(full_address, "trainer", rank=0, size=1, device="cpu", timeout_s=600,
                        bucket_bytes=args.bucket_mib * 2**20, delta=False) as full:
        for number, (name, measured) in enumerate(_schedule()):
            state = _load(args.scratch, name)
            _ready(args, number)
            row = {"version": name, "measured": measured}
            for verify in (False, True):
                full.verify = verify
                stats = full.push(state, number)
                row[f"full, verify {'on' if verify else 'off'}"] = [stats.seconds, stats.wire_bytes]
            spent["checks"] = spent["compare"] = 0.0
            stats = delta.push(state, number)
            delta._base.settle()  # its commit (written after push returns) not under the next full pushes
            row["delta"] = [stats.seconds, stats.wire_bytes, stats.delta]
            row["delta checks"], row["delta compare"] = spent["checks"], spent["compare"]
            row["scan"] = _scan_seconds(state, delta._base.tensors)
            row["state_bytes"] = sum(t.numel() * t.element_size() for t in state.values())
            row["base_bytes"] = delta._base.nbytes
            rows.append(row)
    _write_part(args, f"{args.case}-trainer", {"rows": rows})


def delta_inference(args: argparse.Namespace) -> None:
    from distload.live.channel import SyncChannel
    from distload.tp.slices import take_shard
    from distload.tp.spec import load_spec
    from distload.workers.group import WorkerGroup

    spent = _timed_checks()
    tp = args.tensor_parallel_size
    delta_address, full_address = args.rendezvous.split(",")
    whole = _load(args.scratch, "v0")
    with WorkerGroup(device="cpu") as group:
        spec = load_spec("decoder", LLAMA) if tp > 1 else None

        def held() -> dict[str, torch.Tensor]:
            if tp == 1:
                return {n: torch.zeros_like(t) for n, t in whole.items()}
            return {n: torch.zeros_like(take_shard(t, spec.action(n, tuple(t.shape)), group.rank % tp, tp, n))
                    .contiguous() for n, t in whole.items()}

        into_delta, into_full = held(), held()
        options = {"rank": group.rank, "size": group.world_size, "device": "cpu", "timeout_s": 600,
                   "tensor_parallel_size": tp, "sharding": "decoder" if tp > 1 else None,
                   "model_config": LLAMA if tp > 1 else None, "verify": False}
        rows = []
        with SyncChannel(delta_address, "inference", **options) as delta, \
                SyncChannel(full_address, "inference", **options) as full:
            for number, _ in enumerate(_schedule()):
                _ready(args, number, group.rank)
                row = {}
                for verify in (False, True):
                    stats = full.receive(into_full)
                    row[f"full, verify {'on' if verify else 'off'}"] = [stats.seconds, stats.wire_bytes]
                spent["checks"] = spent["apply"] = 0.0
                stats = delta.receive(into_delta)
                row["delta"] = [stats.seconds, stats.wire_bytes, stats.delta]
                row["delta checks"], row["delta apply"] = spent["checks"], spent["apply"]
                row["identical"] = all(torch.equal(into_delta[n].view(torch.int16), into_full[n].view(torch.int16))
                                       for n in into_full)
                rows.append(row)
        every = group.exchange(rows)
        if group.rank == 0:
            _write_part(args, f"{args.case}-inference", {"ranks": every})


def orchestrate_deltas(args: argparse.Namespace) -> None:
    os.makedirs(args.scratch, exist_ok=True)
    names = _versions(args.scratch)
    assert names == _versions_names()
    for stale in os.listdir(args.scratch):  # an earlier run's readiness marks
        if stale.startswith("ready-"):
            os.remove(os.path.join(args.scratch, stale))
    load_before = os.getloadavg()
    encoded = encodings(args)
    cases = {}
    for case, tp in (("whole", 1), ("TP 2", 2)):
        key = case.replace(" ", "")
        addresses = f"tcp://127.0.0.1:{_free_port()},tcp://127.0.0.1:{_free_port()}"
        base = ["--bucket-mib", str(args.bucket_mib), "--scratch", args.scratch, "--rendezvous", addresses,
                "--case", key]
        jobs = [subprocess.Popen(_torchrun(2, "--part", "delta-inference", "--tensor-parallel-size", str(tp), *base)),
                subprocess.Popen(_torchrun(1, "--part", "delta-trainer", *base))]
        for job in jobs:
            if job.wait(timeout=3600) != 0:
                raise SystemExit(f"deltas, {case}: a job failed ({job.args})")
        sent = json.load(open(os.path.join(args.scratch, f"{key}-trainer.json")))["rows"]
        got = json.load(open(os.path.join(args.scratch, f"{key}-inference.json")))["ranks"]
        assert all(row["identical"] for rank in got for row in rank), f"{case}: a delta receiver differs from full"
        steps = {}
        for i, row in enumerate(sent):
            if not row["measured"]:
                continue
            step = steps.setdefault(row["version"], {k: [] for k in ("full, verify off", "full, verify on", "delta",
                                                                        "checks", "compare", "wire_full", "wire_delta",
                                                                        "receiver_checks", "receiver_apply", "scan")})
            step["compare"].append(row["delta compare"])
            step["full, verify off"].append(row["full, verify off"][0])
            step["full, verify on"].append(row["full, verify on"][0])
            step["delta"].append(row["delta"][0])
            step["checks"].append(row["delta checks"])
            step["receiver_checks"].append(max(rank[i]["delta checks"] for rank in got))
            step["receiver_apply"].append(max(rank[i]["delta apply"] for rank in got))
            step["scan"].append(row["scan"])
            step["wire_full"] = row["full, verify off"][1]
            step["wire_delta"] = row["delta"][1]
            step["state_bytes"], step["base_bytes"] = row["state_bytes"], row["base_bytes"]
        table = {}
        for version, step in steps.items():
            full_s = statistics.median(step["full, verify off"])
            delta_s = statistics.median(step["delta"])
            table[version] = {
                "changed_fraction": encoded[version]["changed_fraction"],
                "full_seconds": round(full_s, 4), "full_verified_seconds": round(statistics.median(step["full, verify on"]), 4),
                "delta_seconds": round(delta_s, 4), "delta_vs_full_seconds": round(delta_s / full_s, 3),
                "wire_full": step["wire_full"], "wire_delta": step["wire_delta"],
                "delta_vs_full_bytes": round(step["wire_delta"] / step["wire_full"], 4),
                "trainer_check_share": round(statistics.median(step["checks"]) / delta_s, 4),
                "trainer_compare_share": round(statistics.median(step["compare"]) / delta_s, 4),
                "receiver_check_share": round(statistics.median(step["receiver_checks"]) / delta_s, 4),
                "verify_cost_full": round(statistics.median(step["full, verify on"]) / full_s - 1, 4),
                "receiver_apply_share": round(statistics.median(step["receiver_apply"]) / delta_s, 4),
                "scan_seconds": round(statistics.median(step["scan"]), 4),
                "scan_vs_full": round(statistics.median(step["scan"]) / full_s, 3),
                "state_bytes": step["state_bytes"], "base_bytes": step["base_bytes"]}
        cases[case] = table
    load = [round(x, 2) for x in load_before + os.getloadavg()]
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                       "load_average_before_after": load},
           "model": LLAMA, "backend": "gloo", "bucket_mib": args.bucket_mib, "encodings": encoded, "pushes": cases}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sync_delta.json"), "w") as f:
        json.dump(out, f, indent=2)
    first = next(iter(encoded.values()))
    lines = [f"Delta updates of real optimizer steps: a transformers Llama (hidden {LLAMA['hidden_size']}, "
             f"{LLAMA['num_hidden_layers']} layers, vocabulary {LLAMA['vocab_size']}: "
             f"{first['state_bytes'] / 2**20:.0f} MiB in bf16), fp32 master weights, AdamW at learning rates "
             f"{', '.join(f'{lr:g}' for lr in LRS)}, {STEPS} steps each from one initialisation, every version cast "
             f"to bf16. gloo, 1 trainer rank -> 2 inference ranks (two jobs), buckets of {args.bucket_mib} MiB; "
             f"{os.cpu_count()} CPUs shared with other work (load average {load[0]} before, {load[3]} after: "
             f"every figure is noisy; ratios are of pushes interleaved in the same jobs), torch {torch.__version__}, "
             f"{platform.platform()}.", "",
             "Encodings (bytes on the wire / the state's bytes; each piece sent raw where its encoding would not "
             "be smaller; in brackets: / the changed fraction):", "",
             "| step | changed | " + " | ".join(_ENCODINGS) + " |", "|---|---|" + "---|" * len(_ENCODINGS)]
    for version, row in encoded.items():
        lines.append(f"| {version} | {row['changed_fraction']:.4f} | " + " | ".join(
            f"{row['bytes_vs_state'][e]:.4f} ({row['vs_changed_fraction'][e]:.2f}x)" for e in _ENCODINGS) + " |")
    lines += ["", "Encode seconds over the whole state, this process (compare: finding what changed, which the "
                  "first three share; the int32 and bitmask encodings were sized, not built):", "",
              "| step | compare | " + " | ".join(_ENCODINGS) + " |", "|---|---|" + "---|" * len(_ENCODINGS)]
    for version, row in encoded.items():
        lines.append(f"| {version} | {row['encode_seconds']['compare']} | " + " | ".join(
            str(row['encode_seconds'][e]) for e in _ENCODINGS) + " |")
    for case, table in cases.items():
        lines += ["", f"Pushes, {case} (median of 3 pushes of each step, each against a full push in the same jobs; "
                      f"bytes: what the trainer sent to both receivers):", "",
                  "| step | changed | full s | full+verify s | delta s | delta/full time | full bytes | delta bytes | "
                  "delta/full bytes | checks/delta time (trainer, receiver) | compare/delta time | receiver decode+apply/"
                  "delta time | scan floor s (/full) | full verify cost |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for version, r in table.items():
            lines.append(f"| {version} | {r['changed_fraction']:.4f} | {r['full_seconds']} | {r['full_verified_seconds']} | "
                         f"{r['delta_seconds']} | {r['delta_vs_full_seconds']} | {r['wire_full'] / 2**20:.1f} MiB | "
                         f"{r['wire_delta'] / 2**20:.1f} MiB | {r['delta_vs_full_bytes']} | "
                         f"{r['trainer_check_share'] * 100:.1f}%, {r['receiver_check_share'] * 100:.1f}% | "
                         f"{r['trainer_compare_share'] * 100:.1f}% | {r['receiver_apply_share'] * 100:.1f}% | "
                         f"{r['scan_seconds']} ({r['scan_vs_full']}x) | {r['verify_cost_full'] * 100:.1f}% |")
    base = next(iter(cases["whole"].values()))
    lines += ["", f"The trainer's host copy (the base): {base['base_bytes'] / 2**20:.0f} MiB for a "
                  f"{base['state_bytes'] / 2**20:.0f} MiB state. Every delta receiver ended bit-identical to the "
                  f"full push's receiver after every push."]
    with open(os.path.join(args.out, "sync_delta.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


# -- the delta channel's choice (--choice): never slower than a full push ------------------------
# sync-demo's state (--size-mib, hidden 512 by default: what its user measured) with a fraction
# of its elements changed between two versions, pushed back and forth by two channels of one
# trainer job to the same 2 inference ranks: the default (delta) channel and a full one
# (``delta=False``), alternating push by push, so that both see the machine alike. Every
# element changed, half, 4% (an AdamW step cast to bf16: sync_delta.md), 0.1%. Results:
# benchmarks/results/sync_choice.{json,md}.

CHANGED = (1.0, 0.5, 0.04, 0.001)  # the table's rows; measured from the last to the first: a
# tensor whose compare gave up rests some pushes (delta.MAX_REST), which would carry over into a
# row that follows with fewer changes (a fresh channel's rows would not: the steady state of each)


def choice_states(args: argparse.Namespace, fraction: float) -> tuple[dict, dict]:
    """Two versions of sync-demo's state: the second with the lowest bit of ``fraction`` of the
    elements flipped (1.0: every element), seeded, so every process makes the same two."""
    from distload.cli.sync_demo import demo_state

    first = demo_state(args.size_mib, 1, torch.device("cpu"), args.hidden)
    second = {}
    gen = torch.Generator().manual_seed(7)
    for name, tensor in first.items():
        bits = tensor.clone().view(torch.int16).reshape(-1)
        if fraction >= 1.0:
            bits ^= 1
        else:
            bits[torch.rand(bits.numel(), generator=gen) < fraction] ^= 1
        second[name] = bits.view(torch.bfloat16).reshape(tensor.shape)
    return first, second


def choice_trainer(args: argparse.Namespace) -> None:
    from distload.live.channel import SyncChannel

    delta_address, full_address = args.rendezvous.split(",")
    options = {"rank": 0, "size": 1, "device": "cpu", "timeout_s": 600, "bucket_bytes": args.bucket_mib * 2**20}
    rows = []
    number = 0
    with SyncChannel(delta_address, "trainer", **options) as delta, \
            SyncChannel(full_address, "trainer", delta=False, **options) as full:
        for fraction in reversed(CHANGED):
            states = choice_states(args, fraction)
            for k in range(2 * args.repeats + 2):  # two unmeasured: the first whole, then a warm-up
                state = states[k % 2]
                _ready(args, number)
                first, second = (full, delta) if k % 2 else (delta, full)  # who goes first alternates
                got = {}
                for channel in (first, second):
                    stats = channel.push(state, number)
                    channel._base.settle()  # its commit (written after push returns) not under the other
                    got["delta" if channel is delta else "full"] = stats
                rows.append({"fraction": fraction, "measured": k >= 2, "number": number,
                             "delta": [got["delta"].seconds, got["delta"].wire_bytes, got["delta"].delta,
                                       got["delta"].whole_bytes],
                             "full": [got["full"].seconds, got["full"].wire_bytes],
                             "state_bytes": sum(t.numel() * t.element_size() for t in state.values())})
                number += 1
    _write_part(args, "choice-trainer", {"rows": rows})


def choice_inference(args: argparse.Namespace) -> None:
    from distload.live.channel import SyncChannel
    from distload.workers.group import WorkerGroup

    delta_address, full_address = args.rendezvous.split(",")
    with WorkerGroup(device="cpu") as group:
        options = {"rank": group.rank, "size": group.world_size, "device": "cpu", "timeout_s": 600}
        rows = []
        number = 0
        with SyncChannel(delta_address, "inference", **options) as delta, \
                SyncChannel(full_address, "inference", **options) as full:
            into_delta = into_full = None
            for fraction in reversed(CHANGED):
                states = choice_states(args, fraction)
                if into_delta is None:
                    into_delta = {n: torch.zeros_like(t) for n, t in states[0].items()}
                    into_full = {n: torch.zeros_like(t) for n, t in states[0].items()}
                for k in range(2 * args.repeats + 2):
                    _ready(args, number, group.rank)
                    first, second = (full, delta) if k % 2 else (delta, full)
                    for channel in (first, second):
                        channel.receive(into_delta if channel is delta else into_full)
                    want = states[k % 2]
                    rows.append({"number": number, "identical": all(
                        torch.equal(into_delta[n].view(torch.int16), want[n].view(torch.int16))
                        and torch.equal(into_full[n].view(torch.int16), want[n].view(torch.int16)) for n in want)})
                    number += 1
        every = group.exchange(rows)
        if group.rank == 0:
            _write_part(args, "choice-inference", {"ranks": every})


def orchestrate_choice(args: argparse.Namespace) -> None:
    os.makedirs(args.scratch, exist_ok=True)
    for stale in os.listdir(args.scratch):
        if stale.startswith("ready-"):
            os.remove(os.path.join(args.scratch, stale))
    args.case = "choice"
    load_before = os.getloadavg()
    addresses = f"tcp://127.0.0.1:{_free_port()},tcp://127.0.0.1:{_free_port()}"
    base = _common(args) + ["--rendezvous", addresses, "--case", "choice"]
    jobs = [subprocess.Popen(_torchrun(2, "--part", "choice-inference", *base)),
            subprocess.Popen(_torchrun(1, "--part", "choice-trainer", *base))]
    for job in jobs:
        if job.wait(timeout=3600) != 0:
            raise SystemExit(f"choice: a job failed ({job.args})")
    load = [round(x, 2) for x in load_before + os.getloadavg()]
    sent = json.load(open(os.path.join(args.scratch, "choice-trainer.json")))["rows"]
    got = json.load(open(os.path.join(args.scratch, "choice-inference.json")))["ranks"]
    assert all(row["identical"] for rank in got for row in rank), "a receiver's tensors are not the version pushed"
    table = {}
    for fraction in CHANGED:
        rows = [r for r in sent if r["fraction"] == fraction and r["measured"]]
        delta_s = statistics.median(r["delta"][0] for r in rows)
        full_s = statistics.median(r["full"][0] for r in rows)
        ratios = [r["delta"][0] / r["full"][0] for r in rows]
        table[fraction] = {
            "full_seconds": round(full_s, 4), "delta_seconds": round(delta_s, 4),
            "delta_vs_full_seconds": round(delta_s / full_s, 3),
            "delta_vs_full_seconds_mean": round(sum(r["delta"][0] for r in rows) / sum(r["full"][0] for r in rows), 3),
            "delta_vs_full_seconds_each": [round(x, 3) for x in ratios],
            "full_bytes": rows[-1]["full"][1], "delta_bytes": rows[-1]["delta"][1],
            "delta_vs_full_bytes": round(rows[-1]["delta"][1] / rows[-1]["full"][1], 4),
            # a push that compared nothing went as a full update: every byte whole
            "sent_whole_fraction": round((rows[-1]["delta"][3] if rows[-1]["delta"][2] else rows[-1]["state_bytes"])
                                         / rows[-1]["state_bytes"], 4),
            "full_updates": sum(1 for r in rows if not r["delta"][2]),
            "a_delta_update": rows[-1]["delta"][2], "pushes": len(rows)}
    state_bytes = sent[0]["state_bytes"]
    out = {"machine": {"cpus": os.cpu_count(), "nproc": os.cpu_count(), "kernel": platform.release(),
                       "platform": platform.platform(), "torch": torch.__version__,
                       "load_average_before_after": load},
           "state_bytes": state_bytes, "size_mib": args.size_mib, "hidden": args.hidden,
           "bucket_mib": args.bucket_mib, "repeats": args.repeats, "backend": "gloo", "rows": table}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sync_choice.json"), "w") as f:
        json.dump(out, f, indent=2)
    lines = [f"The delta channel's choice: sync-demo's state ({state_bytes / 2**30:.3f} GiB of bf16, hidden "
             f"{args.hidden}), versions that differ in a fraction of the elements (the lowest bit flipped), pushed "
             f"by one trainer rank to 2 inference ranks of another job on this host (gloo; same-host hand-off, the "
             f"default), through the default channel (deltas) and a full one (`delta=False`), both verified (the "
             f"default), pushes alternating between them and which goes first; median of {args.repeats * 2} "
             f"pushes a row after one whole push and a warm-up. Machine: 2-core VM shared with other work "
             f"(`nproc` {os.cpu_count()}, `uname -r` {platform.release()}), load average {load[0]} before, "
             f"{load[3]} after (1-minute): every figure is noisy, the ratios are of pushes interleaved in the same "
             f"jobs. torch {torch.__version__}. Every receive bit-identical to the version pushed.", "",
             "| elements changed | full s | delta channel s | delta/full time (median) | (total) | full bytes | "
             "delta channel bytes | delta/full bytes | sent whole (of the state) | delta channel's pushes that "
             "went as full updates (every tensor resting) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for fraction, r in table.items():
        lines.append(f"| {fraction * 100:g}% | {r['full_seconds']} | {r['delta_seconds']} | "
                     f"{r['delta_vs_full_seconds']} | {r['delta_vs_full_seconds_mean']} | {r['full_bytes'] / 2**20:.1f} MiB | "
                     f"{r['delta_bytes'] / 2**20:.1f} MiB | {r['delta_vs_full_bytes']} | "
                     f"{r['sent_whole_fraction'] * 100:.0f}% | {r['full_updates']} of {r['pushes']} |")
    with open(os.path.join(args.out, "sync_choice.md"), "w") as f:
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
    parser.add_argument("--part", choices=("one-job", "trainer", "inference", "delta-trainer", "delta-inference",
                                           "choice-trainer", "choice-inference"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--deltas", action="store_true",
                        help="delta updates of a real model's optimizer steps: encodings, then full vs delta pushes")
    parser.add_argument("--choice", action="store_true",
                        help="the delta channel against a full one at 100%%, 50%%, 4%%, 0.1%% of the elements "
                             "changed (sync_choice.md; --size-mib 256 --hidden 512: sync-demo's state)")
    parser.add_argument("--rendezvous", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--locally", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--interleave-verify", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tags", action="store_true",
                        help="the keyed bucket tags' cost against the old unkeyed sums, interleaved (sync_tags.md)")
    parser.add_argument("--only-verify", action="store_true",
                        help="run only the verified and plain two-job pushes, interleaved (the verify cost)")
    args = parser.parse_args()
    parts = {"one-job": one_job, "trainer": trainer, "inference": inference, "delta-trainer": delta_trainer,
             "delta-inference": delta_inference, "choice-trainer": choice_trainer, "choice-inference": choice_inference}
    if args.part:
        parts[args.part](args)
    elif args.choice:
        orchestrate_choice(args)
    elif args.deltas:
        orchestrate_deltas(args)
    else:
        orchestrate(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
