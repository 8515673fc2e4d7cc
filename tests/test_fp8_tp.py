"""FP8 block-scaled checkpoints under tensor parallelism (issue 46, item 3: loads and reshard).

A DeepSeek-V3 / Qwen3-FP8 style checkpoint holds ``X.weight`` as float8_e4m3fn with
``X.weight_scale_inv`` (float32, one scale per 128x128 block) beside it. A split weight carries its
scales: column-parallel weights cut their scale rows, row-parallel weights their scale columns, on
block boundaries. The reference for every rank is the independent one: read the whole checkpoint,
``chunk`` the weight and ``chunk`` its scale (an even split, as the TP sizes here are aligned).
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

import distload
from distload.errors import ConfigError
from distload.loading.report import state_digest
from distload.tp.slices import rank_slice, take_shard
from distload.tp.spec import carry_block_scales, load_spec
from distload.workers.group import WorkerGroup

from conftest import plain_read, read_report, run_distload, write_whole

BLOCK = 128
HEADS, KV, HEAD_DIM, HIDDEN, VOCAB = 4, 2, 128, 256, 256
FP8 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split on dim 0; the rest on dim 1


def config(inter: int, block_size: bool = True) -> dict:
    out = {"architectures": ["Qwen3ForCausalLM"], "num_attention_heads": HEADS, "num_key_value_heads": KV,
           "head_dim": HEAD_DIM, "hidden_size": HIDDEN, "intermediate_size": inter, "vocab_size": VOCAB,
           "num_hidden_layers": 2}
    if block_size:
        out["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [BLOCK, BLOCK]}
    return out


def fp8_state(inter: int = 512, layers: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """A 2-layer decoder: attention and MLP projections in FP8 with their block scales, the rest BF16."""
    g = torch.Generator().manual_seed(seed)

    def bf16(*shape):
        return (torch.randn(shape, generator=g) * 0.1).to(torch.bfloat16)

    state = {"model.embed_tokens.weight": bf16(VOCAB, HIDDEN), "lm_head.weight": bf16(VOCAB, HIDDEN),
             "model.norm.weight": bf16(HIDDEN)}
    shapes = {"q_proj": (HEADS * HEAD_DIM, HIDDEN), "k_proj": (KV * HEAD_DIM, HIDDEN),
              "v_proj": (KV * HEAD_DIM, HIDDEN), "o_proj": (HIDDEN, HEADS * HEAD_DIM),
              "gate_proj": (inter, HIDDEN), "up_proj": (inter, HIDDEN), "down_proj": (HIDDEN, inter)}
    for i in range(layers):
        p = f"model.layers.{i}"
        state[f"{p}.input_layernorm.weight"] = bf16(HIDDEN)
        state[f"{p}.post_attention_layernorm.weight"] = bf16(HIDDEN)
        for proj, (rows, cols) in shapes.items():
            name = f"{p}.{'self_attn' if proj in FP8[:4] else 'mlp'}.{proj}"
            state[f"{name}.weight"] = (torch.randn(rows, cols, generator=g) * 64).clamp(-448, 448).to(
                torch.float8_e4m3fn)
            state[f"{name}.weight_scale_inv"] = torch.rand(-(-rows // BLOCK), -(-cols // BLOCK), generator=g) + 1e-3
    return state


def whole_read_slices(state: dict[str, torch.Tensor], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Slicing after a whole read, by hand: each FP8 weight and its scale chunked alike."""
    out = {}
    for name, t in state.items():
        proj = name.split(".")[-2]
        if proj in FP8:
            dim = 0 if proj in COLUMN else 1
            out[name] = t.chunk(tp, dim)[rank].contiguous()
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):  # 256 rows: no vocabulary padding
            out[name] = t.chunk(tp, 0)[rank].contiguous()
        else:
            out[name] = t
    return out


def write_checkpoint(folder: str, state: dict[str, torch.Tensor], cfg: dict) -> str:
    write_whole(folder, state, num_files=2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    state = fp8_state()
    return write_checkpoint(str(root / "whole"), state, config(512)), state


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


def load_as(folder, rank, tp, fmt="auto", **kw):
    with WorkerGroup(device="cpu") as group:
        return distload.Loader(folder, fmt, group=group, tensor_parallel_size=tp, tensor_parallel_rank=rank,
                               **kw).load(digest=True)


# -- pure: the scale's action follows its weight's ---------------------------------------------------

def test_block_scales_follow_their_weights_rule():
    state = fp8_state(layers=1)
    spec = load_spec("decoder", config(512))
    tensors = [(n, tuple(t.shape), spec.action(n, tuple(t.shape))) for n, t in state.items()]
    actions = carry_block_scales(tensors, config(512))
    for name, t in state.items():
        if not name.endswith(".weight_scale_inv"):
            continue
        weight = name[: -len("_scale_inv")]
        assert actions[name].dim == actions[weight].dim == (0 if name.split(".")[-2] in COLUMN else 1), name
        assert "128, 128" in actions[name].scales.source
        for rank in range(2):
            assert torch.equal(take_shard(t, actions[name], rank, 2, name), t.chunk(2, actions[name].dim)[rank])
    # a scale beside a replicated weight stays replicated, and one a rule names keeps that rule
    bare = [("a.norm.weight", (256, 256), spec.action("a.norm.weight", (256, 256))),
            ("a.norm.weight_scale_inv", (2, 2), spec.action("a.norm.weight_scale_inv", (2, 2)))]
    assert carry_block_scales(bare)["a.norm.weight_scale_inv"].replicated


def test_block_size_from_config_or_inferred_and_a_mismatch_refused():
    spec = load_spec("plain")
    w, s = "m.layers.0.mlp.up_proj.weight", "m.layers.0.mlp.up_proj.weight_scale_inv"

    def carried(weight_shape, scale_shape, cfg):
        tensors = [(w, weight_shape, spec.action(w, weight_shape)), (s, scale_shape, spec.action(s, scale_shape))]
        return carry_block_scales(tensors, cfg)[s]

    inferred = carried((512, 256), (4, 2), {})  # no config.json: 128 fits the shapes
    assert inferred.scales.block == 128 and "inferred from the shapes" in inferred.scales.source
    assert carried((512, 256), (8, 4), {}).scales.block == 64  # exact tiling
    given = carried((512, 256), (8, 2), {"quantization_config": {"weight_block_size": [64, 128]}})
    assert given.scales.block == 64 and "weight_block_size [64, 128]" in given.scales.source
    with pytest.raises(ConfigError, match=r"in blocks of \[128, 128\] .* has \[4, 2\]"):
        carried((512, 256), (8, 2), config(512))
    with pytest.raises(ConfigError, match="no block size gives 600 blocks of 512"):
        carried((512, 256), (600, 2), {})


def test_a_misaligned_split_names_tensor_block_and_working_sizes():
    """384 rows at TP 4 are 96 a rank, at TP 2 192: neither on blocks of 128; TP 3 is."""
    spec = load_spec("decoder", config(384))
    w, s = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate_proj.weight_scale_inv"
    tensors = [(w, (384, 256), spec.action(w, (384, 256))), (s, (3, 2), spec.action(s, (3, 2)))]
    action = carry_block_scales(tensors, config(384))[s]
    for tp in (2, 4):
        with pytest.raises(ConfigError) as err:
            rank_slice(s, (3, 2), action, 0, tp)
        msg = str(err.value)
        assert msg.startswith(f"tensor {w!r} with shape [384, 256] cannot be split over {tp} ranks with its block "
                              f"scales {s!r} (shape [3, 2]): rank 0 would hold its rows [0, {384 // tp}) of dim 0, "
                              f"which do not fall on the FP8 blocks of 128 rows"), msg
        assert "Tensor-parallel sizes that cut" in msg and "on block boundaries: 1, 3 (rule" in msg, msg
    assert rank_slice(s, (3, 2), action, 2, 3).ranges == ((2, 3),)
    # KV heads of 64 rows replicated over ranks: each rank's head is half a block
    spec64 = load_spec("decoder", {**config(512), "head_dim": 64})
    k, ks = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.weight_scale_inv"
    tensors = [(k, (128, 256), spec64.action(k, (128, 256))), (ks, (1, 2), spec64.action(ks, (1, 2)))]
    with pytest.raises(ConfigError, match=r"rank 1 would hold its rows \[64, 128\).* blocks of 128 rows"):
        rank_slice(ks, (1, 2), carry_block_scales(tensors, {**config(512), "head_dim": 64})[ks], 1, 2)


def test_fused_and_expert_weights_carry_their_scales_part_by_part():
    """A fused gate_up_proj (two parts, each split on its own) and a fused qkv_proj (q, k, v split
    between heads): rank r's scale rows are each part's, as its weight rows are; DeepSeek-style
    expert names follow the same rules."""
    cfg = config(512)
    spec = load_spec("decoder", cfg)
    g = torch.Generator().manual_seed(1)
    cases = {"model.layers.0.mlp.gate_up_proj": ((1024, 256), [512, 512]),
             "model.layers.0.self_attn.qkv_proj": ((1024, 256), [512, 256, 256]),
             "model.layers.3.mlp.experts.7.gate_proj": ((512, 256), [512]),
             "model.layers.3.mlp.experts.7.down_proj": ((256, 512), None)}
    for stem, (shape, parts) in cases.items():
        w, s = f"{stem}.weight", f"{stem}.weight_scale_inv"
        scale = torch.rand(shape[0] // BLOCK, shape[1] // BLOCK, generator=g)
        tensors = [(w, shape, spec.action(w, shape)), (s, tuple(scale.shape), spec.action(s, tuple(scale.shape)))]
        action = carry_block_scales(tensors, cfg)[s]
        for rank in range(2):
            if parts is None:  # row-parallel
                want = scale.chunk(2, 1)[rank]
            else:
                want = torch.cat([p.chunk(2, 0)[rank] for p in scale.split([n // BLOCK for n in parts])])
            assert torch.equal(take_shard(scale, action, rank, 2, s), want), (stem, rank)


def test_a_padded_vocabulary_pads_its_scales_with_whole_blocks_of_zeros():
    """An FP8 lm_head of 200 rows, padded to 256 as vLLM pads a vocabulary: at TP 2 rank 1 holds
    rows 128-199 and 56 zero rows, one block, whose scale is the whole tensor's second; the
    reference pads the weight and its scale (zeros) first and chunks both."""
    spec = load_spec("decoder", config(512))
    w, s = "lm_head.weight", "lm_head.weight_scale_inv"
    for length, tps, refused in ((200, (1, 2), 4), (300, (1,), 2)):
        weight_shape, scale = (length, 256), torch.rand(-(-length // BLOCK), 2) + 1
        tensors = [(w, weight_shape, spec.action(w, weight_shape)), (s, tuple(scale.shape), spec.action(s, (2, 2)))]
        action = carry_block_scales(tensors, config(512))[s]
        padded = -(-length // 64) * 64
        reference = torch.zeros(-(-padded // BLOCK), 2)
        reference[: scale.shape[0]] = scale
        for tp in tps:
            for rank in range(tp):
                assert torch.equal(take_shard(scale, action, rank, tp, s), reference.chunk(tp)[rank]), (length, tp)
        with pytest.raises(ConfigError, match=f"cannot be split over {refused} ranks with its block scales"):
            rank_slice(s, tuple(scale.shape), action, 0, refused)


def test_other_quantization_tensors_beside_a_split_weight_are_still_refused():
    spec = load_spec("plain")
    w, z = "m.layers.0.mlp.down_proj.weight", "m.layers.0.mlp.down_proj.weight_zero_point"
    tensors = [(w, (64, 64), spec.action(w, (64, 64))), (z, (64, 8), spec.action(z, (64, 8)))]
    with pytest.raises(ConfigError, match=r"'weight_zero_point'.*without tensor parallelism"):
        carry_block_scales(tensors)


# -- loads, one process per TP rank in turn -----------------------------------------------------------

@pytest.mark.parametrize("fmt", ["auto", "safetensors"])
def test_each_tp_rank_equals_slicing_a_whole_read(fp8, fmt):
    folder, state = fp8
    for rank in range(2):
        result = load_as(folder, rank, 2, fmt)
        same(result.state, whole_read_slices(state, rank, 2))
        if fmt == "auto":  # distload's reader asks for the rank's slices only, scales included
            want = sum(t.numel() * t.element_size() for t in whole_read_slices(state, rank, 2).values())
            assert result.rank_report.requested_bytes == want


def test_reshard_writes_the_same_slices_and_refuses_misaligned_with_nothing_written(fp8, tmp_path):
    folder, state = fp8
    out = str(tmp_path / "tp2")
    report = distload.reshard(folder, out, 2)  # quantization tensors: the decoder layout, own names
    assert report.spec == "decoder"
    assert report.split["model.layers.1.mlp.down_proj.weight_scale_inv"] == 1
    for rank in range(2):
        names = sorted(n for n in os.listdir(out) if n.startswith(f"model-rank-{rank}-part-"))
        same(plain_read([os.path.join(out, n) for n in names]), whole_read_slices(state, rank, 2))
    bad = write_checkpoint(str(tmp_path / "bad"), fp8_state(inter=384, layers=1), config(384))
    with pytest.raises(ConfigError, match=r"'model.layers.0.mlp.(gate|up|down)_proj.weight' with shape "
                                          r"\[(384, 256|256, 384)\] cannot be split over 2 ranks.*blocks of 128 "
                                          r"(rows|columns).*: 1, 3 "):
        distload.reshard(bad, str(tmp_path / "bad-tp2"), 2)
    assert not any(n.endswith(".safetensors") for n in os.listdir(tmp_path / "bad-tp2")) \
        if os.path.isdir(tmp_path / "bad-tp2") else True


# -- under torchrun: 2 ranks ------------------------------------------------------------------------

@pytest.mark.dist
@pytest.mark.parametrize("which", ["whole", pytest.param("saved", marks=pytest.mark.slow)])
def test_torchrun_tp2_load_equals_slicing_a_whole_read(fp8, tmp_path, which):
    """``load --tensor-parallel-size 2`` of the whole checkpoint, and of its ``reshard`` at TP 2."""
    folder, state = fp8
    source = folder
    if which == "saved":
        source = str(tmp_path / "tp2")
        distload.reshard(folder, source, 2)
    report_path = str(tmp_path / "report.json")
    result = run_distload(["load", source, "--tensor-parallel-size", "2", "--report-json", report_path,
                           "--no-progress"], nproc=2, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    ranks = read_report(report_path)["ranks"]
    assert len(ranks) == 2
    for r in ranks:
        assert r["tensor_parallel"] == [r["rank"], 2]
        assert r["digest"] == state_digest(whole_read_slices(state, r["rank"], 2)), r["rank"]


@pytest.mark.slow
@pytest.mark.dist
def test_torchrun_misaligned_tp_is_refused_on_every_rank(tmp_path):
    bad = write_checkpoint(str(tmp_path / "bad"), fp8_state(inter=384, layers=1), config(384))
    result = run_distload(["load", bad, "--tensor-parallel-size", "2", "--no-progress"], nproc=2, timeout=240)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert "cannot be split over 2 ranks with its block scales" in out, out[-3000:]
    assert "error on ranks 0, 1 (every rank)" in out, out[-3000:]
    assert re.search(r"blocks of 128 (rows|columns) \(config.json's quantization_config.weight_block_size "
                     r"\[128, 128\]\)", out), out[-3000:]
    assert "on block boundaries: 1, 3 " in out, out[-3000:]
