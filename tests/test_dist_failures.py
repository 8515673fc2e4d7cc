"""Failures under torchrun (2 ranks on gloo): every rank stops with a clear error that names the
file or the failing rank, exits 1 on its own (no abort, no hang), and no rank ever returns data
it should not have."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

from conftest import every_dtype_state, in_ci, plain_digest, read_report, run_distload, write_sharded, write_whole
from dist_helpers import (
    ABORT_MARKERS,
    FAILURE_ENV,
    assert_failed_cleanly,
    assert_ranks_exited_1,
    clean_env,
    free_port,
    launch_ranks,
    rank_error,
    run_script,
    write_script,
)

pytestmark = pytest.mark.dist

# A deadline against hangs, not a speed test: a failure must end the job long before any
# collective timeout (300 s by default) could have ended it.
HANG_DEADLINE_S = 60


def corrupt_header(path: str) -> None:
    """Keep the length field, replace the JSON header with bytes that are not JSON."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.write(b"\xff" * n)


def truncate(path: str, nbytes: int = 100) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - nbytes)


def append_garbage(path: str, nbytes: int = 16) -> None:
    with open(path, "ab") as f:
        f.write(b"\0" * nbytes)


def load_args(source: str, load_format: str | None = None, extra: str | None = None) -> list[str]:
    args = ["load", source, "--no-progress"]
    if load_format:
        args += ["--load-format", load_format]
    if extra is not None:
        args += ["--model-loader-extra-config", extra]
    return args


# --------------------------------------------------------------------------------------------
# (a) cooperative reads with different file lists on different ranks


MISMATCH_SCRIPT = r'''
import json, os, sys
import distload
from safetensors.torch import load_file

root, out = sys.argv[1], sys.argv[2]
outcomes = {}


def attempt(label, source, extra):
    try:
        state = distload.load(source, "runai_streamer", extra, group=g)
    except distload.GroupError as exc:
        outcomes[label] = ["GroupError", type(exc).__name__, str(exc)]
    except Exception as exc:
        outcomes[label] = ["other", type(exc).__name__, str(exc)]
    else:
        outcomes[label] = ["RETURNED", sorted(state), None]


with distload.WorkerGroup(timeout_s=120) as g:
    mine = os.path.join(root, f"src{g.rank}")
    # same tensor names and shapes on both ranks, other values: a silent swap would go unnoticed
    attempt("different folders", mine, {"distributed": True})
    # rank 1 reads one file of rank 0's folder
    src0 = os.path.join(root, "src0")
    one_file = sorted(os.path.join(src0, n) for n in os.listdir(src0))[0]
    attempt("fewer files", src0 if g.rank == 0 else one_file, {"distributed": True})
    # rank 1 asks for a non-cooperative read of the same files
    attempt("different readers", src0, {"distributed": g.rank == 0})
    # the group is still usable: the same load on both ranks works and returns rank 0's values
    state = distload.load(src0, "runai_streamer", {"distributed": True}, group=g)
    want = {}
    for name in sorted(os.listdir(src0)):
        want.update(load_file(os.path.join(src0, name)))
    ok = distload.state_digest(state) == distload.state_digest(want)
    outcomes["same list afterwards"] = ["ok" if ok else "WRONG DATA", None, None]
    rank = g.rank

with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(outcomes, f)
'''


@pytest.mark.slow
def test_cooperative_read_refuses_different_file_lists(tmp_path):
    write_whole(str(tmp_path / "src0"), every_dtype_state(seed=1))
    write_whole(str(tmp_path / "src1"), every_dtype_state(seed=2))
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "mismatch.py", MISMATCH_SCRIPT)
    start = time.monotonic()
    result = run_script(script, [str(tmp_path), str(out)], nproc=2)
    assert time.monotonic() - start < HANG_DEADLINE_S
    assert result.returncode == 0, result.stdout + result.stderr[-6000:]
    for rank in range(2):
        outcomes = json.loads((out / f"rank{rank}.json").read_text())
        for label in ("different folders", "fewer files"):
            kind, exc_type, message = outcomes[label]
            assert kind == "GroupError", f"rank {rank} {label}: {outcomes[label]}"  # never RETURNED
            assert exc_type == "GroupError"
            assert "shared read refused" in message and "identical file list" in message
            assert "rank 1" in message
            assert "distributed=false" in message  # the way out
        assert "has [" in outcomes["different folders"][2] and str(tmp_path / "src1") in outcomes["different folders"][2]
        assert "rank 1 lacks [" in outcomes["fewer files"][2]
        kind, _, message = outcomes["different readers"]
        assert kind == "GroupError", outcomes["different readers"]
        assert "ranks chose different readers" in message and "rank 1" in message
        assert outcomes["same list afterwards"][0] == "ok"


SAME_PATH_SCRIPT = r'''
import json, os, sys
import distload

source, out = sys.argv[1], sys.argv[2]
try:
    with distload.WorkerGroup(timeout_s=60) as g:
        rank = g.rank
        state = distload.load(source, "runai_streamer", {"distributed": True}, group=g)
        outcome = ["returned", distload.state_digest(state)]
except distload.DistloadError as exc:
    rank = int(os.environ["RANK"])
    outcome = ["raised", f"{type(exc).__name__}: {exc}"]
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(outcome, f)
'''

def _private_mounts_work() -> bool:
    try:
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               "mount --bind / /mnt"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
@pytest.mark.parametrize("change", ["other version", "1 MiB corrupted at 25%"])
def test_cooperative_read_same_path_other_content(tmp_path, change):
    """Rank 1 sees another version of the checkpoint at the same path, as a second node with a
    stale copy would (a private mount namespace stands in for the other node); or a copy that
    differs in one 1 MiB run at a quarter of the file (issue 13, item 8: it passed the three
    start/middle/end samples the fingerprint had)."""
    if not _private_mounts_work():
        message = "needs unshare --mount and bind mounts (root)"
        if in_ci():  # CI runs as root: there this is a broken setup, not a missing feature
            pytest.fail(message)
        pytest.skip(message)
    here, other = str(tmp_path / "ckpt"), str(tmp_path / "other-version")
    if change == "other version":
        write_whole(here, every_dtype_state(seed=1))
        write_whole(other, every_dtype_state(seed=2))  # same names, shapes and file sizes
    else:
        g = torch.Generator().manual_seed(5)
        os.makedirs(here)
        save_file({f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(4)},  # 16 MiB, one file
                  os.path.join(here, "model.safetensors"))
        shutil.copytree(here, other)
        victim = os.path.join(other, "model.safetensors")
        with open(victim, "r+b") as f:
            f.seek(os.path.getsize(victim) // 4 + 12345)  # not on a sample's boundary
            f.write(os.urandom(1 << 20))
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "same_path.py", SAME_PATH_SCRIPT)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2"}
    procs = []
    for rank in range(2):
        cmd = [sys.executable, script, here, str(out)]
        if rank == 1:
            cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                   f'mount --bind "{other}" "{here}" && exec "$@"', "sh", *cmd]
        procs.append(subprocess.Popen(cmd, env=clean_env({**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outputs = [p.communicate(timeout=HANG_DEADLINE_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    own = {0: plain_digest(sorted(os.path.join(here, n) for n in os.listdir(here))),
           1: plain_digest(sorted(os.path.join(other, n) for n in os.listdir(other)))}
    for rank in (0, 1):
        path = out / f"rank{rank}.json"
        assert path.exists(), outputs[rank][1][-4000:]
        kind, detail = json.loads(path.read_text())
        # refusing is right; returning is right only with exactly this rank's own version
        assert kind == "raised" or detail == own[rank], f"rank {rank} returned a mix of both versions"
        if change != "other version":  # the sampled fingerprints see the corrupted run
            assert kind == "raised" and "differ" in detail, detail


# --------------------------------------------------------------------------------------------
# (b) pre-sharded checkpoints that do not fit the job


@pytest.mark.slow
@pytest.mark.parametrize("load_format", ["sharded_state", "runai_streamer_sharded"])
def test_sharded_missing_rank_fails_on_every_rank(tmp_path, load_format):
    folder = str(tmp_path / "sh")
    write_sharded(folder, world_size=1)
    start = time.monotonic()
    result = run_distload(load_args(folder, load_format), nproc=2, env=FAILURE_ENV)
    assert time.monotonic() - start < HANG_DEADLINE_S
    messages = assert_failed_cleanly(result)
    for rank in (0, 1):
        assert "Could not find checkpoint files" in messages[rank]
        assert "Files exist for ranks 0" in messages[rank]
        assert "saved for 1 ranks, this job has 2" in messages[rank]
        assert f"{folder}/model-rank-1-part-*.safetensors" in messages[rank]
    assert messages[0].startswith("planning the load failed on rank(s) 1:")
    assert "rank 1: Could not find checkpoint files" in messages[0]


CUSTOM_PATTERN = "weights-r{rank}-p{part}.safetensors"


@pytest.fixture(scope="module")
def custom_pattern_ckpt(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("pattern") / "sh")
    write_sharded(folder, world_size=2, pattern=CUSTOM_PATTERN)
    return folder


@pytest.mark.slow
def test_sharded_wrong_pattern_is_named(custom_pattern_ckpt):
    folder = custom_pattern_ckpt
    result = run_distload(load_args(folder, "sharded_state"), nproc=2, env=FAILURE_ENV, torchrun=True)
    messages = assert_failed_cleanly(result)
    assert messages[0] == messages[1]  # every rank fails alike: one line for the job
    assert result.stderr.count("Could not find checkpoint files") == 1 + 2  # the line, torchrun's summary
    for rank in (0, 1):  # the message names the pattern and what is there
        assert messages[rank].startswith("Could not find checkpoint files")
        assert "matches the pattern 'model-rank-{rank}-part-{part}.safetensors'" in messages[rank]
        assert "weights-r0-p0.safetensors" in messages[rank]
        assert "extra config 'pattern'" in messages[rank]


@pytest.mark.slow
def test_sharded_custom_pattern_loads_with_pattern(custom_pattern_ckpt, tmp_path):
    folder = custom_pattern_ckpt
    report_path = str(tmp_path / "r.json")
    extra = json.dumps({"pattern": CUSTOM_PATTERN})
    result = run_distload(load_args(folder, "runai_streamer_sharded", extra) + ["--report-json", report_path],
                          nproc=2)
    assert result.returncode == 0, result.stderr[-6000:]
    report = read_report(report_path)
    for r in report["ranks"]:
        files = [os.path.join(folder, CUSTOM_PATTERN.format(rank=r["rank"], part=p)) for p in range(2)]
        assert r["files"] == files
        assert r["digest"] == plain_digest(files)


@pytest.mark.slow
def test_checkpoint_for_two_ranks_refused_by_one(tmp_path):
    folder = str(tmp_path / "sh")
    write_sharded(folder, world_size=2)
    result = run_distload(load_args(folder, "sharded_state"), nproc=1, env=FAILURE_ENV)
    messages = assert_failed_cleanly(result, nproc=1)
    assert "saved for 2 ranks, this job has 1" in messages[0]
    assert "would never be loaded" in messages[0]
    assert folder in messages[0]


# --------------------------------------------------------------------------------------------
# (c) bad input: a clear error on every rank, naming the file (or the setting)


def _missing(tmp_path):
    path = str(tmp_path / "no-such-checkpoint")
    return load_args(path), ["no such file or directory"], path


def _no_safetensors(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return load_args(str(folder), "safetensors"), ["no .safetensors files in this folder", "config.json"], str(folder)


def _not_safetensors(tmp_path):
    folder = tmp_path / "pickle"
    folder.mkdir()
    path = str(folder / "model.safetensors")
    torch.save({"w": torch.ones(4, 4)}, path)  # a PyTorch zip saved under a .safetensors name
    return load_args(str(folder), "runai_streamer"), ["not a safetensors file"], path


def _corrupt_header(tmp_path):
    paths = write_whole(str(tmp_path / "ck"), every_dtype_state())
    corrupt_header(paths[1])
    return load_args(str(tmp_path / "ck"), "safetensors"), ["corrupt header"], paths[1]


def _truncated(tmp_path):
    paths = write_whole(str(tmp_path / "ck"), every_dtype_state())
    truncate(paths[2])
    extra = '{"distributed": true}'
    return (load_args(str(tmp_path / "ck"), "runai_streamer", extra),
            ["file is shorter than its header says", "truncated"], paths[2])


def _duplicate_name(tmp_path):
    folder = tmp_path / "dup"
    folder.mkdir()
    a, b = str(folder / "a.safetensors"), str(folder / "b.safetensors")
    save_file({"w": torch.ones(2), "x": torch.zeros(3)}, a)
    save_file({"w": torch.ones(2) * 2}, b)
    return load_args(str(folder), "auto"), ["tensor 'w' appears in two files", a], b


def _trailing_bytes(load_format):
    def make(tmp_path):
        paths = write_whole(str(tmp_path / "ck"), every_dtype_state())
        append_garbage(paths[0])
        return load_args(str(tmp_path / "ck"), load_format), ["bytes after the last tensor belong to no tensor"], paths[0]
    return make


def _config(load_format, extra, *expected):
    def make(tmp_path):
        paths = write_whole(str(tmp_path / "ck"), every_dtype_state(), num_files=1)
        return load_args(os.path.dirname(paths[0]), load_format, extra), list(expected), None
    return make


BAD_INPUTS = {
    "missing-path": _missing,
    "folder-without-safetensors": _no_safetensors,
    "not-safetensors": _not_safetensors,
    "corrupt-header": _corrupt_header,
    "truncated": _truncated,
    "same-name-in-two-files": _duplicate_name,
    "trailing-bytes-runai": _trailing_bytes("runai_streamer"),
    "trailing-bytes-safetensors": _trailing_bytes("safetensors"),
    "unknown-load-format": _config("tensorizer", None, "unknown load format 'tensorizer'", "runai_streamer"),
    "unknown-key": _config("runai_streamer", '{"chunk_size": 8}',
                           "Unexpected extra config keys ['chunk_size']", "allowed keys: concurrency, distributed, memory_limit"),
    "distributed-yes": _config("runai_streamer", '{"distributed": "yes"}', "'distributed' must be true", "'yes'"),
    "concurrency-true": _config("runai_streamer", '{"concurrency": true}', "'concurrency' must be a positive int", "True"),
    "concurrency-0": _config("runai_streamer", '{"concurrency": 0}', "'concurrency' must be a positive int", "got 0"),
    "memory-limit-minus-2": _config("runai_streamer", '{"memory_limit": -2}', "'memory_limit' must be an int >= -1", "got -2"),
    "invalid-json": _config("runai_streamer", '{distributed: true}', "not valid JSON", "{distributed: true}"),
    "distributed-on-sharded": _config("runai_streamer_sharded", '{"distributed": true}',
                                      "Unexpected extra config keys ['distributed']", "silently exchange data"),
}

CONFIG_CASES = {"unknown-load-format", "unknown-key", "distributed-yes", "concurrency-true", "concurrency-0",
                "memory-limit-minus-2", "invalid-json", "distributed-on-sharded"}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_fails_clearly_on_every_rank(tmp_path, case):
    args, expected, named_file = BAD_INPUTS[case](tmp_path)
    start = time.monotonic()
    if case in CONFIG_CASES:
        # Rejected before any process group exists, so the ranks do not wait for each other and
        # torchrun's agent would stop a rank still starting up once its peer has exited: start
        # the ranks directly (torchrun's environment, no agent) to see every rank's own answer.
        # Every rank rejects the command line itself; rank 0 alone says so, for all of them.
        results = launch_ranks(args, nproc=2, timeout=HANG_DEADLINE_S)
        messages = {}
        for r in results:
            output = r.stdout + r.stderr
            assert r.returncode == 1, f"rank {r.rank}: rc {r.returncode}\n{output[-4000:]}"
            assert "Traceback" not in output, output[-4000:]
            if r.rank == 0:
                messages[0] = rank_error(output, 0)
                assert "distload: error on ranks 0, 1 (every rank): " in output
                assert "failed on rank(s)" not in messages[0]  # no agreement step: each rank rejects it
            else:
                assert r.stderr == "", r.stderr[-4000:]
    else:
        result = run_distload(args, nproc=2, env=FAILURE_ENV)
        messages = assert_failed_cleanly(result)
    assert time.monotonic() - start < HANG_DEADLINE_S
    for rank, message in messages.items():
        for text in expected:
            assert text in message, f"rank {rank}: {text!r} not in {message!r}"
        if named_file:
            assert named_file in message, f"rank {rank}: {named_file} not named in {message!r}"


# --------------------------------------------------------------------------------------------
# (d) a failure on rank 1 alone ends both ranks at once, and rank 0 names rank 1


@pytest.mark.slow
def test_corrupt_shard_of_rank_1_only(tmp_path):
    folder = str(tmp_path / "sh")
    write_sharded(folder, world_size=2)
    bad = os.path.join(folder, "model-rank-1-part-1.safetensors")
    corrupt_header(bad)
    start = time.monotonic()
    result = run_distload(load_args(folder, "sharded_state"), nproc=2, env=FAILURE_ENV)
    assert time.monotonic() - start < HANG_DEADLINE_S
    messages = assert_failed_cleanly(result)
    assert messages[1].startswith(f"{bad}: corrupt header")
    assert messages[0].startswith("planning the load failed on rank(s) 1:")
    assert f"rank 1: {bad}: corrupt header" in messages[0]


INJECTED_READ_ERROR = r'''
import os, sys
import distload.loading.backends as backends
from distload.errors import CheckpointError

if os.environ["RANK"] == "1":  # an I/O error on rank 1 after two tensors, as a failing disk gives
    class Failing(type(backends.BACKENDS["runai"])):
        def read(self, request):
            run = super().read(request)

            def tensors():
                for i, item in enumerate(run.tensors()):
                    if i == 2:
                        raise CheckpointError(f"{request.index.files[0].path}: [Errno 5] Input/output error")
                    yield item

            return backends.BackendRun(run.path).start(tensors())

    backends.BACKENDS["runai"] = Failing()

from distload.cli.main import main
sys.exit(main(sys.argv[1:]))
'''


@pytest.mark.slow
def test_read_error_of_rank_1_only_while_loading(tmp_path):
    """The headers pass on both ranks; rank 1's reader fails mid-load (after the planning step)."""
    folder = str(tmp_path / "sh")
    write_sharded(folder, world_size=2)
    bad = os.path.join(folder, "model-rank-1-part-0.safetensors")
    script = write_script(tmp_path, "inject.py", INJECTED_READ_ERROR)
    start = time.monotonic()
    result = run_script(script, load_args(folder, "runai_streamer_sharded"), nproc=2, env=FAILURE_ENV)
    assert time.monotonic() - start < HANG_DEADLINE_S
    messages = assert_failed_cleanly(result)
    assert f"{bad}: [Errno 5] Input/output error" in messages[1]
    assert messages[0].startswith("loading failed on rank(s) 1:")
    assert bad in messages[0]


AGREE_SCRIPT = r'''
import sys
import distload

with distload.WorkerGroup(timeout_s=240) as g:
    def step():
        if g.rank == 1:
            raise ValueError("rank 1 cannot go on")
        return "fine"
    g.agree("the custom step", step)
    print(f"rank {g.rank} got past the step", flush=True)
'''


def test_rank_1_raising_inside_agree_ends_both(tmp_path):
    script = write_script(tmp_path, "agree.py", AGREE_SCRIPT)
    start = time.monotonic()
    result = run_script(script, [], nproc=2, env=FAILURE_ENV)
    assert time.monotonic() - start < HANG_DEADLINE_S
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-6000:]
    assert "got past the step" not in output
    assert "ValueError: rank 1 cannot go on" in output  # rank 1's own error
    assert "RankFailedError: the custom step failed on rank(s) 1:" in output  # rank 0 names rank 1
    assert "rank 1: ValueError: rank 1 cannot go on" in output
    for marker in ABORT_MARKERS:
        assert marker not in output
    assert_ranks_exited_1(result)


STOP_SCRIPT = r'''
import json, os, sys
import distload

src, out, fmt, extra, timeout = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), float(sys.argv[5])
outcome = None
with distload.WorkerGroup(timeout_s=timeout) as g:
    stream = distload.iter_tensors(src, fmt, extra, group=g)
    try:
        for i, (name, tensor) in enumerate(stream):
            if g.rank == 1:
                break  # rank 1's own code stops after one tensor
        stream.close()
        outcome = ["finished", None, None]
    except Exception as exc:
        outcome = ["raised", type(exc).__name__, str(exc)]
    rank = g.rank
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(outcome, f)
'''

@pytest.fixture(scope="module")
def large_whole(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("large") / "whole")
    generator = torch.Generator().manual_seed(5)
    state = {f"layer{i}.weight": torch.randn(512, 1024, generator=generator) for i in range(8)}
    write_whole(folder, state, num_files=4)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("fmt,extra,group_timeout", [
    ("safetensors", "{}", "120"),
    # a short group timeout: the peer of the rank that stopped must not wait for it
    ("runai_streamer", '{"distributed": true}', "8"),
], ids=["safetensors", "runai-distributed"])
def test_rank_1_stops_consuming_iter_tensors(large_whole, tmp_path, fmt, extra, group_timeout):
    script = write_script(tmp_path, "stop.py", STOP_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    start = time.monotonic()
    result = run_script(script, [large_whole, str(out), fmt, extra, group_timeout], nproc=2, env=FAILURE_ENV)
    assert time.monotonic() - start < HANG_DEADLINE_S
    outcomes = {}
    for rank in (0, 1):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} died:\n{result.stderr[-6000:]}"
        outcomes[rank] = json.loads(path.read_text())
    # rank 1 stopped on purpose: closing its stream tells the others, it does not raise there
    assert outcomes[1][0] == "finished", outcomes[1]
    # rank 0 must not believe its load went fine, and must say that rank 1 stopped
    assert outcomes[0][:2] == ["raised", "RankFailedError"], outcomes[0]
    assert "loading failed on rank(s) 1" in outcomes[0][2]
    assert "rank 1 stopped consuming tensors" in outcomes[0][2]


# --------------------------------------------------------------------------------------------
# (e) nothing half-applied: a rejected config writes no environment; a load restores it


ENV_SCRIPT = r'''
import json, os, sys
import distload

src, bad, out = sys.argv[1], sys.argv[2], sys.argv[3]
checks = {}
KEYS = ("RUNAI_STREAMER_CONCURRENCY", "RUNAI_STREAMER_MEMORY_LIMIT", "RUNAI_STREAMER_DIST")


def runai_env():
    return {k: v for k, v in os.environ.items() if k.startswith("RUNAI_STREAMER")}


checks["at start"] = runai_env()
with distload.WorkerGroup(timeout_s=120) as g:
    try:
        distload.load(src, "runai_streamer", {"concurrency": 4, "memory_limit": -5}, group=g)
        checks["bad config"] = "RETURNED"
    except distload.ConfigError as exc:
        checks["bad config"] = str(exc)
    checks["after bad config"] = runai_env()

    during = None
    for name, tensor in distload.iter_tensors(src, "runai_streamer", {"concurrency": 4, "distributed": True}, group=g):
        if during is None:
            during = {k: os.environ.get(k) for k in KEYS}
    checks["during streamed load"] = during
    checks["after streamed load"] = runai_env()

    state = distload.load(src, "runai_streamer", {"concurrency": 4, "memory_limit": 1 << 20}, group=g)
    checks["loaded"] = len(state)
    checks["after load"] = runai_env()

    try:
        distload.load(bad, "runai_streamer", {"concurrency": 4}, group=g)
        checks["failed load"] = "RETURNED"
    except distload.CheckpointError as exc:
        checks["failed load"] = type(exc).__name__
    checks["after failed load"] = runai_env()

    os.environ["RUNAI_STREAMER_CONCURRENCY"] = "7"  # the user's own setting survives both kinds
    try:
        distload.load(src, "runai_streamer", {"concurrency": 0}, group=g)
    except distload.ConfigError:
        pass
    distload.load(src, "runai_streamer", {"concurrency": 4}, group=g)
    checks["user value after loads"] = os.environ.get("RUNAI_STREAMER_CONCURRENCY")
    rank = g.rank
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(checks, f)
'''


@pytest.fixture(scope="module")
def env_checks(tmp_path_factory):
    """Run ENV_SCRIPT once on 2 ranks (with no RUNAI_STREAMER_* set); rank -> its records."""
    root = tmp_path_factory.mktemp("env")
    write_whole(str(root / "ck"), every_dtype_state())
    bad_paths = write_whole(str(root / "bad"), every_dtype_state())
    append_garbage(bad_paths[0])  # headers pass, Run:ai refuses the file while reading
    out = root / "out"
    out.mkdir()
    script = write_script(root, "env.py", ENV_SCRIPT)
    result = run_script(script, [str(root / "ck"), str(root / "bad"), str(out)], nproc=2,
                        drop_prefixes=("RUNAI_STREAMER_",))
    assert result.returncode == 0, result.stdout + result.stderr[-6000:]
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)}


# what distload itself sets for a Run:ai read
DISTLOAD_KEYS = ("RUNAI_STREAMER_CONCURRENCY", "RUNAI_STREAMER_MEMORY_LIMIT", "RUNAI_STREAMER_DIST",
                 "RUNAI_STREAMER_DIST_TIMEOUT")


@pytest.mark.slow
def test_rejected_config_sets_no_environment_and_loads_restore_it(env_checks):
    for rank, checks in env_checks.items():
        assert checks["at start"] == {}
        assert checks["bad config"] != "RETURNED" and "memory_limit" in checks["bad config"]
        assert checks["after bad config"] == {}  # nothing half-applied
        # the config really reached Run:ai's environment while it read...
        assert checks["during streamed load"] == {
            "RUNAI_STREAMER_CONCURRENCY": "4", "RUNAI_STREAMER_MEMORY_LIMIT": None, "RUNAI_STREAMER_DIST": "1"}
        assert checks["loaded"] == len(every_dtype_state())
        # ...and is gone afterwards, after a failed read too
        for when in ("after streamed load", "after load", "after failed load"):
            left = {k: v for k, v in checks[when].items() if k in DISTLOAD_KEYS}
            assert left == {}, f"rank {rank} {when}: {left}"
        assert checks["failed load"] == "CheckpointError"
        assert checks["user value after loads"] == "7"  # the user's own value is put back


@pytest.mark.slow
def test_distributed_load_leaves_no_runai_environment(env_checks):
    for rank, checks in env_checks.items():
        assert checks["after streamed load"] == {}, f"rank {rank}: {checks['after streamed load']}"


# --------------------------------------------------------------------------------------------
# (f) failing paths tear the process group down: each process exits 1, never aborts


@pytest.fixture(scope="module")
def failing_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("failing")
    one_rank = str(root / "one-rank")
    write_sharded(one_rank, world_size=1)
    corrupt = str(root / "corrupt")
    corrupt_header(write_whole(corrupt, every_dtype_state())[0])
    read_error = str(root / "read-error")
    write_sharded(read_error, world_size=2)
    append_garbage(os.path.join(read_error, "model-rank-1-part-0.safetensors"))
    return {
        "planning-fails-on-rank-1": load_args(one_rank, "sharded_state"),
        "planning-fails-everywhere": load_args(corrupt, "runai_streamer", '{"distributed": true}'),
        "bad-file-on-rank-1": load_args(read_error, "runai_streamer_sharded"),
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", ["planning-fails-on-rank-1", "planning-fails-everywhere",
                                  "bad-file-on-rank-1"])
def test_failing_load_exits_1_without_abort(failing_sources, case):
    """Ranks started directly (torchrun's environment, no agent that could kill a slow rank), so
    each process's own exit status is seen: 1, not a signal."""
    start = time.monotonic()
    results = launch_ranks(failing_sources[case], nproc=2, timeout=HANG_DEADLINE_S)
    assert time.monotonic() - start < HANG_DEADLINE_S
    for r in results:
        output = r.stdout + r.stderr
        assert r.returncode == 1, f"rank {r.rank}: rc {r.returncode}\n{output[-4000:]}"
        for marker in ABORT_MARKERS:
            assert marker not in output, f"rank {r.rank}: {marker!r}\n{output[-4000:]}"
        assert "Traceback" not in output, output[-4000:]
    # Each rank's error is printed: by the rank, or once by rank 0 where every rank failed alike.
    every_output = "".join(r.stdout + r.stderr for r in results)
    for r in results:
        rank_error(every_output, r.rank)


PEER_STOPS_SCRIPT = r'''
import json, os, signal, sys, time
import distload

source, out, how = sys.argv[1], sys.argv[2], sys.argv[3]
rank = int(os.environ["RANK"])
start = time.monotonic()
try:
    with distload.WorkerGroup(device="cpu", timeout_s=10) as g:
        loader = distload.Loader(source, "runai_streamer", {"distributed": True}, group=g)
        for i, (name, tensor) in enumerate(loader.stream()):
            if rank == 1 and i == 1:
                os.kill(os.getpid(), signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        outcome = ["returned", None]
except distload.DistloadError as exc:
    outcome = ["raised", f"{type(exc).__name__}: {exc}"]
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(outcome + [time.monotonic() - start], f)
os._exit(0)  # a peer is gone: no teardown handshake with it
'''


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_peer_killed_or_stopped_during_a_distributed_read_is_named(tmp_path, how):
    """Issue 13, item 4: a rank SIGKILLed or SIGSTOPped in the middle of Run:ai's distributed
    read: the other ends with a GroupError (no gloo traceback) that names it, within the group's
    timeout."""
    folder = str(tmp_path / "ckpt")
    g = torch.Generator().manual_seed(3)
    write_whole(folder, {f"layers.{i}.weight": torch.randn(512, 1024, generator=g) for i in range(24)})  # 48 MiB
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "peer_stops.py", PEER_STOPS_SCRIPT)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, script, folder, str(out), how],
                              env=clean_env({**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    try:
        _, err0 = procs[0].communicate(timeout=HANG_DEADLINE_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert (out / "rank0.json").exists(), err0[-4000:]
    kind, message, seconds = json.loads((out / "rank0.json").read_text())
    assert kind == "raised" and message.startswith("GroupError"), message
    # A killed peer on this host is named as gone at once (its process is checked); a stopped one
    # by its heartbeat. A kill may also be seen first by the heartbeat: either names rank 1.
    named = ("rank 1 ended: its process on", "rank 1 stopped answering") if how == "killed" else (
        "rank 1 stopped answering",)
    assert any(words in message for words in named), message
    assert "Traceback" not in err0, err0[-4000:]
    assert seconds < 35, seconds


LATE_SURVIVOR_SCRIPT = r'''
import os, signal, sys, time
import distload

with distload.WorkerGroup(device="cpu", timeout_s=60) as group:
    group.exchange("ready")
    if group.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if group.rank == 2:
        time.sleep(2.0)  # busy elsewhere: it finds out after rank 0 did
    try:
        group.exchange("after")
    except distload.DistloadError as exc:
        print(f"rank {group.rank}: {exc}", flush=True)
        sys.exit(3)
'''


@pytest.mark.dist
def test_a_survivor_that_finds_out_late_still_names_the_killed_rank(tmp_path):
    """Rank 1 is killed; rank 0 (which serves the job's store outside torchrun) finds out at once
    and leaves; rank 2 finds out 2 s later, and names rank 1 from the store, which rank 0 kept
    while rank 2 still beat (it took the store along before, and rank 2 blamed rank 0)."""
    from dist_helpers import launch_ranks, write_script

    script = write_script(tmp_path, "late.py", LATE_SURVIVOR_SCRIPT)
    start = time.monotonic()
    results = launch_ranks([], nproc=3, timeout=90, entry=(script,))
    assert time.monotonic() - start < 30
    assert results[1].returncode == -9
    for rank in (0, 2):
        out = results[rank].stdout + results[rank].stderr
        assert results[rank].returncode == 3, out[-3000:]
        assert "rank 1 ended: its process on" in out and "does not answer" not in out, out[-3000:]
