"""Shared reads: the ranks that need the same bytes split their reading, and each sends what it
read to the others, so each byte leaves storage once per sharing group.

This is the cooperative read of distload's own readers (``pread`` on local files, ``ranged`` on
object stores), for what Run:ai's distributed mode cannot split: a load over a subgroup,
tensor-parallel slices that data-parallel replicas all keep, shard files that replicas share,
local files shared job-wide (a network file system). The readers give it a ``ByteReader``; it does
the rest.

**Who shares** (``request.sharing``): the ranks of the load's group that need exactly this rank's
bytes (the same files and the same slices), on its node or in the whole job (the read choice's
scope). The load's agreement step found them, and checked that they hold identical file lists.

**How.** The rank's bytes (its tensors, or its slices of them, in file order) are cut into
*buckets* of at most BUCKET_BYTES (smaller for a small load, so that each member reads several):
a large tensor into equal buckets of its own, small neighbours together. Each *round* of k buckets (k members) gives each member one to read, the largest to the
member that has read least so far (``assign_readers``). In each round:

1. each member waits for its bucket's read (its threads read READ_AHEAD_ROUNDS rounds ahead);
2. every rank of the load's group says whether it is fine (one exchange on the control group, as
   ``WorkerGroup.check_all_ok`` does): a read that failed on one rank, or a rank that failed
   elsewhere and reported it, ends every rank at this point, naming it; nobody waits for it;
3. each bucket goes from its reader to the other members: one broadcast where the members are the
   whole group, point-to-point sends otherwise (ranks outside a sharing group receive nothing of
   it). A bucket of one tensor's bytes travels in place, into each member's tensor; a bucket of
   several small tensors through one staging buffer.

Every rank of the group runs the same number of rounds (the most any sharing group needs), so the
exchanges match where sharing groups differ. A tensor is handed out once its last bucket is in.
The report counts ``requested_bytes`` (what this rank read from storage) and ``received_bytes``
(what came from the other members).
"""

from __future__ import annotations

import ctypes
import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

import torch
import torch.distributed as dist

from distload.errors import DistloadError, GroupError, RankFailedError
from distload.loading.backends.base import BackendRun, ReadRequest
from distload.loading.index import TensorInfo
from distload.tensor_io import host_view

BUCKET_BYTES = 64 * 1024 * 1024
# Smaller buckets where the load is small for its members: at least BUCKETS_PER_MEMBER rounds, so
# that one member's extra bucket does not hold up the others (measured: 300 MiB over 4 ranks in
# 64 MiB buckets left one rank reading 37% of it).
MIN_BUCKET_BYTES = 4 * 1024 * 1024
BUCKETS_PER_MEMBER = 4
READ_AHEAD_ROUNDS = 2  # each member reads this many of its buckets ahead of the sends
ALIGN = 64  # a large tensor's buckets start on this many bytes

Extent = tuple[int, int, int]  # (offset in the tensor's data in its file, offset in the buffer, length)


class ByteReader(Protocol):
    """Reads byte ranges of one tensor's data in its file into a buffer (thread-safe);
    ``task_bytes``: the bytes one read task should take (several tasks run at once)."""

    task_bytes: int

    def read(self, info: TensorInfo, extents: Sequence[Extent], view: memoryview) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Segment:
    """Bytes ``[start, start + length)`` of this rank's piece of tensor number ``tensor``."""

    tensor: int
    start: int
    length: int


Bucket = tuple[Segment, ...]


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[Bucket]:
    """Buckets over tensors of ``sizes`` bytes (in order): a tensor of at least ``bucket_bytes``
    in equal buckets of its own, smaller neighbours grouped up to ``bucket_bytes``."""
    buckets: list[Bucket] = []
    group: list[Segment] = []
    size = 0
    for i, n in enumerate(sizes):
        if n == 0:
            continue
        if n >= bucket_bytes:
            if group:
                buckets.append(tuple(group))
                group, size = [], 0
            parts = math.ceil(n / bucket_bytes)
            share = -(-n // parts)  # ceil(n / parts), then up to a multiple of ALIGN
            step = -(-share // ALIGN) * ALIGN
            buckets += [(Segment(i, start, min(step, n - start)),) for start in range(0, n, step)]
            continue
        if group and size + n > bucket_bytes:
            buckets.append(tuple(group))
            group, size = [], 0
        group.append(Segment(i, 0, n))
        size += n
    if group:
        buckets.append(tuple(group))
    return buckets


def assign_readers(buckets: Sequence[Bucket], k: int) -> list[int]:
    """Which of ``k`` members reads each bucket: one bucket per member in each round of k, the
    round's largest bucket to the member that has read least so far (ties by position), so that
    buckets of unequal sizes still spread evenly. Pure: every member computes the same."""
    load = [0] * k
    owners = [0] * len(buckets)
    for first in range(0, len(buckets), k):
        round_ = sorted(range(first, min(first + k, len(buckets))),
                        key=lambda b: (-sum(s.length for s in buckets[b]), b))
        members = sorted(range(k), key=lambda m: (load[m], m))
        for b, m in zip(round_, members):
            owners[b] = m
            load[m] += sum(s.length for s in buckets[b])
    return owners


def clip(extents: Sequence[Extent], start: int, length: int, at: int) -> list[Extent]:
    """Of a piece's ``(source, destination, length)`` extents, the parts that land in destination
    bytes ``[start, start + length)``, placed at ``at`` onward in a buffer."""
    end = start + length
    out = []
    for src, dst, n in extents:
        lo, hi = max(dst, start), min(dst + n, end)
        if lo < hi:
            out.append((src + lo - dst, at + lo - start, hi - lo))
    return out


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


class _Tensors:
    """This rank's tensors: each allocated when a bucket first needs it, handed out when done."""

    def __init__(self, request: ReadRequest, infos: list[TensorInfo], buckets: list[Bucket]):
        self.request = request
        self.infos = infos
        self.tensors: list[torch.Tensor | None] = [None] * len(infos)
        self.new: list[bool] = [True] * len(infos)
        self.missing = [0] * len(infos)
        for bucket in buckets:
            for segment in bucket:
                self.missing[segment.tensor] += 1
        self.next_out = 0

    def piece(self, i: int):
        return self.request.slices.get(self.infos[i].name)

    def extents(self, i: int) -> Sequence[Extent]:
        piece = self.piece(i)
        info = self.infos[i]
        if piece is None:
            return ((0, 0, info.nbytes),) if info.nbytes else ()
        return piece.extents

    def zeros(self, i: int) -> Sequence[tuple[int, int]]:
        piece = self.piece(i)
        return () if piece is None else piece.zeros

    def get(self, i: int) -> torch.Tensor:
        tensor = self.tensors[i]
        if tensor is None:
            tensor = self.tensors[i] = self._allocate(i)
        return tensor

    def _allocate(self, i: int) -> torch.Tensor:
        info, request = self.infos[i], self.request
        piece = self.piece(i)
        shape = info.shape if piece is None else piece.shape
        dest = request.destinations.get(info.name)
        if (dest is not None and dest.device == request.device and dest.is_contiguous()
                and dest.dtype == info.torch_dtype and tuple(dest.shape) == tuple(shape)):
            self.new[i] = False
            return dest
        if request.device.type == "cpu":
            return request.host_memory.empty(shape, info.torch_dtype)
        return torch.empty(shape, dtype=info.torch_dtype, device=request.device)

    def region(self, segment: Segment) -> torch.Tensor:
        return _flat_bytes(self.get(segment.tensor))[segment.start:segment.start + segment.length]

    def done(self, bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
        """After ``bucket`` arrived: the tensors now complete, in order."""
        for segment in bucket:
            self.missing[segment.tensor] -= 1
        yield from self.ready()

    def ready(self) -> Iterator[tuple[str, torch.Tensor]]:
        while self.next_out < len(self.infos) and self.missing[self.next_out] == 0:
            i = self.next_out
            self.next_out += 1
            tensor = self.get(i)  # an empty tensor has no bucket
            self.tensors[i] = None  # the consumer holds it now
            yield self.infos[i].name, tensor


class _Bucket:
    """One bucket in this round: what travels (``wire``) and, on its reader, the read."""

    def __init__(self, index: int, segments: Bucket, owner: int, tensors: _Tensors):
        self.index = index
        self.segments = segments
        self.owner = owner  # index into the sharing members
        self.nbytes = sum(s.length for s in segments)
        device = tensors.request.device
        if len(segments) == 1:
            self.wire = tensors.region(segments[0])  # in place, into the tensor itself
        else:
            self.wire = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        for segment in segments:
            tensors.get(segment.tensor)
        self.reads: list[Future] = []
        self.requested = 0  # bytes its reader asked the source for
        self.host: torch.Tensor | None = None  # where a reader on a device reads first

    def unpack(self, tensors: _Tensors) -> None:
        """A staged bucket's bytes into the tensors they belong to."""
        if len(self.segments) == 1:
            return
        at = 0
        for segment in self.segments:
            tensors.region(segment).copy_(self.wire[at:at + segment.length])
            at += segment.length


def shared_stream(request: ReadRequest, run: BackendRun, reader: ByteReader, concurrency: int
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The cooperative read: ``(name, tensor)`` in file order, each rank reading its share."""
    group = request.group
    members = list(request.sharing) or list(range(group.world_size))
    me = members.index(group.rank)
    k = len(members)
    infos = [t for f in request.index.files for t in f.tensors]
    sizes = [(request.slices[t.name].nbytes if t.name in request.slices else t.nbytes) for t in infos]
    bucket_bytes = min(BUCKET_BYTES, max(MIN_BUCKET_BYTES, sum(sizes) // (BUCKETS_PER_MEMBER * k)))
    buckets = plan_buckets(sizes, bucket_bytes)
    owners = assign_readers(buckets, k)
    tensors = _Tensors(request, infos, buckets)
    run.requested_bytes = 0
    run.received_bytes = 0
    own_rounds = math.ceil(len(buckets) / k)
    rounds = max(_agree(group, lambda: own_rounds, "planning the shared read"))
    whole_group = k == group.world_size
    reads: dict[int, _Bucket] = {}
    try:
        with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="distload-shared") as pool:
            def in_round(r: int) -> range:
                return range(r * k, min((r + 1) * k, len(buckets)))

            def read_ahead(first_round: int) -> None:
                for r in range(first_round, min(own_rounds, first_round + READ_AHEAD_ROUNDS + 1)):
                    for b in in_round(r):
                        if owners[b] == me and b not in reads:
                            reads[b] = _start_read(pool, _Bucket(b, buckets[b], me, tensors), tensors, reader)

            yield from tensors.ready()  # leading empty tensors
            for r in range(rounds):
                def wait_for_own_read() -> None:
                    read_ahead(r)
                    for b in in_round(r):
                        if b in reads:
                            for future in reads[b].reads:
                                future.result()

                _agree(group, wait_for_own_read, "reading its share")
                this_round = [reads.pop(b) if b in reads else _receiving(b, buckets[b], owners[b], tensors)
                              for b in in_round(r)]
                _send(group, members, me, this_round, whole_group)
                for bucket in this_round:
                    if bucket.owner == me:
                        run.requested_bytes += bucket.requested
                    else:
                        run.received_bytes += bucket.nbytes
                    bucket.unpack(tensors)
                    yield from tensors.done(bucket.segments)
            yield from tensors.ready()
    finally:
        reader.close()


def _receiving(index: int, segments: Bucket, owner: int, tensors: _Tensors) -> _Bucket:
    """A bucket another member reads; new host memory is backed in one call before it arrives."""
    bucket = _Bucket(index, segments, owner, tensors)
    if bucket.wire.device.type == "cpu" and len(segments) == 1 and tensors.new[segments[0].tensor]:
        tensors.request.host_memory.prefault(bucket.wire.data_ptr(), bucket.nbytes)
    return bucket


def _start_read(pool: ThreadPoolExecutor, bucket: _Bucket, tensors: _Tensors, reader: ByteReader) -> _Bucket:
    """Submit the reads of one bucket this rank owns (into the wire, or a host buffer first)."""
    request = tensors.request
    on_host = bucket.wire.device.type == "cpu"
    target = bucket.wire if on_host else request.host_memory.empty((bucket.nbytes,), torch.uint8)
    bucket.host = None if on_host else target
    view = host_view(target)
    fresh = on_host and len(bucket.segments) == 1 and tensors.new[bucket.segments[0].tensor]
    at = 0
    for segment in bucket.segments:
        i = segment.tensor
        info = tensors.infos[i]
        extents = clip(tensors.extents(i), segment.start, segment.length, at)
        for dst, n in tensors.zeros(i):  # vocabulary padding: zero rows, never read
            for _, where, length in clip(((0, dst, n),), segment.start, segment.length, at):
                ctypes.memset(target.data_ptr() + where, 0, length)
        bucket.requested += sum(n for _, _, n in extents)
        for task in batch_extents(extents, reader.task_bytes):
            bucket.reads.append(pool.submit(_read, reader, info, task, view, request.host_memory if fresh else None,
                                            target.data_ptr()))
        at += segment.length
    return bucket


def batch_extents(extents: Sequence[Extent], chunk_bytes: int) -> list[list[Extent]]:
    """Reads of about ``chunk_bytes`` each: a large extent cut into chunks, small ones grouped."""
    batches: list[list[Extent]] = []
    current: list[Extent] = []
    size = 0
    for src, dst, length in extents:
        for start in range(0, length, chunk_bytes):
            n = min(chunk_bytes, length - start)
            if current and size + n > chunk_bytes:
                batches.append(current)
                current, size = [], 0
            current.append((src + start, dst + start, n))
            size += n
    if current:
        batches.append(current)
    return batches


def _read(reader: ByteReader, info: TensorInfo, extents: list[Extent], view: memoryview, host_memory,
          address: int) -> None:
    if host_memory is not None:  # new memory: back it in one call before reading into it
        start, end = extents[0][1], extents[-1][1] + extents[-1][2]
        host_memory.prefault(address + start, end - start)
    reader.read(info, extents, view)


def _agree(group, step: Callable, what: str) -> list:
    """``step()`` on this rank, then every rank's result; a failure anywhere ends every rank here.

    The payloads are those of check_all_ok and report_failure, so a rank that failed outside the
    read and reported it is heard here too. An exception raised here has been reported to every
    rank already: it carries ``reported = True``, and the loader does not report it again."""
    try:
        value = step()
    except BaseException as exc:
        if group.world_size > 1:
            try:
                group.exchange((False, str(exc) if isinstance(exc, DistloadError) else f"{type(exc).__name__}: {exc}"),
                               explain=False)
            except GroupError:
                pass  # the others are gone; this rank's own error is what matters
        _mark_reported(exc)
        raise
    statuses = group.exchange((True, value))
    failures = {rank: message for rank, (ok, message) in enumerate(statuses) if not ok}
    if failures:
        error = RankFailedError(what, failures)
        _mark_reported(error)
        raise error
    return [value for _, value in statuses]


def _mark_reported(exc: BaseException) -> None:
    try:
        exc.reported = True  # type: ignore[attr-defined]
    except AttributeError:  # an exception type without a __dict__: the loader reports it again
        pass


def _send(group, members: list[int], me: int, buckets: list[_Bucket], whole_group: bool) -> None:
    """Each bucket from its reader to the other members (collective over the members)."""
    for bucket in buckets:
        if bucket.owner == me and bucket.host is not None:  # read on the host, for a device
            bucket.wire.copy_(bucket.host)
    if len(members) == 1:
        return
    pg = group.process_group
    ranks = group.ranks  # job-wide ranks: torch's collectives and sends take those
    works = []
    try:
        for bucket in buckets:
            owner = ranks[members[bucket.owner]]
            if whole_group:
                works.append((bucket, dist.broadcast(bucket.wire, src=owner, group=pg, async_op=True)))
            elif bucket.owner == me:
                works += [(bucket, dist.isend(bucket.wire, dst=ranks[m], group=pg))
                          for m in members if m != members[me]]
            else:
                works.append((bucket, dist.irecv(bucket.wire, src=owner, group=pg)))
        for bucket, work in works:
            work.wait(group.timeout)
    except Exception as exc:  # a member died or the timeout passed
        owner = members[bucket.owner]
        raise GroupError(f"rank {group.rank}: lost contact with rank {owner} while its share of the shared "
                         f"read (bucket {bucket.index}, {bucket.nbytes} bytes) travelled: {exc}"
                         f"{group.lost_peers(exc)}") from exc
