"""A tensor-parallel rank's slices of a whole checkpoint: which bytes of which tensor it reads.

With a tensor-parallel size T, rank r of the group is TP rank ``r % T`` (vLLM's and Megatron's
order): the T consecutive ranks holding r form its tensor-parallel group, and ranks with the same
TP rank in different groups are data-parallel replicas, which hold the same slices. The sharding
spec (distload/sharding.py) decides each tensor's action, distload/slicing.py the rank's rows;
here they become the byte ranges a reader asks the source for, so that a rank reads its own
slices only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

import torch

from distload.config import is_int
from distload.errors import ConfigError
from distload.loading.index import PACKED, CheckpointIndex
from distload.sharding import ShardingSpec, check_scales, spec_with_config
from distload.slicing import Action, SliceBytes, block_bytes, shard_shape, slice_bytes, take_shard

if TYPE_CHECKING:
    from distload.group import WorkerGroup


@dataclass(frozen=True)
class TensorParallel:
    """Where this rank sits: TP rank ``rank`` of ``size``, and the sharding spec to slice with."""

    size: int
    rank: int
    sharding: str | ShardingSpec | None = None  # None: the decoder spec

    @staticmethod
    def of(group: "WorkerGroup", size: int | None, sharding: str | ShardingSpec | None = None,
           rank: int | None = None) -> "TensorParallel | None":
        """The group's layout for ``size`` (None: no tensor parallelism, unless a spec is given:
        then the whole group is one tensor-parallel group, as ``reload_into`` has always done)."""
        if size is None and sharding is None and rank is None:
            return None
        if size is None:
            size = group.world_size
        if not is_int(size) or size < 1:
            raise ConfigError(f"tensor_parallel_size must be a whole number >= 1, got {size!r}")
        if rank is None:
            if group.world_size % size:
                raise ConfigError(
                    f"--tensor-parallel-size {size} does not divide the group's {group.world_size} ranks: "
                    f"a job holds whole tensor-parallel groups (N = k x T ranks, k data-parallel replicas)")
            rank = group.rank % size
        # An explicit rank is checked by check(), inside the planning step: it may differ by rank,
        # and a rank failing alone before any collective would leave the others waiting.
        return TensorParallel(int(size), rank, sharding)

    def check(self) -> None:
        if not is_int(self.rank) or not 0 <= self.rank < self.size:
            raise ConfigError(f"tensor-parallel rank {self.rank!r} is not in 0..{self.size - 1}")


Block = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of a DTensor's local shard


@dataclass(frozen=True)
class RankSlices:
    """This rank's split tensors and the bytes to read, by tensor name: from a sharding spec's
    actions (tensor parallelism), or from the blocks of DTensor targets (their placements)."""

    spec: ShardingSpec | None
    actions: Mapping[str, Action] = field(default_factory=dict)
    slices: Mapping[str, SliceBytes] = field(default_factory=dict)
    blocks: Mapping[str, Block] = field(default_factory=dict)

    def cut(self, name: str, tensor: torch.Tensor, tp: TensorParallel | None) -> torch.Tensor:
        """This rank's piece of a whole tensor a library reader delivered (the rest is dropped)."""
        action = self.actions.get(name)
        if action is not None:
            assert tp is not None
            return take_shard(tensor, action, tp.rank, tp.size, name)
        block = self.blocks.get(name)
        if block is not None:
            for dim, (offset, size) in enumerate(zip(*block)):
                tensor = tensor.narrow(dim, offset, size)
            return tensor.contiguous()
        return tensor


def plan_blocks(index: CheckpointIndex, blocks: Mapping[str, Block]) -> RankSlices:
    """The byte ranges of each DTensor target's local shard (tensors without a block: whole)."""
    slices = {}
    for info in index.tensors:
        block = blocks.get(info.name)
        if block is None:
            continue
        offsets, sizes = block
        if len(sizes) != len(info.shape) or any(o + n > d for o, n, d in zip(offsets, sizes, info.shape)):
            raise ConfigError(f"tensor {info.name!r} has shape {list(info.shape)} in the checkpoint, but the "
                              f"DTensor's local shard is sizes {list(sizes)} at {list(offsets)}")
        slices[info.name] = block_bytes(info.shape, info.torch_dtype.itemsize, offsets, sizes)
    return RankSlices(None, {}, slices, dict(blocks))


def plan_slices(index: CheckpointIndex, tp: TensorParallel, read_config: Callable[[], Mapping]) -> RankSlices:
    """Every split tensor's slice for this rank; raises naming the tensor when one cannot split.

    Every rank's split is checked (shard_shape checks them all), so all ranks fail alike.
    """
    spec = spec_with_config(tp.sharding, read_config)
    if spec.engine is not None:
        raise ConfigError(
            f"--sharding {spec.name} gives a save vLLM's engine names (fused qkv_proj and gate_up_proj); "
            f"a load or reload keeps the checkpoint's names: use --sharding decoder, the same slices")
    actions: dict[str, Action] = {}
    slices: dict[str, SliceBytes] = {}
    every = [(info, spec.action(info.name, info.shape, PACKED.get(info.dtype, 1))) for info in index.tensors]
    check_scales([(info.name, info.shape, action) for info, action in every])
    for info, action in every:
        if action.replicated:
            continue
        shard_shape(info.name, info.shape, action, tp.size)
        piece = slice_bytes(info.name, info.shape, info.torch_dtype.itemsize, action, tp.rank, tp.size)
        assert piece is not None
        actions[info.name] = action
        slices[info.name] = piece
    return RankSlices(spec, actions, slices)
