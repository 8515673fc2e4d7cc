"""vLLM's own expert placement on one worker (``--enable-expert-parallel``), read from its layers.

Under vLLM's expert parallelism each worker's mixture-of-experts layers hold only their own
experts, and their weight loaders skip every other expert's tensors. The weight map recorded from
those loaders (distload/vllm/weight_map.py) therefore already takes only this worker's experts;
what it also needs is the placement itself, read from the layers rather than re-derived from
vLLM's rules (which fall back between strategies by model and backend): it goes into the weight
map's cache key (two placements with equal parameter shapes, linear and round robin, must never
share a record) and into the log line that says which experts a worker keeps.

Plain attribute reads: vLLM 0.32 keeps the placement on each layer's ``expert_map_manager``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerExperts:
    """One mixture-of-experts layer's placement: EP ``size`` and ``rank``, the number of experts
    it routes between (``total``), and ``local``: the global expert held in each local slot."""

    layer: str
    size: int
    rank: int
    total: int
    local: tuple[int, ...]


def engine_experts(model: torch.nn.Module) -> list[LayerExperts]:
    """The placement of every mixture-of-experts layer of ``model`` (a vLLM model on this
    worker), in module order; empty for a dense model."""
    out, seen = [], set()
    for name, module in model.named_modules():
        manager = getattr(module, "expert_map_manager", None)
        # A layer's experts and the runner around them share one manager: one entry per manager.
        if manager is None or not hasattr(manager, "ep_size") or id(manager) in seen:
            continue
        seen.add(id(manager))
        total = int(manager.global_num_experts)
        expert_map = manager.expert_map  # global -> local slot, -1 elsewhere; None without EP
        if expert_map is None:
            local = tuple(range(total))
        else:
            slots = expert_map.tolist()[:total]
            local = tuple(sorted((g for g, slot in enumerate(slots) if slot >= 0), key=lambda g: slots[g]))
        out.append(LayerExperts(name, int(manager.ep_size), int(manager.ep_rank), total, local))
    return out


def placement_key(layers: list[LayerExperts]) -> list:
    """What of the placement a weight map depends on, for its cache key (JSON-able)."""
    return [(x.layer, x.size, x.rank, x.total, list(x.local)) for x in layers]


def describe(layers: list[LayerExperts]) -> str | None:
    """One phrase for the log: the experts this worker keeps (None without expert parallelism)."""
    split = [x for x in layers if x.size > 1]
    if not split:
        return None
    kinds = sorted({(x.rank, x.size, x.local, x.total) for x in split})
    if len(kinds) == 1:
        rank, size, local, total = kinds[0]
        where = f"each of its {len(split)} MoE layers" if len(split) > 1 else "its MoE layer"
        return f"EP rank {rank} of {size}, keeping experts {list(local)} of {total} in {where}"
    return "; ".join(f"{x.layer}: EP rank {x.rank} of {x.size}, experts {list(x.local)} of {x.total}" for x in split)
