"""Weight sync across hosts (issue 45): a cluster of network namespaces on this machine
(tests/cluster), every host's link shaped with tbf, Debian's /etc/hosts, no GLOO_SOCKET_IFNAME::

    python benchmarks/bench_cluster.py --json benchmarks/results/cluster.json --md benchmarks/results/cluster.md

Three cases, each in one run with its repeats interleaved:

1. delta / full at 1 Gbit/s: a trainer host -> one inference host. The trainer holds two channels
   to the same inference process, one with deltas on and one with them off, and pushes every
   version through both, alternating which goes first. Versions after the first move 4% of the
   bf16 elements by one ulp each (what an AdamW step at lr 1e-6 does to a bf16 model: 2-3% of the
   elements in results/sync_delta.md). Verified pushes; every received tensor is also compared bit
   for bit with the expected version (outside the timings).
2. the same at 10 Gbit/s.
3. relays: full pushes from the trainer (its link 1 Gbit/s, every link 1 Gbit/s) to a job of one
   inference rank on one host and to a job of four ranks on four hosts (whole model each: one
   place, so a relay chain: the trainer sends each byte once), alternating.

Every member is a plain process (tests/cluster_sync_driver.py) inside its host. The machine's CPUs
are shared by every host's processes: what a host does on its own CPUs elsewhere (compare, encode,
patch, verify) competes here with the others'.
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
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from cluster import Cluster  # noqa: E402

DRIVER = str(ROOT / "tests" / "cluster_sync_driver.py")
SECRET = "bench-cluster-secret-0123456789abcdef"
# A Llama of 302 MiB in bf16: hidden 1024, 8 layers, 16 heads of 64 (8 KV heads), vocabulary 32000.
MODEL = {"hidden": 1024, "inter": 2816, "layers": 8, "vocab": 32000, "heads": 16, "kv_heads": 8, "head_dim": 64}


def state_bytes(model: dict) -> int:
    h, i, v = model["hidden"], model["inter"], model["vocab"]
    q, kv = model["heads"] * model["head_dim"], model["kv_heads"] * model["head_dim"]
    layer = q * h * 2 + kv * h * 2 + i * h * 3 + 2 * h
    return 2 * (2 * v * h + model["layers"] * layer + h)


class Run:
    def __init__(self, cluster: Cluster, out: Path, timeout: float, bucket: int, model: dict):
        self.cluster, self.out, self.timeout, self.bucket, self.model = cluster, out, timeout, bucket, model
        self.root = out
        self.procs: list[subprocess.Popen] = []
        self.port = 23000

    def case(self, name: str) -> None:
        """Logs and marks of the next case in a folder of their own."""
        self.out = self.root / name
        self.out.mkdir(parents=True, exist_ok=True)

    def address(self) -> str:
        self.port += 1
        return f"tcp://{self.cluster['train'].address}:{self.port}"

    def start(self, host: str, name: str, role: str, rank: int, size: int, channels: dict, steps: list[str]):
        cfg = {"out": str(self.out), "name": name, "role": role, "rank": rank, "size": size, "tp": 1,
               "channels": channels, "timeout": self.timeout, "bucket": self.bucket, "model": self.model,
               "change": 0.04, "steps": steps, "settle": True}
        err = open(self.out / f"{name}{rank}.stderr", "w")
        self.procs.append(self.cluster[host].run(
            [sys.executable, DRIVER, json.dumps(cfg)], stdout=subprocess.DEVNULL, stderr=err,
            env={"DISTLOAD_SECRET": SECRET, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}))
        err.close()

    def finish(self, limit: float) -> None:
        deadline = time.monotonic() + limit
        for proc in self.procs:
            code = proc.wait(max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise SystemExit(f"a member exited {code}: see {self.out}")
        self.procs = []

    def events(self, member: str, event: str) -> list[dict]:
        path = self.out / f"{member}.jsonl"
        return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == event]


def delta_vs_full(run: Run, repeats: int) -> dict:
    run.case("delta_" + str(run.port))
    channels = {"delta": run.address(), "full": run.address()}
    order = []
    for v in range(2, repeats + 2):  # version 1: both channels' first (whole) push, pairs connected
        order += [("delta", v), ("full", v)] if v % 2 == 0 else [("full", v), ("delta", v)]
    pushes = [("delta", 1), ("full", 1)] + order
    # Each push waits until the receiver has checked the one before and is in its receive again:
    # a push's time is its own, not the receiver's check of the last one.
    trainer = [s for k, (c, v) in enumerate(pushes) for s in (f"gate:inf0-{k}", f"push:{c}:{v}")]
    receiver = [s for k, (c, _) in enumerate(pushes) for s in (f"mark:inf0-{k}", f"recv:{c}")]
    run.start("train", "trainer", "trainer", 0, 1, channels, trainer)
    run.start("inf0", "inf", "inference", 0, 1, channels, receiver)
    run.finish(run.timeout * (len(pushes) + 2))
    pushes = run.events("trainer0", "push")[2:]
    recvs = run.events("inf0", "recv")[2:]
    assert all(p["ok"] for p in pushes) and all(r["ok"] and r["exact"] for r in recvs), (pushes, recvs)
    rows = []
    for v in range(2, repeats + 2):
        d = next(p for p in pushes if p["version"] == v and p["channel"] == "delta")
        f = next(p for p in pushes if p["version"] == v and p["channel"] == "full")
        dr = next(r for r in recvs if r["version"] == v and r["channel"] == "delta")
        fr = next(r for r in recvs if r["version"] == v and r["channel"] == "full")
        assert d["delta"] and not f["delta"] and d["verified"] and f["verified"]
        rows.append({"version": v, "first": "delta" if v % 2 == 0 else "full",
                     "delta_s": d["seconds"], "full_s": f["seconds"], "ratio": d["seconds"] / f["seconds"],
                     "delta_wire": d["wire"], "full_wire": f["wire"],
                     "delta_recv_s": dr["stats_seconds"], "full_recv_s": fr["stats_seconds"],
                     "delta_settle_s": d.get("settle")})
    return {"rows": rows, "ratio_median": statistics.median(r["ratio"] for r in rows),
            "delta_s_median": statistics.median(r["delta_s"] for r in rows),
            "full_s_median": statistics.median(r["full_s"] for r in rows),
            "wire_ratio": rows[0]["delta_wire"] / rows[0]["full_wire"]}


def tags(run: Run, repeats: int) -> dict:
    """Full verified pushes, trainer host -> one inference host, the buckets checked with the keyed
    tags (the code's) and with the unkeyed sums they replaced (bench_sync._unkeyed_sums), both
    sides switching alike before each push, alternating which goes first."""
    run.case("tags_" + str(run.port))
    channels = {"full": run.address()}
    order = [("keyed", 1), ("unkeyed", 2)]  # warm-ups
    for v in range(3, 2 * repeats + 3, 2):
        pair = [("keyed", v), ("unkeyed", v + 1)] if v % 4 == 3 else [("unkeyed", v), ("keyed", v + 1)]
        order += pair
    trainer = [s for k, (sums, v) in enumerate(order) for s in (f"gate:inf0-{k}", f"sums:{sums}", f"push:full:{v}")]
    receiver = [s for k, (sums, _) in enumerate(order) for s in (f"sums:{sums}", f"mark:inf0-{k}", "recv:full")]
    run.start("train", "trainer", "trainer", 0, 1, channels, trainer)
    run.start("inf0", "inf", "inference", 0, 1, channels, receiver)
    run.finish(run.timeout * (len(order) + 2))
    pushes = run.events("trainer0", "push")[2:]
    recvs = run.events("inf0", "recv")[2:]
    assert all(p["ok"] and p["verified"] for p in pushes) and all(r["ok"] and r["exact"] for r in recvs), \
        (pushes, recvs)
    kind = dict((v, sums) for sums, v in order)
    keyed = [p["seconds"] for p in pushes if kind[p["version"]] == "keyed"]
    unkeyed = [p["seconds"] for p in pushes if kind[p["version"]] == "unkeyed"]
    return {"keyed_s": keyed, "unkeyed_s": unkeyed, "keyed_s_median": statistics.median(keyed),
            "unkeyed_s_median": statistics.median(unkeyed),
            "cost": statistics.median(keyed) / statistics.median(unkeyed) - 1}


def relays(run: Run, repeats: int, hosts: int) -> dict:
    run.case(f"relays_{run.port}")
    one, many = run.address(), run.address()
    order = []
    for v in range(2, repeats + 2):
        order += [("one", v), ("many", v)] if v % 2 == 0 else [("many", v), ("one", v)]
    pushes = [("one", 1), ("many", 1)] + order
    ranks = {"one": 1, "many": hosts}
    trainer, count = [], {"one": 0, "many": 0}
    for c, v in pushes:  # each push waits for its receivers to be in their receive again
        trainer += [f"gate:{','.join(f'{c}{r}-{count[c]}' for r in range(ranks[c]))}", f"push:full_{c}:{v}"]
        count[c] += 1

    def receiving(c: str, r: int) -> list[str]:
        return [s for k in range(repeats + 1) for s in (f"mark:{c}{r}-{k}", f"recv:full_{c}")]

    run.start("train", "trainer", "trainer", 0, 1, {"full_one": one, "full_many": many}, trainer)
    run.start("inf0", "one", "inference", 0, 1, {"full_one": one}, receiving("one", 0))
    for r in range(hosts):
        run.start(f"inf{r}", "many", "inference", r, hosts, {"full_many": many}, receiving("many", r))
    run.finish(run.timeout * (len(trainer) + 2))
    pushes = run.events("trainer0", "push")[2:]
    many_recvs = [run.events(f"many{r}", "recv") for r in range(hosts)]
    one_recvs = run.events("one0", "recv")
    assert all(p["ok"] for p in pushes), pushes
    assert all(r["ok"] and r["exact"] for rows in many_recvs + [one_recvs] for r in rows)
    rows = []
    for v in range(2, repeats + 2):
        o = next(p for p in pushes if p["version"] == v and p["channel"] == "full_one")
        m = next(p for p in pushes if p["version"] == v and p["channel"] == "full_many")
        slowest = max(next(r for r in rows_ if r["version"] == v)["stats_seconds"] for rows_ in many_recvs)
        rows.append({"version": v, "first": "one" if v % 2 == 0 else "many", "one_s": o["seconds"],
                     "many_s": m["seconds"], "ratio": m["seconds"] / o["seconds"], "one_wire": o["wire"],
                     "many_wire": m["wire"], "many_slowest_recv_s": slowest})
    pairs = [many_recvs[r][-1]["pairs"] for r in range(hosts)]
    return {"rows": rows, "hosts": hosts, "ratio_median": statistics.median(r["ratio"] for r in rows),
            "one_s_median": statistics.median(r["one_s"] for r in rows),
            "many_s_median": statistics.median(r["many_s"] for r in rows), "pairs": pairs}


def loaded(case, *args) -> dict:
    """``case(*args)``, with the load average before and after it."""
    before = os.getloadavg()
    out = case(*args)
    out["load"] = [before[0], os.getloadavg()[0]]
    return out


def link(cluster: Cluster, a: str, b: str) -> float:
    return cluster.throughput(a, b, seconds=1.5)["bits_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--relay-hosts", type=int, default=4)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--relay-bucket-mib", type=int, default=16,
                        help="the relay case's buckets: a chain passes a bucket on once it has landed")
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--cases", default="1g,10g,relays")
    parser.add_argument("--json")
    parser.add_argument("--md")
    parser.add_argument("--out", default="/tmp/bench_cluster")
    parser.add_argument("--merge", action="store_true", help="keep the cases of --json that this run does not measure")
    parser.add_argument("--small", action="store_true", help="a 20 MiB model: a quick check of the script")
    args = parser.parse_args()
    model = dict(MODEL, layers=1, vocab=8192) if args.small else MODEL
    out = Path(args.out)
    if out.exists():
        import shutil
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cases = args.cases.split(",")
    previous = json.loads(Path(args.json).read_text()) if args.merge and args.json and Path(args.json).exists() else {}
    result = {**previous, "model": model, "state_bytes": state_bytes(model), "repeats": args.repeats,
              "bucket_bytes": args.bucket_mib << 20, "change": 0.04, "hosts_style": "debian",
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                          "load_before": os.getloadavg()}}
    names = ["train"] + [f"inf{i}" for i in range(max(1, args.relay_hosts))]
    with Cluster(names, rate_bits_per_s=1e9, hosts_style="debian") as cluster:
        run = Run(cluster, out, args.timeout, args.bucket_mib << 20, model)
        if "1g" in cases:
            result["link_1g_measured_bits_per_s"] = link(cluster, "train", "inf0")
            result["delta_1g"] = loaded(delta_vs_full, run, args.repeats)
            print("1g", json.dumps({k: v for k, v in result["delta_1g"].items() if k != "rows"}), flush=True)
        if "10g" in cases:
            for host in cluster:
                host.set_rate(1e10)
            result["link_10g_measured_bits_per_s"] = link(cluster, "train", "inf0")
            result["delta_10g"] = loaded(delta_vs_full, run, args.repeats)
            print("10g", json.dumps({k: v for k, v in result["delta_10g"].items() if k != "rows"}), flush=True)
            for host in cluster:
                host.set_rate(1e9)
        if "tags" in cases:  # the keyed bucket tags' cost where a 1 Gbit/s link carries the bytes
            result["link_1g_measured_bits_per_s"] = link(cluster, "train", "inf0")
            result["tags_1g"] = loaded(tags, run, args.repeats)
            print("tags", json.dumps(result["tags_1g"]), flush=True)
        if "relays" in cases:
            run.bucket = args.relay_bucket_mib << 20
            result["relay_bucket_bytes"] = run.bucket
            result["relays"] = loaded(relays, run, args.repeats, args.relay_hosts)
            print("relays", json.dumps({k: v for k, v in result["relays"].items() if k != "rows"}), flush=True)
        if "relays10g" in cases:  # the same at 10 Gbit/s: what the chain costs where the link does not bound it
            run.bucket = args.relay_bucket_mib << 20
            result["relay_bucket_bytes"] = run.bucket
            for host in cluster:
                host.set_rate(1e10)
            result["relays_10g"] = loaded(relays, run, args.repeats, args.relay_hosts)
            print("relays10g", json.dumps({k: v for k, v in result["relays_10g"].items() if k != "rows"}), flush=True)
    result["machine"]["load_after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.md:
        Path(args.md).write_text(markdown(result))


def markdown(r: dict) -> str:
    mib = r["state_bytes"] / 2**20
    m = r["machine"]
    lines = [
        "Weight sync across hosts (benchmarks/bench_cluster.py): a cluster of network namespaces on one machine "
        "(tests/cluster), each host's link shaped both ways with tc tbf, Debian-style /etc/hosts (each host's name "
        "on 127.0.1.1), no GLOO_SOCKET_IFNAME. "
        f"State: a Llama in bf16, {mib:.0f} MiB (hidden {r['model']['hidden']}, {r['model']['layers']} layers, "
        f"vocabulary {r['model']['vocab']}); each version after the first moves {r['change']:.0%} of the elements by "
        "one ulp (an AdamW step at lr 1e-6 moves 2-3% of a bf16 model's elements: results/sync_delta.md). "
        f"gloo, buckets of {r['bucket_bytes'] >> 20} MiB, verified pushes; every received tensor compared bit for bit "
        f"with the expected version. A delta channel's base commit (on a thread after its push returns) is waited "
        f"for before the next push, outside the push's time (as bench_sync.py). {r['repeats']} repeats per case, interleaved in one run (the order alternating). "
        f"{m['cpus']} CPUs shared by every host's processes, torch {m['torch']}, {m['platform']}.",
        "",
    ]
    for key, rate in (("delta_1g", "1g"), ("delta_10g", "10g")):
        if key not in r:
            continue
        d = r[key]
        measured = r[f"link_{rate}_measured_bits_per_s"] / 1e9
        lines += [f"### Delta / full push, trainer host -> 1 inference host, links at {rate.replace('g', ' Gbit/s')} "
                  f"(one TCP stream measured {measured:.2f} Gbit/s)", "",
                  "| version | first | delta push s | full push s | delta / full | delta wire MiB | full wire MiB "
                  "| delta base commit s (after) |", "|---|---|---|---|---|---|---|---|"]
        for row in d["rows"]:
            lines.append(f"| {row['version']} | {row['first']} | {row['delta_s']:.3f} | {row['full_s']:.3f} | "
                         f"{row['ratio']:.3f} | {row['delta_wire'] / 2**20:.1f} | {row['full_wire'] / 2**20:.1f} | "
                         f"{row['delta_settle_s'] or 0:.3f} |")
        lines += ["", f"Median delta / full push time: **{d['ratio_median']:.3f}x** ({d['delta_s_median']:.3f} s / "
                      f"{d['full_s_median']:.3f} s); bytes on the wire {d['wire_ratio']:.3f}x. Load average "
                      f"{d['load'][0]:.2f} before, {d['load'][1]:.2f} after.", ""]
    for key, rate in (("relays", "1 Gbit/s"), ("relays_10g", "10 Gbit/s")):
        if key not in r:
            continue
        d = r[key]
        lines += [f"### Full push to {d['hosts']} inference hosts (one job, relays) / to 1 host, every link {rate}, "
                  f"buckets of {r['relay_bucket_bytes'] >> 20} MiB", "",
                  f"| version | first | 1 host s | {d['hosts']} hosts s | ratio | trainer's wire MiB (1 / {d['hosts']} hosts) "
                  f"| slowest of {d['hosts']} receivers s |", "|---|---|---|---|---|---|---|"]
        for row in d["rows"]:
            lines.append(f"| {row['version']} | {row['first']} | {row['one_s']:.3f} | {row['many_s']:.3f} | "
                         f"{row['ratio']:.3f} | {row['one_wire'] / 2**20:.1f} / {row['many_wire'] / 2**20:.1f} | "
                         f"{row['many_slowest_recv_s']:.3f} |")
        lines += ["", f"Median {d['hosts']} hosts / 1 host: **{d['ratio_median']:.3f}x** ({d['many_s_median']:.3f} s / "
                      f"{d['one_s_median']:.3f} s). The {d['hosts']}-host job's pairs (session ranks, per receiver): "
                      f"{d['pairs']}. Load average {d['load'][0]:.2f} before, {d['load'][1]:.2f} after.", ""]
    if "tags_1g" in r:
        d = r["tags_1g"]
        lines += ["### Keyed bucket tags / the unkeyed sums they replaced, trainer host -> 1 inference host, 1 Gbit/s",
                  "", "Full verified pushes, both sides switching the check alike before each push, alternating which "
                  "goes first (docs/security.md).", "", "| check | push seconds | median |", "|---|---|---|",
                  f"| keyed tags (NH + HMAC-SHA256) | {' '.join(f'{x:.3f}' for x in d['keyed_s'])} | "
                  f"{d['keyed_s_median']:.3f} |",
                  f"| unkeyed sums (before) | {' '.join(f'{x:.3f}' for x in d['unkeyed_s'])} | "
                  f"{d['unkeyed_s_median']:.3f} |", "",
                  f"The keyed tags cost **{d['cost'] * 100:+.1f}%** of a push here. Load average {d['load'][0]:.2f} "
                  f"before, {d['load'][1]:.2f} after.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
