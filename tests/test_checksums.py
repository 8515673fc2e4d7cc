"""CRC-32C on load: every save records each tensor's CRC-32C per 4 MiB chunk in the manifest,
and every load of such a checkpoint checks the bytes it reads (distload/loading/checksums.py).

A flipped byte inside a tensor's data keeps the file's size, so only these checks (and
``distload verify``'s SHA-256) see it: the load must fail naming the file and the tensor, on
every rank, instead of handing out a different model.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import google_crc32c
import pytest
import torch
from safetensors.torch import save_file

import distload
from distload.checkpoints.reshard import reshard
from distload.errors import CheckpointError
from distload.loading.checksums import CHUNK_BYTES
from distload.loading.manifest import MANIFEST_NAME
from distload.loading.sources import read_local_header

from conftest import run_distload
from test_save_reshard import LAUNCH_VARS, llama_state, raw, vllm_tp1, write_hf_source

FORMATS = ["sharded_state", "runai_streamer_sharded", "auto"]


@pytest.fixture(autouse=True)
def single_process_env(monkeypatch):
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A Llama-shaped source and its reshards for 1 and 2 ranks (several parts per rank)."""
    root = tmp_path_factory.mktemp("crc")
    state = llama_state()
    write_hf_source(str(root / "src"), state)
    outs = {n: str(root / f"tp{n}") for n in (1, 2)}
    for n, out in outs.items():
        reshard(str(root / "src"), out, n, max_file_size=16 * 1024)
    return state, outs


def manifest_json(folder: str) -> dict:
    with open(os.path.join(folder, MANIFEST_NAME)) as f:
        return json.load(f)


def flip_byte_in(folder: str, file_name: str, tensor: str | None = None, at: float = 0.5) -> tuple[str, str]:
    """Flip one bit of a byte inside a tensor's data (the largest one of the file unless named),
    ``at`` of the way into it; returns the file's path and the tensor's name."""
    path = os.path.join(folder, file_name)
    info = read_local_header(path)
    victim = (next(t for t in info.tensors if t.name == tensor) if tensor
              else max(info.tensors, key=lambda t: t.nbytes))
    offset = victim.begin + int(victim.nbytes * at)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
    return path, victim.name


def chunks_crc32c(data: bytes) -> list[int]:
    return [google_crc32c.value(data[i:i + CHUNK_BYTES]) for i in range(0, len(data), CHUNK_BYTES)]


def test_saves_record_each_tensors_crc32c_per_chunk(saved, tmp_path):
    _, outs = saved
    # save_sharded from a job, with a tensor of several chunks (and an empty one)
    g = torch.Generator().manual_seed(3)
    state = {"big": torch.randn(3 * CHUNK_BYTES // 4 + 5, generator=g), "small": torch.arange(7, dtype=torch.int16),
             "empty": torch.zeros(0, 4)}
    distload.save_sharded(state, str(tmp_path / "saved"))
    for folder in (outs[2], str(tmp_path / "saved")):
        files = manifest_json(folder)["files"]
        for entry in files:
            assert entry["crc32c_chunk_bytes"] == CHUNK_BYTES
            info = read_local_header(os.path.join(folder, entry["name"]))
            with open(os.path.join(folder, entry["name"]), "rb") as f:
                data = f.read()
            assert sorted(entry["crc32c"]) == sorted(t.name for t in info.tensors)
            for t in info.tensors:
                assert entry["crc32c"][t.name] == chunks_crc32c(data[t.begin:t.end]), (folder, t.name)
    big = manifest_json(str(tmp_path / "saved"))["files"][0]["crc32c"]
    assert len(big["big"]) == 4 and big["empty"] == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_flipped_byte_fails_the_load_naming_the_file_and_tensor(saved, tmp_path, fmt):
    state, outs = saved
    out = str(tmp_path / "copy")
    shutil.copytree(outs[1], out)
    loaded = distload.load(out, fmt)  # intact: bit for bit, with every tensor checked
    for name, want in vllm_tp1(state).items():
        assert raw(loaded[name]) == raw(want), name
    victim_file = manifest_json(out)["files"][2]["name"]
    path, tensor = flip_byte_in(out, victim_file)
    with pytest.raises(CheckpointError) as err:
        distload.load(out, fmt)
    message = str(err.value)
    assert message.startswith(f"{path}: tensor {tensor!r} is corrupt"), message
    assert "CRC-32C" in message and "re-copy" in message and f"python -m distload verify {out}" in message
    assert "\n" not in message

    # The same files with the manifest of a distload that recorded no checksums: loaded as before,
    # unchecked (the flipped byte goes through: what verify is for).
    m = manifest_json(out)
    assert m["version"] == 2
    m["version"] = 1
    for entry in m["files"]:
        del entry["crc32c"], entry["crc32c_chunk_bytes"]
    with open(os.path.join(out, MANIFEST_NAME), "w") as f:
        json.dump(m, f)
    loaded = distload.load(out, fmt)
    assert sorted(loaded) == sorted(state)
    assert raw(loaded[tensor]) != raw(vllm_tp1(state)[tensor])


def test_a_damaged_checksum_list_is_a_corrupt_manifest(saved, tmp_path):
    _, outs = saved
    out = str(tmp_path / "copy")
    shutil.copytree(outs[1], out)
    m = manifest_json(out)
    name = sorted(m["files"][0]["crc32c"])[0]
    m["files"][0]["crc32c"][name] = ["12"]
    with open(os.path.join(out, MANIFEST_NAME), "w") as f:
        json.dump(m, f)
    with pytest.raises(CheckpointError, match=r"corrupt manifest .*CRC-32C entries of 'model-rank-0-part-0"):
        distload.load(out, "auto")


@pytest.mark.dist
@pytest.mark.parametrize("fmt", ["auto", pytest.param("sharded_state", marks=pytest.mark.slow)])
def test_every_rank_fails_with_the_corrupt_file_named(saved, tmp_path, fmt):
    """torchrun, 2 ranks: rank 1's file is corrupt; both ranks end, naming it, within the timeout."""
    _, outs = saved
    out = str(tmp_path / "copy")
    shutil.copytree(outs[2], out)
    victim = next(f["name"] for f in manifest_json(out)["files"] if f["rank"] == 1 and f["part"] == 1)
    path, tensor = flip_byte_in(out, victim)
    start = time.monotonic()
    result = run_distload(["load", out, "--load-format", fmt, "--no-progress"], nproc=2, timeout=120)
    assert result.returncode != 0
    assert time.monotonic() - start < 100
    lines = [ln for ln in result.stderr.splitlines() if f"{path}: tensor {tensor!r} is corrupt" in ln]
    assert lines, result.stderr[-3000:]
    # rank 0 read intact files, and still fails with rank 1's error named
    assert any("error on rank 1" in ln for ln in lines), result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.dist
def test_replicas_sharing_a_read_fail_together(saved, tmp_path):
    """Two data-parallel replicas of TP rank 0 share the read of its files (distributed): a
    corrupt tensor fails both ranks, the one that read it and the one it was sent to."""
    _, outs = saved
    out = str(tmp_path / "copy")
    shutil.copytree(outs[1], out)
    path, tensor = flip_byte_in(out, manifest_json(out)["files"][1]["name"])
    result = run_distload(["load", out, "--no-progress", "--tensor-parallel-size", "1",
                           "--model-loader-extra-config", '{"distributed": true}'], nproc=2, timeout=120)
    assert result.returncode != 0
    assert f"{path}: tensor {tensor!r} is corrupt" in result.stderr, result.stderr[-3000:]
    assert "error on ranks 0, 1" in result.stderr, result.stderr[-3000:]


# -- a sliced read of part of a file --------------------------------------------------------------

@pytest.fixture(scope="module")
def store_copy(tmp_path_factory):
    """A checkpoint resharded for 1 rank with a 16 MiB tensor split along dim 0 (4 chunks: TP
    rank 0 of 2 reads chunks 0-1, rank 1 chunks 2-3) and a 2 MiB one along dim 1 (one chunk,
    half of every row for each rank), served by s3rver: a whole-format TP load reads each rank's
    byte ranges only."""
    from object_store_servers import start_s3rver

    root = tmp_path_factory.mktemp("sliced")
    g = torch.Generator().manual_seed(5)
    state = {"model.embed_tokens.weight": torch.randn(8192, 512, generator=g),
             "model.layers.0.self_attn.o_proj.weight": torch.randn(1024, 512, generator=g),
             "model.norm.weight": torch.randn(512, generator=g)}
    os.makedirs(root / "src")
    save_file(state, str(root / "src" / "model.safetensors"))
    with open(root / "src" / "config.json", "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "hidden_size": 512, "num_attention_heads": 8,
                   "num_key_value_heads": 8, "vocab_size": 8192}, f)
    reshard(str(root / "src"), str(root / "tp1"), 1, sharding="decoder")
    server = start_s3rver(str(root))
    yield server, str(root / "tp1"), state
    server.stop()


def load_tp_rank(uri: str, rank: int) -> dict[str, torch.Tensor]:
    with distload.WorkerGroup(device="cpu") as group:
        result = distload.Loader(uri, "safetensors", group=group, tensor_parallel_size=2,
                                 tensor_parallel_rank=rank).load()
    assert result.rank_report.path == "ranged-reads"  # byte ranges, not whole tensors
    return result.state


@pytest.mark.slow
def test_a_sliced_read_checks_the_part_it_reads(store_copy, tmp_path, monkeypatch):
    server, folder, state = store_copy
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    file_name = manifest_json(folder)["files"][0]["name"]

    # a byte in TP rank 1's rows of the dim-0 split tensor (its last chunk)
    rows = str(tmp_path / "rows")
    shutil.copytree(folder, rows)
    path, tensor = flip_byte_in(rows, file_name, "model.embed_tokens.weight", at=0.9)
    uri = server.upload_folder(rows, "rows")
    with pytest.raises(CheckpointError) as err:
        load_tp_rank(uri, 1)
    assert str(err.value).startswith(f"{uri}/{file_name}: tensor {tensor!r} is corrupt"), str(err.value)
    # TP rank 0 reads no byte of that chunk: its load is whole and bit for bit
    loaded = load_tp_rank(uri, 0)
    assert raw(loaded[tensor]) == raw(state[tensor][:4096])
    assert raw(loaded["model.layers.0.self_attn.o_proj.weight"]) == raw(
        state["model.layers.0.self_attn.o_proj.weight"][:, :256].contiguous())

    # a byte in TP rank 0's columns of the dim-1 split tensor (a row's first bytes)
    cols = str(tmp_path / "cols")
    shutil.copytree(folder, cols)
    path, tensor = flip_byte_in(cols, file_name, "model.layers.0.self_attn.o_proj.weight", at=0.5)
    uri = server.upload_folder(cols, "cols")
    with pytest.raises(CheckpointError, match=f"tensor {tensor!r} is corrupt"):
        load_tp_rank(uri, 0)
