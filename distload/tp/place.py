"""Where a rank sits in tensor parallelism: one type for loads, reloads and weight sync.

With a tensor-parallel size T, rank r of a group is TP rank ``r % T`` (vLLM's and Megatron's
order): the T consecutive ranks holding r form its tensor-parallel group, and ranks with the same
TP rank in different groups are data-parallel replicas, which hold the same slices. Public
keywords spell it as vLLM does (``tensor_parallel_size``, ``tensor_parallel_rank``); the type
calls them ``size`` and ``rank``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from distload.config import is_int
from distload.errors import ConfigError, on_every_rank
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

    @staticmethod
    def of(group: "WorkerGroup", size: int | None, spec: str | ShardingSpec | None = None,
           rank: int | None = None) -> "TPPlace | None":
        """The group's layout for ``size`` (None: no tensor parallelism, unless a spec is given:
        then the whole group is one tensor-parallel group, as ``reload_into`` has always done)."""
        if size is None and spec is None and rank is None:
            return None
        if size is None:
            size = group.world_size
        if not is_int(size) or size < 1:
            raise ConfigError(f"tensor_parallel_size must be a whole number >= 1, got {size!r}")
        if rank is None:
            if group.world_size % size:
                raise on_every_rank(ConfigError(
                    f"--tensor-parallel-size {size} does not divide the group's {group.world_size} ranks: "
                    f"a job holds whole tensor-parallel groups (N = k x T ranks, k data-parallel replicas)"))
            rank = group.rank % size
        # An explicit rank is checked by check(), inside the planning step: it may differ by rank,
        # and a rank failing alone before any collective would leave the others waiting.
        return TPPlace(int(size), rank, spec)

    def check(self) -> None:
        if not is_int(self.rank) or not 0 <= self.rank < self.size:
            raise ConfigError(f"tensor-parallel rank {self.rank!r} is not in 0..{self.size - 1}")
