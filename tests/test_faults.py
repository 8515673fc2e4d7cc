"""Faults injected with real processes (issue 13): a disk that fills during reshard.

The output folder is a 1 MiB tmpfs mounted inside a private user and mount namespace
(``unshare -rm``, no root needed, the machine's mounts untouched).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import distload
from distload.errors import CheckpointError

from conftest import in_ci


def unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def fails_on_a_1_mib_disk(mount: str, args: list[str], listed: str, prepare: str = "true") -> tuple[list[str], str]:
    """``python -m distload ARGS`` with a 1 MiB tmpfs at ``mount`` (after the sh commands
    ``prepare``), in a private user and mount namespace (skipped where there is none, failed under
    CI). It must fail with distload's message, no traceback; returns what ``listed`` then holds
    (``ls -a``) and the whole output."""
    if not unshare_works():
        if in_ci():
            pytest.fail("unshare -rm (util-linux, user namespaces) is needed under CI")
        pytest.skip("this machine cannot make a private mount namespace (unshare -rm)")
    os.makedirs(mount)
    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "distload", *args])
    script = (f"mount -t tmpfs -o size=1m tmpfs {shlex.quote(mount)} && {prepare} && {command}; echo exit=$?; "
              f"ls -a {shlex.quote(listed)}")
    result = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    text = result.stdout + result.stderr
    assert "exit=1" in text, text[-3000:]
    assert "Traceback" not in text and "Errno 28" not in text, text[-3000:]
    return result.stdout.split("exit=1", 1)[1].split(), text


def test_disk_full_during_save_sharded_names_the_file_and_leaves_the_folder_refused(tmp_path):
    whole = str(tmp_path / "whole")
    os.makedirs(whole)
    g = torch.Generator().manual_seed(0)
    save_file({f"layers.{i}.weight": torch.randn(256, 1024, generator=g) for i in range(4)},  # 4 MiB
              os.path.join(whole, "model.safetensors"))
    mount = str(tmp_path / "small")
    out = os.path.join(mount, "tp1")
    _, text = fails_on_a_1_mib_disk(mount, ["reshard", whole, out, "--tensor-parallel-size", "1", "--sharding",
                                            "replicate"], out)
    assert "no space left on the device" in text and "bytes free there" in text, text[-3000:]
    assert f"{out}/model-rank-0-part-" in text  # the file it could not write
    assert "distload.saving" in text  # the marker stays: every later command refuses the folder


def test_a_refused_unfinished_save_after_a_failed_write(tmp_path):
    """What the marker means for a later load (the same folder state, made without a full disk)."""
    from distload.checkpoints.output import SAVING_MARKER

    folder = tmp_path / "unfinished"
    folder.mkdir()
    (folder / SAVING_MARKER).write_text("")
    save_file({"a": torch.ones(2)}, str(folder / "model-rank-0-part-0.safetensors"))
    with pytest.raises(CheckpointError, match="incomplete"):
        distload.load(str(folder), "sharded_state")


@pytest.mark.parametrize("fmt", ["auto", "safetensors", "runai_streamer"])
@pytest.mark.parametrize("change", ["rewritten", "replaced", "resized"])
def test_a_file_changed_between_planning_and_the_end_of_its_read_fails(tmp_path, fmt, change):
    """Issue 13, item 7: never a silent mix of two versions of a file."""
    from distload.workers.group import WorkerGroup

    folder = str(tmp_path / "ck")
    os.makedirs(folder)
    path = os.path.join(folder, "model.safetensors")
    save_file({"a": torch.ones(64, 64), "b": torch.zeros(64)}, path)
    with WorkerGroup(device="cpu") as group:
        loader = distload.Loader(folder, fmt, group=group)
        plan = loader.plan()
        if change == "rewritten":  # same size and name, new bytes (an in-place overwrite)
            save_file({"a": torch.full((64, 64), 2.0), "b": torch.zeros(64)}, path + ".new")
            with open(path + ".new", "rb") as src, open(path, "r+b") as dst:
                dst.write(src.read())
            os.utime(path, ns=(plan.index.files[0].stamp[3] + 10**9,) * 2)  # coarse clocks: a later mtime
            os.unlink(path + ".new")
        elif change == "replaced":  # renamed over, as a download tool does
            save_file({"a": torch.full((64, 64), 3.0), "b": torch.zeros(64)}, path + ".new")
            os.replace(path + ".new", path)
        else:
            with open(path, "ab") as f:
                f.write(b"\0" * 8)
        with pytest.raises(CheckpointError) as err:
            dict(loader.stream(plan))
    assert path in str(err.value), str(err.value)
    if change != "resized":  # a resize the readers may notice themselves, naming the file
        assert f"was {change}" in str(err.value) and "load again" in str(err.value), str(err.value)


@pytest.mark.parametrize("fmt", ["runai_streamer", "auto", "safetensors"])
def test_a_file_truncated_after_planning_is_an_error_naming_it(tmp_path, fmt):
    """Issue 13, item 4: Run:ai's 'End of file reached' (and every reader's) as a DistloadError."""
    from distload.workers.group import WorkerGroup

    folder = str(tmp_path / "ck")
    os.makedirs(folder)
    path = os.path.join(folder, "model.safetensors")
    save_file({"a": torch.ones(256, 256), "b": torch.zeros(256, 256)}, path)
    with WorkerGroup(device="cpu") as group:
        loader = distload.Loader(folder, fmt, group=group)
        plan = loader.plan()
        os.truncate(path, os.path.getsize(path) - 100_000)
        with pytest.raises(distload.DistloadError) as err:
            dict(loader.stream(plan))
    assert path in str(err.value), str(err.value)


_TRUNCATE_DURING_READ = r"""
import os, sys
import distload
from distload.workers.group import WorkerGroup
folder, fmt, path = sys.argv[1:4]
with WorkerGroup(device="cpu") as group:
    loader = distload.Loader(folder, fmt, group=group)
    plan = loader.plan()
    try:
        for i, (name, tensor) in enumerate(loader.stream(plan)):
            if i == 0:  # safetensors has mapped the file: cut it under the map
                os.truncate(path, os.path.getsize(path) // 3)
    except distload.DistloadError as exc:
        print("ERROR:", exc)
        sys.exit(3)
print("NO ERROR")
"""


@pytest.mark.parametrize("fmt,name", [("safetensors", "model.safetensors"),
                                      ("sharded_state", "model-rank-0-part-0.safetensors")])
def test_a_file_truncated_under_safetensors_map_is_an_error_not_sigbus(tmp_path, fmt, name):
    """Issue 13, item 5: touching a map beyond its file's end is SIGBUS; the copy out of the map
    must end in an error naming the file and tensor instead."""
    folder = tmp_path / "ck"
    folder.mkdir()
    path = str(folder / name)
    g = torch.Generator().manual_seed(0)
    save_file({f"t{i}": torch.randn(512, 1024, generator=g) for i in range(6)}, path)  # 12 MiB
    script = tmp_path / "truncate.py"
    script.write_text(_TRUNCATE_DURING_READ)
    result = subprocess.run([sys.executable, str(script), str(folder), fmt, path],
                            capture_output=True, text=True, timeout=120)
    text = result.stdout + result.stderr
    assert result.returncode == 3, f"exit {result.returncode} (-7 is SIGBUS): {text[-3000:]}"
    assert path in text and "truncated or replaced during the load" in text, text[-3000:]
    assert "tensor 't" in text and "Traceback" not in text, text[-3000:]


def test_safetensors_reads_by_pread_where_process_vm_readv_is_refused(tmp_path, monkeypatch):
    """The fallback where a seccomp filter refuses process_vm_readv: the same bytes, the path
    named in the report, and a truncated file still an error."""
    from distload.loading import mapped
    from safetensors.torch import load_file

    monkeypatch.setattr(mapped, "safe_copy_available", lambda: False)
    folder = tmp_path / "ck"
    folder.mkdir()
    path = str(folder / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    save_file({"a": torch.randn(300, 70, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16),
               "empty": torch.zeros(0, 4)}, path)
    from distload.workers.group import WorkerGroup

    with WorkerGroup(device="cpu") as group:
        result = distload.Loader(str(folder), "safetensors", group=group).load()
    tensors = result.state
    expected = load_file(path)
    assert set(tensors) == set(expected)
    for key, value in expected.items():
        assert torch.equal(tensors[key].view(torch.uint8), value.view(torch.uint8)), key
    assert result.rank_report.path == "safetensors-pread"


def test_map_copies_are_bit_exact_and_short_copies_are_counted(tmp_path):
    import mmap

    from distload.loading import mapped

    if not mapped.safe_copy_available():
        if in_ci():
            pytest.fail("process_vm_readv is refused on this CI machine")
        pytest.skip("process_vm_readv is refused here")
    path = tmp_path / "bytes"
    data = os.urandom(3 * mapped.CHUNK_BYTES + 12345)
    path.write_bytes(data)
    with open(path, "rb") as f:
        region = mmap.mmap(f.fileno(), len(data), prot=mmap.PROT_READ)
    try:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns that the map is read-only
            src = torch.frombuffer(region, dtype=torch.uint8)
        dst = torch.empty(len(data), dtype=torch.uint8)
        with mapped.MapCopier() as copier:
            copier.copy(dst, src)
            assert bytes(dst.numpy()) == data
            os.truncate(path, mapped.CHUNK_BYTES + 4096)
            with pytest.raises(mapped.ShortCopy) as short:
                copier.copy(dst, src)
        assert short.value.copied == mapped.CHUNK_BYTES + 4096 and short.value.wanted == len(data)
        del src
    finally:
        region.close()


def test_a_full_disk_during_pull_counts_without_the_pulls_own_partial_file(tmp_path):
    """Issue 30, item 7: the partial file a pull writes is what fills the disk; the advice must
    not ask to free space the pull itself holds. A partial a killed pull left (here 800 KiB on a
    1 MiB disk) is removed before writing; the one of the file that did not fit is removed on
    failure, and the message counts what is free without it."""
    source = str(tmp_path / "source")
    os.makedirs(source)
    save_file({"a": torch.zeros(64 * 1024)}, os.path.join(source, "model-00001.safetensors"))  # 256 KiB
    save_file({"b": torch.zeros(512 * 1024)}, os.path.join(source, "model-00002.safetensors"))  # 2 MiB
    mount = str(tmp_path / "small")
    dest = os.path.join(mount, "dest")
    stale = os.path.join(dest, ".model-00002.safetensors.distload-tmp")
    listing, text = fails_on_a_1_mib_disk(mount, ["pull", source, dest, "--chunk-mib", "0.25"], dest,
                                          prepare=f"mkdir {shlex.quote(dest)} && head -c 819200 /dev/zero > {shlex.quote(stale)}")
    assert sorted(listing) == [".", "..", "model-00001.safetensors"], listing  # no partial left, stale one gone
    assert f"{dest}/model-00002.safetensors: no space left on" in text, text[-3000:]
    assert "the pull's own partial file (.model-00002.safetensors.distload-tmp) is removed" in text, text[-3000:]
    assert "free at least " in text and "the 1 complete file(s) there are kept" in text, text[-3000:]
