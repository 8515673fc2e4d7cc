"""Expert parallelism as pure data: which routed experts an expert-parallel (EP) rank holds, and
what that makes of each tensor of a mixture-of-experts checkpoint.

Placement is vLLM's (``determine_expert_map``, ``compute_local_expert_ids``), under its option
names (``--expert-placement-strategy``):

- ``linear`` (the default): EP rank r holds a contiguous run of experts, ``E / EP`` of them
  (vLLM gives the first ``E % EP`` ranks one more; distload refuses an EP size that does not
  divide E, so every rank holds the same shapes);
- ``round_robin``: EP rank r holds experts r, r + EP, r + 2 EP, ...

Two layouts of routed experts are known:

- per expert, the expert id in the name (``mlp.experts.7.gate_proj.weight``, Mixtral's
  ``block_sparse_moe.experts.7.w1.weight``, their FP8 ``weight_scale_inv``): a rank keeps its
  experts' tensors (TP-sliced as the sharding spec says) and none of the others;
- stacked, one row per expert along dim 0 (vLLM's ``experts.w13_weight`` [E, 2I, H] and
  ``experts.w2_weight`` [E, H, I], their scales [E, ...]): a rank keeps its experts' rows, and
  of each its TP slice where the sharding spec splits the stack along a later dim.

Everything else (attention, dense MLPs, shared experts, the router ``mlp.gate``) is the
tensor-parallel spec's business. Pure: no I/O, no torch.distributed; the weight sync's pairing
can ask it what any rank holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Mapping, Sequence

from distload.config import is_int
from distload.errors import ConfigError
from distload.tp.slices import Action

PLACEMENTS = ("linear", "round_robin")  # vLLM's ExpertPlacementStrategy, its default first
# vLLM's ep_weight_filter: a per-expert tensor names its expert; a stacked one has no number there.
# (Pattern strings: re caches them compiled.)
_EXPERT_ID = r"\.experts\.(\d+)\."
_STACKED = r"\.(?:routed_)?experts\.[A-Za-z_][^.]*$"  # vLLM 0.32: mlp.experts.routed_experts.w13_weight
# Where config.json gives the number of routed experts, in vLLM's order (get_num_experts): Qwen-MoE
# and Jamba, Dbrx, DeepSeek, Mixtral (and transformers 5's Qwen3-MoE).
EXPERT_COUNT_KEYS = ("num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts")


@dataclass(frozen=True)
class ExpertPlace:
    """Where a rank sits in expert parallelism: EP rank ``rank`` of ``size``, experts placed by
    ``placement`` (``linear`` or ``round_robin``)."""

    size: int = 1
    rank: int = 0
    placement: str = "linear"
    # The model's routed experts, where known beforehand (a weight-sync receiver's, from its
    # config.json: a trainer rank's tensors name only some of them); None: counted at load.
    num_experts: int | None = None

    def check(self) -> None:
        if not is_int(self.size) or self.size < 1:
            raise ConfigError(f"--expert-parallel-size must be a whole number >= 1, got {self.size!r}")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"--expert-placement-strategy {self.placement!r} is not one of {', '.join(PLACEMENTS)} "
                              f"(vLLM's names)")
        if not is_int(self.rank) or not 0 <= self.rank < self.size:
            raise ConfigError(f"expert-parallel rank {self.rank!r} is not in 0..{self.size - 1}")

    def experts(self, num_experts: int) -> tuple[int, ...]:
        """The global ids of the experts this rank holds, ascending."""
        return local_experts(num_experts, self.size, self.rank, self.placement)


def local_experts(num_experts: int, size: int, rank: int, placement: str = "linear") -> tuple[int, ...]:
    """The experts EP rank ``rank`` of ``size`` holds, as vLLM places them (uneven counts too)."""
    if placement == "linear":
        base, extra = divmod(num_experts, size)
        start = rank * base + min(rank, extra)
        return tuple(range(start, start + base + (rank < extra)))
    if placement == "round_robin":
        return tuple(range(rank, num_experts, size))
    raise ConfigError(f"--expert-placement-strategy {placement!r} is not one of {', '.join(PLACEMENTS)}")


def expert_id(name: str) -> int | None:
    """The routed expert a per-expert tensor belongs to (None: not a per-expert tensor)."""
    found = re.search(_EXPERT_ID, name)
    return int(found.group(1)) if found else None


def is_stacked(name: str, shape: Sequence[int], num_experts: int) -> bool:
    """A tensor of every expert stacked along dim 0 (``experts.w13_weight`` [E, 2I, H])."""
    return bool(re.search(_STACKED, name)) and len(shape) >= 1 and int(shape[0]) == num_experts


def config_experts(config: Mapping[str, Any]) -> tuple[int, str] | None:
    """The number of routed experts config.json gives, and under which key (None: it gives none)."""
    for where in (config, config.get("text_config")):
        if isinstance(where, Mapping):
            for key in EXPERT_COUNT_KEYS:
                value = where.get(key)
                if is_int(value) and value > 0:
                    return int(value), key
    return None


def num_experts(tensors: Sequence[tuple[str, Sequence[int]]], config: Mapping[str, Any], ep_size: int) -> int:
    """The number of routed experts, from config.json (checked against the names) or the names;
    refused where there are none (a dense model) or ``ep_size`` does not divide them."""
    ids = {i for i in (expert_id(name) for name, _ in tensors) if i is not None}
    given = config_experts(config)
    if given is not None:
        count, key = given
        if ids and max(ids) >= count:
            raise ConfigError(f"--expert-parallel-size {ep_size}: the checkpoint names expert {max(ids)}, but "
                              f"config.json's {key} is {count}; fix config.json")
        where = f"config.json's {key}"
    elif ids:
        count, where = max(ids) + 1, "the tensor names (config.json gives no expert count)"
    else:  # stacked tensors alone: their rows, where they agree
        rows = {int(shape[0]) for name, shape in tensors if re.search(_STACKED, name) and len(shape) >= 1}
        count, where = (rows.pop(), "the stacked tensors' rows (config.json gives no expert count)") \
            if len(rows) == 1 else (0, "")
    if not ids and not any(is_stacked(name, shape, count) for name, shape in tensors if count):
        example = ", ".join(repr(name) for name, _ in tensors[:2])
        raise ConfigError(
            f"--expert-parallel-size {ep_size}: this checkpoint has no routed experts (no tensor named "
            f"'*.experts.N.*', nor one stacked per expert as '*.experts.w13_weight'; such as {example}): a dense "
            f"model. Load it without --expert-parallel-size (--tensor-parallel-size splits a dense model)")
    if count % ep_size:
        working = [n for n in range(1, count + 1) if count % n == 0]
        raise ConfigError(
            f"--expert-parallel-size {ep_size} does not divide the model's {count} routed experts ({where}), "
            f"so ranks would hold different numbers of experts; expert-parallel sizes that divide them: "
            f"{', '.join(map(str, working))}")
    return count


@dataclass(frozen=True)
class ExpertCut:
    """One EP rank's actions on a checkpoint: every tensor's, with its experts' rows of stacked
    tensors, and the per-expert tensors of other ranks' experts (``dropped``: read nothing of
    them, not in the rank's state)."""

    actions: Mapping[str, Action]
    dropped: frozenset[str]
    experts: tuple[int, ...]
    num_experts: int


def cut_experts(tensors: Sequence[tuple[str, Sequence[int], Action]], place: ExpertPlace,
                config: Mapping[str, Any]) -> ExpertCut:
    """The EP rank's actions, from the tensor-parallel ones (``tensors``: name, torch shape, the
    spec's action with block scales carried; distload/tp/spec.py): :func:`expert_action`'s."""
    place.check()
    if place.size == 1:  # every expert on every rank: nothing to place, a dense model included
        return ExpertCut({name: action for name, _, action in tensors}, frozenset(), (), 0)
    count = num_experts([(name, shape) for name, shape, _ in tensors], config, place.size)
    mine = place.experts(count)
    actions: dict[str, Action] = {}
    dropped = set()
    for name, shape, action in tensors:
        actions[name], gone = expert_action(name, shape, action, place, count)
        if gone:
            dropped.add(name)
    return ExpertCut(actions, frozenset(dropped), mine, count)


def expert_action(name: str, shape: Sequence[int], action: Action, place: ExpertPlace, count: int
                  ) -> tuple[Action, bool]:
    """One tensor's action on EP rank ``place`` of a model with ``count`` routed experts, from its
    tensor-parallel action: (the action, whether the tensor is another rank's expert: dropped).

    A per-expert tensor of another rank's expert becomes an empty cut of dim 0 (0-d ones are
    read whole, a few bytes) and is dropped; a stacked tensor keeps its experts' rows of dim 0,
    each split along a later dim where the sharding spec splits it there too (its TP slice of
    each of its experts: the action's ``rows``). A spec that splits a stack along dim 0, its
    experts, is refused: expert parallelism cuts that dimension."""
    eid = expert_id(name)
    if eid is not None:
        if not others_expert(name, place, count):
            return action, False
        return (Action(0, None, _rule(place), ranges=()) if len(shape) else action), True
    _, rows = _placed(count, place.size, place.rank, place.placement)
    if is_stacked(name, shape, count) and place.size > 1:
        if action.replicated:
            return Action(0, None, _rule(place), ranges=rows), False
        if action.dim == 0 or action.ranges is not None:
            cut = f"along dim {action.dim}" if action.dim == 0 else f"to the ranges {list(action.ranges or ())}"
            raise ConfigError(
                f"tensor {name!r} (shape {list(shape)}) stacks all {count} experts along dim 0, which expert "
                f"parallelism cuts by expert (--expert-parallel-size {place.size}); the sharding spec also cuts it "
                f"{cut} (rule {action.rule!r}), through the experts. Split a stacked expert tensor along a later "
                f"dim (vLLM's w13_weight [E, 2I, H] along dim 1, w2_weight [E, H, I] along dim 2), or drop that rule")
        return replace(action, rows=rows), False
    return action, False


def others_expert(name: str, place: ExpertPlace, count: int) -> bool:
    """Whether ``name`` is a per-expert tensor of another EP rank's expert (dropped by
    :func:`expert_action`, whatever its action: a weight sync asks this first and skips the
    sharding rules for it)."""
    eid = expert_id(name)
    return eid is not None and eid not in _placed(count, place.size, place.rank, place.placement)[0]


def _rule(place: ExpertPlace) -> str:
    return f"expert parallelism: EP rank {place.rank} of {place.size}, {place.placement}"


@lru_cache(maxsize=1024)
def _placed(count: int, size: int, rank: int, placement: str) -> tuple[frozenset[int], tuple[tuple[int, int], ...]]:
    """The experts an EP rank holds, as a set and as runs of rows (asked once per tensor: cached)."""
    mine = local_experts(count, size, rank, placement)
    return frozenset(mine), _runs(mine)


def _runs(ids: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Ascending ids as [start, stop) runs: linear placement is one run, round robin one per expert."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return tuple((a, b) for a, b in runs)
