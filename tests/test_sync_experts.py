"""Expert parallelism in weight sync (issue 46, item 2): an inference rank loaded with
``distload.load(..., expert_parallel_size=2)`` receives into that dict, from trainer ranks that
hold its experts, only its experts' bytes (other experts absent, stacked experts' rows cut); the
next update is a delta; a BF16 push into FP8 targets is quantized by the trainer (refit) at EP 2.
Real processes (tests/ep_sync_driver.py); the expected tensors are made here, by plain slicing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from dist_helpers import clean_env, free_port, rank_env

from distload.errors import ConfigError
from distload.live import pairing, refit
from distload.live.channel import SyncChannel
from distload.live.rendezvous import SessionRecord
from distload.live.transfer import BucketLayout, SyncTensor, kept_slice
from distload.tp.place import TPPlace

import ep_sync_driver as driver
from test_sync_refit import reference as quantize_reference

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ep_sync_driver.py")


def _expert(e: int) -> SyncTensor:
    return SyncTensor(f"model.layers.0.mlp.experts.{e}.down_proj.weight", "BF16", (8, 4), 64)


def _ep_record(placement: str = "linear") -> SessionRecord:
    """Two trainer ranks, four inference ranks at EP 2 (TP 1: rank r is EP rank r % 2), as their
    hellos say it (pairing.with_experts, expert_info: what SyncChannel posts)."""
    infos = {}
    for r in range(4):
        place = pairing.with_experts(TPPlace(), "inference", r, 4, 2, placement,
                                     lambda: {"n_routed_experts": 4})
        infos[f"inference/{r}"] = {"tp_size": 1, "spec": None, "experts": pairing.expert_info(place)}
    return SessionRecord("s", 2, 4, {}, infos)


@pytest.mark.parametrize("placement,of_rank_1", [("linear", (2, 3)), ("round_robin", (1, 3))])
def test_an_ep_receiver_pairs_only_with_trainer_ranks_that_hold_its_experts(placement, of_rank_1):
    """Trainer rank 0 holds EP rank 0's experts, trainer rank 1 EP rank 1's: each pairs with the
    receivers of its EP rank only (both replicas), and a stacked tensor goes to both, cut by rows."""
    record = _ep_record(placement)
    mine = [e for e in range(4) if e not in of_rank_1]
    first, second = [_expert(e) for e in mine], [_expert(e) for e in of_rank_1]
    # session ranks: trainers 0, 1; inference ranks 0..3 are 2..5; EP rank 0: inference 0, 2
    assert pairing.receivers(first, record) == [2, 4] and pairing.receivers(second, record) == [3, 5]
    keys = {key: ranks for key, (_, ranks) in pairing.places(record).items()}
    assert sorted(keys.values()) == [[2, 4], [3, 5]]
    assert sorted(pairing.senders({0: first, 1: second}, record).values()) == [[0], [1]]
    stacked = SyncTensor("model.layers.1.mlp.experts.w13_weight", "BF16", (4, 6, 8), 4 * 6 * 8 * 2)
    ep1 = pairing.info_place(record.infos["inference/1"], 1)
    piece = kept_slice(ep1, 0, stacked)
    assert piece.shape == (2, 6, 8) and piece.nbytes == stacked.nbytes // 2
    assert not kept_slice(ep1, 0, _expert(mine[0])).kept


def test_ep_receivers_claiming_different_experts_for_refit_is_no_conflict():
    """Each EP rank holds its own experts as FP8: the trainer rank quantizes them all (the union);
    a receiver that keeps one of them as sent (BF16) is a conflict, named."""
    meta = {"entries": [_expert(e) for e in range(4)]}
    kept = {2: {0, 1}, 3: {2, 3}}
    union, problems = refit.conflicts({2: {0: [0, 1]}, 3: {0: [2, 3]}}, {0: meta}, str, lambda r, t: kept[r])
    assert union == {0: [0, 1, 2, 3]} and problems == []
    kept[3] = {1, 2, 3}  # it keeps expert 1 too, as sent (BF16), which rank 2 holds as FP8
    _, problems = refit.conflicts({2: {0: [0, 1]}, 3: {0: [2, 3]}}, {0: meta}, str, lambda r, t: kept[r])
    assert problems == [f"{_expert(1).name}: 2 holds it as float8_e4m3fn (BF16 -> FP8 refit), 3 as sent (BF16); "
                        f"a trainer rank sends a tensor in one dtype to all its receivers"]


@pytest.mark.parametrize("kwargs,words", [
    ({"expert_parallel_size": 2}, ["expert_parallel_size=2", "model_config=", "n_routed_experts"]),
    ({"expert_parallel_size": 3, "model_config": {"n_routed_experts": 4}}, ["does not divide", "4 routed experts"]),
    ({"expert_parallel_size": 2, "model_config": {"n_routed_experts": 4}, "keeps": lambda entries: {}},
     ["keeps=", "expert_parallel_size", "one or the other"]),
    ({"expert_parallel_size": 2, "role": "trainer"}, ["a trainer sends whole tensors"]),
    ({"expert_placement_strategy": "round_robin"}, ["give --expert-parallel-size too"]),
    ({"expert_parallel_size": 2, "expert_placement_strategy": "nearest", "model_config": {"n_routed_experts": 4}},
     ["'nearest' is not one of linear, round_robin"]),
])
def test_an_ep_channel_that_cannot_work_is_refused_in_one_line_before_it_joins(kwargs, words):
    args = {"role": "inference", "rank": 0, "size": 6 if kwargs.get("expert_parallel_size") == 3 else 4, **kwargs}
    with pytest.raises(ConfigError) as err:
        SyncChannel("tcp://127.0.0.1:1", **args)
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


def _run(tmp_path, trainers: int, receivers: int = 2, timeout: float = 120, tp: int = 1) -> dict[str, dict]:
    """Trainer ranks and inference ranks (with torchrun's environment, one group) as processes."""
    address = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    ckpt = str(tmp_path / "ckpt")
    procs = []
    for rank in range(trainers):
        procs.append(subprocess.Popen([sys.executable, DRIVER, "trainer", str(rank), str(trainers), ckpt, address,
                                       str(tmp_path)], env=clean_env(), stdout=subprocess.DEVNULL,
                                      stderr=open(tmp_path / f"trainer{rank}.log", "w")))
    for rank in range(receivers):
        env = rank_env(clean_env(), rank, receivers, port)
        procs.append(subprocess.Popen([sys.executable, DRIVER, "inference", str(tp), "-", ckpt, address, str(tmp_path)],
                                      env=env, stdout=subprocess.DEVNULL,
                                      stderr=open(tmp_path / f"inference{rank}.log", "w")))
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    out = {}
    for role, size in (("trainer", trainers), ("inference", receivers)):
        for rank in range(size):
            path = tmp_path / f"{role}{rank}.json"
            log = (tmp_path / f"{role}{rank}.log").read_text()
            assert path.exists(), f"{role} {rank} wrote nothing: {log[-3000:]}"
            result = json.loads(path.read_text())
            assert "crash" not in result, f"{role} {rank}: {result['crash']}"
            out[f"{role}{rank}"] = result
    return out


def expected(rank: int, version: int, fp8: bool) -> dict[str, torch.Tensor]:
    """What EP rank ``rank`` of 2 holds after ``version``: its experts (linear: 0-1, 2-3), their
    rows of the stacked tensor, everything else whole; FP8 projections quantized by the formula."""
    mine = range(rank * 2, rank * 2 + 2)
    out = {}
    for name, tensor in driver.pushed(version).items():
        if ".experts." in name and not name.endswith("w13_weight"):
            if int(name.split(".experts.")[1].split(".")[0]) not in mine:
                continue
        if name.endswith("w13_weight"):
            tensor = tensor[mine.start:mine.stop]
        if fp8 and driver.quantized(name):
            out[name], out[name + "_scale_inv"] = quantize_reference(tensor)
        else:
            out[name] = tensor
    return out


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _check(tmp_path, results: dict, receivers: int, fp8: bool) -> None:
    for rank in range(receivers):
        stats = results[f"inference{rank}"]["stats"]
        want = expected(rank, 1, fp8)
        assert results[f"inference{rank}"]["loaded"] == sorted(want)  # other experts absent
        for version in (1, 2):
            got = load_file(str(tmp_path / f"inference{rank}-v{version}.safetensors"))
            want = expected(rank, version, fp8)
            assert sorted(got) == sorted(want)
            for name in want:
                assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
                assert torch.equal(_bits(got[name]), _bits(want[name])), (rank, version, name)
        kept = sum(t.numel() * t.element_size() for t in want.values())
        # only its experts' bytes (and the rest it keeps): alignment and checksums only on top
        assert stats[0]["nbytes"] == kept and stats[0]["wire_bytes"] <= 1.05 * kept, (stats[0], kept)
        assert stats[0]["verified"] and not stats[0]["delta"]
        assert stats[1]["delta"] and stats[1]["verified"] and stats[1]["wire_bytes"] < kept / 4, stats[1]


def test_ep2_receivers_take_only_their_experts_from_one_trainer_then_a_delta(tmp_path):
    driver.write_checkpoint(str(tmp_path / "ckpt"), "bf16")
    results = _run(tmp_path, trainers=1)
    _check(tmp_path, results, 2, fp8=False)
    assert results["trainer0"]["stats"][1]["delta"]


@pytest.mark.slow  # four processes, two refit updates: 6 s alone on the 2-core VM, 30-40 s at load average 15
def test_ep2_refit_from_two_trainers_lands_as_the_formula_then_a_delta_of_fp8(tmp_path):
    """Each trainer rank quantizes what any receiver holds as FP8 (EP ranks claim different
    experts: not a conflict); a receiver keeps its own; the next update is a delta of the FP8 bytes."""
    driver.write_checkpoint(str(tmp_path / "ckpt"), "fp8")
    results = _run(tmp_path, trainers=2)
    _check(tmp_path, results, 2, fp8=True)
    assert all(results[f"trainer{t}"]["stats"][1]["delta"] for t in range(2))


def test_tp2_x_ep2_receivers_keep_their_tp_slice_of_their_experts_as_loads_rank_them():
    """Inference rank 3 of 4 at TP 2 x EP 2 is TP rank 1, EP rank 1 (loads' mapping): it keeps
    the second half of the rows of experts 2 and 3's gate_proj, nothing of experts 0 and 1, and
    of a stacked w13 its experts' rows, each its TP slice of gate and of up (the decoder spec
    splits vLLM's stacks as its FusedMoE does)."""
    from distload.tp.spec import load_spec

    spec = load_spec("decoder")
    place = pairing.with_experts(TPPlace(2, 3 % 2, spec), "inference", 3, 4, 2, None, lambda: {"num_experts": 4})
    assert (place.rank, place.experts.rank, place.experts.experts(4)) == (1, 1, (2, 3))
    gate = [SyncTensor(f"model.layers.0.mlp.experts.{e}.gate_proj.weight", "BF16", (128, 256), 128 * 256 * 2)
            for e in range(4)]
    pieces = [kept_slice(place, e, entry) for e, entry in enumerate(gate)]
    assert [p.kept for p in pieces] == [False, False, True, True]
    assert pieces[3].shape == (64, 256) and pieces[3].run == (64 * 256 * 2, 128 * 256 * 2)
    stacked = SyncTensor("model.layers.1.mlp.experts.w13_weight", "BF16", (4, 8, 8), 4 * 8 * 8 * 2)
    piece = kept_slice(place, 0, stacked)
    assert piece.kept and piece.shape == (2, 4, 8)
    assert piece.action.rows == ((2, 4),) and piece.action.rule == "*.experts.w13_weight"


def test_tp2_x_ep2_receivers_of_stacks_a_spec_splits_take_their_tp_slice_of_their_experts_and_its_changes():
    """A spec that splits stacked experts (vLLM's w13 as [gate; up], each by rows; w2 by columns)
    at TP 2 x EP 2, round robin: each receiver's piece, its packed bytes and its part of a delta
    are its TP slice of its own experts' rows, the FP8 block scales beside them cut on their blocks
    (config.json's 2-d weight_block_size, an expert a row)."""
    from distload.live import delta as deltas
    from distload.live.transfer import group_entries, layouts, pack
    from distload.tp.spec import spec_from_json

    config = {"num_experts": 4, "quantization_config": {"weight_block_size": [4, 4]}}
    spec = spec_from_json({"rules": [{"match": "*.experts.w13_weight", "split": 1, "fused": 2},
                                     {"match": "*.experts.w2_weight", "split": 2}]}, config)
    shapes = {"model.layers.1.mlp.experts.w13_weight": (4, 16, 8),
              "model.layers.1.mlp.experts.w13_weight_scale_inv": (4, 4, 2),
              "model.layers.1.mlp.experts.w2_weight": (4, 8, 8),
              "model.layers.1.mlp.experts.w2_weight_scale_inv": (4, 2, 2)}
    gen = torch.Generator().manual_seed(0)
    olds = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    news = {name: t.clone() for name, t in olds.items()}
    for t in news.values():
        t.view(-1)[::7] += 1  # a few changes in every expert and slice
    entries = [SyncTensor(name, "F32", shape, olds[name].numel() * 4) for name, shape in shapes.items()]
    for rank in range(4):
        place = pairing.with_experts(TPPlace(2, rank % 2, spec), "inference", rank, 4, 2, "round_robin", lambda: config)
        mine, tp_rank = [rank // 2, rank // 2 + 2], rank % 2  # round robin: EP rank e holds experts e, e + 2

        def cut(name: str, t: torch.Tensor) -> torch.Tensor:
            if ".w13_" in name:
                return torch.cat([half.chunk(2, 1)[tp_rank] for half in t[mine].chunk(2, 1)], 1)
            return t[mine].chunk(2, 2)[tp_rank].contiguous()

        pieces = [piece for layout in layouts(entries, group_entries(entries, 1 << 20), place, False)
                  for piece, _ in layout.items]
        assert len(pieces) == 4
        for piece in pieces:
            name = entries[piece.entry].name
            want_old, want_new = cut(name, olds[name]), cut(name, news[name])
            assert piece.shape == tuple(want_new.shape) and piece.nbytes == want_new.numel() * 4, (rank, name)
            buffer = torch.empty(piece.nbytes, dtype=torch.uint8)
            pack(buffer, BucketLayout(((piece, 0),), piece.nbytes), {piece.entry: news[name]}, place)
            assert torch.equal(buffer.view(torch.float32).view(piece.shape), want_new), (rank, name)
            part = deltas.piece_patch(deltas.diff(news[name], olds[name]), shapes[name], name, piece.action, place,
                                      piece.shape)
            want = deltas.diff(want_new, want_old)
            assert torch.equal(part.positions, want.positions) and torch.equal(part.flips, want.flips), (rank, name)


@pytest.mark.slow  # five processes on two cores
def test_tp2_x_ep2_receivers_hold_what_a_load_at_tp2_x_ep2_holds_after_each_update(tmp_path):
    """Four inference ranks at TP 2 x EP 2, loaded by ``distload.load`` at those sizes, receive
    from one trainer: after each version each rank holds, bit for bit, what a load of that version
    at TP 2 x EP 2 gives the same rank (its TP slice of its own experts, tests/test_expert_parallel.py
    checks those loads against slicing), and takes no more than 1.05x those bytes off the wire; the
    second version is a delta."""
    from conftest import write_whole

    driver.write_checkpoint(str(tmp_path / "ckpt"), "bf16")
    for version in (1, 2):
        write_whole(str(tmp_path / f"v{version}"), driver.pushed(version), num_files=2)
        (tmp_path / f"v{version}" / "config.json").write_text(json.dumps(driver.CONFIG))
    results = _run(tmp_path, trainers=1, receivers=4, tp=2)
    whole = sum(t.numel() * t.element_size() for t in driver.pushed(1).values())
    for rank in range(4):
        stats = results[f"inference{rank}"]["stats"]
        for version in (1, 2):
            got = load_file(str(tmp_path / f"inference{rank}-v{version}.safetensors"))
            want = load_file(str(tmp_path / f"inference{rank}-v{version}-load.safetensors"))
            assert sorted(got) == sorted(want) == results[f"inference{rank}"]["loaded"]
            for name in want:
                assert got[name].shape == want[name].shape, (rank, name)
                assert torch.equal(_bits(got[name]), _bits(want[name])), (rank, version, name)
        kept = sum(t.numel() * t.element_size() for t in want.values())
        assert kept < 0.4 * whole  # a quarter of the experts' bytes, half of the rest, roughly
        assert stats[0]["nbytes"] == kept and stats[0]["wire_bytes"] <= 1.05 * kept, (rank, stats[0], kept)
        assert stats[0]["verified"] and not stats[0]["delta"]
        assert stats[1]["delta"] and stats[1]["verified"], (rank, stats[1])
