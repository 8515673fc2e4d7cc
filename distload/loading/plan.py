"""The rank plan: what this rank will read, how, and what it must end up with (pure data; the
planner, :mod:`distload.loading.planner`, makes it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from distload.loading.choice import ReadChoice
from distload.loading.index import CheckpointIndex
from distload.loading.manifest import View


@dataclass(frozen=True)
class RankPlan:
    """What this rank will read and how (pure data: it travels between ranks for the checks)."""

    source: str
    choice: ReadChoice
    index: CheckpointIndex
    # From a distload manifest: the keys this rank must end up with, and names that share a
    # tensor's storage (tied embeddings; restored as the same tensor).
    expected_keys: frozenset[str] | None = None
    aliases: Mapping[str, str] = field(default_factory=dict)
    # From a distload manifest: tensors saved inside another one, handed out as views of it.
    views: Mapping[str, View] = field(default_factory=dict)
    # For a cooperative read of local files: each file's content fingerprint, compared across ranks.
    fingerprints: tuple[str, ...] = ()

    def signature(self) -> list[tuple]:
        """What ranks compare before a cooperative read: path, size (and content) per file."""
        if not self.fingerprints:
            return self.index.signature()
        return [(path, size, fp) for (path, size), fp in zip(self.index.signature(), self.fingerprints)]
