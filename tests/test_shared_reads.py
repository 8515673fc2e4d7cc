"""Shared reads (issue 16): ranks that need the same bytes split their reading and send each other
their shares, so each byte leaves storage once per job (whole checkpoints, tensor-parallel slices
kept by data-parallel replicas, shard files of a TP rank, loads over a subgroup).

Every load is checked bit for bit against a plain safetensors read (or ``reshard``'s slices),
and the bytes each rank asked the source for are asserted, not just reported. The buckets are made
tiny here so that every checkpoint spans many of them (large tensors split, small ones grouped).
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest
import torch

from distload.loading.agreement import member_ranks
from distload.loading.shared_reads.plan import (
    ExchangePlan, Segment, assign_readers, clip_runs, compact, expand, plan_buckets)
from distload.loading.report import state_digest

from conftest import every_dtype_state, plain_digest, write_whole
from dist_helpers import run_script, write_script
from test_sliced_loads import llama, rank_reference, slice_request_bytes, llama_state  # noqa: F401 (a fixture)


# -- pure: buckets, clipping, who shares ------------------------------------------------------------

def test_buckets_split_large_tensors_evenly_and_group_small_ones():
    buckets = plan_buckets([10, 20, 0, 300, 30, 40], 100)
    assert buckets[0] == (Segment(0, 0, 10), Segment(1, 0, 20))  # small neighbours together
    big = [b for b in buckets if b[0].tensor == 3]
    assert [s.length for (s,) in big] == [128, 128, 44]  # 3 buckets, starts aligned to 64 bytes
    assert [s.start for (s,) in big] == [0, 128, 256]
    assert buckets[-1] == (Segment(4, 0, 30), Segment(5, 0, 40))
    assert all(s.tensor != 2 for b in buckets for s in b)  # an empty tensor travels in no bucket
    assert plan_buckets([], 100) == []


def test_each_round_gives_every_member_one_bucket_and_the_largest_to_the_least_loaded():
    buckets = [(Segment(i, 0, n),) for i, n in enumerate([100, 10, 10, 100, 50, 60])]
    owners = assign_readers(buckets, 2)
    assert owners[:2] == [0, 1]  # round 0: the 100 to member 0
    assert owners[2:4] == [0, 1]  # round 1: member 1 (10 so far) takes the 100
    assert owners[4:] == [1, 0]  # round 2: member 0 (110) takes the 60, member 1 (110) the 50: tie by rank
    assert assign_readers(buckets[:3], 2) == [0, 1, 1]  # a last round shorter than k
    # A member that keeps a bucket reads it where the loads allow (then nobody sends it its bytes):
    # each half of a dim-0 split to the TP rank that keeps it; a member 90 bytes ahead takes a
    # 100-byte bucket it keeps whole, not one it keeps 10 bytes of.
    halves = [(Segment(0, 0, 100),), (Segment(0, 100, 100),)]
    assert assign_readers(halves, 2, keeps=[[0, 100], [100, 0]]) == [1, 0]
    assert assign_readers(buckets[:4], 2, keeps=[[0, 0], [0, 0], [0, 0], [100, 0]]) == [0, 1, 1, 0]
    assert assign_readers(buckets[:4], 2, keeps=[[0, 0], [0, 0], [0, 0], [10, 0]]) == [0, 1, 0, 1]


def test_a_row_sliced_need_is_one_run_and_clips_to_whole_and_cut_rows():
    rows = [(0, 0, 10), (40, 10, 10), (80, 20, 10), (120, 30, 10)]  # 4 rows of 10 bytes, 40 apart
    runs = compact(rows)
    assert runs == ((0, 0, 10, 4, 40, 10),) and list(expand(runs)) == rows
    # [5, 125): row 0 cut at its start, rows 1-2 whole (one run), row 3 cut at its end
    assert clip_runs(runs, 5, 125) == [(5, 5, 5, 1, 5, 5), (40, 10, 10, 2, 40, 10), (120, 30, 5, 1, 5, 5)]
    assert clip_runs(runs, 10, 40) == []  # a gap between rows
    assert compact([(0, 0, 4), (4, 4, 4), (20, 8, 2)]) == ((0, 0, 4, 2, 4, 4), (20, 8, 2, 1, 2, 2))


def test_the_exchange_plan_reads_the_union_once_and_gives_each_member_exactly_its_need(monkeypatch):
    """Two TP ranks keeping halves of every row (dim 1) of a 16 x 48-byte tensor, and a replica of
    the first: the union is the whole tensor, cut into 64-byte buckets (rows cut at their edges),
    each read once, and each member's pieces are exactly its half rows."""
    import distload.loading.shared_reads.plan as exchange_plan

    monkeypatch.setattr(exchange_plan, "MIN_BUCKET_BYTES", 1)
    left = compact((r * 48, r * 24, 24) for r in range(16))
    right = compact((r * 48 + 24, r * 24, 24) for r in range(16))
    needs = [left, right, left]
    plan = ExchangePlan([768], [[n] for n in needs], bucket_bytes=128)  # 768 // (4 x 3) = 64 a bucket
    assert plan.union_bytes == 768 and not plan.identical
    assert [(span.lo, span.hi) for spans in plan.spans for span in spans] == [(b, b + 64) for b in range(0, 768, 64)]
    assert plan.readers == [0, 1, 2] * 4 and sum(plan.read_bytes(b) for b in range(12)) == 768
    for member, need in enumerate(needs):
        kept = []
        for b in range(len(plan.buckets)):
            (span,) = plan.spans[b]
            kept += [(src - span.at + span.lo, dst, n) for _, run in plan.pieces(b, member) for src, dst, n in expand([run])]
        assert {d + x: s + x for s, d, n in kept for x in range(n)} == \
            {d + x: s + x for s, d, n in expand(need) for x in range(n)}, member
        assert sum(n for _, _, n in kept) == 384  # its half, nothing more
    # A lone TP rank's rows: the union has gaps, which are neither read nor counted.
    alone = ExchangePlan([768], [[left]], bucket_bytes=128)
    assert alone.union_bytes == 384 and sum(alone.read_bytes(b) for b in range(len(alone.buckets))) == 384


def test_sharing_ranks_by_need_and_by_node():
    needs = [(("slices", "a"), "n0"), (("slices", "b"), "n0"), (("slices", "a"), "n1"), (("slices", "b"), "n1")]
    assert member_ranks(needs, 0, "job") == (0, 2)  # the replicas of TP rank 0
    assert member_ranks(needs, 3, "job") == (1, 3)
    assert member_ranks(needs, 2, "node") == (2,)  # alone on its node
    assert member_ranks([(("whole",), "n0")] * 3, 1, "node") == (0, 1, 2)


# -- under torchrun -------------------------------------------------------------------------------

# Each rank loads SOURCE with the given settings and tiny buckets; rank 0 writes every rank's
# report (digest, requested and received bytes, path) as JSON. FAULT (optional): "fail:R" makes
# rank R's reads fail mid-load, "kill:R" makes rank R die (SIGKILL) there, "close:R" makes rank
# R stop consuming after 2 tensors, "pack:R" makes rank R run out of memory for a message it sends,
# "bucket:R" gives rank R buckets twice as large (a plan that differs from the others').
SCRIPT = r"""
import json, os, signal, sys, time
import distload
import distload.loading.backends.pread as pread
import distload.loading.shared_reads.stream as shared
from distload.errors import CheckpointError

source, out, tp, extra, bucket, fault = sys.argv[1:7]
shared.BUCKET_BYTES = int(bucket)
tp = int(tp) or None
with distload.WorkerGroup(device="cpu", timeout_s=60) as group:
    kind, _, who = fault.partition(":")
    if kind in ("fail", "kill") and group.rank == int(who):
        real, calls = pread.LocalBytes.read, []
        def failing(self, info, extents, view):
            calls.append(1)
            if len(calls) == 3 and kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if len(calls) == 3:
                raise CheckpointError(f"{info.file}: reading tensor {info.name!r} failed: [Errno 5] Input/output error")
            return real(self, info, extents, view)
        pread.LocalBytes.read = failing
    if kind == "bucket" and group.rank == int(who):
        shared.BUCKET_BYTES = 2 * int(bucket)
    if kind == "needs" and group.rank == int(who):  # the agreement's answer lost on this rank
        import dataclasses
        real_stream = shared.shared_stream
        shared_stream = lambda request, *a: real_stream(
            dataclasses.replace(request, options=dataclasses.replace(request.options, needs=())), *a)
        pread.shared_stream = shared_stream
    if kind == "pack" and group.rank == int(who):
        import distload.loading.buckets as buckets
        real_pack, packs = buckets.pack_runs, []
        def failing_pack(buffer, pieces):
            packs.append(1)
            if len(packs) == 2:
                raise MemoryError("no memory left for a message")
            return real_pack(buffer, pieces)
        buckets.pack_runs = failing_pack
    start = time.monotonic()
    loader = distload.Loader(source, "auto", extra, group=group, tensor_parallel_size=tp)
    try:
        if kind == "close" and group.rank == int(who):
            stream = loader.stream()
            for i, _ in enumerate(stream):
                if i == 1:
                    break
            stream.close()
            result = None
        else:
            result = loader.load(digest=True, gather=True)
    except distload.DistloadError as exc:
        print(f"rank {group.rank} stopped after {time.monotonic() - start:.1f} s: {exc}", flush=True)
        sys.exit(3)
    if group.rank == 0:
        json.dump(result.report.to_json(), open(out, "w"))
"""


def run_shared(tmp_path, source: str, nproc: int, tp: int = 0, extra: dict | None = None, bucket: int = 4096,
               fault: str = "-"):
    script = write_script(tmp_path, "shared.py", SCRIPT)
    out = str(tmp_path / "out.json")
    result = run_script(script, [source, out, str(tp), json.dumps(extra or {"distributed": "job"}), str(bucket),
                                 fault], nproc=nproc, timeout=240)
    report = json.load(open(out)) if result.returncode == 0 else None
    return result, report


@pytest.mark.dist
def test_a_whole_checkpoint_is_read_once_by_the_ranks_together(tmp_path):
    folder = str(tmp_path / "whole")
    paths = write_whole(folder, {**every_dtype_state(seed=3), "big": torch.randn(5000)}, num_files=3)
    result, report = run_shared(tmp_path, folder, 2)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    ranks = report["ranks"]
    assert [r["path"] for r in ranks] == ["pread-shared"] * 2
    assert [r["digest"] for r in ranks] == [plain_digest(paths)] * 2
    total = ranks[0]["nbytes"]
    assert sum(r["requested_bytes"] for r in ranks) == total  # each byte read once per job
    assert all(0.25 * total < r["requested_bytes"] < 0.75 * total for r in ranks)  # both read a share
    for r in ranks:
        assert r["received_bytes"] == total - r["requested_bytes"]


def planned_exchange(folder: str, tp: int, nproc: int, bucket: int) -> list[dict[str, int]]:
    """Per rank, what the job-wide exchange plan says it reads, keeps of its own reads, and
    receives, from each rank's real plan (the exchange's facts: file order, every rank's slices)."""
    from distload.workers.group import WorkerGroup
    from distload.loading.buckets import run_bytes
    from distload.loading.shared_reads.plan import whole_need
    from distload.loading.loader import Loader

    plans = []
    with WorkerGroup(device="cpu") as group:
        for rank in range(nproc):
            plans.append(Loader(folder, "auto", group=group, tensor_parallel_size=tp,
                                tensor_parallel_rank=rank % tp).plan())
    infos = [t for f in plans[0].index.files for t in f.tensors]
    needs = [[p.slice_runs().get(i, whole_need(t.nbytes)) for i, t in enumerate(infos)] for p in plans]
    plan = ExchangePlan([t.nbytes for t in infos], needs, bucket)
    out = [{"read": 0, "kept_own": 0, "received": 0} for _ in range(nproc)]
    for b, reader in enumerate(plan.readers):
        out[reader]["read"] += plan.read_bytes(b)
        for m in range(nproc):
            kept = run_bytes(run for _, run in plan.pieces(b, m))
            out[m]["kept_own" if m == reader else "received"] += kept
    return out


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("nproc", [2, 4])
def test_tp_ranks_and_their_replicas_read_each_byte_once_and_receive_only_their_slices(llama, tmp_path, nproc):
    """TP 2 on 2 ranks, and TP 2 x DP 2 on 4: the job reads the whole checkpoint once (the dim-1
    tensors too, which each TP rank would fetch whole alone), split over all ranks, and each rank
    receives exactly the bytes of its slices it did not read itself (point to point)."""
    whole, saved = llama
    result, report = run_shared(tmp_path, whole, nproc, tp=2, bucket=1024)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    ranks = report["ranks"]
    state = llama_state()
    checkpoint = sum(t.numel() * t.element_size() for t in state.values())
    assert sum(r["requested_bytes"] for r in ranks) == checkpoint  # each byte read once per job
    planned = planned_exchange(whole, 2, nproc, 1024)
    for r in ranks:
        tp_rank = r["rank"] % 2
        assert r["digest"] == state_digest(rank_reference(saved[2], tp_rank)), r["rank"]
        assert r["path"] == "pread-shared" and r["tensor_parallel"] == [tp_rank, 2]
        want = planned[r["rank"]]
        assert (r["requested_bytes"], r["received_bytes"]) == (want["read"], want["received"]), (r, want)
        assert 0.1 * checkpoint < r["requested_bytes"] < 0.9 * checkpoint * 2 / nproc  # a share of the reads
        # what it received and what it kept of its own reads: exactly its slices (padding is not read)
        assert r["received_bytes"] + want["kept_own"] == slice_request_bytes(state, tp_rank, 2)
        assert r["received_bytes"] <= r["nbytes"]


@pytest.mark.slow
@pytest.mark.dist
def test_replicas_of_a_pre_sharded_checkpoint_read_each_shard_file_once(llama, tmp_path):
    _, saved = llama
    result, report = run_shared(tmp_path, saved[2], 4, tp=2)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    for tp_rank in (0, 1):
        replicas = [r for r in report["ranks"] if r["rank"] % 2 == tp_rank]
        want = rank_reference(saved[2], tp_rank)
        assert [r["digest"] for r in replicas] == [state_digest(want)] * 2
        assert sum(r["requested_bytes"] for r in replicas) == replicas[0]["nbytes"]
        assert [r["path"] for r in replicas] == ["pread-shared"] * 2


@pytest.mark.slow
@pytest.mark.dist
def test_the_node_scope_shares_within_a_node(llama, tmp_path):
    """One host: the node scope shares between the same ranks as the job scope (which ranks a
    scope takes on several hosts: test_sharing_ranks_by_need_and_by_node)."""
    whole, saved = llama
    result, report = run_shared(tmp_path, whole, 4, tp=2, extra={"distributed": "node"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    for r in report["ranks"]:
        assert r["digest"] == state_digest(rank_reference(saved[2], r["rank"] % 2))
        assert r["path"] == "pread-shared" and r["requested_bytes"] < r["nbytes"]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("tp", [0, 2])
def test_a_rank_whose_share_fails_to_read_stops_every_rank_naming_it(llama, tmp_path, tp):
    """A whole checkpoint on 3 ranks, and TP 2 on 2 ranks (the exchange of slices)."""
    if tp:
        folder = llama[0]
        result, _ = run_shared(tmp_path, folder, 2, tp=tp, bucket=1024, fault="fail:1")
    else:
        folder = str(tmp_path / "whole")
        write_whole(folder, {f"w{i}": torch.randn(4096) for i in range(12)}, num_files=2)
        result, _ = run_shared(tmp_path, folder, 3, fault="fail:1")
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert "rank 1 stopped" in out and "Input/output error" in out, out[-3000:]
    assert re.search(r"rank 1 stopped after [0-9.]+ s: .*reading tensor '.+' failed", out), out[-3000:]
    for rank in ((0,) if tp else (0, 2)):
        found = re.search(rf"rank {rank} stopped after ([0-9.]+) s: .*failed on rank\(s\) 1", out)
        assert found, out[-3000:]
        assert float(found.group(1)) < 30  # at the next round, not at the 60 s timeout


@pytest.mark.slow
@pytest.mark.dist
def test_a_rank_that_cannot_prepare_its_messages_stops_every_rank_at_once(llama, tmp_path):
    """TP 2 on 2 ranks: rank 1 runs out of memory packing the pieces it sends rank 0. It says so
    at the round's agreement, before any message travels, so rank 0 stops at once naming it
    rather than waiting out the group's timeout for a message that never comes."""
    result, _ = run_shared(tmp_path, llama[0], 2, tp=2, bucket=1024, fault="pack:1")
    out = result.stdout + result.stderr
    assert result.returncode != 0
    found = re.search(r"rank 0 stopped after ([0-9.]+) s: .*failed on rank\(s\) 1:.*no memory left for a message", out,
                      re.S)
    assert found, out[-3000:]
    assert float(found.group(1)) < 30  # at the round's agreement, not at the 60 s timeout


@pytest.mark.slow
@pytest.mark.dist
def test_a_shared_read_without_the_agreements_needs_is_refused_on_every_rank_at_once(llama, tmp_path):
    """Rank 1's read request lacks what each member keeps (which the load's agreement fills): it
    refuses inside the planning agreement, so rank 0 stops at once too, naming it."""
    result, _ = run_shared(tmp_path, llama[0], 2, tp=2, bucket=1024, fault="needs:1")
    out = result.stdout + result.stderr
    assert result.returncode != 0
    for rank in (0, 1):  # rank 0's message names rank 1 and quotes it (over several lines)
        found = re.search(rf"rank {rank} stopped after ([0-9.]+) s: .*the shared read has members \[0, 1\] but "
                          rf"what 0 keep", out, re.S)
        assert found, out[-3000:]
        assert float(found.group(1)) < 30, out[-3000:]
    assert re.search(r"rank 0 stopped after [0-9.]+ s: planning the shared read failed on rank\(s\) 1", out), out[-3000:]


@pytest.mark.slow
@pytest.mark.dist
def test_ranks_whose_exchange_plans_differ_stop_before_any_message_naming_them(llama, tmp_path):
    """TP 2 on 2 ranks, rank 1 planning with other buckets (as two ranks that read different headers
    of the same file would): their sends and receives would not pair up, so every rank stops at
    the planning, naming the rank whose plan differs, rather than at the group's timeout."""
    result, _ = run_shared(tmp_path, llama[0], 2, tp=2, bucket=1024, fault="bucket:1")
    out = result.stdout + result.stderr
    assert result.returncode != 0
    for rank, other in ((0, 1), (1, 0)):
        found = re.search(rf"rank {rank} stopped after ([0-9.]+) s: rank {rank}: rank\(s\) {other} planned the shared "
                          rf"read from other facts", out)
        assert found, out[-3000:]
        assert float(found.group(1)) < 30, out[-3000:]


@pytest.mark.slow
@pytest.mark.dist
def test_a_rank_killed_mid_read_ends_the_others_in_bounded_time_naming_it(tmp_path):
    """No torchrun agent to end the job: the survivors find out themselves (the lost peer's
    connection, then its heartbeat) and say which rank stopped."""
    from dist_helpers import launch_ranks

    folder = str(tmp_path / "whole")
    write_whole(folder, {f"w{i}": torch.randn(4096) for i in range(12)}, num_files=2)
    script = write_script(tmp_path, "shared.py", SCRIPT)
    start = time.monotonic()
    results = launch_ranks([folder, str(tmp_path / "out.json"), "0", json.dumps({"distributed": "job"}), "4096",
                            "kill:1"], nproc=3, timeout=120, entry=(script,))
    assert time.monotonic() - start < 60  # the group's timeout is 60 s: no survivor waited it out
    assert results[1].returncode == -9
    for rank in (0, 2):
        out = results[rank].stdout + results[rank].stderr
        assert results[rank].returncode == 3, out[-3000:]
        # The other survivor may have exited first, after its own finding: then both are named
        # ("ranks 1, 2 ended"), rank 1 among them.
        assert re.search(rf"rank {rank} stopped after [0-9.]+ s: .*\branks? ([0-9]+, )*1\b", out), out[-3000:]


@pytest.mark.slow
@pytest.mark.dist
def test_a_rank_that_stops_consuming_still_lets_the_others_finish_their_reads(tmp_path):
    folder = str(tmp_path / "whole")
    write_whole(folder, {f"w{i}": torch.randn(4096) for i in range(12)}, num_files=2)
    result, _ = run_shared(tmp_path, folder, 2, fault="close:1")
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert re.search(r"rank 0 stopped after [0-9.]+ s: loading failed on rank\(s\) 1:\s+rank 1: rank 1 stopped "
                     r"consuming tensors", out), out[-3000:]


SUBGROUP_SCRIPT = r"""
import json, sys
import distload
import distload.loading.shared_reads.stream as shared

source, out = sys.argv[1:3]
shared.BUCKET_BYTES = 4096
with distload.WorkerGroup(device="cpu", timeout_s=60) as job:
    readers, other = job.subgroup([0, 1]), job.subgroup([2])
    mine = readers or other
    if readers is not None:  # ranks 0-1 share the reading of the real weights over their subgroup
        result = distload.Loader(source, "auto", {"distributed": "job"}, group=readers).load(digest=True)
    else:  # meanwhile rank 2 loads dummy weights alone
        result = distload.Loader(source, "dummy", group=other).load(digest=True)
    reports = job.exchange(result.rank_report.__dict__)
    if job.rank == 0:
        json.dump(reports, open(out, "w"))
"""


@pytest.mark.slow
@pytest.mark.dist
def test_a_subgroup_shares_its_reads_beside_another_load(tmp_path):
    folder = str(tmp_path / "whole")
    paths = write_whole(folder, every_dtype_state(seed=4), num_files=2)
    script = write_script(tmp_path, "subgroup.py", SUBGROUP_SCRIPT)
    out = str(tmp_path / "out.json")
    result = run_script(script, [folder, out], nproc=3, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    reports = json.load(open(out))
    assert [r["path"] for r in reports] == ["pread-shared", "pread-shared", "dummy"]
    assert [r["digest"] for r in reports[:2]] == [plain_digest(paths)] * 2
    assert sum(r["requested_bytes"] for r in reports[:2]) == reports[0]["nbytes"]


RELOAD_SCRIPT = r"""
import json, sys
import torch
import distload
import distload.loading.shared_reads.stream as shared
from distload.loading.report import state_digest

source, out, tp = sys.argv[1:4]
tp = int(tp) or None
shared.BUCKET_BYTES = 2048
with distload.WorkerGroup(device="cpu", timeout_s=60) as group:
    model = {n: torch.zeros_like(t) for n, t in distload.load(source, "dummy", group=group,
                                                               tensor_parallel_size=tp).items()}
    pointers = {n: t.data_ptr() for n, t in model.items()}
    report = distload.reload_into(model, source, "auto", {"distributed": "job"}, group=group,
                                  tensor_parallel_size=tp)
    same = all(model[n].data_ptr() == p for n, p in pointers.items())
    found = group.exchange({"same": same, "digest": state_digest(model), "nbytes": report.nbytes})
    if group.rank == 0:
        json.dump(found, open(out, "w"))
"""


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("tp", [0, 2])
def test_a_shared_read_fills_existing_tensors_in_place(llama, tmp_path, tp):
    """A whole checkpoint, and TP 2's slices (half rows received straight into the tensor)."""
    if tp:
        folder = llama[0]
        want = [state_digest(rank_reference(llama[1][2], rank)) for rank in (0, 1)]
    else:
        folder = str(tmp_path / "whole")
        want = [plain_digest(write_whole(folder, {f"w{i}": torch.randn(3000) for i in range(5)}, num_files=2))] * 2
    script = write_script(tmp_path, "reload.py", RELOAD_SCRIPT)
    out = str(tmp_path / "out.json")
    result = run_script(script, [folder, out, str(tp)], nproc=2, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    found = json.load(open(out))
    assert all(f["same"] for f in found), "the model's tensors were replaced, not filled"
    assert [f["digest"] for f in found] == want


@pytest.mark.slow
@pytest.mark.dist
def test_ranks_that_would_share_but_see_different_files_are_refused(tmp_path):
    script = write_script(tmp_path, "differ.py", r"""
import os, sys
import torch
import distload
from safetensors.torch import save_file

root = sys.argv[1]
with distload.WorkerGroup(device="cpu", timeout_s=60) as group:
    folder = os.path.join(root, f"copy{group.rank}")  # another folder, other bytes, on each rank
    os.makedirs(folder, exist_ok=True)
    save_file({"w": torch.full((64,), float(group.rank))}, os.path.join(folder, "model.safetensors"))
    try:
        distload.load(folder, "auto", {"distributed": "job"}, group=group)
    except distload.DistloadError as exc:
        print(f"rank {group.rank} refused: {exc}", flush=True)
        sys.exit(3)
""")
    result = run_script(script, [str(tmp_path)], nproc=2, timeout=120)
    assert result.returncode != 0
    for rank in (0, 1):
        assert re.search(rf"rank {rank} refused: .*shared read refused: every rank must read the identical "
                         rf"file list, but rank 1 has \[.*copy1/model.safetensors'\] that rank 0 lacks", result.stdout), \
            result.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("tp", [0, 2])
def test_on_s3_auto_shares_the_reads_and_the_store_serves_each_byte_once(tmp_path, tp):
    """moto behind a byte-counting proxy, auto: the server sends the objects' bytes once (listings,
    headers and HTTP framing included), every rank bit-identical to a plain read. A whole
    checkpoint on 3 ranks; a Llama-shaped one with TP 2 x DP 2 on 4 ranks (reshard's slices):
    the dim-1 tensors too leave the store once, and each rank receives only bytes it keeps."""
    from conftest import read_report, run_distload
    from object_store_servers import ByteCountingProxy, start_moto

    folder = str(tmp_path / "whole")
    if tp:
        from distload import reshard
        from distload.cli.demo import write_demo_checkpoint

        folder, _ = write_demo_checkpoint(str(tmp_path / "demo"), 1, 24, 512)
        reshard(folder, str(tmp_path / "tp2"), tp, sharding="decoder")
        want = {rank: state_digest(rank_reference(str(tmp_path / "tp2"), rank)) for rank in range(tp)}
        paths = sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))
    else:
        paths = write_whole(folder, {f"w{i}": torch.randn(1 << 20) for i in range(6)}, num_files=2)  # 24 MiB
        want = {0: plain_digest(paths)}
    nproc = 4 if tp else 3
    total = sum(os.path.getsize(p) for p in paths)
    os.makedirs(tmp_path / "moto")
    server = start_moto(str(tmp_path / "moto"))
    try:
        uri = server.upload_folder(folder, "shared")
        proxy = ByteCountingProxy(server.port)
        try:
            report_path = str(tmp_path / "report.json")
            result = run_distload(["load", uri, "--report-json", report_path, "--no-progress"]
                                  + (["--tensor-parallel-size", str(tp)] if tp else []), nproc=nproc,
                                  env=server.env(proxy.port), timeout=240)
        finally:
            proxy.close()
    finally:
        server.stop()
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    ranks = read_report(report_path)["ranks"]
    assert [r["path"] for r in ranks] == ["ranged-shared"] * nproc
    assert [r["digest"] for r in ranks] == [want[r["rank"] % max(tp, 1)] for r in ranks]
    tensors = total - sum(8 + header_length(p) for p in paths)
    assert sum(r["requested_bytes"] for r in ranks) == tensors  # each tensor byte asked for once
    assert all(r["received_bytes"] <= r["nbytes"] for r in ranks)  # only what it keeps
    assert total <= proxy.served <= 1.05 * total, (proxy.served, total)


def header_length(path: str) -> int:
    with open(path, "rb") as f:
        return int.from_bytes(f.read(8), "little")


def test_a_send_that_fails_names_the_receiver_not_the_sending_rank(monkeypatch):
    """The reader of a bucket sends each member its pieces: where the send to member 1 fails (its
    process ended), the error names rank 1, not the reader itself."""
    import contextlib
    from datetime import timedelta
    from types import SimpleNamespace

    import distload.loading.shared_reads.stream as shared
    from distload.errors import GroupError

    class Lost:
        def wait(self, timeout):
            raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(shared.dist, "isend", lambda tensor, dst, group: Lost())
    plan = ExchangePlan([8], [[compact([(0, 0, 4)])], [compact([(4, 0, 4)])]], bucket_bytes=8)
    memory = SimpleNamespace(empty=lambda shape, dtype: torch.empty(shape, dtype=dtype))
    request = SimpleNamespace(slices={}, destinations={}, device=torch.device("cpu"), host_memory=memory)
    info = SimpleNamespace(name="w", shape=(8,), torch_dtype=torch.uint8, nbytes=8)
    bucket = shared._Bucket(0, plan, 0, shared._Tensors(request, [info], plan))
    bucket.buffer = torch.zeros(8, dtype=torch.uint8)
    bucket.pack(plan, 0, 2, broadcast=False)
    group = SimpleNamespace(rank=0, ranks=[0, 1], process_group=object(), timeout=timedelta(seconds=1),
                            lost_peers=lambda exc: "", watched=lambda step: contextlib.nullcontext())
    assert plan.readers == [0]
    with pytest.raises(GroupError, match=r"rank 0: lost contact with rank 1 "):
        shared._send(group, [0, 1], 0, [bucket], broadcast=False)
