"""Unit tests for distload/tp/spec.py: specs, spec files, fused parts, shard shapes, and
take_shard/reassemble (pure: no torch.distributed, no I/O besides spec files in tmp_path)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from distload.errors import ConfigError
from distload.tp.spec import BUILTIN_SPECS, SPEC_ALIASES, Rule, ShardingSpec, attention_dims, load_spec, spec_from_json
from distload.tp.slices import Action, reassemble, shard_shape, take_shard

H, HEADS, KV_HEADS, INTER, VOCAB = 64, 8, 2, 128, 256
HEAD_DIM = H // HEADS
LLAMA_CONFIG = {"hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS}


def llama_shapes(prefix: str = "model.layers.3") -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.self_attn.q_proj.weight": (H, H),
        f"{prefix}.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, H),
        f"{prefix}.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, H),
        f"{prefix}.self_attn.q_proj.bias": (H,),
        f"{prefix}.self_attn.o_proj.weight": (H, H),
        f"{prefix}.self_attn.o_proj.bias": (H,),
        f"{prefix}.mlp.gate_proj.weight": (INTER, H),
        f"{prefix}.mlp.up_proj.weight": (INTER, H),
        f"{prefix}.mlp.down_proj.weight": (H, INTER),
        f"{prefix}.mlp.down_proj.bias": (H,),
        f"{prefix}.input_layernorm.weight": (H,),
        f"{prefix}.post_attention_layernorm.weight": (H,),
        f"{prefix}.self_attn.q_norm.weight": (HEAD_DIM,),
        "model.embed_tokens.weight": (VOCAB, H),
        "lm_head.weight": (VOCAB, H),
        "model.norm.weight": (H,),
    }


EXPECTED_DECODER = {
    "q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "q_proj.bias": 0,
    "gate_proj.weight": 0, "up_proj.weight": 0, "down_proj.weight": 1, "o_proj.weight": 1,
    "o_proj.bias": None, "down_proj.bias": None, "input_layernorm.weight": None,
    "post_attention_layernorm.weight": None, "q_norm.weight": None,
    "embed_tokens.weight": 0, "lm_head.weight": 0, "model.norm.weight": None,
}


def expected_dim(name: str):
    for suffix, dim in EXPECTED_DECODER.items():
        if name.endswith(suffix):
            return dim
    raise AssertionError(name)


# -- built-in specs ---------------------------------------------------------------------------

def test_decoder_plan_on_llama_names():
    spec = load_spec(None, LLAMA_CONFIG)
    assert spec.name == "decoder"
    for name, shape in llama_shapes().items():
        action = spec.action(name, shape)
        want = expected_dim(name)
        assert action.dim == want, name
        assert action.replicated == (want is None), name
        headed = any(p in name for p in ("q_proj", "k_proj", "v_proj", "o_proj.weight"))
        assert (action.parts is not None) == headed, name  # split between heads, as vLLM does
        assert action.rule is not None, f"{name} should be matched by a rule of the decoder spec"


def test_decoder_plan_shard_shapes():
    spec = load_spec("decoder", LLAMA_CONFIG)
    shapes = llama_shapes()
    got = {n: shard_shape(n, s, spec.action(n, s), 4) for n, s in shapes.items()}
    p = "model.layers.3"
    assert got[f"{p}.self_attn.q_proj.weight"] == (H // 4, H)
    # 2 KV heads on 4 ranks: each rank one whole head (vLLM replicates them), never half a head
    assert got[f"{p}.self_attn.k_proj.weight"] == (HEAD_DIM, H)
    assert got[f"{p}.self_attn.o_proj.weight"] == (H, H // 4)
    assert got[f"{p}.mlp.down_proj.weight"] == (H, INTER // 4)
    assert got[f"{p}.self_attn.o_proj.bias"] == (H,)
    assert got["model.embed_tokens.weight"] == (VOCAB // 4, H)
    assert got["lm_head.weight"] == (VOCAB // 4, H)
    assert got["model.norm.weight"] == (H,)


def test_decoder_plan_other_families():
    spec = load_spec("decoder", LLAMA_CONFIG)
    # Mixtral experts, a nested lm_head, and names no rule knows.
    assert spec.action("model.layers.0.block_sparse_moe.experts.3.w1.weight", (8, 4)).dim == 0
    assert spec.action("model.layers.0.block_sparse_moe.experts.3.w3.weight", (8, 4)).dim == 0
    assert spec.action("model.layers.0.block_sparse_moe.experts.3.w2.weight", (4, 8)).dim == 1
    assert spec.action("language_model.lm_head.weight", (8, 4)).dim == 0
    assert spec.action("model.rotary_emb.inv_freq", (4,)).replicated
    unmatched = spec.action("model.layers.0.mlp.router.weight", (8, 4))
    assert unmatched.replicated and unmatched.rule is None
    # A norm is matched (replicated by a rule), so it is not "unmatched".
    assert spec.action("model.norm.weight", (4,)).rule is not None


@pytest.mark.parametrize("alias", ["llama", "mistral", "qwen2", "qwen3", "LLAMA", "Qwen3"])
def test_spec_aliases_are_the_decoder_spec(alias):
    spec = load_spec(alias, LLAMA_CONFIG)
    assert spec.name == "decoder"
    assert spec.rules == BUILTIN_SPECS["decoder"]
    assert set(SPEC_ALIASES) == {"llama", "mistral", "qwen2", "qwen3"}


def test_replicate_plan_replicates_everything():
    spec = load_spec("replicate")
    assert spec.name == "replicate"
    for name, shape in llama_shapes().items():
        action = spec.action(name, shape)
        assert action.replicated and action.rule == "*", name
        assert shard_shape(name, shape, action, 4) == shape
    t = torch.arange(12).reshape(3, 4)
    a = spec.action("x", t.shape)
    assert torch.equal(take_shard(t, a, 2, 4), t)


def test_unknown_plan_name():
    with pytest.raises(ConfigError) as err:
        load_spec("gpt-neox-not-a-file")
    msg = str(err.value)
    assert "gpt-neox-not-a-file" in msg and "decoder" in msg and "replicate" in msg and "spec file" in msg


def test_first_matching_rule_wins():
    spec = spec_from_json({"rules": [{"match": "*.special.weight", "replicate": True},
                                     {"match": "*.weight", "split": 1}]})
    assert spec.action("a.special.weight", (4, 4)).replicated
    assert spec.action("a.other.weight", (4, 4)).dim == 1
    assert spec.action("a.other.bias", (4,)).rule is None


# -- spec files -------------------------------------------------------------------------------

def write_spec(tmp_path, value, name="spec.json") -> str:
    path = str(tmp_path / name)
    with open(path, "w") as f:
        f.write(value if isinstance(value, str) else json.dumps(value))
    return path


def test_spec_file_valid(tmp_path):
    raw = {"name": "my-model", "rules": [
        {"match": "*.qkv_proj.weight", "split": 0, "fused": [32, 16, 16]},
        {"match": "*.gate_up_proj.weight", "split": 0, "fused": 2},
        {"match": "*.wqkv.weight", "split": 0, "fused": "qkv"},
        {"match": "*.o_proj.weight", "split": 1},
        {"match": "*norm*", "replicate": True},
    ]}
    spec = load_spec(write_spec(tmp_path, raw), {"hidden_size": 32, "num_attention_heads": 4,
                                                 "num_key_value_heads": 2})
    assert spec.name == "my-model"
    assert spec.rules == (
        Rule("*.qkv_proj.weight", 0, (32, 16, 16)), Rule("*.gate_up_proj.weight", 0, 2),
        Rule("*.wqkv.weight", 0, "qkv"), Rule("*.o_proj.weight", 1), Rule("*norm*", None))
    assert spec.action("l.qkv_proj.weight", (64, 8)) == Action(0, (32, 16, 16), "*.qkv_proj.weight")
    assert spec.action("l.gate_up_proj.weight", (64, 8)).part_sizes == (32, 32)
    assert spec.action("l.wqkv.weight", (64, 8)).part_sizes == (32, 16, 16)
    assert spec.action("l.o_proj.weight", (8, 64)) == Action(1, None, "*.o_proj.weight")
    assert spec.action("l.norm.weight", (8,)).replicated
    # to_json gives back the file's rules, and reads back to the same spec
    recorded = spec.to_json()
    assert recorded.pop("config") == {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    assert recorded == raw
    # the recorded spec alone (as a manifest holds it) sizes the heads the same way
    again = spec_from_json(spec.to_json())
    assert again.rules == spec.rules and attention_dims(again.config) == attention_dims(spec.config)


def test_spec_file_without_name_is_custom(tmp_path):
    spec = load_spec(write_spec(tmp_path, {"rules": []}))
    assert spec.name == "custom" and spec.rules == ()
    assert spec.action("anything", (2,)) == Action(None, None, None)


BAD_RULES = [
    ("not-an-object", "'match' glob"),
    ({"split": 0}, "'match' glob"),
    ({"match": 3, "split": 0}, "'match' glob"),
    ({"match": "*", "split": 0, "dim": 1}, "unknown keys ['dim']"),
    ({"match": "*", "replicate": True, "split": 0}, "either replicates or splits"),
    ({"match": "*", "replicate": True, "fused": 2}, "either replicates or splits"),
    ({"match": "*"}, "'split' must be a dimension index"),
    ({"match": "*", "replicate": False}, "'split' must be a dimension index"),
    ({"match": "*", "split": -1}, "'split' must be a dimension index"),
    ({"match": "*", "split": True}, "'split' must be a dimension index"),
    ({"match": "*", "split": "0"}, "'split' must be a dimension index"),
    ({"match": "*", "split": 1.0}, "'split' must be a dimension index"),
    ({"match": "*", "split": 0, "fused": 0}, "'fused' must be"),
    ({"match": "*", "split": 0, "fused": True}, "'fused' must be"),
    ({"match": "*", "split": 0, "fused": []}, "'fused' must be"),
    ({"match": "*", "split": 0, "fused": [4, 0]}, "'fused' must be"),
    ({"match": "*", "split": 0, "fused": [4, -4]}, "'fused' must be"),
    ({"match": "*", "split": 0, "fused": [4, 2.0]}, "'fused' must be"),
    ({"match": "*", "split": 0, "fused": "kqv"}, "'fused' must be"),
    ({"match": "*", "split": 0, "heads": "query"}, "'heads' must be"),
    ({"match": "*", "split": 0, "heads": "kv", "fused": 2}, "one of 'fused', 'heads' and 'pad_to'"),
    ({"match": "*", "split": 0, "pad_to": 0}, "'pad_to' must be"),
    ({"match": "*", "split": 0, "pad_to": True}, "'pad_to' must be"),
    ({"match": "*", "replicate": True, "pad_to": 64}, "either replicates or splits"),
]


@pytest.mark.parametrize("bad,needle", BAD_RULES, ids=[str(i) for i in range(len(BAD_RULES))])
def test_spec_file_bad_rule_names_file_and_index(tmp_path, bad, needle):
    good = {"match": "*norm*", "replicate": True}
    path = write_spec(tmp_path, {"rules": [good, good, bad]})
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    msg = str(err.value)
    assert path in msg, msg
    assert "rule 2" in msg, msg
    assert needle in msg, msg


@pytest.mark.parametrize("content,needle", [
    ("{not json", "not valid JSON"),
    (b"\xff\xfe\x00bad".decode("latin-1"), "not valid JSON"),
    ("[]", "expected an object with a 'rules' list"),
    ('{"name": "x"}', "expected an object with a 'rules' list"),
    ('{"rules": {"match": "*"}}', "expected an object with a 'rules' list"),
])
def test_spec_file_bad_top_level_names_file(tmp_path, content, needle):
    path = write_spec(tmp_path, content)
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    assert path in str(err.value) and needle in str(err.value), str(err.value)


def test_spec_file_path_that_does_not_exist(tmp_path):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match="neither a built-in sharding spec"):
        load_spec(missing)
    assert not os.path.exists(missing)


# -- fused parts ------------------------------------------------------------------------------

def test_fused_list_sizes_must_add_up():
    spec = spec_from_json({"rules": [{"match": "*qkv*", "split": 0, "fused": [32, 16, 16]}]})
    assert spec.action("a.qkv.weight", (64, 8)).part_sizes == (32, 16, 16)
    with pytest.raises(ConfigError) as err:
        spec.action("a.qkv.weight", (60, 8))
    msg = str(err.value)
    assert "'a.qkv.weight'" in msg and "[60, 8]" in msg and "64" in msg and "60" in msg


def test_fused_equal_parts():
    spec = spec_from_json({"rules": [{"match": "*", "split": 1, "fused": 3}]})
    assert spec.action("t", (2, 12)).part_sizes == (4, 4, 4)
    with pytest.raises(ConfigError) as err:
        spec.action("t", (2, 10))
    assert "'t'" in str(err.value) and "3 equal fused parts" in str(err.value)


@pytest.mark.parametrize("config,expected", [
    ({"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8}, (4096, 1024, 1024)),
    ({"hidden_size": 4096, "num_attention_heads": 32}, (4096, 4096, 4096)),  # MHA: kv = heads
    # Qwen3 style: head_dim given and not hidden/heads
    ({"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128},
     (2048, 1024, 1024)),
    ({"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": None},
     (1024, 256, 256)),
])
def test_attention_dims_from_config(config, expected):
    dims = attention_dims(config)
    assert (dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim, dims.kv_heads * dims.head_dim) == expected
    # A multimodal model's text part is its text_config, as in transformers.
    assert attention_dims({"text_config": config, "vision_config": {"num_attention_heads": 3}}) == dims


def test_decoder_qkv_and_gate_up_are_fused():
    spec = load_spec("decoder", LLAMA_CONFIG)
    qkv = spec.action("model.layers.0.self_attn.qkv_proj.weight", (H + 2 * KV_HEADS * HEAD_DIM, H))
    assert qkv.dim == 0 and qkv.part_sizes == (H, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)
    assert [(p.unit, p.replicable) for p in qkv.parts] == [(HEAD_DIM, False), (HEAD_DIM, True), (HEAD_DIM, True)]
    bias = spec.action("model.layers.0.self_attn.qkv_proj.bias", (H + 2 * KV_HEADS * HEAD_DIM,))
    assert bias.parts == qkv.parts
    gate_up = spec.action("model.layers.0.mlp.gate_up_proj.weight", (2 * INTER, H))
    assert gate_up.dim == 0 and gate_up.part_sizes == (INTER, INTER)


@pytest.mark.parametrize("config", [{}, {"hidden_size": 64}, {"num_attention_heads": 8},
                                    {"num_attention_heads": "eight", "hidden_size": 64}])
def test_heads_without_config_is_a_clear_error_once_split(config):
    spec = load_spec("decoder", config)
    for name in ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        action = spec.action(name, (96, 64))
        assert shard_shape(name, (96, 64), action, 1) == (96, 64)  # TP 1 splits nothing: no heads needed
        with pytest.raises(ConfigError) as err:
            shard_shape(name, (96, 64), action, 2)
        msg = str(err.value)
        assert name.replace(".0.", ".N.") in msg and "config.json" in msg and "num_attention_heads" in msg
        assert "--sharding plain" in msg  # says what to do instead


def test_qkv_config_that_does_not_fit_the_tensor():
    spec = load_spec("decoder", LLAMA_CONFIG)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    action = spec.action(name, (H, H))  # should be H + 2 kv
    # A tensor config.json does not describe (a vision tower's q_proj) loads whole at TP 1 ...
    assert shard_shape(name, (H, H), action, 1) == (H, H)
    with pytest.raises(ConfigError) as err:  # ... and is refused once it is split
        shard_shape(name, (H, H), action, 2)
    assert "add up to" in str(err.value) and f"[{H}, {H}]" in str(err.value)


def test_vision_tower_beside_a_text_config_loads_at_tp1():
    spec = load_spec("decoder", {"text_config": {"num_attention_heads": 32, "num_key_value_heads": 8,
                                                 "head_dim": 128, "hidden_size": 4096}})
    vision_q = "vision_tower.encoder.layers.0.self_attn.q_proj.weight"
    assert shard_shape(vision_q, (1024, 1024), spec.action(vision_q, (1024, 1024)), 1) == (1024, 1024)


def test_packed_fp4_last_dim_split_counts_header_values():
    """An NVFP4 o_proj: 32 heads of 128 header values along dim 1 = 2048 torch elements (pairs)."""
    spec = load_spec("decoder", {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                                 "hidden_size": 4096})
    name = "model.layers.0.self_attn.o_proj.weight"
    action = spec.action(name, (4096, 2048), packing=2)
    assert action.part_sizes == (2048,) and action.parts[0].unit == 64
    assert shard_shape(name, (4096, 2048), action, 4) == (4096, 512)
    q = "model.layers.0.self_attn.q_proj.weight"  # split along dim 0: packing does not matter
    assert shard_shape(q, (4096, 2048), spec.action(q, (4096, 2048), packing=2), 4) == (1024, 2048)


def test_an_fp4_split_refusal_quotes_the_files_shape_not_torchs():
    """Issue 30, item 7: the header counts F4 in 4-bit values ([64, 100]); torch holds pairs
    ([64, 50]). A refusal gives the file's shape and says which of the two reasons holds."""
    spec = load_spec("decoder", {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                                 "hidden_size": 4096})
    down = "model.layers.0.mlp.down_proj.weight"
    action = spec.action(down, (64, 50), packing=2)
    with pytest.raises(ConfigError) as err:
        shard_shape(down, (64, 50), action, 4)  # 25 values a rank: half a pair
    assert str(err.value).startswith(f"tensor {down!r} with shape [64, 100] (in the file; torch holds it as [64, 50], "
                                     f"2 values packed in one element) cannot be split over 4 ranks: dim 1 (100 values, "
                                     f"50 elements) would be cut between the 2 values packed in one element"), err.value
    with pytest.raises(ConfigError, match=r"\[64, 100\].*dim 1 \(100 values, 50 elements\) is not divisible by 3"):
        shard_shape(down, (64, 50), action, 3)
    o = "model.layers.0.self_attn.o_proj.weight"
    with pytest.raises(ConfigError, match=r"shape \[4096, 4096\] \(in the file.*32 attention heads of 128 values"):
        shard_shape(o, (4096, 2048), spec.action(o, (4096, 2048), packing=2), 3)
    up = "model.layers.0.mlp.up_proj.weight"  # split along dim 0: the file's shape still quoted
    with pytest.raises(ConfigError, match=r"shape \[30, 16\] \(in the file.*dim 0 \(30\) is not divisible by 4"):
        shard_shape(up, (30, 8), spec.action(up, (30, 8), packing=2), 4)


def test_a_block_scale_beside_a_split_weight_goes_with_it_and_other_scales_are_refused():
    """FP8 ``weight_scale_inv`` is split with its weight (tests/test_fp8_tp.py); a quantization
    tensor distload cannot cut with its weight (a zero point) is refused, naming both."""
    from distload.tp.spec import carry_block_scales, check_scales

    spec = load_spec("decoder", LLAMA_CONFIG)
    w, s = "model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight_scale_inv"
    tensors = [(w, (H, INTER), spec.action(w, (H, INTER))), (s, (H // 8, INTER // 8), spec.action(s, (2, 16)))]
    carried = carry_block_scales(tensors)[s]
    assert carried.dim == 1 and carried.scales.block == 8 and carried.scales.weight == w
    z = "model.layers.0.mlp.down_proj.weight_zero_point"
    tensors = [(w, (H, INTER), spec.action(w, (H, INTER))), (z, (H // 8, INTER // 8), spec.action(z, (2, 16)))]
    with pytest.raises(ConfigError) as err:
        check_scales(tensors)
    assert repr(z) in str(err.value) and repr(w) in str(err.value) and "without tensor parallelism" in str(err.value)
    per_tensor = [(w, (H, INTER), spec.action(w, (H, INTER))), (s, (), spec.action(s, ()))]
    check_scales(per_tensor)  # one value: fine replicated


# -- shard_shape errors -----------------------------------------------------------------------

def test_indivisible_dimension_names_tensor_shape_and_n():
    spec = load_spec("decoder", LLAMA_CONFIG)
    name = "model.layers.0.mlp.down_proj.weight"
    action = spec.action(name, (64, 100))
    assert shard_shape(name, (64, 100), action, 4) == (64, 25)
    with pytest.raises(ConfigError) as err:
        shard_shape(name, (64, 100), action, 3)
    msg = str(err.value)
    assert repr(name) in msg and "[64, 100]" in msg and "3 ranks" in msg and "dim 1 (100)" in msg


def test_indivisible_fused_part():
    spec = load_spec("decoder", {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 1})
    name = "model.layers.0.self_attn.qkv_proj.weight"
    action = spec.action(name, (80, 64))  # q 64 (8 heads of 8), k 8, v 8 (one KV head)
    assert action.part_sizes == (64, 8, 8)
    # 8 ranks: one query head each, and the one KV head replicated on all of them (vLLM's rule)
    assert shard_shape(name, (80, 64), action, 8) == (24, 64)
    # 80 is divisible by 16, but 8 query heads are not: heads are never cut.
    with pytest.raises(ConfigError) as err:
        shard_shape(name, (80, 64), action, 16)
    msg = str(err.value)
    assert repr(name) in msg and "[80, 64]" in msg and "16 ranks" in msg and "8 attention heads" in msg


@pytest.mark.parametrize("shape", [(), (8,)])
def test_split_dim_beyond_rank(shape):
    spec = spec_from_json({"rules": [{"match": "*", "split": len(shape)}]})
    action = spec.action("t.weight", shape)
    with pytest.raises(ConfigError) as err:
        shard_shape("t.weight", shape, action, 2)
    msg = str(err.value)
    assert "'t.weight'" in msg and str(list(shape)) in msg and f"no dim {len(shape)}" in msg


def test_fused_split_dim_beyond_rank():
    spec = spec_from_json({"rules": [{"match": "*", "split": 1, "fused": [2, 2]}]})
    action = spec.action("bias", (4,))
    with pytest.raises(ConfigError, match="no dim 1"):
        shard_shape("bias", (4,), action, 2)


def test_world_size_one_keeps_everything():
    spec = load_spec("decoder", LLAMA_CONFIG)
    for name, shape in llama_shapes().items():
        assert shard_shape(name, shape, spec.action(name, shape), 1) == shape


# -- take_shard / reassemble ------------------------------------------------------------------

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int8, torch.bool]


def make(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randn(shape, generator=g) > 0
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
    return (torch.randn(shape, generator=g) * 10).to(dtype)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("action,shape", [
    (Action(0), (16, 6)),
    (Action(1), (6, 16)),
    (Action(2), (3, 2, 8)),
    (Action(0, (8, 4, 4)), (16, 6)),
    (Action(1, (8, 8)), (3, 16)),
    (Action(None), (5, 3)),
], ids=["dim0", "dim1", "dim2", "fused-qkv", "fused-dim1", "replicated"])
def test_take_shard_reassemble_inverse(dtype, world, action, shape):
    tensor = make(shape, dtype, seed=world)
    shards = [take_shard(tensor, action, r, world) for r in range(world)]
    want = shard_shape("t", shape, action, world)
    for shard in shards:
        assert tuple(shard.shape) == want
        assert shard.dtype == dtype and shard.is_contiguous()
    back = reassemble(shards, action, shape)
    assert back.dtype == dtype and tuple(back.shape) == tuple(shape)
    assert raw(back) == raw(tensor)
    if not action.replicated and world > 1:
        assert raw(shards[0]) != raw(shards[-1]) or dtype == torch.bool


def test_take_shard_fused_gives_each_rank_its_part_of_each():
    q = torch.arange(0, 8).reshape(8, 1)
    k = torch.arange(100, 104).reshape(4, 1)
    v = torch.arange(200, 204).reshape(4, 1)
    fused = torch.cat([q, k, v])
    action = Action(0, (8, 4, 4))
    assert take_shard(fused, action, 0, 2).flatten().tolist() == [0, 1, 2, 3, 100, 101, 200, 201]
    assert take_shard(fused, action, 1, 2).flatten().tolist() == [4, 5, 6, 7, 102, 103, 202, 203]
    # A plain split would straddle q and k: that is not what a fused rule does.
    assert take_shard(fused, Action(0), 1, 2).flatten().tolist() == [
        100, 101, 102, 103, 200, 201, 202, 203]


def test_take_shard_row_parallel_slices_columns():
    t = torch.arange(24).reshape(2, 12)
    s = take_shard(t, Action(1), 2, 4)
    assert s.tolist() == [[6, 7, 8], [18, 19, 20]]


def test_take_shard_non_contiguous_source():
    t = make((8, 12), torch.float32).t()  # (12, 8), non-contiguous
    shards = [take_shard(t, Action(0), r, 4) for r in range(4)]
    assert all(s.is_contiguous() for s in shards)
    assert torch.equal(reassemble(shards, Action(0), t.shape), t)


def test_shardingplan_is_pure_data():
    spec = ShardingSpec("x", (Rule("*", 0),))
    assert spec.config == {}
    assert spec.to_json() == {"name": "x", "rules": [{"match": "*", "split": 0}]}


@pytest.mark.parametrize("config,says", [
    ({}, "there is none"),
    ({"hidden_size": 64}, "it has no num_attention_heads"),
    ({"num_attention_heads": "4", "hidden_size": 64}, "its num_attention_heads is '4' (str), not a positive int"),
    ({"num_attention_heads": 4, "num_key_value_heads": 0, "hidden_size": 64},
     "its num_key_value_heads is 0 (int), not a positive int"),
])
def test_a_config_with_wrong_head_counts_says_which(config, says):
    """A config.json that has the keys with wrong values is not "none", and KV heads 0 is not
    taken for "as many as the attention heads"."""
    name = "model.layers.0.self_attn.k_proj.weight"
    action = load_spec("decoder", config).action(name, (96, 64))
    with pytest.raises(ConfigError) as err:
        shard_shape(name, (96, 64), action, 2)
    assert says in str(err.value), str(err.value)
    fix = "Fix that in the config.json beside the weights" if config else "Put the model's config.json next to"
    assert fix in str(err.value), str(err.value)  # a config.json that is there is fixed, not put there
