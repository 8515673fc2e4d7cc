"""``distload pull SRC DEST``: every node ends with the whole folder, each byte read once per job."""

from __future__ import annotations

import filecmp
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import every_dtype_state, run_distload, write_whole
from test_launch_multinode import describe, run_two_nodes, uts_namespaces  # noqa: F401 (a fixture)
from distload.fileio import TEMPORARY_SUFFIX
from distload.loading.manifest import MANIFEST_NAME

pytestmark = pytest.mark.dist

MIB = 1024 * 1024


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))


def same_folder(a: str, b: str) -> bool:
    names = sorted(os.listdir(a))
    if names != sorted(os.listdir(b)):
        return False
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    return not mismatch and not errors


def pull(source: str, dest: str, tmp_path, nproc: int | None = 2, *extra: str,
         **kwargs) -> tuple[subprocess.CompletedProcess, dict]:
    """``distload pull`` under torchrun with ``nproc`` ranks, or (None) one process without
    torchrun, as a user pulls alone: one process start less than torchrun's agent and its rank."""
    report = str(tmp_path / "pull-report.json")
    if os.path.exists(report):
        os.unlink(report)
    result = run_distload(["pull", source, dest, "--report-json", report, *extra], nproc=nproc, **kwargs)
    data = json.load(open(report)) if os.path.exists(report) else {}
    return result, data


@pytest.fixture
def sharded(tmp_path):
    """A distload-sharded checkpoint (manifest with SHA-256s) and a config file beside it."""
    from distload.checkpoints.reshard import reshard

    folder = str(tmp_path / "src")
    write_whole(str(tmp_path / "whole"), every_dtype_state(seed=5), num_files=2)
    reshard(str(tmp_path / "whole"), folder, 2, sharding="replicate")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"]}, f)
    return folder


@pytest.mark.slow
def test_two_ranks_copy_everything_reading_each_byte_once(sharded, tmp_path):
    dest = str(tmp_path / "dest")
    result, report = pull(sharded, dest, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert same_folder(sharded, dest)
    ranks = report["ranks"]
    assert [r["writes"] for r in ranks] == [True, False]  # one node: local rank 0 writes
    assert sum(r["requested_bytes"] for r in ranks) == folder_bytes(sharded)  # once per job
    assert all(r["requested_bytes"] > 0 for r in ranks)  # both ranks read a share
    assert sorted(ranks[0]["fetched"]) == sorted(os.listdir(sharded))
    assert "read from the source, whole job" in result.stdout
    # Both ranks' lines have the same fields; the rank that only sends says so.
    lines = [line for line in result.stdout.splitlines() if line.startswith("  rank ")]
    assert len(lines) == 2 and all("from the source; wrote " in line and ", kept " in line for line in lines), lines
    assert "sends only" in lines[1] and "sends only" not in lines[0]
    verified = run_distload(["verify", dest])
    assert verified.returncode == 0 and "match the manifest" in verified.stdout, verified.stdout


@pytest.mark.slow
def test_a_rerun_keeps_complete_files_and_fetches_only_what_is_missing_or_wrong(sharded, tmp_path):
    dest = str(tmp_path / "dest")
    assert pull(sharded, dest, tmp_path, 2, "--chunk-mib", "0.01")[0].returncode == 0
    # One rerun for both halves (a pull is a torchrun start): the files left complete are kept and
    # not read; the missing one and the one with a changed byte are fetched again, and only they.
    shards = sorted(n for n in os.listdir(dest) if n.endswith(".safetensors"))
    os.unlink(os.path.join(dest, shards[0]))
    with open(os.path.join(dest, shards[1]), "r+b") as f:  # same size, one byte changed: SHA-256 says so
        f.seek(os.path.getsize(f.name) - 1)
        last = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([last[0] ^ 0xFF]))
    result, report = pull(sharded, dest, tmp_path, 2, "--chunk-mib", "0.01")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(report["ranks"][0]["fetched"]) == shards[:2]
    assert sorted(report["ranks"][0]["kept"]) == sorted(set(os.listdir(sharded)) - set(shards[:2]))
    assert sum(r["requested_bytes"] for r in report["ranks"]) == sum(
        os.path.getsize(os.path.join(sharded, n)) for n in shards[:2])
    assert same_folder(sharded, dest)


@pytest.mark.slow
def test_a_source_that_disagrees_with_its_manifest_fails_and_leaves_nothing_visible(sharded, tmp_path):
    shard = sorted(n for n in os.listdir(sharded) if n.endswith(".safetensors"))[0]
    with open(os.path.join(sharded, shard), "r+b") as f:
        f.seek(os.path.getsize(f.name) - 1)
        f.write(b"\x7f")
    dest = str(tmp_path / "dest")
    result, _ = pull(sharded, dest, tmp_path)
    assert result.returncode != 0
    assert f"{shard}: SHA-256 of the pulled bytes" in result.stderr, result.stderr[-3000:]
    assert "RankFailedError" in result.stderr or "rank 0" in result.stderr
    assert shard not in os.listdir(dest)
    assert MANIFEST_NAME not in os.listdir(dest)  # the manifest comes last: never before its files
    assert not [n for n in os.listdir(dest) if n.endswith(TEMPORARY_SUFFIX)]


@pytest.mark.slow
def test_an_unfinished_save_is_refused_before_any_byte_moves(sharded, tmp_path):
    open(os.path.join(sharded, "distload.saving"), "w").close()
    result, _ = pull(sharded, str(tmp_path / "dest"), tmp_path)
    assert result.returncode != 0
    assert "the checkpoint is incomplete" in result.stderr
    assert not os.path.exists(tmp_path / "dest")


@pytest.mark.slow
def test_a_kill_mid_pull_leaves_only_complete_files_and_a_rerun_completes(tmp_path):
    source = str(tmp_path / "whole")
    write_whole(source, {f"w{i}": torch.randn(2 * MIB) for i in range(6)}, num_files=3)  # 3 x 16 MiB
    dest = str(tmp_path / "dest")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "distload", "pull", source, dest, "--chunk-mib", "0.25"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen(cmd, env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:  # wait until the first file is in place, then kill
            if os.path.isdir(dest) and any(n.endswith(".safetensors") for n in os.listdir(dest)):
                break
            if proc.poll() is not None:
                pytest.fail("the pull ended before it could be killed: make the source bigger")
            time.sleep(0.01)
        else:
            pytest.fail("no file appeared in DEST within 120 s")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    visible = [n for n in os.listdir(dest) if not n.startswith(".")]
    assert visible and len(visible) < 5, visible  # killed partway
    for name in visible:  # everything visible is complete and right
        assert filecmp.cmp(os.path.join(source, name), os.path.join(dest, name), shallow=False), name
    result, report = pull(source, dest, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(report["ranks"][0]["kept"]) >= {n for n in visible if n.endswith(".safetensors")}
    assert same_folder(source, dest)  # no partial left behind either


@pytest.mark.slow
def test_two_nodes_each_get_a_copy_reading_each_byte_once(tmp_path, uts_namespaces):
    source = str(tmp_path / "whole")
    write_whole(source, every_dtype_state(seed=9), num_files=2)
    report_path = str(tmp_path / "report.json")
    cwds = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    nodes = run_two_nodes(tmp_path, ["-m", "distload", "pull", source, "copy", "--chunk-mib", "0.01",
                                     "--report-json", report_path], 150, cwds=cwds)
    assert [n.returncode for n in nodes] == [0, 0], describe(nodes)
    for cwd in cwds:
        assert same_folder(source, os.path.join(cwd, "copy")), cwd
    ranks = json.load(open(report_path))["ranks"]
    assert sorted(r["hostname"] for r in ranks) == ["node0", "node1"]
    assert [r["writes"] for r in ranks] == [True, True]
    assert sum(r["requested_bytes"] for r in ranks) == folder_bytes(source)
    assert all(r["requested_bytes"] > 0 for r in ranks)


@pytest.mark.slow
def test_two_nodes_with_different_files_at_the_same_path_are_refused(tmp_path, uts_namespaces):
    """Each node has its own ./src, the same names and sizes, other bytes: without comparing the
    contents, each node would get a mix of both."""
    cwds = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    for i, cwd in enumerate(cwds):
        write_whole(os.path.join(cwd, "src"), {"w": torch.full((4096,), float(i))}, num_files=1)
    nodes = run_two_nodes(tmp_path, ["-m", "distload", "pull", "src", "copy"], 150, cwds=cwds)
    assert [n.returncode for n in nodes] != [0, 0], describe(nodes)
    for node in nodes:
        assert "the same size, other contents" in node.output, describe(nodes)
    for cwd in cwds:
        assert not os.path.exists(os.path.join(cwd, "copy")), "nothing may be written before the lists agree"


@pytest.mark.slow
def test_from_s3_the_store_serves_each_byte_once_per_job(tmp_path):
    """moto behind a byte-counting proxy: two ranks pull, the server sends the objects' bytes
    once (listings, headers and HTTP framing included), and the copy is exact."""
    from object_store_servers import ByteCountingProxy, start_moto

    source = str(tmp_path / "whole")
    write_whole(source, {f"w{i}": torch.randn(MIB) for i in range(8)}, num_files=4)  # 32 MiB
    os.makedirs(tmp_path / "moto")
    server = start_moto(str(tmp_path / "moto"))
    try:
        uri = server.upload_folder(source, "pull-me")
        proxy = ByteCountingProxy(server.port)
        try:
            result, report = pull(uri, str(tmp_path / "dest"), tmp_path, 2, "--chunk-mib", "2",
                                  env=server.env(proxy.port))
        finally:
            proxy.close()
    finally:
        server.stop()
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert same_folder(source, str(tmp_path / "dest"))
    total = folder_bytes(source)
    assert sum(r["requested_bytes"] for r in report["ranks"]) == total
    assert total <= proxy.served <= 1.05 * total, (proxy.served, total)


def test_a_source_naming_one_file_pulls_that_file_only(sharded, tmp_path):
    shard = sorted(n for n in os.listdir(sharded) if n.endswith(".safetensors"))[0]
    dest = str(tmp_path / "dest")
    result, report = pull(os.path.join(sharded, shard), dest, tmp_path, None)
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.listdir(dest) == [shard]
    assert filecmp.cmp(os.path.join(sharded, shard), os.path.join(dest, shard), shallow=False)


@pytest.mark.slow
def test_a_dest_that_cannot_be_written_is_a_clear_error_on_every_rank(sharded, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result, _ = pull(sharded, str(blocker), tmp_path)
    assert result.returncode != 0
    assert "error on rank 0:" in result.stderr and "DEST must be a writable local folder" in result.stderr, \
        result.stderr[-3000:]
    assert "error on rank 1: checking what each node has failed on rank(s) 0" in result.stderr
    assert 'distload/checkpoints/pull.py", line' not in result.stderr  # no traceback of ours (torchrun prints its own)


def test_an_object_written_again_during_the_pull_fails_and_leaves_nothing_visible(tmp_path, monkeypatch):
    """The object is rewritten (same size, other bytes) after its first chunk was read: the
    pulled bytes would mix two versions, so the pull fails naming it and DEST holds no such file."""
    import distload
    import distload.checkpoints.pull as pull_mod
    from object_store_servers import start_s3rver

    source = str(tmp_path / "whole")
    files = write_whole(source, {"a": torch.randn(MIB), "b": torch.randn(MIB)}, num_files=1)
    server = start_s3rver(str(tmp_path / "s3rver"))
    try:
        uri = server.upload_folder(source, "rewritten")
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        victim = os.path.basename(files[0])
        with open(files[0], "rb") as f:
            changed = bytearray(f.read())
        changed[-1] ^= 0xFF
        real_read = pull_mod._read_range

        def read_then_rewrite(src, name, start, end):
            data = real_read(src, name, start, end)
            if name == victim and start == 0:
                server.put(f"rewritten/{victim}", bytes(changed))
            return data

        monkeypatch.setattr(pull_mod, "_read_range", read_then_rewrite)
        dest = str(tmp_path / "dest")
        with distload.WorkerGroup(device="cpu") as group:
            with pytest.raises(distload.errors.CheckpointError, match=f"{victim}: the object was written again"):
                pull_mod.pull(uri, dest, group=group, chunk_bytes=MIB)
        assert not os.path.exists(os.path.join(dest, victim))
    finally:
        server.stop()


def tree(folder: str) -> dict[str, bytes]:
    """Every file below ``folder`` (relative name with ``/`` -> its bytes)."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder).replace(os.sep, "/")] = f.read()
    return found


def hub_shaped(folder: str) -> dict[str, bytes]:
    """A Hugging Face repository with subfolders (sentence-transformers' 1_Pooling/, Llama's
    original/, a deeper one), and a partial file in a subfolder that a pull must not copy."""
    write_whole(folder, {"w": torch.arange(4096, dtype=torch.float32)}, num_files=1)
    files = {"config.json": b'{"architectures": ["BertModel"]}', "1_Pooling/config.json": b'{"pooling": "mean"}',
             "original/params.json": b'{"dim": 8}', "deep/er/still/tokenizer.json": b"{}"}
    for name, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    save_path = os.path.join(folder, "original", "consolidated.safetensors")
    from safetensors.torch import save_file
    save_file({"tok": torch.ones(3, 5)}, save_path)
    expected = tree(folder)
    with open(os.path.join(folder, "original", f".half{TEMPORARY_SUFFIX}"), "wb") as f:
        f.write(b"a partial file of an earlier copy")
    return expected


def test_subfolders_are_pulled_too_and_a_rerun_keeps_them(tmp_path):
    source, dest = str(tmp_path / "hub"), str(tmp_path / "dest")
    expected = hub_shaped(source)
    result, report = pull(source, dest, tmp_path, None)
    assert result.returncode == 0, result.stderr[-3000:]
    assert tree(dest) == expected
    assert sorted(report["ranks"][0]["fetched"]) == sorted(expected)
    result, report = pull(source, dest, tmp_path, None)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(report["ranks"][0]["kept"]) == sorted(expected) and report["ranks"][0]["requested_bytes"] == 0


def test_subfolders_of_an_object_store_prefix_are_pulled_too(tmp_path, monkeypatch):
    import distload
    import distload.checkpoints.pull as pull_mod
    from object_store_servers import start_s3rver

    source = str(tmp_path / "hub")
    expected = hub_shaped(source)
    server = start_s3rver(str(tmp_path / "s3rver"))
    try:
        uri = server.upload_folder(source, "hub")
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        dest = str(tmp_path / "dest")
        with distload.WorkerGroup(device="cpu") as group:
            report = pull_mod.pull(uri, dest, group=group, chunk_bytes=4096)
            assert sorted(report.fetched) == sorted(expected)
            assert tree(dest) == {n: d for n, d in expected.items()}
    finally:
        server.stop()


def test_an_object_name_that_would_leave_dest_is_refused():
    """A hand-made key can hold ``..`` or an empty segment (``a//b``: os.path.join would make the
    second part absolute); s3rver refuses to store one, so the listing is a stand-in."""
    from types import SimpleNamespace

    from distload.checkpoints.pull import _every_file
    from distload.errors import CheckpointError
    from distload.loading.stores import Listing, parse_uri

    for bad in ("a//b.json", "../escape.json", "sub/./x"):
        listing = Listing({"ok.json": 2, bad: 2})
        src = SimpleNamespace(remote=True, folder_location=parse_uri("s3://b/p"),
                              store=SimpleNamespace(list=lambda location, recursive: listing),
                              path=lambda name: f"s3://b/p/{name}")
        with pytest.raises(CheckpointError, match="path segment, which would not land inside DEST"):
            _every_file(src)


@pytest.mark.slow
def test_rank_1_killed_mid_pull_is_named_by_rank_0(tmp_path):
    """Issue 30, item 7: rank 0's error names rank 1, whose process is gone, and quotes no gloo
    advice ("bugs in the application"). The ranks run with torchrun's environment (its run id:
    the path where a lost peer is not watched for) but without its agent, which would end rank 0
    the moment rank 1 died and leave no message to check."""
    from dist_helpers import clean_env, free_port, rank_env

    source = str(tmp_path / "whole")
    write_whole(source, {f"w{i}": torch.randn(2 * MIB) for i in range(6)}, num_files=3)  # 3 x 16 MiB
    dest = str(tmp_path / "dest")
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "distload", "pull", source, dest, "--chunk-mib", "0.25", "--timeout", "60"],
        env=rank_env(clean_env({"TORCHELASTIC_RUN_ID": "pull-test"}), rank, 2, port),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    try:
        deadline = time.monotonic() + 120
        while not (os.path.isdir(dest) and any(n.endswith(TEMPORARY_SUFFIX) for n in os.listdir(dest))):
            if procs[1].poll() is not None or time.monotonic() > deadline:
                pytest.fail("the pull ended (or never started) before rank 1 could be killed")
            time.sleep(0.01)
        procs[1].kill()
        _, err = procs[0].communicate(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert procs[0].returncode == 1, err[-3000:]
    assert "rank 1 ended: its process on" in err and "is gone" in err, err[-3000:]
    assert "bugs in the application" not in err and "GLHF" not in err and "pair.cc" not in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert not [n for n in os.listdir(dest) if not n.startswith(".") and not filecmp.cmp(
        os.path.join(source, n), os.path.join(dest, n), shallow=False)]  # what is visible is whole
