"""What a reader is given (:class:`ReadRequest`) and what it hands back (:class:`BackendRun`).

Below the backends (``backends/``) and the parts they share (``shared_reads/``): both use these,
and neither is imported from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, TypeVar

import torch

from distload.loading.checksums import TensorChecksums
from distload.loading.host_memory import HostMemory
from distload.loading.index import CheckpointIndex
from distload.tp.slices import SliceBytes


@dataclass(frozen=True)
class ReadOptions:
    """A backend's own part of a read request: each backend that has settings defines a subclass
    (typed fields) and makes it from the extra config and the rank plan in ``Backend.options``.
    The request carries it without knowing its fields, as DCP's plans carry an opaque
    per-storage field: a new backend's data is a new subclass, never a new request field."""


T = TypeVar("T", bound=ReadOptions)


@dataclass(frozen=True, kw_only=True)
class ReadRequest:
    """One rank's read: its files, where the tensors go, and how (built by keyword only).

    ``shared`` means every rank of the group holds this very index (checked by the caller
    before the backend runs) and the backend may split the reading across them.
    ``destinations``: existing tensors (by checkpoint name) that a backend able to read in place
    may read straight into and yield, instead of allocating (an in-place reload); a backend that
    cannot ignores them, and the caller copies.
    ``host_memory``: where a backend that allocates host tensors itself gets them (huge pages;
    the loader passes one per load, the default marks nothing).
    ``slices``: only for a backend that reads slices; the others read whole tensors and the
    loader cuts the rank's slice.
    ``options``: the backend's own settings (its :class:`ReadOptions` subclass; None: its defaults).
    """

    index: CheckpointIndex
    device: torch.device
    group: Any  # the WorkerGroup; backends use its process_group, rank and timeout
    shared: bool = False
    destinations: Mapping[str, torch.Tensor] = field(default_factory=dict)
    host_memory: HostMemory = field(default_factory=lambda: HostMemory(False))
    # A tensor-parallel rank's slices (tensor name -> the byte extents of its piece), for a
    # backend that ``reads_slices``; it yields those tensors in their slice's shape.
    slices: Mapping[str, SliceBytes] = field(default_factory=dict)
    options: ReadOptions | None = None
    # The manifest's CRC-32Cs by tensor name: a reader that checks a tensor's bytes as they
    # arrive adds its name to ``BackendRun.checked``; the loader checks the others.
    checksums: Mapping[str, TensorChecksums] = field(default_factory=dict)

    def tensor_for(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Where a reader puts tensor ``name`` (or this rank's piece of it, of ``shape``): the
        caller's destination when it fits exactly (host memory, contiguous, that dtype and shape),
        else a new host tensor."""
        dest = self.destinations.get(name)
        if (dest is not None and self.device.type == "cpu" and dest.device.type == "cpu"
                and dest.is_contiguous() and dest.dtype == dtype and tuple(dest.shape) == tuple(shape)):
            return dest
        return self.host_memory.empty(shape, dtype)

    def options_as(self, kind: type[T]) -> T:
        """The options as the reading backend's own type (its defaults where none were given)."""
        if self.options is None:
            return kind()
        if not isinstance(self.options, kind):
            raise TypeError(f"a read that takes {kind.__name__} was given {type(self.options).__name__}")
        return self.options


class BackendRun:
    """A read in progress: ``tensors()`` yields once; ``path`` names what actually ran.

    A backend may learn only once reading starts which path its library took (Run:ai decides
    inside ``stream_files`` whether distributed streaming really runs), so it updates ``path``
    from inside the generator; read it after the first tensor.
    """

    def __init__(self, path: str, requested_bytes: int | None = None):
        self.path = path
        # Bytes the reader asked the source for, counted by the reader (None: a library read the
        # whole tensors, and the loader counts their bytes).
        self.requested_bytes = requested_bytes
        # Bytes by the way they were read ("pread/page-cache", "pread/storage", ...), for a reader
        # that takes each tensor the way its bytes' place calls for; None for the others.
        self.reader_bytes: dict[str, int] | None = None
        # Bytes that came from other ranks over the group (a shared read); None: not counted.
        self.received_bytes: int | None = None
        # Through a node cache: bytes its complete blocks gave, bytes fetched from the store into
        # it, and blocks found corrupt (fetched again); None: no cache.
        self.cache_bytes: int | None = None
        self.store_bytes: int | None = None
        self.corrupt_blocks: int | None = None
        # Bytes received from other ranks (a shared read) and kept in this node's cache.
        self.cache_received_bytes: int | None = None
        # Tensors whose CRC-32Cs the reader checked itself as their bytes arrived (read-ahead
        # threads, on bytes still in the core's cache); the loader checks every other one.
        self.checked: set[str] = set()
        self._tensors: Iterator[tuple[str, torch.Tensor]] = iter(())

    def start(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> "BackendRun":
        self._tensors = tensors
        return self

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._tensors
