"""What a backend is: one object per reader, what it is given, and what it hands back.

The loader never asks for a backend by name beyond looking it up in the registry
(``distload.loading.backends.BACKENDS``); everything it needs to know is a trait or a method of
the object. Order of calls, on every rank of the group:

1. ``check_source(source, group)`` first, when the load format reads with this backend only:
   what it can refuse from the source's kind and the rank's device alone, before any request;
   ``preflight(plan, group)`` at the end of planning. Both run inside the group's agreement
   step: a refusal there reaches every rank at once (inside a shared read the others would
   wait the timeout);
2. ``options(extra, plan)``: the backend's own settings for the request (a
   :class:`~distload.loading.request.ReadOptions` subclass it defines), made by the loader;
3. ``read(request)``: a :class:`BackendRun` whose ``tensors()`` streams ``(name, tensor)`` onto
   the request's device, with ``environment(request)`` applied while it streams.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

from distload.loading.request import BackendRun, ReadOptions, ReadRequest

if TYPE_CHECKING:
    from distload.workers.group import WorkerGroup
    from distload.loading.plan import RankPlan

# An extra-config value check: raises ConfigError naming the key.
Check = Callable[[str, Any], None]


class Backend:
    """One reader. Subclasses set the traits and implement :meth:`read`.

    ``name``: the registry key and the read choice's ``backend``.
    ``keys``: the extra-config keys this reader honours, each with its value check.
    ``creates_host_tensors``: it allocates the host tensors it yields itself (from the request's
        HostMemory), so the ``huge_pages`` setting concerns it.
    ``reads_object_stores``: it can read ``s3://``/``gs://``/``az://`` sources.
    ``package``: the optional module it needs (None: always there).
    ``reads_slices``: it reads only a tensor-parallel rank's byte ranges (``request.slices``).
    ``shares_reads``: its shared read splits the bytes among the ranks that read the same
        files (its options' ``members``, shared_reads.stream.SharedReadOptions: a whole checkpoint's
        ranks, the replicas of a TP rank's shard files; a node's only, for the node scope) and
        sends each only what it keeps.
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

    def options(self, extra: Mapping[str, Any], plan: "RankPlan") -> ReadOptions | None:
        """This backend's part of the request, from the validated extra config and the rank plan
        (None: it has none)."""
        return None

    def environment(self, request: ReadRequest) -> dict[str, str]:
        """Environment variables the reader needs while it streams (nothing is written here)."""
        return {}

    def read(self, request: ReadRequest) -> BackendRun:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<backend {self.name}>"
