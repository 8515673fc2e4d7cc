"""Shared test helpers: tiny checkpoints made in the test, and torchrun as a subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Mapping

import pytest
import torch
from safetensors.torch import load_file, save_file

from distload.loading.report import state_digest

# Every dtype the core must round-trip bit for bit.
ALL_DTYPES = [
    torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
]


def in_ci() -> bool:
    """Under CI (CI=true) every tool a test needs is installed: a missing one fails, never skips."""
    return bool(os.environ.get("CI"))


def every_dtype_state(seed: int = 0, prefix: str = "") -> dict[str, torch.Tensor]:
    """One tensor per dtype plus a 0-d and an empty tensor, values from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for i, dtype in enumerate(ALL_DTYPES):
        values = torch.randn(3 + i, 5, generator=generator) * 20
        if dtype == torch.bool:
            tensor = values > 0
        else:
            tensor = values.to(dtype)
        state[f"{prefix}t{i:02d}.{str(dtype).split('.')[-1]}"] = tensor
    state[f"{prefix}scalar"] = torch.tensor(2.5 + seed, dtype=torch.float32)
    state[f"{prefix}empty"] = torch.zeros(0, 7, dtype=torch.bfloat16)
    return state


def write_whole(folder: str, state: Mapping[str, torch.Tensor], num_files: int = 3) -> list[str]:
    """Split ``state`` over ``num_files`` files named like a Hugging Face checkpoint."""
    os.makedirs(folder, exist_ok=True)
    names = sorted(state)
    paths = []
    for i in range(num_files):
        chunk = {n: state[n].contiguous() for n in names[i::num_files]}
        path = os.path.join(folder, f"model-{i + 1:05d}-of-{num_files:05d}.safetensors")
        save_file(chunk, path)
        paths.append(path)
    return paths


def write_sharded(folder: str, world_size: int, parts: int = 2,
                  pattern: str = "model-rank-{rank}-part-{part}.safetensors") -> dict[int, dict[str, torch.Tensor]]:
    """Per-rank shards with distinct values per rank; returns rank -> its state."""
    os.makedirs(folder, exist_ok=True)
    states = {}
    for rank in range(world_size):
        state = every_dtype_state(seed=100 + rank)
        names = sorted(state)
        for part in range(parts):
            chunk = {n: state[n].contiguous() for n in names[part::parts]}
            save_file(chunk, os.path.join(folder, pattern.format(rank=rank, part=part)))
        states[rank] = state
    return states


def plain_read(paths: list[str]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in paths:
        state.update(load_file(path))
    return state


def plain_digest(paths: list[str]) -> str:
    return state_digest(plain_read(paths))


def run_distload(args: list[str], nproc: int | None = None, timeout: float = 180,
                 env: Mapping[str, str] | None = None, cwd: str | None = None,
                 torchrun: bool = False) -> subprocess.CompletedProcess:
    """``python -m distload ARGS`` alone (nproc None) or as a job of ``nproc`` ranks
    (dist_helpers.run_job: started as srun starts them, or under torchrun with ``torchrun``)."""
    from dist_helpers import run_job

    full_env = {k: v for k, v in os.environ.items()
                if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    if nproc is None:
        return subprocess.run([sys.executable, "-m", "distload", *args], capture_output=True, text=True,
                              timeout=timeout, env=full_env, cwd=cwd)
    return run_job(["-m", "distload", *args], nproc, timeout, full_env, cwd=cwd, torchrun=torchrun)


def read_report(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


@pytest.fixture
def whole_ckpt(tmp_path):
    """A whole checkpoint of every dtype over 3 files: (folder, expected state)."""
    state = every_dtype_state()
    folder = str(tmp_path / "whole")
    write_whole(folder, state)
    return folder, state


# -- the quick subset: pytest -m "not slow" ------------------------------------------------------
# Tests marked ``slow`` (setup.cfg) are left out of it: torchrun jobs beyond each area's first,
# object-store servers, Slurm, vLLM engines. A test outside that mark which takes longer than this
# (its setup included: a module fixture that starts a job counts) is named at the end of a quick
# run, so that the subset stays quick.
QUICK_TEST_LIMIT_S = 20.0
_quick_run_slow: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if report.when in ("setup", "call") and "slow" not in report.keywords:
        _quick_run_slow[report.nodeid] = _quick_run_slow.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, config):
    if "not slow" not in (config.getoption("markexpr", "") or ""):
        return
    over = sorted(((t, n) for n, t in _quick_run_slow.items() if t > QUICK_TEST_LIMIT_S), reverse=True)
    if over:
        terminalreporter.section("quick subset: tests to mark slow")
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}: over {QUICK_TEST_LIMIT_S:.0f} s, mark it "
                                        "@pytest.mark.slow (or make it quicker)")


# -- parallel: one test module per worker process (pytest-xdist, in the test extra) -------------
# Most of the suite's time goes to starting processes (torchrun's agent, then its ranks, servers,
# engines): a torchrun job keeps one of two cores idle about a third of its time. With
# pytest-xdist installed, a run uses one worker per core (-n N sets the count, -n 0 runs in this
# process; -s and --pdb run in this process too), each module whole on one worker (--dist
# loadfile: its module fixtures, servers and engines start once), the longest modules first so
# that none is left running alone at the end. Without pytest-xdist the suite runs serially.
LONGEST_MODULES_FIRST = (  # measured (2 workers on 2 cores): about 4.5 minutes (vLLM's engines) to 1.5
    "test_vllm_engine.py", "test_object_stores.py", "test_dist_failures.py", "test_sync_failures.py",
    "test_shared_reads.py", "test_node_cache.py", "test_pull.py", "test_sync_jobs.py", "test_cli.py",
    "test_cluster_loads.py", "test_save_reshard.py", "test_launch_slurm.py", "test_cluster_sync.py",
    "test_verl_engine.py",
)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """distload's and the tests' bytecode, written once before any test: the suite starts a
    thousand Python processes, and where PYTHONDONTWRITEBYTECODE is set (as on the CI machines)
    none of them writes what it compiles, so each would compile the modules it imports again
    (about 0.1 s of CPU each). Python reads the bytecode whatever that setting says."""
    if hasattr(session.config, "workerinput"):
        return  # the controller did it
    import compileall

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for folder in ("distload", "tests", "benchmarks"):
        compileall.compile_dir(os.path.join(root, folder), quiet=2, workers=1,
                               rx=re.compile(r"node_modules"))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return
    if config.option.numprocesses is not None or config.option.dist != "no":
        return  # the command line says how
    if config.getoption("usepdb", False) or config.getoption("capture", "fd") == "no":
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cores >= 2:
        config.option.numprocesses = cores
        config.option.dist = "loadfile"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):
        return  # a serial run keeps the files' order

    def rank(item) -> int:
        name = os.path.basename(str(item.path))
        return LONGEST_MODULES_FIRST.index(name) if name in LONGEST_MODULES_FIRST else len(LONGEST_MODULES_FIRST)

    items.sort(key=rank)  # stable: each module's own order is kept
