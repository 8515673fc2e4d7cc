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
from typing import TYPE_CHECKING, Mapping

import torch

from distload.config import is_int
from distload.errors import ConfigError
from distload.loading.index import CheckpointIndex
from distload.sharding import ShardingSpec, load_spec
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
        elif not is_int(rank) or not 0 <= rank < size:
            raise ConfigError(f"tensor-parallel rank {rank!r} is not in 0..{size - 1}")
        return TensorParallel(int(size), int(rank), sharding)

    @property
    def describe(self) -> str:
        return f"TP rank {self.rank} of {self.size}"


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


def plan_slices(index: CheckpointIndex, tp: TensorParallel, model_config: Mapping) -> RankSlices:
    """Every split tensor's slice for this rank; raises naming the tensor when one cannot split.

    Every rank's split is checked (shard_shape checks them all), so all ranks fail alike.
    """
    spec = tp.sharding if isinstance(tp.sharding, ShardingSpec) else load_spec(tp.sharding, model_config)
    actions: dict[str, Action] = {}
    slices: dict[str, SliceBytes] = {}
    for info in index.tensors:
        action = spec.action(info.name, info.shape)
        if action.replicated:
            continue
        shard_shape(info.name, info.shape, action, tp.size)
        piece = slice_bytes(info.name, info.shape, info.torch_dtype.itemsize, action, tp.rank, tp.size)
        assert piece is not None
        actions[info.name] = action
        slices[info.name] = piece
    return RankSlices(spec, actions, slices)
