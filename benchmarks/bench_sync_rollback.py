"""What a receiver's rollback costs: receives with and without it, interleaved in the same two jobs.

    python benchmarks/bench_sync_rollback.py                 # 256 MiB, 4 repeats of each
    python benchmarks/bench_sync_rollback.py --size-mib 512 --repeats 6

A trainer process and an inference process (plain processes, one rank each, gloo on the host)
meet at a ``tcp://`` address; the trainer pushes sync-demo's Llama-shaped bf16 state again and
again, the receiver takes the versions alternately with ``rollback=True`` (the default for a
dict: the old bytes of every tensor set aside first, every bucket through a buffer) and
``rollback=False`` (big tensors land straight in place), after one warm-up of each. Seconds are
the receiver's, median of ``--repeats`` each; the cost is their ratio. Results:
benchmarks/results/sync_rollback.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from bench_sync import _free_port  # noqa: E402 - the sync benchmark's helper, beside this file


def trainer(args: argparse.Namespace) -> None:
    from distload.cli.sync_demo import demo_state
    from distload.live.channel import SyncChannel

    state = demo_state(args.size_mib, 1, torch.device("cpu"))
    with SyncChannel(args.rendezvous, "trainer", rank=0, size=1, device="cpu", timeout_s=300,
                     bucket_bytes=args.bucket_mib * 2**20) as channel:
        for version in range(2 * (args.repeats + 1)):
            channel.push(state, version)


def inference(args: argparse.Namespace) -> None:
    from distload.cli.sync_demo import demo_state
    from distload.live.channel import SyncChannel

    held = demo_state(args.size_mib, 0, torch.device("cpu"))
    seconds: dict[bool, list[float]] = {True: [], False: []}
    with SyncChannel(args.rendezvous, "inference", rank=0, size=1, device="cpu", timeout_s=300) as channel:
        for i in range(2 * (args.repeats + 1)):
            rollback = i % 2 == 0
            start = time.perf_counter()
            channel.receive(held, rollback=rollback)
            seconds[rollback].append(time.perf_counter() - start)
    nbytes = sum(t.numel() * t.element_size() for t in held.values())
    with open(args.result, "w") as f:
        json.dump({"nbytes": nbytes, "with": seconds[True][1:], "without": seconds[False][1:]}, f)


def orchestrate(args: argparse.Namespace) -> None:
    address = f"tcp://127.0.0.1:{_free_port()}"
    result = f"/tmp/distload-bench-rollback-{os.getpid()}.json"
    base = [sys.executable, os.path.abspath(__file__), "--size-mib", str(args.size_mib), "--repeats",
            str(args.repeats), "--bucket-mib", str(args.bucket_mib), "--rendezvous", address, "--result", result]
    jobs = [subprocess.Popen(base + ["--part", "trainer"]), subprocess.Popen(base + ["--part", "inference"])]
    for job in jobs:
        if job.wait(timeout=1800) != 0:
            raise SystemExit(f"a job failed ({job.args})")
    got = json.load(open(result))
    os.unlink(result)
    with_, without = statistics.median(got["with"]), statistics.median(got["without"])
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
           "nbytes": got["nbytes"], "bucket_mib": args.bucket_mib, "repeats": args.repeats,
           "seconds_with_rollback": round(with_, 4), "seconds_without": round(without, 4),
           "cost": round(with_ / without - 1, 4), "host_bytes_set_aside": got["nbytes"]}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sync_rollback.json"), "w") as f:
        json.dump(out, f, indent=2)
    line = (f"Receive of {got['nbytes'] / 2**20:.0f} MiB (sync-demo's state, gloo, 1 -> 1 rank, buckets of "
            f"{args.bucket_mib} MiB), median of {args.repeats} each, interleaved: {with_:.3f} s with rollback, "
            f"{without:.3f} s without: rollback costs {(with_ / without - 1) * 100:.1f}% and "
            f"{got['nbytes'] / 2**20:.0f} MiB of host memory; {os.cpu_count()} CPUs, torch {torch.__version__}.")
    with open(os.path.join(args.out, "sync_rollback.md"), "w") as f:
        f.write(line + "\n")
    print(line, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--part", choices=("trainer", "inference"), help=argparse.SUPPRESS)
    parser.add_argument("--rendezvous", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part == "trainer":
        trainer(args)
    elif args.part == "inference":
        inference(args)
    else:
        orchestrate(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
