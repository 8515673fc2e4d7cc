"""Weight sync over a process group: trainer ranks push, inference ranks receive in place.

Protocol of one update, per sender ``s`` (its group is ``s`` plus every receiver; all groups are
made once, by the constructor, on every rank of the default group):

1. metadata: ``s`` broadcasts the version, every tensor's name, dtype and shape, and the bucket
   layout (gloo control group);
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
from datetime import timedelta
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from distload.loading.index import DTYPES, dtype_code
from distload.errors import ConfigError, DistloadError
from distload.live.reload import model_tensors

DEFAULT_BUCKET_BYTES = 512 * 1024**2
_ALIGN = 64  # every tensor starts 64-byte aligned in a bucket, so a view as any dtype is legal


class SyncError(DistloadError):
    """An update was refused or failed; the receiver's version did not advance."""


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


@dataclass
class _Channel:
    """One sender and the receivers: a data group and a gloo control group."""

    src: int
    ranks: list[int]
    data: Any
    control: Any


class WeightSync:
    """Push state dicts from sender ranks to receiver ranks, in place, versioned.

    Construct on EVERY rank of the default process group (it creates subgroups), with the same
    arguments. Then for each update every sender calls :meth:`push` and every receiver calls
    :meth:`receive`. With several senders each pushes its own slice (disjoint names) and a
    receiver takes all of them, in sender order, before its version advances.
    """

    def __init__(self, senders: Sequence[int], receivers: Sequence[int] | None = None, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 300.0,
                 device: torch.device | str | None = None):
        if not dist.is_initialized():
            raise ConfigError("WeightSync needs torch.distributed: create a distload.WorkerGroup first")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ConfigError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.senders = sorted(set(senders))
        self.receivers = sorted(set(receivers) if receivers is not None
                                else set(range(world)) - set(self.senders))
        if not self.senders or not self.receivers or set(self.senders) & set(self.receivers):
            raise ConfigError(f"senders {self.senders} and receivers {self.receivers} must be non-empty "
                              f"and disjoint")
        if any(r < 0 or r >= world for r in self.senders + self.receivers):
            raise ConfigError(f"ranks must be in [0, {world}), got senders {self.senders}, receivers {self.receivers}")
        self.bucket_bytes = bucket_bytes
        self.timeout = timedelta(seconds=timeout_s)
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu"))
        data_backend = "nccl" if self.device.type == "cuda" else "gloo"
        self._channels: list[_Channel] = []
        for src in self.senders:
            ranks = sorted([src] + self.receivers)
            # new_group is collective over the whole default group: every rank makes every group.
            data = dist.new_group(ranks, backend=data_backend, timeout=self.timeout)
            control = dist.new_group(ranks, backend="gloo", timeout=self.timeout)
            self._channels.append(_Channel(src, ranks, data, control))
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
        gathered: list[Any] = [None] * len(channel.ranks)
        dist.all_gather_object(gathered, (self.rank, ok, message), group=channel.control)
        return {rank: msg for rank, good, msg in gathered if not good}

    def _my_channel(self) -> _Channel:
        return next(c for c in self._channels if c.src == self.rank)

    # -- sender -------------------------------------------------------------------------------
    def push(self, state: Mapping[str, torch.Tensor], version: int) -> SyncStats:
        """Send ``state`` as ``version`` to every receiver; raises SyncError if any refuses or fails."""
        if self.rank not in self.senders:
            raise ConfigError(f"rank {self.rank} is not a sender ({self.senders})")
        start = time.perf_counter()
        channel = self._my_channel()
        entries = [_Entry(n, dtype_code(t.dtype), tuple(t.shape), t.numel() * t.element_size())
                   for n, t in state.items()]
        buckets = plan_buckets(entries, self.bucket_bytes)
        meta = [{"version": version, "entries": entries, "buckets": buckets}]
        try:
            dist.broadcast_object_list(meta, src=channel.src, group=channel.control)
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
                in_flight[slot] = dist.broadcast(buffer, src=channel.src, group=channel.data, async_op=True)
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
        nbytes = num_tensors = num_buckets = 0
        seconds = 0.0
        version = None
        try:
            for channel in self._channels:
                got = self._receive_from(channel, targets)
                if version is not None and got[0] != version:
                    raise SyncError(f"senders disagree on the version: {version} from rank "
                                    f"{self._channels[0].src}, {got[0]} from rank {channel.src}")
                version = got[0]
                nbytes, num_tensors, num_buckets = nbytes + got[1], num_tensors + got[2], num_buckets + got[3]
                seconds += got[4]
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
        return SyncStats(version, nbytes, num_tensors, num_buckets, seconds)

    def _receive_from(self, channel: _Channel,
                      targets: Mapping[str, torch.Tensor]) -> tuple[int, int, int, int, float]:
        """One sender's update; the time counts from the metadata's arrival (not the wait for it)."""
        meta: list[Any] = [None]
        dist.broadcast_object_list(meta, src=channel.src, group=channel.control)
        start = time.perf_counter()
        version, entries, buckets = meta[0]["version"], meta[0]["entries"], meta[0]["buckets"]
        problems = check_entries(entries, targets)
        refused = self._statuses(channel, not problems, "; ".join(problems[:10]) or None)
        if refused:
            raise SyncError(f"update to version {version} refused (nothing was written; still at version "
                            f"{self.version}): " + "; ".join(f"rank {r}: {m}" for r, m in sorted(refused.items())))
        self.consistent = False  # from here on, a failure leaves a mix of versions
        works: list[Any] = [None, None]

        def post(i: int) -> None:
            works[i % 2] = dist.broadcast(self._buffer(i % 2, buckets[i].size), src=channel.src,
                                          group=channel.data, async_op=True)

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
        return (version, sum(e.nbytes for e in entries), len(entries), len(buckets),
                time.perf_counter() - start)

    def close(self) -> None:
        for channel in self._channels:
            for group in (channel.data, channel.control):
                try:
                    dist.destroy_process_group(group)
                except Exception:  # a group whose peer died may not tear down cleanly
                    pass
        self._channels = []
        self._buffers = []
