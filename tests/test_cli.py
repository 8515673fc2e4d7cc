"""``python -m distload`` as a user runs it: alone, under torchrun, and the demo."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import every_dtype_state, plain_digest, read_report, run_distload, write_whole
from dist_helpers import FAILURE_ENV, RankResult, clean_env, launch_ranks, rank_error

import distload

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("cli") / "whole")
    paths = write_whole(folder, every_dtype_state(seed=11), num_files=3)
    return folder, paths


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_single_process_load(ckpt, tmp_path, kind):
    folder, paths = ckpt
    source = paths[1] if kind == "file" else folder
    files = [paths[1]] if kind == "file" else paths
    report_path = str(tmp_path / "r.json")
    result = run_distload(["load", source, "--report-json", report_path, "--no-progress"], timeout=120)
    assert result.returncode == 0, result.stderr[-6000:]
    assert re.search(r"Loading weights took \d+\.\d\d seconds", result.stderr)
    assert f"distload: auto from {source} on 1 rank(s)" in result.stdout
    report = read_report(report_path)
    assert report["world_size"] == 1
    assert report["source"] == source
    [rank] = report["ranks"]
    assert rank["rank"] == 0 and rank["device"] == "cpu"
    assert rank["files"] == files
    assert rank["digest"] == plain_digest(files)


def test_no_digest(ckpt, tmp_path):
    folder, paths = ckpt
    report_path = str(tmp_path / "r.json")
    result = run_distload(["load", folder, "--load-format", "safetensors", "--no-digest",
                           "--report-json", report_path, "--no-progress"], timeout=120)
    assert result.returncode == 0, result.stderr[-6000:]
    [rank] = read_report(report_path)["ranks"]
    assert rank["digest"] is None
    assert rank["num_tensors"] == len(every_dtype_state())  # it did load
    assert "digest -" in result.stdout


# Installed through PYTHONPATH into every process torchrun starts: records, per rank, each file
# opened for writing and each rename into the report's folder (Python audit events).
AUDIT_SITECUSTOMIZE = '''
import os, sys
_dir = os.environ.get("DISTLOAD_TEST_AUDIT_DIR")
_watch = os.environ.get("DISTLOAD_TEST_WATCH_DIR")
if _dir and _watch and "RANK" in os.environ:
    _fd = os.open(os.path.join(_dir, "audit-rank%s.log" % os.environ["RANK"]),
                  os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def _hook(event, args):
        if event == "open" and isinstance(args[0], str) and args[0].startswith(_watch):
            flags = args[2] if isinstance(args[2], int) else 0
            mode = args[1] or ""
            if flags & (os.O_WRONLY | os.O_RDWR) or any(c in mode for c in "wax+"):
                os.write(_fd, ("open %s\\n" % args[0]).encode())
        elif event == "os.rename" and str(args[1]).startswith(_watch):
            os.write(_fd, ("rename %s -> %s\\n" % (args[0], args[1])).encode())

    sys.addaudithook(_hook)
'''


@pytest.mark.slow
def test_report_json_written_once_by_rank_0(ckpt, tmp_path):
    folder, paths = ckpt
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(AUDIT_SITECUSTOMIZE))
    audit = tmp_path / "audit"
    audit.mkdir()
    report_dir = tmp_path / "reports" / "new"  # does not exist yet
    report_path = str(report_dir / "r.json")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
           "DISTLOAD_TEST_AUDIT_DIR": str(audit), "DISTLOAD_TEST_WATCH_DIR": str(tmp_path / "reports")}
    result = run_distload(["load", folder, "--load-format", "runai_streamer", "--report-json", report_path,
                           "--no-progress"], nproc=2, env=env)
    assert result.returncode == 0, result.stderr[-6000:]
    logs = {rank: (audit / f"audit-rank{rank}.log").read_text() for rank in (0, 1)}
    renames = [line for line in logs[0].splitlines() if line.startswith("rename ")]
    assert len(renames) == 1 and renames[0].endswith(f"-> {report_path}"), logs[0]
    assert logs[1] == "", f"rank 1 wrote into the report folder: {logs[1]}"
    assert os.listdir(report_dir) == ["r.json"]  # no temporary file left behind
    report = read_report(report_path)
    assert report["world_size"] == 2 and [r["rank"] for r in report["ranks"]] == [0, 1]
    assert all(r["digest"] == plain_digest(paths) for r in report["ranks"])
    assert result.stderr.count("report written to") == 1
    assert result.stdout.count("distload: runai_streamer from") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("nproc", [1, 2])
def test_device_cuda_without_cuda_fails_clearly(ckpt, nproc):
    """Alone, and as 2 ranks with torchrun's environment (started directly: the ranks fail before
    any process group, so torchrun's agent could stop one before it speaks)."""
    folder, _ = ckpt
    args = ["load", folder, "--device", "cuda", "--no-progress"]
    if nproc == 1:
        result = run_distload(args, timeout=120)
        results = [RankResult(0, result.returncode, result.stdout, result.stderr)]
    else:
        results = launch_ranks(args, nproc=nproc, timeout=120)
    for r in results:
        output = r.stdout + r.stderr
        assert r.returncode == 1, output[-6000:]
        assert "Traceback" not in output
        if r.rank > 0:  # every rank of the node sees the same devices: rank 0 speaks for them
            assert "distload: error" not in output, output
            continue
        message = rank_error(output, r.rank)
        assert "--device cuda was asked for, but no CUDA device is visible" in message
        assert "use --device cpu or auto" in message
        if nproc == 2:
            assert "distload: error on ranks 0, 1 (every rank): " in output


@pytest.mark.slow
def test_demo(tmp_path):
    """The README's first command: every format loads bit-identical, nothing is timed (too small a
    checkpoint), and the folder every printed command loads is kept, named at the end with how to
    remove it (no --dir: a new folder under the temporary directory)."""
    result = run_distload(["demo", "--size-mib", "4"], timeout=300, env={"TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    rows = {}
    for line in result.stdout.splitlines():
        match = re.match(r"(\S+(?: distributed)?)\s+(whole|sharded)\s+(\S+)\s+(.+)$", line)
        if match:
            rows[(match[1], match[2])] = (match[3], match[4].strip())
    assert "vs plain" not in result.stdout and "benchmarks/results/load.md" in result.stdout
    assert "(--dir DIR writes it there instead)" in result.stdout
    # Every format's equivalent command is shown, with the summary distload load prints.
    assert "$ torchrun --nproc-per-node 2 -m distload load " in result.stdout
    assert result.stdout.count("distload: auto from ") == 3
    real = [("safetensors", "whole"), ("runai_streamer", "whole"), ("runai_streamer distributed", "whole"),
            ("sharded_state", "sharded"), ("runai_streamer_sharded", "sharded"), ("auto", "whole"),
            ("auto distributed", "whole"), ("auto", "sharded")]
    for key in real:
        assert key in rows, f"{key} missing from the demo table:\n{result.stdout[-4000:]}"
        assert rows[key][1] == "bit-identical", (key, rows[key])
    assert rows[("runai_streamer distributed", "whole")][0] == "runai-distributed"
    assert rows[("auto distributed", "whole")][0] == "pread-shared"
    assert rows[("dummy", "whole")][1] == "dummy (random)"
    assert "every real read matched a plain safetensors read bit for bit" in result.stdout
    root = re.search(r"remove them with: rm -rf (\S+)\n", result.stdout)[1]
    assert os.path.dirname(root) == str(tmp_path)
    for folder in re.findall(r"-m distload load (\S+) ", result.stdout):  # every command loads a kept folder
        assert folder.startswith(root + os.sep) and os.listdir(folder), folder
    assert sorted(os.listdir(root)) == ["demo-cases.json", "demo-results.json", "sharded", "whole"]


def test_version():
    result = subprocess.run([sys.executable, "-m", "distload", "--version"], capture_output=True, text=True,
                            timeout=60, env=clean_env())
    assert result.returncode == 0 and result.stdout == f"distload {distload.__version__}\n"


def test_log_level_from_the_flag_and_the_environment(ckpt):
    """At the default level rank 0 logs "Loading weights took" (test_single_process_load); the
    environment's level, and the flag over it, are unit-tested in test_user_messages."""
    folder, _ = ckpt
    args = ["load", folder, "--no-progress", "--no-digest"]
    quiet = run_distload(args + ["--log-level", "warning"], timeout=120, env={"DISTLOAD_LOG_LEVEL": "debug"})
    assert quiet.returncode == 0, quiet.stderr[-4000:]
    assert "distload: auto from" in quiet.stdout  # the summary is output, not a log line
    assert "Loading weights took" not in quiet.stderr  # the flag wins over the environment
    bad = run_distload(args, timeout=120, env={"DISTLOAD_LOG_LEVEL": "loud"})
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "DISTLOAD_LOG_LEVEL='loud' is not a log level; use one of debug, info, warning, error" in bad.stderr


def test_a_closed_pipe_ends_quietly(ckpt):
    """`distload inspect ... | head`: the reader is gone before distload writes."""
    folder, _ = ckpt
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE, as once head has exited
    try:
        result = subprocess.run([sys.executable, "-m", "distload", "inspect", folder], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, timeout=60, env=clean_env())
    finally:
        os.close(write_end)
    assert result.returncode == 141, result.stderr[-4000:]
    assert result.stderr == ""


def test_a_misspelt_format_stops_before_torchrun_starts_ranks(ckpt):
    folder, _ = ckpt
    result = subprocess.run(["bash", os.path.join(REPO, "launch", "torchrun_local.sh"), "2", "load", folder,
                             "--load-format", "runai-streamr"], capture_output=True, text=True, timeout=60,
                            env=clean_env({"PYTHON": sys.executable}))
    assert result.returncode == 1
    assert result.stderr.startswith("distload: error: unknown load format 'runai-streamr'; did you mean "
                                    "'runai_streamer'?"), result.stderr[-4000:]
    assert result.stderr.count("distload: error") == 1  # one message, no rank started
    assert "torch.distributed" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_torchrun_summary_shows_distloads_message_once(tmp_path):
    """Every rank fails the same way: rank 0 prints it once for both, and torchrun's failure
    summary gives it as the root cause (torch's error file), not "To enable traceback see ..."."""
    missing = str(tmp_path / "no-such-checkpoint")
    result = run_distload(["load", missing, "--no-progress"], nproc=2, env=FAILURE_ENV, timeout=120, torchrun=True)
    assert result.returncode == 1
    printed = [line for line in result.stderr.splitlines() if line.startswith("distload: error")]
    assert len(printed) == 1, result.stderr[-6000:]
    assert printed[0].startswith("distload: error on ranks 0, 1 (every rank): ") and missing in printed[0]
    root_cause = result.stderr[result.stderr.index("Root Cause"):]
    assert "distload: error on ranks 0, 1 (every rank): " in root_cause and missing in root_cause
    assert "To enable traceback" not in result.stderr


# -- a failure every rank shares: one line, by rank 0 -----------------------------------------------

# (arguments, environment, what the line says); "{whole}" is the module's whole checkpoint. Each
# of these printed one line per rank before (no agreement step told the ranks they all failed alike).
SHARED_REFUSALS = [
    pytest.param(["load", "{whole}", "--tensor-parallel-size", "3"], {},
                 "--tensor-parallel-size 3 does not divide the group's 2 ranks", id="tp-size-not-dividing"),
    pytest.param(["load", "{whole}", "--load-format", "sharded_state"], {},
                 "Could not find checkpoint files '{whole}/model-rank-*-part-*.safetensors' for any rank",
                 id="sharded-state-on-a-whole-checkpoint"),
    pytest.param(["load", "{whole}", "--device", "tpu"], {}, "--device must be auto, cpu, cuda or cuda:N, got 'tpu'",
                 id="device-misspelt", marks=pytest.mark.slow),
    pytest.param(["load", "{whole}", "--device", "cuda"], {}, "--device cuda was asked for, but no CUDA device",
                 id="device-cuda-without-cuda", marks=[pytest.mark.slow, pytest.mark.skipif(
                     torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")]),
    pytest.param(["pull", "{whole}-missing", "{whole}-copy"], {}, "{whole}-missing: no such file or directory",
                 id="pull-from-nothing", marks=pytest.mark.slow),
    pytest.param(["load", "{whole}"], {"DISTLOAD_LOG_LEVEL": "loud"}, "DISTLOAD_LOG_LEVEL='loud' is not a log level",
                 id="log-level-environment", marks=pytest.mark.slow),
    pytest.param(["sync-demo", "--role", "trainer"], {}, "sync-demo --role trainer needs --rendezvous tcp://HOST:PORT",
                 id="sync-demo-role-without-rendezvous", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("args, env, says", SHARED_REFUSALS)
def test_a_refusal_every_rank_shares_is_one_line_from_rank_0(ckpt, args, env, says):
    """2 ranks of ``-m distload ...`` (started as srun starts them; torchrun's agent adds only its
    summary, test_torchrun_summary_shows_distloads_message_once): a refusal that every rank meets alike is one
    line for the job (``distload: error on ranks 0, 1 (every rank): ...``), printed by rank 0; the
    ranks exit 1, without a traceback of their own."""
    folder, _ = ckpt
    args = [a.replace("{whole}", folder) for a in args]
    args += ["--no-progress"] if args[0] == "load" else []
    result = run_distload(args, nproc=2, env={**FAILURE_ENV, **env}, timeout=120)
    assert result.returncode == 1, result.stderr[-6000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("distload: error")]
    assert len(lines) == 1, result.stderr[-6000:]
    assert lines[0].startswith("distload: error on ranks 0, 1 (every rank): "), lines[0]
    assert says.replace("{whole}", folder) in lines[0], lines[0]
    assert "Traceback (most recent call last)" not in result.stderr  # (torchrun would add its ChildFailedError's)
