"""distload as verl's checkpoint engine (issue 32), against the real verl package (0.9.1, in its
own environment ``.verl-venv``, which ``bash .ci/run`` makes; or DISTLOAD_VERL_PYTHON): verl's
protocol moves every version exactly, across separate processes and inside a local Ray cluster
through verl's own CheckpointEngineManager; a rollout worker killed mid-update ends the others'
waits within their timeout, naming it, in both; a replacement rejoins. One driver run (tests/verl_driver.py)
for the module: the tests read its result.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from conftest import in_ci

pytestmark = [pytest.mark.verl, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, "tests", "verl_driver.py")
TIMEOUT_S = 20.0  # the engines' timeout_s in the driver


def verl_python() -> str:
    path = os.environ.get("DISTLOAD_VERL_PYTHON") or os.path.join(ROOT, ".verl-venv", "bin", "python")
    if not os.path.exists(path):
        message = f"no verl environment at {path}; bash .ci/run installs verl there (or set DISTLOAD_VERL_PYTHON)"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="module")
def driven():
    from dist_helpers import clean_env

    result = subprocess.run([verl_python(), DRIVER, "processes", "ray"], capture_output=True, text=True,
                            timeout=600, env=clean_env())
    lines = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(lines[0][len("RESULT "):])


def _ok(answer: list) -> dict:
    status, out, _ = answer
    assert status == "ok", out
    return out


def test_verls_protocol_moves_every_version_exactly_across_processes(driven):
    """The master actor worker -> 2 rollout workers; verl's global_steps 10, 20, 30 carried as the versions; the group formed again before every
    update, as verl does, and the channel kept: after the first, each update is a delta."""
    steps = driven["processes"]["steps"]
    for step, update in steps.items():
        sent = _ok(update["actors"][0])
        assert sent["distload/verified"] and sent["distload/delta"] == (step != "10")
        for answer in update["rollouts"]:
            got = _ok(answer)
            assert got["wrong"] == [] and got["version"] == int(step) and got["verified"], got
            assert got["delta"] == (step != "10")
            assert got["transport"] == "shm"  # every worker on this one host: through shared memory
    # a delta sends a fraction of the bytes (about 1% of the elements move from step to step)
    assert steps["20"]["actors"][0][1]["distload/wire_bytes"] < 0.3 * steps["10"]["actors"][0][1]["distload/wire_bytes"]


def test_a_rollout_worker_killed_mid_update_ends_the_others_in_time_and_a_replacement_rejoins(driven):
    killed = driven["processes"]["killed"]
    assert killed["exitcode"] == -9
    (trainer,) = killed["actors"]
    survivor, victim = killed["rollouts"]
    assert victim[0] == "died"
    assert trainer[0] == "error" and "SyncError" in trainer[1] and "inference rank 1" in trainer[1], trainer
    assert survivor[0] == "error" and "still at version 30" in survivor[1] and "inference rank 1" in survivor[1], survivor
    assert killed["seconds"] < TIMEOUT_S, killed  # a dead peer is seen at once, not at the timeout
    # The replacement is new, the survivor's last update failed: both are sent every byte, exactly.
    rejoined = driven["processes"]["rejoined"]
    assert not _ok(rejoined["actors"][0])["distload/delta"]
    for answer in rejoined["rollouts"]:
        got = _ok(answer)
        assert got["wrong"] == [] and got["version"] == 50 and not got["delta"], got


def test_a_rollout_worker_refuses_a_version_other_than_the_step_verl_announced(driven):
    sent, *received = driven["processes"]["mismatch"]
    assert _ok(sent)["distload/bytes"] > 0
    for status, error, _ in received:
        assert status == "error" and "received version 60, but verl asked for step 70" in error, error


def test_verls_own_manager_on_ray_moves_every_version_exactly(driven):
    """verl's CheckpointEngineManager, RayWorkerGroup and CheckpointEngineWorker (the rollout
    side's real class, its server adapter a checker): 2 trainer actors (rank 1 walks its generator,
    as a non-master actor worker does) -> 2 rollout replicas."""
    ray = driven["ray"]
    for checked, stats in ray["checked"]:
        assert checked == [{"step": s, "wrong": []} for s in (1, 2, 3)], checked
        assert stats == {"delta": True, "verified": True}
    assert [m["distload/delta"] for m in ray["metrics"].values()] == [False, True, True]  # returned to verl's trainer


def test_on_ray_a_rollout_worker_killed_mid_update_fails_verls_update_and_ends_every_wait(driven):
    """verl's manager raises as soon as the actor is gone; the trainer actor's send and the other
    rollout worker's receive each end with a SyncError naming it, within the timeout, and the
    survivor keeps version 3."""
    killed = driven["ray"]["killed"]
    assert killed["error"] and "ActorDiedError" in killed["error"], killed
    for side in ("trainer", "survivor"):
        failed = killed[side]
        assert failed and failed["error"].startswith("SyncError") and "inference rank 1" in failed["error"], killed
        assert failed["seconds"] < TIMEOUT_S, killed
    assert "still at version 3" in killed["survivor"]["error"]


def test_the_ray_example_syncs_a_plain_ray_job_exactly(driven):
    """examples/ray_weight_sync.py in the same cluster: 1 trainer actor -> 2 inference actors."""
    rows = driven["ray"]["example"]
    assert [row["trainer"]["version"] for row in rows] == [1, 2, 3]
    for row in rows:
        pushed = row["trainer"]
        assert pushed["verified"] and pushed["delta"] == (pushed["version"] > 1)
        for got in row["inference"]:
            assert got["version"] == pushed["version"] and got["digest"] == pushed["digest"], (got, pushed)


def test_distload_imports_verl_only_when_verls_config_names_it(driven):
    """distload, its CLI and its sync channel never import verl; distload.verl (what verl's
    custom_backend_module imports) registers the engine, which every worker above built by name."""
    assert driven["distload_imported_verl"] is False
