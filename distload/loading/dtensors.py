"""A DTensor state dict straight from a checkpoint: each rank reads its local shards' bytes only.

For training jobs (FSDP2, torch's tensor-parallel API, torchtitan-style meshes): given a device
mesh and each tensor's placements, :func:`load_dtensors` is one load, planned once: inside the
planning step the headers give each tensor's shape and dtype, the empty DTensors made from them
give the block of the checkpoint tensor each rank holds (``Shard(d)`` and ``Replicate()`` on a
mesh of any rank), and the reader fills those local shards, in place where it can.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Mapping, Sequence, Union

import torch

from distload.errors import ReloadError
from distload.loading.index import CheckpointIndex
from distload.loading.loader import Loader
from distload.loading.rank_slices import Block
from distload.workers.group import WorkerGroup

Placements = Union[Mapping[str, Sequence[Any]], Callable[[str], Union[Sequence[Any], None]]]


def dtensor_blocks(targets: Mapping[str, torch.Tensor]) -> dict[str, Block]:
    """Name -> (offsets, sizes) of the local shard of each DTensor target (FSDP2, torch's tensor
    parallel API): the block of the checkpoint tensor this rank holds."""
    if "torch.distributed.tensor" not in sys.modules:
        # No DTensor can exist before its module is imported, and importing it costs 0.7 s: the
        # whole of a small in-place reload (benchmarks/results/load.md, "in place").
        return {}
    from torch.distributed.tensor import DTensor, Replicate, Shard

    blocks = {}
    for name, tensor in targets.items():
        if not isinstance(tensor, DTensor):
            continue
        odd = [p for p in tensor.placements if type(p) not in (Shard, Replicate)]
        if odd:
            raise ReloadError(
                f"parameter {name!r} is a DTensor placed as {odd[0]}: distload fills Shard(d) and "
                f"Replicate() placements, whose local shards are blocks of the checkpoint tensor; "
                f"redistribute it to those first"
            )
        chunks = tensor.__create_chunk_list__()  # the protocol torch.distributed.checkpoint uses
        if len(chunks) != 1:
            raise ReloadError(f"parameter {name!r}: a DTensor whose local shard is {len(chunks)} blocks")
        blocks[name] = (tuple(int(x) for x in chunks[0].offsets), tuple(int(x) for x in chunks[0].sizes))
    return blocks


def load_dtensors(source: str, device_mesh: Any, placements: Placements, load_format: str = "auto",
                  extra_config: str | Mapping[str, Any] | None = None, *, group: WorkerGroup | None = None,
                  progress: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of a whole checkpoint as a DTensor on ``device_mesh``, each rank reading only
    its local shards' bytes.

    Args:
        source: a whole checkpoint, as for :func:`load`.
        device_mesh: the mesh the DTensors live on.
        placements: a tensor name's placements (a dict, or a function of the name); a name it
            does not know (or None) is replicated on every mesh dimension. ``Shard(d)`` and
            ``Replicate()`` only.
        load_format: as for :func:`load`.
        extra_config: as for :func:`load`.
        group: collective over it (None: one from the environment); it must hold the mesh's ranks.
        progress: show a progress bar on rank 0.

    Returns:
        Tensor name -> DTensor.
    """
    from torch.distributed.tensor import Replicate, empty

    def placed(name: str) -> tuple[Any, ...]:
        chosen = placements.get(name) if isinstance(placements, Mapping) else placements(name)
        return tuple(chosen) if chosen is not None else (Replicate(),) * device_mesh.ndim

    state: dict[str, torch.Tensor] = {}

    def blocks(index: CheckpointIndex) -> dict[str, Block]:
        # In the planning step, from this rank's headers: the empty DTensors, whose local shards
        # are the bytes this rank reads.
        state.update({t.name: empty(t.shape, dtype=t.torch_dtype, device_mesh=device_mesh, placements=placed(t.name))
                      for t in index.tensors})
        return dtensor_blocks(state)

    with WorkerGroup.for_call(group, device=device_mesh.device_type) as g:
        loader = Loader(source, load_format, extra_config, group=g, progress=progress, blocks=blocks)
        plan = loader.plan()
        local = {name: tensor.to_local().detach() for name, tensor in state.items()}
        stream = loader.stream(plan, destinations=local)
        with torch.no_grad(), contextlib.closing(stream):  # a failed copy tells the other ranks at once
            for name, tensor in stream:
                shard = local[name]
                if not (tensor.data_ptr() == shard.data_ptr() and tensor.shape == shard.shape):
                    shard.copy_(tensor)  # else the reader already put the bytes in place
    return state
