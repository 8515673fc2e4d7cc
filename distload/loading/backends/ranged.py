"""Ranged reads from an object store: what ``safetensors`` and ``sharded_state`` do on ``s3://``,
``gs://`` and ``az://`` (safetensors' own reader needs a local file).

Each file is read in order with ranged GETs through the store's SDK client (the one that listed it
and read its headers), consecutive tensors coalesced into requests of up to ``CHUNK_BYTES`` (a
tensor larger than that gets a request of its own), the next request in flight while the tensors
of the current one are handed out. Host memory: about two requests' bytes plus one tensor.
The report's path is ``ranged-reads``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import torch

from distload.config import check_bool
from distload.loading.backends.base import Backend, BackendRun, ReadRequest
from distload.loading.index import TensorInfo
from distload.tensor_io import host_view

CHUNK_BYTES = 64 * 1024 * 1024


def coalesce(tensors: tuple[TensorInfo, ...] | list[TensorInfo],
             chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int, list[TensorInfo]]]:
    """Group tensors (sorted by offset) into byte ranges ``[start, end)`` of at most ``chunk_bytes``."""
    groups: list[tuple[int, int, list[TensorInfo]]] = []
    for info in sorted(tensors, key=lambda t: t.begin):
        if groups and info.end - groups[-1][0] <= chunk_bytes and info.begin >= groups[-1][1]:
            start, _, members = groups[-1]
            groups[-1] = (start, info.end, members + [info])
        else:
            groups.append((info.begin, info.end, [info]))
    return groups


class RangedBackend(Backend):
    name = "ranged"
    keys = {"huge_pages": check_bool}
    creates_host_tensors = True

    def read(self, request: ReadRequest) -> BackendRun:
        return BackendRun("ranged-reads").start(_stream(request))


def _tensor_from(data: bytes, offset: int, info: TensorInfo, request: ReadRequest) -> torch.Tensor:
    device = request.device
    out = request.host_memory.empty((info.nbytes,), torch.uint8)
    if info.nbytes:
        # Through ctypes, not numpy: a numpy view would make the storage non-resizable for good
        # (see tensor_io), and WeightSleeper could not release it.
        host_view(out)[:] = memoryview(data)[offset:offset + info.nbytes]
    tensor = out.view(info.torch_dtype).reshape(info.shape)
    return tensor if device.type == "cpu" else tensor.to(device)


def _stream(request: ReadRequest) -> Iterator[tuple[str, torch.Tensor]]:
    from distload.loading.stores import store_for

    jobs = []
    for info in request.index.files:
        store, location = store_for(info.path)
        for start, end, members in coalesce(info.tensors):
            jobs.append((store, location, start, end, members))
    if not jobs:
        return
    with ThreadPoolExecutor(1, thread_name_prefix="distload-ranged") as pool:
        def fetch(job):
            store, location, start, end, _ = job
            return store.read(location, start, end)

        pending = pool.submit(fetch, jobs[0])
        for i, job in enumerate(jobs):
            data = pending.result()
            if i + 1 < len(jobs):
                pending = pool.submit(fetch, jobs[i + 1])
            start, members = job[2], job[4]
            for info in members:
                yield info.name, _tensor_from(data, info.begin - start, info, request)
            del data
