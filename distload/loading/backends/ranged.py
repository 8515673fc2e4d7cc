"""Ranged reads from an object store: what ``safetensors`` and ``sharded_state`` do on ``s3://``,
``gs://`` and ``az://`` (safetensors' own reader needs a local file), and how ``auto`` reads there:
each rank alone (one rank, or ``distributed: false``), or shared between the ranks that read the
same files (``StoreBytes`` under ``shared_reads.py``: each byte fetched once per job).

Each file is read in order with ranged GETs through the store's SDK client (the one that listed it
and read its headers). The byte ranges a rank needs (whole tensors, or the extents of its slices)
are coalesced into requests of up to ``CHUNK_BYTES``; a gap of at most ``GAP_BYTES`` between two
ranges is fetched with them (one GET per row of a row-sliced tensor would cost more than its
bytes), a longer gap starts a new request. A range larger than a request gets one of its own. The
next request is in flight while the current one's tensors are handed out. Host memory: about
two requests' bytes plus the tensors being assembled. The report's path is ``ranged-reads``;
``requested_bytes`` counts every byte asked for, gaps included.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import torch

from distload.config import check_bool
from distload.loading.backends.base import Backend, BackendRun, ReadRequest
from distload.loading.shared_reads.stream import Extent, SharedReadOptions, shared_stream
from distload.loading.index import TensorInfo
from distload.tensor_io import host_view

CHUNK_BYTES = 64 * 1024 * 1024
GAP_BYTES = 1024 * 1024
SHARED_CONCURRENCY = 2  # GETs in flight per rank in a shared read (its next buckets)

if TYPE_CHECKING:
    from distload.loading.plan import RankPlan


@dataclass(frozen=True)
class FileExtent:
    """Bytes ``[start, start + length)`` of a file that go to ``offset`` in tensor ``info``'s piece."""

    info: TensorInfo
    start: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


def coalesce(pieces: list[FileExtent], chunk_bytes: int = CHUNK_BYTES,
             gap_bytes: int = GAP_BYTES) -> list[tuple[int, int, list[FileExtent]]]:
    """Group pieces (of one file) into requests ``[start, end)`` of at most ``chunk_bytes``."""
    groups: list[tuple[int, int, list[FileExtent]]] = []
    for piece in sorted(pieces, key=lambda p: p.start):
        if (groups and piece.end - groups[-1][0] <= chunk_bytes
                and groups[-1][1] <= piece.start <= groups[-1][1] + gap_bytes):
            start, _, members = groups[-1]
            groups[-1] = (start, piece.end, members + [piece])
        else:
            groups.append((piece.start, piece.end, [piece]))
    return groups


def pieces_of(info: TensorInfo, request: ReadRequest) -> list[FileExtent]:
    piece = request.slices.get(info.name)
    if piece is None:
        return [FileExtent(info, info.begin, 0, info.nbytes)]
    return [FileExtent(info, info.begin + src, dst, length) for src, dst, length in piece.extents]


class RangedBackend(Backend):
    name = "ranged"
    keys = {"huge_pages": check_bool}
    creates_host_tensors = True
    reads_slices = True
    shares_reads = True

    def options(self, extra: Mapping[str, Any], plan: "RankPlan") -> SharedReadOptions:
        return SharedReadOptions(members=plan.members, needs=plan.needs)

    def read(self, request: ReadRequest) -> BackendRun:
        if request.shared:
            run = BackendRun("ranged-shared", requested_bytes=0)
            return run.start(shared_stream(request, run, StoreBytes(), SHARED_CONCURRENCY))
        run = BackendRun("ranged-reads", requested_bytes=0)
        return run.start(_stream(request, run))


class StoreBytes:
    """Byte ranges of object-store files for a shared read: the extents of one read, coalesced
    into ranged GETs as the plain ranged read does (a row-sliced tensor is not one GET per row).
    A task is a whole bucket: one GET each, as large as the plain read's."""

    task_bytes = CHUNK_BYTES

    def read(self, info: TensorInfo, extents: Sequence[Extent], view: memoryview) -> None:
        from distload.loading.stores import store_for

        store, location = store_for(info.file)
        pieces = [FileExtent(info, info.begin + src, dst, length) for src, dst, length in extents]
        for start, end, members in coalesce(pieces):
            data = memoryview(store.read(location, start, end))
            for piece in members:
                at = piece.start - start
                view[piece.offset:piece.offset + piece.length] = data[at:at + piece.length]

    def close(self) -> None:
        pass


class _Assembly:
    """A tensor (or slice) being filled from one or more requests."""

    def __init__(self, info: TensorInfo, request: ReadRequest, pieces: int):
        piece = request.slices.get(info.name)
        shape = info.shape if piece is None else piece.shape
        self.tensor = request.tensor_for(info.name, info.torch_dtype, shape)  # in place where the caller can take it
        self.view = host_view(self.tensor)
        if piece is not None:
            for offset, length in piece.zeros:  # vocabulary padding: zero rows, never fetched
                ctypes.memset(self.tensor.data_ptr() + offset, 0, length)
        self.missing = pieces


def _stream(request: ReadRequest, run: BackendRun) -> Iterator[tuple[str, torch.Tensor]]:
    from distload.loading.stores import store_for

    jobs = []
    pieces_by_name: dict[str, int] = {}
    empty: list[TensorInfo] = []
    for file_info in request.index.files:
        store, location = store_for(file_info.path)
        pieces = []
        for info in file_info.tensors:
            own = [p for p in pieces_of(info, request) if p.length]
            pieces_by_name[info.name] = len(own)
            if not own:
                empty.append(info)  # empty, or a slice that is all padding: complete at once
            pieces += own
        for start, end, members in coalesce(pieces):
            jobs.append((store, location, start, end, members))
    for info in empty:
        yield info.name, _on_device(_Assembly(info, request, 0).tensor, request)
    if not jobs:
        return
    assemblies: dict[str, _Assembly] = {}
    with ThreadPoolExecutor(1, thread_name_prefix="distload-ranged") as pool:
        def fetch(job):
            store, location, start, end, _ = job
            return store.read(location, start, end)

        pending = pool.submit(fetch, jobs[0])
        for i, job in enumerate(jobs):
            data = pending.result()
            run.requested_bytes += job[3] - job[2]
            if i + 1 < len(jobs):
                pending = pool.submit(fetch, jobs[i + 1])
            start, members = job[2], job[4]
            for piece in members:
                name = piece.info.name
                assembly = assemblies.get(name)
                if assembly is None:
                    assembly = assemblies[name] = _Assembly(piece.info, request, pieces_by_name[name])
                at = piece.start - start
                assembly.view[piece.offset:piece.offset + piece.length] = memoryview(data)[at:at + piece.length]
                assembly.missing -= 1
                if assembly.missing == 0:
                    del assemblies[name]
                    yield name, _on_device(assembly.tensor, request)
            del data


def _on_device(tensor: torch.Tensor, request: ReadRequest) -> torch.Tensor:
    return tensor if request.device.type == "cpu" else tensor.to(request.device)
