"""Loads across hosts (issue 45): an S3 store on a host of its own behind a 1 Gbit/s link, loading
hosts linked at 10 Gbit/s: a cluster of network namespaces on this machine (tests/cluster), moto's
server inside the store host (tests/cluster_store.py)::

    python benchmarks/bench_cluster_loads.py --json benchmarks/results/cluster_loads.json \\
        --md benchmarks/results/cluster_loads.md

Two tables, each in one run with its repeats interleaved (the order rotates every repeat):

1. shared reads: one job of 2 ranks on 1 host, and of 2 ranks a host on 4 hosts
   (``torchrun --nnodes 4``, c10d rendezvous), both ``auto`` (distload's shared reads: each byte
   leaves the store once per job), against Run:ai's own distributed mode per node
   (``runai_streamer`` with ``{"distributed": true}``: each node's ranks share their reads, so
   each byte leaves the store once per node: 4 times for 4 hosts).
2. a new replica (1 rank on node1): from a running job (``distload serve`` on node0, which read
   the store once before the timings) and from the store (``auto``), alternating.

A time is the load report's slowest rank (its load, not the start of its processes or torchrun's
rendezvous, which on this 2-core machine cost more than the load); the wall time of the whole job
is recorded beside it. Every load is checked bit for bit (each rank's digest against a plain
safetensors read), and the bytes the store sent are counted at its interface (payload plus
TCP/IP headers). Each run records the link rates asked for and measured (one TCP stream), the
machine, and the load average before it: every host's processes share this machine's 2 cores.
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
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from cluster import Cluster  # noqa: E402
from cluster_store import S3Store  # noqa: E402
from conftest import plain_digest, write_whole  # noqa: E402

SECRET = "bench-cluster-loads-secret-0123456789"
MIB = 1 << 20


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def make_checkpoint(folder: str, size_mib: int, files: int) -> tuple[list[str], str, int]:
    tensors = size_mib // 8  # 8 MiB float32 tensors
    generator = torch.Generator().manual_seed(45)
    state = {f"layers.{i}.weight": torch.randn(2 * MIB, generator=generator) for i in range(tensors)}
    paths = write_whole(folder, state, num_files=files)
    return paths, plain_digest(paths), sum(os.path.getsize(p) for p in paths)


class Bench:
    def __init__(self, cluster: Cluster, store: S3Store, uri: str, digest: str, nbytes: int, work: Path,
                 timeout: int):
        self.cluster, self.store, self.uri, self.digest, self.nbytes = cluster, store, uri, digest, nbytes
        self.work, self.timeout = work, timeout
        self.env = {**store.env(), "PYTHONPATH": str(ROOT), "DISTLOAD_CACHE_DIR": "", "DISTLOAD_SECRET": SECRET}
        self.count = 0

    def _finish(self, name: str, report: Path, started: float, load_before: float, sent: int, logs: str) -> dict:
        wall = time.monotonic() - started
        if not report.exists():
            raise RuntimeError(f"{name}: no report\n{logs[-4000:]}")
        ranks = json.loads(report.read_text())["ranks"]
        wrong = [r["rank"] for r in ranks if r["digest"] != self.digest]
        if wrong:
            raise RuntimeError(f"{name}: rank(s) {wrong} loaded other bytes than a plain read")
        seconds = max(r["seconds"] for r in ranks)
        return {"case": name, "seconds": round(seconds, 3), "wall_s": round(wall, 2), "ranks": len(ranks),
                "hosts": sorted({r["hostname"] for r in ranks}), "paths": sorted({r["path"] for r in ranks}),
                "store_sent_bytes": sent, "store_sent_x": round(sent / self.nbytes, 3),
                "gbit_per_s": round(self.nbytes * 8 / seconds / 1e9, 3), "load_average_before": load_before}

    def job(self, name: str, hosts: list[str], nproc: int, extra: list[str]) -> dict:
        """One torchrun job of ``nproc`` ranks a host over ``hosts``."""
        self.count += 1
        report = self.work / f"report-{self.count}.json"
        logs = self.work / f"logs-{self.count}"
        args = ["-m", "distload", "load", self.uri, "--no-progress", "--report-json", str(report),
                "--timeout", str(self.timeout), *extra]
        load_before, before, started = load_average(), self.store.sent_bytes(), time.monotonic()
        procs = self.cluster.torchrun(hosts, nproc, args, env=self.env, logs=str(logs), port=29400 + self.count % 100)
        codes = [p.wait(self.timeout + 120) for p in procs]
        sent = self.store.sent_bytes() - before
        text = "\n".join((logs / f"{h}.log").read_text(errors="replace") for h in hosts)
        if codes != [0] * len(hosts):
            raise RuntimeError(f"{name}: exit codes {codes}\n{text[-4000:]}")
        return self._finish(name, report, started, load_before, sent, text)

    def single(self, name: str, host: str, source: str) -> dict:
        """One process (1 rank) on ``host`` loading ``source``."""
        self.count += 1
        report = self.work / f"report-{self.count}.json"
        load_before, before, started = load_average(), self.store.sent_bytes(), time.monotonic()
        done = self.cluster[host].check([sys.executable, "-m", "distload", "load", source, "--no-progress",
                                         "--report-json", str(report), "--timeout", str(self.timeout)],
                                        env={**self.env, "OMP_NUM_THREADS": "1"}, timeout=self.timeout + 60)
        sent = self.store.sent_bytes() - before
        if done.returncode != 0:
            raise RuntimeError(f"{name}: exit code {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
        return self._finish(name, report, started, load_before, sent, done.stdout)


def rotated(cases: list, rep: int) -> list:
    k = rep % len(cases)
    return cases[k:] + cases[:k]


def summarize(runs: list[dict], cases: list[str]) -> dict[str, dict]:
    out = {}
    for case in cases:
        mine = [r for r in runs if r["case"] == case]
        seconds = [r["seconds"] for r in mine]
        out[case] = {"median_s": round(statistics.median(seconds), 3), "min_s": min(seconds), "max_s": max(seconds),
                     "median_wall_s": round(statistics.median(r["wall_s"] for r in mine), 2),
                     "store_sent_x": round(statistics.median(r["store_sent_x"] for r in mine), 3),
                     "paths": mine[0]["paths"], "ranks": mine[0]["ranks"], "hosts": len(mine[0]["hosts"])}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--store-rate", type=float, default=1e9, help="the store's link, bit/s")
    parser.add_argument("--host-rate", type=float, default=10e9, help="every loading host's link, bit/s")
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--only", choices=["shared", "replica"], default=None)
    parser.add_argument("--json")
    parser.add_argument("--md")
    args = parser.parse_args()

    hosts = ["node0", "node1", "node2", "node3"]
    with tempfile.TemporaryDirectory(prefix="bench-cluster-loads-") as tmp:
        work = Path(tmp)
        paths, digest, nbytes = make_checkpoint(str(work / "ckpt"), args.size_mib, args.files)
        with Cluster([*hosts, "store"], rate_bits_per_s=args.host_rate, rates={"store": args.store_rate}) as cluster:
            measured = {"store -> node0": cluster.throughput("store", "node0", 2.0)["bits_per_s"],
                        "node0 -> node1": cluster.throughput("node0", "node1", 2.0)["bits_per_s"]}
            store = S3Store(cluster["store"], str(work / "moto"))
            uri = store.upload_folder(str(work / "ckpt"), "bench")
            bench = Bench(cluster, store, uri, digest, nbytes, work, args.timeout)
            runs: list[dict] = []
            n = args.ranks_per_host
            shared_cases = {
                "1 host, auto": lambda: bench.job("1 host, auto", hosts[:1], n, []),
                "4 hosts, auto (shared reads)": lambda: bench.job("4 hosts, auto (shared reads)", hosts, n, []),
                "4 hosts, Run:ai distributed per node": lambda: bench.job(
                    "4 hosts, Run:ai distributed per node", hosts, n,
                    ["--load-format", "runai_streamer", "--model-loader-extra-config", '{"distributed": true}']),
            }
            if args.only in (None, "shared"):
                for rep in range(args.repeats):
                    for name in rotated(list(shared_cases), rep):
                        runs.append({**shared_cases[name](), "repeat": rep, "table": "shared"})
                        print(json.dumps(runs[-1]), flush=True)
            server_log = work / "serve.log"
            if args.only in (None, "replica"):
                address = f"tcp://{cluster['node0'].address}:29611"
                with open(server_log, "w") as out:
                    server = cluster["node0"].run(
                        [sys.executable, "-m", "distload", "serve", uri, "--address", address, "--no-progress",
                         "--timeout", str(args.timeout)], env={**bench.env, "OMP_NUM_THREADS": "1"},
                        stdout=out, stderr=subprocess.STDOUT)
                deadline = time.monotonic() + args.timeout
                while "serves" not in server_log.read_text() and time.monotonic() < deadline:
                    if server.poll() is not None:
                        raise RuntimeError(f"serve ended: {server_log.read_text()[-3000:]}")
                    time.sleep(0.2)
                replica_cases = {"new replica from the running job (serve)": address,
                                 "new replica from the store": uri}
                for rep in range(args.repeats):
                    for name in rotated(list(replica_cases), rep):
                        runs.append({**bench.single(name, "node1", replica_cases[name]), "repeat": rep,
                                     "table": "replica"})
                        print(json.dumps(runs[-1]), flush=True)
                server.terminate()

    summary = summarize(runs, list(dict.fromkeys(r["case"] for r in runs)))
    ratios = {}
    if "4 hosts, auto (shared reads)" in summary:
        one = summary["1 host, auto"]["median_s"]
        ratios["4-host shared / 1-host"] = round(summary["4 hosts, auto (shared reads)"]["median_s"] / one, 2)
        ratios["4-host Run:ai per node / 1-host"] = round(
            summary["4 hosts, Run:ai distributed per node"]["median_s"] / one, 2)
    if "new replica from the store" in summary:
        ratios["replica: store / serve (x faster)"] = round(
            summary["new replica from the store"]["median_s"] / summary["new replica from the running job (serve)"]["median_s"], 2)
    result = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "load_average_end": load_average()},
        "links": {"store_bits_per_s": args.store_rate, "host_bits_per_s": args.host_rate,
                  "measured_bits_per_s": {k: round(v) for k, v in measured.items()}},
        "checkpoint": {"bytes": nbytes, "files": args.files}, "ranks_per_host": args.ranks_per_host,
        "repeats": args.repeats, "runs": runs, "summary": summary, "ratios": ratios,
    }
    print(json.dumps({"summary": summary, "ratios": ratios}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(result))


def markdown(result: dict) -> str:
    links, machine = result["links"], result["machine"]
    m = links["measured_bits_per_s"]
    lines = [
        "# Loads across hosts (issue 45)",
        "",
        "`python benchmarks/bench_cluster_loads.py` on a cluster of network namespaces on one machine "
        f"({machine['cpus']} CPUs, {machine['platform']}, torch {machine['torch']}): an S3 store (moto) on a host "
        f"of its own, its link shaped to {links['store_bits_per_s'] / 1e9:g} Gbit/s; loading hosts at "
        f"{links['host_bits_per_s'] / 1e9:g} Gbit/s (measured, one TCP stream: store -> node0 "
        f"{m['store -> node0'] / 1e9:.2f} Gbit/s, node0 -> node1 {m['node0 -> node1'] / 1e9:.2f} Gbit/s). "
        f"Checkpoint {result['checkpoint']['bytes'] / MIB:.0f} MiB in {result['checkpoint']['files']} files; "
        f"{result['repeats']} repeats interleaved; a time is the report's slowest rank (median), wall is the whole "
        "job with its start; store sent = bytes out of the store's interface / checkpoint bytes. Every load "
        "checked bit for bit against a plain safetensors read.",
        "",
        "| case | ranks | hosts | path | median s | min-max s | median wall s | store sent | load avg before |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case, s in result["summary"].items():
        loads = [r["load_average_before"] for r in result["runs"] if r["case"] == case]
        lines.append(f"| {case} | {s['ranks']} | {s['hosts']} | {', '.join(s['paths'])} | {s['median_s']:.2f} | "
                     f"{s['min_s']:.2f}-{s['max_s']:.2f} | {s['median_wall_s']:.1f} | {s['store_sent_x']:.2f}x | "
                     f"{min(loads):.1f}-{max(loads):.1f} |")
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in result["ratios"].items()]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
