"""DTensor targets loaded from a running job: each rank receives only its local shards.

A training job (FSDP2, torch's tensor-parallel API) that takes its weights from a server
(``distload serve``, a WeightServer) rather than from files. On a 1-D device mesh over the loading
group (mesh coordinate r on group rank r), each tensor's placement, ``Shard(d)`` or
``Replicate()``, becomes one rule of a sharding spec: split along d into the mesh's size equal
parts, or whole. The load from the server is then the channel's tensor-parallel receive at the
mesh's size (rank r gets TP rank r's slices: its local shard, and nothing else over the wire), and
each DTensor is made around the shard it received (``DTensor.from_local``: no copy, no collective).

A dimension the mesh's size does not divide is refused (torch would cut it unevenly, the channel
evenly); so is a mesh of more dimensions, or one whose ranks are not the group's, in order.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from distload.errors import ConfigError
from distload.live.from_server import load_from_server
from distload.loading.loader import LoadResult
from distload.tp.spec import Rule, ShardingSpec
from distload.workers.group import WorkerGroup


def placements_spec(placements: Mapping[str, Sequence[Any]]) -> ShardingSpec:
    """The sharding spec that gives every tensor its placement's local shard on a 1-D mesh (a name
    not in ``placements`` is replicated)."""
    from torch.distributed.tensor import Replicate, Shard

    rules = []
    for name, chosen in placements.items():
        chosen = tuple(chosen)
        if len(chosen) != 1:
            raise ConfigError(f"tensor {name!r}: {len(chosen)} placement(s) {list(chosen)}; loading DTensors from a "
                              f"server takes a 1-D device mesh, so one placement each")
        placement = chosen[0]
        pattern = _literal(name)
        if isinstance(placement, Shard):
            if placement.dim < 0:
                raise ConfigError(f"tensor {name!r}: placement {placement!r}; give the dimension it shards counted "
                                  f"from 0 (the tensor's shape arrives from the server only)")
            rules.append(Rule(pattern, split=placement.dim))
        elif isinstance(placement, Replicate):
            rules.append(Rule(pattern))
        else:
            raise ConfigError(f"tensor {name!r} is placed as {placement!r}: distload fills Shard(d) and Replicate() "
                              f"placements, whose local shards are blocks of the served tensor")
    rules.append(Rule("*"))  # every other tensor whole on every rank
    return ShardingSpec("dtensor placements", tuple(rules))


def _literal(name: str) -> str:
    """A rule pattern that matches ``name`` alone (fnmatch's wildcards taken literally)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def load_dtensors_from_server(address: str, device_mesh: Any, placements: Mapping[str, Sequence[Any]], *,
                              group: WorkerGroup | None = None, timeout_s: float | None = None,
                              digest: bool = False, gather: bool = True, secret_file: str | None = None) -> LoadResult:
    """Every tensor a server at ``address`` holds, as a DTensor on ``device_mesh``, each rank
    receiving only its local shard.

    Args:
        address: the server's ``tcp://HOST:PORT``.
        device_mesh: a 1-D mesh over the group's ranks, in order.
        placements: tensor name -> its placements (one: ``Shard(d)`` or ``Replicate()``); a name
            it does not hold is replicated. A dict: the server's names arrive with its tensors.
        group: collective over it (None: one from the environment).
        timeout_s, digest, gather, secret_file: as for :func:`load_from_server` (the digest is of
            the local shards: what this rank received).

    Returns:
        The DTensors by name as the result's state, this rank's report (``server_bytes``: what
        it received, its local shards) and with ``gather`` the job's.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(placements, Mapping):
        raise ConfigError(f"placements must be a dict of tensor name -> placements to load DTensors from a server "
                          f"(its tensor names arrive with its tensors), got {type(placements).__name__}")
    spec = placements_spec(placements)
    with WorkerGroup.for_call(group, device=device_mesh.device_type) as g:
        ranks = [int(r) for r in device_mesh.mesh.flatten().tolist()]
        if device_mesh.ndim != 1 or ranks != list(g.ranks):
            raise ConfigError(f"loading DTensors from a server takes a 1-D device mesh over the loading group's ranks "
                              f"{list(g.ranks)} in order; got a {device_mesh.ndim}-D mesh of ranks {ranks}")
        size = device_mesh.size()
        loaded = load_from_server(address, group=g, tensor_parallel_size=size, sharding=spec, timeout_s=timeout_s,
                                  digest=digest, gather=gather, secret_file=secret_file)
        out = {}
        for name, local in loaded.state.items():
            placement = tuple(placements.get(name) or (Replicate(),))
            shape = list(local.shape)
            if isinstance(placement[0], Shard):
                shape[placement[0].dim] *= size
            out[name] = DTensor.from_local(local, device_mesh, placement, run_check=False, shape=torch.Size(shape),
                                           stride=_contiguous_stride(shape))
        unknown = sorted(set(placements) - set(out))
        if unknown:
            raise ConfigError(f"placements name {len(unknown)} tensor(s) the server at {address} does not hold: "
                              f"{', '.join(unknown[:5])}")
        return LoadResult(out, loaded.rank_report, loaded.report)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= max(1, n)
    return tuple(reversed(stride))


__all__ = ["load_dtensors_from_server", "placements_spec"]
