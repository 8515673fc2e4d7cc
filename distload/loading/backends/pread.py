"""distload's own reader for local files: parallel ``pread`` straight into each tensor's memory.

Each tensor is allocated once, on the host, and its bytes are read into it by a pool of threads
(``os.preadv`` releases the GIL), in chunks, so that several reads are in flight for the disk's
queue and the page-cache copies run on every core. There is no intermediate buffer and no memory
map: the only copy is the kernel's, into the tensor. Tensors are yielded in file order, each as
soon as its chunks are in, while the pool reads ahead within a bounded window of bytes, so host
memory beyond the tensors the caller keeps stays bounded. A CUDA destination gets each tensor
copied from the host. Given existing tensors to fill (an in-place reload), it reads straight into
them: no allocation, no page faults on fresh memory, no second copy.

A new tensor is read in units of 32 MiB, each *prefaulted* by its reader thread in one call
before its reads into it start (``host_memory.py`` says why that is cheaper than faulting page by
page inside the copies). That was measured against the alternatives from the page cache and from
storage alike (the numbers are at PREFAULT_UNIT_BYTES), and it won both: the warm loss to a memcpy
out of a memory map was the destination's page faults, not the reads. Each file's page-cache
residency is probed when its first tensor is submitted (``distload/loading/residency.py``; a
file another rank of the node has just read counts as cached), and ``run.reader_bytes`` counts
where each tensor's bytes were: ``pread/page-cache`` (at least half resident), ``pread/storage``,
or ``pread/unprobed`` where this system cannot say.

A tensor-parallel slice (``request.slices``) is read as its byte extents only: one read per
extent (a slice along dim 0 is one extent per fused part; along a later dim, one per row), small
extents batched into one task so that a row-sliced tensor costs one task per chunk of bytes, not
one per row. Padding rows are zeroed in place.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import torch

from distload.config import check_bool, check_positive_int
from distload.errors import CheckpointError
from distload.fileio import open_for_reading, read_exactly
from distload.loading.backends.base import Backend, BackendRun, ReadRequest
from distload.loading.checksums import TensorChecksums, corrupt_error
from distload.loading.stores.crc import crc32c
from distload.loading.shared_reads.stream import Extent, SharedReadOptions, batch_extents, shared_stream
from distload.loading.index import TensorInfo
from distload.loading.mapped import FileMap, copy_extents, safe_copy_available
from distload.loading.residency import Residency, probe
from distload.tensor_io import host_view

CHUNK_BYTES = 8 * 1024 * 1024
DEFAULT_CONCURRENCY = 8
READ_AHEAD_BYTES = 256 * 1024 * 1024
CACHED_FRACTION = 0.5  # a tensor at least this resident counts as read from the page cache
# A reader thread's unit of work in a new tensor: prefault this much, then read it in chunks.
# Measured on the 2-core VM, 1 GiB, fresh process per run, 3 runs each. From the page cache:
# units of 32 MiB on the reader threads 0.27-0.41 s, prefaulting whole tensors ahead on one
# thread 0.39-0.43 s, torch's copy out of a memory map 0.34-0.39 s, no prefaulting 0.41-0.54 s.
# From storage: 0.82-1.05 s against 1.06-1.14 s without prefaulting (2 ranks reading the same
# files: 0.92-1.10 s against 1.19-1.35 s); units of 8 MiB 1.25-1.32 s there, 128 MiB no better.
PREFAULT_UNIT_BYTES = 32 * 1024 * 1024
# Ranges this small on average (a slice along a later dimension: one range per row) are copied out
# of the file's map, up to 1024 ranges per process_vm_readv call, not read one pread each: one
# call per row cost a TP 2 x DP 2 load on 4 ranks most of its CPU time in Python.
SMALL_RANGE_BYTES = 64 * 1024
# A tensor with checksums is read this much at a time, each piece's CRC-32C taken right after its
# read, while it is still in the core's cache (2 MiB of L2 here). Measured on the 2-core VM with
# crc32c-rs (stores/crc.py), 1 GiB warm, one process loading in turn: pieces of 1 MiB +5-7% over
# the unchecked load (41 pairs, benchmarks/results/checksums_in_process.md; about the CRC's own
# read of the bytes), 256 and 128 KiB no better (more pieces: more of the reader threads' Python,
# under one GIL). With google-crc32c before: 256 KiB +28%, 1 MiB +22%, 4 MiB +55%.
CHECKED_PIECE_BYTES = 1024 * 1024

if TYPE_CHECKING:
    from distload.loading.plan import RankPlan


@dataclass(frozen=True)
class PreadOptions(SharedReadOptions):
    """pread's settings: its reader threads (extra config ``concurrency``), and for a shared read
    the ranks that share it."""

    concurrency: int = DEFAULT_CONCURRENCY


class PreadBackend(Backend):
    name = "pread"
    keys = {"huge_pages": check_bool, "concurrency": check_positive_int}  # concurrency: reader threads
    creates_host_tensors = True
    reads_object_stores = False
    reads_slices = True
    shares_reads = True

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, read_ahead_bytes: int = READ_AHEAD_BYTES):
        self.chunk_bytes = chunk_bytes  # one read's size: several reads per tensor are in flight
        self.read_ahead_bytes = read_ahead_bytes  # bytes read ahead of what the caller took

    def options(self, extra: Mapping[str, Any], plan: "RankPlan") -> PreadOptions:
        return PreadOptions(members=plan.members, needs=plan.needs,
                            concurrency=int(extra.get("concurrency", DEFAULT_CONCURRENCY)))

    def read(self, request: ReadRequest) -> BackendRun:
        concurrency = request.options_as(PreadOptions).concurrency
        if request.shared:
            run = BackendRun("pread-shared", requested_bytes=0)
            return run.start(shared_stream(request, run, LocalBytes(), concurrency))
        run = BackendRun("pread", requested_bytes=0)
        run.reader_bytes = {}
        return run.start(self._stream(request, run))

    def _stream(self, request: ReadRequest, run: BackendRun) -> Iterator[tuple[str, torch.Tensor]]:
        concurrency = request.options_as(PreadOptions).concurrency
        tensors = [t for f in request.index.files for t in f.tensors]
        fds: dict[str, _OpenFile] = {}
        residency: dict[str, Residency | None] = {}
        pending: deque[tuple[TensorInfo, torch.Tensor, list[Future], int]] = deque()
        window = 0  # bytes submitted but not yet handed out
        submitted = 0
        # No more threads than units of work: each costs its start (a load of 64 MiB spent more
        # starting 8 threads than reading), and a small load has fewer units than threads.
        units = -(-sum(t.nbytes for t in tensors) // PREFAULT_UNIT_BYTES)
        try:
            with ThreadPoolExecutor(max_workers=max(1, min(concurrency, units)),
                                    thread_name_prefix="distload-pread") as pool:
                while submitted < len(tensors) or pending:
                    # Read ahead until the window is full (always at least one tensor).
                    while submitted < len(tensors) and (not pending or window < self.read_ahead_bytes):
                        info = tensors[submitted]
                        submitted += 1
                        if info.file not in fds:
                            fds[info.file] = _OpenFile.open(info.file)
                            residency[info.file] = probe(fds[info.file].fd)
                        where = _where(residency[info.file], info)
                        pending.append(self._submit(pool, fds[info.file], info, request))
                        window += pending[-1][3]
                        run.requested_bytes += pending[-1][3]
                        key = f"pread/{where}"
                        run.reader_bytes[key] = run.reader_bytes.get(key, 0) + pending[-1][3]
                    info, tensor, futures, nbytes = pending.popleft()
                    for future in futures:
                        future.result()
                    if _checks_as_it_reads(request.checksums.get(info.name), request.slices.get(info.name)):
                        run.checked.add(info.name)  # its units checked each chunk as they read it
                    window -= nbytes
                    yield info.name, tensor if request.device.type == "cpu" else tensor.to(request.device)
        finally:
            for opened in fds.values():
                opened.close()

    def _submit(self, pool: ThreadPoolExecutor, opened: "_OpenFile", info: TensorInfo,
                request: ReadRequest) -> tuple[TensorInfo, torch.Tensor, list[Future], int]:
        """Start reading one tensor (or this rank's slice of it), in chunks, into its destination."""
        piece = request.slices.get(info.name)
        if piece is None:
            tensor = request.tensor_for(info.name, info.torch_dtype, info.shape)
            extents: Sequence[Extent] = ((0, 0, info.nbytes),) if info.nbytes else ()
        else:
            tensor = request.tensor_for(info.name, info.torch_dtype, piece.shape)
            for offset, length in piece.zeros:  # vocabulary padding: zero rows, never read
                ctypes.memset(tensor.data_ptr() + offset, 0, length)
            extents = piece.extents
        view = host_view(tensor)
        # New memory is prefaulted; so is a caller's tensor whose pages are not backed yet (one
        # made by torch.empty: a DTensor model before its first load), where first touches are
        # slow on this VM (memory its balloon gave back to the host). Measured, TP 2 x DP 2 into
        # DTensors, 4 ranks, 2 GiB, cold, three runs in a row: 3.2-5.4 s without, 2.6-3.0 s with.
        # A backed tensor is not: the call would walk its page tables for nothing (a warm reload
        # of 2 GiB of backed memory took 0.21 s with it against 0.17 without).
        new = request.destinations.get(info.name) is not tensor
        want = request.checksums.get(info.name)
        if _checks_as_it_reads(want, piece):
            # Whole, with checksums: each unit (whole chunks: units start at multiples of the
            # chunk) is read and checked a piece at a time, while the piece is in the core's cache.
            futures = [pool.submit(_read_checked, request.host_memory, tensor.data_ptr(),
                                   new or not _backed(request.host_memory, tensor, unit), opened, view, info,
                                   unit, want) for unit in batch_extents(extents, PREFAULT_UNIT_BYTES)]
            return info, tensor, futures, info.nbytes
        futures = [pool.submit(_prefault_and_read if new or not _backed(request.host_memory, tensor, unit)
                               else _read_unit, request.host_memory, tensor.data_ptr(), opened, view,
                               info.begin, unit, self.chunk_bytes, info.name)
                   for unit in batch_extents(extents, PREFAULT_UNIT_BYTES)]
        return info, tensor, futures, sum(length for _, _, length in extents)


class LocalBytes:
    """Byte ranges of local files for a shared read (one descriptor per file, shared by threads)."""

    task_bytes = CHUNK_BYTES  # several reads in flight for the disk's queue, as in a plain read
    keeps_received = False  # local files have the page cache
    where = None  # a local disk: a round that times out has lost a rank, not a link

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def read(self, info: TensorInfo, extents: Sequence[Extent], view: memoryview) -> None:
        with self._lock:
            fd = self._fds.get(info.file)
            if fd is None:
                fd = self._fds[info.file] = open_for_reading(info.file)
        _read_extents(_OpenFile(fd, info.file), 0, view, info.begin, list(extents), info.name)

    def received(self, pieces) -> None:
        pass  # never called: keeps_received is False

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


@dataclass
class _OpenFile:
    """A file being read: its descriptor, and (where process_vm_readv works) a read-only map of
    it for slices made of many small ranges."""

    fd: int
    path: str
    map: FileMap | None = None

    @classmethod
    def open(cls, path: str) -> "_OpenFile":
        fd = open_for_reading(path)
        return cls(fd, path, FileMap(fd) if safe_copy_available() else None)

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
        os.close(self.fd)


def _read_extents(opened: _OpenFile, address: int, view: memoryview, begin: int, extents: list[Extent],
                  name: str) -> None:
    """Read ``extents`` of tensor ``name`` (data at ``begin`` in its file) into ``view`` (whose
    memory starts at ``address``; 0: unknown)."""
    total = sum(length for _, _, length in extents)
    if opened.map is not None and address and len(extents) > 1 and total < SMALL_RANGE_BYTES * len(extents):
        copied = copy_extents(address, opened.map.address + begin, extents)
        if copied < total:
            raise CheckpointError(f"{opened.path}: ended while reading tensor {name!r}: the file is shorter "
                                  f"than its header says (truncated while loading?)")
        return
    for src, dst, length in extents:
        read_exactly(opened.fd, view[dst:dst + length], begin + src, opened.path, name)


def _backed(host_memory, tensor: torch.Tensor, unit: list[Extent]) -> bool:
    start = unit[0][1]
    return host_memory.backed(tensor.data_ptr() + start, unit[-1][1] + unit[-1][2] - start)


def _read_unit(host_memory, address: int, opened: _OpenFile, view: memoryview, begin: int,
               unit: list[Extent], chunk_bytes: int, name: str) -> None:
    """Read one unit of a tensor whose memory is already backed, in chunks."""
    for batch in batch_extents(unit, chunk_bytes):
        _read_extents(opened, address, view, begin, batch, name)


def _prefault_and_read(host_memory, address: int, opened: _OpenFile, view: memoryview, begin: int,
                       unit: list[Extent], chunk_bytes: int, name: str) -> None:
    """Back one unit of a tensor with memory in one call, then read it in chunks."""
    start = unit[0][1]
    end = unit[-1][1] + unit[-1][2]
    host_memory.prefault(address + start, end - start)
    for batch in batch_extents(unit, chunk_bytes):
        _read_extents(opened, address, view, begin, batch, name)


def _checks_as_it_reads(want: TensorChecksums | None, piece) -> bool:
    """Whether a tensor's CRC-32Cs are checked by the reader threads: a whole tensor with
    checksums whose chunks each lie in one unit (units start at multiples of PREFAULT_UNIT_BYTES).
    The loader checks the others (a slice: the chunks it touches, the rest read from the file)."""
    return piece is None and want is not None and PREFAULT_UNIT_BYTES % want.chunk_bytes == 0


def _read_checked(host_memory, address: int, prefault: bool, opened: _OpenFile, view: memoryview,
                  info: TensorInfo, unit: list[Extent], want: TensorChecksums) -> None:
    """Read one unit of a whole tensor (whole checksum chunks of it) a piece at a time, each piece's
    CRC-32C taken right after its read, on bytes still in the core's cache (a third of what a
    separate pass after the read costs; see CHECKED_PIECE_BYTES). A chunk that differs from the
    manifest fails the read naming the file and the tensor."""
    start = unit[0][1]
    end = unit[-1][1] + unit[-1][2]
    if prefault:
        host_memory.prefault(address + start, end - start)
    size = want.chunk_bytes
    for first in range(start, end, size):
        stop = min(first + size, end)
        crc = 0
        for at in range(first, stop, CHECKED_PIECE_BYTES):
            piece = view[at:min(at + CHECKED_PIECE_BYTES, stop)]
            read_exactly(opened.fd, piece, info.begin + at, opened.path, info.name)
            crc = crc32c(piece, crc)
        if crc != want.crcs[first // size]:
            raise corrupt_error(info, want, first // size, os.path.dirname(info.file))


def _where(residency: Residency | None, info: TensorInfo) -> str:
    """Where a tensor's bytes are, as the report names it."""
    if residency is None:
        return "unprobed"
    return "page-cache" if residency.fraction(info.begin, info.end) >= CACHED_FRACTION else "storage"
