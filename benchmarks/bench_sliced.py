"""Tensor-parallel loads from a whole checkpoint: distload's sliced reads against the naive way
and torch.distributed.checkpoint's Hugging Face reader.

    python benchmarks/bench_sliced.py                    # 2 GiB, cold cache, 3 repeats
    python benchmarks/bench_sliced.py --size-mib 256 --repeats 1

One Llama-shaped bf16 whole checkpoint (``distload.cli.demo``, hidden 2048: tensors of tens of
MiB), files evicted from the page cache before every run (posix_fadvise DONTNEED, no root). In
ONE run, for TP 2 on 2 ranks and TP 2 x DP 2 on 4 ranks:

- **distload sliced**: ``torchrun -m distload load WHOLE --tensor-parallel-size 2`` (auto: pread
  of each rank's slices only);
- **naive**: the same with ``--load-format safetensors``: every rank reads the whole checkpoint
  with safetensors and keeps its slice (what vLLM does from a whole checkpoint);
- **DCP HF reader**: ``torch.distributed.checkpoint.load`` with ``HuggingFaceStorageReader`` into
  a state dict of DTensors sharded as the decoder spec shards them (Shard(0)/Shard(1) on a
  one-dimensional gloo mesh of the TP group); the anchor training frameworks use. The fused and
  head-aware layouts have no DTensor placement, so this checkpoint has separate q/k/v with TP
  not above the KV heads, where the two layouts agree;
- **distload -> DTensor**: ``distload.reload_into`` filling the same DTensors in place, timed the
  same way as DCP's load (around the one call, after the DTensors exist), so that the two readers
  are compared on the same work: each rank's local shards, into memory already allocated.

Per rank: requested bytes (distload's count; for the others, what their reader asks for: the
whole checkpoint for naive, the slices' files for DCP, where it is not counted), bytes read from
storage (psutil read_bytes), seconds; the slowest rank counts. Medians of ``--repeats``.
Results: benchmarks/results/sliced.json and sliced.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_load import evict, machine  # noqa: E402
from distload.cli.demo import write_demo_checkpoint  # noqa: E402

GIB = 2**30
TP = 2

_DCP = r"""
import json, sys, time, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, empty
import distload
from distload.loading.report import storage_read_bytes
folder, out, tp, method = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
# One mesh of shape (dp, tp): each rank's TP group is its consecutive ranks, as distload's.
mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]
spec = distload.load_spec("plain")
state = {}
# The shapes from the headers, by safetensors itself: the DCP run holds nothing of distload's but
# its sharding spec (pure), so whatever happens in it is DCP's.
from safetensors import safe_open
for name in sorted(f for f in __import__("os").listdir(folder) if f.endswith(".safetensors")):
    with safe_open(f"{folder}/{name}", framework="pt") as f:
        for key in f.keys():
            piece = f.get_slice(key)
            shape = tuple(piece.get_shape())
            dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[piece.get_dtype()]
            action = spec.action(key, shape)
            placement = Replicate() if action.replicated else Shard(action.dim)
            state[key] = empty(shape, dtype=dtype, device_mesh=mesh, placements=[placement])
read0 = storage_read_bytes()
dist.barrier()
start = time.perf_counter()
if method == "dcp":
    dcp.load(state, storage_reader=HuggingFaceStorageReader(folder))
    requested = None
else:  # the same DTensors filled in place by distload (listing, headers and agreement included)
    with distload.WorkerGroup(device="cpu") as group:
        requested = distload.reload_into(state, folder, group=group).requested_bytes
seconds = time.perf_counter() - start
nbytes = sum(v.to_local().numel() * v.to_local().element_size() for v in state.values())
result = {"seconds": seconds, "nbytes": nbytes, "read_bytes": storage_read_bytes() - read0, "requested_bytes": requested}
results = [None] * world
dist.all_gather_object(results, result)
if rank == 0:
    json.dump(results, open(out, "w"))
dist.destroy_process_group()
"""


def torchrun(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}")
    return result


def run_distload(whole: str, fmt: str, nproc: int, report: str) -> list[dict]:
    torchrun(nproc, ["-m", "distload", "load", whole, "--load-format", fmt, "--tensor-parallel-size", str(TP),
                     "--report-json", report, "--no-progress", "--no-digest"])
    with open(report) as f:
        ranks = json.load(f)["ranks"]
    return [{"seconds": r["seconds"], "nbytes": r["nbytes"], "read_bytes": r["read_bytes"],
             "requested_bytes": r["requested_bytes"], "path": r["path"]} for r in ranks]


def run_dtensor(whole: str, nproc: int, out: str, script: str, method: str) -> list[dict]:
    torchrun(nproc, [script, whole, out, str(TP), method])
    with open(out) as f:
        return json.load(f)


def summarize(method: str, nproc: int, repeats: list[list[dict]], whole_bytes: int) -> dict:
    seconds = statistics.median(max(r["seconds"] for r in rep) for rep in repeats)
    first = repeats[0]
    requested = [r.get("requested_bytes") for r in first]
    return {
        "method": method, "ranks": nproc, "tp": TP,
        "seconds": round(seconds, 3),
        "kept_gib_per_rank": round(max(r["nbytes"] for r in first) / GIB, 3),
        "requested_gib_per_rank": None if None in requested else round(max(requested) / GIB, 3),
        "read_gib_per_rank": round(statistics.median(max(r["read_bytes"] for r in rep) for rep in repeats) / GIB, 3),
        "read_gib_job": round(statistics.median(sum(r["read_bytes"] for r in rep) for rep in repeats) / GIB, 3),
        "whole_gib": round(whole_bytes / GIB, 3),
    }


def write_outputs(out_dir: str, result: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "sliced.json"), "w") as f:
        json.dump(result, f, indent=2)
    m = result["machine"]
    lines = [f"# Tensor-parallel loads from a whole checkpoint (TP {TP})", "",
             f"{result['size_mib']} MiB bf16 Llama-shaped whole checkpoint (hidden {result['hidden']}), cold page "
             f"cache before every run, median of {result['repeats']}; machine: {m['cpus']} CPUs, "
             f"{m['memory_gib']} GiB, {m['platform']}, torch {m['torch']}.", "",
             "| ranks | method | seconds (slowest rank) | vs naive | kept GiB/rank | requested GiB/rank | "
             "read from storage GiB/rank | read GiB, whole job |",
             "|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        naive = next(r for r in result["rows"] if r["ranks"] == row["ranks"] and r["method"].startswith("naive"))
        requested = "-" if row["requested_gib_per_rank"] is None else f"{row['requested_gib_per_rank']:.3f}"
        lines.append(f"| {row['ranks']} | {row['method']} | {row['seconds']:.2f} | "
                     f"{row['seconds'] / naive['seconds']:.2f}x | {row['kept_gib_per_rank']:.3f} | {requested} | "
                     f"{row['read_gib_per_rank']:.3f} | {row['read_gib_job']:.3f} |")
    lines += ["", "`requested` is distload's own count of the bytes it asked the source for (naive: "
              "the whole checkpoint, read by safetensors); `read from storage` is psutil's read_bytes "
              "(page-cache hits do not count, so ranks of one node sharing a file show the bytes "
              "only on whichever read them first). DCP's requests are not counted (`-`)."]
    with open(os.path.join(out_dir, "sliced.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--no-dcp", action="store_true", help="skip torch.distributed.checkpoint")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="distload-bench-sliced-") as root:
        whole, _ = write_demo_checkpoint(os.path.join(root, "ck"), 1, args.size_mib, args.hidden)
        whole_bytes = sum(os.path.getsize(os.path.join(whole, n)) for n in os.listdir(whole)
                          if n.endswith(".safetensors"))
        script = os.path.join(root, "dcp.py")
        with open(script, "w") as f:
            f.write(_DCP)
        methods = [("distload sliced (auto)", lambda n, out: run_distload(whole, "auto", n, out)),
                   ("naive (safetensors whole, keep slice)", lambda n, out: run_distload(whole, "safetensors", n, out))]
        methods.append(("distload reload_into -> DTensor", lambda n, out: run_dtensor(whole, n, out, script, "distload")))
        if not args.no_dcp:
            methods.append(("DCP HuggingFaceStorageReader -> DTensor",
                            lambda n, out: run_dtensor(whole, n, out, script, "dcp")))
        rows = []
        for nproc in args.ranks:
            for method, run in methods:
                repeats = []
                for i in range(args.repeats):
                    evict(whole)
                    start = time.perf_counter()
                    repeats.append(run(nproc, os.path.join(root, f"out-{nproc}-{i}.json")))
                    print(f"{nproc} ranks, {method}: {time.perf_counter() - start:.1f} s wall", flush=True)
                rows.append(summarize(method, nproc, repeats, whole_bytes))
                print(json.dumps(rows[-1]), flush=True)
    write_outputs(args.out, {"size_mib": args.size_mib, "hidden": args.hidden, "repeats": args.repeats,
                             "machine": machine(), "rows": rows})
    print(open(os.path.join(args.out, "sliced.md")).read())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
