"""Loads across hosts (issue 45): an S3 store on a host of its own behind its own shaped link.

One cluster (tests/cluster) shared by the module: ``node0`` and ``node1`` (the loading hosts) and
``store`` (moto's server inside it, tests/cluster_store.py), every link 1 Gbit/s. Every byte a
load fetches crosses the store's link, and what the store sent is counted at its interface
(``sent_bytes``: payload plus TCP/IP headers). Every load is checked bit for bit against a plain
safetensors read of the same files. Each host has its own hostname but shares this machine's
file system: a per-host folder (a pull's copy, a node cache) is named after the host
(``$(hostname)``, through ``torchrun --no-python sh -c``).

The failure tests slow the store's link first, so that a load is still moving when its link goes
down or slows 10x, and check that every rank ends within its timeouts with a message that names
what went away (the store's address), never a silent stall.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cluster import cluster_fixture
from cluster_store import S3Store
from conftest import plain_digest, write_whole

pytestmark = pytest.mark.dist

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
RATE = 1e9
SECRET = "cluster-loads-test-secret-0123456789"
MIB = 1 << 20
STORE_SLACK = 1.06  # what the store's interface sends over the objects' bytes: headers, listings, HTTP

cluster = cluster_fixture(hosts=["node0", "node1", "store"], rate_bits_per_s=RATE, scope="module")


class Checkpoint:
    """A 48 MiB whole checkpoint in 3 files, uploaded to the store host's moto, and its digest."""

    def __init__(self, cluster, root: Path):
        self.folder = str(root / "ckpt")
        generator = torch.Generator().manual_seed(45)
        state = {f"layer{i}.w": torch.randn(2 * MIB, generator=generator) for i in range(6)}  # 6 x 8 MiB
        state["tiny.bf16"] = torch.randn(33, 7, generator=generator).to(torch.bfloat16)
        self.paths = write_whole(self.folder, state, num_files=3)
        self.digest = plain_digest(self.paths)
        self.nbytes = sum(os.path.getsize(p) for p in self.paths)
        self.store = S3Store(cluster["store"], str(root / "moto"))
        self.uri = self.store.upload_folder(self.folder, "ckpt")


@pytest.fixture(scope="module")
def ckpt(cluster, tmp_path_factory):
    made = Checkpoint(cluster, tmp_path_factory.mktemp("cluster-loads"))
    yield made
    made.store.stop()


@pytest.fixture
def links(cluster):
    """Every link back at RATE and up after a test, whatever it did."""
    yield cluster
    for host in cluster:
        host.link_up()
        host.set_rate(RATE)


def env_for(ckpt, **extra) -> dict[str, str]:
    return {**ckpt.store.env(), "PYTHONPATH": str(ROOT), "DISTLOAD_CACHE_DIR": "", **extra}


def per_host(command: str) -> list[str]:
    """torchrun arguments that run ``command`` through ``sh -c`` (so ``$(hostname)`` is the host's)."""
    return ["sh", "-c", command]


def distload_cmd(*args: str) -> str:
    return " ".join([shlex.quote(sys.executable), "-m", "distload", *args])


def run_job(cluster, hosts, nproc: int, args: list[str], env: dict, logs: Path, *, shell: bool = False,
            timeout: float = 120) -> dict[str, tuple[int, str]]:
    """A torchrun job over ``hosts``; returns hostname -> (exit code, log)."""
    procs = cluster.torchrun(hosts, nproc, args, env=env, logs=str(logs),
                             torchrun_args=["--no-python"] if shell else ())
    codes = {}
    try:
        for host, proc in zip(hosts, procs):
            codes[host] = proc.wait(timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(10)
    return {host: (codes.get(host), (logs / f"{host}.log").read_text(errors="replace")) for host in hosts}


def describe(results: dict) -> str:
    return "\n".join(f"--- {host} exited {code}\n{log[-3000:]}" for host, (code, log) in results.items())


def load_args(ckpt, report: Path, *extra: str) -> list[str]:
    return ["-m", "distload", "load", ckpt.uri, "--no-progress", "--report-json", str(report), *extra]


# -- pure: the words of a round that times out ------------------------------------------------------

def test_a_round_that_times_out_names_where_the_reads_go_and_how_long_this_ranks_took():
    """A peer that is alive but slow to read its share from the store holds this rank up at the
    round's agreement until the timeout: the error names the source and this rank's own time."""
    from types import SimpleNamespace

    from distload.errors import GroupError
    from distload.loading.shared_reads.rounds import run_rounds

    def exchange(value, explain=True):
        raise GroupError("rank 1: lost contact with the other ranks while exchanging state (timeout 4s): "
                         "Timed out waiting 4000ms for recv operation to complete")

    group = SimpleNamespace(world_size=2, exchange=exchange)
    where = "the S3 endpoint http://10.0.0.3:9000 (from AWS_ENDPOINT_URL)"
    with pytest.raises(GroupError) as caught:
        list(run_rounds(group, 3, "reading its share", lambda r: None, lambda r: r, source=where))
    text = str(caught.value)
    assert text.startswith("rank 1: lost contact with the other ranks")
    assert f"round 1 of 3 waited for every rank's reads from {where} (this rank's took 0.0 s)" in text
    with pytest.raises(GroupError) as plain:  # no source (a local disk, pull): the message as it was
        list(run_rounds(group, 3, "reading its share", lambda r: None, lambda r: r))
    assert "waited for" not in str(plain.value)


# -- loads that work -------------------------------------------------------------------------------

def test_a_two_host_load_takes_each_byte_from_the_store_once(cluster, ckpt, tmp_path):
    """torchrun --nnodes 2 (c10d rendezvous on node0), one rank a host, auto: the ranks share the
    reads across hosts, so the store's link carries the checkpoint once, not once per host."""
    report = tmp_path / "report.json"
    before = ckpt.store.sent_bytes()
    results = run_job(cluster, ["node0", "node1"], 1, load_args(ckpt, report), env_for(ckpt), tmp_path / "logs")
    sent = ckpt.store.sent_bytes() - before
    assert all(code == 0 for code, _ in results.values()), describe(results)
    ranks = json.loads(report.read_text())["ranks"]
    assert sorted(r["hostname"] for r in ranks) == ["node0", "node1"]
    assert [r["path"] for r in ranks] == ["ranged-shared"] * 2
    assert [r["digest"] for r in ranks] == [ckpt.digest] * 2
    assert all(0.3 * ckpt.nbytes < r["requested_bytes"] < 0.7 * ckpt.nbytes for r in ranks), ranks
    assert ckpt.nbytes <= sent <= STORE_SLACK * ckpt.nbytes, (sent, ckpt.nbytes)


@pytest.mark.slow
def test_pull_onto_two_hosts_each_gets_a_copy_and_the_store_serves_it_once(cluster, ckpt, tmp_path):
    dest = tmp_path / "pulled"
    command = distload_cmd("pull", ckpt.uri, f"{dest}/$(hostname)", "--chunk-mib", "4",
                           "--report-json", str(tmp_path / "report.json"))
    before = ckpt.store.sent_bytes()
    results = run_job(cluster, ["node0", "node1"], 1, per_host(command), env_for(ckpt), tmp_path / "logs", shell=True)
    sent = ckpt.store.sent_bytes() - before
    assert all(code == 0 for code, _ in results.values()), describe(results)
    for host in ("node0", "node1"):
        copy = dest / host
        assert sorted(os.listdir(copy)) == sorted(os.path.basename(p) for p in ckpt.paths), host
        assert plain_digest([str(copy / os.path.basename(p)) for p in ckpt.paths]) == ckpt.digest, host
    ranks = json.loads((tmp_path / "report.json").read_text())["ranks"]
    assert sum(r["requested_bytes"] for r in ranks) == ckpt.nbytes and all(r["requested_bytes"] > 0 for r in ranks)
    assert ckpt.nbytes <= sent <= STORE_SLACK * ckpt.nbytes, (sent, ckpt.nbytes)


@pytest.mark.slow
def test_the_node_cache_fills_on_two_hosts_and_the_next_job_leaves_the_store_alone(cluster, ckpt, tmp_path):
    """--cache-dir on each host (its own folder): the first job's ranks fetch their shares and keep
    what they receive from the other host; the next job (TP 2 this time) takes everything from the
    caches: the store sends its listing and nothing of the objects."""
    caches = tmp_path / "caches"
    sent, fetched = [], []
    for tp in ("", "--tensor-parallel-size 2 --sharding replicate"):
        report = tmp_path / "report.json"
        command = distload_cmd("load", ckpt.uri, "--no-progress", "--report-json", str(report),
                               "--cache-dir", f"{caches}/$(hostname)", *tp.split())
        before = ckpt.store.sent_bytes()
        results = run_job(cluster, ["node0", "node1"], 1, per_host(command), env_for(ckpt), tmp_path / f"logs{tp[:3]}",
                          shell=True)
        sent.append(ckpt.store.sent_bytes() - before)
        assert all(code == 0 for code, _ in results.values()), describe(results)
        ranks = json.loads(report.read_text())["ranks"]
        assert [r["digest"] for r in ranks] == [ckpt.digest] * 2, ranks
        assert [r["path"] for r in ranks] == ["ranged-shared"] * 2
        fetched.append(sum(r["store_bytes"] for r in ranks))
    assert sorted(os.listdir(caches)) == ["node0", "node1"]
    # the cache fetches whole blocks: a block that two hosts' shares cut is fetched by both
    # (1.19x of a 48 MiB checkpoint here), and the interface counts just what the ranks fetched
    assert ckpt.nbytes <= fetched[0] <= 1.3 * ckpt.nbytes and fetched[1] == 0, fetched
    assert fetched[0] <= sent[0] <= STORE_SLACK * fetched[0], (sent, fetched)
    assert sent[1] < 0.02 * ckpt.nbytes, sent


@pytest.mark.slow
def test_serve_on_one_host_and_load_from_it_on_another(cluster, ckpt, tmp_path):
    """``distload serve`` on node0 reads the store once and listens on node0's address (with the
    job secret: beyond loopback it refuses to start without one); ``distload load tcp://`` on
    node1 takes the weights from it: nothing from the store, bit for bit."""
    node0, node1 = cluster["node0"], cluster["node1"]
    address = f"tcp://{node0.address}:29611"
    log = tmp_path / "serve.log"
    env = env_for(ckpt, DISTLOAD_SECRET=SECRET, OMP_NUM_THREADS="1")
    before = ckpt.store.sent_bytes()
    with open(log, "w") as out:
        server = node0.run([sys.executable, "-m", "distload", "serve", ckpt.uri, "--address", address, "--no-progress",
                            "--timeout", "60"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while "serves" not in log.read_text() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.poll() is None and "serves" in log.read_text(), log.read_text()
        served_by_store = ckpt.store.sent_bytes() - before
        asked = ckpt.store.requests()
        report = tmp_path / "report.json"
        done = node1.check([sys.executable, "-m", "distload", "load", address, "--no-progress", "--report-json",
                            str(report), "--timeout", "60"], env=env, timeout=120)
        after = ckpt.store.sent_bytes()
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        (rank,) = json.loads(report.read_text())["ranks"]
        assert rank["hostname"] == "node1" and rank["digest"] == ckpt.digest
        assert rank["requested_bytes"] == 0 and rank["nbytes"] <= rank["server_bytes"] <= 1.05 * rank["nbytes"]
        assert ckpt.nbytes <= served_by_store <= STORE_SLACK * ckpt.nbytes
        # The replica took nothing from the store: no request, and no more than a few control packets
        # (the server's pooled connections closing, ARP), where even one ranged read is a full packet.
        assert ckpt.store.requests() == asked
        assert after - before - served_by_store < 1500, (after - before, served_by_store)
        # without the secret the loader is refused (the server listens beyond loopback)
        refused = node1.check([sys.executable, "-m", "distload", "load", address, "--no-progress", "--timeout", "20"],
                              env={**env, "DISTLOAD_SECRET": "another-secret-of-this-length"}, timeout=60)
        assert refused.returncode != 0, refused.stdout + refused.stderr
    finally:
        if server.poll() is None:
            os.killpg(server.pid, 15)
            try:
                server.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, 9)
                server.wait(10)


# -- the store's link fails mid-load -------------------------------------------------------------

SLOW_RATE = 80e6  # the store's link while a failure is set up: the 48 MiB load takes about 5 s
READ_TIMEOUT_S = 5  # DISTLOAD_STORE_READ_TIMEOUT: a socket read of the store that gets nothing this long fails
GROUP_TIMEOUT_S = 15  # --timeout: every collective


def start_load_then(cluster, ckpt, tmp_path: Path, action, fraction: float = 0.25, rate: float = SLOW_RATE,
                    group_timeout: int = GROUP_TIMEOUT_S, read_timeout: int = READ_TIMEOUT_S):
    """Start a two-host load (one rank a host, each a plain process with torchrun's variables and
    no agent, so that each rank's end and message are its own) with the store's link at
    ``rate``; once the store has sent ``fraction`` of the checkpoint, run ``action()``. Returns
    (hostname -> (exit code, output), seconds from the action to the last rank's end, report)."""
    cluster["store"].set_rate(rate)
    report = tmp_path / "report.json"
    hosts = ["node0", "node1"]
    port = str(29500 + os.getpid() % 400)
    env = env_for(ckpt, DISTLOAD_STORE_READ_TIMEOUT=str(read_timeout), WORLD_SIZE="2", LOCAL_RANK="0",
                  LOCAL_WORLD_SIZE="1", MASTER_ADDR=cluster["node0"].address, MASTER_PORT=port,
                  GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
    before = ckpt.store.sent_bytes()
    procs = []
    for rank, host in enumerate(hosts):
        with open(tmp_path / f"{host}.log", "w") as log:
            procs.append(cluster[host].run(
                [sys.executable, *load_args(ckpt, report, "--timeout", str(group_timeout))],
                env={**env, "RANK": str(rank), "GROUP_RANK": str(rank)}, stdout=log, stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 120
        while ckpt.store.sent_bytes() - before < fraction * ckpt.nbytes:
            assert all(p.poll() is None for p in procs), "the load ended before the failure"
            assert time.monotonic() < deadline, "the load did not get under way"
            time.sleep(0.05)
        acted = time.monotonic()
        action()
        for proc in procs:
            proc.wait(read_timeout + group_timeout + 60)
        took = time.monotonic() - acted
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(10)
    results = {h: (p.returncode, (tmp_path / f"{h}.log").read_text(errors="replace")) for h, p in zip(hosts, procs)}
    return results, took, report


@pytest.mark.slow
def test_the_store_link_down_mid_load_ends_every_rank_naming_the_store(cluster, ckpt, links, tmp_path):
    store = cluster["store"]
    results, took, _ = start_load_then(cluster, ckpt, tmp_path, store.link_down)
    print(describe(results))
    print("took", took)
    assert all(code != 0 for code, _ in results.values()), describe(results)
    assert took < READ_TIMEOUT_S + GROUP_TIMEOUT_S + 30, took
    for host, (_, log) in results.items():
        assert store.address in log, f"{host} does not name the store\n{describe(results)}"


@pytest.mark.slow
def test_the_store_link_slowed_10x_past_the_timeout_ends_every_rank_naming_the_store(cluster, ckpt, links, tmp_path):
    """80 -> 8 Mbit/s mid-load with a group timeout of 4 s: a round's reads take longer than the
    rank that finished its share waits for them; every rank ends naming the store's endpoint (the
    slow rank once its reads in flight are done), and how long its own reads of the round took,
    not just "lost contact" with a rank that is alive."""
    store = cluster["store"]
    results, took, _ = start_load_then(cluster, ckpt, tmp_path, lambda: store.set_rate(SLOW_RATE / 10),
                                       group_timeout=4)
    assert all(code != 0 for code, _ in results.values()), describe(results)
    assert took < READ_TIMEOUT_S + 4 + 60, took
    for host, (_, log) in results.items():
        assert f"from the S3 endpoint http://{store.address}:" in log, f"{host} does not name the store\n{describe(results)}"
        assert "slow or stalled" in log, describe(results)
