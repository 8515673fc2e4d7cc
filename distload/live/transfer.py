"""What one weight-sync update moves, and how it sits in buckets: pure planning, no transport.

A sender describes its tensors as :class:`SyncTensor` (name, dtype, whole shape). Entries are grouped
in order into buckets of at most ``bucket_bytes`` whole bytes (a bigger tensor alone): the same
grouping for every receiver, so a sender gathers each group once (DTensor shards) however many
receiver layouts it packs. Each receiver keeps, by its place (distload/tp/place.py), the whole tensor or its
tensor-parallel slice under a sharding spec (distload/tp/slices.py, the rules ``save-sharded``
writes). A bucket as one place sees it is a :class:`BucketLayout`: its pieces at 64-byte aligned
offsets (the grouping and the offsets are distload/loading/buckets.py's, as for shared reads; the
copies are typed here: a TP slice of a tensor of any strides, its padding rows sent as zeros, into
a target of any strides). When the update is verified, the checksum of every bucket follows the
update's last bucket in one message: each a tag keyed with the job secret (:func:`checksum`),
so the check also proves who sent the bytes.

Sender and receivers compute the same layouts from the same metadata, so no layout travels.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from distload.errors import ConfigError
from distload.live.secret import Secret
from distload.loading.buckets import ALIGN, flat_bytes, group_in_order, offsets
from distload.loading.index import DTYPES
from distload.tp.experts import expert_action, others_expert
from distload.tp.place import TPPlace
from distload.tp.spec import BLOCK_SCALE_SUFFIXES, ShardingSpec, carry_block_scales
from distload.tp.slices import Action, rank_slice, shard_shape
from distload.tensor_io import host_view

CHECKSUM_BYTES = 16  # two int64 words a bucket: its tag (checksum)
# A verified bucket travels as one message, as a plain one does, and is summed whole: by the
# trainer while the transport copies it, by a receiver once it has landed. Sending it in 8 MiB
# frames, each summed while still in the CPU's cache, measured worse on the 2-core VM
# (bench_sync.py --only-verify, 567 MiB to 2 receivers, alternating runs: 26.7-31.5% against
# 14.5-22.0% whole): each extra message costs gloo more than the cache saves, and under the
# transport's own copies a frame is not in the cache by the time it is summed anyway.
# A tensor this big travels alone, and where what a receiver keeps of it is one contiguous run of
# its bytes (whole, or a slice along dim 0), straight from the sender's tensor: no packing copy.
# Below it, packing many tensors into one message costs less than a message each.
DIRECT_BYTES = 4 * 1024**2


@dataclass(frozen=True)
class SyncTensor:
    """One tensor of an update, as the sender holds it (whole)."""

    name: str
    dtype: str  # safetensors code (distload.loading.index.DTYPES)
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class KeptSlice:
    """What one receiver keeps of one entry."""

    entry: int  # index into the update's entries
    shape: tuple[int, ...]  # the receiver's tensor shape
    nbytes: int
    action: Action | None  # None: the whole tensor
    run: tuple[int, int] | None = None  # [start, stop) bytes of the whole tensor, where it is one run
    kept: bool = True  # False: another EP rank's expert, which this receiver does not hold at all


@dataclass(frozen=True)
class BucketLayout:
    """One bucket as receivers at one place see it."""

    items: tuple[tuple[KeptSlice, int], ...]  # (piece, byte offset)
    size: int  # bytes of its data: up to the end of the last piece
    direct: bool = False  # one piece, sent from the tensor itself (no packing copy)
    verified: bool = False  # its checksum follows the update's last bucket

    @property
    def wire_bytes(self) -> int:
        return self.size + (CHECKSUM_BYTES if self.verified and self.size else 0)


class Cuts:
    """What one receiver said it keeps of each tensor, by name: ``(dim, ranges)``, the ranges of
    ``dim`` it keeps (in the order it keeps them; none: nothing of that tensor); a name it does
    not list it keeps whole. A receiver whose layout no sharding rule describes posts it with each
    update: a vLLM worker, whose slices come from the weight map recorded from vLLM's own loaders
    (distload/vllm/sync.py). It stands where a place's sharding spec stands."""

    def __init__(self, cuts: Mapping[str, tuple[int, Sequence[Sequence[int]]]]):
        self.cuts = {name: (int(dim), tuple((int(a), int(b)) for a, b in ranges))
                     for name, (dim, ranges) in cuts.items()}

    def action(self, name: str, shape: Sequence[int]) -> Action:
        cut = self.cuts.get(name)
        if cut is None:
            return Action(None)
        dim, ranges = cut
        if not 0 <= dim < len(shape) or any(not 0 <= a < b <= shape[dim] for a, b in ranges):
            raise ConfigError(f"{name} {list(shape)}: the receiver keeps {list(ranges)} of dim {dim}, "
                              f"which the tensor does not have")
        return Action(dim, rule="the receiver's cut", ranges=ranges)

    def to_json(self) -> dict:
        return {name: [dim, [list(r) for r in ranges]] for name, (dim, ranges) in sorted(self.cuts.items())}

    @staticmethod
    def from_json(raw: Mapping[str, Any]) -> "Cuts":
        return Cuts({name: (dim, ranges) for name, (dim, ranges) in raw.items()})


def kept_slice(place: TPPlace, index: int, entry: SyncTensor, carried: Action | None = None) -> KeptSlice:
    """What a receiver at ``place`` keeps of ``entry``: the whole tensor, or its TP slice (or
    the cut it posted); with expert parallelism, its experts' (tp/experts.py: another EP rank's
    expert is not kept at all, a stacked tensor keeps its experts' rows). ``carried``: its action
    as :func:`carried_scales` gives it, where it is the block scales of a split weight."""
    whole = KeptSlice(index, entry.shape, entry.nbytes, None, (0, entry.nbytes))
    experts = place.experts
    if experts is not None:
        assert experts.num_experts is not None, "a receiver's expert count is known when its channel is made"
        if others_expert(entry.name, experts, experts.num_experts):  # before the rules: most experts are others'
            return KeptSlice(index, (), 0, None, kept=False)
    spec = place.spec
    if carried is not None:
        action = carried
    elif isinstance(spec, Cuts):
        action = spec.action(entry.name, entry.shape)
    elif spec is None or place.size == 1:
        if experts is None:
            return whole
        action = Action(None)
    else:
        assert isinstance(spec, ShardingSpec), "a receiver's spec is resolved when its channel is made"
        action = spec.action(entry.name, entry.shape)
    if experts is not None:  # its own experts as the spec says; stacked ones cut to its rows
        action, _ = expert_action(entry.name, entry.shape, action, experts,
                                  experts.num_experts)  # type: ignore[arg-type]
    if action.replicated:
        return whole
    shape = shard_shape(entry.name, entry.shape, action, place.size)
    nbytes = _numel(shape) * DTYPES[entry.dtype].itemsize
    cut = rank_slice(entry.name, entry.shape, action, place.rank, place.size)
    run = None
    if action.dim == 0 and cut is not None and len(cut.ranges) == 1 and not cut.padding:
        row = entry.nbytes // max(1, entry.shape[0])
        run = (cut.ranges[0][0] * row, cut.ranges[0][1] * row)
    return KeptSlice(index, shape, nbytes, action, run)


def carried_scales(entries: Sequence[SyncTensor], place: TPPlace) -> dict[int, Action]:
    """The FP8 block scales (``X.weight_scale_inv``) among ``entries`` that go with a weight the
    place's spec splits, by entry index: cut on the weight's blocks, as loads cut them
    (tp/spec.carry_block_scales; a slice off the blocks is refused when it is cut, naming the
    tensor, the block size and the TP sizes that work). A scale without its weight in ``entries``
    stays as the spec says."""
    spec = place.spec
    if not isinstance(spec, ShardingSpec) or place.size == 1:
        return {}
    scales = {e.name for e in entries if e.name.endswith(BLOCK_SCALE_SUFFIXES)}
    if not scales:
        return {}
    weights = {name[:-len("_scale_inv")] for name in scales}
    involved = [(e.name, e.shape, spec.action(e.name, e.shape)) for e in entries
                if e.name in scales or e.name in weights]
    actions = carry_block_scales(involved, spec.config)
    return {i: actions[e.name] for i, e in enumerate(entries)
            if e.name in scales and actions[e.name].scales is not None}


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


def group_entries(entries: Sequence[SyncTensor], bucket_bytes: int) -> list[tuple[int, ...]]:
    """SyncTensor indices, in order, grouped into buckets of at most ``bucket_bytes`` whole bytes
    (aligned as they would be packed whole; a bigger tensor alone)."""
    return group_in_order([entry.nbytes for entry in entries], bucket_bytes, align=ALIGN,
                          alone=lambda nbytes: nbytes >= DIRECT_BYTES)


def layouts(entries: Sequence[SyncTensor], groups: Sequence[Sequence[int]], place: TPPlace,
            verify: bool) -> list[BucketLayout]:
    """Every bucket as a receiver at ``place`` sees it (one whose pieces are all empty has size 0: nothing of it
    travels, on either side). Tensors it does not hold at all (other EP ranks' experts) are not in
    it: the receiver neither checks nor marks them."""
    out = []
    carried = carried_scales(entries, place)
    for group in groups:
        pieces = [piece for piece in (kept_slice(place, index, entries[index], carried.get(index)) for index in group)
                  if piece.kept]
        at, size = offsets([piece.nbytes for piece in pieces], ALIGN)  # so a piece can be viewed as its dtype
        items = list(zip(pieces, at))
        direct = (len(group) == 1 and len(items) == 1 and entries[group[0]].nbytes >= DIRECT_BYTES
                  and items[0][0].run is not None and size > 0)
        out.append(BucketLayout(tuple(items), size, direct, verify))
    return out


def run_bytes(tensor: torch.Tensor, piece: KeptSlice) -> torch.Tensor:
    """The bytes of ``tensor`` that ``piece`` keeps (its run), as a 1-d uint8 view where the
    tensor is contiguous (a copy where not)."""
    assert piece.run is not None
    return flat_bytes(tensor.detach().contiguous())[piece.run[0]:piece.run[1]]



def check_pieces(entries: Sequence[SyncTensor], pieces: Sequence[KeptSlice],
                 targets: Mapping[str, torch.Tensor]) -> list[str]:
    """What prevents receiving ``pieces`` into ``targets`` (empty: nothing), one line each."""
    problems = []
    for piece in pieces:
        entry = entries[piece.entry]
        dst = targets.get(entry.name)
        if dst is None:
            problems.append(f"{entry.name}: no such tensor here")
            continue
        if piece.nbytes and dst.untyped_storage().nbytes() == 0:
            # WeightSleeper empties each storage (or, where a storage cannot resize, the tensor)
            problems.append(f"{entry.name}: asleep (its storage holds 0 bytes): wake() the model "
                            f"before receiving into it")
        elif DTYPES[entry.dtype] != dst.dtype or tuple(dst.shape) != piece.shape:
            sliced = "" if piece.action is None else f" (its slice of {list(entry.shape)})"
            problems.append(f"{entry.name}: sent {entry.dtype} {list(piece.shape)}{sliced}, "
                            f"here {dst.dtype} {list(dst.shape)}")
    return problems


def pack(buffer: torch.Tensor, layout: BucketLayout, tensors: Mapping[int, torch.Tensor], place: TPPlace) -> None:
    """Copy each piece of ``layout`` from the whole ``tensors`` (by entry index) into ``buffer``."""
    for piece, offset in layout.items:
        if not piece.nbytes:
            continue
        source = tensors[piece.entry]
        region = buffer[offset:offset + piece.nbytes]
        if piece.action is None:
            region.copy_(flat_bytes(source.detach()))
            continue
        dst = region.view(source.dtype).view(piece.shape)
        dim = piece.action.dim
        assert dim is not None
        cut = rank_slice("", tuple(source.shape), piece.action, place.rank, place.size)
        assert cut is not None
        pairs = [(source, dst)]
        if cut.rows is not None:  # an EP rank's experts of a stacked tensor, each then cut along ``dim``
            pairs, kept = [], 0
            for first, last in cut.rows:
                pairs.append((source[first:last], dst[kept:kept + last - first]))
                kept += last - first
        for whole, out in pairs:
            at = 0
            for start, stop in cut.ranges:
                out.narrow(dim, at, stop - start).copy_(whole.narrow(dim, start, stop - start))
                at += stop - start
            if cut.padding:  # a padded vocabulary's zero rows
                out.narrow(dim, at, cut.padding).zero_()


def unpack(buffer: torch.Tensor, layout: BucketLayout, entries: Sequence[SyncTensor],
           targets: Mapping[str, torch.Tensor]) -> None:
    """Copy each piece of ``layout`` out of ``buffer`` into its target tensor, in place."""
    with torch.no_grad():
        for piece, offset in layout.items:
            if not piece.nbytes:
                continue
            entry = entries[piece.entry]
            dst = targets[entry.name].detach()
            dst.copy_(buffer[offset:offset + piece.nbytes].view(DTYPES[entry.dtype]).view(piece.shape))


class BucketKey:
    """The key of one trainer rank's buckets in one update: :func:`checksum` tags every bucket
    with it. Derived from the job secret (distload/live/secret.py), the session, the update's number
    and the trainer rank, so a tag proves who sent the bytes and is good for that update only: a
    bucket replayed from another update, session or trainer rank fails. Without a secret the
    same key is derived from public values: the tag still catches transport and buffer faults,
    and proves nothing."""

    def __init__(self, secret: Secret | None, session: str, seq: int, trainer: int):
        base = secret.key("buckets") if secret is not None else _PUBLIC_BUCKETS
        self.mac = hmac.new(base, f"{session}/{seq}/{trainer}".encode(), hashlib.sha256).digest()
        stream = b"".join(hmac.new(self.mac, b"nh%d" % i, hashlib.sha256).digest() for i in range(_NH_WORDS // 8))
        self.nh = np.frombuffer(stream, dtype=np.uint32).copy()  # one NH key word per 4 bytes of a block
        self._on: dict[torch.device, torch.Tensor] = {}

    def nh_on(self, device: torch.device) -> torch.Tensor:
        """The NH key as int64 on ``device`` (the torch path's)."""
        if device not in self._on:
            self._on[device] = torch.from_numpy(self.nh.astype(np.int64)).to(device)
        return self._on[device]


_PUBLIC_BUCKETS = b"distload buckets without a secret"  # an HMAC key anyone knows
_NH_WORDS = 1024  # an NH block: 4 KiB, 1024 32-bit words
_NH_BLOCK = _NH_WORDS * 4
_NH_ROWS = 128  # blocks hashed at a time on the host: 512 KiB, in L2 with its temporaries


def checksum(data: torch.Tensor, key: BucketKey, extra: bytes = b"") -> torch.Tensor:
    """The tag of ``data`` (a 1-d uint8 tensor, one bucket, on its device) and ``extra`` (a delta
    bucket's header) under ``key``: two int64 words, the first 16 bytes of
    HMAC-SHA256(key, length, extra, NH(data)).

    NH (UMAC's hash, RFC 4418) takes each 4 KiB block to 8 bytes, sum of ((m[2i] + k[2i]) mod
    2^32) * ((m[2i+1] + k[2i+1]) mod 2^32) mod 2^64: one pass, an add and a multiply per 8 bytes,
    on the device that holds the bucket (only 1/512 of it comes to the host for the HMAC). Two
    different buckets of one length give the same NH with probability at most 2^-32 over the
    secret key, so a forged bucket passes at most once in 2^32 tries, each a failed, loud update
    (the next has a new key). SHA-256 over every byte ran at 1 GB/s on one core here, NH at about
    2 GB/s and on a GPU at its memory's speed (docs/security.md)."""
    nbytes = data.numel()
    if data.device.type == "cpu" and data.is_contiguous():
        digest = _host_nh(np.frombuffer(host_view(data), dtype=np.uint8), key.nh)
    else:
        digest = _device_nh(data, key.nh_on(data.device)).cpu().numpy()
    tag = hmac.new(key.mac, struct.pack(">QI", nbytes, len(extra)) + extra + digest.tobytes(), hashlib.sha256)
    return torch.frombuffer(bytearray(tag.digest()[:CHECKSUM_BYTES]), dtype=torch.int64)


def _host_nh(raw: np.ndarray, key: np.ndarray) -> np.ndarray:
    """NH of every 4 KiB block of ``raw`` (the last zero-padded), as little-endian uint64s.
    Blocks go _NH_ROWS at a time through scratch arrays that stay in the cache: whole-array numpy
    (a temporary per step, each the bucket's size or twice it) measured 3x slower."""
    whole = raw.size // _NH_BLOCK
    out = np.empty(whole + (raw.size % _NH_BLOCK > 0), dtype="<u8")
    added = np.empty((_NH_ROWS, _NH_WORDS), dtype=np.uint32)
    low = np.empty((_NH_ROWS, _NH_WORDS // 2), dtype=np.uint64)
    high = np.empty_like(low)
    blocks = raw[:whole * _NH_BLOCK].view("<u4").reshape(whole, _NH_WORDS)
    if raw.size % _NH_BLOCK:
        tail = np.zeros(_NH_BLOCK, dtype=np.uint8)
        tail[:raw.size % _NH_BLOCK] = raw[whole * _NH_BLOCK:]
        blocks = [blocks, tail.view("<u4").reshape(1, _NH_WORDS)]
    else:
        blocks = [blocks]
    at = 0
    for part in blocks:
        for i in range(0, part.shape[0], _NH_ROWS):
            rows = part[i:i + _NH_ROWS]
            n = rows.shape[0]
            np.add(rows, key, out=added[:n])  # wraps mod 2^32
            pairs = added[:n].view("<u8")  # word 2i in the low half, 2i+1 in the high
            np.bitwise_and(pairs, np.uint64(0xFFFFFFFF), out=low[:n])
            np.right_shift(pairs, np.uint64(32), out=high[:n])
            np.multiply(low[:n], high[:n], out=low[:n])  # wraps mod 2^64
            low[:n].sum(axis=1, out=out[at:at + n])
            at += n
    return out


_DEVICE_SLAB = 4 << 20  # bytes of a device bucket hashed at a time (its int64 temporaries: 8x)


def _device_nh(data: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """:func:`_host_nh` with torch ops, on ``data``'s device: int64 arithmetic, whose wrapping
    is the same bits as uint64's."""
    nbytes = data.numel()
    padded = -(-nbytes // _NH_BLOCK) * _NH_BLOCK
    out = []
    for start in range(0, padded, _DEVICE_SLAB):
        stop = min(start + _DEVICE_SLAB, padded)
        chunk = data[start:min(stop, nbytes)]
        if chunk.numel() != stop - start:
            chunk = torch.cat([chunk, torch.zeros(stop - start - chunk.numel(), dtype=torch.uint8, device=data.device)])
        elif chunk.storage_offset() % 4:
            chunk = chunk.clone()
        words = chunk.view(torch.int32).to(torch.int64).view(-1, _NH_WORDS) & 0xFFFFFFFF
        words = (words + key) & 0xFFFFFFFF
        out.append((words[:, 0::2] * words[:, 1::2]).sum(dim=1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64, device=data.device)


def first_mismatch(sums: torch.Tensor, expected: torch.Tensor) -> int | None:
    """The index of the first row of ``sums`` (one checksum a verified bucket, as received) that
    differs from ``expected`` (as sent); None when all match."""
    if torch.equal(sums, expected):
        return None
    return int((sums != expected).any(dim=1).nonzero()[0])
