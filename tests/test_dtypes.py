"""Every dtype safetensors knows, on every path: MXFP8 scales (F8_E8M0), FP4 (F4, two values a
byte: the header counts 4-bit values, torch holds float4_e2m1fn_x2 pairs) and the FNUZ fp8s.

torch.equal is not implemented for these dtypes, so every comparison here is of raw bytes."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

import distload
from distload.loading import index as index_module
from distload.loading.index import DTYPES, parse_header
from distload.tp.spec import spec_from_json
from distload.tp.slices import take_shard

from conftest import plain_digest, read_report, run_distload

NEW_CODES = {"F8_E8M0": torch.float8_e8m0fnu, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
             "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "F4": torch.float4_e2m1fn_x2}
FNUZ = ("fnuz_e4m3", "fnuz_e5m2")  # Run:ai 0.17 cannot stream these


def new_dtype_state(seed: int = 0, fnuz: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {
        "scales": (torch.rand(8, 6, generator=g) * 4 + 0.01).to(torch.float8_e8m0fnu),
        "scale0d": torch.tensor(0.5).to(torch.float8_e8m0fnu),
        "fp4": torch.randint(0, 256, (8, 6), generator=g, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
        "fp4_rows": torch.randint(0, 256, (5, 3), generator=g, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
        "fp4_empty": torch.zeros(0, 4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
        "weight": torch.randn(8, 6, generator=g).to(torch.bfloat16),
    }
    if fnuz:
        state["fnuz_e4m3"] = torch.randn(8, 6, generator=g).to(torch.float8_e4m3fnuz)
        state["fnuz_e5m2"] = torch.randn(4, 2, generator=g).to(torch.float8_e5m2fnuz)
    return state


def raw(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and tuple(got[name].shape) == tuple(tensor.shape), name
        assert raw(got[name]) == raw(tensor), name


def header_of(path: str) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_every_safetensors_dtype_is_known_to_this_torch():
    assert set(NEW_CODES) <= set(DTYPES)
    assert all(DTYPES[code] == dtype for code, dtype in NEW_CODES.items())


@pytest.mark.parametrize("fmt", ["safetensors", "auto", "runai_streamer"])
def test_whole_checkpoint_loads_bit_for_bit(tmp_path, fmt):
    state = new_dtype_state(fnuz=fmt != "runai_streamer")
    save_file(state, str(tmp_path / "model.safetensors"))
    assert header_of(str(tmp_path / "model.safetensors"))["fp4"]["shape"] == [8, 12]  # 4-bit values
    want = load_file(str(tmp_path / "model.safetensors"))
    assert_same(distload.load(str(tmp_path), fmt, device="cpu"), want)


@pytest.mark.parametrize("fmt", ["sharded_state", "runai_streamer_sharded", "auto"])
def test_pre_sharded_checkpoint_loads_bit_for_bit(tmp_path, fmt):
    state = new_dtype_state(fnuz=fmt != "runai_streamer_sharded")
    names = sorted(state)
    for part in range(2):
        save_file({n: state[n] for n in names[part::2]}, str(tmp_path / f"model-rank-0-part-{part}.safetensors"))
    assert_same(distload.load(str(tmp_path), fmt, device="cpu"), state)


def test_dummy_gives_every_dtype_its_header_shape(tmp_path):
    state = new_dtype_state()
    save_file(state, str(tmp_path / "model.safetensors"))
    dummy = distload.load(str(tmp_path), "dummy", device="cpu")
    assert {n: (t.dtype, tuple(t.shape)) for n, t in dummy.items()} == {
        n: (t.dtype, tuple(t.shape)) for n, t in state.items()}
    again = distload.load(str(tmp_path), "dummy", device="cpu")
    assert_same(again, dummy)  # seeded by name: the same on every rank and every run


def test_run_ai_refuses_fnuz_while_planning_and_says_what_reads_it(tmp_path):
    save_file(new_dtype_state(), str(tmp_path / "model.safetensors"))
    with pytest.raises(distload.BackendUnavailableError) as info:
        distload.load(str(tmp_path), "runai_streamer", device="cpu")
    message = str(info.value)
    assert "fnuz_e4m3" in message and "F8_E4M3FNUZ" in message and "--load-format safetensors" in message


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("fmt", ["safetensors", "auto"])
def test_two_ranks_load_every_dtype(tmp_path, fmt):
    save_file(new_dtype_state(), str(tmp_path / "model.safetensors"))
    report_path = str(tmp_path / "report.json")
    result = run_distload(["load", str(tmp_path), "--load-format", fmt, "--report-json", report_path,
                           "--no-progress"], nproc=2)
    assert result.returncode == 0, result.stderr[-2000:]
    want = plain_digest([str(tmp_path / "model.safetensors")])
    assert [r["digest"] for r in read_report(report_path)["ranks"]] == [want, want]


def test_reshard_splits_every_dtype_by_torch_shape(tmp_path):
    """Split along dim 0 and along the packed last dim: each rank gets take_shard of a plain
    read, and each shard's header counts FP4 in 4-bit values again."""
    state = new_dtype_state()
    os.makedirs(tmp_path / "whole")
    save_file(state, str(tmp_path / "whole" / "model.safetensors"))
    spec_json = {"rules": [{"match": "fp4", "split": 1}, {"match": "fp4_rows", "split": 1},
                           {"match": "scales", "split": 0}, {"match": "fnuz_e4m3", "split": 0},
                           {"match": "*", "replicate": True}]}
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec_json))
    # The file's shape (values), not torch's (pairs): 6 values a row, 3 a rank would cut a pair.
    with pytest.raises(distload.ConfigError, match="'fp4_rows' with shape \\[5, 6\\] \\(in the file; torch holds it as "
                       "\\[5, 3\\].* cannot be split over 2 ranks: dim 1 \\(6 values, 3 elements\\) would be cut between"):
        distload.reshard(str(tmp_path / "whole"), str(tmp_path / "bad"), 2, sharding=str(spec_file))
    spec_json["rules"].pop(1)
    spec_file.write_text(json.dumps(spec_json))
    distload.reshard(str(tmp_path / "whole"), str(tmp_path / "tp2"), 2, sharding=str(spec_file))
    spec = spec_from_json(spec_json)
    for rank in range(2):
        paths = distload.detect_layout(str(tmp_path / "tp2")).rank_paths(rank, 2)
        got = {}
        for path in paths:
            got.update(load_file(path))
            header = header_of(path)
            if "fp4" in header:
                assert header["fp4"]["shape"] == [8, 6]  # 3 pairs a row on each rank, 6 values
        want = {n: take_shard(t, spec.action(n, t.shape), rank, 2) for n, t in state.items()}
        assert_same(got, want)


def test_save_sharded_round_trips_every_dtype(tmp_path):
    state = new_dtype_state()
    manifest = distload.save_sharded(state, str(tmp_path / "out"))
    assert manifest.world_size == 1
    assert_same(distload.load(str(tmp_path / "out"), "sharded_state", device="cpu"), state)
    assert distload.verify(str(tmp_path / "out"))[1] == []


def test_digest_and_inspect_count_fp4_bytes(tmp_path):
    state = new_dtype_state()
    save_file(state, str(tmp_path / "model.safetensors"))
    info = distload.inspect(str(tmp_path))
    assert info["dtypes"]["F4"] == {"num_tensors": 3, "nbytes": 8 * 6 + 5 * 3}
    assert distload.state_digest(distload.load(str(tmp_path), "auto", device="cpu")) == distload.state_digest(
        load_file(str(tmp_path / "model.safetensors")))


def _header_bytes(entries: dict) -> bytes:
    body = json.dumps(entries).encode()
    return struct.pack("<Q", len(body)) + body


def test_an_fp4_header_with_an_odd_last_dimension_is_refused():
    head = _header_bytes({"x": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}})
    with pytest.raises(distload.CheckpointError, match=r"tensor 'x': a F4 tensor packs 2 values a byte"):
        parse_header("/ckpt/x.safetensors", head + b"\0" * 3, len(head) + 3)


def test_a_dtype_this_torch_lacks_says_so(monkeypatch):
    monkeypatch.delitem(index_module.DTYPES, "F4")
    head = _header_bytes({"x": {"dtype": "F4", "shape": [2, 2], "data_offsets": [0, 2]}})
    with pytest.raises(distload.CheckpointError, match=r"dtype F4 needs torch.float4_e2m1fn_x2, which this torch"):
        parse_header("/ckpt/x.safetensors", head + b"\0" * 2, len(head) + 2)
    head = _header_bytes({"x": {"dtype": "F2", "shape": [1], "data_offsets": [0, 1]}})
    with pytest.raises(distload.CheckpointError, match="unsupported dtype 'F2'; safetensors knows: BOOL"):
        parse_header("/ckpt/x.safetensors", head + b"\0", len(head) + 1)
