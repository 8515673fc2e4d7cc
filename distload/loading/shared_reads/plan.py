"""The job-wide exchange plan of a shared read: which bytes each member reads, and which bytes of
each bucket travel to which member (pure: every member computes the same plan from the same facts).

The facts: each tensor's size, and what each member keeps of it (its *need*: byte runs of the
tensor's data in its file, mapped to places in the member's own tensor; the whole tensor where it
is not split). The plan:

- per tensor, the *union* of the members' needs (the bytes somebody keeps): read once, by one
  member. For tensor-parallel slices the union is the whole tensor (the TP ranks' rows together),
  so a tensor split along dim 1 is read as one range, not row by row;
- *buckets* cut over those unions (tensor by tensor, in file order, as ``plan_buckets`` cuts), each
  one file range per tensor it covers, read into one buffer;
- one *reader* per bucket (``assign_readers``: balanced rounds over the members, each bucket to
  a member that keeps it where the loads allow: what its reader keeps, nobody sends);
- per member and bucket, its *pieces*: its need clipped to the bucket, as runs from the bucket's
  buffer into its tensor. A member receives exactly its pieces (packed, in order, one message),
  so it receives only what it keeps.

A need is kept as *runs* ``(src, dst, length, count, src_step, dst_step)``: ``count`` ranges of
``length`` bytes, the j-th from ``src + j * src_step`` to ``dst + j * dst_step``. A slice along
dim 1 (one range per row) is one run, which keeps the needs small enough to send to every rank
and lets a bucket's rows be packed and placed with one strided copy each.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import math
from typing import Iterable, Iterator, NamedTuple, Sequence

from distload.loading.buckets import ALIGN, Run, TensorRun, aligned, group_in_order, run_bytes

Need = tuple[Run, ...]  # one member's runs of one tensor, in its destination order
Interval = tuple[int, int]  # [start, end) of a tensor's data in its file

BUCKET_BYTES = 64 * 1024 * 1024
# Smaller buckets where the load is small for its members: at least BUCKETS_PER_MEMBER rounds, so
# that one member's extra bucket does not hold up the others (measured: 300 MiB over 4 ranks in
# 64 MiB buckets left one rank reading 37% of it).
MIN_BUCKET_BYTES = 4 * 1024 * 1024
BUCKETS_PER_MEMBER = 4


def whole_need(nbytes: int) -> Need:
    return ((0, 0, nbytes, 1, nbytes, nbytes),) if nbytes else ()


def compact(extents: Iterable[tuple[int, int, int]]) -> Need:
    """``(src, dst, length)`` extents (increasing in both) as runs: equal lengths at equal steps
    join one run."""
    runs: list[list[int]] = []
    for src, dst, n in extents:
        if runs:
            s, d, length, count, ss, ds = runs[-1]
            if n == length and count == 1 and src - s >= n and dst - d >= n:
                runs[-1] = [s, d, length, 2, src - s, dst - d]
                continue
            if n == length and count > 1 and src == s + count * ss and dst == d + count * ds:
                runs[-1][3] += 1
                continue
        runs.append([src, dst, n, 1, n, n])
    return tuple(tuple(r) for r in runs)  # type: ignore[misc]


def expand(runs: Iterable[Run]) -> Iterator[tuple[int, int, int]]:
    """Runs back to ``(src, dst, length)`` extents."""
    for src, dst, n, count, ss, ds in runs:
        for j in range(count):
            yield src + j * ss, dst + j * ds, n


def clip_runs(runs: Iterable[Run], lo: int, hi: int) -> list[Run]:
    """The parts of ``runs`` whose source lies in ``[lo, hi)`` (sources stay file-relative): rows
    wholly inside stay one run, a row cut by either end becomes a run of its own."""
    out: list[Run] = []
    for src, dst, n, count, ss, ds in runs:
        if n == 0 or count == 0:
            continue
        # rows j whose range [src + j*ss, src + j*ss + n) meets [lo, hi)
        first = max(0, (lo - src - n) // ss + 1) if count > 1 else 0
        last = min(count - 1, -(-(hi - src) // ss) - 1) if count > 1 else 0
        j = first
        while j <= last:
            start = src + j * ss
            a, b = max(start, lo), min(start + n, hi)
            if a >= b:
                j += 1
                continue
            if a == start and b == start + n:  # whole rows from j on, up to the last whole one
                whole_last = last if src + last * ss + n <= hi else last - 1
                rows = whole_last - j + 1
                out.append((start, dst + j * ds, n, rows, ss, ds))
                j = whole_last + 1
                continue
            out.append((a, dst + j * ds + a - start, b - a, 1, b - a, b - a))
            j += 1
    return out


def union(needs: Iterable[Need], nbytes: int) -> list[Interval]:
    """The bytes any of ``needs`` keeps, as sorted disjoint intervals (touching ones merged)."""
    needs = set(needs)
    if whole_need(nbytes) in needs:
        return [(0, nbytes)] if nbytes else []
    if _rows_fill(needs, nbytes):
        return [(0, nbytes)]
    spans = sorted((src, src + n) for need in needs for src, _, n in expand(need) if n)
    merged: list[list[int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _rows_fill(needs: Iterable[Need], nbytes: int) -> bool:
    """Whether ``needs`` together keep every byte of a tensor of ``nbytes``, told without listing
    rows where every run takes the same range of each of the tensor's rows (the TP slices of a
    dim-1 split: their ranges side by side fill a row, so their rows fill the tensor)."""
    runs = [run for need in needs for run in need if run[2]]
    if not runs or len({(count, step) for _, _, _, count, step, _ in runs}) != 1:
        return False
    count, step = runs[0][3], runs[0][4]
    if count < 2 or count * step != nbytes or any(src < 0 or src + n > step for src, _, n, _, _, _ in runs):
        return False
    end = 0
    for a, b in sorted((src, src + n) for src, _, n, _, _, _ in runs):
        if a > end:
            return False
        end = max(end, b)
    return end == step


class Segment(NamedTuple):
    """Bytes ``[start, start + length)`` of tensor number ``tensor``'s union (its needed bytes,
    gaps left out). (A named tuple: a 1T checkpoint's plan makes 47,000 of them, and a frozen
    dataclass's construction cost a third of the plan's time.)"""

    tensor: int
    start: int
    length: int


Bucket = tuple[Segment, ...]


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[Bucket]:
    """Buckets over tensors of ``sizes`` bytes (in order): a tensor of at least ``bucket_bytes``
    in equal buckets of its own, smaller neighbours grouped up to ``bucket_bytes``."""
    tensors = [i for i, n in enumerate(sizes) if n]  # an empty tensor travels in no bucket
    buckets: list[Bucket] = []
    for group in group_in_order([sizes[i] for i in tensors], bucket_bytes, alone=lambda n: n >= bucket_bytes):
        i = tensors[group[0]]
        n = sizes[i]
        if n < bucket_bytes:
            buckets.append(tuple(Segment(tensors[j], 0, sizes[tensors[j]]) for j in group))
            continue
        parts = math.ceil(n / bucket_bytes)
        # ceil(n / parts), then up to a multiple of ALIGN: a large tensor's buckets start on
        # ALIGN bytes (of its union)
        step = aligned(-(-n // parts), ALIGN)
        buckets += [(Segment(i, start, min(step, n - start)),) for start in range(0, n, step)]
    return buckets


def assign_readers(buckets: Sequence[Bucket], k: int, keeps: Sequence[Sequence[int]] | None = None,
                   classes: Sequence[int] | None = None) -> list[int]:
    """Which of ``k`` members reads each bucket: one bucket per member in each round of k, the
    round's largest bucket first, each to the member that has read least so far (ties by
    position), so that buckets of unequal sizes still spread evenly. ``keeps[b][c]``: the bytes
    a member of class c keeps of bucket b (``classes[m]``: member m's class, by default its own
    position: members that keep the same bytes share one); a member's load counts as that much
    lower for it, so a bucket goes to a member that keeps it where the loads allow (what its
    reader keeps, nobody sends). Pure: every member computes the same.

    Within a class the members differ only by load, so each bucket takes the best of the least
    loaded free member of each class that keeps some of it (a heap per class) and the least loaded
    free member of all (a heap): O(buckets x classes keeping it x log k), not O(buckets x k),
    which matters at a thousand members."""
    classes = list(range(k)) if classes is None else list(classes)
    count = max(classes, default=-1) + 1
    by_class: list[list[int]] = [[] for _ in range(count)]
    for m, c in enumerate(classes):
        by_class[c].append(m)
    load = [0] * k
    owners = [0] * len(buckets)
    sizes = [sum(s.length for s in bucket) for bucket in buckets]
    for first in range(0, len(buckets), k):
        round_ = sorted(range(first, min(first + k, len(buckets))), key=lambda b: (-sizes[b], b))
        # The round's free members: in one heap, and in one per class (taken ones skipped lazily).
        free = [[(load[m], m) for m in members] for members in by_class]
        for heap in free:
            heapq.heapify(heap)
        every = [(load[m], m) for m in range(k)]
        heapq.heapify(every)
        taken: set[int] = set()
        for b in round_:
            # A member of a class that keeps nothing of b is weighed by its load alone: the least
            # loaded free member overall stands for all of them; each class that keeps some of b
            # offers its least loaded free member, weighed by load less what it keeps.
            while every[0][1] in taken:
                heapq.heappop(every)
            best = (every[0][0], every[0][0], every[0][1])
            if keeps is not None:
                for c, kept in enumerate(keeps[b]):
                    if kept and c < count:
                        heap = free[c]
                        while heap and heap[0][1] in taken:
                            heapq.heappop(heap)
                        if heap:
                            best = min(best, (heap[0][0] - kept, heap[0][0], heap[0][1]))
            m = best[2]
            taken.add(m)
            owners[b] = m
            load[m] += sizes[b]
    return owners


class Span(NamedTuple):
    """One tensor's part of a bucket: file bytes ``[lo, hi)`` of tensor ``tensor``'s data, at
    ``at`` in the bucket's buffer; ``reads``: the needed intervals inside it (gaps are not read)."""

    tensor: int
    lo: int
    hi: int
    at: int
    reads: tuple[Interval, ...]


class ExchangePlan:
    """The plan for ``k`` members over tensors of ``sizes`` bytes; ``needs[m][i]``: member m's
    need of tensor i. Buckets, their readers, and each member's pieces of each bucket.

    ``classes`` (optional): ``needs`` then holds each *distinct* need once and ``classes[m]`` is
    member m's (the agreement sends each distinct need once: a thousand ranks of a TP-8 load
    keep 8). The plan's cost then grows with the distinct needs, not with the members."""

    def __init__(self, sizes: Sequence[int], needs: Sequence[Sequence[Need]], bucket_bytes: int = BUCKET_BYTES,
                 classes: Sequence[int] | None = None):
        if classes is None:
            needs, classes = distinct_needs(needs)
        self.distinct = [list(need) for need in needs]
        self.classes = list(classes)
        self.k = len(self.classes)
        self.sizes = list(sizes)
        # The layers of a model repeat their needs: each distinct (size, needs) unioned once.
        unions: dict[tuple, tuple[list[Interval], list[int]]] = {}
        self.unions: list[list[Interval]] = []
        self._starts: list[list[int]] = []  # the union offset of each interval
        for nbytes, column in zip(sizes, zip(*self.distinct)):  # column: tensor i's distinct needs
            key = (nbytes, tuple(sorted(set(column))))
            if key not in unions:
                merged = union(key[1], nbytes)
                unions[key] = (merged, [0] + _cumulative(merged))
            merged, starts = unions[key]
            self.unions.append(merged)
            self._starts.append(starts)
        totals = [s[-1] for s in self._starts]
        self.union_bytes = sum(totals)
        self.bucket_bytes = min(bucket_bytes, max(MIN_BUCKET_BYTES, self.union_bytes // (BUCKETS_PER_MEMBER * self.k)))
        self.buckets = plan_buckets(totals, self.bucket_bytes)
        self.spans = [self._spans(bucket) for bucket in self.buckets]
        keeps = [self.kept_bytes(b) for b in range(len(self.buckets))]
        self.readers = assign_readers(self.buckets, self.k, keeps, self.classes)
        # Every member keeps the same bytes of every tensor: one broadcast per bucket serves them.
        self.identical = len(set(self.classes)) <= 1

    @property
    def needs(self) -> list[list[Need]]:
        """Each member's need of each tensor (the distinct ones, shared by the members of a class)."""
        return [self.distinct[c] for c in self.classes]

    def digest(self) -> str:
        """The facts the plan is made of (tensor sizes, needs, bucket size), hashed: members
        compare it, since plans that differ would pair sends and receives of different sizes."""
        facts = (self.sizes, self.distinct, self.classes, self.bucket_bytes)
        return hashlib.sha256(repr(facts).encode()).hexdigest()

    def nbytes(self, b: int) -> int:
        """The size of bucket ``b``'s buffer."""
        last = self.spans[b][-1]
        return last.at + last.hi - last.lo

    def read_bytes(self, b: int) -> int:
        return sum(e - s for span in self.spans[b] for s, e in span.reads)

    def pieces(self, b: int, member: int) -> list[TensorRun]:
        """What ``member`` keeps of bucket ``b``: runs from the buffer into its tensors."""
        return self._pieces(b, self.distinct[self.classes[member]])

    def kept_bytes(self, b: int) -> list[int]:
        """The bytes each distinct need keeps of bucket ``b`` (needs equal on the bucket's tensors
        counted once: an expert's bucket has two, kept whole or not at all)."""
        spans = self.spans[b]
        known: dict = {}
        if len(spans) == 1:
            span = spans[0]
            i = span.tensor
            keys: list = [need[i] for need in self.distinct]
            # Nothing, or the whole tensor: no clipping needed (most of a model's buckets).
            known = {(): 0, whole_need(self.sizes[i]): span.hi - span.lo}
        else:
            keys = [tuple(need[span.tensor] for span in spans) for need in self.distinct]
        out = []
        for key, need in zip(keys, self.distinct):
            kept = known.get(key)
            if kept is None:
                kept = known[key] = run_bytes(run for _, run in self._pieces(b, need))
            out.append(kept)
        return out

    def _pieces(self, b: int, need: Sequence[Need]) -> list[TensorRun]:
        out: list[TensorRun] = []
        for span in self.spans[b]:
            for src, dst, n, count, ss, ds in clip_runs(need[span.tensor], span.lo, span.hi):
                out.append((span.tensor, (src - span.lo + span.at, dst, n, count, ss, ds)))
        return out

    def _spans(self, bucket: Bucket) -> tuple[Span, ...]:
        spans = []
        at = 0
        for segment in bucket:
            i = segment.tensor
            lo = self._file_offset(i, segment.start, end=False)
            hi = self._file_offset(i, segment.start + segment.length, end=True)
            reads = tuple((max(a, lo), min(b, hi)) for a, b in self.unions[i] if a < hi and b > lo)
            spans.append(Span(i, lo, hi, at, reads))
            at += hi - lo
        return tuple(spans)

    def _file_offset(self, i: int, offset: int, end: bool) -> int:
        """Where byte ``offset`` of tensor i's union lies in its data (``end``: the end of the
        byte before it, so that a bucket ends where its last needed byte does)."""
        starts, intervals = self._starts[i], self.unions[i]
        j = bisect.bisect_right(starts, offset - 1 if end else offset) - 1
        return intervals[j][0] + offset - starts[j]


def distinct_needs(needs: Sequence[Sequence[Need]]) -> tuple[list[Sequence[Need]], list[int]]:
    """Members' needs as (each distinct need once, in order of first use; each member's class)."""
    seen: dict[int, int] = {}  # id of a member's list -> class: members often share one list
    distinct: list[Sequence[Need]] = []
    by_value: dict[tuple, int] = {}
    classes = []
    for need in needs:
        c = seen.get(id(need))
        if c is None:
            c = by_value.setdefault(tuple(need), len(distinct))
            if c == len(distinct):
                distinct.append(need)
            seen[id(need)] = c
        classes.append(c)
    return distinct, classes


def _cumulative(intervals: Sequence[Interval]) -> list[int]:
    out, total = [], 0
    for a, b in intervals:
        total += b - a
        out.append(total)
    return out
