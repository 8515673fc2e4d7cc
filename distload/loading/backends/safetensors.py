"""The reference reader: safetensors' own ``safe_open``, one file at a time.

On the CPU ``get_tensor`` returns a view of the file's memory map: nothing is read until the
tensor is first touched, and rewriting the file (a reshard, a hot reload) would change the
"loaded" tensor under its user. We copy each tensor out of the map so that a load means the bytes
are in the rank's own memory, and its timing is the real cost. The copies are new host tensors
from the request's HostMemory (huge pages where the kernel allows).
"""

from __future__ import annotations

from typing import Iterator

import torch
from safetensors import safe_open

from distload.config import check_bool
from distload.errors import CheckpointError
from distload.loading.backends.base import Backend, BackendRun, ReadRequest


class SafetensorsBackend(Backend):
    name = "safetensors"
    keys = {"huge_pages": check_bool}
    creates_host_tensors = True
    reads_object_stores = False  # safe_open needs a local file; object stores get `ranged`

    def read(self, request: ReadRequest) -> BackendRun:
        return BackendRun("safetensors").start(_stream(request))


def _stream(request: ReadRequest) -> Iterator[tuple[str, torch.Tensor]]:
    device = str(request.device)
    for info in request.index.files:
        try:
            handle = safe_open(info.path, framework="pt", device=device)
        except Exception as exc:  # SafetensorError, OSError: name the file
            raise CheckpointError(f"{info.path}: safetensors could not open it: {exc}") from exc
        with handle:
            for tensor in info.tensors:  # in file order: sequential reads
                try:
                    loaded = handle.get_tensor(tensor.name)
                except Exception as exc:
                    raise CheckpointError(f"{info.path}: safetensors could not read tensor "
                                          f"{tensor.name!r}: {exc}") from exc
                if loaded.device.type == "cpu":
                    copy = request.host_memory.empty(tuple(loaded.shape), loaded.dtype)
                    loaded = copy.copy_(loaded)
                yield tensor.name, loaded
