"""The worker group: who this process is, which device it owns, and how ranks agree.

A group comes from torchrun's environment (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``), from Slurm's
(``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` when ``srun`` started the ranks directly), or
from nothing (one process, no process group at all).

Every collective that distload issues goes through :meth:`WorkerGroup.agree` or
:meth:`WorkerGroup.exchange`, on a gloo *control* group with a timeout. A step that fails on one
rank is reported to all of them, so no rank waits for a failed one: the failing rank raises its own
error, the others raise :class:`RankFailedError` naming it.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping, TypeVar

import torch
import torch.distributed as dist

from distload.errors import ConfigError, DistloadError, GroupError, RankFailedError

DEFAULT_TIMEOUT_S = 300.0

T = TypeVar("T")


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


def resolve_device(device: str, local_rank: int) -> torch.device:
    """``auto`` -> ``cuda:<local_rank>`` when CUDA is there, else ``cpu``; explicit values checked."""
    choice = (device or "auto").strip().lower()
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cpu":
        return torch.device("cpu")
    if choice == "cuda" or choice.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"--device {device} was asked for, but no CUDA device is visible to this process "
                f"(torch.cuda.is_available() is False); use --device cpu or auto"
            )
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
    raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, DistloadError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class WorkerGroup:
    """This rank's place in the job: rank, device, and the collectives to agree with the others.

    Use as a context manager (or call :meth:`close`): the process group is always torn down, on
    failing paths too, because a gloo group still alive at interpreter exit can abort the process.

    If ``torch.distributed`` is already initialised (a training job importing distload), the
    existing default group is used and left alone on close.
    """

    def __init__(self, device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
                 environ: Mapping[str, str] = os.environ):
        if not timeout_s or timeout_s <= 0:
            raise ConfigError(f"group timeout must be a positive number of seconds, got {timeout_s!r}")
        self.timeout = timedelta(seconds=timeout_s)
        self._owns_default_group = False
        self._control: Any = None
        if dist.is_available() and dist.is_initialized():
            self.launch = LaunchInfo(
                "existing", dist.get_rank(), dist.get_world_size(),
                int(environ.get("LOCAL_RANK", "0")), int(environ.get("LOCAL_WORLD_SIZE", "1")), None,
            )
        else:
            self.launch = detect_launch(environ)
        self.device = resolve_device(device, self.launch.local_rank)
        if self.world_size > 1 and not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            kwargs: dict[str, Any] = {"backend": backend, "timeout": self.timeout}
            if self.launch.init_method:
                kwargs.update(init_method=self.launch.init_method, rank=self.rank, world_size=self.world_size)
            if backend == "nccl":
                kwargs["device_id"] = self.device
            try:
                dist.init_process_group(**kwargs)
            except Exception as exc:  # a peer that never started, a port in use, a bad address
                raise GroupError(self._rendezvous_failure(exc)) from exc
            self._owns_default_group = True
        if self.world_size > 1:
            # Control messages (errors, file lists, reports) always travel over gloo so they work
            # the same next to NCCL, and never touch device memory.
            if dist.get_backend() == "gloo":
                self._control = dist.group.WORLD
            else:
                self._control = dist.new_group(backend="gloo", timeout=self.timeout)
        self.hostname = socket.gethostname()

    def _rendezvous_failure(self, exc: BaseException) -> str:
        where = self.launch.init_method or (
            f"env://{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}")
        reason = str(exc).rstrip(".")
        message = (f"rank {self.rank} of {self.world_size} ({self.launch.launcher}) could not join the "
                   f"process group at {where} within {self.timeout.total_seconds():.0f}s: {reason}")
        if self.launch.launcher == "slurm":
            message += (
                f". Slurm said this job has SLURM_NTASKS={self.world_size} ranks: start them all with "
                f"srun (a batch script or salloc shell outside srun is one process; there, unset "
                f"SLURM_NTASKS and SLURM_PROCID, or use launch/slurm/load_srun.sbatch), and check that "
                f"{where} is reachable from every node (set MASTER_ADDR/MASTER_PORT otherwise)"
            )
        return message

    # -- identity ---------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def local_rank(self) -> int:
        return self.launch.local_rank

    @property
    def local_world_size(self) -> int:
        """Ranks on this node (the whole world where the launcher does not say)."""
        return self.launch.local_world_size

    @property
    def backend(self) -> str | None:
        return dist.get_backend() if self.world_size > 1 else None

    @property
    def process_group(self) -> Any:
        """The default (data) group, for backends that take a handle; None for one process."""
        return dist.group.WORLD if self.world_size > 1 else None

    # -- collectives --------------------------------------------------------------------------
    def exchange(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (an all-gather of picklable objects)."""
        if self.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, value, group=self._control)
        except Exception as exc:  # a peer died or the timeout passed
            raise GroupError(
                f"rank {self.rank}: lost contact with the other ranks while exchanging state "
                f"(timeout {self.timeout.total_seconds():.0f}s): {exc}"
            ) from exc
        return gathered

    def agree(self, step: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on every rank; if it fails anywhere, raise on every rank.

        The failing rank re-raises its own exception; the others raise RankFailedError naming
        each failing rank and its message.
        """
        try:
            result = fn()
        except BaseException as exc:  # KeyboardInterrupt too: the others must not wait
            self.report_failure(step, exc)
            raise
        self.check_all_ok(step)
        return result

    def report_failure(self, step: str, exc: BaseException) -> None:
        """Tell the other ranks this rank failed ``step`` (they are inside check_all_ok)."""
        if self.world_size == 1:
            return
        try:
            self.exchange((False, _describe(exc)))
        except GroupError:
            pass  # the peers are already gone; the local error is what matters now

    def check_all_ok(self, step: str) -> None:
        """The success side of :meth:`report_failure`: raise if any other rank failed."""
        statuses = self.exchange((True, None))
        failures = {rank: message for rank, (ok, message) in enumerate(statuses) if not ok}
        if failures:
            raise RankFailedError(step, failures)

    def close(self) -> None:
        if self._control is not None and self._control is not dist.group.WORLD:
            dist.destroy_process_group(self._control)
        self._control = None
        if self._owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_default_group = False

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"WorkerGroup(rank={self.rank}, world_size={self.world_size}, "
                f"local_rank={self.local_rank}, device={self.device}, launcher={self.launch.launcher})")
