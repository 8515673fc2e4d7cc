"""What a backend is given and what it hands back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch

from distload.loading.index import CheckpointIndex
from distload.loading.host_memory import HostMemory


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
    """

    index: CheckpointIndex
    device: torch.device
    group: Any  # the WorkerGroup; backends use its process_group, rank and timeout
    extra: Mapping[str, Any] = field(default_factory=dict)
    cooperative: bool = False
    destinations: Mapping[str, torch.Tensor] = field(default_factory=dict)
    host_memory: HostMemory = field(default_factory=lambda: HostMemory(False))


class BackendRun:
    """A read in progress: ``tensors()`` yields once; ``path`` names what actually ran.

    A backend may learn only once reading starts which path its library took (Run:ai decides
    inside ``stream_files`` whether distributed streaming really runs), so it updates ``path``
    from inside the generator; read it after the first tensor.
    """

    def __init__(self, path: str):
        self.path = path
        self._tensors: Iterator[tuple[str, torch.Tensor]] = iter(())

    def start(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> "BackendRun":
        self._tensors = tensors
        return self

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._tensors
