"""The cost of checking CRC-32Cs on load: a warm load with the check and without, same run.

    python benchmarks/bench_checksums.py                       # 1 GiB, 1 rank, auto and sharded_state, 7 repeats
    python benchmarks/bench_checksums.py --size-mib 512 --ranks 2 --repeats 5
    python benchmarks/bench_checksums.py --cache cold        # every file evicted before each load
    python benchmarks/bench_checksums.py --in-process --repeats 41   # one process, wall and CPU seconds

Writes a Llama-shaped bf16 checkpoint (``distload.cli.demo``, tensors of tens of MiB), reshards it
for ``--ranks`` ranks (its manifest records each tensor's CRC-32Cs, so every load checks them),
and copies it with the checksums taken out of the manifest (what a checkpoint saved before
distload recorded them is: it loads unchecked). Both are read once untimed (warm page cache),
then loaded through ``torchrun -m distload load`` in turn, checked and unchecked interleaved
(the order alternating each repetition), for each format: ``auto`` (distload's pread reader,
which checks each piece in its reader threads right after reading it) and ``sharded_state``
(the safetensors library's reader, checked by the loader as each tensor arrives).

The slowest rank's seconds count. Reported: the median of each case, and the median of the
paired ratios (checked over the unchecked run next to it), which a shared machine's drifts
disturb less. ``--in-process`` loads in this one process instead (``distload.load``, ``auto``,
1 rank), the cases interleaved, and counts CPU seconds beside wall seconds, with the reader
threads at their default number and at one: a paired ratio per repetition, many repetitions (a
load of 1 GiB takes a quarter of a second here, so 41 pairs take a minute), because on a shared
2-core VM one load's time moves by more than the check costs. ``--cache cold`` evicts every file from the page cache (posix_fadvise
DONTNEED, as bench_load.py does) before each load instead of warming it. Results:
benchmarks/results/checksums.json and checksums.md (cold: checksums_cold.json and .md;
in-process: checksums_in_process.json and .md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

GIB = 2**30


def machine() -> dict:
    import psutil
    import torch

    return {"cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / GIB, 1),
            "platform": platform.platform(), "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__, "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}


def run_load(folder: str, load_format: str, nproc: int, report: str) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "distload", "load", folder, "--load-format", load_format, "--report-json", report,
           "--no-progress", "--no-digest"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    with open(report) as f:
        return max(r["seconds"] for r in json.load(f)["ranks"])


def machine_sentence(info: dict) -> str:
    """The results' line about the machine and its load while the benchmark ran."""
    return (f"Machine: {info['cpus']} CPUs (`nproc`), kernel {info['kernel']}, {info['memory_gib']} GiB, "
            f"torch {info['torch']}; a VM shared with other engineers' jobs (load average "
            f"{info['load_average_at_start']} at the start, {info['load_average_at_end']} at the end).")


def evict(folder: str) -> None:
    """Drop the folder's files from the page cache (no root needed)."""
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def without_checksums(folder: str, copy: str) -> None:
    """``folder`` as a distload that recorded no checksums would have saved it."""
    from distload.loading.manifest import MANIFEST_NAME

    shutil.copytree(folder, copy)
    path = os.path.join(copy, MANIFEST_NAME)
    with open(path) as f:
        manifest = json.load(f)
    manifest["version"] = 1
    for entry in manifest["files"]:
        del entry["crc32c"], entry["crc32c_chunk_bytes"]
    with open(path, "w") as f:
        json.dump(manifest, f)


def in_process(cases: dict[str, str], repeats: int) -> tuple[list[dict], dict]:
    """Load each case in this process, interleaved; per case the wall and CPU seconds of each load."""
    import resource

    import distload

    def one(folder: str, concurrency: int | None) -> tuple[float, float]:
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        state = distload.load(folder, "auto", extra_config={"concurrency": concurrency} if concurrency else None)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
        del state
        return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime

    threads = {"default threads": None, "one reader thread": 1}
    runs = {(t, c): [] for t in threads for c in cases}
    for key in runs:  # warm: the page cache holds both, and this process has loaded each once
        one(cases[key[1]], threads[key[0]])
    for rep in range(repeats):
        keys = list(runs) if rep % 2 == 0 else list(reversed(runs))
        for key in keys:
            runs[key].append(one(cases[key[1]], threads[key[0]]))
    rows = []
    for t in threads:
        c, u = runs[(t, "checked")], runs[(t, "unchecked")]
        row = {"threads": t}
        for i, what in enumerate(("wall", "cpu")):
            row[f"{what}_checked_s"] = round(statistics.median(x[i] for x in c), 4)
            row[f"{what}_unchecked_s"] = round(statistics.median(x[i] for x in u), 4)
            row[f"{what}_paired_ratio"] = round(statistics.median(a[i] / b[i] for a, b in zip(c, u)), 4)
            row[f"{what}_mean_ratio"] = round(statistics.fmean(x[i] for x in c) / statistics.fmean(x[i] for x in u), 4)
        row["runs"] = {k: [[round(w, 4), round(p, 4)] for w, p in runs[(t, k)]] for k in cases}
        rows.append(row)
    return rows, runs


def write_in_process(args, info: dict, nbytes: int, rows: list[dict]) -> None:
    result = {"machine": info, "mode": "in-process", "size_mib": args.size_mib, "bytes": nbytes,
              "repeats": args.repeats, "rows": rows}
    with open(os.path.join(args.out, "checksums_in_process.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# CRC-32C check on load, in one process: warm `auto` load, checked vs unchecked ({nbytes / GIB:.2f} GiB)",
             "",
             machine_sentence(info) + " "
             f"`distload.load(folder, \"auto\")` in one process, {args.repeats} repetitions, the four cases "
             f"interleaved (order reversed every other repetition); CPU seconds are the process's user + system.",
             "",
             "| reader threads | wall checked / unchecked s | wall: median of paired ratios | wall: ratio of means "
             "| CPU checked / unchecked s | CPU: median of paired ratios | CPU: ratio of means |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['threads']} | {r['wall_checked_s']:.3f} / {r['wall_unchecked_s']:.3f} | "
                     f"{r['wall_paired_ratio']:.3f} | {r['wall_mean_ratio']:.3f} | {r['cpu_checked_s']:.3f} / "
                     f"{r['cpu_unchecked_s']:.3f} | {r['cpu_paired_ratio']:.3f} | {r['cpu_mean_ratio']:.3f} |")
    with open(os.path.join(args.out, "checksums_in_process.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--formats", nargs="+", default=["auto", "sharded_state"])
    parser.add_argument("--cache", choices=["warm", "cold"], default="warm")
    parser.add_argument("--in-process", action="store_true",
                        help="load in this process (auto, 1 rank), wall and CPU seconds, default and one reader thread")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    if args.in_process and (args.ranks != 1 or args.cache != "warm" or args.formats != ["auto", "sharded_state"]):
        parser.error("--in-process loads one rank's warm checkpoint with auto: leave out --ranks, --cache and --formats")

    import distload
    from distload.cli.demo import write_demo_checkpoint

    info = machine()
    root = tempfile.mkdtemp(prefix="distload-bench-crc-")
    try:
        whole, _ = write_demo_checkpoint(os.path.join(root, "demo"), 1, size_mib=args.size_mib, hidden=2048)
        checked = os.path.join(root, "checked")
        distload.reshard(whole, checked, args.ranks, sharding="decoder")
        unchecked = os.path.join(root, "unchecked")
        without_checksums(checked, unchecked)
        shutil.rmtree(os.path.join(root, "demo"))
        nbytes = sum(os.path.getsize(os.path.join(checked, n)) for n in os.listdir(checked) if n.endswith(".safetensors"))
        report = os.path.join(root, "report.json")
        cases = {"checked": checked, "unchecked": unchecked}
        if args.in_process:
            rows, _ = in_process(cases, args.repeats)
            info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
            os.makedirs(args.out, exist_ok=True)
            write_in_process(args, info, nbytes, rows)
            return 0
        seconds: dict[str, dict[str, list[float]]] = {fmt: {c: [] for c in cases} for fmt in args.formats}
        for fmt in args.formats:
            for folder in cases.values():  # warm: the page cache holds both (cold: a first run)
                run_load(folder, fmt, args.ranks, report)
        for rep in range(args.repeats):
            for fmt in args.formats:
                order = list(cases) if rep % 2 == 0 else list(reversed(cases))
                for case in order:
                    if args.cache == "cold":
                        evict(cases[case])
                    s = run_load(cases[case], fmt, args.ranks, report)
                    seconds[fmt][case].append(s)
                    print(f"rep {rep} {fmt:14s} {case:9s} {s:.3f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    rows = []
    for fmt in args.formats:
        c, u = seconds[fmt]["checked"], seconds[fmt]["unchecked"]
        rows.append({"format": fmt, "checked_s": round(statistics.median(c), 4),
                     "unchecked_s": round(statistics.median(u), 4),
                     "median_ratio": round(statistics.median(c) / statistics.median(u), 4),
                     "paired_ratio": round(statistics.median(a / b for a, b in zip(c, u)), 4),
                     "checked_runs": [round(x, 4) for x in c], "unchecked_runs": [round(x, 4) for x in u]})
    info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    result = {"machine": info, "cache": args.cache, "size_mib": args.size_mib, "bytes": nbytes, "ranks": args.ranks,
              "repeats": args.repeats, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    stem = "checksums" if args.cache == "warm" else "checksums_cold"
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# CRC-32C check on load: {args.cache} load, checked vs unchecked ({nbytes / GIB:.2f} GiB, {args.ranks} rank(s))",
             "",
             machine_sentence(info) + " "
             f"`torchrun -m distload load`, slowest rank's seconds, cases interleaved (order alternating), "
             f"medians of {args.repeats}.",
             "",
             "| format | checked s | unchecked s | checked / unchecked (medians) | median of paired ratios |",
             "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['format']} | {row['checked_s']:.3f} | {row['unchecked_s']:.3f} | "
                     f"{row['median_ratio']:.3f} | {row['paired_ratio']:.3f} |")
    lines += ["", "Every run (seconds):", ""]
    for row in rows:
        lines.append(f"- {row['format']}: checked {row['checked_runs']}, unchecked {row['unchecked_runs']}")
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
