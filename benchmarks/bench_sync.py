"""Weight sync: distload's bucketed, double-buffered push against the two ways people do it.

    python benchmarks/bench_sync.py                       # 3 ranks on gloo, ~512 MiB, 3 repeats
    python benchmarks/bench_sync.py --nproc 2 --size-mib 256 --bucket-mib 32

In ONE run, over the same many-tensor Llama-shaped bf16 state dict, rank 0 sends to the others:
- flat: one broadcast of all bytes already packed in one buffer (the transport's limit);
- per-tensor: one broadcast per tensor (the naive way);
- distload: ``WeightSync.push``/``receive`` (metadata, checks, bucketed, double-buffered, in place).
Median seconds of the slowest rank; results in benchmarks/results/sync.{json,md}.
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
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, os.path.dirname(HERE))
    from distload.group import WorkerGroup
    from distload.live.sync import WeightSync
    from distload.cli.sync_demo import _state

    with WorkerGroup(device="cpu") as group:
        state = _state(args.size_mib, group.device)
        if group.rank == 0:
            for tensor in state.values():
                tensor.normal_()
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        sync = WeightSync([0], group=group, bucket_bytes=args.bucket_mib * 2**20)
        flat = torch.empty(nbytes, dtype=torch.uint8)
        results: dict[str, list[float]] = {"flat": [], "per-tensor": [], "distload": []}
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.broadcast(flat, src=0)
            results["flat"].append(time.perf_counter() - start)

            dist.barrier()
            start = time.perf_counter()
            for tensor in state.values():
                dist.broadcast(tensor, src=0)
            results["per-tensor"].append(time.perf_counter() - start)

            dist.barrier()
            start = time.perf_counter()
            if group.rank == 0:
                sync.push(state, 1)
            else:
                sync.receive(state)
            results["distload"].append(time.perf_counter() - start)
        sync.close()
        slowest = group.exchange(results)
        if group.rank == 0:
            summary = {}
            for method in results:
                per_repeat = [max(r[method][i] for r in slowest) for i in range(args.repeats)]
                seconds = statistics.median(per_repeat)
                summary[method] = {"seconds": round(seconds, 4), "gb_per_s": round(nbytes / 1e9 / seconds, 3)}
            flat_s = summary["flat"]["seconds"]
            for method in summary:
                summary[method]["vs_flat"] = round(flat_s / summary[method]["seconds"], 3)
            out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                               "torch": torch.__version__},
                   "ranks": group.world_size, "backend": "gloo", "nbytes": nbytes, "num_tensors": len(state),
                   "bucket_mib": args.bucket_mib, "repeats": args.repeats, "results": summary}
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "sync.json"), "w") as f:
                json.dump(out, f, indent=2)
            lines = [f"Weight sync, gloo, {group.world_size} ranks (1 sender), {nbytes / 2**20:.0f} MiB in "
                     f"{len(state)} bf16 tensors, buckets of {args.bucket_mib} MiB, median of {args.repeats}; "
                     f"{os.cpu_count()} CPUs, torch {torch.__version__}.", "",
                     "| method | seconds | GB/s | throughput vs flat |", "|---|---|---|---|"]
            for method, r in summary.items():
                lines.append(f"| {method} | {r['seconds']} | {r['gb_per_s']} | {r['vs_flat']} |")
            with open(os.path.join(args.out, "sync.md"), "w") as f:
                f.write("\n".join(lines) + "\n")
            print("\n".join(lines), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=3)
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           os.path.abspath(__file__), "--worker", "--size-mib", str(args.size_mib), "--bucket-mib",
           str(args.bucket_mib), "--repeats", str(args.repeats), "--out", args.out]
    return subprocess.run(cmd, timeout=1800).returncode


if __name__ == "__main__":
    sys.exit(main())
