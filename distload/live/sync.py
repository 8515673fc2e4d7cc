"""Weight sync inside one job: some ranks of the job push, the others receive in place.

:class:`WeightSync` is the weight-sync channel (distload/live/channel.py: metadata and agreement
through a store, data point to point, versioned, all-or-nothing, verified; after the first
update only what changed: distload/live/delta.py) run over
the job's own rendezvous store, with the job's ranks as its members. Two separately launched
jobs use :class:`~distload.live.channel.SyncChannel` with a ``tcp://`` address instead.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch.distributed import PrefixStore

from distload.errors import ConfigError, SyncError
from distload.workers.group import WorkerGroup
from distload.live.channel import DEFAULT_BUCKET_BYTES, SyncChannel, SyncStats
from distload.runtime import RUNTIME
from distload.tp.spec import ShardingSpec

__all__ = ["WeightSync", "SyncStats", "SyncError", "DEFAULT_BUCKET_BYTES"]

class WeightSync:
    """Push state dicts from sender ranks to receiver ranks of one job, in place, versioned.

    ``senders`` and ``receivers`` (default: every other rank) are ranks of ``group`` (None: a
    group from the environment, owned by this object and closed by :meth:`close`). Construct it
    on every rank of the group, in the same order as the job's other WeightSyncs; then for each
    update every sender calls :meth:`push` and every receiver :meth:`receive`. With several
    senders each pushes its own part (disjoint names, or the same DTensors) and a receiver takes
    all of them before its version advances. Receivers may keep tensor-parallel slices
    (``tensor_parallel_size``, ``sharding``, ``model_config``: receiver i keeps TP rank
    ``i % T``). ``delta``, ``max_base_bytes``, ``verify`` and ``transport`` are SyncChannel's: senders send
    what changed since the version every receiver holds, checked; ``verify`` checks full updates
    too. Timeouts and devices are the group's.
    """

    def __init__(self, senders: Sequence[int], receivers: Sequence[int] | None = None, *,
                 group: WorkerGroup | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 verify: bool = True, delta: bool = True, max_base_bytes: int | None = None,
                 transport: str = "auto", tensor_parallel_size: int = 1,
                 sharding: str | ShardingSpec | None = None, model_config: Mapping[str, Any] | str | None = None):
        self._own_group = group is None
        self.group = WorkerGroup() if group is None else group
        self._channel: SyncChannel | None = None
        try:
            self._setup(senders, receivers, bucket_bytes, verify, tensor_parallel_size, sharding, model_config,
                        {"delta": delta, "max_base_bytes": max_base_bytes, "transport": transport})
        except BaseException:
            self.close()
            raise

    def _setup(self, senders: Sequence[int], receivers: Sequence[int] | None, bucket_bytes: int, verify: bool,
               tensor_parallel_size: int, sharding: Any, model_config: Any, deltas: dict[str, Any]) -> None:
        group = self.group
        world = group.world_size
        if world < 2:
            raise ConfigError("WeightSync needs at least two ranks (a sender and a receiver); start the "
                              "job with torchrun or srun, or pass a WorkerGroup of several ranks")
        self.rank = group.rank
        self.senders = sorted(set(senders))
        self.receivers = sorted(set(receivers) if receivers is not None
                                else set(range(world)) - set(self.senders))
        if not self.senders or not self.receivers or set(self.senders) & set(self.receivers):
            raise ConfigError(f"senders {self.senders} and receivers {self.receivers} must be non-empty "
                              f"and disjoint")
        if any(r < 0 or r >= world for r in self.senders + self.receivers):
            raise ConfigError(f"ranks must be in [0, {world}), got senders {self.senders}, receivers {self.receivers}")
        from torch.distributed import distributed_c10d

        with RUNTIME.lock:  # the n-th WeightSync of every rank meets the others' n-th
            number, RUNTIME.weight_syncs = RUNTIME.weight_syncs, RUNTIME.weight_syncs + 1
        ranks = "-".join(map(str, group.ranks))
        store = PrefixStore(f"distload/weight-sync/{number}/{ranks}/", distributed_c10d._get_default_store())
        members = {"trainer": self.senders, "inference": self.receivers}
        if self.rank in self.senders or self.rank in self.receivers:
            role = "trainer" if self.rank in self.senders else "inference"
            side = members[role]
            self._channel = SyncChannel(
                role=role, rank=side.index(self.rank), size=len(side), device=str(group.device),
                timeout_s=group.timeout.total_seconds(), bucket_bytes=bucket_bytes, verify=verify,
                tensor_parallel_size=tensor_parallel_size if role == "inference" else 1,
                sharding=sharding if role == "inference" else None,
                model_config=model_config if role == "inference" else None, store=store, **deltas,
                member_name=lambda r, i: f"rank {members[r][i]}")

    @property
    def version(self) -> int | None:
        return None if self._channel is None else self._channel.version

    @property
    def consistent(self) -> bool:
        return True if self._channel is None else self._channel.consistent

    @property
    def last_error(self) -> str | None:
        return None if self._channel is None else self._channel.last_error

    def push(self, state: Mapping[str, torch.Tensor], version: int) -> SyncStats:
        """Send ``state`` as ``version`` to every receiver; raises SyncError if any refuses or fails."""
        if self.rank not in self.senders or self._channel is None:
            raise ConfigError(f"rank {self.rank} is not a sender ({self.senders})")
        return self._channel.push(state, version)

    def receive(self, target: torch.nn.Module | Mapping[str, torch.Tensor],
                timeout_s: float | None = None, *, rollback: bool | None = None) -> SyncStats:
        """Receive the next update into ``target``'s tensors, in place (SyncChannel.receive;
        a failed update is rolled back by default)."""
        if self.rank not in self.receivers or self._channel is None:
            raise ConfigError(f"rank {self.rank} is not a receiver ({self.receivers})")
        return self._channel.receive(target, timeout_s, rollback=rollback)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._own_group:
            self.group.close()

    def __enter__(self) -> "WeightSync":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
