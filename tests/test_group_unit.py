"""Unit tests for distload/workers/group.py without any process group: launcher detection and devices."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from distload.workers import launch as launch_mod
from distload.errors import ConfigError, DistloadError
from distload.workers.group import WorkerGroup
from distload.workers.launch import LaunchInfo, detect_launch, first_slurm_host, resolve_device

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
               "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "SLURM_JOB_ID", "SLURM_STEP_ID",
               "SLURM_STEP_NUM_TASKS")

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


@pytest.fixture(autouse=True)
def clean_launch_env(monkeypatch):
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def no_scontrol(monkeypatch):
    """Make the node-list parser the only source of the first host."""
    monkeypatch.setattr(launch_mod.shutil, "which", lambda name: None)


# -- detect_launch ---------------------------------------------------------------------------

def test_nothing_means_single():
    assert detect_launch({}) == LaunchInfo("single", 0, 1, 0, 1, None)
    assert detect_launch() == LaunchInfo("single", 0, 1, 0, 1, None)


def test_torchrun_environment():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "host", "MASTER_PORT": "29500"}
    assert detect_launch(env) == LaunchInfo("torchrun", 5, 8, 1, 4, None)


def test_torchrun_defaults_for_local_values():
    assert detect_launch({"RANK": "1", "WORLD_SIZE": "2"}) == LaunchInfo("torchrun", 1, 2, 0, 2, None)


def test_torchrun_wins_over_slurm():
    env = {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "3", "SLURM_NTASKS": "4"}
    assert detect_launch(env).launcher == "torchrun"


def test_rank_without_world_size_is_not_torchrun():
    assert detect_launch({"RANK": "3"}).launcher == "single"


@pytest.mark.parametrize("name", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"])
def test_non_integer_torchrun_value(name):
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", name: "zero"}
    with pytest.raises(ConfigError) as info:
        detect_launch(env)
    assert f"{name}='zero' is not an integer" in str(info.value)


def test_slurm_nodelist_without_master_addr(no_scontrol):
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2",
           "SLURM_JOB_NODELIST": "gpu[003-005,9]", "SLURM_JOB_ID": "123456"}
    launch = detect_launch(env)
    assert launch == LaunchInfo("slurm", 2, 4, 1, 2, "tcp://gpu003:23456")  # 20000 + 123456 % 20000


def test_slurm_port_is_derived_from_the_job_id(no_scontrol):
    base = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"}
    ports = {job: detect_launch({**base, "SLURM_JOB_ID": job}).init_method for job in ("7", "20007", "8")}
    assert ports["7"] == "tcp://n1:20007"
    assert ports["20007"] == ports["7"]  # same modulo
    assert ports["8"] == "tcp://n1:20008"
    # No job id at all: the base port.
    assert detect_launch(base).init_method == "tcp://n1:20000"


def test_slurm_respects_master_addr_and_port(no_scontrol):
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[003-005]",
           "SLURM_JOB_ID": "42", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "31337"}
    assert detect_launch(env).init_method == "tcp://10.0.0.7:31337"


def test_slurm_step_nodelist_preferred(no_scontrol):
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a[1-4]",
           "SLURM_STEP_NODELIST": "b[7-8]", "SLURM_JOB_ID": "1"}
    assert detect_launch(env).init_method == "tcp://b7:20001"


def test_slurm_uses_scontrol_when_available(tmp_path, monkeypatch):
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] || exit 1\necho realhost-a\necho realhost-b\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[003-005]", "SLURM_JOB_ID": "5"}
    assert detect_launch(env).init_method == "tcp://realhost-a:20005"


def test_slurm_single_task_needs_no_rendezvous(no_scontrol):
    launch = detect_launch({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert launch == LaunchInfo("slurm", 0, 1, 0, 1, None)


def test_slurm_local_world_size_with_odd_tasks_per_node(no_scontrol):
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2(x2)",
           "MASTER_ADDR": "h", "MASTER_PORT": "1234"}
    assert detect_launch(env).local_world_size == 4


def test_slurm_without_nodelist_or_master_addr(no_scontrol):
    with pytest.raises(ConfigError) as info:
        detect_launch({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    assert "neither MASTER_ADDR nor SLURM_JOB_NODELIST" in str(info.value)
    assert "export MASTER_ADDR" in str(info.value)


def test_slurm_non_integer_values(no_scontrol):
    with pytest.raises(ConfigError, match="SLURM_NTASKS='four' is not an integer"):
        detect_launch({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "four"})
    with pytest.raises(ConfigError, match="MASTER_PORT='http' is not an integer"):
        detect_launch({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "h", "MASTER_PORT": "http"})


def test_slurm_non_integer_job_id(no_scontrol):
    with pytest.raises(ConfigError, match="SLURM_JOB_ID"):
        detect_launch({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1",
                       "SLURM_JOB_ID": "job42"})


# -- first_slurm_host ------------------------------------------------------------------------

@pytest.mark.parametrize("nodelist,host", [
    ("gpu[003-005,9]", "gpu003"),
    ("gpu[9,003-005]", "gpu9"),
    ("gpu[003-005,9],login1", "gpu003"),
    ("node1,node2", "node1"),
    ("login1", "login1"),
    (" node-a[01-02] ", "node-a01"),
    ("rack1-gpu[7]", "rack1-gpu7"),
])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["", "[1-2]", ",node1"])
def test_first_slurm_host_unreadable(nodelist):
    with pytest.raises(ConfigError, match="cannot read the first host"):
        first_slurm_host(nodelist)


# -- resolve_device --------------------------------------------------------------------------

@no_cuda
def test_auto_is_cpu_without_cuda():
    assert resolve_device("auto", 0) == torch.device("cpu")
    assert resolve_device("AUTO", 3) == torch.device("cpu")
    assert resolve_device("", 0) == torch.device("cpu")


def test_cpu():
    assert resolve_device("cpu", 5) == torch.device("cpu")
    assert resolve_device(" CPU ", 0) == torch.device("cpu")


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "CUDA:1"])
def test_cuda_without_cuda(device):
    with pytest.raises(ConfigError) as info:
        resolve_device(device, 0)
    message = str(info.value)
    assert f"--device {device} was asked for" in message
    assert "no CUDA device is visible" in message


@pytest.mark.parametrize("device", ["bogus", "gpu", "mps", "cuda0"])
def test_bogus_device(device):
    if device == "cuda0" and torch.cuda.is_available():
        pytest.skip("on a GPU machine 'cuda0' is caught by the cuda branch's int() parse")
    with pytest.raises(ConfigError) as info:
        resolve_device(device, 0)
    assert "--device must be auto, cpu, cuda or cuda:N" in str(info.value)
    assert repr(device) in str(info.value)


# -- WorkerGroup without a launcher ----------------------------------------------------------

def test_worker_group_single_process():
    with WorkerGroup() as group:
        assert group.world_size == 1
        assert group.rank == 0
        assert group.local_rank == 0
        assert group.launch.launcher == "single"
        assert group.process_group is None
        assert group.backend is None
        assert group.exchange({"x": 1}) == [{"x": 1}]
        group.check_all_ok("nothing")
        assert group.agree("step", lambda: 41 + 1) == 42
        assert "world_size=1" in repr(group)
    assert not torch.distributed.is_initialized()


@no_cuda
def test_worker_group_default_device_is_cpu_here():
    with WorkerGroup() as group:
        assert group.device == torch.device("cpu")


def test_agree_reraises_the_local_error():
    error = ValueError("local failure")
    with WorkerGroup(device="cpu") as group:
        def fail():
            raise error

        with pytest.raises(ValueError) as info:
            group.agree("step", fail)
        assert info.value is error
        group.report_failure("step", error)  # a no-op on one process


def test_agree_reraises_distload_errors_unchanged():
    with WorkerGroup(device="cpu") as group:
        def fail():
            raise ConfigError("bad setting")

        with pytest.raises(ConfigError, match="^bad setting$"):
            group.agree("planning", fail)


def test_non_integer_rank_gives_config_error(monkeypatch):
    monkeypatch.setenv("RANK", "first")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="RANK='first' is not an integer"):
        WorkerGroup(device="cpu")
    assert not torch.distributed.is_initialized()


def test_worker_group_explicit_environ():
    with WorkerGroup(device="cpu", environ={}) as group:
        assert group.world_size == 1
    with pytest.raises(ConfigError, match="WORLD_SIZE='two'"):
        WorkerGroup(device="cpu", environ={"RANK": "0", "WORLD_SIZE": "two"})


@pytest.mark.parametrize("timeout", [0, -1, None])
def test_worker_group_bad_timeout(timeout):
    with pytest.raises(ConfigError, match="group timeout must be a positive number"):
        WorkerGroup(device="cpu", timeout_s=timeout)


@no_cuda
def test_worker_group_cuda_device_without_cuda():
    with pytest.raises(ConfigError, match="no CUDA device"):
        WorkerGroup(device="cuda")


def test_cli_reports_bad_rank_cleanly(monkeypatch, tmp_path, capsys):
    from distload.cli.main import main

    monkeypatch.setenv("RANK", "first")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["load", str(tmp_path), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "distload: error on rank ?" in err
    assert "RANK='first' is not an integer" in err


def test_distload_error_hierarchy():
    assert issubclass(ConfigError, DistloadError)


def test_batch_shell_without_srun_is_one_process():
    """sbatch's own shell has SLURM_PROCID=0 and SLURM_NTASKS=2 but no step: not rank 0 of 2."""
    launch = detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"})
    assert (launch.launcher, launch.world_size) == ("single", 1)


def test_slurm_step_task_count_wins():
    launch = detect_launch({"SLURM_STEP_ID": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "8",
                            "SLURM_STEP_NUM_TASKS": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert (launch.launcher, launch.rank, launch.world_size) == ("slurm", 1, 2)


def test_heartbeat_threads_stop_before_exit():
    """A heartbeat still calling into its store while the interpreter finalizes made a process
    abort at exit (a WorkerGroup left open beside a DTensor job); the runtime stops them at exit."""
    import threading

    from distload.workers.heartbeat import Beat
    from distload.runtime import RUNTIME

    class Store:
        def __init__(self):
            self.count = 0

        def add(self, key, amount):
            self.count += amount
            return self.count

    store = Store()
    with RUNTIME.lock:
        RUNTIME.heartbeats[id(store)] = beat = Beat(store, 0)
    assert any(t.name == "distload-heartbeat" for t in threading.enumerate())
    RUNTIME.stop_heartbeats()
    assert not beat._thread.is_alive() and RUNTIME.heartbeats == {}
    assert store.count >= 1


# -- which group carries data for which device (review findings 3, 4, 5, 10) ------------------

from distload.workers.group import carries, subgroup_backend  # noqa: E402


@pytest.mark.parametrize("backend, device_type, expected", [
    ("nccl", "cuda", True), ("nccl", "cpu", False),  # 10: a CPU tensor on an NCCL-only group
    ("gloo", "cpu", True), ("gloo", "cuda", False),  # 3: gloo P2P takes the device pointer
    ("cpu:gloo,cuda:nccl", "cpu", True), ("cpu:gloo,cuda:nccl", "cuda", True),
    ("cuda:nccl", "cpu", False), (None, "cpu", False),
])
def test_carries(backend, device_type, expected):
    assert carries(backend, device_type) is expected


def test_subgroup_is_one_group_whose_object_collectives_run_on_gloo():
    """Finding 5: on CUDA one cpu:gloo,cuda:nccl group (one ncclCommSplit on every rank), not an
    NCCL group then a gloo one (a second split only the ranks left out take part in)."""
    assert subgroup_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert carries(subgroup_backend("cuda"), "cpu") and carries(subgroup_backend("cuda"), "cuda")
    assert subgroup_backend("cpu") == "gloo"


def test_instanttensor_refuses_what_it_would_get_wrong():
    from distload.errors import BackendUnavailableError
    from distload.loading.backends.instanttensor import check_instanttensor_read
    ok = [("a.safetensors", "w", "BF16")]
    check_instanttensor_read(True, "job", "nccl", 8, 8, ok)
    check_instanttensor_read(False, "job", "gloo", 8, 8, ok)  # each rank reads alone
    with pytest.raises(BackendUnavailableError, match="NCCL process group only.*gloo"):  # finding 4
        check_instanttensor_read(True, "job", "gloo", 2, 2, ok)
    with pytest.raises(BackendUnavailableError, match="spans nodes of 8"):  # finding 17
        check_instanttensor_read(True, "node", "nccl", 16, 8, ok)
    check_instanttensor_read(True, "node", "nccl", 8, 8, ok)  # one node: node is the whole group
    with pytest.raises(BackendUnavailableError, match="tensor 'q' is F4.*safetensors"):  # finding 6
        check_instanttensor_read(False, "job", None, 1, 1, ok + [("a.safetensors", "q", "F4")])


# -- naming a lost peer (issue 30, item 7) ---------------------------------------------------------

def test_a_collective_failure_is_quoted_without_gloos_location_and_advice():
    from distload.workers.group import collective_cause

    closed = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                          "[127.0.0.1]:31910: Connection reset by peer. This is typically caused by a remote worker "
                          "hanging or bugs in the application. Check the logs of the remote worker before "
                          "reporting an error. GLHF! \U0001F3D6\ufe0f")
    assert collective_cause(closed) == "Read error [127.0.0.1]:31910: Connection reset by peer"
    late = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms "
                        "for recv operation to complete")
    assert collective_cause(late) == "Timed out waiting 10000ms for recv operation to complete"
    assert collective_cause(RuntimeError("")) == "RuntimeError"


def test_a_peer_whose_process_is_gone_is_named_and_a_running_one_is_not():
    import subprocess
    import sys

    from distload.workers.heartbeat import ended_processes, process_identity

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ns = os.readlink("/proc/self/ns/pid")
        with open(f"/proc/{child.pid}/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]
        posted = process_identity(0) + f"1 {ns} {child.pid} {start};" + f"2 pid:[1] {child.pid} {start};"
        assert ended_processes(posted, [1, 2]) == []  # running; rank 2 lives in another PID namespace
        child.kill()
        child.wait()
        assert ended_processes(posted, [0, 1, 2]) == [1]  # gone; this process (0) runs; 2 cannot be told
        assert ended_processes(posted + f"3 {ns} {os.getpid()} 1;", [3]) == [3]  # its PID now another's
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
