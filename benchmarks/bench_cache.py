"""The node cache (``--cache-dir``) against the store and against local disk (issue 33, item 4).

    python benchmarks/bench_cache.py                              # 256 MiB, 3 repeats
    python benchmarks/bench_cache.py --size-mib 32 --repeats 1    # a quick check

Needs s3rver (``cd tests/node && npm ci``) and ``pip install -e ".[s3,test]"`` (the server and
the byte-counting proxy come from tests/object_store_servers.py). Nothing leaves 127.0.0.1.

Writes a Llama-shaped bf16 checkpoint of ``--size-mib`` (hidden 2048: tensors of real models'
sizes), uploads it to s3rver, and in ONE process and ONE run (repeats interleaved, medians), every
load on one rank, through a byte-counting proxy in front of the server:

- **cold**: ``auto`` with a new cache folder (distload's ranged reads fill it);
- **warm**: the same load again (the cache serves it);
- **local disk**: ``auto`` on the same files on local disk (pread; the files were just written, so
  in the page cache, as the cache's own files are);
- **store**: ``auto`` without a cache (Run:ai's reader, one rank);
- **TP 4 after TP 2**: a new cache; TP 2's two ranks load in turn, then TP 4's four: the bytes the
  server served for TP 4's loads, against the checkpoint.

Seconds are each load's own (distload's report, listing and headers included). Every load's
digest is checked against a plain safetensors read. Goals (issue 33): warm serves at most 2% of
the checkpoint from the store and runs at least 0.9x local disk's speed. Results:
benchmarks/results/cache.json and cache.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TESTS = os.path.join(REPO, "tests")
GIB = 2**30
MIB = 2**20


def load(source: str, extra: dict | None = None, **kwargs) -> dict:
    import distload

    with distload.WorkerGroup(device="cpu") as group:
        report = distload.Loader(source, "auto", extra, group=group, **kwargs).load(digest=True).rank_report
    return {"seconds": report.seconds, "gib_per_s": report.gib_per_s, "path": report.path,
            "digest": report.digest, "store_bytes": report.store_bytes, "cache_bytes": report.cache_bytes}


def machine() -> dict:
    import psutil
    import torch

    return {"cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / GIB, 1),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    sys.path.insert(0, TESTS)
    from conftest import plain_digest
    from object_store_servers import ByteCountingProxy, start_s3rver

    import distload
    from distload.cli.demo import write_demo_checkpoint

    at_start = machine()
    root = tempfile.mkdtemp(prefix="distload-bench-cache-")
    server = start_s3rver(os.path.join(root))
    try:
        whole, _ = write_demo_checkpoint(os.path.join(root, "src"), 1, size_mib=args.size_mib, hidden=2048)
        files = sorted(os.path.join(whole, n) for n in os.listdir(whole) if n.endswith(".safetensors"))
        nbytes = sum(os.path.getsize(p) for p in files)
        expected = plain_digest(files)
        tp_expected = {}
        for size in (2, 4):
            out = os.path.join(root, f"tp{size}")
            distload.reshard(whole, out, size, sharding="decoder")
            tp_expected[size] = [plain_digest(sorted(os.path.join(out, n) for n in os.listdir(out)
                                                     if n.startswith(f"model-rank-{r}-"))) for r in range(size)]
        uri = server.upload_folder(whole, "model")
        proxy = ByteCountingProxy(server.port)
        os.environ.update(server.env(proxy.port))
        os.environ.pop("DISTLOAD_CACHE_DIR", None)
        runs: dict[str, list[dict]] = {k: [] for k in ("cold", "warm", "local disk", "store", "TP 2 (2 loads)",
                                                         "TP 4 after TP 2 (4 loads)")}

        def timed(name: str, digest: str | None, *a, **kw) -> dict:
            before = proxy.served
            result = load(*a, **kw)
            result["served_bytes"] = proxy.served - before
            if digest is not None and result["digest"] != digest:
                raise SystemExit(f"{name}: digest {result['digest']} differs from the plain read's {digest}")
            return result

        for repeat in range(args.repeats):
            cache = os.path.join(root, f"cache-{repeat}")
            runs["cold"].append(timed("cold", expected, uri, {"cache_dir": cache}))
            runs["warm"].append(timed("warm", expected, uri, {"cache_dir": cache}))
            runs["local disk"].append(timed("local disk", expected, whole))
            runs["store"].append(timed("store", expected, uri))
            shutil.rmtree(cache)
            cache = os.path.join(root, f"tp-cache-{repeat}")
            for size, name in ((2, "TP 2 (2 loads)"), (4, "TP 4 after TP 2 (4 loads)")):
                parts = [timed(f"TP {size} rank {r}", tp_expected[size][r], uri, {"cache_dir": cache},
                               tensor_parallel_size=size, tensor_parallel_rank=r) for r in range(size)]
                runs[name].append({"seconds": sum(p["seconds"] for p in parts),
                                   "served_bytes": sum(p["served_bytes"] for p in parts),
                                   "store_bytes": sum(p["store_bytes"] for p in parts),
                                   "cache_bytes": sum(p["cache_bytes"] for p in parts), "path": parts[0]["path"]})
            shutil.rmtree(cache)
        proxy.close()
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    summary = {name: {"seconds": round(median(name, "seconds"), 4), "served_bytes": int(median(name, "served_bytes")),
                      "served_over_checkpoint": round(median(name, "served_bytes") / nbytes, 4),
                      "path": runs[name][0]["path"]} for name in runs}
    ratios = {
        "warm speed / local disk speed": round(median("local disk", "seconds") / median("warm", "seconds"), 3),
        "warm speed / store speed": round(median("store", "seconds") / median("warm", "seconds"), 3),
        "warm speed / cold speed": round(median("cold", "seconds") / median("warm", "seconds"), 3),
        "warm served / checkpoint": round(median("warm", "served_bytes") / nbytes, 6),
        "TP 4 after TP 2 served / checkpoint": summary["TP 4 after TP 2 (4 loads)"]["served_over_checkpoint"],
    }
    result = {"machine": {**at_start, "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
              "checkpoint_bytes": nbytes, "repeats": args.repeats, "summary": summary, "ratios": ratios, "runs": runs}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cache.json"), "w") as f:
        json.dump(result, f, indent=2)
    m = result["machine"]
    lines = [
        "# The node cache against the store and local disk (benchmarks/bench_cache.py)",
        "",
        f"{nbytes / MIB:.0f} MiB Llama-shaped bf16 checkpoint (hidden 2048), s3rver on loopback behind a "
        f"byte-counting proxy, one rank, medians of {args.repeats} interleaved repeats, every digest checked.",
        f"Machine: {m['cpus']} CPUs, {m['memory_gib']} GiB, {m['platform']}, torch {m['torch']}, load average "
        f"{m['load_average_at_start']} at the start, {m['load_average_at_end']} at the end (shared machine).",
        "",
        "| load | reader | seconds | GiB/s | served by the store (bytes) | served by the store / checkpoint |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        speed = (nbytes / GIB / s["seconds"]) if "TP" not in name else float("nan")
        lines.append(f"| {name} | {s['path']} | {s['seconds']:.3f} | "
                     f"{'-' if 'TP' in name else f'{speed:.2f}'} | {s['served_bytes']:,} | "
                     f"{s['served_over_checkpoint']:.4f} |")
    lines += ["", "| ratio (same run) | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in ratios.items()]
    lines.append("")
    with open(os.path.join(args.out, "cache.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
