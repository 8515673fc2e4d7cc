"""Readers, one module per product, registered by name.

Each backend is a callable ``read(request) -> BackendRun``. Optional packages are imported inside
the backend, with an error that names the ``pip install`` extra, so that ``import distload``
works without them.
"""

from __future__ import annotations

from typing import Callable

from distload.loading.backends.base import BackendRun, ReadRequest
from distload.loading.backends.dummy import read_dummy
from distload.loading.backends.instanttensor import read_instanttensor
from distload.loading.backends.pread import read_pread
from distload.loading.backends.ranged import read_ranged
from distload.loading.backends.runai import read_runai
from distload.loading.backends.safetensors import read_safetensors

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
