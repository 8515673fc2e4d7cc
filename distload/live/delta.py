"""Delta updates: what changed since the base, encoded, applied in place with its undo, and checked.

The *base* is the version every receiver of a trainer rank already holds: the trainer keeps a copy
of it in host memory (:class:`Base`, the tensors it pushed last, whole, in their own dtype; bounded
by ``max_bytes``), so that the next push sends only the elements whose bits changed. A trainer
step changes a few percent of a bf16 model's elements (benchmarks/results/sync.md), so the
encoding is element-level: a *patch* is the changed elements' flat positions and new values.

On the wire a piece's patch is (measured against sparse int32 positions, a bitmask and XOR with
zstd on real optimizer steps: benchmarks/bench_sync.py --deltas):

    [int32 count of changes per 64 Ki elements] [uint16 position within its chunk, each change]
    [pad to 8 bytes] [flips: new value XOR base value, each change, in the tensor's own bits]

4 bytes a change for bf16 plus 4 bytes per 64 Ki elements. A piece whose patch would not be at
most 1/WORTH of the piece itself travels *raw* (its bytes, as a full push sends them), in the same
update; one with no change sends nothing. The trainer's compare gives up on a tensor as soon as
its patch clearly cannot pay (:func:`gives_up`), and such a tensor then rests (whole, not compared:
Base.resting) a few pushes before it is compared again. Values are compared and flipped as integers of the element's size, so a bf16 NaN
or a -0.0 is a change like any other and the receiver ends with the trainer's exact bits.

Checks that cost in proportion to the change (every delta update, whatever ``verify`` says): for
each bucket the trainer sums its patches' new values (:func:`patch_sum`: as 8-byte words weighted
by their index, plus the positions); the receiver makes the same sum of the values it wrote, which are its old
values XOR the flips: the trainer's new values only where it held the base's. A receiver whose
tensors changed since the base at a changed position fails that sum (as does a patch read
wrong); it is undone from the values it found there. A drift at positions the trainer did not change is found by the
*audit*: each update also checks one window of 1/AUDIT_ROUNDS of every receiver's bytes, in turn
(:func:`audit_window`), so every byte is checked once every AUDIT_ROUNDS updates; a receiver whose
tensors moved (another storage: repacked or reallocated) or were written by a torch op (their
version counter moved: channel.py's ``_mark``) is sent the next update raw, before any byte moves.

Where the time goes, and why each step is a few whole-array numpy operations (no Python loop
per element): docs/delta-sync.md, "Speed".
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

from distload.live.transfer import BucketKey, BucketLayout, KeptSlice, SyncTensor, checksum, pack, run_bytes, unpack
from distload.loading.buckets import ALIGN, aligned, flat_bytes, offsets
from distload.loading.index import DTYPES
from distload.tp.place import TPPlace
from distload.tensor_io import host_view
from distload.runtime import RUNTIME
from distload.tp.slices import rank_slice

CHUNK_BITS = 16  # positions travel as their low 16 bits within chunks of 64 Ki elements
RAW = -1  # a piece's count in a bucket's header: sent whole (its patch would not pay)
# A patch pays where it is at most this fraction of the piece's bytes: per change a delta costs
# CPU on both sides that a whole piece's bytes do not (the trainer finds and encodes it, each
# receiver gathers, flips and scatters it and keeps its undo), so a patch only a little smaller
# than the piece loses time to the piece (benchmarks/results/sync_choice.md). For bf16 (4 bytes a
# change) that is up to one element in 8 changed.
WORTH = 4
# The margin where every receiver of a push reads the trainer's memory (same host): a byte whole
# then costs a memory copy, about what finding, encoding and applying a change costs per byte of
# its patch, so a patch must be far smaller to pay. Measured on one host: a patch stopped paying
# near 1.5% of the elements changed (bf16; results/sync_choice.md), 3% of the bytes; for bf16 this
# allows up to one element in 64 changed.
WORTH_SAME_HOST = 32
AUDIT_ROUNDS = 64  # every receiver byte is audited once every this many delta updates
# A tensor whose compare gave up rests (travels whole, neither compared nor copied into the base)
# 0 pushes, then 1, 2, 4 and at most this many while its compares keep giving up; then its copy
# is refreshed (one copy, the push goes whole) and it is compared again the push after: the cost
# of measuring a tensor that changes everywhere every push, a copy and a glance, spread over up
# to this many pushes, while one that gave up once (a warm-up's step) is compared again 2 pushes on.
MAX_REST = 8
_SCAN = 1 << 17  # elements compared per block: the block, its mask and temporaries stay in L2 (measured)
_APPLY = 8192  # changes a receiver applies per block (_apply_on_host; measured)
# A position's weight in a patch sum: odd, so a changed value always changes the sum (an odd
# number is invertible modulo 2**64); the golden-ratio multiplier spreads neighbouring positions.
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as an int64

# The integer dtype of each element size, by size (an immutable table).
log = logging.getLogger("distload")

_INT_OF_SIZE = (None, torch.uint8, torch.int16, None, torch.int32, None, None, None, torch.int64)


def int_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements as integers of their size (same memory, any strides)."""
    return tensor.detach().view(_INT_OF_SIZE[tensor.element_size()])


def flat_ints(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host tensor's elements as a 1-d integer view."""
    return int_view(tensor).reshape(-1)


# -- host arrays ----------------------------------------------------------------------------------
# On the host every step below runs on numpy arrays: under a loaded machine torch's CPU kernels
# (2 threads synchronising per op) measured 5-10x slower than numpy's single-threaded loops for
# these scans and gathers (bench_sync.py --deltas). Views of a caller's tensor go through ctypes
# (distload/tensor_io.py): a numpy view of the tensor itself would pin its storage for good.

def _np_int(itemsize: int) -> np.dtype:
    return np.dtype(f"<{'u' if itemsize == 1 else 'i'}{itemsize}")


def host_ints(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous host tensor's elements as a 1-d numpy integer view of its memory (writable;
    the view keeps the tensor alive)."""
    return np.frombuffer(host_view(tensor.detach().reshape(-1)), dtype=_np_int(tensor.element_size()))


def _array(tensor: torch.Tensor) -> np.ndarray:
    """A tensor of ours (a patch's, a gather's) as numpy."""
    return tensor.detach().cpu().numpy()


# -- finding what changed -------------------------------------------------------------------------

def _changed(a: np.ndarray, b: np.ndarray, scratch: "PatchScratch | None" = None, limit: int | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Where ``a`` (new) and ``b`` (base) differ: sorted positions (int64), ``a``'s values there
    and the flips (``a ^ b``) there (in ``scratch``'s memory where it has room). None, as soon as
    it is clear there are more than ``limit`` changes (:func:`gives_up`): the rest is not looked at."""
    per = 8 // a.itemsize
    shift = per.bit_length() - 1
    out = _Found(a.dtype, scratch)
    mask = np.empty(min(a.size, _SCAN) // per or 1, dtype=bool)  # reused: stays in cache
    for start in range(0, a.size, _SCAN):
        x, y = a[start:start + _SCAN], b[start:start + _SCAN]
        if per > 1 and x.size % per == 0:
            # 8-byte words first: at a few percent of changed elements most words are equal, and a
            # quarter as many items (bf16) to compare and scan is what makes the whole-state scan,
            # the trainer's cost of a delta, fast; only the differing words are looked into.
            x64, y64 = x.view(np.int64), y.view(np.int64)
            differ = np.not_equal(x64, y64, out=mask[:x64.size])
            # each differing word holds a change at least: a count that alone says the patch
            # cannot pay stops the compare before the changes are looked into (their extraction
            # is the costly part: every element changed, it was most of a 4.4 s push); in the
            # first block, so does the rate of changes that many differing words tell
            if limit is not None:
                words = int(np.count_nonzero(differ))
                if gives_up(out.size + words, start + x.size, a.size, limit, _rate_of_words(words, x64.size, per)):
                    out.drop()
                    return None
            words = np.flatnonzero(differ)
            new_words = x64[words]
            flip_words = y64[words]
            flip_words ^= new_words
            # the changed lanes of the differing words (a mask: nonzero of a mask is vectorised)
            lanes = np.flatnonzero(flip_words.view(a.dtype) != 0)
            positions, values, flips = out.next(lanes.size, a.size - start, x.size)
            np.take(new_words.view(a.dtype), lanes, out=values, mode="clip")  # valid; "raise" would copy
            np.take(flip_words.view(a.dtype), lanes, out=flips, mode="clip")
            # position = word * per + lane, in place (each temporary costs a pass over the changes)
            np.take(words, lanes >> shift, out=positions, mode="clip")
            positions <<= shift
            lanes &= per - 1
            positions += lanes
            if limit is not None and gives_up(out.size, start + x.size, a.size, limit):
                out.drop()
                return None
        else:
            lanes = np.flatnonzero(x != y)
            if limit is not None and gives_up(out.size + lanes.size, start + x.size, a.size, limit):
                out.drop()
                return None
            positions, values, flips = out.next(lanes.size, a.size - start, x.size)
            np.take(x, lanes, out=values, mode="clip")
            np.take(y, lanes, out=flips, mode="clip")
            flips ^= values
            positions[:] = lanes
        if start:
            positions += start
    if limit is not None and out.size > limit:
        out.drop()
        return None
    return out.done()


def gives_up(found: int, scanned: int, numel: int, limit: int, rate: float | None = None) -> bool:
    """Whether a compare that found ``found`` changes (or at least that many) in the first
    ``scanned`` of ``numel`` elements stops: past ``limit`` (the patch cannot pay), or, in its
    first block, at more than twice the rate that pays (every element changed, a high learning
    rate: one block of 128 Ki elements tells, where each further block would cost an extraction
    of its changes); ``rate``: the fraction of elements changed as its differing words tell it,
    where that is all it looked at yet. A tensor whose changes crowd into its first block is
    misjudged only towards sending it whole: what a full push sends."""
    if found > limit:
        return True
    if scanned > _SCAN:
        return False
    return max(found / scanned, rate or 0.0) * numel > 2 * limit


def _rate_of_words(words: int, of: int, per: int) -> float:
    """The fraction of elements changed that ``words`` differing 8-byte words of ``of`` tell, were
    the changes independent (a word of ``per`` elements differs with probability 1 - (1 - p)^per):
    at every element changed, or half, it is near 1 or 0.5, where the words' count alone (a change
    a word at least) says only 1/per or 1/(2 per)."""
    if not of or words >= of:
        return 1.0 if of else 0.0
    return 1.0 - (1.0 - words / of) ** (1.0 / per)


class PatchScratch:
    """Host memory for the arrays an update makes per change, kept from update to update: fresh
    arrays would cost their page faults every update (a fifth of the trainer's scan, measured).
    Per value dtype, ``lanes`` arrays: int64 positions, then ``lanes - 1`` of the dtype (the
    trainer: values and flips; a receiver: flips, the values found and those written). Grown to
    what the updates since the last :meth:`reset` took; what it hands out is valid until the next
    reset (the trainer's base commits its patches before: Base.begin; a receiver's undo is done
    with once its update ended)."""

    def __init__(self, lanes: int = 3) -> None:
        self.lanes = lanes
        self.arrays: dict[np.dtype, list[np.ndarray]] = {}
        self.used: dict[np.dtype, int] = {}
        self.wanted: dict[np.dtype, int] = {}  # what was taken since the last reset

    def reset(self) -> None:
        """A new update: everything handed out before is done with. Grows to what the last took."""
        for dtype, want in self.wanted.items():
            have = self.arrays.get(dtype)
            if have is None or have[0].size < want:
                room = want + want // 8
                self.arrays[dtype] = [np.empty(room, dtype=np.int64)] + [
                    np.empty(room, dtype=dtype) for _ in range(self.lanes - 1)]
        self.used = dict.fromkeys(self.arrays, 0)
        self.wanted = {}

    def take(self, count: int, dtype: np.dtype) -> list[np.ndarray]:
        """``count`` elements of each lane: in the scratch where it has room, else new arrays."""
        self.wanted[dtype] = self.wanted.get(dtype, 0) + count
        have, at = self.arrays.get(dtype), self.used.get(dtype, 0)
        if have is not None and at + count <= have[0].size:
            self.used[dtype] = at + count
            return [array[at:at + count] for array in have]
        return [np.empty(count, dtype=np.int64)] + [np.empty(count, dtype=dtype) for _ in range(self.lanes - 1)]


class _Found:
    """_changed's results, written block by block: into the scratch where it has room, else into
    arrays of its own, grown as needed (no copy of every block's results into one array)."""

    def __init__(self, dtype: np.dtype, scratch: PatchScratch | None):
        self.dtype, self.scratch = dtype, scratch
        free = scratch.arrays.get(dtype) if scratch is not None else None
        if free is not None:
            at = scratch.used[dtype]  # type: ignore[union-attr]
            self.arrays = [array[at:] for array in free[:3]]
        else:
            self.arrays = [np.empty(0, dtype=np.int64), np.empty(0, dtype=dtype), np.empty(0, dtype=dtype)]
        self.borrowed = free is not None
        self.size = 0

    def next(self, count: int, left: int, block: int) -> list[np.ndarray]:
        """Room for a block's ``count`` results, ``left`` elements before the end (this block's
        ``block`` of them included): own arrays grow to what the rest will take at this rate."""
        need = self.size + count
        if need > self.arrays[0].size:
            room = max(need + count * (left - block) // max(block, 1) + 1024, 2 * self.arrays[0].size)
            if self.borrowed:  # the scratch is full: on to arrays of our own
                self.arrays = [np.concatenate([array[:self.size], np.empty(room - self.size, array.dtype)])
                               for array in self.arrays]
                self.borrowed = False
            else:
                for array in self.arrays:
                    array.resize(room, refcheck=False)  # ours alone: no view of it is used after
        start, self.size = self.size, need
        return [array[start:need] for array in self.arrays]

    def drop(self) -> None:
        """The compare gave up: nothing it found is kept (the scratch's room is free again, and
        does not grow for it)."""
        self.size = 0
        self.arrays = []

    def done(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.scratch is not None:
            self.scratch.wanted[self.dtype] = self.scratch.wanted.get(self.dtype, 0) + self.size
        if self.borrowed:
            self.scratch.used[self.dtype] += self.size  # type: ignore[union-attr]
            return tuple(array[:self.size] for array in self.arrays)  # type: ignore[return-value]
        for array in self.arrays:
            array.resize(self.size, refcheck=False)
        return tuple(self.arrays)  # type: ignore[return-value]


def changed_positions(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Sorted flat positions (int64) where ``new`` and ``base`` (contiguous host tensors of one
    dtype and length) differ bit for bit."""
    return torch.from_numpy(_changed(host_ints(new), host_ints(base))[0])


@dataclass
class Patch:
    """A whole tensor's (or a piece's) change since the base: flat positions, the new values
    there and the flips (new XOR base: what travels)."""

    positions: torch.Tensor  # int64, sorted
    new: torch.Tensor  # the new values there (integer view)
    flips: torch.Tensor  # new ^ base there


def diff(new: torch.Tensor, base: torch.Tensor, scratch: PatchScratch | None = None,
         limit: int | None = None) -> Patch | None:
    """The patch from ``base`` to ``new`` (host tensors of one dtype and shape, contiguous); its
    arrays in ``scratch`` where it has room (valid until its next reset). None where it has more
    than ``limit`` changes (found out early: :func:`gives_up`)."""
    found = _changed(host_ints(new), host_ints(base), scratch, limit)
    if found is None:
        return None
    positions, values, flips = found
    return Patch(torch.from_numpy(positions), torch.from_numpy(values), torch.from_numpy(flips))


# A device compare's slab: the base goes up this many elements at a time (64 MiB of bf16), so the
# device holds one slab of the base, its mask and its patch (at most 17 bytes an element of bf16,
# when every element changed: 0.5 GiB), never a second copy of a whole tensor.
DEVICE_SLAB = 1 << 25


def diff_on_device(new: torch.Tensor, base: torch.Tensor, limit: int | None = None) -> Patch | None:
    """The patch from ``base`` (the trainer's host copy) to ``new`` where ``new`` lives (a GPU):
    the base goes up a slab at a time, the compare runs at the device's memory speed, and only
    the patch comes down. A host compare would first bring all of ``new`` down and then scan it
    at one core's speed (about 2 GB/s of bf16 state: slower than the link a full push takes).
    Torch ops only, the same on any device (the tests run them on the CPU). A state tensor that
    is not contiguous is made so first (one copy on the device). None where it has more than
    ``limit`` changes: found slab by slab, before any of that slab's changes come down."""
    x = int_view(new.contiguous()).reshape(-1)
    y = int_view(base).reshape(-1)
    parts = []
    found = 0
    for start in range(0, x.numel(), DEVICE_SLAB):
        ours = x[start:start + DEVICE_SLAB]
        theirs = y[start:start + DEVICE_SLAB].to(ours.device, non_blocking=True)
        at = torch.nonzero(ours != theirs).squeeze(1)  # sorted
        found += at.numel()
        if limit is not None and found > limit:
            return None
        values = ours[at]
        flips = torch.bitwise_xor(values, theirs[at])
        parts.append((at.add_(start).cpu(), values.cpu(), flips.cpu()))
    if not parts:  # no elements
        return Patch(torch.empty(0, dtype=torch.int64), x.new_empty(0).cpu(), x.new_empty(0).cpu())
    if len(parts) == 1:
        return Patch(*parts[0])
    return Patch(*(torch.cat(lane) for lane in zip(*parts)))


def piece_patch(patch: Patch, shape: Sequence[int], name: str, action, place: TPPlace,
                piece_shape: Sequence[int]) -> Patch:
    """The part of a whole tensor's ``patch`` that a receiver at ``place`` keeps (``action``: its
    piece's split, None for the whole tensor), in that piece's own flat positions."""
    if action is None:
        return patch
    cut = rank_slice(name, tuple(shape), action, place.rank, place.size)
    if cut is None:
        return patch
    dim = action.dim
    inner = 1
    for size in shape[dim + 1:]:
        inner *= int(size)
    whole_dim, kept_dim = int(shape[dim]), int(piece_shape[dim])
    # The outer indices kept (all, or an EP rank's experts' of a stacked tensor: cut.rows), each
    # with its own index in the piece.
    outers = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in cut.outer_runs(shape, dim)] or
                            [np.empty(0, dtype=np.int64)])
    at_piece = np.arange(outers.size, dtype=np.int64)
    # The tensor as (outer, whole_dim, inner): what the piece keeps of each outer index is one run
    # of flat positions per range of the split dimension. Taken in the piece's own order (outer,
    # then its ranges as they lie in the piece), the runs' positions come out sorted, whatever the
    # order of the ranges in the whole tensor: each run is found by bisection of the sorted
    # positions, and nothing is divided or compared per change.
    pos, new, flips = _array(patch.positions), _array(patch.new), _array(patch.flips)
    firsts, shifts, at = [], [], 0
    for start, stop in cut.ranges:
        firsts.append((start * inner, max(start, min(stop, whole_dim)) * inner))  # padding rows never change
        shifts.append((at - start) * inner)
        at += stop - start
    run = np.array(firsts, dtype=np.int64)
    lows = (outers[:, None] * (whole_dim * inner) + run[:, 0]).reshape(-1)
    highs = (outers[:, None] * (whole_dim * inner) + run[:, 1]).reshape(-1)
    moves = (at_piece[:, None] * (kept_dim * inner) - outers[:, None] * (whole_dim * inner)
             + np.array(shifts, dtype=np.int64)).reshape(-1)
    lo, hi = np.searchsorted(pos, lows), np.searchsorted(pos, highs)
    if lo.size <= 16:  # a few runs (a split of rows): slices of the patch, no gather
        keep = [(int(a), int(b), int(m)) for a, b, m in zip(lo, hi, moves)]
        return Patch(torch.from_numpy(np.concatenate([pos[a:b] + m for a, b, m in keep])),
                     torch.from_numpy(np.concatenate([new[a:b] for a, b, _ in keep])),
                     torch.from_numpy(np.concatenate([flips[a:b] for a, b, _ in keep])))
    lengths = hi - lo
    kept = int(lengths.sum())
    ends = np.cumsum(lengths)
    index = np.arange(kept, dtype=np.int64)
    index += np.repeat(lo - (ends - lengths), lengths)  # each kept change's index in the patch
    local = pos[index]
    local += np.repeat(moves, lengths)
    return Patch(torch.from_numpy(local), torch.from_numpy(new[index]), torch.from_numpy(flips[index]))


# -- the encoding ---------------------------------------------------------------------------------

def chunks(numel: int) -> int:
    return -(-numel // (1 << CHUNK_BITS))


def encoded_size(numel: int, count: int, itemsize: int) -> int:
    """Bytes of a patch of ``count`` changes to a piece of ``numel`` elements (0: no change)."""
    if not count:
        return 0
    return aligned(4 * chunks(numel) + 2 * count, 8) + count * itemsize


def pays(numel: int, count: int, itemsize: int, worth: int = WORTH) -> bool:
    """Whether a patch is worth sending: at most 1/``worth`` of the piece's own bytes (else the
    piece travels raw, as a full push sends it)."""
    return encoded_size(numel, count, itemsize) * worth <= numel * itemsize


def most_changes(numel: int, itemsize: int, worth: int = WORTH) -> int:
    """The most changes a patch of a piece of ``numel`` elements can have and still pay (a bound
    from above: the 8-byte alignment left out), the limit a compare gives up past."""
    return max(0, (numel * itemsize // worth - 4 * chunks(numel)) // (2 + itemsize))


def encode(into: torch.Tensor, numel: int, patch: Patch) -> None:
    """Write ``patch`` (of a piece of ``numel`` elements) into ``into``, 1-d uint8 of exactly
    ``encoded_size`` bytes, on any device."""
    positions, flips = _array(patch.positions), _array(patch.flips)
    count, m = positions.size, chunks(numel)
    values_at = aligned(4 * m + 2 * count, 8)
    on_host = into.device.type == "cpu" and into.is_contiguous()
    host = np.frombuffer(host_view(into), dtype=np.uint8) if on_host else np.empty(into.numel(), dtype=np.uint8)
    # The positions are sorted: each chunk's count is the distance between two bisections.
    bounds = np.searchsorted(positions, np.arange(m + 1, dtype=np.int64) << CHUNK_BITS)
    np.subtract(bounds[1:], bounds[:-1], out=host[:4 * m].view(np.int32), casting="unsafe")
    np.copyto(host[4 * m:4 * m + 2 * count].view(np.uint16), positions, casting="unsafe")  # the low 16 bits
    host[4 * m + 2 * count:values_at] = 0
    host[values_at:].view(flips.dtype)[:] = flips
    if not on_host:
        into.copy_(torch.from_numpy(host))


class PatchError(ValueError):
    """A patch whose counts or positions cannot be those of the piece: its bytes are not the
    bytes sent."""


def decode(data: torch.Tensor, numel: int, count: int, dtype: torch.dtype,
           into: Sequence[np.ndarray] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions (int64, sorted) and flips (integers of ``dtype``'s size) in ``data`` (a
    received buffer of ours, on any device), on the host (in ``into``: two arrays of ``count``,
    from a receiver's scratch, when given)."""
    raw = np.frombuffer(host_view(data.cpu()), dtype=np.uint8)
    m = chunks(numel)
    counts = raw[:4 * m].view(np.int32).astype(np.int64)
    if int(counts.sum()) != count or bool((counts < 0).any()):
        raise PatchError(f"the patch's chunk counts add up to {int(counts.sum())}, not {count}")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    positions, flips = into if into is not None else (np.empty(count, dtype=np.int64),
                                                      np.empty(count, dtype=_np_int(itemsize)))
    low = raw[4 * m:4 * m + 2 * count].view(np.uint16)
    # position = chunk * 64 Ki + low: each chunk's start repeated for its changes, plus the lows
    # (two passes over the changes; a running sum of jumps took three, measured 3x slower)
    np.add(np.repeat(np.arange(m, dtype=np.int64) << CHUNK_BITS, counts), low, out=positions)
    # Only the last chunk can reach past the piece: every other one ends inside it.
    tail = int(counts[-1]) if m else 0
    if tail and int(low[count - tail:].max()) >= numel - ((m - 1) << CHUNK_BITS):
        raise PatchError(f"a position lies past the piece's {numel} elements")
    values_at = aligned(4 * m + 2 * count, 8)
    flips[:] = raw[values_at:values_at + count * itemsize].view(_np_int(itemsize))
    return torch.from_numpy(positions), torch.from_numpy(flips)


# -- applying, with the undo ----------------------------------------------------------------------

@dataclass
class Undo:
    """What a delta update overwrote on a receiver, in the order written, to restore on failure;
    and which memory it has written (:func:`alias_key`), so that a tensor the receiver holds
    under two names (a tied weight: the embedding and the LM head) is patched once."""

    writes: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = field(default_factory=list)
    touched: set[tuple] = field(default_factory=set)
    # where whole pieces' old bytes go (keep_whole), by memory: a receiver's, kept between updates
    space: dict[tuple, torch.Tensor] = field(default_factory=dict)
    full_writes: set[tuple] = field(default_factory=set)  # memory a full update's sender wrote this update

    def restore(self) -> None:
        """Put back every overwritten value, last write first."""
        with torch.no_grad():
            for target, positions, old in reversed(self.writes):
                if positions is None:
                    target.detach().copy_(old)
                else:
                    _scatter(target, positions, old)
        self.writes.clear()
        self.touched.clear()
        self.full_writes.clear()


def alias_key(tensor: torch.Tensor) -> tuple:
    """The memory a tensor views, as a key: two names of one tensor (tied weights) have one."""
    return (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))


def _on_host(target: torch.Tensor) -> bool:
    return target.device.type == "cpu" and target.is_contiguous()


def _gather(target: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    if _on_host(target):
        return torch.from_numpy(host_ints(target)[_array(positions)])
    ints = int_view(target)
    positions = positions.to(target.device)
    if target.is_contiguous():
        return ints.reshape(-1)[positions].cpu()
    return ints[torch.unravel_index(positions, tuple(target.shape))].cpu()


def _scatter(target: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    if _on_host(target):
        host_ints(target)[_array(positions)] = _array(values)
        return
    ints = int_view(target)
    positions, values = positions.to(target.device), values.to(target.device)
    if target.is_contiguous():
        ints.reshape(-1).index_copy_(0, positions, values)
    else:
        ints[torch.unravel_index(positions, tuple(target.shape))] = values


def apply(target: torch.Tensor, positions: torch.Tensor, flips: torch.Tensor, undo: Undo,
          into: Sequence[np.ndarray] | None = None) -> torch.Tensor:
    """Flip the bits ``flips`` at flat ``positions`` (within ``target``: decode checked them) of
    ``target`` in place, keeping the overwritten values in ``undo``. Returns the values written,
    for the check: they are the trainer's new values only where ``target`` held the base's.
    ``into``: two arrays for the values found and written (a receiver's scratch), for a host target.

    A tensor this update already wrote under another name (a tied weight, whose patch under each
    name is the same) is not flipped twice, which would undo the change: its values are read back
    for the check, which then holds exactly where the two names' patches agree."""
    key = alias_key(target)
    if key in undo.touched:
        return _gather(target, positions)
    undo.touched.add(key)
    if into is not None and _on_host(target):
        return _apply_on_host(target, positions, flips, undo, into)
    with torch.no_grad():
        found = _gather(target, positions)
        written = torch.from_numpy(np.bitwise_xor(_array(found), _array(flips)))
        undo.writes.append((target, positions, found))
        _scatter(target, positions, written)
        return written


def _apply_on_host(target: torch.Tensor, positions: torch.Tensor, flips: torch.Tensor, undo: Undo,
                   into: Sequence[np.ndarray]) -> torch.Tensor:
    """apply() into a host tensor, in blocks of _APPLY changes: a block's writes land in the cache
    lines its reads of the values found just brought in. At a few percent of elements changed
    nearly every cache line of the tensor holds a change, so a whole-patch gather and then a
    whole-patch scatter would stream the tensor through memory twice (measured 1.75x slower)."""
    host, at, flipped = host_ints(target), _array(positions), _array(flips)
    found, written = into
    done = 0
    try:
        for start in range(0, at.size, _APPLY):
            where = at[start:start + _APPLY]
            old, new = found[start:start + _APPLY], written[start:start + _APPLY]
            np.take(host, where, out=old, mode="clip")  # ("raise" would copy)
            np.bitwise_xor(old, flipped[start:start + _APPLY], out=new)
            host[where] = new
            done = start + where.size
    finally:  # what was overwritten, however far it got
        undo.writes.append((target, positions[:done], torch.from_numpy(found[:done])))
    return torch.from_numpy(written)


def keep_whole(target: torch.Tensor, undo: Undo) -> None:
    """Before a raw piece overwrites ``target``: its old bytes into ``undo`` (in memory kept from
    update to update, ``undo.space``: a fresh copy each time would cost its page faults, as much
    again as the copy), and its memory noted as written, so that a tied name's patch is not
    flipped over the new bytes."""
    key = alias_key(target)
    old = target.detach()
    if key in undo.full_writes:  # a full sender's bytes: the rollback puts back what lay under them
        return
    if key in undo.touched:  # patched already this update (a tied name): these bytes, apart
        undo.writes.append((target, None, old.clone()))
        return
    undo.touched.add(key)
    held = undo.space.get(key)
    if held is None or held.shape != old.shape or held.dtype != old.dtype or held.device != old.device:
        held = undo.space[key] = torch.empty_like(old, memory_format=torch.contiguous_format)
    held.copy_(old)
    undo.writes.append((target, None, held))


# -- checks ---------------------------------------------------------------------------------------

def _index_weights(count: int) -> np.ndarray:
    """The first ``count`` patch-sum weights: odd, so a changed value always changes the sum (an
    odd number is invertible modulo 2**64), spread by the golden-ratio multiplier. Made once per
    process and kept in the runtime (8 bytes per change of the largest patch yet), not per patch."""
    table = RUNTIME.patch_weights
    if table is None or table.size < count:
        with np.errstate(over="ignore"):
            size = max(count, 2 * (0 if table is None else table.size))
            table = (np.arange(1, size + 1, dtype=np.int64) * _GOLDEN) | 1
        RUNTIME.patch_weights = table
    return table[:count]


def patch_sum(positions: torch.Tensor, values: torch.Tensor) -> int:
    """A sum of a patch's ``values`` weighted by index, plus the sum of its ``positions`` times an
    odd constant, modulo 2**64 (as a signed int64): one changed value or one moved position always
    changes it; the weights are a table, not made per patch.

    The values are summed as the 8-byte words their bits make, laid end to end (4 bf16 values a
    word; the last few values, short of a word, one by one): a quarter of the items to weigh for
    bf16 and no widened copy, and still any one changed value changes the sum (it changes its
    word by a nonzero multiple of 2**(16 * lane), less than 2**64, times an odd weight)."""
    pos, vals = _array(positions), np.ascontiguousarray(_array(values))
    per = 8 // vals.itemsize
    whole = vals.size - vals.size % per
    words, tail = vals[:whole].view(np.int64), vals[whole:].astype(np.int64)
    weights = _index_weights(words.size + tail.size)
    total = (int(np.dot(weights[:words.size], words)) + int(np.dot(weights[words.size:], tail))
             + int(pos.sum()) * _GOLDEN)
    return _wrap(total)


def _wrap(total: int) -> int:
    return (total + (1 << 63)) % (1 << 64) - (1 << 63)


def audit_window(sizes: Sequence[int], turn: int) -> list[tuple[int, int, int]]:
    """Turn ``turn``'s window of a receiver's pieces (their byte ``sizes``, in order, laid end to
    end): 1/AUDIT_ROUNDS of their bytes, as (piece, start, stop) byte ranges of its pieces."""
    total = sum(sizes)
    turn %= AUDIT_ROUNDS
    lo, hi = total * turn // AUDIT_ROUNDS, total * (turn + 1) // AUDIT_ROUNDS
    out, at = [], 0
    for i, size in enumerate(sizes):
        start, stop = max(lo, at), min(hi, at + size)
        if start < stop:
            out.append((i, start - at, stop - at))
        at += size
    return out


# -- the trainer's copy ---------------------------------------------------------------------------

class Base:
    """The trainer's copy of what every receiver holds (host memory, at most ``max_bytes``; None:
    no bound). A tensor past the bound is not kept: it travels raw in every update."""

    def __init__(self, max_bytes: int | None):
        self.max_bytes = max_bytes
        self.tensors: dict[str, torch.Tensor] = {}
        self.id: str | None = None  # what a receiver holding exactly this copy holds
        self._committing: threading.Thread | None = None
        self._failed: BaseException | None = None
        self.scratch = PatchScratch()  # the patches' memory (host: 12 bytes a change of bf16)
        self._shared: set[int] | None = None  # refresh's: ids of copies kept for two names
        # Copies that are not the receivers' version: name -> pushes each still rests before it is
        # refreshed (:meth:`refresh`); and how many times in a row each name's compare gave up.
        self.resting: dict[str, int] = {}
        self.gave_up: dict[str, int] = {}

    @property
    def nbytes(self) -> int:
        """Host bytes the copy holds (a tensor kept under two names, tied weights, counted once)."""
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in self.tensors.values()}.values())

    def held(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """The base of ``name`` where it matches ``tensor``'s dtype and shape (and is the version
        the receivers hold: not resting)."""
        base = self.tensors.get(name)
        if base is None or name in self.resting or base.dtype != tensor.dtype or base.shape != tensor.shape:
            return None
        return base

    def room_for(self, name: str, nbytes: int, pending: int) -> bool:
        """Whether a new tensor of ``nbytes`` fits the bound, beside ``pending`` bytes already to be kept."""
        if self.max_bytes is None:
            return True
        kept = self.nbytes - (self.tensors[name].numel() * self.tensors[name].element_size()
                              if name in self.tensors else 0)
        return kept + pending + nbytes <= self.max_bytes

    def refresh(self, name: str, tensor: torch.Tensor) -> None:
        """A resting copy's time is up: ``tensor`` (going whole in the push under way) into it, in
        place (its memory kept while it rested: no new memory, no page faults); it is compared
        again from the next push on, once this push's commit says every receiver holds it. A copy
        kept for two names (tied) is kept apart for this one instead."""
        self.settle()
        held = self.tensors[name]
        if self._shared is None:  # the copies kept under two names, found once a push
            seen: set[int] = set()
            self._shared = {id(t) for t in self.tensors.values() if id(t) in seen or seen.add(id(t))}
        if id(held) in self._shared:
            self.tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
            return
        held.copy_(tensor.detach())

    def compares_none(self, names: Sequence[str]) -> bool:
        """Whether a push of ``names`` compares none of them: each one's copy rests (its compare
        gave up lately) or there is none yet, so every byte goes whole."""
        return all(name in self.resting or name not in self.tensors for name in names)

    def rests(self, name: str) -> int | None:
        """None where ``name``'s copy is the version the receivers hold (or there is none); else
        how many more pushes it rests before it is refreshed (0: this one)."""
        return self.resting.get(name)

    def commit(self, patches: Mapping[str, Patch], copies: Mapping[str, torch.Tensor], new_id: str,
               later: bool = False, whole: Mapping[str, str] | None = None) -> None:
        """Every receiver now holds the pushed version: apply it to the copy (the changed positions
        only). ``later``: the patches are written by a thread (numpy releases the GIL while it
        scatters), so that the push that made them returns without waiting; :meth:`settle` waits
        for it, and every use of the copy comes after a settle. ``whole``: the names the push sent
        whole for the copy's sake, each as "gave up" (its compare did: it rests 0 pushes, then,
        while its compares keep giving up, 1, 2, 4, up to MAX_REST), "rested" (one push less to rest) or
        "refreshed" (:meth:`refresh`: compared again from now on)."""
        self.settle()
        self.tensors.update(copies)
        self.id = new_id
        for name in copies:  # a new copy: the receivers' version, whatever its name's copy was
            self.resting.pop(name, None)
            self.gave_up.pop(name, None)
        for name, what in (whole or {}).items():
            if what == "gave up":
                times = self.gave_up[name] = self.gave_up.get(name, 0) + 1
                self.resting[name] = min((1 << (times - 1)) >> 1, MAX_REST)
            elif what == "rested":
                self.resting[name] -= 1
            else:
                self.resting.pop(name, None)
        for name in patches:
            self.gave_up.pop(name, None)  # a patch again: the next give-up rests one push
        if not later:
            self._apply(patches)
            return
        self._committing = threading.Thread(target=self._apply_noting, args=(patches,), daemon=True,
                                            name="distload-base-commit")
        self._committing.start()

    def begin(self) -> None:
        """Before a push compares: the last commit written, its patches' memory free again."""
        self.settle()
        self.scratch.reset()
        self._shared = None

    def settle(self) -> None:
        """Wait for a commit made ``later``. If it failed, the copy is unknown: it is dropped (the
        next push sends every byte), and the reason logged."""
        thread, self._committing = self._committing, None
        if thread is not None:
            thread.join()
        if self._failed is not None:
            failed, self._failed = self._failed, None
            self.tensors.clear()
            self.id = None
            log.warning("the trainer's delta base could not take the last push (%s): the next push sends "
                        "every byte", failed)

    def _apply(self, patches: Mapping[str, Patch]) -> None:
        # A copy kept for two names (tied weights) stays one only while both take one patch: names
        # that were tied and no longer are (or one of them was not pushed) get copies of their own.
        shared: dict[int, list[str]] = {}
        for name, tensor in self.tensors.items():
            shared.setdefault(id(tensor), []).append(name)
        for names in shared.values():
            if len(names) > 1 and len({id(patches.get(name)) for name in names}) > 1:
                for name in names[1:]:
                    self.tensors[name] = self.tensors[name].clone()
        for name, patch in patches.items():
            host_ints(self.tensors[name])[_array(patch.positions)] = _array(patch.new)

    def _apply_noting(self, patches: Mapping[str, Patch]) -> None:
        try:
            self._apply(patches)
        except BaseException as exc:  # noqa: BLE001 - settle() reports it and drops the copy
            self._failed = exc


# -- buckets of a delta update --------------------------------------------------------------------
# A delta update sends, per bucket of a receiver's layout (transfer.py; consecutive buckets merged
# up to the trainer's bucket size: merged), two messages: a header
# (an int64 per piece: RAW, or its count of changes, 0 for none) and, when any piece changed,
# the data: each piece's patch or raw bytes at 64-byte aligned offsets. The header is what lets a
# receiver size the data message: a patch's size is known only once the trainer has compared.

def _itemsize(entry: SyncTensor) -> int:
    return DTYPES[entry.dtype].itemsize


def data_sizes(layout: BucketLayout, entries: Sequence[SyncTensor], counts: Sequence[int]) -> list[int]:
    """Each piece's bytes in a bucket's data message, from its header's ``counts``."""
    sizes = []
    for (piece, _), count in zip(layout.items, counts):
        size = _itemsize(entries[piece.entry])
        sizes.append(piece.nbytes if count == RAW else encoded_size(piece.nbytes // size, count, size))
    return sizes


def merged(plan: Sequence[BucketLayout], budget: int) -> list[tuple[int, BucketLayout]]:
    """A delta update's buckets for a receiver of ``plan`` (its layouts of the push's buckets):
    the buckets with bytes there, consecutive ones taken together while their whole bytes stay
    within ``budget`` (the trainer's bucket size; a bigger bucket alone). Each as (the index in
    ``plan`` of its last bucket, its layout). A full push sends a tensor of 4 MiB or more alone,
    from its own memory; its patch is a few percent of that, and every message costs a hand-off
    both ways: 35 buckets a receiver (a header and the data each) for the benchmark's 297 MiB
    model took 1.5x the time of 5
    (measured). Trainer and receivers derive the same list from the same layouts."""
    out: list[tuple[int, BucketLayout]] = []
    items: list = []
    size = 0
    last = -1
    for i, layout in enumerate(plan):
        if not layout.size:
            continue
        if items and size + layout.size > budget:
            out.append((last, BucketLayout(tuple(items), size)))
            items, size = [], 0
        items += layout.items
        size += layout.size
        last = i
    if items:
        out.append((last, BucketLayout(tuple(items), size)))
    return out


@dataclass
class Outgoing:
    """A delta bucket as the trainer decided to send it: per piece its header count (RAW: whole;
    0: unchanged or nothing kept; else its changes) and patch, its data message's size and the
    patch sum of the new values."""

    counts: list[int]
    parts: list[Patch | None]
    sizes: list[int]
    size: int  # the data message's bytes (0: no data message)
    total: int


def plan_bucket(layout: BucketLayout, entries: Sequence[SyncTensor], patches: Mapping[int, Patch],
                place: TPPlace, worth: int = WORTH) -> Outgoing:
    """What a bucket sends receivers at ``place``: each piece as its patch where that pays (by the
    margin ``worth``), else whole; a piece with no patch (no base, or its compare gave up) whole."""
    counts, parts = [], []
    total = 0
    for piece, _ in layout.items:
        entry = entries[piece.entry]
        patch = patches.get(piece.entry)
        if not piece.nbytes or patch is None:  # nothing kept, or no base (or too many changes): raw
            counts.append(0 if not piece.nbytes else RAW)
            parts.append(None)
            continue
        part = piece_patch(patch, entry.shape, entry.name, piece.action, place, piece.shape)
        count = part.positions.numel()
        if count and not pays(piece.nbytes // _itemsize(entry), count, _itemsize(entry), worth):
            counts.append(RAW)
            parts.append(None)
            continue
        counts.append(count)
        parts.append(part)
        if count:
            total += patch_sum(part.positions, part.new)
    sizes = data_sizes(layout, entries, counts)
    return Outgoing(counts, parts, sizes, offsets(sizes, ALIGN)[1], total)


def write_bucket(out: Outgoing, data: torch.Tensor, layout: BucketLayout, entries: Sequence[SyncTensor],
                 whole: Mapping[int, torch.Tensor], place: TPPlace) -> None:
    """Write the bucket's data message into ``data`` (``out.size`` bytes, where the caller sends
    it from: a buffer kept between updates, or the same-host segment)."""
    at, _ = offsets(out.sizes, ALIGN)
    gap = 0
    for (piece, _), count, part, offset, nbytes in zip(layout.items, out.counts, out.parts, at, out.sizes):
        data[gap:offset].zero_()  # the alignment gaps: the checksum covers them
        gap = offset + nbytes
        if count == RAW:
            pack(data[offset:offset + nbytes], BucketLayout(((piece, 0),), nbytes),
                 {piece.entry: whole[piece.entry].to(data.device)}, place)
        elif count:
            encode(data[offset:offset + nbytes], piece.nbytes // _itemsize(entries[piece.entry]), part)
    data[gap:].zero_()


def bucket_row(out: Outgoing, data: torch.Tensor, key: BucketKey) -> torch.Tensor:
    """A written bucket's row of the update's check: the tag of its header and ``data`` under
    ``key`` (transfer.checksum; the header's RAW marks are covered, so no piece can be made to
    read as whole or as a patch) and the patch sum of the new values."""
    return _row(data, key, out.counts, out.total)


def send_bucket(layout: BucketLayout, entries: Sequence[SyncTensor], whole: Mapping[int, torch.Tensor],
                patches: Mapping[int, Patch], place: TPPlace, device: torch.device, key: BucketKey
                ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A bucket's messages (header, then data where there is any) for receivers at ``place``, in
    new memory on ``device``, and its row of the update's check (:func:`write_bucket`)."""
    out = plan_bucket(layout, entries, patches, place)
    header = torch.tensor(out.counts, dtype=torch.int64).to(device)
    data = torch.empty(out.size, dtype=torch.uint8, device=device)
    write_bucket(out, data, layout, entries, whole, place)
    return ([header, data] if out.size else [header]), bucket_row(out, data, key)


def _row(data: torch.Tensor, key: BucketKey, counts: Sequence[int], total: int) -> torch.Tensor:
    """A delta bucket's row of the check: the tag of its header (``counts``) and data, and the
    patch sum of the values written."""
    header = np.asarray(counts, dtype="<i8").tobytes()
    return torch.cat([checksum(data, key, header).cpu(), torch.tensor([_wrap(total)], dtype=torch.int64)])


def receive_bucket(data: torch.Tensor | None, counts: Sequence[int], layout: BucketLayout,
                   entries: Sequence[SyncTensor], targets: Mapping[str, torch.Tensor], undo: Undo,
                   key: BucketKey, scratch: PatchScratch | None = None) -> torch.Tensor:
    """Apply a bucket's data into ``targets`` in place (the overwritten values into ``undo``; the
    arrays made per change in ``scratch``, 4 lanes, when given); returns its row of the check, as
    this receiver found it."""
    total = 0
    sizes = data_sizes(layout, entries, counts)
    at, _ = offsets(sizes, ALIGN)
    for (piece, _), count, offset, nbytes in zip(layout.items, counts, at, sizes):
        if not count:
            continue
        entry = entries[piece.entry]
        target = targets[entry.name]
        assert data is not None
        if count == RAW:
            keep_whole(target, undo)
            unpack(data[offset:offset + nbytes], BucketLayout(((piece, 0),), nbytes), entries, targets)
            continue
        lanes = scratch.take(count, _np_int(_itemsize(entry))) if scratch is not None else None
        positions, flips = decode(data[offset:offset + nbytes], piece.nbytes // _itemsize(entry), count,
                                  DTYPES[entry.dtype], None if lanes is None else lanes[:2])
        # The sum of the values written: the trainer's new values only where this rank held the
        # base's (a flip is undone by nothing else), at the positions as decoded (the data's
        # checksum covers the bytes that arrived, this their reading).
        total += patch_sum(positions, apply(target, positions, flips, undo, None if lanes is None else lanes[2:]))
    return _row(torch.empty(0, dtype=torch.uint8) if data is None else data, key, counts, total)


def audit_parts(plan: Sequence[BucketLayout], turn: int) -> dict[int, list[tuple[KeptSlice, int, int]]]:
    """This turn's audit window of a receiver's pieces, by bucket: (piece, start, stop) bytes."""
    pieces = [(i, piece) for i, layout in enumerate(plan) for piece, _ in layout.items]
    out: dict[int, list[tuple[KeptSlice, int, int]]] = {}
    for k, start, stop in audit_window([piece.nbytes for _, piece in pieces], turn):
        bucket, piece = pieces[k]
        out.setdefault(bucket, []).append((piece, start, stop))
    return out


def audit_row(data: torch.Tensor, key: BucketKey) -> torch.Tensor:
    return torch.cat([checksum(data, key).cpu(), torch.zeros(1, dtype=torch.int64)])


def sent_audit(parts: Sequence[tuple[KeptSlice, int, int]], whole: Mapping[int, torch.Tensor],
               place: TPPlace, key: BucketKey) -> list[torch.Tensor]:
    """The audit rows of ``parts`` from the version being sent (``whole``: its tensors)."""
    rows = []
    for piece, start, stop in parts:
        source = whole[piece.entry].detach()  # where it lives: only the window comes to the host
        if piece.run is not None:
            data = run_bytes(source, piece)[start:stop]
        else:
            data = torch.empty(piece.nbytes, dtype=torch.uint8, device=source.device)
            pack(data, BucketLayout(((piece, 0),), piece.nbytes), {piece.entry: source}, place)
            data = data[start:stop]
        rows.append(audit_row(data.cpu(), key))
    return rows


def held_audit(parts: Sequence[tuple[KeptSlice, int, int]], entries: Sequence[SyncTensor],
               targets: Mapping[str, torch.Tensor], key: BucketKey) -> list[torch.Tensor]:
    """The audit rows of ``parts`` from what a receiver's tensors hold."""
    return [audit_row(flat_bytes(targets[entries[piece.entry].name].detach().contiguous().cpu())[start:stop], key)
            for piece, start, stop in parts]
