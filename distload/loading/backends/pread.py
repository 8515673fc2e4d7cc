"""distload's own reader for local files: parallel ``pread`` straight into each tensor's memory.

Each tensor is allocated once, on the host, and its bytes are read into it by a pool of threads
(``os.preadv`` releases the GIL), in chunks, so that several reads are in flight for the disk's
queue and the page-cache copies run on every core. There is no intermediate buffer and no memory
map: the only copy is the kernel's, into the tensor. Tensors are yielded in file order, each as
soon as its chunks are in, while the pool reads ahead within a bounded window of bytes, so host
memory beyond the tensors the caller keeps stays bounded. A CUDA destination gets each tensor
copied from the host. Given existing tensors to fill (an in-place reload), it reads straight into
them: no allocation, no page faults on fresh memory, no second copy.

A tensor-parallel slice (``request.slices``) is read as its byte extents only: one read per
extent (a slice along dim 0 is one extent per fused part; along a later dim, one per row), small
extents batched into one task so that a row-sliced tensor costs one task per chunk of bytes, not
one per row. Padding rows are zeroed in place.
"""

from __future__ import annotations

import ctypes
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, Sequence

import torch

from distload.config import check_bool, check_positive_int
from distload.fileio import open_for_reading, read_exactly
from distload.loading.backends.base import Backend, BackendRun, ReadRequest
from distload.loading.index import TensorInfo
from distload.tensor_io import host_view

CHUNK_BYTES = 8 * 1024 * 1024
DEFAULT_CONCURRENCY = 8
READ_AHEAD_BYTES = 256 * 1024 * 1024

Extent = tuple[int, int, int]  # (source offset in the tensor's data, destination offset, length)


class PreadBackend(Backend):
    name = "pread"
    keys = {"huge_pages": check_bool, "concurrency": check_positive_int}  # concurrency: reader threads
    creates_host_tensors = True
    reads_object_stores = False
    reads_slices = True

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, read_ahead_bytes: int = READ_AHEAD_BYTES):
        self.chunk_bytes = chunk_bytes  # one read's size: several reads per tensor are in flight
        self.read_ahead_bytes = read_ahead_bytes  # bytes read ahead of what the caller took

    def read(self, request: ReadRequest) -> BackendRun:
        run = BackendRun("pread", requested_bytes=0)
        return run.start(self._stream(request, run))

    def _stream(self, request: ReadRequest, run: BackendRun) -> Iterator[tuple[str, torch.Tensor]]:
        concurrency = int(request.extra.get("concurrency", DEFAULT_CONCURRENCY))
        tensors = [t for f in request.index.files for t in f.tensors]
        fds: dict[str, int] = {}
        pending: deque[tuple[TensorInfo, torch.Tensor, list[Future], int]] = deque()
        window = 0  # bytes submitted but not yet handed out
        submitted = 0
        try:
            with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="distload-pread") as pool:
                while submitted < len(tensors) or pending:
                    # Read ahead until the window is full (always at least one tensor).
                    while submitted < len(tensors) and (not pending or window < self.read_ahead_bytes):
                        info = tensors[submitted]
                        submitted += 1
                        if info.file not in fds:
                            fds[info.file] = open_for_reading(info.file)
                        pending.append(self._submit(pool, fds[info.file], info, request))
                        window += pending[-1][3]
                        run.requested_bytes += pending[-1][3]
                    info, tensor, futures, nbytes = pending.popleft()
                    for future in futures:
                        future.result()
                    window -= nbytes
                    yield info.name, tensor if request.device.type == "cpu" else tensor.to(request.device)
        finally:
            for fd in fds.values():
                os.close(fd)

    def _submit(self, pool: ThreadPoolExecutor, fd: int, info: TensorInfo,
                request: ReadRequest) -> tuple[TensorInfo, torch.Tensor, list[Future], int]:
        """Start reading one tensor (or this rank's slice of it), in chunks, into its destination."""
        piece = request.slices.get(info.name)
        if piece is None:
            tensor = _destination(request, info, info.shape)
            extents: Sequence[Extent] = ((0, 0, info.nbytes),) if info.nbytes else ()
        else:
            tensor = _destination(request, info, piece.shape)
            for offset, length in piece.zeros:  # vocabulary padding: zero rows, never read
                ctypes.memset(tensor.data_ptr() + offset, 0, length)
            extents = piece.extents
        view = host_view(tensor)
        futures = [pool.submit(_read_extents, fd, view, info.begin, batch, info.file, info.name)
                   for batch in batch_extents(extents, self.chunk_bytes)]
        return info, tensor, futures, sum(length for _, _, length in extents)


def batch_extents(extents: Sequence[Extent], chunk_bytes: int) -> list[list[Extent]]:
    """Reads of about ``chunk_bytes`` each: a large extent cut into chunks, small ones grouped."""
    batches: list[list[Extent]] = []
    current: list[Extent] = []
    size = 0
    for src, dst, length in extents:
        for start in range(0, length, chunk_bytes):
            n = min(chunk_bytes, length - start)
            if current and size + n > chunk_bytes:
                batches.append(current)
                current, size = [], 0
            current.append((src + start, dst + start, n))
            size += n
    if current:
        batches.append(current)
    return batches


def _read_extents(fd: int, view: memoryview, begin: int, extents: list[Extent], path: str, name: str) -> None:
    for src, dst, length in extents:
        read_exactly(fd, view[dst:dst + length], begin + src, path, name)


def _destination(request: ReadRequest, info: TensorInfo, shape: tuple[int, ...]) -> torch.Tensor:
    """The caller's tensor to read into in place when it fits exactly, else a new one."""
    dest = request.destinations.get(info.name)
    if (dest is not None and request.device.type == "cpu" and dest.device.type == "cpu"
            and dest.is_contiguous() and dest.dtype == info.torch_dtype and tuple(dest.shape) == tuple(shape)):
        return dest
    return request.host_memory.empty(shape, info.torch_dtype)
