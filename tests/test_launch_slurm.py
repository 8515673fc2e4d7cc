"""The launch/slurm/ batch scripts, submitted with sbatch to a real single-node Slurm.

The cluster (munged + slurmctld + slurmd, config in a temporary folder, loopback ports) is started
once for this module and stopped afterwards; see tests/slurm_cluster.py. Every job gets 2 tasks
(or 2 ranks under one torchrun) on this machine, and is checked by its report and by the state and
exit code Slurm records for it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import every_dtype_state, plain_digest, read_report, run_distload, write_sharded, write_whole
from distload.loading.report import state_digest
from slurm_cluster import SlurmCluster, free_port, missing_slurm_tools, require_root_tools

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM_DIR = os.path.join(REPO, "launch", "slurm")
TORCHRUN_SCRIPT = os.path.join(SLURM_DIR, "load_torchrun.sbatch")
SRUN_SCRIPT = os.path.join(SLURM_DIR, "load_srun.sbatch")
RESHARD_SCRIPT = os.path.join(SLURM_DIR, "reshard.sbatch")
JOB_DEADLINE_S = 150  # generous: other test runs share this machine's 2 cores

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def slurm():
    require_root_tools("a real Slurm for the launch/slurm tests", missing_slurm_tools())
    if os.geteuid() != 0:
        require_root_tools("a real Slurm for the launch/slurm tests", "slurmd must run as root")
    cluster = SlurmCluster()
    try:
        cluster.start()
    except RuntimeError as exc:
        cluster.stop()
        pytest.fail(f"could not start a single-node Slurm: {exc}", pytrace=False)
    yield cluster
    cluster.stop()


# Every setting the scripts read: unset unless a test sets it, whatever the developer's shell has.
SCRIPT_SETTINGS = ("CHECKPOINT", "OUTPUT", "LOAD_FORMAT", "EXTRA_CONFIG", "REPORT_JSON", "LOAD_TIMEOUT",
                   "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "TORCHRUN_ARGS", "SRUN_ARGS",
                   "TENSOR_PARALLEL_SIZE", "CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def job_env(**settings: str) -> dict[str, str | None]:
    """What the submitting shell exports: the interpreter with distload, and the script settings."""
    env: dict[str, str | None] = dict.fromkeys(SCRIPT_SETTINGS)
    env.update({"PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})
    env.update(settings)
    return env


def run_job(cluster: SlurmCluster, tmp_path, script_and_args: list[str], options: list[str],
            **settings: str) -> tuple[dict[str, str], str]:
    """Submit, wait, and return Slurm's record of the job and its output."""
    output = str(tmp_path / "job-%j.out")
    job_id = cluster.sbatch(script_and_args, [f"--output={output}", f"--chdir={tmp_path}", *options],
                            env=job_env(**settings))
    info = cluster.wait(job_id, JOB_DEADLINE_S)
    with open(output.replace("%j", str(job_id)), errors="replace") as f:
        text = f.read()
    return info, text


def assert_completed(info: dict[str, str], output: str) -> None:
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), f"{info}\n{output}"


def test_torchrun_script_cooperative_whole_checkpoint(slurm, tmp_path):
    """One torchrun per node (here: 1 node x NPROC_PER_NODE=2), the load command passed through."""
    folder = str(tmp_path / "whole")
    paths = write_whole(folder, every_dtype_state(seed=3))
    report_path = str(tmp_path / "report.json")
    info, output = run_job(
        slurm, tmp_path,
        [TORCHRUN_SCRIPT, folder, "--load-format", "runai_streamer",
         "--model-loader-extra-config", '{"distributed": true}', "--report-json", report_path],
        ["--nodes=1", "--cpus-per-task=2"],
        NPROC_PER_NODE="2",
    )
    assert_completed(info, output)
    assert info["NumNodes"] == "1"
    assert "1 node(s) x 2 rank(s)" in output
    assert f"rendezvous {slurm.node}:{20000 + int(info['JobId']) % 20000}" in output
    report = read_report(report_path)
    assert report["world_size"] == 2
    assert report["load_format"] == "runai_streamer"
    expected = plain_digest(paths)
    ranks = report["ranks"]
    assert [(r["rank"], r["local_rank"]) for r in ranks] == [(0, 0), (1, 1)]
    for r in ranks:
        assert r["path"] == "runai-distributed", output
        assert r["digest"] == expected
        assert r["files"] == paths
        assert r["hostname"] == os.uname().nodename


@pytest.mark.parametrize("gpus_on_node, ranks", [(None, 1), ("2", 2)], ids=["no-gpus", "2-gpus"])
def test_torchrun_script_ranks_per_node_default_to_the_gpus_slurm_gave(slurm, tmp_path, gpus_on_node, ranks):
    """Without NPROC_PER_NODE: one rank per GPU Slurm gave the node (SLURM_GPUS_ON_NODE, which Slurm
    sets for a GPU request; this Slurm has no GPUs, so the test sets it as Slurm would), 1 without."""
    folder = str(tmp_path / "whole")
    paths = write_whole(folder, every_dtype_state(seed=4))
    report_path = str(tmp_path / "report.json")
    settings = {"SLURM_GPUS_ON_NODE": gpus_on_node} if gpus_on_node else {}
    info, output = run_job(slurm, tmp_path, [TORCHRUN_SCRIPT, folder, "--device", "cpu",
                                             "--report-json", report_path], ["--nodes=1"], **settings)
    assert_completed(info, output)
    assert f"1 node(s) x {ranks} rank(s)" in output
    assert ("Slurm gave no GPUs; starting 1 rank per node" in output) == (gpus_on_node is None)
    report = read_report(report_path)
    assert report["world_size"] == ranks
    assert [r["digest"] for r in report["ranks"]] == [plain_digest(paths)] * ranks


def test_srun_script_sharded_checkpoint_from_settings(slurm, tmp_path):
    """srun starts both ranks directly; every setting comes from the environment, no arguments."""
    folder = str(tmp_path / "sharded")
    states = write_sharded(folder, world_size=2)
    report_path = str(tmp_path / "report.json")
    info, output = run_job(
        slurm, tmp_path, [SRUN_SCRIPT], ["--ntasks=2"],
        CHECKPOINT=folder, LOAD_FORMAT="sharded_state", REPORT_JSON=report_path, LOAD_TIMEOUT="120",
    )
    assert_completed(info, output)
    assert info["NumTasks"] == "2"
    assert "2 rank(s) on 1 node(s)" in output
    report = read_report(report_path)
    assert report["world_size"] == 2
    assert report["load_format"] == "sharded_state"
    for rank, r in enumerate(report["ranks"]):
        assert (r["rank"], r["local_rank"], r["path"]) == (rank, rank, "safetensors")
        assert r["files"] == [os.path.join(folder, f"model-rank-{rank}-part-{part}.safetensors")
                              for part in (0, 1)]
        assert r["digest"] == state_digest(states[rank])
    assert report["ranks"][0]["digest"] != report["ranks"][1]["digest"]


@pytest.mark.parametrize("script", [TORCHRUN_SCRIPT, SRUN_SCRIPT], ids=["torchrun", "srun"])
def test_bad_checkpoint_path_fails_the_job(slurm, tmp_path, script):
    missing = str(tmp_path / "no-such-checkpoint")
    info, output = run_job(slurm, tmp_path, [script, missing, "--load-format", "safetensors"],
                           ["--ntasks=2"] if script == SRUN_SCRIPT else ["--nodes=1"],
                           NPROC_PER_NODE="2")
    assert info["JobState"] == "FAILED", f"{info}\n{output}"
    assert info["ExitCode"] != "0:0"
    assert f"{missing}: no such file or directory" in output
    assert "distload: error on rank" in output


def test_srun_script_rank_killed_ends_the_job(slurm, tmp_path):
    """Rank 1 dies by SIGKILL before the rendezvous: rank 0, which would wait for it for the whole
    --timeout, is ended by srun (--kill-on-bad-exit) and the job fails, within the deadline."""
    folder = str(tmp_path / "whole")
    write_whole(folder, every_dtype_state())
    wrapper = tmp_path / "python-kill-rank-1"
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        '[[ $SLURM_PROCID == 1 ]] && { echo "rank 1 kills itself" >&2; kill -9 $$; }\n'
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    output = str(tmp_path / "job-%j.out")
    env = job_env(PYTHON=str(wrapper), LOAD_TIMEOUT="600")
    job_id = slurm.sbatch([SRUN_SCRIPT, folder], [f"--output={output}", "--ntasks=2"], env=env)
    info = slurm.wait(job_id, 90)
    with open(output.replace("%j", str(job_id)), errors="replace") as f:
        text = f.read()
    assert info["JobState"] == "FAILED", f"{info}\n{text}"
    assert info["ExitCode"] != "0:0"
    assert "rank 1 kills itself" in text
    assert "task 1: Killed" in text, text


@pytest.mark.parametrize("script", [TORCHRUN_SCRIPT, SRUN_SCRIPT], ids=["torchrun", "srun"])
def test_a_misspelt_format_fails_the_job_before_any_rank_starts(slurm, tmp_path, script):
    info, output = run_job(slurm, tmp_path, [script, str(tmp_path), "--load-format", "runai-streamr"],
                           ["--ntasks=2"] if script == SRUN_SCRIPT else ["--nodes=1"], NPROC_PER_NODE="2")
    assert info["JobState"] == "FAILED", f"{info}\n{output}"
    assert output.count("distload: error: unknown load format 'runai-streamr'; did you mean 'runai_streamer'?") == 1
    # Checked in the batch step: the script never reached srun (its banner comes just before it).
    assert "rank(s)" not in output and "error on rank" not in output, output


def test_script_without_checkpoint_says_how_to_give_one(slurm, tmp_path):
    info, output = run_job(slurm, tmp_path, [SRUN_SCRIPT], ["--ntasks=1"])
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", f"{info}\n{output}"
    assert "pass SOURCE as the first argument or set CHECKPOINT" in output


def test_srun_rank_whose_peers_never_start_fails_clearly(tmp_path):
    """A task srun started as rank 0 of 2 whose peer never starts waits for it for --timeout, then
    fails with what to do, not a traceback. --timeout 2: the peer never comes, so a longer wait
    would only be waited out.
    Needs no Slurm: the environment is what srun would set."""
    folder = str(tmp_path / "whole")
    write_whole(folder, every_dtype_state())
    port = free_port()
    start = time.monotonic()
    out = run_distload(["load", folder, "--timeout", "2"], timeout=120, env={
        "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert out.returncode == 1, out.stderr
    assert time.monotonic() - start < 90
    assert (f"distload: error on rank 0: rank 0 of 2 (slurm) could not join the process group at "
            f"tcp://127.0.0.1:{port} within 2s") in out.stderr, out.stderr
    assert "start them all with srun" in out.stderr
    assert "Traceback" not in out.stderr


def save_sharded_available() -> bool:
    """``python -m distload save-sharded --help`` succeeds: asked of the command line's main() in
    this process (an interpreter start only to print a help text would cost seconds)."""
    import contextlib
    import io

    import distload.cli.main

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            distload.cli.main.main(["save-sharded", "--help"])
    except SystemExit as exc:  # argparse ends --help with exit 0, an unknown command with 2
        return exc.code == 0
    return False


def test_reshard_script_then_srun_load(slurm, tmp_path):
    """The offline reshard job (one CPU task) writes shards for TENSOR_PARALLEL_SIZE=2 ranks with the
    default decoder plan; the srun job then loads them, each rank its own slice."""
    assert save_sharded_available(), "python -m distload save-sharded is missing"
    generator = torch.Generator().manual_seed(7)
    q_proj = torch.randn(4, 6, generator=generator).to(torch.bfloat16)
    norm = torch.randn(6, generator=generator)
    source = str(tmp_path / "whole")
    write_whole(source, {"model.layers.0.self_attn.q_proj.weight": q_proj, "model.norm.weight": norm},
                num_files=2)
    with open(os.path.join(source, "config.json"), "w") as f:  # 2 heads of 2 rows: the decoder spec needs them
        json.dump({"num_attention_heads": 2, "head_dim": 2, "hidden_size": 6}, f)
    output_dir = str(tmp_path / "tp2")
    info, output = run_job(slurm, tmp_path, [RESHARD_SCRIPT, source, output_dir], [],
                           TENSOR_PARALLEL_SIZE="2")
    assert_completed(info, output)
    assert info["NumTasks"] == "1"
    assert f"{source} -> {output_dir}" in output

    report_path = str(tmp_path / "report.json")
    info, output = run_job(slurm, tmp_path, [SRUN_SCRIPT, output_dir, "--load-format", "sharded_state",
                                             "--report-json", report_path], ["--ntasks=2"])
    assert_completed(info, output)
    report = read_report(report_path)
    assert report["world_size"] == 2
    for rank, r in enumerate(report["ranks"]):
        assert r["files"], r
        assert all(os.path.basename(f).startswith(f"model-rank-{rank}-part-") for f in r["files"]), r
        # q_proj is column-parallel (split along dim 0), the norm replicated.
        expected = {"model.layers.0.self_attn.q_proj.weight": q_proj[2 * rank:2 * rank + 2],
                    "model.norm.weight": norm}
        assert r["digest"] == state_digest(expected), (rank, output)
