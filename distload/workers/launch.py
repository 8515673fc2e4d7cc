"""Who this process is, as its launcher said: torchrun's environment (``RANK``/``WORLD_SIZE``/
``LOCAL_RANK``), Slurm's (``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` when ``srun`` started
the ranks directly), or nothing (one process); and which device a rank owns. Reads the
environment only: no process group.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Mapping

import torch

from distload.errors import ConfigError, on_every_rank


@dataclass(frozen=True)
class LaunchInfo:
    """Where this rank sits, as the launcher described it."""

    launcher: str  # "torchrun", "slurm" or "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    init_method: str | None  # None: torchrun's env:// (MASTER_ADDR/MASTER_PORT) or no group


def _env_int(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list such as ``gpu[003-005,9],login1`` -> ``gpu003``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ConfigError(f"cannot read the first host of the Slurm node list {nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _slurm_master_addr(environ: Mapping[str, str]) -> str:
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"]
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise ConfigError(
            "started by Slurm with several tasks but neither MASTER_ADDR nor SLURM_JOB_NODELIST is "
            "set; export MASTER_ADDR=<first node of the allocation>"
        )
    if shutil.which("scontrol"):
        # scontrol knows every node-list syntax; our parser is the fallback when it is absent.
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
            )
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return first_slurm_host(nodelist)


def _slurm_master_port(environ: Mapping[str, str]) -> int:
    if environ.get("MASTER_PORT"):
        return _env_int(environ, "MASTER_PORT")
    # Every task of a job derives the same port from the job id, and concurrent jobs on one node
    # are unlikely to collide.
    job_id = _env_int(environ, "SLURM_JOB_ID") if environ.get("SLURM_JOB_ID") else 0
    return 20000 + job_id % 20000


def detect_launch(environ: Mapping[str, str] = os.environ) -> LaunchInfo:
    """Read rank, world size and local rank from torchrun's, then Slurm's environment."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        world_size = _env_int(environ, "WORLD_SIZE")
        return LaunchInfo(
            launcher="torchrun",
            rank=_env_int(environ, "RANK"),
            world_size=world_size,
            local_rank=_env_int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0,
            local_world_size=(
                _env_int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else world_size
            ),
            init_method=None,
        )
    # Only a task that srun started (SLURM_STEP_ID set) is a rank: the batch script's own shell
    # also has SLURM_PROCID=0 and SLURM_NTASKS=N, and treating it as rank 0 of N would wait the
    # whole timeout for ranks that never start.
    if "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ:
        tasks_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
        world_size = _env_int(environ, tasks_var) if tasks_var in environ else 1
        rank = _env_int(environ, "SLURM_PROCID")
        local_rank = _env_int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0
        local_world_size = world_size
        if environ.get("SLURM_NTASKS_PER_NODE", "").isdigit():
            local_world_size = int(environ["SLURM_NTASKS_PER_NODE"])
        init_method = None
        if world_size > 1:
            init_method = f"tcp://{_slurm_master_addr(environ)}:{_slurm_master_port(environ)}"
        return LaunchInfo("slurm", rank, world_size, local_rank, local_world_size, init_method)
    return LaunchInfo("single", 0, 1, 0, 1, None)


def check_device(device: str | None) -> str:
    """The device setting's spelling (auto, cpu, cuda or cuda:N), lower-cased; what the machine
    has is :func:`resolve_device`'s to check. The command line checks it before any rank starts."""
    choice = (device or "auto").strip().lower()
    if choice in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", choice):
        return choice
    raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}")


def resolve_device(device: str, local_rank: int) -> torch.device:
    """``auto`` -> ``cuda:<local_rank>`` when CUDA is there, else ``cpu``; explicit values checked."""
    choice = check_device(device)
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        # Every rank of a node sees the same devices (torchrun and srun start them alike).
        raise on_every_rank(ConfigError(
            f"--device {device} was asked for, but no CUDA device is visible to this process "
            f"(torch.cuda.is_available() is False); use --device cpu or auto"
        ), "node")
    index = local_rank if choice == "cuda" else int(choice.split(":", 1)[1])
    if choice == "cuda" and torch.cuda.device_count() == 1:
        # One GPU visible per task (srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES set per rank).
        index = 0
    if index >= torch.cuda.device_count():
        raise ConfigError(
            f"device cuda:{index} does not exist: this node has {torch.cuda.device_count()} "
            f"visible GPU(s); start at most that many ranks per node"
        )
    return torch.device("cuda", index)
