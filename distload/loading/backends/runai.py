"""Run:ai Model Streamer: concurrent chunked reads, optionally shared across ranks (Run:ai's distributed mode).

Distributed mode splits the chunks of ONE file list across the ranks of the default process group
(grouped by host), each rank reads its share and broadcasts it. Two quirks shape this module:

- it silently falls back to plain streaming in several cases (gloo without
  ``RUNAI_STREAMER_DIST=1``, too little GPU memory, ...), so we set the variable ourselves and
  report the path the library actually took (``runai-distributed`` or ``runai``);
- ranks with different file lists silently receive each other's data, so the caller must have
  checked that every rank holds the same list before ``shared`` is set.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import torch

from distload.config import check_positive_int, is_int
from distload.errors import (BackendUnavailableError, CheckpointError, ConfigError, DistloadError, GroupError,
                             ObjectStoreError, RankFailedError)
from distload.loading.backends.base import Backend, BackendRun, ReadOptions, ReadRequest
from distload.loading.sources import is_object_store
from distload.runtime import RUNTIME
from distload.workers.group import collective_cause

if TYPE_CHECKING:
    from distload.workers.group import WorkerGroup
    from distload.loading.plan import RankPlan

log = logging.getLogger("distload")


# Dtypes Run:ai 0.17.1 refuses while streaming (seen here); it streams F8_E8M0 and F4.
UNSUPPORTED_DTYPES = frozenset({"F8_E4M3FNUZ", "F8_E5M2FNUZ"})


def check_memory_limit(key: str, value: Any) -> None:
    if not is_int(value) or value < -1:
        raise ConfigError(
            f"extra config '{key}' must be an int >= -1 (-1: unlimited, 0: the largest tensor, "
            f"N: bytes), got {value!r}"
        )


def _import_streamer():
    try:
        from runai_model_streamer import SafetensorsStreamer
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the Run:ai formats need runai-model-streamer: pip install 'distload' (it is a "
            f"core dependency) ({exc})"
        ) from None
    return SafetensorsStreamer


@dataclass(frozen=True)
class RunaiOptions(ReadOptions):
    """Run:ai's settings: its extra-config keys (None: the library's default), and for a
    shared read which ranks split it, each node's (``node``) or the whole job's (``job``)."""

    concurrency: int | None = None
    memory_limit: int | None = None
    scope: str = "node"


class RunaiBackend(Backend):
    name = "runai"
    keys = {"concurrency": check_positive_int, "memory_limit": check_memory_limit}
    package = "runai_model_streamer"

    def preflight(self, plan: "RankPlan", group: "WorkerGroup") -> None:
        """The refusals Run:ai's reader would otherwise meet only once reading starts."""
        super().preflight(plan, group)
        if plan.choice.shared and not group.is_world:
            raise BackendUnavailableError(
                f"Run:ai's distributed mode runs only over the job's default process group, and this "
                f"load runs over a subgroup of {group.world_size} of its ranks; let each rank read alone "
                f"(extra config distributed=false), or load over the whole job"
            )
        unreadable = [t for t in plan.index.tensors if t.dtype in UNSUPPORTED_DTYPES]
        if unreadable:
            shown = "; ".join(f"{t.file}: tensor {t.name!r} is {t.dtype}" for t in unreadable[:5])
            more = f" (and {len(unreadable) - 5} more)" if len(unreadable) > 5 else ""
            raise BackendUnavailableError(
                f"{shown}{more}: Run:ai Model Streamer 0.17 cannot stream "
                f"{' or '.join(sorted({t.dtype for t in unreadable}))} ('Unsupported dtype'); load this "
                f"checkpoint with --load-format safetensors (or sharded_state for per-rank files), which "
                f"reads every safetensors dtype")
        paths = [info.path for info in plan.index.files]
        store = _object_store(paths)
        if store is not None and paths:
            _preflight(store, paths[0])

    def options(self, extra: Mapping[str, Any], plan: "RankPlan") -> RunaiOptions:
        return RunaiOptions(concurrency=extra.get("concurrency"), memory_limit=extra.get("memory_limit"),
                            scope=plan.choice.scope)

    def environment(self, request: ReadRequest) -> dict[str, str]:
        env: dict[str, str] = {}
        options = request.options_as(RunaiOptions)
        if options.concurrency is not None:
            env["RUNAI_STREAMER_CONCURRENCY"] = str(options.concurrency)
        if options.memory_limit is not None:
            env["RUNAI_STREAMER_MEMORY_LIMIT"] = str(options.memory_limit)
        store = _object_store([info.path for info in request.index.files])
        if store is not None:
            env.update(store.reader_environment())
        if _distributed(request):
            # "auto" means NCCL only: on gloo the library would quietly stream alone on each rank.
            env["RUNAI_STREAMER_DIST"] = "1"
            # Job-wide: one group of every rank splits the reads (each byte once per job), not one
            # group per node (each node reads everything).
            env["RUNAI_STREAMER_DIST_GLOBAL"] = "1" if options.scope == "job" else "0"
            env["RUNAI_STREAMER_DIST_TIMEOUT"] = str(max(1, int(request.group.timeout.total_seconds())))
        return env

    def read(self, request: ReadRequest) -> BackendRun:
        streamer_cls = _import_streamer()
        paths = [info.path for info in request.index.files]
        run = BackendRun(_path(request, _distributed(request)))
        return run.start(_stream(streamer_cls, request, paths, self.environment(request), run,
                                 _object_store(paths)))


def _path(request: ReadRequest, distributed: bool) -> str:
    if not distributed:
        return "runai"
    return "runai-distributed-job" if request.options_as(RunaiOptions).scope == "job" else "runai-distributed"


def _distributed(request: ReadRequest) -> bool:
    return request.shared and request.group.world_size > 1


def _check_one_store_kind(scheme: str) -> None:
    # Run:ai 0.17 serves a single object-store type per process: after it read from s3://, a gs://
    # read fails with b'File access error', and the other way round (seen here with 0.17.1).
    used = RUNTIME.runai_store_scheme
    if used is not None and used != scheme:
        raise BackendUnavailableError(
            f"Run:ai's reader serves one object-store type per process, and this process already read "
            f"from {used}:// with it: a read from {scheme}:// here would fail with b'File access error'. "
            f"Load {scheme}:// sources in another process, or with --load-format safetensors (ranged "
            f"reads) in this one"
        )


def _preflight(store, uri: str) -> None:
    _check_one_store_kind(store.scheme)
    # Run:ai's GCS reader retries an endpoint that is down for minutes: check it answers first.
    store.check_reachable(uri, store.reader_endpoint())


def _object_store(paths: list[str]):
    """The store all ``paths`` are in, or None for local files (Run:ai takes one scheme per call)."""
    remote = [p for p in paths if is_object_store(p)]
    if not remote:
        return None
    schemes = {p.split("://", 1)[0] for p in paths}
    if len(remote) != len(paths) or len(schemes) > 1:
        raise CheckpointError(f"Run:ai reads one storage type per load, got {', '.join(sorted(schemes))}")
    from distload.loading.stores import store_for

    return store_for(remote[0])[0]


def _read_failure(paths: list[str], store, exc: BaseException) -> DistloadError:
    """An error that says what went wrong, for Run:ai's opaque ``b'File access error'``."""
    if store is None:
        return CheckpointError(f"Run:ai could not read {', '.join(paths)}: {exc}")
    from distload.loading.stores import scrub

    try:
        found = store.diagnose(paths)
    except ObjectStoreError as diagnosed:
        return diagnosed
    if found is not None:
        return found
    return CheckpointError(scrub(
        f"Run:ai's {store.product} reader could not read {', '.join(paths)} ({exc}), yet distload's own "
        f"{store.product} client reaches every one of them at {store.endpoint().describe()}: the reader is "
        f"configured differently. It connects to {store.reader_endpoint().describe()}; set "
        f"RUNAI_STREAMER_LOG_TO_STDERR=1 to see its own reason"))


def _stream(streamer_cls, request: ReadRequest, paths: list[str], env: dict[str, str], run: BackendRun,
            store) -> Iterator[tuple[str, torch.Tensor]]:
    if not paths:
        return
    if store is not None:
        # Again here: the endpoint may have gone away since planning.
        _preflight(store, paths[0])
    distributed = _distributed(request) and all_can_distribute(
        request.group, max((t.nbytes for t in request.index.tensors), default=0),
        torch.cuda.mem_get_info(request.device)[0] if request.device.type == "cuda" else None)
    if not distributed:
        env = {key: value for key, value in env.items() if not key.startswith("RUNAI_STREAMER_DIST")}
    with RUNTIME.environment(env), _quiet_python_log(), streamer_cls() as streamer:
        try:
            streamer.stream_files(paths, device=str(request.device), is_distributed=distributed)
        except (ValueError, RuntimeError) as exc:
            raise _wrapped(exc, paths, store, request, distributed) from exc
        if store is not None and RUNTIME.runai_store_scheme is None:
            RUNTIME.runai_store_scheme = store.scheme
        took_distributed = bool(getattr(streamer.file_streamer, "is_distributed", False))
        run.path = _path(request, took_distributed)
        if distributed and not took_distributed:
            log.warning(
                "rank %d: Run:ai did not use distributed streaming (it fell back to reading alone; "
                "set RUNAI_STREAMER_LOG_TO_STDERR=1 for its reason); the report says path=runai",
                request.group.rank,
            )
        try:
            yield from streamer.get_tensors()
        except (ValueError, RuntimeError) as exc:
            raise _wrapped(exc, paths, store, request, distributed) from exc


def short_of_memory(free: Sequence[int | None], largest_tensor: int) -> list[int]:
    """The ranks (of ``free``: each rank's free device bytes, None off CUDA) on which Run:ai's
    distributed mode would fall back to reading alone: it needs twice its largest chunk free on
    the device (``set_is_distributed``: ``free_memory < 2 * self.params.max_chunk``), and a
    safetensors file's chunks are its tensors (``FileChunks.contiguous(i, path, offset,
    tensor_sizes)``)."""
    return [rank for rank, nbytes in enumerate(free) if nbytes is not None and nbytes < 2 * largest_tensor]


def all_can_distribute(group: "WorkerGroup", largest_tensor: int, free: int | None) -> bool:
    """Whether every rank will stream distributed (``free``: this rank's free device bytes, None
    off CUDA). Run:ai decides it per rank, from the free memory of the current device, and the
    ranks that stay distributed then make groups and broadcasts that a rank which fell back
    never joins (a hang in ncclCommSplit with a bound default group). Agreed here first: where
    any rank is short of memory, every rank reads alone."""
    statuses = group.exchange((True, free))  # a rank that failed before sends (False, its error)
    failures = {rank: message for rank, (ok, message) in enumerate(statuses) if not ok}
    if failures:
        raise RankFailedError("reading with Run:ai", failures)
    short = short_of_memory([nbytes for _, nbytes in statuses], largest_tensor)
    if short:
        log.warning(
            "rank %d: Run:ai's distributed read needs %d bytes free on every GPU (twice the largest tensor), and "
            "rank(s) %s have less: every rank reads alone (path=runai); free GPU memory there to share the read",
            group.rank, 2 * largest_tensor, ", ".join(map(str, short)))
    return not short


@contextlib.contextmanager
def _quiet_python_log() -> Iterator[None]:
    """Run:ai's Python side logs every failure with its traceback (``logger.exception``), which
    Python's last-resort handler prints before distload's own message: keep it off the screen
    while distload reads, unless its log was asked for (RUNAI_STREAMER_LOG_LEVEL or
    RUNAI_STREAMER_LOG_TO_STDERR set, or a handler on the ``runai_model_streamer`` logger; Run:ai
    sets that logger's level itself on import, so its level says nothing)."""
    logger = logging.getLogger("runai_model_streamer")
    asked = (os.environ.get("RUNAI_STREAMER_LOG_LEVEL") or os.environ.get("RUNAI_STREAMER_LOG_TO_STDERR") == "1"
             or logger.handlers)
    if asked:
        yield
        return
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def _wrapped(exc: BaseException, paths: list[str], store, request: ReadRequest, distributed: bool) -> DistloadError:
    """Every Run:ai failure as a DistloadError naming the files (and, in a distributed read, that a
    peer stopped): never a raw libstreamer or gloo traceback."""
    text = str(exc)
    if "access error" in text:
        # Run:ai reports every I/O fault as b'File access error'; find the real cause.
        return _read_failure(paths, store, exc)
    if distributed and isinstance(exc, RuntimeError):
        # Run:ai's distributed mode exchanges chunks over the group: a peer that died or stalled
        # shows here as gloo's "Connection closed by peer" or a timeout.
        reason = collective_cause(exc)
        return GroupError(f"rank {request.group.rank}: Run:ai's distributed read of {', '.join(paths)} lost a "
                          f"peer ({reason}){request.group.lost_peers(exc)}; every rank stops")
    if "End of file" in text:
        return CheckpointError(f"Run:ai could not read {', '.join(paths)}: a file ended before its header "
                               f"says (truncated while loading?): {text}")
    return CheckpointError(f"Run:ai could not read {', '.join(paths)}: {text}")
