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
``requested_bytes`` counts every byte asked for, gaps included. With a node cache
(``distload.loading.stores.cache``) every range goes through it, and the report says how many
bytes came from the cache and how many from the store (whole blocks).
"""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import torch

from distload.config import check_bool
from distload.loading.backends.base import Backend, BackendRun, ReadRequest
from distload.loading.shared_reads.stream import Extent, SharedReadOptions, shared_stream
from distload.loading.index import FileInfo, TensorInfo
from distload.loading.stores.cache import (BLOCK_BYTES, CacheSettings, NodeCache, Scratch, check_cache_dir,
                                           check_cache_max_gib)
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


@dataclass(frozen=True)
class RangedOptions(SharedReadOptions):
    """``cache``: the node cache this load reads through (None: every byte from the store)."""

    cache: CacheSettings | None = None


class RangedBackend(Backend):
    name = "ranged"
    keys = {"huge_pages": check_bool, "cache_dir": check_cache_dir, "cache_max_gib": check_cache_max_gib}
    creates_host_tensors = True
    reads_slices = True
    shares_reads = True

    def preflight(self, plan: "RankPlan", group) -> None:
        super().preflight(plan, group)
        # The cache's folder must work before any byte moves (the planning step's agreement tells
        # every rank), not fail in the middle, nor be skipped in silence.
        if plan.cache is not None:
            NodeCache(plan.cache).check_writable()

    def options(self, extra: Mapping[str, Any], plan: "RankPlan") -> RangedOptions:
        return RangedOptions(members=plan.members, needs=plan.needs, cache=plan.cache)

    def read(self, request: ReadRequest) -> BackendRun:
        settings = request.options_as(RangedOptions).cache
        bytes_of = ObjectBytes(request.index.files, None if settings is None else NodeCache(settings))
        if request.shared:
            run = BackendRun("ranged-shared", requested_bytes=0)
            return run.start(_counted(shared_stream(request, run, StoreBytes(bytes_of), SHARED_CONCURRENCY),
                                      run, bytes_of))
        run = BackendRun("ranged-reads", requested_bytes=0)
        return run.start(_counted(_stream(request, run, bytes_of), run, bytes_of))


class ObjectBytes:
    """Byte ranges of the load's objects: from the store, or through the node cache (the bytes
    of the version planned with, kept for the next load)."""

    def __init__(self, files: Sequence[FileInfo], cache: NodeCache | None):
        self.files = {f.path: f for f in files}
        self.cache = cache
        self._scratch = threading.local()
        # Per file, the received bytes after the last block boundary (a copy): the next bucket
        # received may complete that block (buckets arrive in file order).
        self._carry: dict[str, tuple[int, bytearray]] = {}
        if cache is not None:  # the header: what a rank receiving the first tensors lacks of block 0
            self._carry.update({f.path: (0, bytearray(f.head)) for f in files if f.head})

    def read(self, path: str, start: int, end: int, scratch: Scratch | None = None):
        """The bytes (through the cache: in ``scratch``, else this thread's own scratch memory,
        valid until the next read that uses it)."""
        from distload.loading.stores import store_for

        store, location = store_for(path)
        if self.cache is None:
            return store.read(location, start, end)
        info = self.files[path]
        scratch = scratch or self.scratch()
        return self.cache.read(path, info.version, info.size, start, end,
                               lambda a, b: store.read_version(location, a, b, info.version), scratch)

    def read_scatter(self, path: str, start: int, end: int, targets: list[tuple[int, memoryview]]) -> None:
        """Through the cache, straight into ``targets`` ((file offset, a tensor's memory), in
        file order, inside ``[start, end)``): each block read once, no copy."""
        from distload.loading.stores import store_for

        assert self.cache is not None
        store, location = store_for(path)
        info = self.files[path]
        self.cache.read_scatter(path, info.version, info.size, start, end, targets,
                                lambda a, b: store.read_version(location, a, b, info.version), self.scratch())

    def offer(self, pieces: Sequence[tuple[TensorInfo, int, memoryview]]) -> None:
        """Bytes received from a peer (tensor, file offset, bytes) into the cache, each file's
        under the version planned with (the peer read that version). A block two received
        buckets share is kept once the second arrives: the first's part of it is carried."""
        by_file: dict[str, list[tuple[int, memoryview]]] = {}
        for info, offset, view in pieces:
            by_file.setdefault(info.file, []).append((offset, view))
        assert self.cache is not None
        for path, segments in by_file.items():
            info = self.files[path]
            segments.sort(key=lambda segment: segment[0])  # offer takes them in file order
            carried = self._carry.pop(path, None)
            if carried is not None and carried[0] + len(carried[1]) == segments[0][0]:
                segments.insert(0, (carried[0], memoryview(carried[1])))
            self.cache.offer(path, info.version, info.size, segments)
            tail = _tail(segments)
            if tail is not None:
                self._carry[path] = tail

    def scratch(self) -> Scratch:
        """This thread's own scratch memory."""
        scratch = getattr(self._scratch, "memory", None)
        if scratch is None:
            scratch = self._scratch.memory = Scratch()
        return scratch

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()


def _tail(segments: list[tuple[int, memoryview]]) -> tuple[int, bytearray] | None:
    """The bytes of the last unbroken run of ``segments`` (in file order) after its last block
    boundary, copied (the tensors they are in may be gone when the next bucket arrives)."""
    end = segments[-1][0] + len(segments[-1][1])
    start = segments[-1][0]
    for offset, view in reversed(segments[:-1]):
        if offset + len(view) != start:
            break
        start = offset
    cut = max(start, end // BLOCK_BYTES * BLOCK_BYTES)
    if cut >= end:
        return None
    tail = bytearray()
    for offset, view in segments:
        a, b = max(cut, offset), min(end, offset + len(view))
        if a < b:
            tail += view[a - offset:b - offset]
    return cut, tail


def _counted(tensors: Iterator[tuple[str, torch.Tensor]], run: BackendRun,
             bytes_of: ObjectBytes) -> Iterator[tuple[str, torch.Tensor]]:
    """The read's tensors; then the cache's counts into the run (its entries closed either way)."""
    try:
        yield from tensors
    finally:
        bytes_of.close()
        cache = bytes_of.cache
        if cache is not None:
            run.cache_bytes, run.store_bytes, run.corrupt_blocks = (cache.cache_bytes, cache.store_bytes,
                                                                    cache.corrupt_blocks)
            run.cache_received_bytes = cache.received_bytes


class StoreBytes:
    """Byte ranges of object-store files for a shared read: the extents of one read, coalesced
    into ranged GETs as the plain ranged read does (a row-sliced tensor is not one GET per row).
    A task is a whole bucket: one GET each, as large as the plain read's."""

    task_bytes = CHUNK_BYTES

    def __init__(self, bytes_of: ObjectBytes):
        self.bytes_of = bytes_of
        self.keeps_received = bytes_of.cache is not None  # into this node's cache
        self.where = _where(bytes_of)


    def read(self, info: TensorInfo, extents: Sequence[Extent], view: memoryview) -> None:
        pieces = [FileExtent(info, info.begin + src, dst, length) for src, dst, length in extents]
        if self.bytes_of.cache is not None:  # from the cache straight into the bucket
            for start, end, members in coalesce(pieces):
                self.bytes_of.read_scatter(info.file, start, end,
                                           [(p.start, view[p.offset:p.offset + p.length]) for p in members])
            return
        for start, end, members in coalesce(pieces):
            data = memoryview(self.bytes_of.read(info.file, start, end))
            for piece in members:
                at = piece.start - start
                view[piece.offset:piece.offset + piece.length] = data[at:at + piece.length]

    def received(self, pieces: Sequence[tuple[TensorInfo, int, memoryview]]) -> None:
        """Bytes a peer read: into this node's cache (only where this load has one: keeps_received)."""
        self.bytes_of.offer([(info, info.begin + offset, view) for info, offset, view in pieces])

    def close(self) -> None:
        pass  # the cache closes once the tensors are all out (_counted)


def _where(bytes_of: ObjectBytes) -> str | None:
    """The store's endpoint the reads go to (and the setting that named it), for messages."""
    from distload.loading.stores import store_for

    try:
        store, _ = store_for(next(iter(bytes_of.files)))
        return f"the {store.product} endpoint {store.endpoint().describe()}"
    except Exception:  # a message's detail only: never a reason to fail a load
        return None


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


def _stream(request: ReadRequest, run: BackendRun, bytes_of: ObjectBytes) -> Iterator[tuple[str, torch.Tensor]]:
    jobs = []
    pieces_by_name: dict[str, int] = {}
    empty: list[TensorInfo] = []
    for file_info in request.index.files:
        pieces = []
        for info in file_info.tensors:
            own = [p for p in pieces_of(info, request) if p.length]
            pieces_by_name[info.name] = len(own)
            if not own:
                empty.append(info)  # empty, or a slice that is all padding: complete at once
            pieces += own
        for start, end, members in coalesce(pieces):
            jobs.append((file_info.path, start, end, members))
    for info in empty:
        yield info.name, _on_device(_Assembly(info, request, 0).tensor, request)
    if not jobs:
        return
    if bytes_of.cache is not None:
        yield from _stream_cached(request, run, bytes_of, jobs)
        return
    assemblies: dict[str, _Assembly] = {}
    with ThreadPoolExecutor(1, thread_name_prefix="distload-ranged") as pool:
        # Two scratch buffers in turn: job i's bytes are all copied out before job i + 2 starts
        # (it is submitted once job i + 1's are in, after job i's loop step).
        scratches = (Scratch(), Scratch())

        def fetch(i):
            path, start, end, _ = jobs[i]
            return bytes_of.read(path, start, end, scratches[i % 2])

        pending = pool.submit(fetch, 0)
        for i, job in enumerate(jobs):
            data = pending.result()
            run.requested_bytes += job[2] - job[1]
            if i + 1 < len(jobs):
                pending = pool.submit(fetch, i + 1)
            start, members = job[1], job[3]
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


# Requests read through the node cache at once, each on its own thread, each at most
# CACHED_REQUEST_BYTES (a larger piece is cut), so that a warm load is not one thread's memory
# bandwidth, and each thread backs (prefaults) the part of a new tensor it reads into.
CACHED_IN_FLIGHT = 4
CACHED_REQUEST_BYTES = 16 * 1024 * 1024


def _stream_cached(request: ReadRequest, run: BackendRun, bytes_of: ObjectBytes,
                   jobs: list) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain ranged read through the node cache: the pieces of each file, cut to at most
    CACHED_REQUEST_BYTES and coalesced into requests of that size, each read from the cache
    straight into its tensors' memory (``read_scatter``: every block once, no copy), on worker
    threads; tensors are handed out in file order."""
    requests = []
    parts: dict[str, int] = {}
    for path, _, _, members in jobs:
        cut = [FileExtent(p.info, p.start + at, p.offset + at, min(CACHED_REQUEST_BYTES, p.length - at))
               for p in members for at in range(0, p.length, CACHED_REQUEST_BYTES)]
        for piece in cut:
            parts[piece.info.name] = parts.get(piece.info.name, 0) + 1
        requests += [(path, a, b, group) for a, b, group in coalesce(cut, CACHED_REQUEST_BYTES)]
    assemblies: dict[str, _Assembly] = {}
    lock = threading.Lock()

    def assembly(piece: FileExtent) -> _Assembly:
        with lock:  # a tensor above CACHED_REQUEST_BYTES has pieces in several requests
            found = assemblies.get(piece.info.name)
            if found is None:
                found = assemblies[piece.info.name] = _Assembly(piece.info, request, parts[piece.info.name])
        return found

    def work(job) -> None:
        path, start, end, members = job
        targets = []
        for piece in members:
            tensor = assembly(piece)
            # This request's part of the tensor backed in one call (as pread does in its units),
            # not a page fault at a time inside the reads; each thread backs what it reads.
            request.host_memory.prefault(tensor.tensor.data_ptr() + piece.offset, piece.length)
            targets.append((piece.start, tensor.view[piece.offset:piece.offset + piece.length]))
        bytes_of.read_scatter(path, start, end, targets)

    with ThreadPoolExecutor(CACHED_IN_FLIGHT, thread_name_prefix="distload-ranged") as pool:
        pending = [pool.submit(work, job) for job in requests[:CACHED_IN_FLIGHT]]
        for i, job in enumerate(requests):
            pending.pop(0).result()
            run.requested_bytes += job[2] - job[1]
            if i + CACHED_IN_FLIGHT < len(requests):
                pending.append(pool.submit(work, requests[i + CACHED_IN_FLIGHT]))
            for piece in job[3]:
                name = piece.info.name
                with lock:
                    done = assemblies[name]
                    done.missing -= 1
                    if done.missing:
                        continue
                    del assemblies[name]
                yield name, _on_device(done.tensor, request)


def _on_device(tensor: torch.Tensor, request: ReadRequest) -> torch.Tensor:
    return tensor if request.device.type == "cpu" else tensor.to(request.device)
