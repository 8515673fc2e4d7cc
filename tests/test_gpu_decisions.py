"""The decisions of distload's GPU paths that run on a CPU: which backend a weight sync's pairs
use, what a given-up NCCL transfer does to its pair, how a failed work is read, the timeout of a
session's pairs (findings 1, 2, 7, 16 of design/GPU_REVIEW.md). What only a GPU can show is in
benchmarks/gpu_check.sh."""

from __future__ import annotations

import threading

import pytest

from distload.errors import SyncError
from distload.live import rendezvous, session as session_mod
from distload.live.session import Session, session_backend
from distload.runtime import RUNTIME


def _info(device, gpu=None):
    return {"device": device, "gpu": gpu}


def test_sync_uses_nccl_only_where_every_member_has_a_gpu_of_its_own():
    """Finding 7: NCCL refuses two ranks of a communicator on one GPU ("Duplicate GPU detected")."""
    assert session_backend([_info("cuda", "GPU-a"), _info("cuda", "GPU-b")]) == "nccl"
    assert session_backend([_info("cuda", "GPU-a"), _info("cuda", "GPU-a")]) == "gloo"  # co-located
    assert session_backend([_info("cuda", "GPU-a"), _info("cpu")]) == "gloo"
    assert session_backend([_info("cuda", None), _info("cuda", "GPU-b")]) == "gloo"  # an older member: unknown
    assert session_backend([_info("cpu"), _info("cpu")]) == "gloo"


class _Work:
    def __init__(self, done=False, failure=None):
        self.done, self.failure = done, failure

    def is_completed(self):
        return self.done

    def exception(self):
        return self.failure

    def wait(self, *args):
        return True


class _Pair:
    def __init__(self):
        self.aborted = 0

    def abort(self):
        self.aborted += 1


class _Beat:
    def stop(self):
        pass


def _session(backend, pairs, issued, into_model=()):
    return Session(record=None, store=None, pairs=pairs, backend=backend, me=1, beat=_Beat(), watch=None,
                   address="x", timeout_s=5, name=lambda role, rank: f"{role} {rank}", issued=issued,
                   into_model=list(into_model))


def test_a_given_up_nccl_transfer_aborts_its_pair(monkeypatch):
    """Finding 1: a spinning NCCL kernel is ended (ncclCommAbort), not kept for the watchdog."""
    monkeypatch.setattr(RUNTIME, "given_up_pairs", [])
    stuck, done = _Pair(), _Pair()
    landing = _Work()
    s = _session("nccl", {0: stuck, 1: done}, {0: [landing], 1: [_Work(done=True)]}, [landing])
    assert s.end() == []  # nothing lands any more: settled at once
    assert (stuck.aborted, done.aborted, session_mod.release_given_up()) == (1, 0, 0)


def test_a_given_up_gloo_pair_is_kept_until_its_transfer_ends_then_released(monkeypatch):
    """A gloo pair whose transfer was given up is not destroyed while the transfer waits (that
    would wait with it), nor kept for the life of the process: released once it has ended."""
    import gc
    import weakref

    monkeypatch.setattr(RUNTIME, "given_up_pairs", [])
    stuck = _Pair()
    gone = weakref.ref(stuck)
    landing = _Work()
    s = _session("gloo", {0: stuck}, {0: [landing]}, [landing])
    assert s.end() == [landing] and stuck.aborted == 0
    del stuck
    gc.collect()
    assert gone() is not None and session_mod.release_given_up() == 1  # its transfer still waits in it
    landing.done = True  # the peer went, or the pair's timeout passed
    assert session_mod.release_given_up() == 0
    gc.collect()
    assert gone() is None


def test_a_failed_work_is_a_sync_error_not_an_arrival():
    """Finding 16: WorkNCCL::isCompleted is true on an exception, and wait() without a timeout
    does not raise it."""
    session = _session("nccl", {}, {})
    with pytest.raises(SyncError, match="receiving bucket 3 failed: NCCL error"):
        session.wait(_Work(done=True, failure=RuntimeError("NCCL error: remote process exited")),
                     threading.Event(), lambda: "receiving bucket 3")
    session.wait(_Work(done=True), threading.Event(), lambda: "receiving bucket 3")


def test_pairs_time_out_after_the_channel_timeout_and_abort_only_their_communicator(monkeypatch):
    """Findings 1 and 2: the pairs' op timeout is the channel's, not what was left of the join
    deadline (here already past), and their backend is chosen from the members' GPUs; an NCCL
    pair is made with CleanUpOnly and no dump through the job's store."""
    import time

    import torch.distributed as dist
    made = []
    infos = {"trainer/0": _info("cuda", "GPU-a"), "inference/0": _info("cuda", "GPU-b")}
    record = rendezvous.SessionRecord("s1", 1, 1, {}, infos)
    monkeypatch.setattr(rendezvous, "post_hello", lambda *a: "n")
    monkeypatch.setattr(rendezvous, "await_session", lambda *a: record)
    monkeypatch.setattr(rendezvous, "process_group", lambda store, rank, size, backend, timeout_s, address=None:
                        made.append((backend, timeout_s)) or object())
    store = rendezvous.BoundedStore(dist.HashStore(), "x", "trainer rank 0")  # the channel's bounded store
    s = session_mod.join(store, "inference", 0, 1, _info("cuda", "GPU-b"), time.monotonic() - 1, address="x",
                         timeout_s=120.0, name=lambda role, rank: f"{role} {rank}")
    s.beat.stop()
    assert made == []  # pairs are made for an update's data step, with the peers it moves bytes with
    s.connect([0], threading.Event(), time.monotonic() + 5)
    assert made == [("nccl", 120.0)] and s.backend == "nccl"
    assert dict(rendezvous.PAIR_NCCL_ENV) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}


@pytest.mark.parametrize("rank", [0, 1])
def test_a_cut_piece_does_not_keep_the_whole_tensor(rank):
    """Finding 9: a dim-0 piece of a whole tensor was a view of its storage (GPU memory of the
    whole model on every TP rank)."""
    import torch

    from distload.loading.rank_slices import RankSlices
    from distload.tp.place import TPPlace
    from distload.tp.slices import Action
    whole = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    cut = RankSlices(None, actions={"w": Action(0)}).cut("w", whole, TPPlace(2, rank, None))
    assert torch.equal(cut, whole[rank * 4:(rank + 1) * 4])
    assert cut.untyped_storage().nbytes() == cut.numel() * cut.element_size()
    blocks = RankSlices(None, blocks={"w": ((rank * 4, 0), (4, 8))}).cut("w", whole, None)
    assert torch.equal(blocks, cut) and blocks.untyped_storage().nbytes() == 4 * 8 * 4


def test_runai_short_of_memory_is_twice_the_largest_tensor():
    from distload.loading.backends.runai import short_of_memory
    assert short_of_memory([100, 99, None], 50) == [1]
    assert short_of_memory([None, None], 10**12) == []


AGREE_SCRIPT = r'''
import json, sys
import distload
from distload.loading.backends.runai import all_can_distribute
out = sys.argv[1]
with distload.WorkerGroup(device="cpu", timeout_s=30) as group:
    free = 10**9 if group.rank != 1 else 1000  # rank 1's GPU is shared with another process
    both = all_can_distribute(group, 600, free)
    enough = all_can_distribute(group, 400, free)
    with open(f"{out}.{group.rank}", "w") as f:
        json.dump([both, enough], f)
'''


@pytest.mark.dist
def test_runai_distributed_is_agreed_across_ranks(tmp_path):
    """Finding 12: where one rank would fall back to reading alone, every rank does (real gloo
    group of 3 ranks)."""
    import json

    from dist_helpers import run_script, write_script
    script = write_script(tmp_path, "agree.py", AGREE_SCRIPT)
    result = run_script(script, [str(tmp_path / "out")], nproc=3, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    got = [json.loads((tmp_path / f"out.{rank}").read_text()) for rank in range(3)]
    assert got == [[False, True]] * 3
    assert "rank(s) 1 have less" in result.stderr


def test_a_watched_nccl_step_aborts_the_communicator_when_a_member_stops(monkeypatch):
    """Findings 8 and 14: on NCCL nothing fails for a lost peer before the group's timeout; the
    watch aborts the data group's communicator once a member's heartbeat stands still, and the
    step raises GroupError naming it. (The NCCL abort itself: benchmarks/gpu_check.sh.)"""
    import time
    from datetime import timedelta
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from distload.errors import GroupError
    from distload.workers import group as group_mod
    from distload.workers.group import WorkerGroup
    from distload.workers.heartbeat import _key

    store = dist.HashStore()
    aborted = threading.Event()
    group = object.__new__(WorkerGroup)
    group.launch = SimpleNamespace(rank=0, world_size=2)
    group._ranks, group.timeout, group.device = None, timedelta(seconds=60), torch.device("cpu")
    group._heartbeat = SimpleNamespace(store=store)
    group._data = SimpleNamespace(_get_backend=lambda device: SimpleNamespace(abort=aborted.set))
    monkeypatch.setattr(WorkerGroup, "backend", property(lambda self: "nccl"))
    monkeypatch.setattr(group_mod, "PEER_DEAD_S", 0.6)
    monkeypatch.setattr(group_mod, "carries", lambda backend, device_type: True)
    store.add(_key(1), 1)  # rank 1 beat once, then stopped
    start = time.monotonic()
    with pytest.raises(GroupError, match=r"rank\(s\) 1 \(job-wide\) stopped answering during the shared read"):
        with group.watched("the shared read"):
            while not aborted.is_set():  # a wait that ends only when the communicator is aborted
                assert time.monotonic() - start < 20, "never aborted"
                time.sleep(0.05)
            raise RuntimeError("NCCL communicator was aborted")
    # A member that keeps beating is left alone.
    aborted.clear()
    with group.watched("the shared read"):
        for _ in range(20):
            store.add(_key(1), 1)
            time.sleep(0.1)
    assert not aborted.is_set()
