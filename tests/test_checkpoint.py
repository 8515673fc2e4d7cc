"""Unit tests for safetensors header parsing (distload/checkpoint.py) and listing (distload/sources.py)."""

from __future__ import annotations

import json
import math
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

import distload
from distload.loading.formats import make_load_config
from distload.loading.index import DTYPES, build_index, dtype_code, parse_header
from distload.loading.sources import content_fingerprint, read_local_header
from distload.errors import CheckpointError, ConfigError
from distload.workers.group import WorkerGroup
from distload.loading.planner import plan_rank
from distload.loading.sources import INDEX_FILE, check_source, list_whole_checkpoint, read_header

from conftest import ALL_DTYPES, every_dtype_state, plain_read, write_sharded, write_whole

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
               "SLURM_LOCALID", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def single_group(monkeypatch):
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    with WorkerGroup(device="cpu") as group:
        yield group


def raw_file(path, header: dict, data: bytes = b"", header_len: int | None = None) -> str:
    """Write a safetensors-like file by hand: 8-byte length, JSON header, data."""
    text = json.dumps(header).encode("utf-8")
    length = len(text) if header_len is None else header_len
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", length) + text + data)
    return str(path)


def one_tensor_file(tmp_path, name="bad.safetensors", **entry) -> str:
    base = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    base.update(entry)
    return raw_file(tmp_path / name, {"w": base}, b"\0" * 16)


# -- valid files -------------------------------------------------------------------------------

def test_valid_file_offsets_for_every_dtype(tmp_path):
    state = every_dtype_state(seed=3)
    path = str(tmp_path / "all.safetensors")
    save_file(state, path)
    info = read_local_header(path)

    assert info.path == path
    assert info.size == os.path.getsize(path)
    assert {t.name for t in info.tensors} == set(state)
    dtypes_seen = {t.torch_dtype for t in info.tensors}
    for dtype in ALL_DTYPES:
        assert dtype in dtypes_seen
    # Independent recomputation of the header's byte ranges.
    with open(path, "rb") as f:
        blob = f.read()
    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + header_len])
    data_start = 8 + header_len
    begins = [t.begin for t in info.tensors]
    assert begins == sorted(begins)
    for tensor in info.tensors:
        expected = state[tensor.name]
        entry = header[tensor.name]
        assert tensor.file == path
        assert tensor.dtype == entry["dtype"] == dtype_code(expected.dtype)
        assert DTYPES[tensor.dtype] == expected.dtype
        assert tensor.shape == tuple(expected.shape)
        assert tensor.begin == data_start + entry["data_offsets"][0]
        assert tensor.end == data_start + entry["data_offsets"][1]
        assert tensor.nbytes == expected.numel() * expected.element_size()
        raw = blob[tensor.begin:tensor.end]
        assert raw == expected.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    assert info.nbytes == sum(t.numel() * t.element_size() for t in state.values())


def test_zero_dim_and_empty_tensors(tmp_path):
    path = str(tmp_path / "small.safetensors")
    save_file({"scalar": torch.tensor(1.5), "empty": torch.zeros(0, 7, dtype=torch.bfloat16),
               "one": torch.ones(1, dtype=torch.int64)}, path)
    tensors = {t.name: t for t in read_local_header(path).tensors}
    assert tensors["scalar"].shape == ()
    assert tensors["scalar"].nbytes == 4
    assert tensors["scalar"].dtype == "F32"
    assert tensors["empty"].shape == (0, 7)
    assert tensors["empty"].nbytes == 0
    assert tensors["empty"].begin == tensors["empty"].end
    assert tensors["empty"].dtype == "BF16"
    assert tensors["one"].nbytes == 8


def test_metadata_is_kept(tmp_path):
    path = str(tmp_path / "meta.safetensors")
    save_file({"x": torch.ones(2)}, path, metadata={"format": "pt"})
    info = read_local_header(path)
    assert info.metadata == {"format": "pt"}
    assert [t.name for t in info.tensors] == ["x"]


def test_dtype_code_unknown():
    with pytest.raises(CheckpointError, match="has no safetensors code"):
        dtype_code(torch.quint8)


# -- bad files ---------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 1, 7])
def test_file_shorter_than_8_bytes(tmp_path, size):
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\1" * size)
    with pytest.raises(CheckpointError) as info:
        read_local_header(str(path))
    message = str(info.value)
    assert message.startswith(str(path))
    assert "not a safetensors file" in message
    assert f"{size} bytes long" in message


def test_torch_pickle_is_not_a_safetensors_file(tmp_path):
    path = tmp_path / "pytorch_model.safetensors"
    torch.save({"w": torch.ones(64, 64)}, str(path))
    with pytest.raises(CheckpointError) as info:
        read_local_header(str(path))
    message = str(info.value)
    assert str(path) in message
    assert "not a safetensors file" in message
    assert "PyTorch .bin/.pt" in message


def test_text_file_is_not_a_safetensors_file(tmp_path):
    path = tmp_path / "notes.safetensors"
    path.write_text("this is a README, not a checkpoint\n" * 4)
    with pytest.raises(CheckpointError) as info:
        read_local_header(str(path))
    assert str(path) in str(info.value)
    assert "not a safetensors file" in str(info.value)


@pytest.mark.parametrize("header_len", [0, 1])
def test_tiny_header_length_is_not_safetensors(tmp_path, header_len):
    path = tmp_path / "zero.safetensors"
    path.write_bytes(struct.pack("<Q", header_len) + b"{}" * 4)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        read_local_header(str(path))


def test_header_length_larger_than_file(tmp_path):
    path = raw_file(tmp_path / "cut.safetensors", {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                    header_len=5000)
    with pytest.raises(CheckpointError) as info:
        read_local_header(path)
    message = str(info.value)
    assert message.startswith(path)
    assert "truncated header" in message
    assert "5000 bytes" in message


def test_real_file_cut_inside_header(tmp_path):
    path = str(tmp_path / "cut.safetensors")
    save_file({"a": torch.ones(8), "b": torch.zeros(3, 3)}, path)
    with open(path, "rb") as f:
        head = f.read(20)
    with open(path, "wb") as f:
        f.write(head)
    with pytest.raises(CheckpointError, match="truncated header") as info:
        read_local_header(path)
    assert path in str(info.value)


@pytest.mark.parametrize("header_bytes", [b'{"w": {"dtype": "F32",', b"\xff\xfe{}   ", b"[1, 2, 3]", b'"text"  '])
def test_corrupt_header(tmp_path, header_bytes):
    path = tmp_path / "corrupt.safetensors"
    path.write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes + b"\0" * 16)
    with pytest.raises(CheckpointError) as info:
        read_local_header(str(path))
    assert str(path) in str(info.value)
    assert "corrupt header" in str(info.value)


def test_corrupt_metadata(tmp_path):
    path = raw_file(tmp_path / "meta.safetensors", {"__metadata__": ["x"]})
    with pytest.raises(CheckpointError, match="corrupt header: __metadata__ must be an object"):
        read_local_header(path)


@pytest.mark.parametrize("dtype", ["F2", "float32", "Q8", None, 7])
def test_unknown_dtype(tmp_path, dtype):
    path = one_tensor_file(tmp_path, dtype=dtype)
    with pytest.raises(CheckpointError) as info:
        read_local_header(path)
    message = str(info.value)
    assert path in message
    assert "tensor 'w'" in message
    assert f"unsupported dtype {dtype!r}" in message
    assert "BF16" in message and "F8_E4M3" in message and "F4" in message  # lists what is supported


@pytest.mark.parametrize("shape", [[-1, 4], [2.0, 2], "2x2", None])
def test_corrupt_shape(tmp_path, shape):
    path = one_tensor_file(tmp_path, shape=shape)
    with pytest.raises(CheckpointError, match="corrupt shape") as info:
        read_local_header(path)
    assert path in str(info.value) and "'w'" in str(info.value)


@pytest.mark.parametrize("offsets", [[16, 0], [0], [0, 16, 32], None, [-4, 12], ["0", "16"]])
def test_corrupt_offsets(tmp_path, offsets):
    path = one_tensor_file(tmp_path, data_offsets=offsets)
    with pytest.raises(CheckpointError, match="corrupt data_offsets") as info:
        read_local_header(path)
    assert path in str(info.value)


def test_corrupt_entry(tmp_path):
    path = raw_file(tmp_path / "entry.safetensors", {"w": [1, 2]})
    with pytest.raises(CheckpointError, match="tensor 'w': corrupt header entry"):
        read_local_header(path)


@pytest.mark.parametrize("dtype,shape,offsets,expected", [
    ("F32", [2, 2], [0, 8], 16),
    ("BF16", [3], [0, 8], 6),
    ("F8_E4M3", [4, 4], [0, 15], 16),
    ("I64", [], [0, 4], 8),
    ("F16", [0, 5], [0, 2], 0),
])
def test_byte_count_must_match_dtype_and_shape(tmp_path, dtype, shape, offsets, expected):
    path = one_tensor_file(tmp_path, dtype=dtype, shape=shape, data_offsets=offsets)
    with pytest.raises(CheckpointError) as info:
        read_local_header(path)
    message = str(info.value)
    assert path in message and "tensor 'w'" in message
    assert f"header says {offsets[1] - offsets[0]} bytes but {dtype} {shape} needs {expected}" in message


def test_data_section_shorter_than_header_says(tmp_path):
    path = str(tmp_path / "model.safetensors")
    save_file({"a": torch.arange(100, dtype=torch.float32), "b": torch.ones(50, dtype=torch.float64)}, path)
    full = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(full - 10)
    with pytest.raises(CheckpointError) as info:
        read_local_header(path)
    message = str(info.value)
    assert message.startswith(path)
    assert "file is shorter than its header says" in message
    assert "truncated" in message


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.safetensors")
    with pytest.raises(CheckpointError, match="no such file") as info:
        read_local_header(path)
    assert path in str(info.value)


def test_directory_given_as_file(tmp_path):
    with pytest.raises(CheckpointError, match="is a directory"):
        read_local_header(str(tmp_path))


def test_parse_header_directly():
    head = struct.pack("<Q", 2) + b"{}"
    info = parse_header("mem", head, len(head))
    assert info.tensors == () and info.metadata is None and info.size == 10
    with pytest.raises(CheckpointError, match="mem: not a safetensors file"):
        parse_header("mem", b"\0" * 4, 4)


# -- duplicates across files --------------------------------------------------------------------

def test_same_tensor_in_two_files(tmp_path):
    a = str(tmp_path / "a.safetensors")
    b = str(tmp_path / "b.safetensors")
    save_file({"shared": torch.ones(2), "only_a": torch.ones(1)}, a)
    save_file({"shared": torch.zeros(2)}, b)
    with pytest.raises(CheckpointError) as info:
        build_index([read_header(a), read_header(b)])
    message = str(info.value)
    assert "'shared'" in message
    assert a in message and b in message
    assert "appears in two files" in message


def test_build_index_counts(tmp_path):
    paths = write_whole(str(tmp_path / "w"), every_dtype_state(), num_files=3)
    index = build_index([read_header(p) for p in paths])
    state = every_dtype_state()
    assert index.num_tensors == len(state)
    assert index.nbytes == sum(t.numel() * t.element_size() for t in state.values())
    assert index.signature() == [(p, os.path.getsize(p)) for p in paths]
    assert {t.name for t in index.tensors} == set(state)


def test_duplicate_in_sharded_folder_gives_sharded_hint(tmp_path, single_group):
    folder = str(tmp_path / "sharded")
    write_sharded(folder, world_size=2)
    config = make_load_config("safetensors")
    with pytest.raises(CheckpointError) as info:
        plan_rank(folder, config, single_group)
    message = str(info.value)
    assert "appears in two files" in message
    assert "model-rank-0-part-" in message and "model-rank-1-part-" in message
    assert "looks like a pre-sharded checkpoint" in message
    assert "sharded_state" in message and "runai_streamer_sharded" in message


def test_duplicate_in_plain_folder_has_no_sharded_hint(tmp_path, single_group):
    folder = tmp_path / "plain"
    folder.mkdir()
    save_file({"x": torch.ones(1)}, str(folder / "one.safetensors"))
    save_file({"x": torch.ones(1)}, str(folder / "two.safetensors"))
    with pytest.raises(CheckpointError) as info:
        plan_rank(str(folder), make_load_config("safetensors"), single_group)
    assert "appears in two files" in str(info.value)
    assert "pre-sharded" not in str(info.value)


# -- sources -----------------------------------------------------------------------------------

def test_missing_path(tmp_path):
    missing = str(tmp_path / "does-not-exist")
    with pytest.raises(CheckpointError) as info:
        check_source(missing)
    assert missing in str(info.value)
    assert "no such file or directory" in str(info.value)


def test_missing_path_through_load(tmp_path, monkeypatch):
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    missing = str(tmp_path / "does-not-exist")
    with pytest.raises(CheckpointError, match="no such file or directory"):
        distload.load(missing, "safetensors", device="cpu")


def test_check_source_normalises(tmp_path):
    assert check_source(str(tmp_path) + "/") == str(tmp_path)
    assert check_source("/") == "/"


@pytest.mark.parametrize("source", ["", None, 3])
def test_check_source_needs_a_string(source):
    with pytest.raises(ConfigError, match="source must be a non-empty path, pathlib.Path or URI string"):
        check_source(source)  # type: ignore[arg-type]


@pytest.mark.parametrize("uri, normalised", [
    ("s3://bucket/llama", "s3://bucket/llama"),
    ("gs://bucket/llama/", "gs://bucket/llama"),
    ("az://container/model/sub/", "az://container/model/sub"),
    ("s3://bucket", "s3://bucket"),
])
def test_object_store_uri_normalised_without_a_request(uri, normalised):
    # Parsing only: no server exists for these, and none is asked.
    assert check_source(uri) == normalised


@pytest.mark.parametrize("uri, fragment", [
    ("s3://", "no bucket name"),
    ("az:///model", "no container name"),
    ("gs://bucket/a//b", "empty path segment"),
])
def test_bad_object_store_uri(uri, fragment):
    with pytest.raises(ConfigError) as info:
        check_source(uri)
    assert uri in str(info.value)
    assert fragment in str(info.value)


@pytest.mark.parametrize("uri", ["http://host/model", "hf://meta/llama", "file:///tmp/x"])
def test_unknown_scheme(uri):
    with pytest.raises(ConfigError) as info:
        check_source(uri)
    assert uri in str(info.value)
    assert "unknown URI scheme" in str(info.value)


def test_folder_without_safetensors_lists_what_is_there(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError) as info:
        list_whole_checkpoint(str(tmp_path))
    message = str(info.value)
    assert str(tmp_path) in message
    assert "no .safetensors files" in message
    assert "config.json" in message and "pytorch_model.bin" in message


def test_empty_folder(tmp_path):
    with pytest.raises(CheckpointError, match="it is empty"):
        list_whole_checkpoint(str(tmp_path))


def test_long_listing_is_cut(tmp_path):
    for i in range(20):
        (tmp_path / f"f{i:02d}.txt").write_text("")
    with pytest.raises(CheckpointError) as info:
        list_whole_checkpoint(str(tmp_path))
    assert "and 8 more" in str(info.value)
    assert "f19.txt" not in str(info.value)


def test_listing_a_file_and_a_folder(tmp_path):
    paths = write_whole(str(tmp_path / "w"), every_dtype_state(), num_files=3)
    (tmp_path / "w" / "README.md").write_text("hi")
    os.mkdir(tmp_path / "w" / "sub.safetensors.d")
    assert list_whole_checkpoint(str(tmp_path / "w")) == sorted(paths)
    assert list_whole_checkpoint(paths[1]) == [paths[1]]


def write_index(folder, weight_map) -> str:
    path = os.path.join(folder, INDEX_FILE)
    with open(path, "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return path


def test_index_is_honoured(tmp_path, single_group):
    folder = tmp_path / "indexed"
    folder.mkdir()
    save_file({"a": torch.arange(4.0)}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.arange(3, dtype=torch.int32)}, str(folder / "model-00002-of-00002.safetensors"))
    # A stray file the index does not name: corrupt, so reading it would fail the load.
    (folder / "stray.safetensors").write_text("not a checkpoint at all")
    write_index(str(folder), {"b": "model-00002-of-00002.safetensors", "a": "model-00001-of-00002.safetensors"})

    files = list_whole_checkpoint(str(folder))
    assert files == [str(folder / "model-00001-of-00002.safetensors"),
                     str(folder / "model-00002-of-00002.safetensors")]
    state = distload.load(str(folder), "safetensors", group=single_group)
    assert set(state) == {"a", "b"}
    assert torch.equal(state["a"], torch.arange(4.0))
    assert torch.equal(state["b"], torch.arange(3, dtype=torch.int32))


def test_index_naming_missing_file(tmp_path):
    folder = tmp_path / "indexed"
    folder.mkdir()
    save_file({"a": torch.ones(1)}, str(folder / "model-00001-of-00002.safetensors"))
    index = write_index(str(folder), {"a": "model-00001-of-00002.safetensors",
                                      "b": "model-00002-of-00002.safetensors"})
    with pytest.raises(CheckpointError) as info:
        list_whole_checkpoint(str(folder))
    message = str(info.value)
    assert index in message
    assert "model-00002-of-00002.safetensors" in message
    assert "model-00001-of-00002.safetensors" not in message.split("names files")[1]


@pytest.mark.parametrize("content", [
    "{not json",
    json.dumps({"metadata": {}}),                       # no weight_map
    json.dumps({"weight_map": ["a.safetensors"]}),      # weight_map not an object
    json.dumps([1, 2]),
])
def test_corrupt_index(tmp_path, content):
    folder = tmp_path / "indexed"
    folder.mkdir()
    save_file({"a": torch.ones(1)}, str(folder / "a.safetensors"))
    (folder / INDEX_FILE).write_text(content)
    with pytest.raises(CheckpointError) as info:
        list_whole_checkpoint(str(folder))
    message = str(info.value)
    assert str(folder / INDEX_FILE) in message
    assert "not a valid safetensors index" in message
    assert "weight_map" in message


def test_whole_checkpoint_plan_reads_every_file(tmp_path, single_group):
    state = every_dtype_state()
    folder = str(tmp_path / "w")
    paths = write_whole(folder, state, num_files=3)
    plan = plan_rank(folder, make_load_config("safetensors"), single_group)
    assert [f.path for f in plan.index.files] == sorted(paths)
    assert plan.index.num_tensors == len(plan_read := plain_read(paths)) == len(state)
    assert {t.name for t in plan.index.tensors} == set(plan_read)
    assert all(t.nbytes == math.prod(t.shape) * t.torch_dtype.itemsize for t in plan.index.tensors)


def indexed_folder(tmp_path):
    folder = tmp_path / "indexed"
    folder.mkdir()
    save_file({"a": torch.ones(2), "b": torch.zeros(1)}, str(folder / "one.safetensors"))
    save_file({"c": torch.arange(3)}, str(folder / "two.safetensors"))
    return folder


def test_stale_index_tensor_in_another_file(tmp_path, single_group):
    folder = indexed_folder(tmp_path)
    write_index(str(folder), {"a": "one.safetensors", "b": "two.safetensors", "c": "two.safetensors"})
    with pytest.raises(CheckpointError) as info:
        plan_rank(str(folder), make_load_config("safetensors"), single_group)
    message = str(info.value)
    assert str(folder / INDEX_FILE) in message
    assert "does not match the files' headers (1 tensor(s))" in message
    assert "'b' -> two.safetensors but it is in one.safetensors" in message
    assert "regenerate the index" in message


def test_stale_index_tensor_no_file_has(tmp_path, single_group):
    folder = indexed_folder(tmp_path)
    write_index(str(folder), {"a": "one.safetensors", "b": "one.safetensors", "c": "two.safetensors",
                              "ghost": "two.safetensors"})
    with pytest.raises(CheckpointError, match="'ghost' -> two.safetensors but no file has it"):
        plan_rank(str(folder), make_load_config("safetensors"), single_group)


def test_matching_index_plans(tmp_path, single_group):
    folder = indexed_folder(tmp_path)
    write_index(str(folder), {"a": "one.safetensors", "b": "one.safetensors", "c": "two.safetensors"})
    plan = plan_rank(str(folder), make_load_config("safetensors"), single_group)
    assert sorted(t.name for t in plan.index.tensors) == ["a", "b", "c"]


@pytest.mark.parametrize("weight_map", [{"a": 1}, {"a": "a.safetensors", "b": None}])
def test_index_with_non_string_file_names(tmp_path, weight_map):
    folder = tmp_path / "indexed"
    folder.mkdir()
    save_file({"a": torch.ones(1)}, str(folder / "a.safetensors"))
    write_index(str(folder), weight_map)
    with pytest.raises(CheckpointError, match="not a valid safetensors index"):
        list_whole_checkpoint(str(folder))


def test_fingerprint_of_a_file_gone_since_its_header_was_read_names_it(tmp_path):
    path = str(tmp_path / "a.safetensors")
    save_file({"a": torch.ones(10)}, path)
    info = read_local_header(path)
    assert len(content_fingerprint(info)) == 64
    os.unlink(path)
    with pytest.raises(CheckpointError, match="cannot read it to compare its content across ranks") as caught:
        content_fingerprint(info)
    assert path in str(caught.value)


def test_fingerprint_sees_every_differing_run_longer_than_its_stride(tmp_path):
    """Issue 13, item 8: one 4 KiB sample per 1 MiB of data; a copy that differs in any run of
    more than 1 MiB + 4 KiB fingerprints differently. What it cannot see, and the README says so:
    a difference that lies wholly between two samples."""
    from distload.loading.sources import FINGERPRINT_SAMPLE_BYTES, FINGERPRINT_STRIDE_BYTES, fingerprint_samples

    path = str(tmp_path / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    save_file({"a": torch.randn(1024, 1024, generator=g), "b": torch.randn(2048, 1024, generator=g)}, path)  # 12 MiB
    info = read_local_header(path)
    original = content_fingerprint(info)
    data_start = info.tensors[0].begin
    samples = fingerprint_samples(info)
    assert samples[0] == (0, data_start)  # the header, whole
    assert all(b - a <= FINGERPRINT_STRIDE_BYTES for (a, _), (b, _) in zip(samples[1:], samples[2:]))
    run = FINGERPRINT_STRIDE_BYTES + FINGERPRINT_SAMPLE_BYTES
    with open(path, "rb") as f:
        pristine = f.read()
    for start in (data_start, data_start + 12345, info.size // 4 + 777, info.size - run):
        with open(path, "r+b") as f:
            f.seek(start)
            f.write(bytes(b ^ 0xFF for b in pristine[start:start + run]))
        assert content_fingerprint(info) != original, start
        with open(path, "wb") as f:
            f.write(pristine)
    # the residual risk, exactly: 100 bytes between two samples go unseen
    gap_start = samples[5][0] + FINGERPRINT_SAMPLE_BYTES + 10
    with open(path, "r+b") as f:
        f.seek(gap_start)
        f.write(b"\0" * 100)
    assert content_fingerprint(info) == original
