"""Readers, one module per product, registered by name.

Each backend is a callable ``read(request) -> BackendRun``. Optional packages are imported inside
the backend, with an error that names the ``pip install`` extra, so that ``import distload``
works without them.
"""

from __future__ import annotations

from typing import Callable

from .base import BackendRun, ReadRequest
from .dummy import read_dummy
from .instanttensor import read_instanttensor
from .pread import read_pread
from .ranged import read_ranged
from .runai import read_runai
from .safetensors import read_safetensors

BACKENDS: dict[str, Callable[[ReadRequest], BackendRun]] = {
    "safetensors": read_safetensors,
    "runai": read_runai,
    "instanttensor": read_instanttensor,
    "dummy": read_dummy,
    "ranged": read_ranged,
    "pread": read_pread,
}

# The backends that create host tensors themselves, from ReadRequest.host_memory (huge pages).
HOST_TENSOR_BACKENDS = frozenset({"pread", "ranged", "safetensors"})

__all__ = ["BACKENDS", "HOST_TENSOR_BACKENDS", "BackendRun", "ReadRequest"]
