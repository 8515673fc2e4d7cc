"""What the content fingerprint of a cooperative read costs, against the load it guards.

    python benchmarks/bench_fingerprint.py               # a 2 GiB file, 3 repeats
    python benchmarks/bench_fingerprint.py --size-mib 256 --repeats 1

Before ranks share reads of local files, each one fingerprints every file (header and one 4 KiB
block every 1 MiB of data, ``distload.loading.sources.content_fingerprint``), so that a node with
another copy at the same path is refused instead of silently handed the other node's bytes. In
ONE run, on one file, warm (in the page cache) and cold (evicted with posix_fadvise DONTNEED):

- **fingerprint**: ``content_fingerprint`` of the file;
- **load**: ``distload.load(FILE)`` (auto: pread), the read the fingerprint guards.

Reports seconds (medians) and the ratio fingerprint / load; results in
benchmarks/results/fingerprint.json and fingerprint.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import distload  # noqa: E402
from bench_load import evict, machine  # noqa: E402
from distload.loading.sources import content_fingerprint, fingerprint_samples, read_local_header  # noqa: E402


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="distload-fingerprint-", dir=os.environ.get("DISTLOAD_BENCH_DIR")) as tmp:
        path = os.path.join(tmp, "model.safetensors")
        g = torch.Generator().manual_seed(0)
        tensors = max(1, args.size_mib // 32)  # 32 MiB tensors
        save_file({f"layers.{i}.weight": torch.randn(4096, 2048, generator=g) for i in range(tensors)}, path)
        info = read_local_header(path)
        times: dict[str, list[float]] = {}
        for _ in range(args.repeats):
            for cache in ("cold", "warm"):
                for what, fn in (("fingerprint", lambda: content_fingerprint(info)),
                                 ("load", lambda: distload.load(path))):
                    if cache == "cold":
                        evict(tmp)
                    else:
                        fn()
                    times.setdefault(f"{what} {cache}", []).append(timed(fn))
        medians = {key: statistics.median(values) for key, values in times.items()}
        samples = fingerprint_samples(info)
        result = {"machine": machine(), "file_bytes": os.path.getsize(path), "samples": len(samples),
                  "sampled_bytes": sum(size for _, size in samples), "repeats": args.repeats,
                  "seconds": times, "medians": medians}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fingerprint.json"), "w") as f:
        json.dump(result, f, indent=2)
    lines = [f"# Content fingerprint cost ({result['file_bytes'] / 2**30:.2f} GiB, one file)", "",
             f"Machine: {result['machine']}. Medians of {args.repeats}.", "",
             f"{result['samples']} samples, {result['sampled_bytes'] / 2**20:.1f} MiB read "
             f"({100 * result['sampled_bytes'] / result['file_bytes']:.2f}% of the file).", "",
             "| cache | fingerprint s | load s | fingerprint / load |", "|---|---|---|---|"]
    for cache in ("cold", "warm"):
        fp, load = medians[f"fingerprint {cache}"], medians[f"load {cache}"]
        lines.append(f"| {cache} | {fp:.3f} | {load:.3f} | {fp / load:.1%} |")
    with open(os.path.join(args.out, "fingerprint.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
