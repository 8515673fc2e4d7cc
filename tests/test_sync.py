"""Weight sync over gloo: versions, in place, refusal before data, a sender killed mid-update."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from distload.tp.place import TPPlace
from distload.live.transfer import (ALIGN, BucketKey, SyncTensor, KeptSlice, check_pieces, checksum, first_mismatch,
                                    group_entries, layouts)

from dist_helpers import clean_env, free_port, run_script, write_script


def entries(*sizes: int) -> list[SyncTensor]:
    return [SyncTensor(f"t{i}", "U8", (n,), n) for i, n in enumerate(sizes)]


def test_buckets_pack_in_order_aligned_and_a_big_tensor_alone():
    sent = entries(10, 20, 100, 5, 300, 7)
    groups = group_entries(sent, bucket_bytes=128)
    assert groups == [(0, 1), (2,), (3,), (4,), (5,)]
    buckets = layouts(sent, groups, TPPlace(), verify=False)
    assert [[off for _, off in b.items] for b in buckets] == [[0, 64], [0], [0], [0], [0]]
    assert buckets[3].size == 300  # bigger than a bucket: travels alone
    assert all(off % ALIGN == 0 for b in buckets for _, off in b.items)
    verified = layouts(sent, groups, TPPlace(), verify=True)
    assert [b.size for b in verified] == [84, 100, 5, 300, 7]  # the checksums travel apart
    assert [b.wire_bytes for b in verified] == [84 + 16, 100 + 16, 5 + 16, 300 + 16, 7 + 16]
    assert group_entries([], 128) == []


def test_a_verified_update_names_the_bucket_whose_bytes_changed():
    sizes = (3 * 4096 + 1000, 200, 4096 * 5)
    groups = [(0,), (1,), (2,)]
    plain = layouts(entries(*sizes), groups, TPPlace(), verify=False)
    verified = layouts(entries(*sizes), groups, TPPlace(), verify=True)
    assert [b.wire_bytes for b in plain] == list(sizes)
    assert [b.wire_bytes for b in verified] == [n + 16 for n in sizes]  # one checksum a bucket
    buckets = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
    key = BucketKey(None, "session", 0, 0)
    sent = torch.stack([checksum(b, key) for b in buckets])
    assert first_mismatch(sent.clone(), sent) is None
    for bucket, where in ((0, 5), (0, sizes[0] - 1), (1, 77), (2, 4096 * 4 + 3)):
        arrived = [b.clone() for b in buckets]
        arrived[bucket][where] ^= 1
        assert first_mismatch(torch.stack([checksum(b, key) for b in arrived]), sent) == bucket
    # two 4 KiB rows swapped: the same words in other places
    swapped = [b.clone() for b in buckets]
    swapped[2][:4096], swapped[2][4096:8192] = buckets[2][4096:8192].clone(), buckets[2][:4096].clone()
    assert first_mismatch(torch.stack([checksum(b, key) for b in swapped]), sent) == 2
    # two words swapped inside one 4 KiB block (which the unkeyed sums missed)
    inside = [b.clone() for b in buckets]
    inside[0][:8], inside[0][8:16] = buckets[0][8:16].clone(), buckets[0][:8].clone()
    assert first_mismatch(torch.stack([checksum(b, key) for b in inside]), sent) == 0


def test_check_pieces_names_every_problem():
    targets = {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16), "d": torch.zeros(8)}
    targets["d"].untyped_storage().resize_(0)  # what WeightSleeper leaves behind
    sent = [SyncTensor("a", "F32", (3, 2), 24), SyncTensor("b", "F32", (4,), 16), SyncTensor("c", "F32", (1,), 4),
            SyncTensor("d", "F32", (8,), 32)]
    pieces = [KeptSlice(i, e.shape, e.nbytes, None) for i, e in enumerate(sent)]
    problems = check_pieces(sent, pieces, targets)
    assert problems == ["a: sent F32 [3, 2], here torch.float32 [2, 3]",
                        "b: sent F32 [4], here torch.bfloat16 [4]", "c: no such tensor here",
                        "d: asleep (its storage holds 0 bytes): wake() the model before receiving into it"]
    assert check_pieces(sent, [], targets) == []


_SYNC = """
import json, os, sys, torch, distload
from distload.live.sync import WeightSync, SyncError
mode = sys.argv[1]
out = sys.argv[2]
with distload.WorkerGroup(device="cpu", timeout_s=60) as g:
    senders = [0, 1] if mode == "two-senders" else [0]
    sync = WeightSync(senders, group=g, bucket_bytes=4096)
    dtypes = [torch.bfloat16, torch.float32, torch.int8, torch.bool, torch.float8_e4m3fn]
    shapes = {f"layer{i}.w": ((17 + i, 9), dtypes[i % len(dtypes)]) for i in range(20)}
    shapes["big"] = ((64, 64), torch.float32)  # 16 KiB: bigger than a bucket
    shapes["scalar"] = ((), torch.float64)
    # A tied weight (an embedding and an LM head): one tensor under two names on both sides.
    shapes["tied.embed"] = shapes["tied.head"] = ((40, 9), torch.bfloat16)
    def value(name, version):
        shape, dtype = shapes[name]
        name = "tied.embed" if name == "tied.head" else name
        if version == 4:  # version 3 with every 200th element's lowest bit flipped: a delta of 0.5%
            t = value(name, 3)
            ints = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
            ints.view(-1)[::200] ^= 1
            return t
        gen = torch.Generator().manual_seed(hash((name, version)) % 2**31)
        return (torch.randn(shape, generator=gen) * 8).to(dtype)
    def mine(name):  # with two senders, each pushes its own slice
        return mode != "two-senders" or (hash(name) % 2) == g.rank
    versions = (1, 2, 3) if mode == "refuse" else (1, 2, 3, 4)
    result = {"rank": g.rank}
    if g.rank in senders:
        for version in versions:
            if mode == "refuse" and version != 2:
                continue
            state = {n: value(n, version) for n in shapes if mine(n)}
            if "tied.head" in state and "tied.embed" in state:
                state["tied.head"] = state["tied.embed"]
            if mode == "refuse":
                try:
                    sync.push(state, version)
                except SyncError as exc:
                    result["refused"] = str(exc)
                continue
            sync.push(state, version)
    else:
        target = {n: torch.zeros(s, dtype=d) for n, (s, d) in shapes.items()}
        target["tied.head"] = target["tied.embed"]
        if mode == "refuse" and g.rank == 2:
            target["layer3.w"] = torch.zeros(3, 3, dtype=shapes["layer3.w"][1])
        pointers = {n: t.data_ptr() for n, t in target.items()}
        result["versions"], result["exact"], result["delta"], result["wire"] = [], [], [], []
        for version in versions:
            if mode == "refuse" and version != 2:
                continue
            before = {n: t.clone() for n, t in target.items()}
            try:
                stats = sync.receive(target)
            except SyncError as exc:
                result["error"] = str(exc)
                result["unchanged"] = all(torch.equal(before[n], target[n]) for n in target)
                result["version"] = sync.version
                result["consistent"] = sync.consistent
                continue
            result["versions"].append(stats.version)
            result["delta"].append(stats.delta and stats.verified)
            result["wire"].append(stats.wire_bytes)
            result["exact"].append(all(
                target[n].view(torch.uint8).equal(value(n, version).view(torch.uint8)) if target[n].dim()
                else target[n].reshape(1).view(torch.uint8).equal(value(n, version).reshape(1).view(torch.uint8))
                for n in shapes))
        result["in_place"] = all(target[n].data_ptr() == pointers[n] for n in target)
    sync.close()
    with open(f"{out}/rank{g.rank}.json", "w") as f:
        json.dump(result, f)
"""


def _results(tmp_path, nproc):
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.dist
def test_versions_arrive_exact_and_in_place(tmp_path):
    """Versions 1-4 of twenty-odd tensors of five dtypes, a scalar, one bigger than a bucket, and a
    tied weight (one tensor under two names on both sides: a delta patches it once, not twice,
    which would undo it), each exact in the receivers' own tensors."""
    script = write_script(tmp_path, "sync.py", _SYNC)
    run = run_script(script, ["one-sender", str(tmp_path)], nproc=3, env={"PYTHONHASHSEED": "0"})
    assert run.returncode == 0, run.stderr[-4000:]
    for r in _results(tmp_path, 3)[1:]:
        assert r["versions"] == [1, 2, 3, 4] and r["exact"] == [True] * 4 and r["in_place"], r
        # The first update is full; then each receiver holds the sender's base: deltas, checked.
        assert r["delta"] == [False, True, True, True], r
        assert r["wire"][3] < 0.3 * r["wire"][0], r  # 0.5% of the elements changed


@pytest.mark.slow
@pytest.mark.dist
def test_several_senders_each_push_a_slice(tmp_path):
    script = write_script(tmp_path, "sync.py", _SYNC)
    run = run_script(script, ["two-senders", str(tmp_path)], nproc=3, env={"PYTHONHASHSEED": "0"})
    assert run.returncode == 0, run.stderr[-4000:]
    receiver = _results(tmp_path, 3)[2]
    assert receiver["versions"] == [1, 2, 3, 4] and all(receiver["exact"]) and receiver["in_place"], receiver
    assert receiver["delta"] == [False, True, True, True], receiver  # from each of the two senders
    assert receiver["wire"][3] < 0.3 * receiver["wire"][0], receiver


@pytest.mark.slow
@pytest.mark.dist
def test_a_refused_update_moves_no_byte_anywhere(tmp_path):
    """Rank 2's layer3.w has another shape: the sender and BOTH receivers refuse version 2."""
    script = write_script(tmp_path, "sync.py", _SYNC)
    run = run_script(script, ["refuse", str(tmp_path)], nproc=3, env={"PYTHONHASHSEED": "0"})
    assert run.returncode == 0, run.stderr[-4000:]
    sender, r1, r2 = _results(tmp_path, 3)
    assert "update to version 2 refused, nothing was sent" in sender["refused"]
    assert "rank 2: 1 tensor does not fit: layer3.w: sent" in sender["refused"]
    for r in (r1, r2):
        assert "update to version 2 refused, nothing was sent" in r["error"], r
        assert r["unchanged"] and r["consistent"] and r["version"] is None, r


_KILLED = """
import json, os, signal, sys, time, torch, distload
import distload.live.channel as channel
from distload.live.sync import WeightSync, SyncError
out = sys.argv[1]
with distload.WorkerGroup(device="cpu", timeout_s=30) as g:
    # A full update (every byte), whose failure may leave a mix: a delta's undo is tested in test_sync_jobs.
    sync = WeightSync([0], group=g, bucket_bytes=1 << 16, delta=False)
    state = {f"w{i}": torch.full((64, 64), float(i)) for i in range(64)}  # 1 MiB in 16 buckets
    if g.rank == 0:
        sync.push(state, 1)
        real = channel.pack
        packed = []
        def dying(*args, **kwargs):
            packed.append(1)
            if len(packed) == 8:  # a few buckets of version 2 are out: die like an OOM-killed trainer
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        channel.pack = dying
        sync.push({n: t + 100 for n, t in state.items()}, 2)
    else:
        target = {n: torch.zeros_like(t) for n, t in state.items()}
        result = {"first": sync.receive(target).version}
        start = time.monotonic()
        try:
            sync.receive(target)
            result["second"] = "arrived?!"
        except SyncError as exc:
            result["error"] = str(exc)
        result["seconds"] = time.monotonic() - start
        result["version"], result["consistent"], result["last_error"] = sync.version, sync.consistent, sync.last_error
        result["holds_version_1"] = all(target[n].equal(t) for n, t in state.items())
        with open(f"{out}/rank{g.rank}.json", "w") as f:
            json.dump(result, f)
        os._exit(0)  # the group lost a member: skip teardown handshakes with the dead rank
"""


@pytest.mark.slow
@pytest.mark.dist
def test_sender_killed_mid_update_leaves_old_version(tmp_path):
    """Ranks started by hand (torchrun would kill the receivers as soon as the sender died):
    the receivers must notice on their own, in bounded time, and keep reporting version 1."""
    script = write_script(tmp_path, "killed.py", _KILLED)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, script, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=clean_env({"RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r),
                                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}))
             for r in range(3)]
    start = time.monotonic()
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert time.monotonic() - start < 120
    assert procs[0].returncode == -9, outputs[0][1][-2000:]
    for rank in (1, 2):
        assert procs[rank].returncode == 0, outputs[rank][1][-3000:]
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["first"] == 1 and "second" not in r, r
        assert r["version"] == 1 and r["consistent"] is True and r["last_error"], r  # rolled back
        assert r["holds_version_1"], r
        assert "still at version 1" in r["error"], r
        assert r["seconds"] < 60, r  # well inside the 30 s group timeout plus slack, not a hang
