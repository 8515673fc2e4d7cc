"""Loading from an object store (s3rver on loopback): Run:ai's concurrency, download-then-load, 2 ranks.

    python benchmarks/bench_object_store.py                          # 512 MiB, concurrency 1 4 8 16 32, 3 repeats
    python benchmarks/bench_object_store.py --size-mib 32 --repeats 1   # a quick check

Needs s3rver (``cd tests/node && npm ci``, as .ci/run does) and ``pip install -e ".[s3,test]"``
(boto3, Run:ai's S3 reader; the server and byte-counting proxy helpers come from
tests/object_store_servers.py, which imports pytest). Nothing leaves 127.0.0.1.

Starts s3rver on a free loopback port, writes a Llama-shaped bf16 checkpoint of ``--size-mib``
(``distload.cli.demo.write_demo_checkpoint``: two files, index.json, config.json), uploads it with
boto3, then, in ONE run (repeats interleaved, median of ``--repeats``):

- **download-then-load** (what a user does without a streaming loader): in one process, boto3
  lists the prefix and downloads every object to a local temp folder (``download_file``: boto3's
  managed transfer with its default concurrency, one file after the other), then plain
  ``safetensors.torch.load_file`` reads each file and every tensor is copied out of the map;
- **Run:ai**, 1 rank: ``torchrun --nproc-per-node 1 -m distload load s3://... --load-format
  runai_streamer --model-loader-extra-config '{"concurrency": C}'`` for each ``--concurrency``;
- **2 ranks**, whole checkpoint: ``{"distributed": false}`` (each rank reads everything) against
  ``{"distributed": true}`` (cooperative). Timed straight against s3rver; then one more run of
  each through a byte-counting TCP proxy gives the bytes the server served (listings, headers,
  HTTP framing included) against the checkpoint's size. Target: <= 1.05x cooperative, ~2x alone.

Seconds are what each load itself took (distload's report: listing, headers and data; the
baseline's own clock: listing, download and load), without process start-up; for 2 ranks the
slowest rank's. Every load's digest is checked against a plain safetensors read of the local
files. s3rver serves from files on local disk (in the page cache after the upload): the numbers
measure the clients and the server on this machine, not a network. Results:
benchmarks/results/object_store.json and object_store.md.
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
REPO = os.path.dirname(HERE)
TESTS = os.path.join(REPO, "tests")
GIB = 2**30
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


# -- the baseline, in its own process -------------------------------------------------------------

def baseline_worker(uri: str, dest: str, out: str) -> None:
    """boto3 downloads every object under ``uri`` into ``dest``, then safetensors loads them."""
    import boto3
    import torch
    from botocore.config import Config
    from safetensors.torch import load_file

    from distload.loading.report import state_digest

    torch.set_num_threads(1)
    bucket, prefix = uri[len("s3://"):].split("/", 1)
    prefix = prefix.rstrip("/") + "/"
    start = time.perf_counter()  # imports excluded, as distload's report excludes them
    client = boto3.session.Session().client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"],
                                            config=Config(s3={"addressing_style": "path"}))
    keys = [obj["Key"] for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix, Delimiter="/") for obj in page.get("Contents", [])]
    paths = []
    for key in keys:  # one file after the other, each with boto3's default managed transfer
        path = os.path.join(dest, key[len(prefix):])
        client.download_file(bucket, key, path)
        paths.append(path)
    downloaded = time.perf_counter()
    state = {}
    for path in sorted(p for p in paths if p.endswith(".safetensors")):
        state.update({name: tensor.clone() for name, tensor in load_file(path).items()})
    end = time.perf_counter()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    with open(out, "w") as f:
        json.dump({"seconds": end - start, "download_seconds": downloaded - start,
                   "load_seconds": end - downloaded, "nbytes": nbytes, "digest": state_digest(state),
                   "path": "boto3 download_file + safetensors"}, f)


def run_baseline(uri: str, env: dict, root: str) -> list[dict]:
    dest = tempfile.mkdtemp(prefix="download-", dir=root)
    out = os.path.join(root, "baseline.json")
    try:
        cmd = [sys.executable, os.path.abspath(__file__), "--baseline-worker", uri, dest, out]
        result = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=1800)
        if result.returncode != 0:
            raise SystemExit(f"download-then-load failed:\n{result.stderr[-3000:]}")
        with open(out) as f:
            return [json.load(f)]
    finally:
        shutil.rmtree(dest, ignore_errors=True)


# -- distload runs ---------------------------------------------------------------------------------

def run_load(uri: str, extra: dict, nproc: int, env: dict, report: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "distload", "load", uri, "--load-format", "runai_streamer",
           "--model-loader-extra-config", json.dumps(extra), "--report-json", report, "--no-progress"]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    with open(report) as f:
        return [{"seconds": r["seconds"], "nbytes": r["nbytes"], "digest": r["digest"], "path": r["path"],
                 "peak_rss": r.get("peak_rss_bytes") or 0} for r in json.load(f)["ranks"]]


def summarize(method: str, ranks: int, reps: list[list[dict]], expected: str, **extra) -> dict:
    for rep in reps:
        for r in rep:
            if r["digest"] != expected:
                raise SystemExit(f"{method}: digest {r['digest'][:16]} != plain safetensors {expected[:16]}")
    seconds = statistics.median(max(r["seconds"] for r in rep) for rep in reps)
    nbytes = sum(r["nbytes"] for r in reps[0])
    row = {"method": method, "ranks": ranks, "path": ",".join(sorted({r["path"] for r in reps[0]})),
           "seconds": round(seconds, 3), "seconds_each": [round(max(r["seconds"] for r in rep), 3) for rep in reps],
           "gib_per_s_per_rank": round(nbytes / ranks / GIB / seconds, 3),
           "gib_per_s_total": round(nbytes / GIB / seconds, 3), "digest_ok": True}
    if "download_seconds" in reps[0][0]:
        row["download_seconds"] = round(statistics.median(rep[0]["download_seconds"] for rep in reps), 3)
        row["load_seconds"] = round(statistics.median(rep[0]["load_seconds"] for rep in reps), 3)
    if reps[0][0].get("peak_rss"):
        row["peak_rss_gib_max_rank"] = round(max(r["peak_rss"] for rep in reps for r in rep) / GIB, 3)
    row.update(extra)
    return row


# -- machine and outputs -----------------------------------------------------------------------------

def machine() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import psutil
    import torch

    def ver(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    try:
        with open(os.path.join(TESTS, "node", "node_modules", "s3rver", "package.json")) as f:
            s3rver = json.load(f)["version"]
    except OSError:
        s3rver = "?"
    node = subprocess.run(["node", "--version"], check=False, capture_output=True, text=True).stdout.strip()
    return {"cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / GIB, 1),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "runai_model_streamer": ver("runai-model-streamer"),
            "runai_model_streamer_s3": ver("runai-model-streamer-s3"), "boto3": ver("boto3"),
            "safetensors": ver("safetensors"), "s3rver": s3rver, "node": node}


def write_outputs(out_dir: str, result: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "object_store.json"), "w") as f:
        json.dump(result, f, indent=2)
    m = result["machine"]
    size_mib = result["checkpoint_bytes"] / 2**20
    lines = [f"{size_mib:.0f} MiB bf16 Llama-shaped checkpoint ({result['num_files']} files) on s3rver {m['s3rver']} "
             f"(node {m['node']}) on 127.0.0.1, median of {result['repeats']}; {m['cpus']} CPUs, "
             f"{m['memory_gib']} GiB, {m['platform']}, torch {m['torch']}, Run:ai {m['runai_model_streamer']} "
             f"(S3 {m['runai_model_streamer_s3']}), boto3 {m['boto3']}, safetensors {m['safetensors']}. "
             f"Seconds: the load itself (listing, headers, data), without process start-up; slowest rank.", "",
             "| ranks | method | path | s | GiB/s per rank | GiB/s total | speed vs download-then-load "
             "| served by the server / checkpoint |", "|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        method = row["method"]
        if "download_seconds" in row:
            method += f" (download {row['download_seconds']} s + load {row['load_seconds']} s)"
        served = f"{row['served_ratio']}x" if "served_ratio" in row else ""
        lines.append(f"| {row['ranks']} | {method} | {row['path']} | {row['seconds']} | {row['gib_per_s_per_rank']} "
                     f"| {row['gib_per_s_total']} | {row.get('vs_download_then_load', '')} | {served} |")
    coop = next((r for r in result["rows"] if r.get("served_ratio") is not None and r["cooperative"]), None)
    alone = next((r for r in result["rows"] if r.get("served_ratio") is not None and not r["cooperative"]), None)
    if coop and alone:
        lines += ["", f"Bytes served for 2 ranks (through a byte-counting proxy, one run each): cooperative "
                      f"{coop['served_ratio']}x the checkpoint (target <= 1.05x: "
                      f"{'met' if coop['served_ratio'] <= 1.05 else 'MISSED'}), each rank alone "
                      f"{alone['served_ratio']}x (expected ~2x)."]
    with open(os.path.join(out_dir, "object_store.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


# -- main ----------------------------------------------------------------------------------------------

def upload(env: dict, bucket: str, prefix: str, folder: str) -> None:
    import boto3
    from botocore.config import Config

    client = boto3.session.Session(aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                                   aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                                   region_name=env["AWS_DEFAULT_REGION"]).client(
        "s3", endpoint_url=env["AWS_ENDPOINT_URL"], config=Config(s3={"addressing_style": "path"}))
    for name in sorted(os.listdir(folder)):
        client.upload_file(os.path.join(folder, name), bucket, f"{prefix}/{name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--dir", default=None, help="work folder (default: a temp folder in /var/tmp, removed)")
    parser.add_argument("--baseline-worker", nargs=3, metavar=("URI", "DEST", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_worker:
        baseline_worker(*args.baseline_worker)
        return 0

    sys.path.insert(0, REPO)
    sys.path.insert(0, TESTS)
    if not os.path.exists(os.path.join(TESTS, "node", "node_modules", ".bin", "s3rver")):
        raise SystemExit("s3rver is not installed: cd tests/node && npm ci (as .ci/run does)")
    from object_store_servers import ByteCountingProxy, start_s3rver

    from distload.cli.demo import expected_digests, write_demo_checkpoint

    began = time.monotonic()
    root = args.dir or tempfile.mkdtemp(prefix="distload-bench-s3-", dir="/var/tmp")
    os.makedirs(root, exist_ok=True)
    server = start_s3rver(root)  # its data in root/s3rver-data, on local disk
    try:
        whole, sharded = write_demo_checkpoint(os.path.join(root, "ckpt"), 1, args.size_mib)
        shutil.rmtree(sharded)
        files = sorted(n for n in os.listdir(whole) if n.endswith(".safetensors"))
        checkpoint_bytes = sum(os.path.getsize(os.path.join(whole, n)) for n in files)
        expected = expected_digests(whole, 1, sharded=False)[0]
        base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and k not in server.unset_keys()}
        base.setdefault("OMP_NUM_THREADS", "1")
        base["PYTHONPATH"] = REPO + (os.pathsep + base["PYTHONPATH"] if base.get("PYTHONPATH") else "")
        env = {**base, **server.env()}
        upload(env, server.bucket, "llama", whole)
        uri = server.uri("llama")
        print(f"{checkpoint_bytes / 2**20:.0f} MiB in {len(files)} files at {uri} (s3rver on 127.0.0.1:"
              f"{server.port}); {args.repeats} repeat(s)", flush=True)

        report = os.path.join(root, "report.json")
        cases = [("download-then-load", 1, None)] + \
                [(f"Run:ai, concurrency {c}", 1, {"concurrency": c}) for c in args.concurrency] + \
                [("Run:ai, each rank alone", 2, {"distributed": False}),
                 ("Run:ai, cooperative", 2, {"distributed": True})]
        reps: dict[str, list] = {label: [] for label, _, _ in cases}
        for repeat in range(args.repeats):  # interleaved: drift hits every case alike
            for label, nproc, extra in cases:
                if extra is None:
                    reps[label].append(run_baseline(uri, env, root))
                else:
                    reps[label].append(run_load(uri, extra, nproc, env, report))
                print(f"[{repeat + 1}/{args.repeats}] {label} ({nproc} rank(s)): "
                      f"{max(r['seconds'] for r in reps[label][-1]):.3f} s", flush=True)

        served: dict[str, dict] = {}
        for label, nproc, extra in cases[-2:]:
            proxy = ByteCountingProxy(server.port)
            try:
                ranks = run_load(uri, extra, nproc, {**base, **server.env(proxy.port)}, report)
            finally:
                proxy.close()
            served[label] = {"served_bytes": proxy.served, "served_ratio": round(proxy.served / checkpoint_bytes, 4),
                             "seconds_through_proxy": round(max(r["seconds"] for r in ranks), 3),
                             "cooperative": bool(extra["distributed"])}
            if any(r["digest"] != expected for r in ranks):
                raise SystemExit(f"{label} through the proxy: digest mismatch")
            print(f"{label} through the proxy: served {proxy.served} bytes = {served[label]['served_ratio']}x",
                  flush=True)

        rows = [summarize(label, nproc, reps[label], expected, **served.get(label, {}))
                for label, nproc, _ in cases]
        for row in rows:
            if row["ranks"] == 1:
                row["vs_download_then_load"] = round(rows[0]["seconds"] / row["seconds"], 2)
        write_outputs(args.out, {"machine": machine(), "size_mib": args.size_mib, "repeats": args.repeats,
                                 "checkpoint_bytes": checkpoint_bytes, "num_files": len(files),
                                 "concurrency": args.concurrency,
                                 "elapsed_s": round(time.monotonic() - began), "rows": rows})
    finally:
        server.stop()
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
