"""Weight sync between TWO separately launched jobs (a trainer job and an inference job,
each its own world, meeting at a tcp:// rendezvous): whole and sliced tensors, several trainer
ranks, refusals, verification, sleeping receivers, and ``distload sync-demo --role``.

The jobs' scripts are tests/sync_jobs_driver.py; both jobs are started at once and waited for
together.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file, save_file

from distload.cli.main import main as cli_main

from dist_helpers import Job as StartedJob, clean_env, free_port

import sync_jobs_driver as driver

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sync_jobs_driver.py")
JOB_TIMEOUT_S = 100


@dataclass
class Job:
    name: str
    returncode: int
    output: str


def run_jobs(folder, jobs: list[tuple[str, int, list[str]]], timeout: float = JOB_TIMEOUT_S,
             torchrun: bool = False) -> dict[str, Job]:
    """Start every ``(name, nproc, args)`` as its own job at once (dist_helpers.Job: its ranks
    started as srun starts them, or under ``torchrun``; args: a script, or ``-m distload ...``),
    then wait for all of them."""
    started = {}
    for name, nproc, args in jobs:
        log = open(os.path.join(str(folder), f"{name}.log"), "w+")
        started[name] = (StartedJob(list(args), nproc, clean_env(), log, torchrun=torchrun), log)
    deadline = time.monotonic() + timeout
    done = {}
    try:
        for name, (job, log) in started.items():
            try:
                job.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for name, (job, log) in started.items():
            timed_out = job.returncode is None
            if timed_out:
                job.kill()  # every rank: the job's own process group
            log.seek(0)
            done[name] = Job(name, job.returncode, ("TIMED OUT\n" if timed_out else "") + log.read())
            log.close()
    return done


@dataclass
class Run:
    trainer: list[dict]  # each rank's result, in rank order
    inference: list[dict]
    jobs: dict[str, Job]

    def outputs(self) -> str:
        return "\n".join(f"===== {j.name} job (rc {j.returncode}) =====\n{j.output[-6000:]}" for j in self.jobs.values())

    def assert_exited_cleanly(self) -> None:
        """Both jobs exited 0 (checked after the behaviour, so that a crash at exit does not hide it)."""
        for job in self.jobs.values():
            assert job.returncode == 0, f"the {job.name} job exited {job.returncode}:\n{self.outputs()}"


def run_driver(folder, scenario: str, trainer_nproc: int, inference_nproc: int, *args: str) -> Run:
    """Both sides of ``scenario`` as two jobs started together; each rank's result."""
    address = f"tcp://127.0.0.1:{free_port()}"
    out = str(folder)
    jobs = run_jobs(folder, [(role, nproc, [DRIVER, scenario, role, address, out, *args])
                             for role, nproc in (("trainer", trainer_nproc), ("inference", inference_nproc))])
    run = Run([], [], jobs)
    for role, nproc in (("trainer", trainer_nproc), ("inference", inference_nproc)):
        for rank in range(nproc):
            path = os.path.join(out, f"{role}{rank}.json")
            assert os.path.exists(path), f"{role} rank {rank} wrote no result\n{run.outputs()}"
            with open(path) as f:
                row = json.load(f)
            assert "crash" not in row, f"{role} rank {rank} failed:\n{row['crash']}\n{run.outputs()}"
            getattr(run, role).append(row)
    _assert_two_worlds(run, trainer_nproc, inference_nproc)
    return run


def _assert_two_worlds(run: Run, trainer_nproc: int, inference_nproc: int) -> None:
    """Two jobs, each its own world: its own store (MASTER_PORT) and world size, and distinct processes."""
    trainer, inference = run.trainer, run.inference
    assert [r["world_size"] for r in trainer] == [trainer_nproc] * trainer_nproc
    assert [r["world_size"] for r in inference] == [inference_nproc] * inference_nproc
    assert [r["rank"] for r in trainer] == list(range(trainer_nproc))
    assert [r["rank"] for r in inference] == list(range(inference_nproc))
    assert len({r["job"] for r in trainer}) == 1 and len({r["job"] for r in inference}) == 1
    assert trainer[0]["job"] != inference[0]["job"]
    assert len({r["pid"] for r in trainer + inference}) == trainer_nproc + inference_nproc


def mixed_bytes() -> int:
    return driver.nbytes(driver.state_of(driver.mixed_shapes(), 0))


# -- 1. whole tensors ---------------------------------------------------------------------------

@pytest.mark.dist
def test_full_tensors_one_trainer_to_two_inference_ranks_three_versions(tmp_path):
    """On one host the pairs hand off through shared memory; a second channel in the same jobs,
    forced onto the socket, delivers the same versions exactly. The segment's file leaves
    /dev/shm once the session formed, and nothing of it is held after close."""
    results = run_driver(tmp_path, "full", 1, 2, f"tcp://127.0.0.1:{free_port()}")
    total = mixed_bytes()
    shapes = driver.mixed_shapes()
    expected = {v: driver.digest(driver.state_of(shapes, v)) for v in (1, 2, 3)}
    assert len(set(expected.values())) == 3  # every version differs from the others
    (trainer,) = results.trainer
    pushes = trainer["pushes"]
    assert [p["version"] for p in pushes] == [1, 2, 3]
    assert [p["digest"] for p in pushes] == [expected[1], expected[2], expected[3]]
    for push in pushes:
        assert push["nbytes"] == push["state_bytes"] == total, push
        assert push["num_tensors"] == len(shapes) and push["num_buckets"] > 3, push
        assert push["wire_bytes"] >= 2 * total, push  # each of the 2 receivers got every byte
        assert push["transport"] == "shm", push  # one host: packed once into the segment, for both receivers
    for rank in results.inference:
        receives = rank["receives"]
        assert [r["version"] for r in receives] == [1, 2, 3], rank
        assert [r["channel_version"] for r in receives] == [1, 2, 3], rank
        for r, push in zip(receives, pushes):
            assert r["digest"] == push["digest"], (rank["rank"], r)  # what the sender had, bit for bit
            assert r["exact"] and r["in_place"] and r["consistent"], (rank["rank"], r)
            assert r["nbytes"] == total == rank["target_bytes"], r
            assert r["num_tensors"] == len(shapes) and r["num_buckets"] == push["num_buckets"], r
            assert total <= r["wire_bytes"] <= total * 1.05, r
            assert r["verified"], r  # every update is checked by default
            assert r["transport"] == "shm", r
        assert [(r["version"], r["exact"], r["transport"]) for r in rank["socket"]] == [
            (v, True, "socket") for v in (1, 2, 3)], rank["socket"]
    # On the socket the two receivers are a relay chain (pairing.relay): the trainer sends each
    # version once, to its head, which passes it on; through shared memory it is read by both.
    assert [(p["version"], p["transport"], 2 * p["wire_bytes"]) for p in trainer["socket"]] == [
        (p["version"], "socket", p["wire_bytes"]) for p in pushes]
    for rank in [trainer] + results.inference:
        # Open: the trainer holds its segment (no longer named in /dev/shm), each receiver maps it.
        assert rank["held_open"]["fds"] >= 1 and rank["held_open"]["maps"] >= 1, rank
        assert rank["held_open"]["named"] == 0 and rank["held_closed"] == {"fds": 0, "maps": 0, "named": 0}, rank
    results.assert_exited_cleanly()


# -- 1b. deltas -----------------------------------------------------------------------------------

@pytest.mark.dist
def test_a_patch_must_save_more_where_every_receiver_reads_the_trainers_memory(tmp_path):
    """4% of the elements changed a version (a real AdamW step in bf16) through two delta
    channels in the same jobs. On the socket each version is a patch of about 8% of the bytes. On
    one host, where a byte whole costs a memory copy and the patch's changes cost more than the
    bytes they save (results/sync_choice.md), no version goes as a patch: the compares give up,
    the tensors go whole and then rest, their pushes full updates. Both land bit for bit."""
    results = run_driver(tmp_path, "margin", 1, 1, f"tcp://127.0.0.1:{free_port()}")
    (trainer,), (receiver,) = results.trainer, results.inference
    names = sorted(driver.MARGIN_SHAPES)
    full = trainer["auto"][0]["wire_bytes"]
    assert trainer["auto"][0]["delta"] is False and trainer["socket"][0]["delta"] is False
    for push in trainer["socket"][1:]:
        assert push["delta"] and push["sent_whole"] == [] and push["wire_bytes"] < 0.1 * full, push
    for push in trainer["auto"][1:]:
        assert push["transport"] == "shm", push
        assert (not push["delta"] or push["sent_whole"] == names) and push["wire_bytes"] <= full + 1024, push
    assert sum(not p["delta"] for p in trainer["auto"][1:]) >= 3, trainer["auto"]  # resting: full updates
    for kind in ("auto", "socket"):
        assert [(r["version"], r["exact"]) for r in receiver[kind]] == [(v, True) for v in driver.MARGIN_VERSIONS]
        assert [r["delta"] for r in receiver[kind]] == [p["delta"] for p in trainer[kind]]
    results.assert_exited_cleanly()


@pytest.mark.dist
@pytest.mark.parametrize("transport", ["auto", pytest.param("socket", marks=pytest.mark.slow)])
def test_a_delta_update_sends_what_would_not_pay_whole_and_checks_it(tmp_path, transport):
    """sync_jobs_driver.CHOICE_STEPS through the default (delta) channel, handed off through
    shared memory (auto, on one host) or on the socket. A tensor with every element changed goes
    whole beside another's patch in one bucket, and lands bit for bit; an update where every
    element of every tensor changed sends no more than a full push (its header and checks aside),
    and the trainer's compare gave up before it took the changes out (its scratch stays small: it
    never held a patch of every element); a corrupted whole piece of a mixed update fails its
    check, and the receiver is back at its version exactly. A tensor whose compare gave up goes
    whole the push after too (its copy refreshed), and is compared again the next: a patch."""
    results = run_driver(tmp_path, "choice", 1, 1, transport)
    (trainer,), (receiver,) = results.trainer, results.inference
    pushes, receives = trainer["pushes"], receiver["receives"]
    state_bytes = pushes[0]["state_bytes"]
    one = state_bytes // 3 + 1  # a tensor's bytes (the two big ones), and "norm"'s within it
    assert [p.get("delta") for p in pushes] == [False, True, True, None, False, True, True], pushes
    for stats in (pushes[1], receives[1], pushes[5], receives[5], pushes[6], receives[6]):  # mixed
        assert stats["sent_whole"] == ["dense"] and stats["whole_bytes"] == 512 * 512 * 2, stats
    assert pushes[1]["wire_bytes"] < 512 * 512 * 2 + 0.01 * one, pushes[1]  # the patch: 0.1% of sparse
    assert pushes[2]["sent_whole"] == receives[2]["sent_whole"] == ["dense", "norm", "sparse"], pushes[2]
    assert pushes[2]["whole_bytes"] == state_bytes, pushes[2]
    assert pushes[2]["wire_bytes"] <= pushes[0]["wire_bytes"] + 1024, (pushes[0], pushes[2])  # as a full push
    # the compare gave up in its first block of every tensor, before extracting a change of it
    assert all(p["scratch_bytes"] < 64 * 1024 for p in pushes), [p["scratch_bytes"] for p in pushes]
    assert pushes[3]["error"].startswith("inference rank 0: ") and "failed its checksum" in pushes[3]["error"], pushes[3]
    assert receives[3]["error"].startswith("version 4 did not arrive whole; still at version 3"), receives[3]
    assert receives[3]["unchanged"] and receives[3]["consistent"] and receives[3]["channel_version"] == 3, receives[3]
    for i, row in enumerate(receives):
        assert row["exact"] and row["consistent"], (i, row)
        if i != 3:
            assert row["version"] == row["channel_version"] == driver.CHOICE_STEPS[i][0], (i, row)
            assert row["delta"] == pushes[i]["delta"], (i, row, pushes[i])
    results.assert_exited_cleanly()


@pytest.mark.dist
def test_delta_updates_of_real_steps_end_bit_identical_or_fail_undone(tmp_path):
    """sync_jobs_driver.DELTA_STEPS: AdamW steps of a Llama's fp32 weights, cast to bf16, pushed to
    TP 2 inference ranks. After the first (full) update each is a delta of a fraction of the
    bytes; every receiver ends with the trainer's exact slices, or, where its base drifted (found
    by the patch sums or by the audit) or a receiver failed mid-update, every receiver is back at
    its previous version exactly (the undo) and the same state pushed again arrives in full; so
    does the first push of a restarted trainer (a new channel: it holds no base), and the update
    after a receiver's tensor was rewritten by a torch op (its write count moved: seen before
    any byte moves, so no error, and that receiver alone takes every byte)."""
    results = run_driver(tmp_path, "delta", 1, 2)
    (trainer,) = results.trainer
    pushes = trainer["pushes"]
    assert [p["version"] for p in pushes] == [v for v, _, _ in driver.DELTA_STEPS]
    failed = {4: "inference rank 1", 7: "inference rank 0", 9: "inference rank 1"}
    for i, push in enumerate(pushes):
        assert ("error" in push) == (i in failed), (i, push)
        if i in failed:
            assert push["error"].startswith(f"{failed[i]}: "), push["error"]
    assert "were not the base's here" in pushes[4]["error"]  # drift at changed positions: the patch sums
    assert "not the version 4 it received" in pushes[4]["error"]
    assert "injected: this receiver fails in its third bucket" in pushes[7]["error"]
    assert "differ from trainer rank 0's after the update" in pushes[9]["error"]  # drift elsewhere: the audit
    # ... and after the restart (a new trainer: no base) one full update, then deltas again; a
    # tensor rewritten by a torch op is seen before the update: that receiver takes every byte.
    # Version 4 is a delta of nearly every byte whole: every big tensor's compare gave up on version
    # 3 (lr 1e-2), so its copy is refreshed and not compared; the norms, whose single changes did
    # not pay at version 2 on one host (a norm of 128 elements) and were refreshed at 3, are compared
    # again. Version 5 compares everything again.
    assert [p.get("delta") for p in pushes] == [False, True, True, True, None, False, True, None, False, None,
                                                False, False, True, True]
    assert all(p["verified"] for p in pushes if "error" not in p), pushes
    full, step = pushes[0]["wire_bytes"], pushes[1]["wire_bytes"]
    assert full >= pushes[0]["state_bytes"] and step < 0.05 * full, (full, step)  # lr 2e-7: about 1.1% of the elements changed
    assert step < pushes[2]["wire_bytes"] <= 1.05 * full, pushes[2]  # lr 1e-2: most pieces raw
    assert pushes[-1]["base_bytes"] == pushes[-1]["state_bytes"]  # the trainer's host copy: 1x the state

    # (version held after each receive, whether it took a delta) on each rank; None: it failed
    took = {0: [True, True, True, None, False, False, None, False, None, False, False, True, False],
            1: [True, True, True, None, False, True, None, False, None, False, False, True, True]}
    for rank in results.inference:
        r = rank["rank"]
        receives = rank["receives"]
        assert [x["channel_version"] for x in receives] == [1, 2, 3, 4, 4, 5, 6, 6, 7, 7, 8, 9, 10, 11], (r, receives)
        assert [x.get("delta") for x in receives[1:]] == took[r], (r, receives)
        for i, x in enumerate(receives):
            assert x["consistent"], (r, i, x)
            if i in failed:
                assert x["error"].startswith(f"version {x['version']} did not arrive whole; still at version "
                                             f"{x['channel_version']} (every change undone)"), x["error"]
                assert x["unchanged"], (r, i)  # exactly its previous tensors, drift included
                assert x["exact"] == (failed[i] != f"inference rank {r}" or i == 7), (r, i)
            else:
                assert x["exact"] and x["verified"] and x["transport"] == "shm", (r, i, x)
        assert receives[1]["wire_bytes"] < 0.15 * receives[0]["wire_bytes"], receives[1]
        assert receives[0]["own_bytes"] <= receives[0]["wire_bytes"] <= 1.05 * receives[0]["own_bytes"]
    assert results.inference[0]["receives"][7]["calls"] == 3
    results.assert_exited_cleanly()


# -- 2. tensor-parallel slices --------------------------------------------------------------------

def _write_llama_checkpoint(folder: str) -> dict[str, torch.Tensor]:
    os.makedirs(folder)
    state = driver.llama_state(1)
    names = sorted(state)
    save_file({n: state[n] for n in names[0::2]}, os.path.join(folder, "model-00001-of-00002.safetensors"))
    save_file({n: state[n] for n in names[1::2]}, os.path.join(folder, "model-00002-of-00002.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(driver.LLAMA_CONFIG, f)
    return state


def _saved_rank(folder: str, tp_rank: int) -> dict[str, torch.Tensor]:
    paths = sorted(glob.glob(os.path.join(folder, f"model-rank-{tp_rank}-part-*.safetensors")))
    assert paths, os.listdir(folder)
    state: dict[str, torch.Tensor] = {}
    for path in paths:
        state.update(load_file(path))
    return state


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("inference_nproc", [2, 4], ids=["tp2", "tp2x2-replicas"])
def test_sliced_receive_equals_save_sharded(tmp_path, inference_nproc):
    """Each inference rank (TP 2, decoder spec) holds exactly what ``reshard
    --tensor-parallel-size 2 --sharding decoder`` writes for its TP rank, and received little more
    than those bytes. With 4 ranks, ranks 2 and 3 are a second replica of TP ranks 0 and 1."""
    src, saved = str(tmp_path / "src"), str(tmp_path / "saved")
    whole = _write_llama_checkpoint(src)
    # `python -m distload reshard SRC DEST -tp 2 --sharding decoder`, run in this process
    # (the same entry point as `python -m distload`; a third interpreter would only slow the jobs).
    assert cli_main(["reshard", src, saved, "--tensor-parallel-size", "2", "--sharding", "decoder"]) == 0
    results = run_driver(tmp_path, "sliced", 1, inference_nproc, src, "2")

    (trainer,) = results.trainer
    whole_bytes = driver.nbytes(whole)
    assert trainer["pushes"][0]["nbytes"] == trainer["pushes"][0]["state_bytes"] == whole_bytes
    shapes = driver.llama_slice_shapes(2)
    slices = {tp: _saved_rank(saved, tp) for tp in (0, 1)}
    assert not torch.equal(slices[0]["model.layers.0.self_attn.q_proj.weight"],
                           slices[1]["model.layers.0.self_attn.q_proj.weight"])  # really different slices
    for tp in (0, 1):
        assert {n: tuple(t.shape) for n, t in slices[tp].items()} == shapes, "reshard's shapes"
        embed = slices[tp]["model.embed_tokens.weight"]
        if tp == 1:  # 16500 rows padded to 16512: TP rank 1 holds rows 8256..16499 and 12 zero rows
            assert not embed[-12:].view(torch.uint8).any() and embed[-13].view(torch.uint8).any()
    sent_to_receivers = 0
    for rank in results.inference:
        r = rank["rank"]
        got = load_file(str(tmp_path / f"received{r}.safetensors"))
        want = slices[r % 2]
        assert set(got) == set(want), r
        for name in want:
            assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, (r, name)
            assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), (r, name)
        (stats,) = rank["receives"]
        own = driver.nbytes(want)
        assert stats["version"] == stats["channel_version"] == 1 and stats["in_place"], stats
        assert stats["nbytes"] == own == rank["target_bytes"], (r, stats, own)
        assert own < 0.6 * whole_bytes, (own, whole_bytes)
        assert own <= stats["wire_bytes"] <= 1.05 * own, (r, stats["wire_bytes"], own)
        sent_to_receivers += stats["wire_bytes"]
    assert trainer["pushes"][0]["wire_bytes"] == sent_to_receivers
    results.assert_exited_cleanly()


# -- 3. several trainer ranks --------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.dist
def test_two_trainer_ranks_push_disjoint_names_to_one_receiver(tmp_path):
    results = run_driver(tmp_path, "two-trainers", 2, 1)
    shapes = driver.mixed_shapes()
    t0, t1 = results.trainer
    assert set(t0["names"]).isdisjoint(t1["names"]) and set(t0["names"]) | set(t1["names"]) == set(shapes)
    (receiver,) = results.inference
    for version, (r, p0, p1) in enumerate(zip(receiver["receives"], t0["pushes"], t1["pushes"]), start=1):
        assert r["version"] == r["channel_version"] == p0["version"] == p1["version"] == version
        assert r["exact"] and r["in_place"], r
        assert p0["num_tensors"] == len(t0["names"]) and p1["num_tensors"] == len(t1["names"])
        assert p0["nbytes"] == p0["state_bytes"] and p1["nbytes"] == p1["state_bytes"]
        assert r["num_tensors"] == len(shapes)
        assert r["nbytes"] == p0["nbytes"] + p1["nbytes"] == mixed_bytes() == receiver["target_bytes"]
        assert r["num_buckets"] == p0["num_buckets"] + p1["num_buckets"]
    assert len(receiver["receives"]) == 2
    results.assert_exited_cleanly()


# -- 4. a receiver that does not fit ---------------------------------------------------------------

@pytest.fixture(scope="module")
def misfit_run(tmp_path_factory):
    return run_driver(tmp_path_factory.mktemp("misfit"), "misfit", 1, 2)


@pytest.mark.slow
@pytest.mark.dist
def test_misfit_receiver_refuses_before_any_byte_moves(misfit_run):
    trainer, (r0, r1) = misfit_run.trainer[0], misfit_run.inference
    v1, one, ten, v4 = trainer["pushes"]
    assert "error" not in v1 and "error" not in v4, trainer["pushes"]

    assert one["error"].startswith("update to version 2 refused, nothing was sent"), one
    assert ("inference rank 1: 1 tensor does not fit: w03: sent F32 [16, 32], here torch.float32 [15, 32]"
            in one["error"]), one
    assert "inference rank 0" not in one["error"] and "more)" not in one["error"], one

    assert ten["error"].startswith("update to version 3 refused, nothing was sent"), ten
    assert "inference rank 1: 10 tensors do not fit: " in ten["error"], ten
    assert ten["error"].count(": sent F32 [16, 32], here torch.float32 [32, 16]") == 4, ten  # 4 shown
    assert ten["error"].endswith("(and 6 more)"), ten

    for rank in (r0, r1):
        first, refused_one, refused_ten, last = rank["receives"]
        assert first["version"] == 1 and first["exact"], first
        for refused, push in ((refused_one, one), (refused_ten, ten)):
            assert refused["error"] == push["error"], (rank["rank"], refused)  # the same refusal everywhere
            assert refused["last_error"] == push["error"], refused
            assert refused["channel_version"] == 1 and refused["consistent"], refused
            assert refused["unchanged"] and not refused["exact"], refused  # still version 1's bytes
        assert last["version"] == last["channel_version"] == 4 and last["exact"] and last["consistent"], last
        assert last["nbytes"] == driver.nbytes(driver.state_of(driver.MISFIT_SHAPES, 4)), last
    misfit_run.assert_exited_cleanly()


@pytest.mark.dist
@pytest.mark.slow
def test_a_refusal_keeps_the_session(misfit_run):
    """channel.py's _check_refusals: "nothing moved: the session stays, the next update takes the
    next number". The next fitting update runs in the same session, on every member."""
    sessions = [p["session"] for p in misfit_run.trainer[0]["pushes"]]
    assert sessions[0] is not None and sessions == [sessions[0]] * 4, sessions
    for rank in misfit_run.inference:
        assert [r["session"] for r in rank["receives"]] == sessions, rank["receives"]


# -- 5. verification -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def verify_run(tmp_path_factory):
    return run_driver(tmp_path_factory.mktemp("verify"), "verify", 1, 2)


@pytest.mark.slow
@pytest.mark.dist
def test_verify_catches_a_bucket_corrupted_after_its_checksum(verify_run):
    (trainer,) = verify_run.trainer
    pushes = trainer["pushes"]
    assert [p["version"] for p in pushes] == [1, 2, 3, 4, 5]
    for clean in (pushes[0], pushes[2], pushes[4]):
        assert "error" not in clean and clean["verified"], clean  # the inference side asked for it
    packed, direct = pushes[1], pushes[3]
    assert 1024 * 1024 * 4 in direct["summed"], direct  # the direct tensor's checksum was made wrong
    # buckets 0-3 hold two 16 KiB tensors each; bucket 4 is the 4 MiB tensor, sent directly
    for failed, bucket in ((packed, 1), (direct, 4)):
        assert f"bucket {bucket} from trainer rank 0 failed its checksum" in failed.get("error", ""), failed
    for rank in verify_run.inference:
        receives = rank["receives"]
        for clean in (receives[0], receives[2], receives[4]):
            assert "error" not in clean and clean["verified"] and clean["exact"], clean
            assert clean["version"] == clean["channel_version"] and clean["consistent"], clean
        assert [r["channel_version"] for r in receives] == [1, 1, 3, 3, 5], receives
        assert receives[1]["corrupted"], receives[1]  # the second packed bucket landed with a flipped byte
        for bad, old in ((receives[1], 1), (receives[3], 3)):
            assert "checksum" in bad.get("error", ""), (rank["rank"], bad)
            assert f"still at version {old}" in bad["error"] and bad["last_error"] == bad["error"], bad
            # rolled back: the corrupted bucket never stays in the tensors
            assert bad["consistent"] is True and bad["holds_its_version"], bad
            assert "(what had landed was rolled back)" in bad["error"], bad


@pytest.mark.dist
@pytest.mark.slow
def test_trainer_exits_cleanly_after_an_update_failed_mid_data(verify_run):
    """The failed update's receivers stopped receiving after the corrupted bucket, so the
    trainer's send of a later bucket never completes: the process must still exit normally
    (not abort at exit with "terminate called without an active exception")."""
    verify_run.assert_exited_cleanly()


# -- 6. a sleeping receiver ----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.dist
def test_sleeping_receiver_refuses_then_wakes_and_receives(tmp_path):
    results = run_driver(tmp_path, "sleep", 1, 2)
    (trainer,) = results.trainer
    first, refused, retried = trainer["pushes"]
    assert "error" not in first and "error" not in retried and retried["version"] == 2, trainer["pushes"]
    assert "refused, nothing was sent" in refused.get("error", ""), refused
    assert "inference rank 1" in refused["error"] and "asleep" in refused["error"], refused
    r0, r1 = results.inference
    assert r1["released"] > 0 and r1["storage_bytes_asleep"] == 0, r1
    for rank in (r0, r1):
        assert rank["v1"]["exact"], rank["v1"]
        asleep = rank["asleep_receive"]
        assert asleep["error"] == refused["error"], (rank["rank"], asleep)
        assert asleep["version"] == 1 and asleep["consistent"], asleep
        assert rank["v2"]["exact"] and rank["v2"]["version"] == rank["v2"]["channel_version"] == 2, rank["v2"]
        assert rank["v2"]["digest"] != rank["v1"]["digest"]
    assert r0["asleep_receive"]["unchanged"], r0
    assert r1["woken_digest"] == r1["v1"]["digest"], r1  # level 1 kept version 1, bit for bit
    assert r1["level2_zeros"], r1
    assert r0["v2"]["digest"] == r1["v2"]["digest"]
    results.assert_exited_cleanly()


def test_a_sleeping_model_with_storages_that_cannot_resize_is_refused_as_asleep():
    """WeightSleeper swaps out storages it cannot resize (numpy-backed tensors, as Run:ai hands
    out): while asleep, such a tensor has shape [0]. A receive must still be refused as "asleep"
    (wake() first), not as a tensor of the wrong shape."""
    import numpy as np

    import distload
    from distload.live.transfer import SyncTensor, check_pieces, group_entries, layouts
    from distload.tp.place import TPPlace

    target = {"w": torch.from_numpy(np.zeros((48, 40), dtype=np.float32))}
    assert not target["w"].untyped_storage().resizable()
    sleeper = distload.WeightSleeper(target)
    sleeper.sleep(level=2)
    sent = [SyncTensor("w", "F32", (48, 40), 48 * 40 * 4)]
    pieces = [piece for layout in layouts(sent, group_entries(sent, 1 << 20), TPPlace(), False)
              for piece, _ in layout.items]
    problems = check_pieces(sent, pieces, target)
    sleeper.wake()
    assert len(problems) == 1 and "asleep" in problems[0], problems
    assert check_pieces(sent, pieces, target) == []


# -- 7. the CLI ----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.dist
def test_sync_demo_as_two_torchrun_jobs(tmp_path):
    from distload.cli.sync_demo import demo_state, kept_slices
    from distload.loading.report import state_digest

    address = f"tcp://127.0.0.1:{free_port()}"
    common = ["-m", "distload", "sync-demo", "--rendezvous", address, "--versions", "3", "--change", "0.01",
              "--size-mib", "16", "--device", "cpu", "--timeout", "60"]
    reports = {role: str(tmp_path / f"{role}.json") for role in ("trainer", "inference")}
    jobs = run_jobs(tmp_path, [
        ("trainer", 1, common + ["--role", "trainer", "--report-json", reports["trainer"]]),
        ("inference", 2, common + ["--role", "inference", "--tensor-parallel-size", "2",
                                   "--report-json", reports["inference"]])], torchrun=True)
    for job in jobs.values():
        assert job.returncode == 0, f"{job.name}:\n{job.output[-6000:]}"
    assert "every inference rank holds exactly the slices it was sent: yes" in jobs["inference"].output

    with open(reports["inference"]) as f:
        inference = json.load(f)
    with open(reports["trainer"]) as f:
        trainer = json.load(f)
    assert inference["role"] == "inference" and [r["rank"] for r in inference["ranks"]] == [0, 1]
    assert trainer["role"] == "trainer" and [r["rank"] for r in trainer["ranks"]] == [0]
    pushed = trainer["ranks"][0]["versions"]
    assert [p["version"] for p in pushed] == [1, 2, 3]
    assert [p["delta"] for p in pushed] == [False, True, True]  # versions that change like training steps
    received_total = {1: 0, 2: 0, 3: 0}
    for rank in inference["ranks"]:
        rows = rank["versions"]
        assert [row["version"] for row in rows] == [1, 2, 3], rows
        for row in rows:
            assert row["matches"] is True and row["verified"] is True, row  # verified by default
            # Not only the demo's own say-so: the digest is that of this TP rank's slices.
            want = state_digest(kept_slices(demo_state(16, row["version"], torch.device("cpu"), change=0.01), 2,
                                            rank["rank"]))
            assert row["digest"] == want, (rank["rank"], row)
            assert isinstance(row["seconds"], float) and row["seconds"] > 0, row
            if row["version"] == 1:
                assert row["tensor_bytes"] <= row["bytes_received"] <= 1.05 * row["tensor_bytes"], row
            else:  # 1% of the elements: 4 bytes each and the checks, about 2% of the bf16 bytes
                assert row["delta"] and row["bytes_received"] < 0.04 * row["tensor_bytes"], row
            received_total[row["version"]] += row["bytes_received"]
    assert inference["ranks"][0]["versions"][0]["digest"] != inference["ranks"][1]["versions"][0]["digest"]
    whole = sum(t.numel() * t.element_size() for t in demo_state(16, 1, torch.device("cpu")).values())
    for push in pushed:
        assert push["bytes_sent"] == received_total[push["version"]], (push, received_total)
        assert push["bytes_sent"] < 0.6 * 2 * whole  # slices, not two whole copies


@pytest.mark.dist
def test_receivers_that_say_what_they_keep_get_only_that(tmp_path):
    """``keeps=`` (how a vLLM worker says the slices its weight map needs): each inference rank
    holds exactly its cuts of every version (runs of rows, a column range, nothing of a tensor,
    the rest whole), received about its own bytes only, and after the first version as deltas."""
    results = run_driver(tmp_path, "cuts", 1, 2)
    (trainer,) = results.trainer
    assert [p["delta"] for p in trainer["pushes"]] == [False, True, True], trainer["pushes"]
    for rank in results.inference:
        receives = rank["receives"]
        assert [r["version"] for r in receives] == [1, 2, 3]
        assert all(r["exact"] and r["verified"] for r in receives), receives
        assert rank["seen"] == [sorted(driver.CUT_SHAPES)] * 3  # asked once per update, with every tensor
        own = rank["target_bytes"]
        assert receives[0]["nbytes"] == own and own <= receives[0]["wire_bytes"] <= 1.05 * own, (own, receives[0])
        assert own < 0.6 * trainer["pushes"][0]["state_bytes"]
        assert receives[1]["delta"] and receives[1]["wire_bytes"] < 0.25 * own, receives[1]
    assert trainer["pushes"][0]["wire_bytes"] == sum(r["receives"][0]["wire_bytes"] for r in results.inference)
    results.assert_exited_cleanly()
