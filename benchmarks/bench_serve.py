"""Loading from a running job (``distload serve`` + ``distload load tcp://``) against a cold load
from local disk and a load from the S3 emulator (issue 33, item 2's goals).

    python benchmarks/bench_serve.py                              # 256 MiB, 3 repeats
    python benchmarks/bench_serve.py --size-mib 32 --repeats 1    # a quick check

Needs s3rver (``cd tests/node && npm ci``) and ``pip install -e ".[s3,test]"`` (the server and
the byte-counting proxy come from tests/object_store_servers.py). Nothing leaves 127.0.0.1.

Writes a Llama-shaped bf16 checkpoint of ``--size-mib`` (hidden 2048: tensors of real models'
sizes) with its config.json, uploads it to s3rver, and starts ``distload serve`` on the S3 URI,
through a byte-counting proxy in front of the server (so its one read is counted too). Then every
load is a job of its own (``python -m distload load ... --report-json``; TP 2: two ranks started
with torchrun's environment), repeats interleaved, medians:

- **server**: ``distload load tcp://127.0.0.1:PORT`` (TP 1: whole tensors; TP 2: each rank its slices);
- **local disk, cold**: the same files on local disk, evicted from the page cache before each load
  (``posix_fadvise(DONTNEED)`` on every file: what a node that has not read them has);
- **local disk, page cache**: the same, the files in the page cache (a node that read them just now);
- **S3 emulator**: ``s3://`` (Run:ai's reader at TP 1, distload's ranged reads at TP 2).

Seconds are each job's load (its report: the slowest rank), not its process start-up. Per job: the
bytes the store served (the proxy), and per rank its bytes received from the server against its
tensors' bytes (its slices). Every rank's digest is checked against the same load from local disk.
Goals (issue 33): 0 bytes from the store, each rank at most 1.05x its slices, at least as fast as
a cold load from local disk. Results: benchmarks/results/serve.json and serve.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from bench_cache import machine  # the same machine description as the cache's results

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TESTS = os.path.join(REPO, "tests")
GIB = 2**30
MIB = 2**20


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_job(args: list[str], ranks: int, report: str, env: dict) -> dict:
    """``python -m distload load ARGS --report-json REPORT`` as one job of ``ranks`` processes."""
    port = str(free_port())
    procs = []
    for rank in range(ranks):
        launch = {} if ranks == 1 else {"RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
                                        "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
                                        "MASTER_PORT": port}
        procs.append(subprocess.Popen([sys.executable, "-m", "distload", "load", *args, "--report-json", report,
                                       "--no-progress"], env=job_env({**env, **launch}), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"load {args} failed:\n" + "\n".join(outputs))
    with open(report) as f:
        return json.load(f)


def evict(files: list[str]) -> None:
    """Drop the files' pages from the page cache: the next read comes from the disk."""
    os.sync()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    sys.path.insert(0, TESTS)
    from object_store_servers import ByteCountingProxy, start_s3rver

    from distload.cli.demo import write_demo_checkpoint

    at_start = machine()
    root = tempfile.mkdtemp(prefix="distload-bench-serve-")
    store = start_s3rver(root)
    serving = None
    try:
        whole, _ = write_demo_checkpoint(os.path.join(root, "src"), 1, size_mib=args.size_mib, hidden=2048)
        files = sorted(os.path.join(whole, n) for n in os.listdir(whole) if n.endswith(".safetensors"))
        nbytes = sum(os.path.getsize(p) for p in files)
        uri = store.upload_folder(whole, "model")
        proxy = ByteCountingProxy(store.port)
        s3_env = store.env(proxy.port)
        address = f"tcp://127.0.0.1:{free_port()}"
        log_path = os.path.join(root, "server.log")
        before = proxy.served
        with open(log_path, "w") as log:
            serving = subprocess.Popen([sys.executable, "-m", "distload", "serve", uri, "--address", address,
                                        "--no-progress"], env=job_env(s3_env), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while "serves" not in open(log_path).read():
            if serving.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start:\n" + open(log_path).read())
            time.sleep(0.1)
        server_read = proxy.served - before

        cases = [("server", 1, [address]), ("server", 2, [address, "-tp", "2"]),
                 ("local disk, cold", 1, [whole]), ("local disk, cold", 2, [whole, "-tp", "2"]),
                 ("local disk, page cache", 1, [whole]), ("local disk, page cache", 2, [whole, "-tp", "2"]),
                 ("S3 emulator", 1, [uri]), ("S3 emulator", 2, [uri, "-tp", "2"])]
        runs: dict[str, list[dict]] = {f"{name}, TP {tp}": [] for name, tp, _ in cases}
        reference: dict[int, list[str]] = {}
        for repeat in range(args.repeats):
            for name, tp, load_args in cases:
                if name == "local disk, cold":
                    evict(files)
                before = proxy.served
                report = run_job(load_args, tp, os.path.join(root, "report.json"), s3_env)
                ranks = report["ranks"]
                digests = [r["digest"] for r in ranks]
                if name.startswith("local disk"):
                    reference.setdefault(tp, digests)
                runs[f"{name}, TP {tp}"].append({
                    "seconds": report["total"]["seconds"], "store_bytes": proxy.served - before,
                    "rank_bytes": [r["nbytes"] for r in ranks],
                    "server_bytes": [r["server_bytes"] for r in ranks], "digests": digests,
                    "reader": ranks[0]["path"] if name != "server" else "server"})
        for key, results in runs.items():
            tp = 2 if key.endswith("TP 2") else 1
            for result in results:
                if result["digests"] != reference[tp]:
                    raise SystemExit(f"{key}: digests {result['digests']} differ from local disk's {reference[tp]}")
        proxy.close()
    finally:
        if serving is not None and serving.poll() is None:
            serving.send_signal(signal.SIGTERM)
            serving.wait(timeout=60)
        store.stop()
        import shutil

        shutil.rmtree(root, ignore_errors=True)

    summary = {}
    for key, results in runs.items():
        summary[key] = {"seconds": round(statistics.median(r["seconds"] for r in results), 4),
                        "store_bytes": int(statistics.median(r["store_bytes"] for r in results)),
                        "reader": results[0]["reader"], "rank_bytes": results[0]["rank_bytes"]}
        if results[0]["server_bytes"][0] is not None:
            summary[key]["received_over_slices"] = [round(s / n, 4) for s, n in zip(results[0]["server_bytes"],
                                                                                     results[0]["rank_bytes"])]
    ratios = {}
    for tp in (1, 2):
        served = summary[f"server, TP {tp}"]["seconds"]
        ratios[f"TP {tp}: server speed / cold local disk speed"] = round(
            summary[f"local disk, cold, TP {tp}"]["seconds"] / served, 3)
        ratios[f"TP {tp}: server speed / page-cache local disk speed"] = round(
            summary[f"local disk, page cache, TP {tp}"]["seconds"] / served, 3)
        ratios[f"TP {tp}: server speed / S3 emulator speed"] = round(summary[f"S3 emulator, TP {tp}"]["seconds"] / served, 3)
    result = {"machine": {**at_start, "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
              "checkpoint_bytes": nbytes, "repeats": args.repeats, "server_read_store_bytes": server_read,
              "summary": summary, "ratios": ratios, "runs": runs}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "serve.json"), "w") as f:
        json.dump(result, f, indent=2)
    m = result["machine"]
    lines = [
        "# Loading from a running job against local disk and the S3 emulator (benchmarks/bench_serve.py)",
        "",
        f"{nbytes / MIB:.0f} MiB Llama-shaped bf16 checkpoint (hidden 2048) with its config.json; s3rver on "
        f"loopback behind a byte-counting proxy; `distload serve` of the s3:// URI on the same machine "
        f"(its one read: {server_read / MIB:.0f} MiB from the store). Every load a job of its own (CPU, "
        f"gloo), its load's seconds (slowest rank, start-up excluded), medians of {args.repeats} interleaved "
        f"repeats, every rank's digest checked against the load from local disk.",
        f"Machine: {m['cpus']} CPUs, {m['memory_gib']} GiB, {m['platform']}, torch {m['torch']}, load average "
        f"{m['load_average_at_start']} at the start, {m['load_average_at_end']} at the end (shared machine).",
        "",
        "| load | reader | seconds | GiB/s (job) | bytes from the store | each rank: received from the server / its slices |",
        "|---|---|---|---|---|---|",
    ]
    for key, s in summary.items():
        speed = sum(s["rank_bytes"]) / GIB / s["seconds"]
        received = ", ".join(f"{x:.4f}" for x in s.get("received_over_slices", [])) or "-"
        lines.append(f"| {key} | {s['reader']} | {s['seconds']:.3f} | {speed:.2f} | {s['store_bytes']:,} | "
                     f"{received} |")
    lines += ["", "| ratio (same run) | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in ratios.items()]
    lines.append("")
    with open(os.path.join(args.out, "serve.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
