"""benchmarks/gpu_check.sh: its CPU smoke mode end to end, its failure exits, and the real GPU run.

The smoke mode (``GPU_CHECK_CPU_SMOKE=1``) runs the script's own steps and command lines with a
tiny checkpoint, ``--device cpu`` and the CPU formats, so everything but the GPU itself is tested
on a machine without one.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu_check.sh")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_check(tmp_path, timeout: float = 240, shm: str | None = None, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the script with its work folders under tmp_path; returns the result and the folders."""
    folders = [shm or str(tmp_path / "shm"), str(tmp_path / "disk")]
    for folder in folders:
        os.makedirs(folder, exist_ok=True)
    full = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("GPU_CHECK_")}
    full.update(GPU_CHECK_SHM_DIR=folders[0], GPU_CHECK_DISK_DIR=folders[1], PYTHON=sys.executable,
                OMP_NUM_THREADS="1", **env)
    result = subprocess.run(["bash", SCRIPT], check=False, capture_output=True, text=True, env=full, timeout=timeout)
    return result, folders


def table_line(stdout: str, location: str, fmt: str) -> str:
    lines = [line for line in stdout.splitlines() if line.split()[:2] == [location, fmt]]
    assert len(lines) == 1, stdout
    return lines[0]


def left_behind(folders: list[str]) -> list[str]:
    return [name for folder in folders for name in os.listdir(folder) if name.startswith("distload-gpu-check.")]


def test_script_parses():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


@pytest.mark.slow
@pytest.mark.dist
def test_cpu_smoke_runs_end_to_end(tmp_path):
    result, folders = run_check(tmp_path, GPU_CHECK_CPU_SMOKE="1")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    for location in ("shm", "disk"):
        for fmt, path in (("safetensors", "safetensors"), ("auto", "pread"), ("runai_streamer", "runai")):
            line = table_line(result.stdout, location, fmt)
            assert line.split()[2:4] == [path, "cpu"], line
            assert line.endswith(" ok"), line
    digests = {line.split()[-2] for line in result.stdout.splitlines()
               if line.endswith(" ok") and line.split()[0] in ("shm", "disk")}
    assert len(digests) == 1, result.stdout
    # The peer (fastsafetensors) is timed beside distload's formats, or said to be missing.
    peer_ok = importlib.util.find_spec("fastsafetensors") is not None
    for location in ("shm", "disk"):
        line = table_line(result.stdout, location, "fastsafetensors")
        assert line.endswith(" ok" if peer_ok else " not installed"), line
    # auto (pread) says how much it found in the page cache: all of it from /dev/shm (tmpfs).
    auto_shm = table_line(result.stdout, "shm", "auto").split()
    assert float(auto_shm[-3]) > 0, auto_shm
    assert "every receiver's digest matches the trainer's" in result.stdout, out  # sync-demo, 2 ranks
    assert "every inference rank holds exactly the slices it was sent: yes" in result.stdout, out  # two jobs
    bound = [line for line in result.stdout.splitlines() if line.startswith("host memory bound:")]
    assert len(bound) == 1 and bound[0].endswith("bound 1024 + 512 MiB: ok"), out
    # Step 6's driver, on the host: a trainer killed mid-update is the receiver's SyncError, and it lives.
    assert "CASE sync-peer rank 0 ok: receiver raised SyncError" in result.stdout, out
    assert "OK: every path loaded onto cpu, every digest agrees, host memory within its bound" in result.stdout
    assert left_behind(folders) == []


@pytest.mark.slow
@pytest.mark.dist
def test_a_failed_path_a_digest_mismatch_or_memory_beyond_the_bound_exits_non_zero(tmp_path):
    # One run, three failures the script must report and go on after: instanttensor cannot load
    # onto the CPU (a failed path); dummy's values are not the checkpoint's (a digest mismatch); a
    # negative allowance makes any peak RSS exceed the host memory bound (its failing branch, for
    # real). safetensors still loads and is reported ok; the script exits 1.
    result, folders = run_check(tmp_path, GPU_CHECK_CPU_SMOKE="1", GPU_CHECK_LOCATIONS="shm",
                                GPU_CHECK_FORMATS="safetensors instanttensor dummy runai_streamer",
                                GPU_CHECK_SYNC_RANKS="0", GPU_CHECK_RSS_OVERHEAD_MIB="-100000")
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert table_line(result.stdout, "shm", "safetensors").endswith(" ok")
    assert table_line(result.stdout, "shm", "instanttensor").endswith("FAILED (exit 1)")
    assert "instanttensor reads only onto CUDA devices" in result.stdout  # the failing load's own error
    assert table_line(result.stdout, "shm", "dummy").endswith("DIGEST MISMATCH")
    assert "weight sync: skipped" in result.stdout and "case sync-kill: skipped" in result.stdout
    line = next(line for line in result.stdout.splitlines() if line.startswith("host memory bound:"))
    assert "runai_streamer with memory_limit 1024 MiB peaked at" in line and line.endswith("EXCEEDED"), out
    assert left_behind(folders) == []


@pytest.mark.slow
def test_the_host_memory_check_is_skipped_without_runai_streamer(tmp_path):
    result, _ = run_check(tmp_path, GPU_CHECK_CPU_SMOKE="1", GPU_CHECK_LOCATIONS="shm",
                          GPU_CHECK_FORMATS="safetensors", GPU_CHECK_SYNC_RANKS="0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "host memory bound: skipped (runai_streamer is not in GPU_CHECK_FORMATS)" in result.stdout


def test_the_plan_needs_no_gpu(tmp_path):
    """GPU_CHECK_PLAN=1: what runs on 1 GPU and on N, without a GPU or any package check."""
    result, _ = run_check(tmp_path, GPU_CHECK_PLAN="1", GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "plan for 1 GPU(s):" in result.stdout and "plan for 8 GPU(s):" in result.stdout
    full = subprocess.run(["bash", SCRIPT, "--gpus", "4"], env={**os.environ, "GPU_CHECK_PLAN": "1"},
                          capture_output=True, text=True, check=False)
    assert full.returncode == 0 and "plan for 4 GPU(s):" in full.stdout, full.stdout + full.stderr
    for path in ("instanttensor-group", "runai-distributed", "pread-shared", "gloo data group", "subgroup",
                 "WeightSleeper", "SIGKILLed mid-update", "NCCL pairs", "vLLM --load-format distload",
                 "sync-demo (NCCL)", "SIGKILLed after its first tensor", "pread onto the device"):
        assert path in full.stdout, path
    bad = subprocess.run(["bash", SCRIPT, "--gpus", "x"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "--gpus takes a GPU count" in bad.stdout


def test_a_missing_package_is_named(tmp_path):
    result, folders = run_check(tmp_path, GPU_CHECK_CPU_SMOKE="1", GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"),
                                GPU_CHECK_REQUIRE="distload_absent_module=distload-absent-package==1.0")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Python package 'distload-absent-package==1.0' (import distload_absent_module) is missing" in result.stdout
    assert "pip download --only-binary=:all:" in result.stdout and "humanize" in result.stdout  # the exact fix
    assert left_behind(folders) == []


@pytest.mark.gpu
@pytest.mark.timeout(660)  # the script may take its 600 s, beyond the suite's 300 s per test
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU check needs CUDA; this machine has no GPU")
def test_gpu_check_on_a_gpu(tmp_path):
    # The real GPU mode (instanttensor, auto, Run:ai and safetensors onto cuda:0; /dev/shm and disk),
    # on a small checkpoint so that the test stays quick; the full run is the script alone.
    before = set(os.listdir("/dev/shm"))
    result, folders = run_check(tmp_path, timeout=600, shm="/dev/shm", GPU_CHECK_SIZE_MIB="512")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    for location in ("shm", "disk"):
        for fmt in ("safetensors", "instanttensor", "auto", "runai_streamer"):
            line = table_line(result.stdout, location, fmt)
            assert " cuda:0 " in line and line.endswith(" ok"), line
    assert "OK: every path loaded onto cuda:0" in result.stdout
    assert set(os.listdir("/dev/shm")) <= before and left_behind(folders[1:]) == []
