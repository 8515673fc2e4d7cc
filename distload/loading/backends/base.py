"""What a backend is: one object per reader, what it is given, and what it hands back.

The loader never asks for a backend by name beyond looking it up in the registry
(``distload.loading.backends.BACKENDS``); everything it needs to know is a trait or a method of
the object. Order of calls, on every rank of the group:

1. ``check_source(source, group)`` first, when the load format reads with this backend only:
   what it can refuse from the source's kind and the rank's device alone, before any request;
   ``preflight(plan, group)`` at the end of planning. Both run inside the group's agreement
   step: a refusal there reaches every rank at once (inside a cooperative read the others would
   wait the timeout);
2. ``read(request)``: a :class:`BackendRun` whose ``tensors()`` streams ``(name, tensor)`` onto
   the request's device, with ``environment(request)`` applied while it streams.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Mapping

import torch

from distload.loading.host_memory import HostMemory
from distload.loading.index import CheckpointIndex
from distload.tp.slices import SliceBytes

if TYPE_CHECKING:
    from distload.workers.group import WorkerGroup
    from distload.loading.plan import RankPlan

# An extra-config value check: raises ConfigError naming the key.
Check = Callable[[str, Any], None]


@dataclass(frozen=True)
class ReadRequest:
    """One rank's read: its files, where the tensors go, and how.

    ``cooperative`` means every rank of the group holds this very index (checked by the caller
    before the backend runs) and the backend may split the reading across them.
    ``destinations``: existing tensors (by checkpoint name) that a backend able to read in place
    may read straight into and yield, instead of allocating (an in-place reload); a backend that
    cannot ignores them, and the caller copies.
    ``host_memory``: where a backend that allocates host tensors itself gets them (huge pages;
    the loader passes one per load, the default marks nothing).
    ``slices``: only for a backend that reads slices; the others read whole tensors and the
    loader cuts the rank's slice.
    ``scope`` (cooperative reads): ``node`` or ``job``, the ranks that split the reading.
    ``sharing`` (cooperative reads of a backend that ``shares_reads``): the ranks of the group
    (group ranks, this one included) that read this rank's files together, found by the agreement;
    ``needs``: what each of them keeps (in ``sharing``'s order): tensor name -> byte runs of its
    slice (``shared_reads/plan.py``), the tensors it keeps whole left out. The load's agreement fills
    both; a shared read without them is refused.
    """

    index: CheckpointIndex
    device: torch.device
    group: Any  # the WorkerGroup; backends use its process_group, rank and timeout
    extra: Mapping[str, Any] = field(default_factory=dict)
    cooperative: bool = False
    destinations: Mapping[str, torch.Tensor] = field(default_factory=dict)
    host_memory: HostMemory = field(default_factory=lambda: HostMemory(False))
    # A tensor-parallel rank's slices (tensor name -> the byte extents of its piece), for a
    # backend that ``reads_slices``; it yields those tensors in their slice's shape.
    slices: Mapping[str, SliceBytes] = field(default_factory=dict)
    scope: str = "node"
    sharing: tuple[int, ...] = ()
    needs: tuple[Mapping[str, tuple], ...] = ()


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
        # Bytes that came from other ranks over the group (a cooperative read); None: not counted.
        self.received_bytes: int | None = None
        self._tensors: Iterator[tuple[str, torch.Tensor]] = iter(())

    def start(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> "BackendRun":
        self._tensors = tensors
        return self

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._tensors


class Backend:
    """One reader. Subclasses set the traits and implement :meth:`read`.

    ``name``: the registry key and the read choice's ``backend``.
    ``keys``: the extra-config keys this reader honours, each with its value check.
    ``creates_host_tensors``: it allocates the host tensors it yields itself (from the request's
        HostMemory), so the ``huge_pages`` setting concerns it.
    ``reads_object_stores``: it can read ``s3://``/``gs://``/``az://`` sources.
    ``package``: the optional module it needs (None: always there).
    ``reads_slices``: it reads only a tensor-parallel rank's byte ranges (``request.slices``).
    ``shares_reads``: its cooperative read splits the bytes among the ranks that read the same
        files (``request.sharing``: a whole checkpoint's ranks, the replicas of a TP rank's shard
        files; a node's only, for the node scope) and sends each only what it keeps.
    """

    name: ClassVar[str] = ""
    keys: ClassVar[Mapping[str, Check]] = {}
    creates_host_tensors: ClassVar[bool] = False
    reads_object_stores: ClassVar[bool] = True
    package: ClassVar[str | None] = None
    reads_slices: ClassVar[bool] = False
    shares_reads: ClassVar[bool] = False

    def available(self) -> bool:
        """Whether this machine has what the reader needs to import (not whether it can run on
        this rank's device: that is :meth:`preflight`'s question)."""
        return self.package is None or importlib.util.find_spec(self.package) is not None

    def check_source(self, source: str, group: "WorkerGroup") -> None:
        """Raise for a source or device this reader can never serve (no I/O)."""

    def preflight(self, plan: "RankPlan", group: "WorkerGroup") -> None:
        """Raise what the read would otherwise meet only once it started."""
        self.check_source(plan.source, group)

    def environment(self, request: ReadRequest) -> dict[str, str]:
        """Environment variables the reader needs while it streams (nothing is written here)."""
        return {}

    def read(self, request: ReadRequest) -> BackendRun:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<backend {self.name}>"
