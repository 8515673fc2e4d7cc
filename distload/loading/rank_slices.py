"""A tensor-parallel rank's slices of a whole checkpoint: which bytes of which tensor it reads.

A rank's place (distload/tp/place.py) says which TP rank (and EP rank) it is; the sharding
spec (distload/tp/spec.py) decides each tensor's action, distload/tp/slices.py the rank's rows;
here they become the byte ranges a reader asks the source for, so that a rank reads its own
slices only. With expert parallelism (distload/tp/experts.py) a rank reads its experts' bytes only:
other ranks' per-expert tensors are empty slices (nothing read) and are dropped from its state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Union

import torch

from distload.errors import ConfigError
from distload.loading.index import PACKED, CheckpointIndex
from distload.tp.place import TPPlace
from distload.tp.experts import cut_experts
from distload.tp.spec import ShardingSpec, carry_block_scales, spec_with_config
from distload.tp.slices import Action, SliceBytes, block_bytes, shard_shape, slice_bytes, take_shard

Block = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of a DTensor's local shard


@dataclass(frozen=True)
class Rows:
    """Runs of whole rows (dim 0), ``(start, stop)`` in ascending order, read one after the other
    as one tensor: what a TP rank needs of a checkpoint tensor that fuses several parts (a fused
    q/k/v: its rows of q, then of k, then of v), where one block would span the other ranks' rows."""

    runs: tuple[tuple[int, int], ...]

    def shape(self, whole: tuple[int, ...]) -> tuple[int, ...]:
        return (sum(stop - start for start, stop in self.runs),) + tuple(whole[1:])


# What a sliced load is given: tensor name -> the block (or rows) it needs, or a function of the
# checkpoint's index that gives them (DTensors made from the headers; a weight map learned there).
Blocks = Union[Mapping[str, "Block | Rows"], Callable[[CheckpointIndex], Mapping[str, "Block | Rows"]]]


@dataclass(frozen=True)
class RankSlices:
    """This rank's split tensors and the bytes to read, by tensor name: from a sharding spec's
    actions (tensor parallelism), or from the blocks of DTensor targets (their placements)."""

    spec: ShardingSpec | None
    actions: Mapping[str, Action] = field(default_factory=dict)
    slices: Mapping[str, SliceBytes] = field(default_factory=dict)
    blocks: Mapping[str, "Block | Rows"] = field(default_factory=dict)
    # Expert parallelism: other ranks' experts' tensors, read as empty slices and left out of
    # this rank's state.
    dropped: frozenset[str] = frozenset()

    def cut(self, name: str, tensor: torch.Tensor, tp: TPPlace | None) -> torch.Tensor:
        """This rank's piece of a whole tensor a library reader delivered (the rest is dropped)."""
        action = self.actions.get(name)
        if action is not None:
            assert tp is not None
            return _own_storage(take_shard(tensor, action, tp.rank, tp.size, name))
        block = self.blocks.get(name)
        if isinstance(block, Rows):
            return torch.cat([tensor[start:stop] for start, stop in block.runs])
        if block is not None:
            for dim, (offset, size) in enumerate(zip(*block)):
                tensor = tensor.narrow(dim, offset, size)
            return _own_storage(tensor.contiguous())
        return tensor


def _own_storage(piece: torch.Tensor) -> torch.Tensor:
    """``piece`` in memory of its own size: a leading range along dim 0 is a contiguous view,
    and would keep the whole tensor's storage (all of it, on every rank) alive with it."""
    if piece.untyped_storage().nbytes() != piece.numel() * piece.element_size():
        return piece.clone()
    return piece


def plan_blocks(index: CheckpointIndex, blocks: Mapping[str, "Block | Rows"]) -> RankSlices:
    """The byte ranges of each block (a DTensor target's local shard) or rows (tensors without
    either: whole)."""
    slices = {}
    for info in index.tensors:
        block = blocks.get(info.name)
        if block is None:
            continue
        if isinstance(block, Rows):
            slices[info.name] = _rows_bytes(info.name, info.shape, info.torch_dtype.itemsize, block)
            continue
        offsets, sizes = block
        if len(sizes) != len(info.shape) or any(o + n > d for o, n, d in zip(offsets, sizes, info.shape)):
            raise ConfigError(f"tensor {info.name!r} has shape {list(info.shape)} in the checkpoint, but the "
                              f"DTensor's local shard is sizes {list(sizes)} at {list(offsets)}")
        slices[info.name] = block_bytes(info.shape, info.torch_dtype.itemsize, offsets, sizes)
    return RankSlices(None, {}, slices, dict(blocks))


def _rows_bytes(name: str, shape: tuple[int, ...], itemsize: int, rows: Rows) -> SliceBytes:
    at = 0
    for start, stop in rows.runs:
        if not (shape and at <= start < stop <= shape[0]):
            raise ConfigError(f"tensor {name!r} has shape {list(shape)}: rows {list(rows.runs)} are not ascending, "
                              f"disjoint runs inside it")
        at = stop
    row = itemsize
    for n in shape[1:]:
        row *= n
    extents, dst = [], 0
    for start, stop in rows.runs:
        extents.append((start * row, dst, (stop - start) * row))
        dst += (stop - start) * row
    return SliceBytes(rows.shape(shape), tuple(extents))


def plan_slices(index: CheckpointIndex, tp: TPPlace, read_config: Callable[[], Mapping]) -> RankSlices:
    """Every split tensor's slice for this rank; raises naming the tensor when one cannot split.

    Every rank's split is checked (shard_shape checks them all), so all ranks fail alike.
    """
    spec = spec_with_config(tp.spec, read_config)
    if spec.engine is not None:
        raise ConfigError(
            f"--sharding {spec.name} gives a save vLLM's engine names (fused qkv_proj and gate_up_proj); "
            f"a load or reload keeps the checkpoint's names: use --sharding decoder, the same slices")
    actions: dict[str, Action] = {}
    slices: dict[str, SliceBytes] = {}
    every = [(info, spec.action(info.name, info.shape, PACKED.get(info.dtype, 1))) for info in index.tensors]
    # A split weight's FP8 block scales go with it, cut on its blocks (refused off them).
    carried = carry_block_scales([(info.name, info.shape, action) for info, action in every], read_config)
    dropped: frozenset[str] = frozenset()
    if tp.experts is not None:  # a rank's experts' rows of stacked tensors; other experts' tensors dropped
        cut = cut_experts([(info.name, info.shape, carried[info.name]) for info, _ in every], tp.experts,
                          read_config())
        carried, dropped = dict(cut.actions), cut.dropped
    every = [(info, carried[info.name]) for info, _ in every]
    for info, action in every:
        if action.replicated:
            continue
        shard_shape(info.name, info.shape, action, tp.size)
        piece = slice_bytes(info.name, info.shape, info.torch_dtype.itemsize, action, tp.rank, tp.size)
        assert piece is not None
        actions[info.name] = action
        slices[info.name] = piece
    if tp.size > 1 and tp.experts is None and every and all(action.rule is None for _, action in every):
        # Else every rank would hold every tensor whole and the load would look like a TP load.
        # (A spec whose rules replicate a tensor, as "replicate" does, says so on purpose.)
        names = ", ".join(repr(info.name) for info, _ in every[:3])
        raise ConfigError(f"--tensor-parallel-size {tp.size}: sharding spec {spec.name!r} splits none of this "
                          f"checkpoint's {len(every)} tensors (it knows none of their names, such as {names}), so "
                          f"every rank would hold them all whole. Give a sharding spec for these names (--sharding "
                          f"with a JSON spec), or load without --tensor-parallel-size")
    return RankSlices(spec, actions, slices, dropped=dropped)
