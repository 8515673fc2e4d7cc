"""reshard's vllm layout (issue 17, item 1): the names, fusions, scales and ties of vLLM's
engine state dict, checked tensor for tensor against the decoder spec's slices. That vLLM's own
loaders read it and generate the original's tokens is tests/test_vllm_engine.py."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import distload
from distload.errors import ConfigError
from distload.tp.spec import load_spec
from distload.tp.slices import take_shard
from distload.tp.vllm_names import ATTENTION_SCALES, vllm_state

HEADS, KV_HEADS, HIDDEN, INTER, VOCAB, LAYERS = 4, 2, 64, 96, 200, 2


def write_decoder(folder, architecture="LlamaForCausalLM", tied=False, bias=False, extra=None, seed=0):
    os.makedirs(folder, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    head_dim = HIDDEN // HEADS
    state = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g).to(torch.bfloat16),
             "model.norm.weight": torch.randn(HIDDEN, generator=g).to(torch.bfloat16)}
    if not tied:
        state["lm_head.weight"] = torch.randn(VOCAB, HIDDEN, generator=g).to(torch.bfloat16)
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        shapes = {"self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
                  "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
                  "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
                  "self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
                  "mlp.gate_proj.weight": (INTER, HIDDEN), "mlp.up_proj.weight": (INTER, HIDDEN),
                  "mlp.down_proj.weight": (HIDDEN, INTER), "input_layernorm.weight": (HIDDEN,),
                  "post_attention_layernorm.weight": (HIDDEN,)}
        if bias:
            shapes.update({"self_attn.q_proj.bias": (HEADS * head_dim,), "self_attn.k_proj.bias": (KV_HEADS * head_dim,),
                           "self_attn.v_proj.bias": (KV_HEADS * head_dim,)})
        for suffix, shape in shapes.items():
            state[f"{p}.{suffix}"] = torch.randn(*shape, generator=g).to(torch.bfloat16)
    state.update(extra or {})
    save_file(state, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"architectures": [architecture], "hidden_size": HIDDEN, "num_attention_heads": HEADS,
                   "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB, "tie_word_embeddings": tied}, f)
    return state


def rank_files(folder, rank):
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, f"model-rank-{rank}-part-*.safetensors"))):
        out.update(load_file(path))
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("tied,bias", [(False, False), (True, True)])
def test_save_sharded_writes_vllms_engine_state(tmp_path, tp, tied, bias):
    whole = str(tmp_path / "whole")
    state = write_decoder(whole, "Qwen2ForCausalLM" if bias else "LlamaForCausalLM", tied=tied, bias=bias)
    out = str(tmp_path / "out")
    report = distload.reshard(whole, out, tp)  # the default where the engine's names are known
    assert report.spec == "vllm" and "loads with vLLM's sharded_state" in report.engine_note
    with open(os.path.join(out, "distload.json")) as f:
        assert json.load(f)["sharding"]["engine"] == "vllm"
    decoder = load_spec("decoder", json.load(open(os.path.join(whole, "config.json"))))

    def shard(name, rank):
        return take_shard(state[name], decoder.action(name, tuple(state[name].shape)), rank, tp, name)

    for rank in range(tp):
        files = rank_files(out, rank)
        expected = {}
        expected["lm_head.weight"] = shard("model.embed_tokens.weight" if tied else "lm_head.weight", rank)
        if not tied:
            expected["model.embed_tokens.weight"] = shard("model.embed_tokens.weight", rank)
        expected["model.norm.weight"] = state["model.norm.weight"]
        for i in range(LAYERS):
            p = f"model.layers.{i}"
            for suffix in ("weight",) + (("bias",) if bias else ()):
                expected[f"{p}.self_attn.qkv_proj.{suffix}"] = torch.cat(
                    [shard(f"{p}.self_attn.{x}_proj.{suffix}", rank) for x in "qkv"])
            expected[f"{p}.mlp.gate_up_proj.weight"] = torch.cat(
                [shard(f"{p}.mlp.gate_proj.weight", rank), shard(f"{p}.mlp.up_proj.weight", rank)])
            for suffix in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                           "post_attention_layernorm.weight"):
                expected[f"{p}.{suffix}"] = shard(f"{p}.{suffix}", rank)
            for scale in ATTENTION_SCALES:
                expected[f"{p}.self_attn.attn.{scale}"] = torch.tensor(1.0, dtype=torch.float32)
        assert sorted(files) == sorted(expected), rank
        for name, value in expected.items():
            assert files[name].dtype == value.dtype and files[name].shape == value.shape, name
            assert torch.equal(files[name], value), (rank, name)
    # the vocabulary is padded to 64 rows per vLLM, then split: 200 -> 256 rows
    assert rank_files(out, 0)["lm_head.weight"].shape[0] == 256 // tp


def test_a_vllm_save_loads_back_with_distload(tmp_path):
    whole = str(tmp_path / "whole")
    write_decoder(whole)
    out = str(tmp_path / "out")
    distload.reshard(whole, out, 1)
    assert distload.state_digest(distload.load(out, "sharded_state")) == distload.state_digest(rank_files(out, 0))


def test_unknown_architecture_saves_with_the_checkpoints_names_and_says_so(tmp_path):
    whole = str(tmp_path / "whole")
    state = write_decoder(whole, "GPTNeoXForCausalLM")
    report = distload.reshard(whole, str(tmp_path / "out"), 2)
    assert report.spec == "decoder"
    assert "vLLM's sharded_state loader does not" in report.engine_note and "GPTNeoXForCausalLM" in report.engine_note
    assert sorted(rank_files(str(tmp_path / "out"), 0)) == sorted(state)
    with pytest.raises(ConfigError, match="only, not GPTNeoXForCausalLM"):
        distload.reshard(whole, str(tmp_path / "out2"), 2, sharding="vllm")


def test_quantized_checkpoints_are_refused_for_the_engine_layout(tmp_path):
    whole = str(tmp_path / "whole")
    write_decoder(whole, extra={"model.layers.0.self_attn.k_proj.k_scale": torch.tensor(0.5)})
    with pytest.raises(ConfigError, match="quantization tensors.*save_sharded_state"):
        distload.reshard(whole, str(tmp_path / "out"), 2, sharding="vllm")
    assert not os.path.exists(tmp_path / "out" / "distload.json")


def test_engine_state_drops_inv_freq_and_refuses_a_lone_fusion_part():
    config = {"architectures": ["LlamaForCausalLM"]}
    names = ["model.layers.0.self_attn.rotary_emb.inv_freq", "model.layers.0.self_attn.o_proj.weight"]
    out = [t.name for t in vllm_state(names, config, "ck")]
    assert out == ["model.layers.0.self_attn.o_proj.weight"] + [
        f"model.layers.0.self_attn.attn.{s}" for s in ATTENTION_SCALES]
    with pytest.raises(ConfigError, match="has no model.layers.0.mlp.up_proj.weight beside it"):
        vllm_state(["model.layers.0.mlp.gate_proj.weight"], config, "ck")
    with pytest.raises(ConfigError, match="names no 'architectures'"):
        vllm_state(names, {}, "ck")


def test_loads_refuse_the_engine_layout_and_name_the_way_out(tmp_path):
    whole = str(tmp_path / "whole")
    write_decoder(whole)
    with pytest.raises(ConfigError, match="use --sharding decoder"):
        distload.load(whole, tensor_parallel_size=1, sharding="vllm")
