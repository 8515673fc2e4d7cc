"""Copying a checkpoint from S3 onto every node: bytes the store served per job, and time.

    python benchmarks/bench_pull.py                      # ~300 MiB, 2 nodes x 2 ranks, 3 repeats
    python benchmarks/bench_pull.py --size-mib 64 --repeats 1

Two simulated nodes (two torchrun agents, each in its own UTS namespace with its own hostname and
its own working folder: needs root, as tests/test_launch_multinode.py does), 2 ranks each, an S3
server (moto) on loopback behind a byte-counting proxy, a Llama-shaped bf16 whole checkpoint
(``distload.cli.demo``) plus its config. In ONE run, each case copies the folder into a local
folder on each node (fresh folders each time):

- **Run:ai per rank**: every rank calls Run:ai's ``pull_files`` into its own folder (what a job
  gets when each process pulls for itself);
- **Run:ai per node**: local rank 0 of each node calls ``pull_files``, the others wait;
- **distload pull**: ``torchrun ... -m distload pull s3://... DEST``: the job's ranks split the
  reads and broadcast, local rank 0 of each node writes.

Per case: bytes the server sent (the proxy's count: listings, headers and HTTP framing
included) over the checkpoint's bytes, and the slowest node's wall time (python start to exit).
Medians of ``--repeats``. Results: benchmarks/results/pull.json and pull.md.
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
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from distload.cli.demo import write_demo_checkpoint  # noqa: E402
from object_store_servers import ByteCountingProxy, start_moto  # noqa: E402
from test_launch_multinode import describe, run_two_nodes  # noqa: E402

MIB = 2**20

# Run:ai's pull_files, per rank or per node, each into ./copy of the process's node folder
# (per rank: ./copy-<local rank>). The barrier keeps the per-node case's other ranks in the job.
RUNAI_PULL = r"""
import os, sys
import torch.distributed as dist
from runai_model_streamer import pull_files
uri, per_rank = sys.argv[1], sys.argv[2] == "rank"
dist.init_process_group("gloo")
local = int(os.environ["LOCAL_RANK"])
if per_rank or local == 0:
    pull_files(uri, os.path.abspath(f"copy-{local}" if per_rank else "copy"))
dist.barrier()
dist.destroy_process_group()
"""


def run_case(case: str, uri: str, server, root: str, script: str, nproc: int) -> dict:
    work = tempfile.mkdtemp(prefix=f"{case}-", dir=root)
    cwds = [os.path.join(work, "node0"), os.path.join(work, "node1")]
    if case == "distload pull":
        entry = ["-m", "distload", "pull", uri, "copy"]
    else:
        entry = [script, uri, "rank" if case == "Run:ai per rank" else "node"]
    proxy = ByteCountingProxy(server.port)
    os.environ.update(server.env(proxy.port))
    start = time.monotonic()
    try:
        nodes = run_two_nodes(LogDir(work), entry, 900, cwds=cwds, nproc_per_node=nproc)
    finally:
        proxy.close()
    seconds = max(n.seconds for n in nodes)
    if any(n.returncode != 0 for n in nodes):
        raise SystemExit(f"{case} failed:\n{describe(nodes)}")
    copies = [os.path.join(c, d) for c in cwds for d in os.listdir(c) if d.startswith("copy")]
    shutil.rmtree(work)
    return {"served": proxy.served, "seconds": round(seconds, 3), "copies": len(copies),
            "wall": round(time.monotonic() - start, 3)}


class LogDir(str):
    """run_two_nodes writes its logs under ``tmp_path / name``: a str path that supports ``/``."""

    def __truediv__(self, name: str) -> str:
        return os.path.join(self, name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=320,
                        help="the demo checkpoint's target size (whole layers: a little less)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="distload-bench-pull-", dir="/var/tmp")
    try:
        whole, _ = write_demo_checkpoint(os.path.join(root, "ckpt"), 1, args.size_mib, 2048)
        total = sum(os.path.getsize(os.path.join(whole, n)) for n in os.listdir(whole))
        os.makedirs(os.path.join(root, "moto"))
        server = start_moto(os.path.join(root, "moto"))
        try:
            uri = server.upload_folder(whole, "llama")
            script = os.path.join(root, "runai_pull.py")
            with open(script, "w") as f:
                f.write(RUNAI_PULL)
            rows = []
            for case in ("Run:ai per rank", "Run:ai per node", "distload pull"):
                reps = [run_case(case, uri, server, root, script, args.nproc_per_node) for _ in range(args.repeats)]
                row = {"case": case, "served_over_size": round(statistics.median(r["served"] for r in reps) / total, 3),
                       "seconds": statistics.median(r["seconds"] for r in reps),
                       "seconds_all": [r["seconds"] for r in reps], "copies": reps[0]["copies"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write(args, rows, total)
    return 0


def write(args: argparse.Namespace, rows: list[dict], total: int) -> None:
    from importlib.metadata import version

    machine = (f"{os.cpu_count()} CPUs, {platform.platform()}, runai-model-streamer "
               f"{version('runai-model-streamer')}, moto {version('moto')}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pull.json"), "w") as f:
        json.dump({"size_bytes": total, "nodes": 2, "ranks_per_node": args.nproc_per_node, "repeats": args.repeats,
                   "machine": machine, "rows": rows}, f, indent=2)
    base = next(r for r in rows if r["case"] == "Run:ai per node")
    lines = ["# Copying a checkpoint from S3 (moto) onto every node", "",
             f"{total / MIB:.0f} MiB (whole checkpoint and config), 2 simulated nodes x {args.nproc_per_node} ranks, "
             f"median of {args.repeats}; {machine}.", "",
             "| case | bytes served / checkpoint | copies made | s (slowest node, whole command) | vs Run:ai per node |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['served_over_size']} | {r['copies']} | {r['seconds']} "
                     f"| {base['seconds'] / r['seconds']:.2f}x |")
    with open(os.path.join(args.out, "pull.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
