"""A DTensor state dict straight from a checkpoint: each rank reads its local shards' bytes only.

For training jobs (FSDP2, torch's tensor-parallel API, torchtitan-style meshes): given a device
mesh and each tensor's placements, :func:`load_dtensors` makes empty DTensors from the headers
and fills them with ``reload_into``, which reads every local shard as a block of the checkpoint
tensor (``Shard(d)`` and ``Replicate()`` on a mesh of any rank).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence, Union

import torch

from distload.workers.group import WorkerGroup
from distload.live.reload import reload_into
from distload.loading.loader import Loader

Placements = Union[Mapping[str, Sequence[Any]], Callable[[str], Union[Sequence[Any], None]]]


def load_dtensors(source: str, device_mesh: Any, placements: Placements, load_format: str = "auto",
                  extra_config: str | Mapping[str, Any] | None = None, *, group: WorkerGroup | None = None,
                  progress: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of a whole checkpoint as a DTensor on ``device_mesh``.

    ``placements``: a tensor name's placements (a dict, or a function of the name); a name it
    does not know (or None) is replicated on every mesh dimension. Collective over ``group``
    (None: one from the environment), which must hold the mesh's ranks.
    """
    from torch.distributed.tensor import Replicate, empty

    def placed(name: str) -> tuple[Any, ...]:
        chosen = placements.get(name) if isinstance(placements, Mapping) else placements(name)
        return tuple(chosen) if chosen is not None else (Replicate(),) * device_mesh.ndim

    with WorkerGroup.for_call(group, device=device_mesh.device_type) as g:
        plan = Loader(source, load_format, extra_config, group=g).plan()
        state = {t.name: empty(t.shape, dtype=t.torch_dtype, device_mesh=device_mesh, placements=placed(t.name))
                 for t in plan.index.tensors}
        reload_into(state, source, load_format, extra_config, group=g, progress=progress)
    return state
