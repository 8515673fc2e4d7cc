"""The ``decoder`` sharding spec holds what vLLM's engine holds, rank for rank.

The expected rows are written here from vLLM 0.32's own rules, independently of
distload/tp/slices.py:

- ``QKVParallelLinear``: with tp_size >= total_num_kv_heads each rank has one KV head and
  ``num_kv_head_replicas = tp_size // total_num_kv_heads``; rank r loads KV head
  ``r // num_kv_head_replicas``. Otherwise each rank has ``kv_heads // tp_size`` heads. Query heads
  are always ``heads // tp_size`` per rank (``divide`` asserts it).
- ``VocabParallelEmbedding`` / ``ParallelLMHead``: ``pad_vocab_size(vocab, 64)`` rows, divided by
  tp_size; rank r copies rows ``[min(r*per, vocab), min((r+1)*per, vocab))`` and fills the rest of
  its ``per`` rows with zeros.
"""

from __future__ import annotations

import pytest
import torch

from distload.errors import ConfigError
from distload.tp.spec import load_spec, spec_from_json
from distload.tp.slices import reassemble, shard_shape, take_shard


def config(heads, kv_heads, head_dim, vocab):
    return {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "hidden_size": heads * head_dim, "vocab_size": vocab}


# (name, config, tensor-parallel sizes vLLM accepts)
MODELS = [
    ("llama-3-8b", config(32, 8, 128, 128256), [1, 2, 4, 8, 16, 32]),
    ("qwen2-0.5b", config(14, 2, 64, 151936), [1, 2]),  # 14 ranks: 151936 rows do not divide
    ("tiny-vocab-1000", config(4, 2, 16, 1000), [1, 2, 4]),
    ("mqa", config(8, 1, 16, 300), [1, 2, 4, 8]),
    ("mha", config(4, 4, 8, 64), [1, 2, 4]),
]


def vllm_query_rows(cfg, rank, tp):
    per = cfg["num_attention_heads"] // tp * cfg["head_dim"]
    return rank * per, (rank + 1) * per


def vllm_kv_rows(cfg, rank, tp):
    kv, hd = cfg["num_key_value_heads"], cfg["head_dim"]
    if tp >= kv:
        replicas = tp // kv
        head = rank // replicas
        return head * hd, (head + 1) * hd
    per = kv // tp * hd
    return rank * per, (rank + 1) * per


def vllm_vocab_rows(cfg, rank, tp):
    vocab = cfg["vocab_size"]
    padded = (vocab + 63) // 64 * 64
    per = padded // tp
    start, end = min(rank * per, vocab), min((rank + 1) * per, vocab)
    return start, end, per - (end - start)


def shapes(cfg):
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    hidden = cfg["hidden_size"]
    return {
        "model.embed_tokens.weight": (cfg["vocab_size"], hidden),
        "lm_head.weight": (cfg["vocab_size"], hidden),
        "model.layers.0.self_attn.q_proj.weight": (q, hidden),
        "model.layers.0.self_attn.k_proj.weight": (kv, hidden),
        "model.layers.0.self_attn.v_proj.weight": (kv, hidden),
        "model.layers.0.self_attn.q_proj.bias": (q,),
        "model.layers.0.self_attn.k_proj.bias": (kv,),
        "model.layers.0.self_attn.qkv_proj.weight": (q + 2 * kv, hidden),
        "model.layers.0.self_attn.o_proj.weight": (hidden, q),
    }


CASES = [(name, cfg, tp) for name, cfg, tps in MODELS for tp in tps]


@pytest.mark.parametrize("name,cfg,tp", CASES, ids=[f"{n}-tp{t}" for n, _, t in CASES])
def test_decoder_shard_shapes_are_vllms(name, cfg, tp):
    spec = load_spec("decoder", cfg)
    hidden = cfg["hidden_size"]
    q = vllm_query_rows(cfg, 0, tp)
    kv = vllm_kv_rows(cfg, 0, tp)
    vocab = vllm_vocab_rows(cfg, 0, tp)
    want = {
        "model.embed_tokens.weight": (vocab[1] - vocab[0] + vocab[2], hidden),
        "lm_head.weight": (vocab[1] - vocab[0] + vocab[2], hidden),
        "model.layers.0.self_attn.q_proj.weight": (q[1] - q[0], hidden),
        "model.layers.0.self_attn.k_proj.weight": (kv[1] - kv[0], hidden),
        "model.layers.0.self_attn.v_proj.weight": (kv[1] - kv[0], hidden),
        "model.layers.0.self_attn.q_proj.bias": (q[1] - q[0],),
        "model.layers.0.self_attn.k_proj.bias": (kv[1] - kv[0],),
        "model.layers.0.self_attn.qkv_proj.weight": (q[1] - q[0] + 2 * (kv[1] - kv[0]), hidden),
        "model.layers.0.self_attn.o_proj.weight": (hidden, q[1] - q[0]),
    }
    for tensor, shape in shapes(cfg).items():
        assert shard_shape(tensor, shape, spec.action(tensor, shape), tp) == want[tensor], tensor


def test_llama_tp4_with_2_kv_heads_holds_whole_heads():
    """The issue's case: TP 4, 2 KV heads; vocab 1000 on TP 2 holds 512 rows per rank."""
    cfg = config(4, 2, 16, 1000)
    spec = load_spec("decoder", cfg)
    k = "model.layers.0.self_attn.k_proj.weight"
    assert shard_shape(k, (32, 64), spec.action(k, (32, 64)), 4) == (16, 64)  # one head, not half
    e = "model.embed_tokens.weight"
    assert shard_shape(e, (1000, 64), spec.action(e, (1000, 64)), 2) == (512, 64)
    plain = load_spec("plain", cfg)  # the even split, for users who want it, by name
    assert shard_shape(k, (32, 64), plain.action(k, (32, 64)), 4) == (8, 64)
    assert shard_shape(e, (1000, 64), plain.action(e, (1000, 64)), 2) == (500, 64)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"  # q 64, k 32, v 32
    assert shard_shape(qkv, (128, 64), spec.action(qkv, (128, 64)), 4) == (16 + 16 + 16, 64)
    assert shard_shape(qkv, (128, 64), plain.action(qkv, (128, 64)), 4) == (16 + 8 + 8, 64)
    # Both specs survive the manifest: the recorded JSON gives back the same rules.
    for s in (spec, plain):
        again = spec_from_json(s.to_json())
        assert again.rules == s.rules and again.name == s.name


def rows(n, width=3):
    """A tensor whose row i holds i, so a slice says which source rows it holds."""
    return torch.arange(n, dtype=torch.float32).repeat_interleave(width).reshape(n, width)


SMALL = [("tiny-vocab-1000", config(4, 2, 2, 1000), [1, 2, 4]),
         ("mqa", config(8, 1, 2, 300), [1, 2, 4, 8]),
         ("kv4", config(8, 4, 2, 130), [1, 2, 4, 8])]
SMALL_CASES = [(name, cfg, tp) for name, cfg, tps in SMALL for tp in tps]


@pytest.mark.parametrize("name,cfg,tp", SMALL_CASES, ids=[f"{n}-tp{t}" for n, _, t in SMALL_CASES])
def test_decoder_slices_hold_vllms_rows(name, cfg, tp):
    spec = load_spec("decoder", cfg)
    q_size = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_size = cfg["num_key_value_heads"] * cfg["head_dim"]
    tensors = {
        "model.embed_tokens.weight": rows(cfg["vocab_size"]),
        "model.layers.0.self_attn.k_proj.weight": rows(kv_size),
        "model.layers.0.self_attn.q_proj.weight": rows(q_size),
        "model.layers.0.self_attn.qkv_proj.weight": rows(q_size + 2 * kv_size),
    }
    for tensor, full in tensors.items():
        action = spec.action(tensor, tuple(full.shape))
        shards = []
        for r in range(tp):
            got = take_shard(full, action, r, tp, name=tensor)
            shards.append(got)
            if tensor.endswith("embed_tokens.weight"):
                start, end, pad = vllm_vocab_rows(cfg, r, tp)
                want = torch.cat([full[start:end], torch.zeros(pad, full.shape[1])])
            elif tensor.endswith("k_proj.weight"):
                want = full[slice(*vllm_kv_rows(cfg, r, tp))]
            elif tensor.endswith("q_proj.weight"):
                want = full[slice(*vllm_query_rows(cfg, r, tp))]
            else:  # fused: this rank's q rows, then its k rows, then its v rows (QKVParallelLinear)
                k0, k1 = vllm_kv_rows(cfg, r, tp)
                want = torch.cat([full[slice(*vllm_query_rows(cfg, r, tp))],
                                  full[q_size + k0:q_size + k1], full[q_size + kv_size + k0:q_size + kv_size + k1]])
            assert torch.equal(got, want), (tensor, r)
        assert torch.equal(reassemble(shards, action, full.shape, name=tensor), full), tensor


@pytest.mark.parametrize("cfg,tp,needle", [
    (config(14, 2, 64, 151936), 4, "14 attention heads"),  # 14 query heads on 4 ranks: vLLM refuses
    (config(14, 2, 64, 151936), 7, "2 KV heads"),  # 7 ranks, 2 KV heads: neither divides the other
    (config(8, 8, 4, 100), 3, "8 attention heads"),
])
def test_head_counts_vllm_cannot_split_are_refused(cfg, tp, needle):
    spec = load_spec("decoder", cfg)
    bad = [n for n, s in shapes(cfg).items() if "proj" in n and _fails(spec, n, s, tp)]
    assert bad, "some attention tensor must be refused"
    name = bad[0]
    with pytest.raises(ConfigError) as err:
        shard_shape(name, shapes(cfg)[name], spec.action(name, shapes(cfg)[name]), tp)
    msg = str(err.value)
    assert repr(name) in msg and f"{tp} ranks" in msg, msg
    assert any(needle in str(_error(spec, n, shapes(cfg)[n], tp)) for n in bad), needle


def _error(spec, name, shape, tp):
    try:
        shard_shape(name, shape, spec.action(name, shape), tp)
    except ConfigError as exc:
        return exc
    return None


def _fails(spec, name, shape, tp):
    return _error(spec, name, shape, tp) is not None


def test_padded_vocabulary_that_does_not_divide_is_refused():
    spec = load_spec("decoder", config(4, 2, 16, 1000))
    e = "model.embed_tokens.weight"
    with pytest.raises(ConfigError) as err:
        shard_shape(e, (1000, 64), spec.action(e, (1000, 64)), 3)  # 1024 rows on 3 ranks
    msg = str(err.value)
    assert repr(e) in msg and "1024" in msg and "multiple of 64" in msg and "3 ranks" in msg


def test_a_config_that_does_not_describe_the_tensor_is_refused():
    spec = load_spec("decoder", config(4, 2, 16, 1000))
    k = "model.layers.0.self_attn.k_proj.weight"
    with pytest.raises(ConfigError) as err:  # 3 heads of 16, but config.json says 2
        shard_shape(k, (48, 64), spec.action(k, (48, 64)), 2)
    msg = str(err.value)
    assert repr(k) in msg and "2 KV heads of 16 rows" in msg and "48" in msg
