"""Two simulated nodes on one machine: two torchrun agents, each in its own UTS namespace.

Each "node" is ``unshare --uts`` + its own hostname (node0, node1) + one torchrun agent
(``--nnodes 2``, c10d rendezvous on 127.0.0.1, ``--local-addr 127.0.0.1`` so neither agent
advertises its made-up hostname), one rank per node (this machine has 2 cores). Everything that
groups ranks by host (local ranks, Run:ai's per-node groups) sees two nodes.

With c10d the agents' order decides the ranks, not ``--node-rank``, so the tests find each rank by
what it reports rather than assume node0 holds rank 0.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from conftest import every_dtype_state, plain_digest, read_report, write_sharded, write_whole
from distload.loading.report import state_digest
from slurm_cluster import free_port, require_root_tools

pytestmark = pytest.mark.dist

AGENT_DEADLINE_S = 150  # a good run takes seconds; generous for a loaded 2-core machine
FAILURE_DEADLINE_S = 90  # every node must end within this after a rank fails (group timeout: 120 s)
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID")

# A rank that fails partway through streaming a load, through the Python API.
FAULT_SCRIPT = r'''
import os, signal, sys
import distload

mode, source = sys.argv[1], sys.argv[2]
with distload.WorkerGroup(device="cpu", timeout_s=120) as group:
    print(f"rank {group.rank} of {group.world_size} on {group.hostname}", flush=True)
    distload.load(source, "safetensors", group=group)  # a first load that works on every rank
    for i, (name, tensor) in enumerate(distload.iter_tensors(source, "safetensors", group=group)):
        if group.hostname == "node1" and i == 2:  # the rank on the node that does not hold the store
            if mode == "kill":
                print(f"rank {group.rank} on {group.hostname} kills itself at {name}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"rank {group.rank} on {group.hostname} fails on purpose at {name}")
    print(f"rank {group.rank} completed every load", flush=True)
'''


@pytest.fixture(scope="module")
def uts_namespaces():
    """``unshare --uts`` must work here (root); CI has it, so it fails there rather than skip."""
    try:
        out = subprocess.run(["unshare", "--uts", "sh", "-c", "hostname node-check && hostname"],
                             capture_output=True, text=True, timeout=30)
        problem = None if out.stdout.strip() == "node-check" else (
            f"`unshare --uts` did not give a process its own hostname (exit {out.returncode}: "
            f"{out.stderr.strip()})")
    except FileNotFoundError:
        problem = "unshare (util-linux) is not installed"
    require_root_tools("two simulated nodes need UTS namespaces (run as root)", problem)


class Node:
    """One simulated node: a torchrun agent in its own UTS namespace."""

    def __init__(self, node_rank: int, port: int, rdzv_id: str, entry: list[str], log_path: str,
                 cwd: str | None = None, nproc_per_node: int = 1):
        self.hostname = f"node{node_rank}"
        self.log_path = log_path
        torchrun = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
            "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", rdzv_id, "--local-addr", "127.0.0.1", "--max-restarts", "0",
            # node0's agent hosts the rendezvous store, whichever agent binds first: an agent that
            # loses the store ends its ranks at once, so the node that outlives a failure must
            # hold it (as a cluster's head node does) for its ranks to report what they found.
            "--rdzv-conf", f"is_host={int(node_rank == 0)}", *entry,
        ]
        env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
        env["OMP_NUM_THREADS"] = "1"
        self._log = open(log_path, "wb")
        self.start = time.monotonic()
        # unshare execs bash, bash execs torchrun: self.proc.pid is the agent itself.
        self.proc = subprocess.Popen(
            ["unshare", "--uts", "bash", "-c", f"hostname {self.hostname} && exec {shlex.join(torchrun)}"],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=cwd,
        )
        self.returncode: int | None = None
        self.seconds: float | None = None

    def wait(self, deadline: float) -> None:
        try:
            self.returncode = self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            self.seconds = time.monotonic() - self.start
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the agent's own session: its ranks too
                self.proc.wait(timeout=30)
            self._log.close()

    @property
    def output(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def run_two_nodes(tmp_path, entry: list[str], deadline_s: float, cwds: list[str] | None = None,
                  nproc_per_node: int = 1) -> list[Node]:
    """Start node0 and node1 with the same entry point (each in its own working folder where
    ``cwds`` says); wait for both (or kill them at the deadline)."""
    port, rdzv_id = free_port(), f"test-{os.getpid()}-{time.monotonic_ns()}"
    for cwd in cwds or ():
        os.makedirs(cwd, exist_ok=True)
    nodes = [Node(i, port, rdzv_id, entry, str(tmp_path / f"node{i}.log"), cwds[i] if cwds else None,
                  nproc_per_node) for i in range(2)]
    deadline = time.monotonic() + deadline_s
    timed_out = []
    for node in nodes:
        try:
            node.wait(deadline)
        except subprocess.TimeoutExpired:
            timed_out.append(node.hostname)
    if timed_out:
        pytest.fail(f"{', '.join(timed_out)} still running after {deadline_s:.0f}s\n" + describe(nodes))
    return nodes


def describe(nodes: list[Node]) -> str:
    return "\n".join(f"--- {n.hostname} (exit {n.returncode}):\n{n.output[-4000:]}" for n in nodes)


@pytest.mark.slow
def test_two_nodes_cooperative_whole_checkpoint(tmp_path, uts_namespaces):
    """Run:ai distributed across two nodes: every rank gets the whole checkpoint, bit for bit."""
    folder = str(tmp_path / "whole")
    paths = write_whole(folder, every_dtype_state(seed=11))
    report_path = str(tmp_path / "report.json")
    nodes = run_two_nodes(tmp_path, [
        "-m", "distload", "load", folder, "--load-format", "runai_streamer",
        "--model-loader-extra-config", '{"distributed": true}', "--report-json", report_path,
    ], AGENT_DEADLINE_S)
    assert [n.returncode for n in nodes] == [0, 0], describe(nodes)
    report = read_report(report_path)
    assert report["world_size"] == 2
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert sorted(r["hostname"] for r in ranks) == ["node0", "node1"]
    expected = plain_digest(paths)
    for r in ranks:
        assert r["local_rank"] == 0  # one rank per node: each is local rank 0 of its own node
        assert r["path"] == "runai-distributed", describe(nodes)
        assert r["files"] == paths
        assert r["digest"] == expected


def test_two_nodes_sharded_checkpoint_each_rank_its_own_files(tmp_path, uts_namespaces):
    folder = str(tmp_path / "sharded")
    states = write_sharded(folder, world_size=2, parts=2)
    report_path = str(tmp_path / "report.json")
    nodes = run_two_nodes(tmp_path, [
        "-m", "distload", "load", folder, "--load-format", "runai_streamer_sharded",
        "--report-json", report_path,
    ], AGENT_DEADLINE_S)
    assert [n.returncode for n in nodes] == [0, 0], describe(nodes)
    report = read_report(report_path)
    assert sorted(r["hostname"] for r in report["ranks"]) == ["node0", "node1"]
    for rank, r in enumerate(report["ranks"]):
        assert r["rank"] == rank
        assert r["path"] == "runai"
        assert r["files"] == [os.path.join(folder, f"model-rank-{rank}-part-{part}.safetensors")
                              for part in (0, 1)]
        assert r["digest"] == state_digest(states[rank])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["kill", "raise"])
def test_rank_failure_ends_the_job_on_every_node(tmp_path, uts_namespaces, mode):
    """node1's rank is SIGKILLed (or raises) partway through a load: both agents, on both nodes,
    exit non-zero well before the 120 s group timeout, and the output names that rank and its
    fault."""
    folder = str(tmp_path / "whole")
    write_whole(folder, every_dtype_state())
    script = tmp_path / "fault.py"
    script.write_text(FAULT_SCRIPT)
    nodes = run_two_nodes(tmp_path, [str(script), mode, folder], FAILURE_DEADLINE_S)
    text = describe(nodes)
    assert all(n.returncode not in (0, None) for n in nodes), text
    assert all(n.seconds is not None and n.seconds < FAILURE_DEADLINE_S for n in nodes), text
    hosts = {}
    for n in nodes:
        for rank in (0, 1):
            if f"rank {rank} of 2 on {n.hostname}" in n.output:
                hosts[rank] = n
    assert set(hosts) == {0, 1} and hosts[0] is not hosts[1], text
    bad = 0 if hosts[0].hostname == "node1" else 1
    failing, surviving = hosts[bad].output, hosts[1 - bad].output
    assert "completed every load" not in text
    if mode == "kill":
        assert f"rank {bad} on node1 kills itself" in failing
        # torchrun's summary on node1: the rank, and the signal that ended it.
        assert "Signal 9 (SIGKILL)" in failing, text
        assert f"rank      : {bad}" in failing or f"rank: {bad}" in failing, text
        # The survivor learns it over the broken connection, not by waiting for the timeout.
        assert "GroupError" in surviving or "RankFailedError" in surviving, text
    else:
        assert f"RuntimeError: rank {bad} on node1 fails on purpose" in failing
        # The survivor is told which rank failed, in which step.
        assert "RankFailedError" in surviving and f"rank {bad}" in surviving, text
