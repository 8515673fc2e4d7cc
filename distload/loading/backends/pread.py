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

from distload.loading.index import TensorInfo
from distload.errors import CheckpointError
from distload.tensor_io import host_view
from distload.loading.backends.base import BackendRun, ReadRequest

CHUNK_BYTES = 8 * 1024 * 1024
DEFAULT_CONCURRENCY = 8
READ_AHEAD_BYTES = 256 * 1024 * 1024


def read_pread(request: ReadRequest) -> BackendRun:
    return BackendRun("pread").start(_stream(request))


def read_exactly(fd: int, view: memoryview, offset: int, path: str, name: str) -> None:
    """Fill ``view`` from ``fd`` at ``offset`` (tensor ``name`` of ``path``); short reads retried,
    a file that ends early or fails is a CheckpointError naming both."""
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            raise CheckpointError(f"{path}: reading tensor {name!r} failed: {exc}") from None
        if n == 0:
            raise CheckpointError(f"{path}: ended while reading tensor {name!r}: the file is shorter "
                                  f"than its header says (truncated while loading?)")
        done += n


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot open it to read its tensors ({exc.strerror}): was it "
                              f"moved or deleted after the load was planned?") from None


def _destination(request: ReadRequest, info: TensorInfo) -> torch.Tensor:
    """The caller's tensor to read into in place when it fits exactly, else a new one."""
    dest = request.destinations.get(info.name)
    if (dest is not None and request.device.type == "cpu" and dest.device.type == "cpu"
            and dest.is_contiguous() and dest.dtype == info.torch_dtype and tuple(dest.shape) == info.shape):
        return dest
    return request.host_memory.empty(info.shape, info.torch_dtype)


def _stream(request: ReadRequest) -> Iterator[tuple[str, torch.Tensor]]:
    concurrency = int(request.extra.get("concurrency", DEFAULT_CONCURRENCY))
    device = request.device
    fds: dict[str, int] = {}
    pending: deque[tuple[TensorInfo, torch.Tensor, list[Future]]] = deque()
    window = 0
    try:
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="distload-pread") as pool:
            queue = iter([t for f in request.index.files for t in f.tensors])
            exhausted = False
            while True:
                # Keep reading ahead until the window is full (always at least one tensor).
                while not exhausted and (not pending or window < READ_AHEAD_BYTES):
                    info = next(queue, None)
                    if info is None:
                        exhausted = True
                        break
                    if info.file not in fds:
                        fds[info.file] = _open(info.file)
                    tensor = _destination(request, info)
                    view = host_view(tensor)
                    futures = [pool.submit(read_exactly, fds[info.file], view[start:start + CHUNK_BYTES],
                                           info.begin + start, info.file, info.name)
                               for start in range(0, info.nbytes, CHUNK_BYTES)]
                    pending.append((info, tensor, futures))
                    window += info.nbytes
                if not pending:
                    return
                info, tensor, futures = pending.popleft()
                for future in futures:
                    future.result()
                window -= info.nbytes
                yield info.name, tensor if device.type == "cpu" else tensor.to(device)
    finally:
        for fd in fds.values():
            os.close(fd)
