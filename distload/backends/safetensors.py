"""The reference reader: safetensors' own ``safe_open``, one file at a time.

On the CPU ``get_tensor`` returns a view of the file's memory map: nothing is read until the
tensor is first touched, and rewriting the file (a reshard, a hot reload) would change the
"loaded" tensor under its user. We copy each tensor out of the map so that a load means the bytes
are in the rank's own memory, and its timing is the real cost.
"""

from __future__ import annotations

from typing import Iterator

import torch
from safetensors import safe_open

from .base import BackendRun, ReadRequest


def read_safetensors(request: ReadRequest) -> BackendRun:
    return BackendRun("safetensors").start(_stream(request))


def _stream(request: ReadRequest) -> Iterator[tuple[str, torch.Tensor]]:
    device = str(request.device)
    for info in request.index.files:
        with safe_open(info.path, framework="pt", device=device) as handle:
            for tensor in info.tensors:  # in file order: sequential reads
                loaded = handle.get_tensor(tensor.name)
                yield tensor.name, loaded.clone() if loaded.device.type == "cpu" else loaded
