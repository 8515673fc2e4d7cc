"""Malformed and special files (issue 13, items 1-3): one parser, safetensors' own rules, on every
format, dummy and inspect included; never a raw torch/json traceback, never a hang.

Each case is checked against the safetensors library too: a header it accepts must load here,
and one it rejects must be a CheckpointError here that names the file.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import distload
from distload.errors import CheckpointError
from distload.workers.group import WorkerGroup
from distload.checkpoints.inspection import inspect_source

FORMATS = ["auto", "safetensors", "runai_streamer", "dummy"]


def write_raw(path: str, header: object | bytes, data: bytes = b"", length: int | None = None) -> str:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def entry(shape, offsets, dtype="F32"):
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


BAD_HEADERS = [
    # (id, header, data, what the message must say)
    ("bool-in-shape", {"t": entry([True, 7], [0, 28])}, b"\0" * 28, "corrupt shape"),
    ("bool-offsets", {"t": entry([], [False, True])}, b"\0" * 4, "corrupt data_offsets"),
    ("shape-2**63", {"t": entry([0, 2**63], [0, 0])}, b"", "64-bit"),
    ("shape-2**70", {"t": entry([0, 2**70], [0, 0])}, b"", "cannot be a size"),
    ("offset-2**64", {"t": entry([1], [2**64, 2**64 + 4])}, b"", "corrupt data_offsets"),
    ("float-in-shape", {"t": entry([1.0], [0, 4])}, b"\0" * 4, "corrupt shape"),
    ("nan-in-metadata", b'{"__metadata__": {"a": NaN}}', b"", "NaN"),
    ("int-metadata", {"__metadata__": {"a": 1}}, b"", "not a string"),
    ("object-metadata", {"__metadata__": {"a": {"b": "c"}}}, b"", "not a string"),
    ("metadata-like-a-tensor", {"__metadata__": entry([1], [0, 4])}, b"\0" * 4, "not a string"),
]


def _huge_int_header() -> bytes:
    return b'{"t": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}'


def _deep_header() -> bytes:
    return b'{"__metadata__": ' + b'{"a": ' * 100_000 + b'"x"' + b"}" * 100_000 + b"}"


BAD_HEADERS += [("5000-digit-int", _huge_int_header(), b"", "5000 digits"),
                ("nested-100000-deep", _deep_header(), b"", "nested deeper")]


def safetensors_rejects(path: str) -> bool:
    try:
        with safe_open(path, "pt") as f:
            for key in f.keys():
                f.get_tensor(key)
    except Exception:
        return True
    return False


@pytest.mark.parametrize("case,header,data,needle", BAD_HEADERS, ids=[c[0] for c in BAD_HEADERS])
def test_bad_header_is_a_clear_error_on_every_format(tmp_path, case, header, data, needle):
    path = write_raw(str(tmp_path / "model.safetensors"), header, data)
    assert safetensors_rejects(path), f"{case}: safetensors accepts it, so distload must too"
    with WorkerGroup(device="cpu") as group:
        for fmt in FORMATS:
            with pytest.raises(CheckpointError) as err:
                distload.load(path, fmt, group=group)
            assert path in str(err.value) and needle in str(err.value), (fmt, str(err.value))
    with pytest.raises(CheckpointError, match=needle):
        inspect_source(path)


def test_header_length_over_safetensors_limit(tmp_path):
    # 100,000,008 bytes: safetensors' limit is 100,000,000; the length field alone says so
    path = write_raw(str(tmp_path / "big.safetensors"), b"{}", length=100_000_008)
    with pytest.raises(CheckpointError, match="header length of 100000008 bytes"):
        distload.load(path, "dummy")
    assert distload.loading.index.MAX_HEADER_BYTES == 100_000_000


def test_good_headers_still_load(tmp_path):
    path = str(tmp_path / "ok.safetensors")
    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "z": torch.zeros(0, 4)}, path,
              metadata={"format": "pt", "note": "ünïcode"})
    state = distload.load(path)
    assert torch.equal(state["a"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert inspect_source(path)["files"][0]["metadata"] == {"format": "pt", "note": "ünïcode"}


def _load_in_thread(source: str, fmt: str) -> tuple[threading.Thread, list]:
    outcome: list = []

    def run():
        try:
            distload.load(source, fmt)
            outcome.append("loaded")
        except Exception as exc:  # noqa: BLE001 - the outcome is asserted
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    return thread, outcome


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_fifo_is_refused_not_opened(tmp_path, fmt):
    folder = tmp_path / "ck"
    folder.mkdir()
    fifo = str(folder / "model.safetensors")
    os.mkfifo(fifo)
    for source in (fifo, str(folder)):
        thread, outcome = _load_in_thread(source, fmt)
        assert not thread.is_alive(), f"{fmt}: loading a FIFO blocked"
        assert isinstance(outcome[0], CheckpointError) and "FIFO" in str(outcome[0]) and fifo in str(outcome[0])


def _inspect_cli_in_thread(path: str) -> int:
    """``python -m distload inspect PATH``'s main() in this process (its exit code; what it
    printed is capsys's), in a thread: an inspect that opened a FIFO would block, and fails here
    after 30 s instead. An exception main() did not turn into a message (a traceback at the
    command line) is raised here."""
    import distload.cli.main

    outcome: list = []

    def run():
        try:
            outcome.append(distload.cli.main.main(["inspect", path]))
        except BaseException as exc:  # noqa: BLE001 - raised below, in the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), f"inspect {path} blocked"
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def test_inspect_cli_refuses_a_fifo_dangling_link_and_directory(tmp_path, capsys):
    folder = tmp_path / "ck"
    folder.mkdir()
    os.mkfifo(str(folder / "a.safetensors"))
    os.symlink(str(tmp_path / "gone.safetensors"), str(folder / "b.safetensors"))
    (folder / "c.safetensors").mkdir()
    for name, needle in (("a.safetensors", "FIFO"), ("b.safetensors", "dangling symbolic link"),
                         ("c.safetensors", "no .safetensors files in this folder")):  # a folder, by any name
        code = _inspect_cli_in_thread(str(folder / name))
        err = capsys.readouterr().err
        assert code != 0 and needle in err, (name, err[-2000:])
    assert _inspect_cli_in_thread(str(folder)) != 0
    # Inside a checkpoint folder, a directory named like a weight file is named, not opened.
    other = tmp_path / "ck2"
    other.mkdir()
    save_file({"a": torch.ones(2)}, str(other / "model-00001-of-00002.safetensors"))
    (other / "model-00002-of-00002.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: is a directory"):
        distload.load(str(other))


def test_verify_reads_headers_so_ok_means_loadable(tmp_path):
    """A shard whose header is broken, with a manifest whose size and SHA-256 were made to match:
    verify must not say OK (issue 13, item 9)."""
    import hashlib

    from distload.loading.manifest import MANIFEST_NAME
    from distload.checkpoints.verify import verify_folder

    whole, out = str(tmp_path / "whole"), str(tmp_path / "tp1")
    os.makedirs(whole)
    save_file({"a": torch.ones(2, 3), "b": torch.zeros(4)}, os.path.join(whole, "model.safetensors"))
    distload.reshard(whole, out, 1, sharding="replicate")
    assert verify_folder(out)[1] == []
    shard = next(n for n in os.listdir(out) if n.startswith("model-rank-0-part-"))
    path = os.path.join(out, shard)
    with open(path, "rb") as f:
        raw = f.read()
    length = struct.unpack("<Q", raw[:8])[0]
    header = raw[8:8 + length].replace(b'"F32"', b'"F33"', 1)  # same size: a dtype no reader knows
    assert len(header) == length and header != raw[8:8 + length]
    with open(path, "wb") as f:
        f.write(raw[:8] + header + raw[8 + length:])
    manifest_path = os.path.join(out, MANIFEST_NAME)
    with open(manifest_path) as f:
        manifest = json.load(f)
    for entry in manifest["files"]:
        if entry["name"] == shard:
            entry["sha256"] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    _, problems = verify_folder(out)
    assert len(problems) == 1 and shard in problems[0] and "header does not load" in problems[0], problems
