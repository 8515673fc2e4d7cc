"""Cross-job weight sync across hosts (issue 45): a trainer on one host, inference jobs on others.

One cluster (tests/cluster) of three hosts, ``train``, ``infer-b`` and ``infer-c``, shared by the
module: Debian's /etc/hosts (each host's own name on 127.0.1.1, where no peer reaches it) and
1 Gbit/s links, so that a pair must listen on the interface that routes to its peer
(rendezvous.pair_address) and bytes cross a shaped link, not loopback. No GLOO_SOCKET_IFNAME is
set anywhere. Every member is a plain process (tests/cluster_sync_driver.py) started in its host
with an explicit rank and size, with the same DISTLOAD_SECRET (the store listens on the trainer
host's address, beyond loopback). Each received tensor is checked bit for bit by its receiver.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import cluster_fixture

pytestmark = pytest.mark.dist

TESTS = Path(__file__).resolve().parent
DRIVER = str(TESTS / "cluster_sync_driver.py")
TIMEOUT_S = 15.0  # every channel's timeout: each failure below must surface within it
SECRET = "cluster-sync-test-secret-0123456789"
# A small Llama (bf16, about 11 MiB): TP 2 cuts whole heads and rows; vocabulary 8192 (no padding).
MODEL = {"hidden": 256, "inter": 640, "layers": 2, "vocab": 8192, "heads": 8, "kv_heads": 4, "head_dim": 32}
# A bigger one for updates cut mid-way (about 24 MiB: 0.2 s at 1 Gbit/s, 2 s at 100 Mbit/s).
BIG = {**MODEL, "hidden": 512, "inter": 1024}

cluster = cluster_fixture(hosts=["train", "infer-b", "infer-c"], hosts_style="debian", rate_bits_per_s=1e9,
                          scope="module")

# Below the kernel's ephemeral range (32768 and up): a port from it can be taken by an outgoing
# connection of an earlier test's process in the same host ("Address already in use").
_port = [20000 + os.getpid() % 1200 * 10]


def next_port() -> int:
    _port[0] += 1
    return _port[0]


class Members:
    """The processes of one test, their logs and their end (every one killed by id at the end)."""

    def __init__(self, cluster, out: Path):
        self.cluster, self.out = cluster, out
        self.procs: dict[str, subprocess.Popen] = {}
        trainer = cluster["train"]
        self.channels = {"delta": f"tcp://{trainer.address}:{next_port()}"}

    def start(self, host: str, name: str, role: str, rank: int, size: int, steps: list[str], *, tp: int = 1,
              model: dict = MODEL, channels: dict | None = None, timeout: float = TIMEOUT_S) -> None:
        cfg = {"out": str(self.out), "name": name, "role": role, "rank": rank, "size": size, "tp": tp,
               "channels": channels or self.channels, "timeout": timeout, "bucket": 1 << 20, "model": model,
               "change": 0.04, "steps": steps}
        key = f"{name}{rank}"
        with open(self.out / f"{key}.stderr", "w") as err:
            self.procs[key] = self.cluster[host].run(
                [sys.executable, DRIVER, json.dumps(cfg)], stdout=subprocess.DEVNULL, stderr=err,
                env={"DISTLOAD_SECRET": SECRET, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS.parent)})

    def events(self, member: str, event: str | None = None) -> list[dict]:
        path = self.out / f"{member}.jsonl"
        if not path.exists():
            return []
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [e for e in lines if event is None or e["event"] == event]

    def wait(self, member: str, event: str, count: int = 1, timeout: float = 60) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            found = self.events(member, event)
            if len(found) >= count:
                return found[:count]
            if time.monotonic() > deadline or (self.procs[member].poll() is not None
                                               and len(self.events(member, event)) < count):
                pytest.fail(f"{member} logged {len(found)} {event!r} event(s), not {count}\n{self.report()}")
            time.sleep(0.05)

    def finish(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        for key, proc in self.procs.items():
            try:
                code = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{key} did not end\n{self.report()}")
            assert code == 0, f"{key} exited {code}\n{self.report()}"

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 9)
                except ProcessLookupError:
                    pass
                proc.wait(10)

    def report(self) -> str:
        parts = [f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.out.glob("*.jsonl"))]
        parts += [f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.out.glob("*.stderr"))]
        return "\n".join(parts)


@pytest.fixture
def members(cluster, tmp_path):
    made = Members(cluster, tmp_path)
    try:
        yield made
    finally:
        made.kill()
        for host in cluster:  # a test that failed mid-way leaves every link as it found it
            host.link_up()
            host.set_rate(1e9)


def test_trainer_host_to_a_tp2_job_on_another_host_full_then_delta(members):
    """Debian's hosts file on both hosts, no GLOO_SOCKET_IFNAME: the pairs listen on eth0's
    address (the one that routes to the rendezvous), and a full update then a delta (4% of the
    elements moved) land bit for bit in both TP slices."""
    members.start("train", "trainer", "trainer", 0, 1, ["push:delta:1", "push:delta:2"])
    for rank in range(2):
        members.start("infer-b", "inf", "inference", rank, 2, ["recv:delta", "recv:delta"], tp=2)
    members.finish()
    pushes = members.events("trainer0", "push")
    assert [p["ok"] for p in pushes] == [True, True], members.report()
    assert [p["delta"] for p in pushes] == [False, True]
    assert pushes[1]["wire"] < 0.2 * pushes[0]["wire"]  # 4% of the elements moved
    for rank in range(2):
        got = members.events(f"inf{rank}", "recv")
        assert [(r["ok"], r["version"], r["exact"], r["transport"]) for r in got] == [
            (True, 1, True, "socket"), (True, 2, True, "socket")], members.report()
        assert got[1]["delta"] and got[0]["verified"] and got[1]["verified"]


def test_relays_to_inference_ranks_on_two_hosts(members):
    """Trainer on one host, an inference job of two whole-model ranks on two other hosts: the
    trainer sends to the head of the relay chain, which passes every bucket on to the other host."""
    members.start("train", "trainer", "trainer", 0, 1, ["push:delta:1", "push:delta:2"])
    members.start("infer-b", "inf", "inference", 0, 2, ["recv:delta", "recv:delta"])
    members.start("infer-c", "inf", "inference", 1, 2, ["recv:delta", "recv:delta"])
    members.finish()
    pushes = members.events("trainer0", "push")
    assert [p["ok"] for p in pushes] == [True, True], members.report()
    got = [members.events(f"inf{r}", "recv") for r in range(2)]
    for rows in got:
        assert [(r["ok"], r["version"], r["exact"]) for r in rows] == [(True, 1, True), (True, 2, True)], \
            members.report()
    # the trainer (session rank 0) pairs with the chain's head only; the head with the other member
    pairs = sorted((r[0]["pairs"] for r in got), key=len)
    assert pairs == [[1], [0, 2]] or pairs == [[2], [0, 1]], pairs
    # the trainer's wire bytes once, not once a host
    assert pushes[0]["wire"] < 1.5 * pushes[0]["nbytes"]


@pytest.mark.slow
@pytest.mark.parametrize("down", ["infer-b", "train"])
def test_a_link_down_mid_update(members, cluster, down):
    """The receiver's link (then the trainer's) pulled mid-update: every member ends the update
    within its timeout with a message, the receivers hold the previous version exactly, and after
    the link returns the next update succeeds."""
    for host in cluster:
        host.set_rate(1e8)  # 100 Mbit/s: a whole update takes 2 s, time to pull the link mid-way
    steps = ["push:full:1", "gate:go2", "push:full:2", "gate:go3", "push:full:3"]
    channels = {"full": f"tcp://{cluster['train'].address}:{next_port()}"}
    members.start("train", "trainer", "trainer", 0, 1, steps, model=BIG, channels=channels)
    members.start("infer-b", "inf", "inference", 0, 1, ["recv:full"] * 3, model=BIG, channels=channels)
    members.wait("inf0", "recv", 1, timeout=60)
    (members.out / "go2").touch()
    members.wait("trainer0", "pushing", 2, timeout=30)
    time.sleep(0.5)
    cluster[down].link_down()
    pulled = time.monotonic()
    push = members.wait("trainer0", "push", 2, timeout=TIMEOUT_S + 15)[1]
    recv = members.wait("inf0", "recv", 2, timeout=TIMEOUT_S + 15)[1]
    ended = time.monotonic() - pulled
    cluster[down].link_up()
    if push["ok"] and recv["ok"]:
        pytest.skip(f"version 2 crossed before the link went down ({push['seconds']:.2f} s)")
    print(f"\n[{down} down] trainer: {push['error']}\n[{down} down] receiver: {recv['error']}")
    assert not push["ok"] and push["error"] and push["seconds"] < TIMEOUT_S + 5, members.report()
    assert not recv["ok"] and recv["error"], members.report()
    # each side names the member it lost (the store's server, for the receiver) and its host
    assert "inference rank 0 on host infer-b (" in push["error"], members.report()
    assert "trainer rank 0 on host train (" in recv["error"], members.report()
    assert "\n" not in push["error"] and "\n" not in recv["error"]
    # the member on the host cut off says so: its own link has no carrier
    cut, other = (push, recv) if down == "train" else (recv, push)
    assert f"this host, {down}, is the one cut off" in cut["error"], members.report()
    assert "is the one cut off" not in other["error"], members.report()
    assert recv["seconds"] < TIMEOUT_S + 5 and ended < TIMEOUT_S + 10
    assert recv["version"] == 1 and recv["holds_its_version"], members.report()
    (members.out / "go3").touch()
    members.finish(timeout=2 * TIMEOUT_S + 30)
    last_push = members.events("trainer0", "push")[2]
    last_recv = members.events("inf0", "recv")[2]
    assert last_push["ok"] and last_recv["ok"] and last_recv["version"] == 3 and last_recv["exact"], members.report()


@pytest.mark.slow
def test_a_relay_hosts_link_down_mid_update(members, cluster):
    """An inference job of two whole-model ranks on two hosts, a relay chain: the trainer sends to
    the chain's head, which passes every bucket on to the tail on the other host. The head's link
    pulled mid-update: every member ends the update within its timeout with one line naming the
    head's host (the trainer and the tail lost it; the head lost the store on the trainer's host,
    and says so), both receivers hold version 1 exactly, and after the link returns version 3
    arrives whole on both hosts."""
    for host in cluster:
        host.set_rate(1e8)  # 100 Mbit/s: a whole update takes 2 s, time to pull the link mid-way
    steps = ["push:full:1", "gate:go2", "push:full:2", "gate:go3", "push:full:3"]
    channels = {"full": f"tcp://{cluster['train'].address}:{next_port()}"}
    hosts = {0: "infer-b", 1: "infer-c"}
    members.start("train", "trainer", "trainer", 0, 1, steps, model=BIG, channels=channels)
    for rank, host in hosts.items():
        members.start(host, "inf", "inference", rank, 2, ["recv:full"] * 3, model=BIG, channels=channels)
    first = {rank: members.wait(f"inf{rank}", "recv", 1, timeout=60)[0] for rank in hosts}
    assert all(r["ok"] and r["exact"] for r in first.values()), members.report()
    # the head pairs with the trainer (session rank 0) and the tail; the tail with the head only
    (head,) = [rank for rank, r in first.items() if 0 in r["pairs"]]
    tail = 1 - head
    head_host, tail_host = hosts[head], hosts[tail]
    (members.out / "go2").touch()
    members.wait("trainer0", "pushing", 2, timeout=30)
    time.sleep(0.5)
    cluster[head_host].link_down()
    pulled = time.monotonic()
    push = members.wait("trainer0", "push", 2, timeout=TIMEOUT_S + 15)[1]
    recv = {rank: members.wait(f"inf{rank}", "recv", 2, timeout=TIMEOUT_S + 15)[1] for rank in hosts}
    ended = time.monotonic() - pulled
    cluster[head_host].link_up()
    if push["ok"] and all(r["ok"] for r in recv.values()):
        pytest.skip(f"version 2 crossed before the link went down ({push['seconds']:.2f} s)")
    print(f"\n[relay {head_host} down] trainer: {push['error']}")
    for rank in hosts:
        print(f"[relay {head_host} down] inference rank {rank} on {hosts[rank]}: {recv[rank]['error']}")
    assert not push["ok"] and push["seconds"] < TIMEOUT_S + 5, members.report()
    assert ended < TIMEOUT_S + 10, members.report()
    lost = f"inference rank {head} on host {head_host} ("
    assert lost in push["error"], members.report()  # the trainer lost the head
    assert lost in recv[tail]["error"], members.report()  # so did the tail, behind it
    # the head, cut off, lost the store on the trainer's host: it names that host, and its own
    # link down (no carrier), which only it can see
    assert "trainer rank 0 on host train (" in recv[head]["error"], members.report()
    assert f"this host, {head_host}, is the one cut off" in recv[head]["error"], members.report()
    assert "is the one cut off" not in push["error"] + recv[tail]["error"], members.report()
    for rank, r in recv.items():
        assert not r["ok"] and r["seconds"] < TIMEOUT_S + 5 and "\n" not in r["error"], members.report()
        assert r["version"] == 1 and r["holds_its_version"], members.report()
    (members.out / "go3").touch()
    members.finish(timeout=2 * TIMEOUT_S + 30)
    assert members.events("trainer0", "push")[2]["ok"], members.report()
    for rank in hosts:
        last = members.events(f"inf{rank}", "recv")[2]
        assert last["ok"] and last["version"] == 3 and last["exact"], members.report()


@pytest.mark.slow
def test_a_link_slowed_10x_mid_update(members, cluster):
    """The receiver's link slowed from 100 to 10 Mbit/s while a full update (about 2 s at the
    normal rate) crosses it: the update either completes, bit for bit, or fails within the
    timeout (10 s here: what is left of it needs about 18 s at the slow rate) in one line naming
    the slow host, with the receiver at version 1 exactly; never a silent stall. At the normal
    rate again, the next update arrives whole."""
    timeout = 10.0
    for host in cluster:
        host.set_rate(1e8)
    steps = ["push:full:1", "gate:go2", "push:full:2", "gate:go3", "push:full:3"]
    channels = {"full": f"tcp://{cluster['train'].address}:{next_port()}"}
    members.start("train", "trainer", "trainer", 0, 1, steps, model=BIG, channels=channels, timeout=timeout)
    members.start("infer-b", "inf", "inference", 0, 1, ["recv:full"] * 3, model=BIG, channels=channels,
                  timeout=timeout)
    members.wait("inf0", "recv", 1, timeout=60)
    (members.out / "go2").touch()
    members.wait("trainer0", "pushing", 2, timeout=30)
    time.sleep(0.5)
    cluster["infer-b"].set_rate(1e7)
    slowed = time.monotonic()
    push = members.wait("trainer0", "push", 2, timeout=timeout + 15)[1]
    recv = members.wait("inf0", "recv", 2, timeout=timeout + 15)[1]
    ended = time.monotonic() - slowed
    cluster["infer-b"].set_rate(1e8)
    print(f"\n[infer-b slowed 10x] trainer: {push.get('error') or 'ok in %.1f s' % push['seconds']}"
          f"\n[infer-b slowed 10x] receiver: {recv.get('error') or 'ok in %.1f s' % recv['seconds']}")
    assert push["seconds"] < timeout + 5 and recv["seconds"] < timeout + 5, members.report()
    assert ended < timeout + 10, members.report()
    if push["ok"]:
        assert recv["ok"] and recv["version"] == 2 and recv["exact"], members.report()
    else:
        assert not recv["ok"], members.report()
        for error in (push["error"], recv["error"]):
            assert "on host infer-b (" in error and "\n" not in error, members.report()
        assert recv["version"] == 1 and recv["holds_its_version"], members.report()
    (members.out / "go3").touch()
    members.finish(timeout=2 * timeout + 30)
    assert members.events("trainer0", "push")[2]["ok"], members.report()
    last = members.events("inf0", "recv")[2]
    assert last["ok"] and last["version"] == 3 and last["exact"], members.report()


PAIR_ADDRESS = ("import json, sys; from distload.errors import SyncError; from distload.live import rendezvous\n"
                "out = {}\n"
                "for a in sys.argv[1:]:\n"
                "    try: out[a] = rendezvous.pair_address(a)\n"
                "    except SyncError as exc: out[a] = 'error: ' + str(exc)\n"
                "print(json.dumps(out))")


def test_the_address_a_pair_listens_on(cluster):
    """On a Debian-style host: towards a peer's address, eth0's; towards loopback, loopback; on a
    wildcard rendezvous (the serving side of tcp://0.0.0.0:PORT), eth0's, not the 127.0.1.1 the
    host's name resolves to; towards an address no route reaches, one line naming it and the fix."""
    train, other = cluster["train"], cluster["infer-b"]
    addresses = [f"tcp://{train.address}:1234", "tcp://127.0.0.1:1234", "tcp://0.0.0.0:1234",
                 "tcp://192.0.2.7:1234"]
    out = other.check([sys.executable, "-c", PAIR_ADDRESS, *addresses], timeout=60,
                      env={"PYTHONPATH": str(TESTS.parent)})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got[addresses[0]] == other.address
    assert got[addresses[1]] == "127.0.0.1"
    assert got[addresses[2]] == other.address
    unreachable = got[addresses[3]]
    assert unreachable.startswith("error: no route from this host to the sync rendezvous host 192.0.2.7")
    assert "GLOO_SOCKET_IFNAME" in unreachable and "/etc/hosts" in unreachable and "\n" not in unreachable
