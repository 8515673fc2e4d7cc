"""Run:ai Model Streamer: concurrent chunked reads, optionally cooperative across ranks.

Distributed mode splits the chunks of ONE file list across the ranks of the default process group
(grouped by host), each rank reads its share and broadcasts it. Two quirks shape this module:

- it silently falls back to plain streaming in several cases (gloo without
  ``RUNAI_STREAMER_DIST=1``, too little GPU memory, ...), so we set the variable ourselves and
  report the path the library actually took (``runai-distributed`` or ``runai``);
- ranks with different file lists silently receive each other's data, so the caller must have
  checked that every rank holds the same list before ``cooperative`` is set.
"""

from __future__ import annotations

import logging
from typing import Iterator

import torch

from ..config import applied_environment, runai_environment
from ..errors import BackendUnavailableError, CheckpointError
from .base import BackendRun, ReadRequest

log = logging.getLogger("distload")


def _import_streamer():
    try:
        from runai_model_streamer import SafetensorsStreamer
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the Run:ai formats need runai-model-streamer: pip install 'distload' (it is a "
            f"core dependency) ({exc})"
        ) from None
    return SafetensorsStreamer


def read_runai(request: ReadRequest) -> BackendRun:
    streamer_cls = _import_streamer()
    group = request.group
    distributed = request.cooperative and group.world_size > 1
    env = runai_environment(request.extra)
    if distributed:
        # "auto" means NCCL only: on gloo the library would quietly stream alone on each rank.
        env["RUNAI_STREAMER_DIST"] = "1"
        env["RUNAI_STREAMER_DIST_TIMEOUT"] = str(max(1, int(group.timeout.total_seconds())))
    run = BackendRun("runai-distributed" if distributed else "runai")
    return run.start(_stream(streamer_cls, request, env, distributed, run))


def _stream(streamer_cls, request: ReadRequest, env: dict[str, str], distributed: bool,
            run: BackendRun) -> Iterator[tuple[str, torch.Tensor]]:
    paths = [info.path for info in request.index.files]
    if not paths:
        return
    with applied_environment(env), streamer_cls() as streamer:
        try:
            streamer.stream_files(paths, device=str(request.device), is_distributed=distributed)
        except ValueError as exc:
            # Run:ai reports every I/O fault as b'File access error'; name the files at least.
            raise CheckpointError(f"Run:ai could not read {', '.join(paths)}: {exc}") from exc
        took_distributed = bool(getattr(streamer.file_streamer, "is_distributed", False))
        run.path = "runai-distributed" if took_distributed else "runai"
        if distributed and not took_distributed:
            log.warning(
                "rank %d: Run:ai did not use distributed streaming (it fell back to reading alone; "
                "set RUNAI_STREAMER_LOG_TO_STDERR=1 for its reason); the report says path=runai",
                request.group.rank,
            )
        yield from streamer.get_tensors()
