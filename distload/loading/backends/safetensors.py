"""The reference reader: safetensors' own ``safe_open``, one file at a time.

On the CPU ``get_tensor`` returns a view of the file's memory map: nothing is read until the
tensor is first touched, and rewriting the file (a reshard, a hot reload) would change the
"loaded" tensor under its user. We copy each tensor out of the map so that a load means the bytes
are in the rank's own memory, and its timing is the real cost. The copies are new host tensors
from the request's HostMemory (huge pages where the kernel allows), and they are made with
``distload.loading.mapped``, so that a file truncated during the read is an error naming it,
never SIGBUS. The map is always opened on the host for that reason (safetensors' own copy to a
GPU would touch the map unguarded); a GPU rank's tensors are moved there after the copy.
"""

from __future__ import annotations

import os
from typing import Iterator

import torch
from safetensors import safe_open

from distload.config import check_bool
from distload.errors import CheckpointError
from distload.loading import mapped
from distload.loading.backends.base import Backend, BackendRun, ReadRequest
from distload.loading.index import FileInfo, TensorInfo


class SafetensorsBackend(Backend):
    name = "safetensors"
    keys = {"huge_pages": check_bool}
    creates_host_tensors = True
    reads_object_stores = False  # safe_open needs a local file; object stores get `ranged`

    def read(self, request: ReadRequest) -> BackendRun:
        if mapped.safe_copy_available():
            return BackendRun("safetensors").start(_stream(request))
        # A seccomp filter refuses process_vm_readv: the bytes come from pread, as safe.
        return BackendRun("safetensors-pread").start(_stream(request, by_pread=True))


def _stream(request: ReadRequest, by_pread: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    if by_pread:
        yield from _stream_files(request, None)
        return
    with mapped.MapCopier() as copier:
        yield from _stream_files(request, copier)


def _stream_files(request: ReadRequest, copier: "mapped.MapCopier | None") -> Iterator[tuple[str, torch.Tensor]]:
    device = request.device
    for info in request.index.files:
        try:
            handle = safe_open(info.path, framework="pt", device="cpu")
        except Exception as exc:  # SafetensorError, OSError: name the file
            raise CheckpointError(f"{info.path}: safetensors could not open it: {exc}") from exc
        fd = os.open(info.path, os.O_RDONLY | os.O_CLOEXEC) if copier is None else -1
        try:
            with handle:
                for tensor in info.tensors:  # in file order: sequential reads
                    try:
                        view = handle.get_tensor(tensor.name)
                    except Exception as exc:
                        raise CheckpointError(f"{info.path}: safetensors could not read tensor "
                                              f"{tensor.name!r}: {exc}") from exc
                    loaded = request.host_memory.empty(tuple(view.shape), view.dtype)
                    _copy(loaded, view, fd, info, tensor, copier)
                    del view  # no reference into the map outlives the file's handle
                    if device.type != "cpu":
                        loaded = loaded.to(device)
                    yield tensor.name, loaded
        finally:
            if fd >= 0:
                os.close(fd)


def _copy(dst: torch.Tensor, view: torch.Tensor, fd: int, info: FileInfo, tensor: TensorInfo,
          copier: "mapped.MapCopier | None") -> None:
    try:
        if copier is None:
            mapped.pread_into(dst, fd, tensor.begin)
        else:
            copier.copy(dst, view)
    except mapped.ShortCopy as short:
        size = _size_now(info.path)
        raise CheckpointError(
            f"{info.path}: tensor {tensor.name!r} ends at byte {tensor.end}, but the file ended after "
            f"{tensor.begin + short.copied} bytes while it was being read (it is {size} bytes now, "
            f"{info.size} when the load planned it): the file was truncated or replaced during the "
            "load; load again once it is complete") from None


def _size_now(path: str) -> str:
    try:
        return str(os.stat(path).st_size)
    except OSError as exc:
        return f"unknown ({exc.strerror})"
