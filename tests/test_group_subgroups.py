"""A WorkerGroup that stands for some ranks only: made by ``subgroup``, or wrapping a
``torch.distributed`` group the caller made. Loads over it agree with its members only, beside
other loads on the other ranks; a failure inside it ends its members, not the others."""

from __future__ import annotations

import json
import time

import pytest

from conftest import every_dtype_state, plain_digest, write_whole
from dist_helpers import FAILURE_ENV, run_script, write_script

pytestmark = pytest.mark.dist

DEADLINE_S = 90

SCRIPT = r'''
import json, os, sys
import torch.distributed as dist
import distload

folder, out = sys.argv[1], sys.argv[2]
result = {}
with distload.WorkerGroup(device="cpu", timeout_s=30) as job:
    inference = job.subgroup([1, 2])  # every rank makes every subgroup, in the same order
    trainer = job.subgroup([0])
    if job.rank == 0:
        # A load of its own, over a group of one, while ranks 1 and 2 read real weights.
        result["dummy"] = sorted(distload.load(folder, "dummy", group=trainer))
        result["trainer"] = [trainer.rank, trainer.world_size, trainer.ranks, inference is None]
    else:
        loaded = distload.Loader(folder, "safetensors", group=inference).load(gather=True, digest=True)
        result["digests"] = [r.digest for r in loaded.report.ranks]
        result["inference"] = [inference.rank, inference.world_size, inference.ranks, trainer is None]
        try:  # only the job's group makes subgroups (torch numbers groups job-wide)
            inference.subgroup([0])
        except distload.ConfigError as exc:
            result["nested"] = str(exc)
    # The caller's own torch group (new_group is collective over the job), wrapped on its members.
    caller_group = dist.new_group([1, 2], backend="gloo")
    if job.rank != 0:
        with distload.WorkerGroup(device="cpu", process_group=caller_group) as wrapped:
            result["wrapped"] = [wrapped.rank, wrapped.world_size, wrapped.exchange(job.rank)]
            try:
                distload.load(folder, "runai_streamer", {"distributed": True}, group=wrapped)
            except distload.DistloadError as exc:
                result["runai"] = str(exc)
            # Rank 2 fails a step: rank 1 hears of it by its rank in the group.
            try:
                wrapped.agree("a step", lambda: 1 / 0 if job.rank == 2 else None)
            except distload.RankFailedError as exc:
                result["failure"] = [exc.step, sorted(exc.failures)]
            except ZeroDivisionError:
                result["failure"] = "raised here"
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(result, f)
'''


def test_loads_over_subgroups_beside_each_other(tmp_path):
    paths = write_whole(str(tmp_path / "ck"), every_dtype_state(), num_files=2)
    script = write_script(tmp_path, "subgroups.py", SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    start = time.monotonic()
    # Under torchrun: rank 0 is done first and leaves while ranks 1 and 2 form a group through
    # the job's store, which torchrun's agent holds (started as srun starts ranks, rank 0 serves
    # it, and leaving takes it along: torch.distributed's env:// launch, no agent to keep it).
    result = run_script(script, [str(tmp_path / "ck"), str(out)], nproc=3, env=FAILURE_ENV,
                        timeout=DEADLINE_S + 60, torchrun=True)
    assert time.monotonic() - start < DEADLINE_S, "a subgroup step waited for ranks outside it"
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]

    assert ranks[0]["trainer"] == [0, 1, [0], True]
    assert ranks[0]["dummy"] == sorted(every_dtype_state())
    want = plain_digest(paths)
    for rank in (1, 2):
        got = ranks[rank]
        assert got["inference"] == [rank - 1, 2, [1, 2], True]
        assert got["digests"] == [want, want]
        assert got["wrapped"] == [rank - 1, 2, [1, 2]]
        assert "Run:ai's distributed mode runs only over the job's default process group" in got["runai"]
        assert "is called on the whole job's WorkerGroup" in got["nested"]
    assert ranks[1]["failure"] == ["a step", [1]]  # rank 2 of the job is rank 1 of the group
    assert ranks[2]["failure"] == "raised here"


TWICE = r'''
import json, os, sys
import distload
from distload.loading.report import state_digest

folder, out = sys.argv[1], sys.argv[2]
digests = []
for _ in range(4):  # each call forms the job's group from torchrun's store and closes it again
    state = distload.load(folder, device="cpu")
    digests.append(state_digest(state))
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(digests, f)
'''


def test_loads_one_after_another_in_one_torchrun_script_each_form_their_own_group(tmp_path):
    """A script that calls distload.load four times under torchrun: each call forms the job's
    group from torchrun's store and closes it. The store outlives each group; every call's keys
    are its own, so no rank dials a peer's closed port from the call before (it did, "Connection
    refused" in about one run of two, before each group took a prefix of its own). Every load
    equals a plain read."""
    import torch

    folder = str(tmp_path / "whole")
    paths = write_whole(folder, {f"w{i}": torch.randn(1000, 100) for i in range(6)}, num_files=3)
    out = tmp_path / "out"
    out.mkdir()
    for attempt in range(3):  # the race needed a few tries to show
        result = run_script(write_script(tmp_path, "twice.py", TWICE), [folder, str(out)], nproc=2, timeout=DEADLINE_S)
        assert result.returncode == 0, (attempt, result.stderr[-3000:])
        for rank in range(2):
            assert json.loads((out / f"rank{rank}.json").read_text()) == [plain_digest(paths)] * 4, (attempt, rank)


ONE_AFTER_ANOTHER = r'''
import json, os, sys, time
import distload

out = sys.argv[1]
seen = []
for i in range(4):  # four groups in the same processes, as four distload.load calls make them
    with distload.WorkerGroup(device="cpu", timeout_s=20) as group:
        seen.append(group.exchange(10 * i + group.rank))
        if group.rank == 0:
            time.sleep(0.5)  # rank 0, which serves the job's store outside torchrun, closes last
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(seen, f)
'''


def test_groups_formed_one_after_another_where_rank_0_serving_the_store_closes_last(tmp_path):
    """Ranks started as srun starts them (rank 0 serves the job's store) form four groups in a
    row. Ranks 1 and 2 close each group and come to the next while rank 0 still holds the one
    before: every group forms and every exchange arrives (the store made anew for each group
    broke this: the early ranks reached the closing server, failed with "Connection was likely
    closed", and left rank 0 waiting)."""
    script = write_script(tmp_path, "one_after_another.py", ONE_AFTER_ANOTHER)
    done = run_script(script, [str(tmp_path)], nproc=3, timeout=DEADLINE_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for rank in range(3):
        with open(tmp_path / f"rank{rank}.json") as f:
            assert json.load(f) == [[10 * i + r for r in range(3)] for i in range(4)], rank
