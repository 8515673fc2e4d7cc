"""Unit tests for distload/report.py: the digest recipe and the JSON report."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys

import pytest
import torch

from distload.loading.report import LoadReport, Progress, RankReport, gib_per_s, state_digest

from conftest import every_dtype_state

CODES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32",
    torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
    torch.float64: "F64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def reference_digest(state: dict[str, torch.Tensor]) -> str:
    """The documented recipe, written independently of distload."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        shape = ",".join(str(d) for d in t.shape)
        h.update(f"{name}|{CODES[t.dtype]}|{shape}|".encode())
        flat = t.reshape(-1).contiguous()
        if flat.numel():
            h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_digest_follows_the_recipe_for_every_dtype():
    state = every_dtype_state(seed=7)
    assert any(t.dim() == 0 for t in state.values())
    assert any(t.numel() == 0 for t in state.values())
    assert state_digest(state) == reference_digest(state)


def test_digest_hand_checked_small_state():
    state = {"b": torch.tensor([1, 2], dtype=torch.int8), "a": torch.tensor(1.0, dtype=torch.bfloat16),
             "e": torch.zeros(0, 3, dtype=torch.float8_e4m3fn)}
    h = hashlib.sha256()
    h.update(b"a|BF16||" + bytes([0x80, 0x3F]))        # bf16 1.0 = 0x3F80, little-endian
    h.update(b"b|I8|2|" + bytes([1, 2]))
    h.update(b"e|F8_E4M3|0,3|")
    assert state_digest(state) == h.hexdigest()


def test_digest_of_empty_state():
    assert state_digest({}) == hashlib.sha256().hexdigest()


def test_digest_ignores_insertion_order_and_layout():
    state = every_dtype_state(seed=1)
    reordered = {name: state[name] for name in reversed(list(state))}
    assert state_digest(reordered) == state_digest(state)
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert state_digest({"x": base.t().contiguous()}) == state_digest({"x": base.t()})


def test_digest_changes_with_one_byte():
    state = every_dtype_state(seed=2)
    reference = state_digest(state)
    for name, tensor in state.items():
        if tensor.numel() == 0:
            continue
        changed = dict(state)
        raw = tensor.reshape(-1).contiguous().view(torch.uint8).clone()
        raw[-1] = 1 - raw[-1] if tensor.dtype == torch.bool else raw[-1] ^ 1
        changed[name] = raw.view(tensor.dtype).reshape(tensor.shape)
        assert state_digest(changed) != reference, name


def test_digest_changes_with_name_shape_dtype():
    state = {"w": torch.arange(6, dtype=torch.int16).reshape(2, 3), "s": torch.tensor(0.5)}
    reference = state_digest(state)
    assert state_digest({"W": state["w"], "s": state["s"]}) != reference
    assert state_digest({"w": state["w"].reshape(3, 2), "s": state["s"]}) != reference
    assert state_digest({"w": state["w"].reshape(6), "s": state["s"]}) != reference
    # Same bytes, other dtype.
    assert state_digest({"w": state["w"].view(torch.float16), "s": state["s"]}) != reference
    assert state_digest({"w": state["w"], "s": state["s"].reshape(1)}) != reference
    # Empty tensors differ by shape and dtype only.
    assert state_digest({"e": torch.zeros(0, 2)}) != state_digest({"e": torch.zeros(2, 0)})
    assert state_digest({"e": torch.zeros(0, dtype=torch.bfloat16)}) != state_digest({"e": torch.zeros(0)})


def test_bf16_and_fp8_digest_matches_reference():
    g = torch.Generator().manual_seed(0)
    state = {"bf": torch.randn(5, 3, generator=g).bfloat16(),
             "e4": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
             "e5": torch.randn(4, generator=g).to(torch.float8_e5m2)}
    assert state_digest(state) == reference_digest(state)


# -- LoadReport ------------------------------------------------------------------------------

RANK_KEYS = {"rank", "local_rank", "device", "path", "files", "num_tensors", "nbytes", "seconds",
             "gib_per_s", "digest"}


def make_report() -> LoadReport:
    ranks = [
        RankReport(rank=0, local_rank=0, device="cpu", path="runai", files=["/c/a.safetensors"],
                   num_tensors=3, nbytes=2 * 1024**3, seconds=2.0, gib_per_s=1.0, digest="ab" * 32,
                   hostname="node1"),
        RankReport(rank=1, local_rank=1, device="cpu", path="runai", files=["/c/a.safetensors"],
                   num_tensors=3, nbytes=2 * 1024**3, seconds=4.0, gib_per_s=0.5, digest=None,
                   hostname="node1"),
    ]
    return LoadReport(world_size=2, load_format="runai_streamer", source="/c", ranks=ranks)


def test_to_json_keys():
    data = make_report().to_json()
    assert set(data) == {"world_size", "load_format", "source", "ranks", "total"}
    assert data["world_size"] == 2
    assert data["load_format"] == "runai_streamer"
    assert data["source"] == "/c"
    assert len(data["ranks"]) == 2
    for entry in data["ranks"]:
        assert RANK_KEYS <= set(entry)
        assert set(entry) - RANK_KEYS <= {"hostname", "read_bytes", "peak_rss_bytes", "huge_page_marked_bytes",
                                          "requested_bytes", "tensor_parallel", "expert_parallel", "prefaulted_bytes",
                                          "reader_bytes", "received_bytes", "cache_bytes", "store_bytes",
                                          "corrupt_blocks", "cache_received_bytes", "server_bytes"}
    assert data["ranks"][0]["digest"] == "ab" * 32
    assert data["ranks"][1]["digest"] is None
    assert data["ranks"][1]["rank"] == 1
    json.dumps(data)  # serialisable


def test_total_uses_the_slowest_rank():
    total = make_report().to_json()["total"]
    assert total["seconds"] == 4.0
    assert total["nbytes"] == 4 * 1024**3
    assert total["gib_per_s"] == 1.0  # 4 GiB over the slowest rank's 4 s


def test_total_of_no_ranks():
    assert LoadReport(1, "auto", "/c").total == {"nbytes": 0, "seconds": 0.0, "gib_per_s": 0.0}


def test_gib_per_s():
    assert gib_per_s(3 * 1024**3, 2.0) == 1.5
    assert gib_per_s(1024**3, 0.0) == 0.0


def test_write_is_atomic_and_leaves_no_temp_file(tmp_path):
    report = make_report()
    path = tmp_path / "out" / "report.json"
    report.write(str(path))
    assert os.listdir(tmp_path / "out") == ["report.json"]
    with open(path) as f:
        assert json.load(f) == json.loads(json.dumps(report.to_json()))
    # Overwrite in place: still one file.
    report.ranks[0].seconds = 9.0
    report.write(str(path))
    assert os.listdir(tmp_path / "out") == ["report.json"]
    with open(path) as f:
        assert json.load(f)["total"]["seconds"] == 9.0


def test_failed_write_keeps_the_old_report_and_no_temp_file(tmp_path):
    path = tmp_path / "report.json"
    path.write_text('{"old": true}\n')
    report = make_report()
    report.ranks[0].digest = object()  # not JSON serialisable: json.dump fails midway
    with pytest.raises(TypeError):
        report.write(str(path))
    assert os.listdir(tmp_path) == ["report.json"]
    assert json.loads(path.read_text()) == {"old": True}


def test_summary_lines():
    lines = make_report().summary_lines()
    assert lines[0] == "distload: runai_streamer from /c on 2 rank(s)"
    assert "rank 0 (cpu, runai)" in lines[1] and "digest " + "ab" * 8 in lines[1]
    assert "digest -" in lines[2]
    assert "slowest rank 4.00 s" in lines[-1]
    assert "2.000 GiB in 2.00 s = 1.00 GiB/s" in lines[1] and lines[-1].endswith(", 1.00 GiB/s")


def _fields(line: str) -> list[str]:
    """A rank line's field names, its numbers taken out."""
    return re.sub(r"digest \S+|(?<![\w/])(\d[\d.]*(?: GiB)?|-)(?!\w)", "#", line).split()


def test_every_rank_line_has_the_same_fields():
    report = make_report()
    report.ranks[0].requested_bytes = 2 * 1024**3  # rank 0 counted what it asked for, rank 1 could not
    report.ranks[1].received_bytes = 1024**3
    report.ranks[0].reader_bytes = {"pread/page-cache": 1024**3, "pread/storage": 1024**3}
    _, rank0, rank1, _ = report.summary_lines()
    assert _fields(rank0) == _fields(rank1), (rank0, rank1)
    assert "requested 2.000 GiB" in rank0 and "requested -" in rank1
    assert "received 0.000 GiB from other ranks" in rank0 and "received 1.000 GiB from other ranks" in rank1
    assert "(pread/page-cache 1.000 GiB, pread/storage 1.000 GiB)" in rank0
    assert "(pread/page-cache -, pread/storage -)" in rank1


def test_a_tiny_load_prints_no_rate():
    report = make_report()
    for r in report.ranks:
        r.nbytes, r.seconds = 3 * 1024**2, 0.2  # 3 MiB: the time is the load's fixed costs
    lines = report.summary_lines()
    assert not any("GiB/s" in line for line in lines), lines
    assert "no rate: under 64 MiB or 0.05 s a rank is mostly fixed costs" in lines[-1]
    assert report.to_json()["ranks"][0]["gib_per_s"] == 1.0  # the JSON keeps every number


def test_the_progress_bar_counts_gib(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    bar = Progress(3 * 1024**3, enabled=True)
    bar.update(1024**3)
    bar.close()
    shown = terminal.getvalue()
    assert "1.00/3.00 GiB" in shown and "GiB/s" in shown
    assert "GB" not in shown.replace("GiB", "")
