"""Where a rank sits in tensor parallelism: one type for loads, reloads and weight sync.

With a tensor-parallel size T, rank r of a group is TP rank ``r % T`` (vLLM's and Megatron's
order): the T consecutive ranks holding r form its tensor-parallel group, and ranks with the same
TP rank in different groups are data-parallel replicas, which hold the same slices. Public
keywords spell it as vLLM does (``tensor_parallel_size``, ``tensor_parallel_rank``); the type
calls them ``size`` and ``rank``.

With expert parallelism too (an EP size P, distload/tp/experts.py), the job's ranks are
T x P x k: rank r is TP rank ``r % T`` and EP rank ``(r // T) % P``. The T ranks of one EP rank
hold the same experts, each of them TP-sliced between those T ranks as the spec slices a dense
MLP (Megatron's expert tensor parallelism); attention, dense MLPs and shared experts are sliced
by TP rank alone. Saved per rank, that is shard ``ep_rank * T + tp_rank`` of T x P.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from distload.config import is_int
from distload.errors import ConfigError, on_every_rank
from distload.tp.experts import ExpertPlace
from distload.tp.spec import ShardingSpec

if TYPE_CHECKING:
    from distload.workers.group import WorkerGroup


@dataclass(frozen=True)
class TPPlace:
    """Where a rank sits in its tensor-parallel group: TP rank ``rank`` of ``size``, and the sharding
    spec that says what it keeps of each tensor. The default is a whole model (size 1)."""

    size: int = 1
    rank: int = 0
    spec: str | ShardingSpec | None = None  # a built-in name, a file, a spec; None: the decoder spec
    experts: ExpertPlace | None = None  # expert parallelism: this rank's EP rank and the placement

    @staticmethod
    def of(group: "WorkerGroup", size: int | None, spec: str | ShardingSpec | None = None,
           rank: int | None = None, expert_parallel_size: int | None = None,
           expert_placement_strategy: str | None = None, expert_parallel_rank: int | None = None,
           ) -> "TPPlace | None":
        """The group's layout for ``size`` (None: no tensor parallelism, unless a spec is given:
        then the whole group is one tensor-parallel group, as ``reload_into`` has always done).
        With ``expert_parallel_size`` P: the ranks are T x P x k (module docstring)."""
        if expert_parallel_size is None and (expert_placement_strategy is not None or expert_parallel_rank is not None):
            raise ConfigError("--expert-placement-strategy places experts over --expert-parallel-size ranks; "
                              "give --expert-parallel-size too")
        if size is None and spec is None and rank is None and expert_parallel_size is None:
            return None
        experts = None
        if expert_parallel_size is not None:
            experts = ExpertPlace(expert_parallel_size, 0, expert_placement_strategy or "linear")
            experts.check()
            if size is None:
                size = 1  # experts whole on each EP rank, everything else whole on every rank
            if experts.size == 1:  # every expert on every rank: no expert parallelism
                experts = None
        if size is None:
            size = group.world_size
        if not is_int(size) or size < 1:
            raise ConfigError(f"tensor_parallel_size must be a whole number >= 1, got {size!r}")
        ep = experts.size if experts is not None else 1
        if rank is None:
            if group.world_size % (size * ep):
                what = (f"--tensor-parallel-size {size} x --expert-parallel-size {ep} ({size * ep})" if experts
                        else f"--tensor-parallel-size {size}")
                groups = "tensor-parallel groups (N = k x T ranks, k data-parallel replicas)" if not experts else \
                    "expert-parallel groups of tensor-parallel groups (N = k x T x P ranks)"
                raise on_every_rank(ConfigError(
                    f"{what} does not divide the group's {group.world_size} ranks: a job holds whole {groups}"))
            rank = group.rank % size
        if experts is not None:
            if expert_parallel_rank is None:
                expert_parallel_rank = (group.rank // size) % ep
            experts = ExpertPlace(ep, expert_parallel_rank, experts.placement)
        # An explicit rank is checked by check(), inside the planning step: it may differ by rank,
        # and a rank failing alone before any collective would leave the others waiting.
        return TPPlace(int(size), rank, spec, experts)

    @property
    def shard_rank(self) -> int:
        """Which rank's files of a checkpoint saved per rank this rank reads (TP x EP shards)."""
        return self.rank + (self.experts.rank * self.size if self.experts is not None else 0)

    @property
    def shard_count(self) -> int:
        """How many ranks' files such a checkpoint holds: T, or T x P with expert parallelism."""
        return self.size * (self.experts.size if self.experts is not None else 1)

    def check(self) -> None:
        if not is_int(self.rank) or not 0 <= self.rank < self.size:
            raise ConfigError(f"tensor-parallel rank {self.rank!r} is not in 0..{self.size - 1}")
        if self.experts is not None:
            self.experts.check()
