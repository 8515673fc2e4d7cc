"""The readers, one module and one object per product, registered by name.

Optional packages are imported inside each backend, with an error that names the ``pip install``
extra, so that ``import distload`` works without them. A new reader is one module here (a
:class:`~distload.loading.backends.base.Backend` subclass) and one line in ``BACKENDS``.
"""

from __future__ import annotations

from distload.loading.backends.base import Backend, BackendRun, ReadRequest
from distload.loading.backends.dummy import DummyBackend
from distload.loading.backends.instanttensor import InstantTensorBackend
from distload.loading.backends.pread import PreadBackend
from distload.loading.backends.ranged import RangedBackend
from distload.loading.backends.runai import RunaiBackend
from distload.loading.backends.safetensors import SafetensorsBackend

BACKENDS: dict[str, Backend] = {backend.name: backend for backend in (
    SafetensorsBackend(),
    PreadBackend(),
    RangedBackend(),
    RunaiBackend(),
    InstantTensorBackend(),
    DummyBackend(),
)}

__all__ = ["BACKENDS", "Backend", "BackendRun", "ReadRequest"]
