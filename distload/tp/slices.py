"""What one tensor-parallel rank holds of one tensor: the ranges of its split dimension, its shape,
its piece, and the way back to the whole tensor.

A sharding spec (distload/tp/spec.py) decides an :class:`Action` per tensor; this module is the
one place that turns an action into rank r's slice, so the offline reshard, ``reload_into`` and
every later reader of slices agree to the row. The rules are vLLM's and Megatron's:

- a split dimension may be cut into fused *parts* (q, k, v of one qkv weight; gate and up), and
  each part is split on its own, so rank r holds ``[q_r; k_r; v_r]``;
- a part made of attention heads is cut between heads only. When there are fewer KV heads than
  ranks, each rank holds one whole KV head, rank r head ``r // (ranks // kv_heads)``, the heads
  replicated over consecutive ranks (vLLM's ``QKVParallelLinear``);
- a padded dimension (a vocabulary, vLLM's ``VocabParallelEmbedding``) is first padded with zero
  rows to a multiple of ``pad_to``, then split evenly: the last ranks hold the zero rows;
- a stacked expert tensor ([E, ...], every expert along dim 0) under expert parallelism keeps
  its EP rank's experts, ``rows`` of dim 0, before it is split along a later ``dim``: a cut of two
  dimensions, each of one kind (distload/tp/experts.py).

Pure: no I/O, no torch.distributed.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field
from collections.abc import Sequence

import torch

from distload.errors import ConfigError


@dataclass(frozen=True)
class Part:
    """One fused part of a split dimension (or the whole dimension)."""

    size: int
    unit: int = 1  # rows never cut apart: one attention head (head_dim rows), else 1
    replicable: bool = False  # fewer units than ranks: each rank holds one whole unit (KV heads)
    what: str = "rows"  # for messages: "attention heads", "KV heads"

    @property
    def units(self) -> int:
        return self.size // self.unit


@dataclass(frozen=True)
class Action:
    """What happens to one tensor: replicate, or split along ``dim`` (part by part if fused)."""

    dim: int | None
    parts: tuple[Part, ...] | None = None  # None: the whole dimension is one plain part
    rule: str | None = None  # the glob that decided; None: no rule matched (replicated)
    pad_to: int | None = None  # pad ``dim`` with zero rows to a multiple of this before splitting
    unresolved: str | None = None  # why the parts cannot be sized; raised once the tensor is split
    # Values per torch element along the last dimension (2 for F4: the file counts 4-bit values,
    # torch holds pairs). Sizes here are torch's; messages give the file's.
    packing: int = 1
    # The ranges of ``dim`` one receiver said it keeps (distload/live/transfer.py's Cuts: a vLLM
    # worker's, from the weight map): the same on every rank asked, as a rule's split is not.
    ranges: tuple[tuple[int, int], ...] | None = None
    # This tensor holds the block scales of a split weight (FP8 ``X.weight_scale_inv``): its ranges
    # are the weight's, on block boundaries, divided by the block size (distload/tp/spec.py).
    scales: "BlockScales | None" = None
    # Runs [start, stop) of dim 0 kept before ``dim`` (> 0) is split: an expert-parallel rank's
    # experts of a stacked expert tensor the spec also splits (distload/tp/experts.py). None: all.
    rows: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        if self.parts is not None:  # sizes may be given as plain ints: equal-footing plain parts
            parts = tuple(p if isinstance(p, Part) else Part(int(p)) for p in self.parts)
            object.__setattr__(self, "parts", parts)

    @property
    def replicated(self) -> bool:
        return self.dim is None

    @property
    def part_sizes(self) -> tuple[int, ...] | None:
        return None if self.parts is None else tuple(p.size for p in self.parts)


@dataclass(frozen=True)
class BlockScales:
    """What a block-scale tensor is cut by: its weight (name, torch shape, action) and how many of
    the weight's rows (or columns) along the split dimension one scale entry covers."""

    weight: str
    weight_shape: tuple[int, ...]
    weight_action: Action
    block: int
    source: str = "inferred from the shapes"  # where ``block`` came from, for messages


@dataclass(frozen=True)
class Slice:
    """Rank r's piece of a split dimension: source ranges in the order the rank holds them."""

    ranges: tuple[tuple[int, int], ...]  # [start, stop) along the split dim of the source tensor
    padding: int = 0  # zero rows after the ranges (a padded vocabulary's last ranks)
    rows: tuple[tuple[int, int], ...] | None = None  # runs of dim 0 kept first (Action.rows); None: all

    @property
    def length(self) -> int:
        return sum(stop - start for start, stop in self.ranges) + self.padding

    def outer_runs(self, shape: Sequence[int], dim: int) -> tuple[tuple[int, int], ...]:
        """The kept indices of the dimensions before ``dim``, flattened, as [start, stop) runs:
        all of them, or each run of ``rows`` times the dimensions between 0 and ``dim``."""
        if self.rows is None:
            return ((0, math.prod(shape[:dim])),)
        mid = math.prod(shape[1:dim])
        return tuple((start * mid, stop * mid) for start, stop in self.rows if stop > start)

    def shape(self, shape: Sequence[int], dim: int) -> tuple[int, ...]:
        """The shape of the piece this slice keeps of a tensor of ``shape`` split along ``dim``."""
        out = list(shape)
        out[dim] = self.length
        if self.rows is not None:
            out[0] = sum(stop - start for start, stop in self.rows)
        return tuple(out)


def rank_slice(name: str, shape: Sequence[int], action: Action, rank: int, world_size: int) -> Slice | None:
    """Rank ``rank``'s ranges of the split dimension; None for a replicated tensor (it is whole).

    Raises ConfigError naming the tensor when the split cannot be made on ``world_size`` ranks.
    """
    piece = _split(name, shape, action, rank, world_size)
    if piece is None or action.rows is None:
        return piece
    if action.dim == 0 or any(not 0 <= a <= b <= int(shape[0]) for a, b in action.rows):
        raise ConfigError(f"tensor {name!r} with shape {list(shape)}: rows {list(action.rows)} of dim 0 cannot be "
                          f"kept before a split along dim {action.dim} (rule {action.rule!r})")
    return Slice(piece.ranges, piece.padding, action.rows)


def _split(name: str, shape: Sequence[int], action: Action, rank: int, world_size: int) -> Slice | None:
    """:func:`rank_slice`'s ranges of the split dimension, before ``action.rows``."""
    if action.replicated:
        return None
    dim = action.dim
    assert dim is not None
    if dim >= len(shape):
        raise ConfigError(
            f"tensor {name!r} has shape {file_shape(shape, action.packing)}, so it has no dim {dim} to split "
            f"(rule {action.rule!r}); fix the sharding spec"
        )
    length = int(shape[dim])
    if action.ranges is not None:
        return Slice(action.ranges)
    if action.scales is not None:
        return _scale_slice(name, shape, action, action.scales, rank, world_size)
    if action.pad_to is not None:
        return _padded_slice(name, shape, action, length, rank, world_size)
    if world_size == 1:
        return Slice(((0, length),))
    if action.unresolved is not None:
        raise ConfigError(action.unresolved)
    parts = action.parts or (Part(length),)
    ranges = []
    offset = 0
    for part in parts:
        ranges.append(_part_range(name, shape, action, part, offset, rank, world_size))
        offset += part.size
    return Slice(tuple(ranges))


def _scale_slice(name: str, shape: Sequence[int], action: Action, scales: BlockScales, rank: int,
                 world_size: int) -> Slice:
    """Rank ``rank``'s scale rows: its weight's ranges ``[a, b)`` as ``[a / block, b / block)``,
    refused unless every rank's ranges fall on block boundaries (the weight's last, ragged block
    aside). A padded vocabulary's zero rows get zero scales, whole blocks of them."""
    piece = rank_slice(scales.weight, scales.weight_shape, scales.weight_action, rank, world_size)
    assert piece is not None and action.dim is not None
    out = _block_slice(piece, scales)
    if isinstance(out, Slice):
        return out
    dim, block = action.dim, scales.block
    rows = "rows" if dim == 0 else "columns" if dim == 1 else f"indices of dim {dim}"
    working = [t for t in range(1, 129) if _on_blocks(scales, t)]
    shown = ", ".join(str(t) for t in working[:12]) + (", ..." if len(working) > 12 else "")
    raise ConfigError(
        f"tensor {scales.weight!r} with shape {list(scales.weight_shape)} cannot be split over "
        f"{world_size} ranks with its block scales {name!r} (shape {list(shape)}): rank {rank} would "
        f"hold its {rows} [{out[0]}, {out[1]}) of dim {dim}, which do not fall on the FP8 blocks of {block} "
        f"{rows} ({scales.source}), so a rank would share a block's scale with another rank. "
        f"Tensor-parallel sizes that cut {scales.weight!r} on block boundaries: {shown or 'none'} "
        f"(rule {scales.weight_action.rule!r})"
    )


def _block_slice(piece: Slice, scales: BlockScales) -> "Slice | tuple[int, int]":
    """The scale's slice for the weight's ``piece``, or the weight's first range off the blocks."""
    dim = scales.weight_action.dim
    assert dim is not None
    length, block = int(scales.weight_shape[dim]), scales.block
    ranges = []
    for start, stop in piece.ranges:
        if start == stop:  # nothing of it (a padded vocabulary's last ranks)
            ranges.append((-(-start // block),) * 2)
        elif start % block or (stop % block and stop != length):
            return start, stop
        else:
            ranges.append((start // block, -(-stop // block)))
    if not piece.padding:
        return Slice(tuple(ranges))
    # Padding rows follow a single range (distload pads one dimension, then splits it evenly): the
    # rank's rows of the padded dimension must be whole blocks; blocks of only padding scale zero.
    pad_to = scales.weight_action.pad_to or 1
    start = piece.ranges[0][0] if piece.ranges else length
    end, padded = start + piece.length, -(-length // pad_to) * pad_to
    if start % block and start != length or end % block and end != padded:
        return start, end
    return Slice(tuple(ranges), -(-end // block) - start // block - sum(b - a for a, b in ranges))


def _on_blocks(scales: BlockScales, world_size: int) -> bool:
    """Whether every rank's slice of the weight at ``world_size`` can be made and is on blocks."""
    try:
        pieces = [rank_slice(scales.weight, scales.weight_shape, scales.weight_action, r, world_size)
                  for r in range(world_size)]
    except ConfigError:
        return False
    return all(p is not None and isinstance(_block_slice(p, scales), Slice) for p in pieces)


def file_shape(shape: Sequence[int], packing: int) -> list[int]:
    """A tensor's shape as its file gives it: a packed dtype's header counts values along the last
    dimension (F4: [r, 2k]), where torch holds elements of ``packing`` values (k float4_e2m1fn_x2)."""
    return list(shape[:-1]) + [shape[-1] * packing] if packing > 1 and len(shape) else list(shape)


def _with_shape(name: str, shape: Sequence[int], action: Action) -> str:
    """``tensor 'x' with shape [...]``, the file's shape (and torch's, where they differ)."""
    if action.packing == 1:
        return f"tensor {name!r} with shape {list(shape)}"
    return (f"tensor {name!r} with shape {file_shape(shape, action.packing)} (in the file; torch holds it "
            f"as {list(shape)}, {action.packing} values packed in one element)")


def _part_range(name: str, shape: Sequence[int], action: Action, part: Part, offset: int,
                rank: int, world_size: int) -> tuple[int, int]:
    units = part.units
    if units % world_size == 0:
        per_rank = part.size // world_size
        return offset + rank * per_rank, offset + (rank + 1) * per_rank
    if part.replicable and world_size % units == 0:
        unit = rank // (world_size // units)  # consecutive ranks share one head, as in vLLM
        return offset + unit * part.unit, offset + (unit + 1) * part.unit
    dim = action.dim
    assert dim is not None
    pack = action.packing if dim == len(shape) - 1 else 1  # values per element along the split
    if part.what == "rows":
        if pack > 1:
            sizes = [shape[dim] * pack] if action.parts is None else [p.size * pack for p in action.parts]
            what = (f"dim {dim} ({sizes[0]} values, {shape[dim]} elements)" if action.parts is None else
                    f"fused parts {sizes} of dim {dim} (in values)")
            why = (f"is not divisible by {world_size}" if any(size % world_size for size in sizes) else
                   f"would be cut between the {pack} values packed in one element")
            raise ConfigError(
                f"{_with_shape(name, shape, action)} cannot be split over {world_size} ranks: {what} {why} "
                f"(rule {action.rule!r})"
            )
        what = f"dim {dim} ({shape[dim]})" if action.parts is None else \
            f"fused parts {[p.size for p in action.parts]} of dim {dim}"
        raise ConfigError(
            f"{_with_shape(name, shape, action)} cannot be split over {world_size} ranks: "
            f"{what} is not divisible by {world_size} (rule {action.rule!r})"
        )
    rule = (f"the number of ranks must divide the {units} {part.what} or be a multiple of it"
            if part.replicable else f"the {units} {part.what} must be divisible by the number of ranks")
    raise ConfigError(
        f"{_with_shape(name, shape, action)} cannot be split over {world_size} ranks: it holds "
        f"{units} {part.what} of {part.unit * pack} {'values' if pack > 1 else 'rows'}, and {rule}, as in "
        f"vLLM (rule {action.rule!r}); choose another tensor-parallel size"
    )


def _padded_slice(name: str, shape: Sequence[int], action: Action, length: int, rank: int,
                  world_size: int) -> Slice:
    pad_to = action.pad_to
    assert pad_to is not None
    padded = -(-length // pad_to) * pad_to
    if padded % world_size:
        raise ConfigError(
            f"{_with_shape(name, shape, action)} cannot be split over {world_size} ranks: dim "
            f"{action.dim} ({length}, padded to a multiple of {pad_to} as vLLM pads a vocabulary: "
            f"{padded}) is not divisible by {world_size} (rule {action.rule!r})"
        )
    per_rank = padded // world_size
    start = min(rank * per_rank, length)
    stop = min(start + per_rank, length) if rank * per_rank < length else start
    return Slice(((start, stop),), per_rank - (stop - start))


def shard_shape(name: str, shape: Sequence[int], action: Action, world_size: int) -> tuple[int, ...]:
    """The shape each rank holds (the same on every rank); raises if the split cannot be made."""
    piece = rank_slice(name, shape, action, 0, world_size)
    if piece is None:
        return tuple(shape)
    for rank in range(1, world_size):  # every rank's split is checked, not only rank 0's
        rank_slice(name, shape, action, rank, world_size)
    return piece.shape(shape, action.dim)  # type: ignore[arg-type]


def take_shard(tensor: torch.Tensor, action: Action, rank: int, world_size: int,
               name: str = "tensor") -> torch.Tensor:
    """Rank ``rank``'s contiguous piece of ``tensor`` under ``action``."""
    piece = rank_slice(name, tuple(tensor.shape), action, rank, world_size)
    if piece is None:
        return tensor.contiguous()
    dim = action.dim
    assert dim is not None
    if piece.rows is not None:  # its experts' rows of dim 0 first, then its ranges of ``dim``
        tensor = torch.cat([tensor[start:stop] for start, stop in piece.rows])
    pieces = [tensor.narrow(dim, start, stop - start) for start, stop in piece.ranges]
    if piece.padding:
        pad_shape = list(tensor.shape)
        pad_shape[dim] = piece.padding
        pieces.append(torch.zeros(pad_shape, dtype=tensor.dtype, device=tensor.device))
    if not pieces:  # a receiver that keeps nothing of it (transfer.Cuts)
        return tensor.narrow(dim, 0, 0).contiguous()
    return pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def reassemble(shards: Sequence[torch.Tensor], action: Action, shape: Sequence[int],
               name: str = "tensor") -> torch.Tensor:
    """The whole tensor of ``shape`` back from every rank's piece (for checks and tests).

    Each rank's ranges are placed where they came from; replicated KV heads are written by every
    rank that holds them (the same bytes), and vocabulary padding is dropped.
    """
    if action.replicated:
        return shards[0]
    dim = action.dim
    assert dim is not None and action.rows is None, "a piece of an EP rank's rows is not the whole tensor's"
    world_size = len(shards)
    out = torch.empty(tuple(shape), dtype=shards[0].dtype, device=shards[0].device)
    for rank, shard in enumerate(shards):
        piece = rank_slice(name, shape, action, rank, world_size)
        assert piece is not None
        offset = 0
        for start, stop in piece.ranges:
            out.narrow(dim, start, stop - start).copy_(shard.narrow(dim, offset, stop - start))
            offset += stop - start
    return out


class RowExtents(Sequence):
    """``count`` extents ``(first + j * row, dst + j * step, length)``: a slice's one range of every
    row, as a sequence that makes each extent only when asked (a 1T checkpoint has 875,000 rows
    of such slices a rank, which a shared read never lists: it plans with the slice's runs)."""

    def __init__(self, first: int, row: int, step: int, length: int, count: int, dst: int = 0):
        self.first, self.row, self.step, self.length, self.count = first, row, step, length, count
        self.dst = dst

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, j):  # type: ignore[override]
        if isinstance(j, slice):
            return tuple(self[i] for i in range(*j.indices(self.count)))
        if j < 0:
            j += self.count
        if not 0 <= j < self.count:
            raise IndexError(j)
        return (self.first + j * self.row, self.dst + j * self.step, self.length)

    def __iter__(self):
        first, row, step, length, dst = self.first, self.row, self.step, self.length, self.dst
        return ((first + j * row, dst + j * step, length) for j in range(self.count))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:  # equal to the tuple of its extents, so hashed as that
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"RowExtents({self.first}, {self.row}, {self.step}, {self.length}, {self.count}, {self.dst})"


class ChainedExtents(Sequence):
    """Several :class:`RowExtents` one after the other, as one sequence (an EP rank's runs of
    experts of a stacked tensor, each a run of rows), made only when asked."""

    def __init__(self, parts: Sequence[RowExtents]):
        self.parts = tuple(parts)
        self.ends = list(itertools.accumulate(len(p) for p in self.parts))

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def __getitem__(self, j):  # type: ignore[override]
        if isinstance(j, slice):
            return tuple(self[i] for i in range(*j.indices(len(self))))
        if j < 0:
            j += len(self)
        if not 0 <= j < len(self):
            raise IndexError(j)
        part = bisect.bisect_right(self.ends, j)
        return self.parts[part][j - (self.ends[part - 1] if part else 0)]

    def __iter__(self):
        return itertools.chain.from_iterable(self.parts)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"ChainedExtents({list(self.parts)!r})"


@dataclass(frozen=True)
class SliceBytes:
    """Rank r's slice of one tensor as byte ranges: what a reader asks the source for.

    ``extents``: ``(source offset, destination offset, length)`` relative to the start of the
    tensor's data in its file and of the rank's piece; contiguous neighbours are merged, so a
    slice along dim 0 is one extent per fused part and a slice along dim d > 0 one per row of
    the dimensions before d. ``zeros``: ``(destination offset, length)`` of padding rows.
    """

    shape: tuple[int, ...]  # the rank's piece
    extents: Sequence[tuple[int, int, int]]  # a tuple, or RowExtents
    zeros: tuple[tuple[int, int], ...] = ()
    # The extents as the exchange plan's runs (shared_reads/plan.py: ``compact(extents)``), where
    # the slice knows them without a pass over its rows (a dim-1 slice: one run): a 1T checkpoint
    # has 875,000 rows of such slices a rank (docs/scale.md). None: compact the extents.
    runs: tuple[tuple[int, int, int, int, int, int], ...] | None = field(default=None, compare=False)

    @property
    def nbytes(self) -> int:
        return self.requested_bytes + sum(length for _, length in self.zeros)

    @property
    def requested_bytes(self) -> int:
        if self.runs is not None:
            return sum(run[2] * run[3] for run in self.runs)
        return sum(length for _, _, length in self.extents)


def slice_bytes(name: str, shape: Sequence[int], itemsize: int, action: Action, rank: int,
                world_size: int) -> SliceBytes | None:
    """The byte ranges of rank ``rank``'s piece of a row-major tensor; None if it is whole."""
    piece = rank_slice(name, shape, action, rank, world_size)
    if piece is None:
        return None
    dim = action.dim
    assert dim is not None
    inner = math.prod(shape[dim + 1:]) * itemsize  # bytes of one index along dim
    length = shape[dim]
    out = piece.shape(shape, dim)
    outers = piece.outer_runs(shape, dim)  # the kept indices of the dims before ``dim``: all, or an EP rank's rows
    count = sum(stop - start for start, stop in outers)
    if count > 1 and len(piece.ranges) == 1:
        # One range of every row (a plain TP slice along dim > 0): rows apart in the source,
        # apart in the destination by the row and its padding, so no two extents merge. Each run
        # of kept rows (an EP rank's experts: one run, linear; one an expert, round robin) is
        # one run of extents, the destination's rows following on.
        start, stop = piece.ranges[0]
        n, row, pad = (stop - start) * inner, length * inner, piece.padding * inner
        if n and (n < row or pad):
            step, at, groups = n + pad, 0, []
            for first, last in outers:
                groups.append((first * row + start * inner, at * step, n, last - first, row, step))
                at += last - first
            extents = [RowExtents(src, row, step, n, rows, dst) for src, dst, _, rows, _, _ in groups]
            return SliceBytes(out, extents[0] if len(extents) == 1 else ChainedExtents(extents),
                              tuple((o * step + n, pad) for o in range(count)) if pad else (), tuple(groups))
    extents: list[tuple[int, int, int]] = []
    zeros: list[tuple[int, int]] = []
    dst = 0
    for first, last in outers:
        for o in range(first, last):
            for start, stop in piece.ranges:
                n = (stop - start) * inner
                if n:
                    src = (o * length + start) * inner
                    if extents and extents[-1][0] + extents[-1][2] == src and extents[-1][1] + extents[-1][2] == dst:
                        prev = extents.pop()
                        extents.append((prev[0], prev[1], prev[2] + n))
                    else:
                        extents.append((src, dst, n))
                dst += n
            if piece.padding:
                zeros.append((dst, piece.padding * inner))
                dst += piece.padding * inner
    return SliceBytes(out, tuple(extents), tuple(zeros))


def block_bytes(shape: Sequence[int], itemsize: int, offsets: Sequence[int], sizes: Sequence[int]) -> SliceBytes:
    """The byte ranges of the block ``[offsets, offsets + sizes)`` of a row-major tensor.

    A DTensor's local shard under ``Shard``/``Replicate`` placements is such a block (on a mesh
    of any rank: FSDP x TP included). The trailing dimensions the block covers whole make one
    run with the first dimension it cuts; every index of the dimensions before gives one extent.
    """
    ndim = len(shape)
    if len(offsets) != ndim or len(sizes) != ndim:
        raise ConfigError(f"a block of a {ndim}-d tensor needs {ndim} offsets and sizes, got {list(offsets)}, {list(sizes)}")
    for dim in range(ndim):
        if offsets[dim] < 0 or sizes[dim] < 0 or offsets[dim] + sizes[dim] > shape[dim]:
            raise ConfigError(f"block offsets {list(offsets)} sizes {list(sizes)} do not lie inside shape {list(shape)}")
    if ndim == 0:
        return SliceBytes((), ((0, 0, itemsize),))
    if 0 in sizes:
        return SliceBytes(tuple(sizes), ())
    strides = [itemsize] * ndim  # bytes per index, row-major
    for dim in range(ndim - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    cut = ndim - 1  # the innermost dimension the block does not cover whole
    while cut > 0 and offsets[cut] == 0 and sizes[cut] == shape[cut]:
        cut -= 1
    run = sizes[cut] * strides[cut]
    base = sum(o * s for o, s in zip(offsets, strides))
    extents = []
    dst = 0
    for index in itertools.product(*(range(n) for n in sizes[:cut])):
        src = base + sum(i * s for i, s in zip(index, strides))
        extents.append((src, dst, run))
        dst += run
    return SliceBytes(tuple(sizes), tuple(extents))
