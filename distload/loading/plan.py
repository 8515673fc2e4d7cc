"""The rank plan: what this rank will read, how, and what it must end up with (pure data; the
planner, :mod:`distload.loading.planner`, makes it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from distload.loading.shared_reads.plan import compact
from distload.loading.checksums import TensorChecksums
from distload.loading.choice import ReadChoice
from distload.loading.index import CheckpointIndex
from distload.loading.manifest import Subtensor
from distload.loading.rank_slices import RankSlices, TPPlace
from distload.loading.stores.cache import CacheSettings


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
    views: Mapping[str, Subtensor] = field(default_factory=dict)
    # For a shared read of local files: each file's content fingerprint, compared across ranks.
    fingerprints: tuple[str, ...] = ()
    # With a tensor-parallel size: where this rank sits, and (whole checkpoint) its slices.
    tensor_parallel: TPPlace | None = None
    slices: RankSlices | None = None
    # After the agreement, for a shared read that splits by need (Backend.shares_reads): the
    # group ranks that read this rank's files with it, this one included, and what each keeps of
    # the split tensors (slice_runs, in the same order).
    members: tuple[int, ...] = ()
    needs: tuple[Mapping[str, tuple], ...] = ()
    # An object-store load's node cache (--cache-dir), for the backend that reads through it.
    cache: CacheSettings | None = None
    # From a distload manifest that records them: each tensor's CRC-32Cs, checked as it arrives.
    checksums: Mapping[str, TensorChecksums] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes this rank ends up with (its slices' bytes for a split tensor)."""
        if self.slices is None:
            return self.index.nbytes
        return sum(self.slices.slices[t.name].nbytes if t.name in self.slices.slices else t.nbytes
                   for t in self.index.tensors if t.name not in self.slices.dropped)

    def shape_of(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape tensor ``name`` (``shape`` in the checkpoint) has on this rank."""
        piece = self.slices.slices.get(name) if self.slices is not None else None
        return shape if piece is None else piece.shape

    def share_key(self) -> tuple:
        """Equal on the ranks that are meant to read the same files, and so may share the reading:
        every rank of a whole checkpoint (whatever slices each keeps: the exchange sends each its
        own), a tensor-parallel rank's replicas of a pre-sharded one. The agreement then checks
        that those ranks hold identical file lists."""
        if self.choice.sharded:
            tp = self.tensor_parallel
            return ("files of TP rank", tp.shard_rank, tp.shard_count) if tp is not None else ("files", tuple(self.index.signature()))
        return ("whole",)

    def slice_runs(self) -> dict[int, tuple]:
        """What this rank keeps of each split tensor, as the exchange plan's byte runs (compact:
        a slice along dim 1 is one run, not one extent per row), by the tensor's position in the
        index: it travels to every rank, where names would be most of its bytes (the members of
        a shared read hold the same files, so the same index; the agreement checks that)."""
        if self.slices is None:
            return {}
        pieces = self.slices.slices
        return {i: piece.runs if piece.runs is not None else compact(piece.extents)
                for i, piece in ((i, pieces.get(t.name)) for i, t in enumerate(self.index.tensors)) if piece is not None}

    def signature(self) -> list[tuple]:
        """What ranks compare before a shared read: path, size (and content) per file."""
        if not self.fingerprints:
            return self.index.signature()
        return [(item[0], item[1], fp) for item, fp in zip(self.index.signature(), self.fingerprints)]
