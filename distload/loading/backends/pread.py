"""distload's own reader for local files: parallel ``pread`` straight into each tensor's memory.

Each tensor is allocated once, on the host, and its bytes are read into it by a pool of threads
(``os.preadv`` releases the GIL), in chunks, so that several reads are in flight for the disk's
queue and the page-cache copies run on every core. There is no intermediate buffer and no memory
map: the only copy is the kernel's, into the tensor. Tensors are yielded in file order, each as
soon as its chunks are in, while the pool reads ahead within a bounded window of bytes, so host
memory beyond the tensors the caller keeps stays bounded. A CUDA destination gets each tensor
copied from the host. Given existing tensors to fill (an in-place reload), it reads straight into
them: no allocation, no page faults on fresh memory, no second copy.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

import torch

from distload.config import check_bool, check_positive_int
from distload.fileio import open_for_reading, read_exactly
from distload.loading.backends.base import Backend, BackendRun, ReadRequest
from distload.loading.index import TensorInfo
from distload.tensor_io import host_view

CHUNK_BYTES = 8 * 1024 * 1024
DEFAULT_CONCURRENCY = 8
READ_AHEAD_BYTES = 256 * 1024 * 1024


class PreadBackend(Backend):
    name = "pread"
    keys = {"huge_pages": check_bool, "concurrency": check_positive_int}  # concurrency: reader threads
    creates_host_tensors = True
    reads_object_stores = False

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, read_ahead_bytes: int = READ_AHEAD_BYTES):
        self.chunk_bytes = chunk_bytes  # one read's size: several reads per tensor are in flight
        self.read_ahead_bytes = read_ahead_bytes  # bytes read ahead of what the caller took

    def read(self, request: ReadRequest) -> BackendRun:
        return BackendRun("pread").start(self._stream(request))

    def _stream(self, request: ReadRequest) -> Iterator[tuple[str, torch.Tensor]]:
        concurrency = int(request.extra.get("concurrency", DEFAULT_CONCURRENCY))
        tensors = [t for f in request.index.files for t in f.tensors]
        fds: dict[str, int] = {}
        pending: deque[tuple[TensorInfo, torch.Tensor, list[Future]]] = deque()
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
                        window += info.nbytes
                    info, tensor, futures = pending.popleft()
                    for future in futures:
                        future.result()
                    window -= info.nbytes
                    yield info.name, tensor if request.device.type == "cpu" else tensor.to(request.device)
        finally:
            for fd in fds.values():
                os.close(fd)

    def _submit(self, pool: ThreadPoolExecutor, fd: int, info: TensorInfo,
                request: ReadRequest) -> tuple[TensorInfo, torch.Tensor, list[Future]]:
        """Start reading one tensor, in chunks, into its destination."""
        tensor = _destination(request, info)
        view = host_view(tensor)
        futures = [pool.submit(read_exactly, fd, view[start:start + self.chunk_bytes], info.begin + start,
                               info.file, info.name)
                   for start in range(0, info.nbytes, self.chunk_bytes)]
        return info, tensor, futures


def _destination(request: ReadRequest, info: TensorInfo) -> torch.Tensor:
    """The caller's tensor to read into in place when it fits exactly, else a new one."""
    dest = request.destinations.get(info.name)
    if (dest is not None and request.device.type == "cpu" and dest.device.type == "cpu"
            and dest.is_contiguous() and dest.dtype == info.torch_dtype and tuple(dest.shape) == info.shape):
        return dest
    return request.host_memory.empty(info.shape, info.torch_dtype)
