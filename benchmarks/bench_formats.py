"""Which load format is fastest on this machine? The measurement behind ``--load-format auto``.

    python benchmarks/bench_formats.py                 # 1 GiB checkpoint, 1 and 2 ranks, 3 repeats
    python benchmarks/bench_formats.py --size-mib 256 --repeats 1 --ranks 2

Writes a Llama-shaped bf16 checkpoint (whole and pre-sharded) with ``distload.demo``, then runs
``torchrun -m distload load`` for every CPU format, warm page cache (one unmeasured warm-up
load first), and takes the median of the report's ``total.seconds`` (the slowest rank). A plain
``safetensors.torch.load_file`` of the same bytes in this process is the baseline of the run, so
the ratios hold on a noisy machine. Results: ``benchmarks/results/formats.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import psutil
import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from distload.demo import write_demo_checkpoint  # noqa: E402

CASES = [  # (label, folder kind, format, extra config)
    ("safetensors", "whole", "safetensors", None),
    ("runai_streamer", "whole", "runai_streamer", None),
    ("runai_streamer distributed", "whole", "runai_streamer", '{"distributed": true}'),
    ("sharded_state", "sharded", "sharded_state", None),
    ("runai_streamer_sharded", "sharded", "runai_streamer_sharded", None),
]


def run_load(folder: str, load_format: str, extra: str | None, nproc: int, report: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "distload", "load", folder, "--load-format", load_format, "--report-json", report,
           "--no-progress", "--no-digest"]
    if extra:
        cmd += ["--model-loader-extra-config", extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    with open(report) as f:
        return json.load(f)


def baseline_seconds(folder: str) -> float:
    """Plain safetensors, copied out of the memory map (what a load must deliver: owned bytes)."""
    files = sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))
    start = time.perf_counter()
    state = {}
    for path in files:
        state.update({k: v.clone() for k, v in load_file(path).items()})
    return time.perf_counter() - start


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "runai_model_streamer": _version("runai-model-streamer"),
        "safetensors": _version("safetensors"),
    }


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()

    root = tempfile.mkdtemp(prefix="distload-bench-")
    rows = []
    for nproc in args.ranks:
        whole, sharded = write_demo_checkpoint(os.path.join(root, f"ws{nproc}"), nproc, args.size_mib)
        folders = {"whole": whole, "sharded": sharded}
        whole_bytes = sum(os.path.getsize(os.path.join(whole, n)) for n in os.listdir(whole)
                          if n.endswith(".safetensors"))
        base_gib_per_s = whole_bytes / 2**30 / statistics.median(
            baseline_seconds(whole) for _ in range(args.repeats))
        for label, kind, load_format, extra in CASES:
            if extra and nproc == 1:
                continue
            report_path = os.path.join(root, "report.json")
            run_load(folders[kind], load_format, extra, nproc, report_path)  # warm-up
            reports = [run_load(folders[kind], load_format, extra, nproc, report_path)
                       for _ in range(args.repeats)]
            seconds = statistics.median(r["total"]["seconds"] for r in reports)
            nbytes = reports[0]["total"]["nbytes"]
            per_rank = nbytes / nproc / 2**30 / seconds
            rows.append({
                "format": label, "ranks": nproc, "checkpoint": kind,
                "path": sorted({r["path"] for r in reports[0]["ranks"]}),
                "seconds": round(seconds, 3), "total_gib_per_s": round(nbytes / 2**30 / seconds, 3),
                "per_rank_gib_per_s": round(per_rank, 3),
                "vs_baseline": round(per_rank / base_gib_per_s, 2),
            })
            print(json.dumps(rows[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    result = {"machine": machine(), "size_mib": args.size_mib, "repeats": args.repeats,
              "cache": "warm", "rows": rows}
    with open(os.path.join(args.out, "formats.json"), "w") as f:
        json.dump(result, f, indent=2)
    lines = [f"Warm page cache, {args.size_mib} MiB bf16 checkpoint, median of {args.repeats}; "
             f"machine: {result['machine']['cpus']} CPUs, {result['machine']['memory_gib']} GiB, "
             f"torch {result['machine']['torch']}, Run:ai {result['machine']['runai_model_streamer']}.",
             "Baseline: plain `safetensors.torch.load_file` + copy out of the map, one process, same run.",
             "", "| format | ranks | checkpoint | path | seconds (slowest rank) | GiB/s all ranks "
             "| GiB/s per rank | per rank / baseline |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['format']} | {row['ranks']} | {row['checkpoint']} | {','.join(row['path'])} "
                     f"| {row['seconds']} | {row['total_gib_per_s']} | {row['per_rank_gib_per_s']} "
                     f"| {row['vs_baseline']} |")
    with open(os.path.join(args.out, "formats.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    subprocess.run(["rm", "-rf", root])
    return 0


if __name__ == "__main__":
    sys.exit(main())
