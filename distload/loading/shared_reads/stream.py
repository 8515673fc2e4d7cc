"""Shared reads: each byte a group of ranks needs is read once, by one of them, and each rank
receives from the others exactly the bytes it keeps.

This is the shared read of distload's own readers (``pread`` on local files, ``ranged`` on
object stores), for what Run:ai's distributed mode cannot split: a load over a subgroup,
tensor-parallel slices (with or without data-parallel replicas), shard files that replicas share,
local files shared job-wide (a network file system). The readers give it a ``ByteReader``; it does
the rest.

**Who shares** (the request's :class:`SharedReadOptions`, ``members``): the *members*, the ranks of the load's group that read a
checkpoint together, on this rank's node or in the whole job (the read choice's scope): every rank
of a whole checkpoint (each keeping all of it, or its tensor-parallel slices), the replicas of a
TP rank for a pre-sharded one (they need the same shard files). ``needs`` says what each
member keeps of each split tensor (byte runs; the others whole). The load's agreement step found
both, and checked that the members hold identical file lists.

**What each reads and receives** (``plan.py``): the union of the members' needs, tensor by
tensor in file order, is cut into *buckets* of at most BUCKET_BYTES (smaller for a small load, so
that each member reads several). Each bucket has one reader: each *round* of k buckets (k members)
gives each member one to read, the largest to the member that has read least so far, counting
what a member keeps of a bucket off its load (so a TP rank tends to read its own rows: bytes its
reader keeps are sent to fewer members). So a tensor
that two TP ranks split along dim 1 is read once, as one range, not once per TP rank row by row.
Each member's *pieces* of a bucket are its need clipped to it.

**A round** (the engine in ``rounds.py``, which ``distload pull`` runs too):

1. each member waits for its bucket's read (its threads read READ_AHEAD_ROUNDS rounds ahead),
   packs the messages it sends, and makes room for the pieces it receives;
2. every rank of the load's group says whether it is fine (one exchange on the control group, as
   ``WorkerGroup.check_all_ok`` does): a read (or a message's memory) that failed on one rank, or
   a rank that failed elsewhere and reported it, ends every rank at this point, naming it; nobody
   waits for it (after this point only a lost rank can fail a round);
3. each reader sends every other member its pieces of the bucket: one broadcast where the members
   are the whole group and all keep the same bytes (a whole checkpoint), else one point-to-point
   message per member that keeps something of it, its pieces packed in order (a dim-1 slice's
   half rows: one strided copy). A receiver places them into its tensors, straight into the
   tensor where they land in one unbroken range (an in-place reload keeps its memory); the reader
   keeps its own pieces, read straight into its tensor where the bucket is exactly what it keeps.

Every rank of the group runs the same number of rounds (the most any member set needs), so the
exchanges match where member sets differ (node scope, shard files). A tensor is handed out once
its last bucket is in. The report counts ``requested_bytes`` (what this rank read from storage)
and ``received_bytes`` (what came from the other members: only bytes it keeps).
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist

from distload.errors import DistloadError, GroupError
from distload.loading import buckets
from distload.loading.buckets import TensorRun, contiguous, flat_bytes, run_bytes
from distload.loading.request import BackendRun, ReadOptions, ReadRequest
from distload.loading.shared_reads.plan import BUCKET_BYTES, ExchangePlan, Need, whole_need
from distload.loading.shared_reads.rounds import agree, run_rounds
from distload.loading.index import TensorInfo
from distload.tensor_io import host_view
from distload.workers.group import collective_cause

Extent = tuple[int, int, int]  # (offset in the tensor's data in its file, offset in the buffer, length)


class ByteReader(Protocol):
    """Reads byte ranges of one tensor's data in its file into a buffer (thread-safe);
    ``task_bytes``: the bytes one read task should take (several tasks run at once).
    ``received``: after a bucket from a peer arrived, its bytes, where this rank keeps them
    unbroken ``(tensor, offset in the tensor's data in its file, the bytes)``, in file order: a
    reader with a node cache keeps them there (every node a shared read passes through fills
    its cache, not only the one whose rank fetched). ``keeps_received``: whether it does; where
    not, the pieces are never gathered (on a GPU, a copy of every received byte to the host)."""

    task_bytes: int
    keeps_received: bool
    where: str | None  # where the reads go, for a round's timeout (an object store's endpoint)

    def read(self, info: TensorInfo, extents: Sequence[Extent], view: memoryview) -> None: ...

    def received(self, pieces: Sequence[tuple[TensorInfo, int, memoryview]]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SharedReadOptions(ReadOptions):
    """The part of a request a reader that ``shares_reads`` needs for its shared read.

    ``members``: the ranks of the group (group ranks, this one included) that read this rank's
    files together, found by the agreement; ``needs``: what each of them keeps (in ``members``'s
    order): a tensor's position in the index -> byte runs of its slice (``shared_reads/plan.py``),
    the tensors it keeps whole left out. The load's agreement fills both (``RankPlan.members``,
    ``RankPlan.needs``); a shared read without them is refused.
    """

    members: tuple[int, ...] = ()
    needs: tuple[Mapping[int, tuple], ...] = ()


def member_needs(request: ReadRequest, infos: Sequence[TensorInfo]) -> tuple[list[list[Need]], list[int]]:
    """Each distinct need of the members (``needs``, in ``members``'s order), as runs per tensor
    (its runs where a member keeps a slice, else the whole tensor), and each member's: members
    that keep the same slices (the agreement hands them one mapping) share one list, so this
    costs the distinct needs x their entries, not the members x tensors."""
    needs = request.options_as(SharedReadOptions).needs
    wholes = [whole_need(info.nbytes) for info in infos]
    lists: dict[int, int] = {}
    distinct: list[list[Need]] = []
    classes = []
    for member in needs:
        if id(member) not in lists:
            need = list(wholes)
            for i, runs in member.items():
                need[i] = runs
            lists[id(member)] = len(distinct)
            distinct.append(need)
        classes.append(lists[id(member)])
    return distinct, classes


class _Tensors:
    """This rank's tensors: each allocated when a bucket first needs it, handed out when done."""

    def __init__(self, request: ReadRequest, infos: list[TensorInfo], plan: ExchangePlan,
                 wire: torch.device | None = None):
        self.request = request
        self.infos = infos
        # Where buckets travel: the device, or the host where the data group cannot carry the
        # device's tensors (CUDA over gloo: WorkerGroup.wire_device). Staged buckets are read,
        # sent and received on the host, and copied into the device tensors at the end.
        self.wire = request.device if wire is None else wire
        self.staged = self.wire.type != request.device.type
        self.tensors: list[torch.Tensor | None] = [None] * len(infos)
        self.new: list[bool] = [True] * len(infos)
        self.missing = [0] * len(infos)
        for spans in plan.spans:
            for span in spans:
                self.missing[span.tensor] += 1
        self.next_out = 0

    def get(self, i: int) -> torch.Tensor:
        tensor = self.tensors[i]
        if tensor is None:
            tensor = self.tensors[i] = self._allocate(i)
        return tensor

    def flat(self, i: int) -> torch.Tensor:
        return flat_bytes(self.get(i))

    def _allocate(self, i: int) -> torch.Tensor:
        info, request = self.infos[i], self.request
        piece = request.slices.get(info.name)
        shape = info.shape if piece is None else piece.shape
        dest = request.destinations.get(info.name)
        if (dest is not None and dest.device == request.device and dest.is_contiguous()
                and dest.dtype == info.torch_dtype and tuple(dest.shape) == tuple(shape)):
            self.new[i] = False
            tensor = dest
        elif request.device.type == "cpu":
            tensor = request.host_memory.empty(shape, info.torch_dtype)
        else:
            tensor = torch.empty(shape, dtype=info.torch_dtype, device=request.device)
        if piece is not None and piece.zeros:  # vocabulary padding: zero rows, never read nor sent
            flat = flat_bytes(tensor)
            for offset, length in piece.zeros:
                flat[offset:offset + length].zero_()
        return tensor

    def done(self, tensors: Sequence[int]) -> Iterator[tuple[str, torch.Tensor]]:
        """After a bucket over ``tensors`` arrived: the tensors now complete, in order."""
        for i in tensors:
            self.missing[i] -= 1
        yield from self.ready()

    def ready(self) -> Iterator[tuple[str, torch.Tensor]]:
        while self.next_out < len(self.infos) and self.missing[self.next_out] == 0:
            i = self.next_out
            self.next_out += 1
            tensor = self.get(i)  # an empty tensor (or one nobody reads) has no bucket
            self.tensors[i] = None  # the consumer holds it now
            yield self.infos[i].name, tensor


def _place(tensors: _Tensors, pieces: Sequence[TensorRun]) -> torch.Tensor | None:
    """The tensor memory that ``pieces`` fill in one unbroken range, if they do (then the bytes
    land there directly); None where they need placing piece by piece."""
    if tensors.staged or not pieces or len({i for i, _ in pieces}) != 1 \
            or not contiguous([r for _, r in pieces], dst=True):
        return None
    i, first = pieces[0]
    return tensors.flat(i)[first[1]:first[1] + run_bytes(r for _, r in pieces)]


class _Bucket:
    """One bucket in this round, as this rank sees it: on its reader, the read and the messages
    to send; on a member that keeps some of it, where the message lands."""

    def __init__(self, index: int, plan: ExchangePlan, me: int, tensors: _Tensors):
        self.index = index
        self.reader = plan.readers[index]
        self.spans = plan.spans[index]
        self.nbytes = plan.nbytes(index)
        self.mine = plan.pieces(index, me)  # what this rank keeps of it
        self.tensors = tensors
        for span in self.spans:  # allocated in file order, whoever reads
            tensors.get(span.tensor)
        self.buffer: torch.Tensor | None = None  # the reader's copy of the bucket, where it travels
        self.host: torch.Tensor | None = None  # where a reader on a device reads first
        self.reads: list[Future] = []
        self.requested = 0  # bytes its reader asked the source for
        self.landing: torch.Tensor | None = None  # where a receiver's message arrives
        self.placed = False  # the landing is the tensor itself (nothing to unpack)
        self.messages: list[tuple[int | None, torch.Tensor]] = []  # the reader's: (member, message); None: broadcast

    def in_place(self) -> torch.Tensor | None:
        """The reader's own tensor memory when the bucket is exactly the unbroken range it keeps."""
        runs = [r for _, r in self.mine]
        if len(self.spans) != 1 or not runs or runs[0][0] != 0 or run_bytes(runs) != self.nbytes \
                or not contiguous(runs, dst=False):
            return None
        return _place(self.tensors, self.mine)

    def pack(self, plan: ExchangePlan, me: int, k: int, broadcast: bool) -> None:
        """On the reader, once its read is in: the bucket onto the device, and each member's pieces
        packed into the message it is sent (one broadcast where every member keeps the same)."""
        assert self.buffer is not None
        if self.host is not None:  # read on the host, for a device
            self.buffer.copy_(self.host)
        if k == 1:
            return
        packed: dict[tuple, torch.Tensor] = {}  # members keeping the same pieces: one packing
        for m in range(k):
            pieces = self.mine if m == me else plan.pieces(self.index, m)
            if m == me and not broadcast or not pieces:
                continue
            key = tuple(pieces)
            if key not in packed:
                packed[key] = buckets.pack_runs(self.buffer, pieces)
            if broadcast:  # every member keeps these same pieces
                self.messages.append((None, packed[key]))
                break
            self.messages.append((m, packed[key]))

    def receive(self) -> None:
        """Prepare where this rank's pieces arrive (new host memory backed in one call first)."""
        if not self.mine:
            return
        self.landing = _place(self.tensors, self.mine)
        self.placed = self.landing is not None
        if self.landing is None:
            self.landing = torch.empty(run_bytes(r for _, r in self.mine), dtype=torch.uint8,
                                       device=self.tensors.wire)
        elif self.landing.device.type == "cpu" and self.tensors.new[self.mine[0][0]]:
            self.tensors.request.host_memory.prefault(self.landing.data_ptr(), self.landing.numel())

    def keep_own(self) -> None:
        """On the reader: its own pieces out of the buffer (nothing to do where it read in place)."""
        assert self.buffer is not None
        if not self.placed and self.mine:
            buckets.copy_runs(self.buffer, self.mine, self.tensors.flat)

    def arrived(self) -> None:
        """On a receiver: its message into its tensors (nothing to do where it landed in place)."""
        if self.landing is not None and not self.placed:
            buckets.unpack_runs(self.landing, self.mine, self.tensors.flat)

    def received(self) -> list[tuple[TensorInfo, int, memoryview]]:
        """On a receiver, once arrived: its pieces as (tensor, offset in the tensor's data in the
        file, the bytes in its memory), in file order. Rows with gaps between them in the file (a
        slice along a later dim) are left out: no block of the file lies whole in them."""
        out = []
        for i, (src, dst, n, count, src_step, dst_step) in self.mine:
            if count > 1 and not (src_step == n and dst_step == n):
                continue
            span = next(s for s in self.spans if s.tensor == i and s.at <= src < s.at + s.hi - s.lo)
            flat = self.tensors.flat(i)[dst:dst + n * count]
            if flat.device.type != "cpu":
                flat = flat.cpu()  # a device's bytes, once more over the bus, for the node's disk
            out.append((self.tensors.infos[i], span.lo + src - span.at, host_view(flat)))
        return out


def shared_stream(request: ReadRequest, run: BackendRun, reader: ByteReader, concurrency: int
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The shared read: ``(name, tensor)`` in file order, each rank reading its share."""
    group = request.group
    # the load's agreement (distload/loading/agreement.py) fills both
    members = list(request.options_as(SharedReadOptions).members)
    k = len(members)
    infos = [t for f in request.index.files for t in f.tensors]

    plan: ExchangePlan | None = None

    def planning() -> tuple[int, str]:  # inside the agreement: a rank that cannot plan stops every rank
        nonlocal plan
        needs, classes = member_needs(request, infos)
        if group.rank not in members or len(classes) != k:
            raise DistloadError(f"the shared read has members {members} but what {len(classes)} "
                                f"keep (the load's agreement fills both)")
        plan = ExchangePlan([t.nbytes for t in infos], needs, BUCKET_BYTES, classes)
        return math.ceil(len(plan.buckets) / k), plan.digest()

    planned = agree(group, planning, "planning the shared read")
    assert plan is not None
    me = members.index(group.rank)
    differing = [m for m in members if planned[m][1] != planned[group.rank][1]]
    if differing:  # every member sees the same digests, so all of them stop here
        raise GroupError(f"rank {group.rank}: rank(s) {', '.join(map(str, differing))} planned the shared read from "
                         f"other facts than this rank (tensor sizes, what each member keeps, bucket size: a file "
                         f"replaced between their header reads?), so their messages would not pair up; load again")
    rounds = max(n for n, _ in planned)  # the same count on every rank
    tensors = _Tensors(request, infos, plan, group.wire_device)
    run.requested_bytes = 0
    run.received_bytes = 0
    broadcast = plan.identical and k == group.world_size
    reads: dict[int, _Bucket] = {}

    def in_round(r: int) -> range:
        return range(r * k, min((r + 1) * k, len(plan.buckets)))

    def prepare(r: int) -> list[_Bucket]:
        this_round = []
        for b in in_round(r):
            bucket = reads.pop(b) if b in reads else _Bucket(b, plan, me, tensors)
            this_round.append(bucket)
            if bucket.reader == me:
                for future in bucket.reads:
                    future.result()
                bucket.pack(plan, me, k, broadcast)
            else:
                bucket.receive()
        return this_round

    try:
        with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="distload-shared") as pool:
            def start(r: int) -> None:  # a round past this rank's last has none of its buckets
                for b in in_round(r):
                    if plan.readers[b] == me:
                        reads[b] = _start_read(pool, _Bucket(b, plan, me, tensors), plan, reader)

            yield from tensors.ready()  # leading empty tensors
            for this_round in run_rounds(group, rounds, "reading its share", start, prepare,
                                         source=getattr(reader, "where", None)):
                _send(group, members, me, this_round, broadcast)
                for bucket in this_round:
                    if bucket.reader == me:
                        run.requested_bytes += bucket.requested
                        bucket.keep_own()
                    else:
                        run.received_bytes += 0 if bucket.landing is None else bucket.landing.numel()
                        bucket.arrived()
                        if bucket.mine and reader.keeps_received:
                            reader.received(bucket.received())
                    yield from tensors.done([span.tensor for span in bucket.spans])
            yield from tensors.ready()
    finally:
        reader.close()


def _start_read(pool: ThreadPoolExecutor, bucket: _Bucket, plan: ExchangePlan, reader: ByteReader) -> _Bucket:
    """Submit the reads of one bucket this rank reads: into its own tensor where the bucket is
    exactly what it keeps, else into a buffer (on the host first for a device)."""
    request = bucket.tensors.request
    own = bucket.in_place()
    bucket.placed = own is not None
    on_host = bucket.tensors.wire.type == "cpu"
    if own is not None:
        bucket.buffer = own
    elif on_host:
        bucket.buffer = request.host_memory.empty((bucket.nbytes,), torch.uint8)
    else:
        bucket.buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=request.device)
    target = bucket.buffer if on_host else request.host_memory.empty((bucket.nbytes,), torch.uint8)
    bucket.host = None if on_host else target
    view = host_view(target)
    fresh = own is None or not on_host or bucket.tensors.new[bucket.spans[0].tensor]  # untouched memory
    bucket.requested = plan.read_bytes(bucket.index)
    for span in bucket.spans:
        info = bucket.tensors.infos[span.tensor]
        extents = [(a, span.at + a - span.lo, b - a) for a, b in span.reads]
        for task in batch_extents(extents, reader.task_bytes):
            bucket.reads.append(pool.submit(_read, reader, info, task, view, request.host_memory if fresh else None,
                                            target.data_ptr()))
    return bucket


def batch_extents(extents: Sequence[Extent], chunk_bytes: int) -> list[list[Extent]]:
    """Reads of about ``chunk_bytes`` each: a large extent cut into chunks, small ones grouped."""
    batches: list[list[Extent]] = []
    current: list[Extent] = []
    size = 0
    for src, dst, length in extents:
        if length <= chunk_bytes:  # most extents (a row of a slice): no cutting
            if current and size + length > chunk_bytes:
                batches.append(current)
                current, size = [], 0
            current.append((src, dst, length))
            size += length
            continue
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


def _send(group, members: list[int], me: int, this_round: list[_Bucket], broadcast: bool) -> None:
    """Each bucket's messages from its reader to the members that keep some of it, packed and
    made room for already (collective over the group's members)."""
    if len(members) == 1:
        return
    pg = group.process_group
    ranks = group.ranks  # job-wide ranks: torch's collectives and sends take those
    works = []  # (bucket, the member at the other end: None for the reader's broadcast, work)
    bucket = this_round[0] if this_round else None
    peer = None
    try:
        for bucket in this_round:
            reader = ranks[members[bucket.reader]]
            if bucket.reader == me:
                for m, message in bucket.messages:
                    peer = None if m is None else members[m]
                    if peer is None:
                        works.append((bucket, peer, dist.broadcast(message, src=reader, group=pg, async_op=True)))
                    else:
                        works.append((bucket, peer, dist.isend(message, dst=ranks[peer], group=pg)))
            elif bucket.landing is not None:
                peer = members[bucket.reader]
                if broadcast:
                    works.append((bucket, peer, dist.broadcast(bucket.landing, src=reader, group=pg, async_op=True)))
                else:
                    works.append((bucket, peer, dist.irecv(bucket.landing, src=reader, group=pg)))
        with group.watched("the shared read"):
            for bucket, peer, work in works:
                work.wait(group.timeout)
    except Exception as exc:  # a member died or the timeout passed
        assert bucket is not None
        other = f"rank {peer}" if peer is not None else "the other ranks"
        raise GroupError(f"rank {group.rank}: lost contact with {other} while bucket {bucket.index} of the shared "
                         f"read ({bucket.nbytes} bytes, read by rank {members[bucket.reader]}) travelled: {collective_cause(exc)}"
                         f"{group.lost_peers(exc)}") from exc
