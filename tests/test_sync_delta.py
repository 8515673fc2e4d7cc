"""Delta updates (distload/live/delta.py) as pure functions: what changed, its encoding, a TP
piece's share of it, the undo, the checks and the audit window. The protocol between jobs is
tested in tests/test_sync_jobs.py (the "delta" scenario) and inside one job in tests/test_sync.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distload.live import delta as deltas
from distload.live.transfer import BucketKey, SyncTensor, group_entries, layouts, pack
from distload.loading.index import dtype_code
from distload.tp.place import TPPlace
from distload.tp.slices import take_shard
from distload.tp.spec import load_spec

KEY = BucketKey(None, "session", 0, 0)  # the tags' key in these tests (no secret: the same code path)

def _bits(t: torch.Tensor) -> torch.Tensor:
    return deltas.flat_ints(t.contiguous())


def _changed(shape, dtype, fraction, seed=0):
    """A tensor and a copy with about ``fraction`` of its elements changed (bit patterns)."""
    gen = torch.Generator().manual_seed(seed)
    old = (torch.randn(shape, generator=gen) * 4).to(dtype)
    new = old.clone()
    ints = deltas.flat_ints(new)
    hit = torch.rand(ints.numel(), generator=gen) < fraction
    ints[hit] ^= 1  # the lowest bit: the smallest change a value can make
    return old, new


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("numel", [1, 7, 4096 + 3, (1 << 16) * 3 + 5])
def test_changed_positions_are_every_element_whose_bits_differ(dtype, numel):
    old, new = _changed((numel,), dtype, 0.05)
    want = torch.ne(_bits(old), _bits(new)).nonzero().squeeze(1)
    got = deltas.changed_positions(_bits(new), _bits(old))
    assert torch.equal(got, want)
    # Unaligned views (a slice one element in) take the element-wise path and agree.
    if numel > 1:
        got = deltas.changed_positions(_bits(new)[1:], _bits(old)[1:])
        assert torch.equal(got, want[want > 0] - 1)


def test_a_nan_payload_and_a_signed_zero_are_changes():
    old = torch.tensor([0.0, float("nan"), 1.0, 2.0], dtype=torch.bfloat16)
    new = old.clone()
    new[0] = -0.0  # == 0.0 as a number, other bits
    deltas.flat_ints(new)[1] ^= 1  # another NaN
    assert deltas.diff(new, old).positions.tolist() == [0, 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.bool])
def test_the_device_compare_finds_the_host_compares_patch_bit_for_bit(dtype, monkeypatch):
    """A GPU state is compared where it lives (torch ops, the base going up a slab at a time);
    the same ops run here on the CPU and must give the numpy compare's patch exactly, across slab
    edges, for NaN payloads and signed zeros, and for a state that is not contiguous."""
    monkeypatch.setattr(deltas, "DEVICE_SLAB", 1000)
    if dtype == torch.bool:
        old = torch.rand(3 * 1000 + 17) < 0.5
        new = old.clone()
        new[torch.rand(new.numel()) < 0.05] ^= True
    else:
        old, new = _changed((3 * 1000 + 17,), dtype, 0.05)
        if dtype.is_floating_point and dtype.itemsize > 1:
            old[:2] = torch.tensor([0.0, float("nan")], dtype=dtype)
            new[:2] = old[:2]
            new[0] = -0.0
            deltas.flat_ints(new)[1] ^= 1
    host = deltas.diff(new, old)
    device = deltas.diff_on_device(new, old)
    assert device.positions.numel() > 50
    for got, want in ((device.positions, host.positions), (device.new, host.new), (device.flips, host.flips)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    if dtype.is_floating_point and dtype.itemsize > 1:
        assert device.positions[:2].tolist() == [0, 1]
    # A transposed state (a view of other strides) is compared in its logical order.
    square_old, square_new = old[:3000].view(60, 50), new[:3000].view(60, 50)
    got = deltas.diff_on_device(square_new.t(), square_old.t().contiguous())
    want = deltas.diff(square_new.t().contiguous(), square_old.t().contiguous())
    assert torch.equal(got.positions, want.positions) and torch.equal(got.flips, want.flips)
    # Nothing changed, or nothing there: an empty patch, not an error.
    assert deltas.diff_on_device(old, old.clone()).positions.numel() == 0
    for empty in (old[:0], old[:0].view(0, 1).expand(0, 4)):
        got = deltas.diff_on_device(empty, empty.contiguous().clone())
        want = deltas.diff(empty.contiguous(), empty.contiguous().clone())
        assert got.positions.numel() == 0 and got.new.dtype == want.new.dtype and got.flips.dtype == want.flips.dtype


@pytest.mark.parametrize("scratch", [False, True])
@pytest.mark.parametrize("numel,count", [(10, 3), ((1 << 16) * 2 + 9, 2000), ((1 << 16) * 4, 1),
                                         ((1 << 16) * 3, 3 * 8192 + 5)])
def test_a_patch_decodes_to_what_was_encoded_and_applies_exactly(numel, count, scratch):
    """Through torch's ops, or (``scratch``: a receiver's arrays, a host tensor) numpy's in blocks
    of changes (several blocks and a short last one in the last case)."""
    old, _ = _changed((numel,), torch.bfloat16, 0.0)
    gen = torch.Generator().manual_seed(numel)
    positions = torch.randperm(numel, generator=gen)[:count].sort().values
    new = old.clone()
    deltas.flat_ints(new)[positions] += 3
    patch = deltas.diff(new, old)
    assert torch.equal(patch.positions, positions)
    size = deltas.encoded_size(numel, count, 2)
    assert size == deltas.aligned(4 * deltas.chunks(numel) + 2 * count, 8) + 2 * count
    data = torch.full((size,), 0xAB, dtype=torch.uint8)
    deltas.encode(data, numel, patch)
    got_positions, flips = deltas.decode(data, numel, count, torch.bfloat16)
    assert torch.equal(got_positions, positions) and torch.equal(flips, patch.flips)
    assert torch.equal(flips, _bits(new)[positions] ^ _bits(old)[positions])
    target = old.clone()
    undo = deltas.Undo()
    into = [np.full(count, 7, dtype=np.int16), np.full(count, 7, dtype=np.int16)] if scratch else None
    written = deltas.apply(target, got_positions, flips, undo, into)
    assert torch.equal(_bits(target), _bits(new)) and torch.equal(written, patch.new)
    undo.restore()
    assert torch.equal(_bits(target), _bits(old))


def test_an_apply_that_fails_between_blocks_is_undone_exactly(monkeypatch):
    """A receiver's apply stopped after two blocks of changes: its undo holds what those two
    overwrote, and nothing it never read (the rest of the scratch is stale), so the restore gives
    back the old tensor bit for bit."""
    old, new = _changed((1 << 18,), torch.bfloat16, 0.2)
    patch = deltas.diff(new, old)
    assert patch.positions.numel() > 3 * 8192
    target = old.clone()
    undo = deltas.Undo()
    real, calls = np.take, []

    def take(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("injected: the third block fails")
        return real(*args, **kwargs)

    monkeypatch.setattr(np, "take", take)
    into = [np.full(patch.positions.numel(), 7, dtype=np.int16) for _ in range(2)]
    with pytest.raises(MemoryError):
        deltas.apply(target, patch.positions, patch.flips, undo, into)
    monkeypatch.setattr(np, "take", real)
    assert not torch.equal(_bits(target), _bits(old))  # two blocks landed
    undo.restore()
    assert torch.equal(_bits(target), _bits(old))


def test_a_corrupted_patch_is_refused_before_it_writes():
    old, new = _changed((5000,), torch.float32, 0.1)
    patch = deltas.diff(new, old)
    count = patch.positions.numel()
    data = torch.empty(deltas.encoded_size(5000, count, 4), dtype=torch.uint8)
    deltas.encode(data, 5000, patch)
    counts = data[:4].view(torch.int32)
    counts += 1
    with pytest.raises(deltas.PatchError, match="add up to"):
        deltas.decode(data, 5000, count, torch.float32)
    counts -= 1
    with pytest.raises(deltas.PatchError, match="past the piece"):
        deltas.decode(data, 4000, count, torch.float32)


def test_a_patch_pays_only_at_a_quarter_of_the_piece_or_less():
    assert deltas.pays(1 << 20, 1000, 2)
    assert not deltas.pays(1 << 20, 1 << 19, 2)  # half the elements: 4 bytes a change, 2 a piece's element
    # an eighth of a bf16 piece's elements is a patch of a quarter of its bytes (and the chunk counts)
    assert deltas.pays(1 << 20, (1 << 17) - 16, 2) and not deltas.pays(1 << 20, (1 << 17) + 16, 2)
    assert not deltas.pays(3, 1, 4)  # the chunk count alone costs as much
    assert deltas.encoded_size(1 << 20, 0, 2) == 0


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("numel", [1, 100, (1 << 16) + 1, 1 << 20, 3 * (1 << 16) + 77])
def test_the_compares_limit_never_gives_up_on_a_patch_that_pays(numel, itemsize):
    """most_changes bounds the changes of a patch that pays from above: a compare that gives up
    past it only ever sends whole a piece whose patch would not have paid."""
    most = deltas.most_changes(numel, itemsize)
    assert not deltas.pays(numel, most + 1, itemsize)
    assert all(not deltas.pays(numel, count, itemsize) for count in range(most + 1, min(numel, most + 50) + 1))
    assert most == 0 or deltas.pays(numel, max(1, most - 8), itemsize)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_a_compare_gives_up_before_it_takes_out_the_changes(dtype):
    """Every element changed (or half): the compare of a tensor of 4 blocks gives up in its first
    block, from the count of its differing 8-byte words, before it has taken out a change (its
    scratch never grows for them); the device compare gives up likewise. Under the limit (a few percent changed) it finds exactly the patch it finds
    without one."""
    numel = 4 * deltas._SCAN + 3
    limit = deltas.most_changes(numel, torch.empty(0, dtype=dtype).element_size())
    for fraction in (1.0, 0.5):
        old, new = _changed((numel,), dtype, fraction)
        scratch = deltas.PatchScratch()
        scratch.reset()
        calls = []
        real = deltas._Found.next
        deltas._Found.next = lambda self, *a: calls.append(a) or real(self, *a)
        try:
            assert deltas.diff(new, old, scratch, limit) is None
        finally:
            deltas._Found.next = real
        scratch.reset()
        # none of its changes taken out: its first block's differing 8-byte words tell
        assert scratch.arrays == {} and calls == [], (fraction, calls)
        assert deltas.diff_on_device(new, old, limit) is None
    old, new = _changed((numel,), dtype, 0.04)
    got, want = deltas.diff(new, old, limit=limit), deltas.diff(new, old)
    assert got is not None and torch.equal(got.positions, want.positions) and torch.equal(got.flips, want.flips)
    on_device = deltas.diff_on_device(new, old, limit)
    assert on_device is not None and torch.equal(on_device.positions, want.positions)


def test_a_tensor_whose_compare_gave_up_rests_longer_each_time_until_a_patch():
    """The base's rests: a give-up rests 0 pushes (its copy refreshed the push after), then 1, 2,
    4 and at most MAX_REST while its compares keep giving up; a patch puts it back to 0."""
    base = deltas.Base(None)
    base.commit({}, {"w": torch.zeros(8, dtype=torch.bfloat16)}, "x:1")
    assert base.held("w", torch.zeros(8, dtype=torch.bfloat16)) is not None
    rests, n = [], 1
    for _ in range(6):
        n += 1
        base.commit({}, {}, f"x:{n}", whole={"w": "gave up"})
        rests.append(base.rests("w"))
        assert base.held("w", torch.zeros(8, dtype=torch.bfloat16)) is None  # not compared while it rests
        while base.rests("w"):
            n += 1
            base.commit({}, {}, f"x:{n}", whole={"w": "rested"})
        new = torch.ones(8, dtype=torch.bfloat16)
        base.refresh("w", new)
        n += 1
        base.commit({}, {}, f"x:{n}", whole={"w": "refreshed"})
        assert base.rests("w") is None and torch.equal(base.tensors["w"], new)
    assert rests == [0, 1, 2, 4, deltas.MAX_REST, deltas.MAX_REST]
    base.commit({"w": deltas.diff(torch.full((8,), 2.0, dtype=torch.bfloat16), base.tensors["w"])}, {}, "x:99")
    base.commit({}, {}, "x:100", whole={"w": "gave up"})
    assert base.rests("w") == 0


def test_undo_at_any_strides_restores_exactly():
    whole = torch.randn(16, 12)
    target = whole.t()  # not contiguous
    before = target.clone()
    undo = deltas.Undo()
    positions = torch.tensor([0, 5, 13, 100, 191])
    want = torch.arange(5, dtype=torch.float32)
    flips = deltas.flat_ints(want) ^ deltas.flat_ints(target.reshape(-1)[positions].clone())
    deltas.apply(target, positions, flips, undo)
    assert torch.equal(target.reshape(-1)[positions], want)
    deltas.keep_whole(target, undo)
    target.fill_(7)
    undo.restore()
    assert torch.equal(target, before)


# A Llama-shaped tensor set: fused parts, heads, a padded vocabulary, a dim-1 split.
_CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "hidden_size": 32,
           "vocab_size": 100}
_SHAPES = {"model.embed_tokens.weight": (100, 32), "model.layers.0.self_attn.qkv_proj.weight": (64, 32),
           "model.layers.0.self_attn.o_proj.weight": (32, 32), "model.layers.0.mlp.down_proj.weight": (32, 48),
           "model.layers.0.input_layernorm.weight": (32,), "lm_head.weight": (100, 32)}


@pytest.mark.parametrize("tp_size", [2, 4])
def test_a_tp_piece_gets_exactly_its_slices_changes(tp_size):
    spec = load_spec("decoder", _CONFIG)
    olds, news = {}, {}
    for i, (name, shape) in enumerate(_SHAPES.items()):
        olds[name], news[name] = _changed(shape, torch.bfloat16, 0.1, seed=i)
    entries = [SyncTensor(n, dtype_code(t.dtype), tuple(t.shape), t.numel() * 2) for n, t in olds.items()]
    for rank in range(tp_size):
        place = TPPlace(tp_size, rank, spec)
        for layout in layouts(entries, group_entries(entries, 1 << 20), place, False):
            for piece, _ in layout.items:
                name = entries[piece.entry].name
                action = spec.action(name, _SHAPES[name])
                old_slice = take_shard(olds[name], action, rank, tp_size, name).contiguous()
                new_slice = take_shard(news[name], action, rank, tp_size, name).contiguous()
                part = deltas.piece_patch(deltas.diff(news[name], olds[name]), _SHAPES[name], name, piece.action,
                                          place, piece.shape)
                want = deltas.diff(new_slice, old_slice)
                assert torch.equal(part.positions, want.positions), (rank, name)
                assert torch.equal(part.new, want.new) and torch.equal(part.flips, want.flips), (rank, name)


def test_a_bucket_round_trips_through_its_messages_with_matching_checks():
    """send_bucket's messages into receive_bucket: the receiver ends at the new version, its
    check row equals the trainer's; a receiver whose base differs at a changed position does not."""
    shapes = {"a": (300, 40), "b": (64,), "c": (7, 3), "d": (0, 4)}
    olds, news = {}, {}
    for i, (name, shape) in enumerate(shapes.items()):
        olds[name], news[name] = _changed(shape, torch.bfloat16, 0.03 if name != "c" else 1.0, seed=i)
    entries = [SyncTensor(n, "BF16", shapes[n], olds[n].numel() * 2) for n in shapes]
    (layout,) = layouts(entries, group_entries(entries, 1 << 20), TPPlace(), False)
    patches = {i: deltas.diff(news[e.name], olds[e.name]) for i, e in enumerate(entries)}
    whole = {i: news[e.name] for i, e in enumerate(entries)}
    key = BucketKey(None, "session", 0, 0)
    messages, row = deltas.send_bucket(layout, entries, whole, patches, TPPlace(), torch.device("cpu"), key)
    header, data = messages
    counts = header.tolist()
    assert counts[2] == deltas.RAW and counts[3] == 0 and 0 < counts[0] < 300 * 40 // 10, counts
    assert data.numel() < 0.2 * sum(e.nbytes for e in entries)

    for drifted in (False, True):
        targets = {n: t.clone() for n, t in olds.items()}
        if drifted:  # every element of "a" moved one bit since the base
            deltas.flat_ints(targets["a"]).__ixor__(2)
        before = {n: t.clone() for n, t in targets.items()}
        undo = deltas.Undo()
        mine = deltas.receive_bucket(data, counts, layout, entries, targets, undo, key)
        assert torch.equal(mine[:2], row[:2])  # the bytes arrived as sent
        if not drifted:
            assert torch.equal(mine, row)
            assert all(torch.equal(_bits(targets[n]), _bits(news[n])) for n in shapes)
        else:
            assert mine[2] != row[2]  # the flips met values that were not the base's
        undo.restore()
        assert all(torch.equal(_bits(targets[n]), _bits(before[n])) for n in shapes)


@pytest.mark.parametrize("dtype,count", [(torch.int16, 1429), (torch.int16, 1428), (torch.uint8, 1429),
                                         (torch.int32, 3), (torch.int64, 1429)])
def test_patch_sums_tell_every_single_change_apart(dtype, count):
    """Any one value changed by any amount, in any lane of the words the values are summed as or
    in the tail short of a word (counts that fill whole words and that do not), changes the sum."""
    positions = torch.arange(0, 7 * count, 7)
    info = torch.iinfo(dtype)
    values = torch.randint(info.min, info.max, (count,), dtype=dtype)
    total = deltas.patch_sum(positions, values)
    assert deltas.patch_sum(positions, values.clone()) == total
    for k in sorted({0, 1, 2, 3, 5, 6, 7, count - 2, count - 1} & set(range(count))):
        for flip in (1, 2**6, 2**7 - 1, info.min or 128):  # the lowest bit, a high one, the low ones, the top one
            other = values.clone()
            other[k] ^= flip
            assert deltas.patch_sum(positions, other) != total, (k, flip)
    moved = positions.clone()
    moved[count // 2] += 1
    assert deltas.patch_sum(moved, values) != total


def test_a_deltas_buckets_merge_consecutive_buckets_within_the_trainers_bucket_size():
    """delta.merged: the buckets with bytes at a place, consecutive ones together up to the budget
    of whole bytes (a bigger one alone), each ending where the trainer sends it; what a receiver
    keeps nothing of is skipped, and every piece is in exactly one merged bucket, in order."""
    sizes = [100, 0, 200, 700, 1500, 50, 50, 0, 900, 10]
    entries = [SyncTensor(f"t{i}", "U8", (n,), n) for i, n in enumerate(sizes)]
    groups = [(i,) for i in range(len(sizes))]
    plan = layouts(entries, groups, TPPlace(), False)
    got = deltas.merged(plan, 1000)
    assert [last for last, _ in got] == [3, 4, 8, 9]
    assert [[piece.entry for piece, _ in layout.items] for _, layout in got] == [[0, 2, 3], [4], [5, 6, 8], [9]]
    assert [layout.size for _, layout in got] == [1000, 1500, 1000, 10]
    assert deltas.merged(plan, 1 << 30)[0][0] == 9 and len(deltas.merged(plan, 1 << 30)) == 1
    assert deltas.merged(plan[1:2], 1000) == []


def test_a_base_kept_once_for_tied_names_splits_when_they_part():
    """The trainer keeps one copy for two names of one tensor (tied weights) while both take one
    patch; when they part (each its own patch, or one not pushed) each name gets its own copy, and
    every copy ends at what was pushed under its name."""
    old, _ = _changed((4096,), torch.bfloat16, 0.0)
    base = deltas.Base(None)
    shared = old.clone()
    base.commit({}, {"embed": shared, "head": shared}, "v1")
    assert base.nbytes == old.numel() * 2  # counted once
    _, a = _changed((4096,), torch.bfloat16, 0.05, seed=1)
    _, b = _changed((4096,), torch.bfloat16, 0.05, seed=2)
    base.commit({"embed": deltas.diff(a, old), "head": deltas.diff(b, old)}, {}, "v2")  # untied
    assert torch.equal(_bits(base.tensors["embed"]), _bits(a)) and torch.equal(_bits(base.tensors["head"]), _bits(b))
    shared = a.clone()
    base.commit({}, {"embed": shared, "head": shared}, "v3")  # tied again
    _, c = _changed((4096,), torch.bfloat16, 0.05, seed=3)
    base.commit({"embed": deltas.diff(c, a)}, {}, "v4")  # only one name pushed
    assert torch.equal(_bits(base.tensors["embed"]), _bits(c)) and torch.equal(_bits(base.tensors["head"]), _bits(a))


def test_tied_names_are_found_from_the_callers_tensors_not_the_gathered_ones():
    """Two entries whose gathered tensors share memory (a DTensor's whole freed and its memory
    handed to the next one) are not tied: each is compared against its own base. Two names of one
    caller's tensor are: one compare, one patch."""
    from distload.live.channel import SyncChannel, _Changes

    channel = SyncChannel.__new__(SyncChannel)
    channel._base = deltas.Base(None)
    olds = {n: _changed((512,), torch.bfloat16, 0.0, seed=i)[0] for i, n in enumerate(("w1", "w3", "e", "h"))}
    channel._base.commit({}, {n: t.clone() for n, t in olds.items() if n in ("w1", "w3")}, "v1")
    channel._base.commit({}, {"e": olds["e"].clone()}, "v1")
    channel._base.tensors["h"] = channel._base.tensors["e"]
    entries = [SyncTensor(n, "BF16", (512,), 1024) for n in ("w1", "w3", "e", "h")]
    new1 = _changed((512,), torch.bfloat16, 0.0, seed=0)[0]
    deltas.flat_ints(new1)[1] ^= 1
    new3 = olds["w3"].clone()
    deltas.flat_ints(new3)[3] ^= 1
    reused = torch.empty(512, dtype=torch.bfloat16)  # one buffer, as a caching allocator hands back
    changes = _Changes()
    first = channel._changes((0,), entries, {0: reused.copy_(new1)}, changes, {0: new1})
    assert first[0].positions.tolist() == [1]
    second = channel._changes((1,), entries, {1: reused.copy_(new3)}, changes, {1: new3})
    assert second[1].positions.tolist() == [3]  # its own compare, not w1's patch
    tied = olds["e"].clone()
    deltas.flat_ints(tied)[7] ^= 1
    both = channel._changes((2, 3), entries, {2: tied, 3: tied}, changes, {2: tied, 3: tied})
    assert both[2] is both[3] and both[2].positions.tolist() == [7]


def test_the_audit_window_covers_every_byte_once_per_round():
    sizes = [0, 10, 3, 1000, 0, 77, 1 << 16]
    seen = [torch.zeros(s, dtype=torch.int32) for s in sizes]
    for turn in range(deltas.AUDIT_ROUNDS):
        for piece, start, stop in deltas.audit_window(sizes, turn):
            seen[piece][start:stop] += 1
    assert all(bool((s == 1).all()) for s in seen)
    assert deltas.audit_window(sizes, deltas.AUDIT_ROUNDS + 3) == deltas.audit_window(sizes, 3)


def test_the_audit_of_a_sliced_piece_is_the_bytes_the_receiver_holds():
    spec = load_spec("decoder", _CONFIG)
    news = {n: torch.randn(s).to(torch.bfloat16) for n, s in _SHAPES.items()}
    entries = [SyncTensor(n, "BF16", s, news[n].numel() * 2) for n, s in _SHAPES.items()]
    place = TPPlace(2, 1, spec)
    plan = layouts(entries, group_entries(entries, 1 << 20), place, False)
    held = {}
    for layout in plan:
        for piece, _ in layout.items:
            buffer = torch.empty(piece.nbytes, dtype=torch.uint8)
            pack(buffer, type(layout)(((piece, 0),), piece.nbytes), {piece.entry: news[entries[piece.entry].name]},
                 place)
            held[entries[piece.entry].name] = buffer.view(torch.bfloat16).view(piece.shape)
    whole = dict(enumerate(news.values()))
    for turn in range(deltas.AUDIT_ROUNDS):
        parts = [p for ps in deltas.audit_parts(plan, turn).values() for p in ps]
        assert torch.equal(torch.stack(deltas.sent_audit(parts, whole, place, KEY)),
                           torch.stack(deltas.held_audit(parts, entries, held, KEY)))
    name = "model.layers.0.mlp.down_proj.weight"  # split along dim 1: packed, not a run
    deltas.flat_ints(held[name])[5] ^= 1
    mismatches = 0
    for turn in range(deltas.AUDIT_ROUNDS):
        parts = [p for ps in deltas.audit_parts(plan, turn).values() for p in ps]
        mismatches += not torch.equal(torch.stack(deltas.sent_audit(parts, whole, place, KEY)),
                                      torch.stack(deltas.held_audit(parts, entries, held, KEY)))
    assert mismatches == 1  # found by exactly one turn of the round


def test_the_base_keeps_only_what_fits_its_bound():
    base = deltas.Base(max_bytes=100)
    assert base.room_for("a", 80, 0) and not base.room_for("b", 30, 80)
    base.commit({}, {"a": torch.zeros(20, dtype=torch.float32)}, "x:1")
    assert base.nbytes == 80 and base.id == "x:1"
    assert base.room_for("a", 100, 0)  # replacing "a" frees its own bytes
    assert base.held("a", torch.zeros(20)) is not None and base.held("a", torch.zeros(21)) is None
    new = torch.zeros(20)
    new[[3, 7]] = 1
    base.commit({"a": deltas.diff(new, base.tensors["a"])}, {}, "x:2")
    assert torch.equal(base.tensors["a"], new) and base.id == "x:2"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_changes_across_blocks_land_in_the_scratch_or_past_it_exactly(dtype):
    """_changed works in blocks of _SCAN elements, writing into the trainer's scratch memory
    where it has room and into arrays of its own past it: every way gives the same patch."""
    numel = 2 * deltas._SCAN + 12  # three blocks, the last one short
    old, new = _changed((numel,), dtype, 0.03, seed=7)
    want = torch.ne(_bits(old), _bits(new)).nonzero().squeeze(1)
    scratch = deltas.PatchScratch()
    for push in range(3):  # no scratch yet; one sized by the first push; one too small (overflow)
        scratch.reset()
        if push == 2:
            (arrays,) = scratch.arrays.values()
            arrays[:] = [array[:want.numel() // 2] for array in arrays]
        patch = deltas.diff(new, old, scratch)
        assert torch.equal(patch.positions, want)
        assert torch.equal(patch.new, _bits(new)[want]) and torch.equal(patch.flips, _bits(new)[want] ^ _bits(old)[want])
    # Two patches in one scratch do not overlap.
    scratch = deltas.PatchScratch()
    deltas.diff(new, old, scratch)
    scratch.reset()
    first, second = deltas.diff(new, old, scratch), deltas.diff(old, new, scratch)
    assert torch.equal(first.positions, want) and torch.equal(second.positions, want)
    assert torch.equal(first.new, _bits(new)[want]) and torch.equal(second.new, _bits(old)[want])


def test_the_checksum_is_the_keyed_tag_it_describes():
    """transfer.checksum of host bytes (numpy, blocked) and of any other tensor (torch ops, the
    device path) against its definition in plain Python, at any length and start: the first 16
    bytes of HMAC-SHA256(key, length, extra, NH of each zero-padded 4 KiB block)."""
    import hashlib
    import hmac
    import struct

    from distload.live.transfer import BucketKey, checksum

    key = BucketKey(None, "session", 3, 1)
    gen = torch.Generator().manual_seed(3)
    buffer = torch.randint(0, 256, (3 * 4096 + 77,), dtype=torch.uint8, generator=gen)
    nh = [int(k) for k in key.nh]
    for start, stop in ((0, 0), (0, 5), (3, 4096 + 9), (0, buffer.numel()), (5, buffer.numel())):
        data = buffer[start:stop]
        raw = bytes(data.tolist())
        padded = raw + bytes(-len(raw) % 4096)
        digest = b""
        for b in range(0, len(padded), 4096):
            words = struct.unpack("<1024I", padded[b:b + 4096])
            added = [(w + k) % 2**32 for w, k in zip(words, nh)]
            digest += struct.pack("<Q", sum(added[i] * added[i + 1] for i in range(0, 1024, 2)) % 2**64)
        for extra in (b"", b"header"):
            tag = hmac.new(key.mac, struct.pack(">QI", len(raw), len(extra)) + extra + digest, hashlib.sha256)
            want = list(struct.unpack("<2q", tag.digest()[:16]))
            assert checksum(data, key, extra).tolist() == want, (start, stop)
            # the device path (torch ops), run on the CPU: a non-contiguous view takes it
            strided = torch.zeros(2 * data.numel(), dtype=torch.uint8)
            strided[::2] = data
            assert checksum(strided[::2], key, extra).tolist() == want, (start, stop)


def test_the_checksum_key_is_per_update_and_trainer_and_secret(monkeypatch):
    """A tag made under another update's, trainer rank's or secret's key does not pass."""
    from distload.live.transfer import BucketKey, checksum
    from distload.live.secret import Secret

    data = torch.randint(0, 256, (10_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    secret, other = Secret(b"a" * 32, "test"), Secret(b"b" * 32, "test")
    tags = {checksum(data, BucketKey(s, sid, seq, t)).tolist().__repr__()
            for s, sid, seq, t in ((secret, "x", 1, 0), (secret, "x", 2, 0), (secret, "x", 1, 1), (secret, "y", 1, 0),
                                   (other, "x", 1, 0), (None, "x", 1, 0))}
    assert len(tags) == 6
    flipped = data.clone()
    flipped[4097] ^= 1
    key = BucketKey(secret, "x", 1, 0)
    assert not torch.equal(checksum(data, key), checksum(flipped, key))


def test_a_commit_written_later_is_waited_for_and_a_failed_one_drops_the_base():
    base = deltas.Base(None)
    old = torch.zeros(1000, dtype=torch.bfloat16)
    base.commit({}, {"a": old.clone()}, "x:1")
    new = old.clone()
    new[[1, 500, 999]] = 1
    base.begin()
    base.commit({"a": deltas.diff(new, base.tensors["a"], base.scratch)}, {}, "x:2", later=True)
    base.begin()  # the next push: the commit has been written
    assert torch.equal(base.tensors["a"], new) and base.id == "x:2"
    # A commit that fails (here: a tensor the base does not hold) leaves no base to patch.
    base.commit({"gone": deltas.diff(new, old)}, {}, "x:3", later=True)
    base.settle()
    assert base.id is None and not base.tensors


@pytest.mark.parametrize("stride", [29, 5])
@pytest.mark.parametrize("whole_rank", [1, 0])
def test_a_tied_weight_from_two_trainer_ranks_one_delta_one_whole_then_a_failure_rolls_back_exactly(
        monkeypatch, whole_rank, stride):
    """Trainer rank 0 pushes the embedding, rank 1 the LM head: one tensor on the receiver (tied).
    One rank sends deltas, the other (``delta=False``) whole bytes; senders are taken in rank order.
    Whole second: the delta patches that memory, then the whole bytes land over it (their old bytes
    set aside after the patch). Whole first: the delta after it reads that memory back rather than
    flipping over the new bytes. Version 3 fails after every byte landed, and the receiver is back
    at version 2 exactly: the whole write's old bytes are put back before the delta's undo (the
    other order leaves version 3's patched values). ``stride`` 5: two in five elements change, too
    many to patch: the delta update sends the tensor whole, and a whole piece over the full
    sender's bytes keeps no undo of them (it would put version 3 back after the rollback)."""
    results = _tied_from_two_trainer_ranks(monkeypatch, {1 - whole_rank}, stride)
    assert results["v1"] == (False, True) and results["v2"] == (True, True), results
    error, at_version_2, consistent = results["v3"]
    assert "injected" in error and at_version_2 and consistent, results
    assert results[f"trainer {1 - whole_rank} v2"] is True and results[f"trainer {whole_rank} v2"] is False, results
    assert results["whole v2"] == (() if stride == 29 else ("head.weight" if whole_rank == 0 else "embed.weight",)), \
        results


def test_a_tied_weight_from_two_full_trainer_ranks_rolls_back_exactly(monkeypatch):
    """Both ranks send whole bytes (no deltas): version 3 lands, the embedding's bytes, then the
    LM head's over the same memory, and fails after; the receiver is back at version 2 exactly.
    Each name was set aside before its first write, the head's after the embedding's had landed:
    put back in the order set aside, version 3 stayed (main before this test)."""
    results = _tied_from_two_trainer_ranks(monkeypatch, set(), 5)
    assert results["v1"] == (False, True) and results["v2"] == (False, True), results
    error, at_version_2, consistent = results["v3"]
    assert "injected" in error and at_version_2 and consistent, results


def _tied_from_two_trainer_ranks(monkeypatch, delta_ranks: set[int], stride: int) -> dict[str, object]:
    """Trainer rank 0 pushes ``embed.weight``, rank 1 ``head.weight`` (ranks in ``delta_ranks``
    through delta channels, the others full), versions 1-3 (``stride``: every stride-th element of
    the next version differs), into one receiver whose model ties them; version 3 fails on the
    receiver after every byte landed. Each rank also pushes a tensor of its own with one element
    changed a version: a delta rank's push compares something even while the tied weight's copy
    rests, and goes as a delta (a push that compares nothing goes full). What each side saw, by name."""
    import threading

    import torch.distributed as dist

    from distload.errors import SyncError
    from distload.live.channel import SyncChannel

    store = dist.HashStore()
    results: dict[str, object] = {}

    def weight(version):
        w = (torch.randn(64, 16, generator=torch.Generator().manual_seed(1)) * 4).to(torch.bfloat16)
        deltas.flat_ints(w)[version::stride] ^= 1
        return w

    def other(version):  # one element changed a version: a patch (the push compares something)
        w = torch.ones(16, 16, dtype=torch.bfloat16)
        w.view(-1)[version] = 2
        return w

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(64, 16, dtype=torch.bfloat16)
            self.head = torch.nn.Linear(16, 64, bias=False, dtype=torch.bfloat16)
            self.head.weight = self.embed.weight
            self.other0 = torch.nn.Linear(16, 16, bias=False, dtype=torch.bfloat16)
            self.other1 = torch.nn.Linear(16, 16, bias=False, dtype=torch.bfloat16)

    real = SyncChannel._receive_all

    def failing_third(channel, *args, **kwargs):
        wire = real(channel, *args, **kwargs)
        if channel.role == "inference" and channel.version == 2:
            raise SyncError("injected: the update fails after every byte landed")
        return wire

    monkeypatch.setattr(SyncChannel, "_receive_all", failing_third)

    def channel(role, rank, **options):
        return SyncChannel(role=role, rank=rank, size=2 if role == "trainer" else 1, store=store, device="cpu",
                           timeout_s=30, transport="socket", **options)

    def trainer(rank):
        name = "embed.weight" if rank == 0 else "head.weight"
        with channel("trainer", rank, delta=rank in delta_ranks) as ch:
            for version in (1, 2, 3):
                try:
                    state = {name: weight(version), f"other{rank}.weight": other(version)}
                    results[f"trainer {rank} v{version}"] = ch.push(state, version).delta
                except SyncError as exc:
                    results[f"trainer {rank} v{version}"] = str(exc)

    def receiver():
        model = Tied()
        with channel("inference", 0) as ch:
            for version in (1, 2, 3):
                try:
                    stats = ch.receive(model)
                    results[f"v{version}"] = (stats.delta, torch.equal(model.embed.weight, weight(version)))
                    results[f"whole v{version}"] = stats.sent_whole
                except SyncError as exc:
                    results[f"v{version}"] = (str(exc), torch.equal(model.embed.weight, weight(2)), ch.consistent)

    threads = [threading.Thread(target=trainer, args=(r,)) for r in (0, 1)] + [threading.Thread(target=receiver)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_a_push_whose_every_tensor_rests_goes_as_a_full_update_and_the_next_compare_is_a_delta():
    """Every element changes in versions 2-8 (a high learning rate), then one element a version.
    Each compare gives up and the tensors rest: a push in which every tensor's copy rests sends
    every byte whole, and goes as a full update (no delta, exactly a full push's wire bytes: no
    headers); the receivers keep the base all along, so once the copies are compared again the
    small steps go as deltas. Every version lands bit for bit."""
    import threading

    import torch.distributed as dist

    from distload.live.channel import SyncChannel

    store = dist.HashStore()
    names = ("a.weight", "b.weight")

    def state(version):
        out = {}
        for i, name in enumerate(names):
            w = (torch.randn(128, 128, generator=torch.Generator().manual_seed(i)) * 4).to(torch.bfloat16)
            bits = deltas.flat_ints(w)
            bits ^= min(version, 8)  # versions 2-8: every element differs from the version before
            if version > 8:
                bits[version] ^= 16  # then one element a version
            out[name] = w
        return out

    versions = range(1, 21)
    pushes, receives = [], []

    def channel(role):
        return SyncChannel(role=role, rank=0, size=1, store=store, device="cpu", timeout_s=30, transport="socket")

    def trainer():
        with channel("trainer") as ch:
            for version in versions:
                stats = ch.push(state(version), version)
                pushes.append((stats.delta, stats.wire_bytes, sorted(stats.sent_whole)))

    def receiver():
        target = {name: torch.zeros(128, 128, dtype=torch.bfloat16) for name in names}
        with channel("inference") as ch:
            for version in versions:
                stats = ch.receive(target)
                receives.append((stats.delta, all(torch.equal(deltas.flat_ints(target[n]), deltas.flat_ints(t))
                                                  for n, t in state(version).items())))

    threads = [threading.Thread(target=trainer), threading.Thread(target=receiver)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(pushes) == len(receives) == len(versions), (pushes, receives)
    assert all(exact for _, exact in receives), [(v, r) for v, r in zip(versions, receives) if not r[1]]
    assert [d for d, _ in receives] == [d for d, _, _ in pushes]
    full_wire = pushes[0][1]
    assert pushes[0][0] is False and pushes[1][0] is True and pushes[1][2] == sorted(names), pushes[:2]
    rested = [p for p in pushes[2:8] if p[0] is False]  # versions 3-8: every tensor resting or refreshed
    # a full update: sent_whole names what a delta update sent whole, and this is none
    assert len(rested) >= 3 and all(wire == full_wire and not whole for _, wire, whole in rested), pushes
    small = [p for p in pushes[8:] if p[0] is True and not p[2]]  # versions 9-20: patches again
    assert small and all(wire < 0.05 * full_wire for _, wire, _ in small), pushes
