"""Weight sync over a process group: trainer ranks push, inference ranks receive in place.

Protocol of one update, per sender ``s`` (its channel is a subgroup of ``s`` plus every receiver,
a :class:`~distload.group.WorkerGroup` with a data group and a gloo control group; all channels
are made once, by the constructor, on every rank of the job):

1. metadata: ``s`` broadcasts the version, every tensor's name, dtype and shape, and the bucket
   layout (the channel's control group);
2. agreement: each receiver checks every entry against its own tensors (name, dtype, shape) and
   all statuses are all-gathered: if any receiver refuses, every member raises and no byte moves;
3. data: tensors travel packed into flat buckets (``bucket_bytes``, default 512 MiB; a tensor
   bigger than a bucket travels alone), double-buffered: the sender packs bucket i+1 while
   bucket i is in flight, receivers unpack bucket i while bucket i+1 arrives, straight into their
   existing tensors (NCCL on GPUs, gloo on CPUs);
4. completion: statuses all-gathered again. A receiver advances ``version`` only when every
   sender's update arrived whole. If anything fails (a peer dies, a timeout passes) the receiver
   keeps its old ``version``, records the failure in ``last_error`` and sets ``consistent`` to
   False (its tensors may now mix two versions): it never reports half-new weights as the new
   version. Every collective has the timeout, so both sides of a failure end in bounded time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from distload.errors import ConfigError, SyncError
from distload.group import WorkerGroup
from distload.live.targets import model_tensors
from distload.loading.index import DTYPES, dtype_code

DEFAULT_BUCKET_BYTES = 512 * 1024**2
_ALIGN = 64  # every tensor starts 64-byte aligned in a bucket, so a view as any dtype is legal


@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class _Bucket:
    size: int
    items: tuple[tuple[int, int], ...]  # (entry index, byte offset)


@dataclass
class SyncStats:
    version: int
    nbytes: int
    num_tensors: int
    num_buckets: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / 1e9 / self.seconds if self.seconds > 0 else 0.0


def plan_buckets(entries: Sequence[_Entry], bucket_bytes: int) -> list[_Bucket]:
    """Pack entries in order into buckets of at most ``bucket_bytes`` (a bigger one alone)."""
    buckets: list[_Bucket] = []
    items: list[tuple[int, int]] = []
    size = 0
    for index, entry in enumerate(entries):
        offset = -(-size // _ALIGN) * _ALIGN
        if items and offset + entry.nbytes > bucket_bytes:
            buckets.append(_Bucket(size, tuple(items)))
            items, size, offset = [], 0, 0
        items.append((index, offset))
        size = offset + entry.nbytes
    if items:
        buckets.append(_Bucket(size, tuple(items)))
    return buckets


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def check_entries(entries: Sequence[_Entry], targets: Mapping[str, torch.Tensor]) -> list[str]:
    """What prevents receiving ``entries`` into ``targets`` (empty: nothing)."""
    problems = []
    for entry in entries:
        dst = targets.get(entry.name)
        if dst is None:
            problems.append(f"{entry.name}: no such tensor here")
        elif DTYPES[entry.dtype] != dst.dtype or tuple(dst.shape) != entry.shape:
            problems.append(f"{entry.name}: sent {entry.dtype} {list(entry.shape)}, "
                            f"here {dst.dtype} {list(dst.shape)}")
    return problems


@dataclass(frozen=True)
class _Channel:
    """One sender and every receiver."""

    src: int  # the sender's rank in the sync's group
    src_global: int  # and in the job
    group: WorkerGroup | None  # None on ranks outside the channel

    @property
    def src_in_channel(self) -> int:
        assert self.group is not None
        return self.group.ranks.index(self.src_global)


class WeightSync:
    """Push state dicts from sender ranks to receiver ranks, in place, versioned.

    ``senders`` and ``receivers`` are ranks of ``group`` (None: a group from the environment,
    owned by this object and closed by :meth:`close`). Construct on EVERY rank of the job, with
    the same arguments (it makes one subgroup per sender, a collective over the whole job). Then
    for each update every sender calls :meth:`push` and every receiver calls :meth:`receive`.
    With several senders each pushes its own slice (disjoint names) and a receiver takes all of
    them, in sender order, before its version advances. Timeouts and devices are the group's.
    """

    def __init__(self, senders: Sequence[int], receivers: Sequence[int] | None = None, *,
                 group: WorkerGroup | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ConfigError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        self._own_group = group is None
        self.group = WorkerGroup() if group is None else group
        try:
            self._setup(senders, receivers, bucket_bytes)
        except BaseException:
            self.close()
            raise

    def _setup(self, senders: Sequence[int], receivers: Sequence[int] | None, bucket_bytes: int) -> None:
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
        self.bucket_bytes = bucket_bytes
        self.timeout = group.timeout
        self.device = group.device
        self._channels: list[_Channel] = []
        for src in self.senders:
            self._channels.append(_Channel(src, group.ranks[src], group.subgroup([src] + self.receivers)))
        self.version: int | None = None
        self.last_error: str | None = None
        self.consistent = True
        self._buffers: list[torch.Tensor] = []

    # -- helpers ------------------------------------------------------------------------------
    def _buffer(self, index: int, size: int) -> torch.Tensor:
        while len(self._buffers) <= index:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._buffers[index].numel() < size:
            self._buffers[index] = torch.empty(max(size, min(self.bucket_bytes, 2 * size)),
                                               dtype=torch.uint8, device=self.device)
        return self._buffers[index][:size]

    def _statuses(self, channel: _Channel, ok: bool, message: str | None) -> dict[int, str]:
        """Every channel member's status; the failed ones by their rank in the sync's group."""
        assert channel.group is not None
        statuses = channel.group.exchange((ok, message))
        return {self.group.ranks.index(channel.group.ranks[i]): msg
                for i, (good, msg) in enumerate(statuses) if not good}

    def _broadcast(self, channel: _Channel, buffer: torch.Tensor) -> Any:
        assert channel.group is not None
        return dist.broadcast(buffer, src=channel.src_global, group=channel.group.process_group, async_op=True)

    def _my_channel(self) -> _Channel:
        return next(c for c in self._channels if c.src == self.rank)

    # -- sender -------------------------------------------------------------------------------
    def push(self, state: Mapping[str, torch.Tensor], version: int) -> SyncStats:
        """Send ``state`` as ``version`` to every receiver; raises SyncError if any refuses or fails."""
        if self.rank not in self.senders:
            raise ConfigError(f"rank {self.rank} is not a sender ({self.senders})")
        start = time.perf_counter()
        channel = self._my_channel()
        assert channel.group is not None
        entries = [_Entry(n, dtype_code(t.dtype), tuple(t.shape), t.numel() * t.element_size())
                   for n, t in state.items()]
        buckets = plan_buckets(entries, self.bucket_bytes)
        meta = {"version": version, "entries": entries, "buckets": buckets}
        try:
            channel.group.broadcast(meta, src=channel.src_in_channel)
            refused = self._statuses(channel, True, None)
            if refused:
                raise SyncError(f"update to version {version} refused, nothing was sent: "
                                + "; ".join(f"rank {r}: {m}" for r, m in sorted(refused.items())))
            tensors = list(state.values())
            in_flight: list[Any] = [None, None]
            for i, bucket in enumerate(buckets):
                slot = i % 2
                if in_flight[slot] is not None:
                    in_flight[slot].wait()  # the buffer is free again
                buffer = self._buffer(slot, bucket.size)
                for index, offset in bucket.items:
                    entry = entries[index]
                    buffer[offset:offset + entry.nbytes].copy_(_as_bytes(tensors[index]))
                in_flight[slot] = self._broadcast(channel, buffer)
            for work in in_flight:
                if work is not None:
                    work.wait()
            failed = self._statuses(channel, True, None)
        except SyncError:
            raise
        except Exception as exc:
            raise SyncError(f"pushing version {version} failed (a receiver died or the "
                            f"{self.timeout.total_seconds():.0f}s timeout passed): {exc}") from exc
        if failed:
            raise SyncError(f"version {version} did not arrive whole on: "
                            + "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items())))
        return SyncStats(version, sum(e.nbytes for e in entries), len(entries), len(buckets),
                         time.perf_counter() - start)

    # -- receiver -----------------------------------------------------------------------------
    def receive(self, target: torch.nn.Module | Mapping[str, torch.Tensor]) -> SyncStats:
        """Receive one update from every sender into ``target``'s tensors, in place.

        On success ``version`` advances and the stats are returned. On failure SyncError is
        raised, ``version`` is unchanged, ``last_error`` says why, and ``consistent`` tells
        whether the tensors were left untouched (refused before any data) or may be mixed.
        """
        if self.rank not in self.receivers:
            raise ConfigError(f"rank {self.rank} is not a receiver ({self.receivers})")
        targets = model_tensors(target)
        total = SyncStats(-1, 0, 0, 0, 0.0)
        version = None
        try:
            for channel in self._channels:
                got = self._receive_from(channel, targets)
                if version is not None and got.version != version:
                    raise SyncError(f"senders disagree on the version: {version} from rank "
                                    f"{self._channels[0].src}, {got.version} from rank {channel.src}")
                version = got.version
                total = SyncStats(version, total.nbytes + got.nbytes, total.num_tensors + got.num_tensors,
                                  total.num_buckets + got.num_buckets, total.seconds + got.seconds)
        except Exception as exc:
            self.last_error = str(exc)
            if isinstance(exc, SyncError):
                raise
            raise SyncError(f"receiving an update failed (a sender died or the "
                            f"{self.timeout.total_seconds():.0f}s timeout passed); still at version "
                            f"{self.version}: {exc}") from exc
        self.version = version
        self.consistent = True
        self.last_error = None
        return total

    def _receive_from(self, channel: _Channel, targets: Mapping[str, torch.Tensor]) -> SyncStats:
        """One sender's update; the time counts from the metadata's arrival (not the wait for it)."""
        assert channel.group is not None
        meta = channel.group.broadcast(None, src=channel.src_in_channel)
        start = time.perf_counter()
        version, entries, buckets = meta["version"], meta["entries"], meta["buckets"]
        problems = check_entries(entries, targets)
        refused = self._statuses(channel, not problems, "; ".join(problems[:10]) or None)
        if refused:
            raise SyncError(f"update to version {version} refused (nothing was written; still at version "
                            f"{self.version}): " + "; ".join(f"rank {r}: {m}" for r, m in sorted(refused.items())))
        self.consistent = False  # from here on, a failure leaves a mix of versions
        works: list[Any] = [None, None]

        def post(i: int) -> None:
            works[i % 2] = self._broadcast(channel, self._buffer(i % 2, buckets[i].size))

        try:
            for i in range(min(2, len(buckets))):
                post(i)
            with torch.no_grad():
                for i, bucket in enumerate(buckets):
                    works[i % 2].wait()
                    buffer = self._buffer(i % 2, bucket.size)
                    for index, offset in bucket.items:
                        entry = entries[index]
                        dst = targets[entry.name].detach()
                        dst.copy_(buffer[offset:offset + entry.nbytes].view(DTYPES[entry.dtype]).view(entry.shape))
                    if i + 2 < len(buckets):
                        post(i + 2)
        except Exception as exc:
            # Tell the others (if they can still hear) so nobody waits for this rank's status.
            try:
                self._statuses(channel, False, f"{type(exc).__name__}: {exc}")
            except Exception:
                pass
            raise
        failed = self._statuses(channel, True, None)
        if failed:
            raise SyncError(f"version {version} failed on: " + "; ".join(f"rank {r}: {m}" for r, m in failed.items()))
        return SyncStats(version, sum(e.nbytes for e in entries), len(entries), len(buckets),
                         time.perf_counter() - start)

    def close(self) -> None:
        for channel in getattr(self, "_channels", []):
            if channel.group is not None:
                channel.group.close()
        self._channels = []
        self._buffers = []
        if self._own_group:
            self.group.close()

    def __enter__(self) -> "WeightSync":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
