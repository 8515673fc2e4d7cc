"""Tiny real mixture-of-experts checkpoints, made with transformers (issue 46, item 5).

Run as a script in an environment with transformers (vLLM's, ``.vllm-venv``): ``python
tests/moe_checkpoints.py OUT`` writes four checkpoints under OUT, each a Hugging Face folder
(config.json, safetensors files, their index), in transformers' own checkpoint names (one tensor
per expert and projection; transformers 5 holds them stacked in memory, and saves them so):

- ``deepseek-bf16``: DeepSeek-V3 (multi-head latent attention, layer 0 a dense MLP, layer 1 four
  routed experts, a shared expert and the router with its score-correction bias; config.json
  with DeepSeek-V3's ``topk_method`` and ``scoring_func``), BF16;
- ``qwen3moe-bf16``: Qwen3-MoE (two layers of four routed experts and a router), BF16;
- ``deepseek-fp8``, ``qwen3moe-fp8``: the same weights in DeepSeek-V3's FP8 form: every linear
  projection ``X.weight`` as float8_e4m3fn with ``X.weight_scale_inv`` (float32, one per 128x128
  block, ceil-div at the edges) beside it, and ``quantization_config`` in config.json; embeddings,
  norms and the router stay BF16, and the config lists the modules left so in
  ``modules_to_not_convert``, as Qwen3's FP8 checkpoints do (vLLM's Qwen3-MoE would otherwise
  build its router as an FP8 layer; its DeepSeek-V3 never quantizes the router).

Sizes are multiples of 128 where a tensor-parallel split of 2 must fall on FP8 blocks; the
replicated MLA projection ``kv_a_proj_with_mqa`` (576 rows) is not, so its edge blocks are partial.
MLA's latent size is DeepSeek-V3's own (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64): vLLM's CPU
MLA kernels are built for that size only.
"""

from __future__ import annotations

import json
import os
import sys

BLOCK = 128
NUM_EXPERTS = 4
FP8_MAX = 448.0
QUANTIZED = ("_proj.weight", "_proj_with_mqa.weight", ".w1.weight", ".w2.weight", ".w3.weight")  # linear projections
# What DeepSeek-V3's own config.json says of its router and transformers' config leaves out (its
# code has no other way); vLLM builds the router's score-correction bias from it.
DEEPSEEK_ROUTER = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}


def quantize(weight):
    """DeepSeek-V3's block quantization, block by block: ``s = amax / 448``, ``q = b / s``."""
    import torch

    rows, cols = weight.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(-(-rows // BLOCK), -(-cols // BLOCK), dtype=torch.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            b = weight[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            s = b.abs().amax().clamp(min=1e-12) / FP8_MAX
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (b / s).clamp(-FP8_MAX, FP8_MAX).to(
                torch.float8_e4m3fn)
            scales[i, j] = s
    return q, scales


def fp8_state(state):
    out = {}
    for name, tensor in state.items():
        if name.endswith(QUANTIZED) and tensor.dim() == 2 and "embed" not in name:
            out[name], out[name[: -len("weight")] + "weight_scale_inv"] = quantize(tensor)
        else:
            out[name] = tensor
    return out


def save(folder: str, state, config: dict, parts: int = 2) -> None:
    """``state`` over ``parts`` files with a Hugging Face index, and config.json."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    names = sorted(state)
    weight_map = {}
    for p in range(parts):
        file = f"model-{p + 1:05d}-of-{parts:05d}.safetensors"
        save_file({n: state[n].contiguous() for n in names[p::parts]}, os.path.join(folder, file),
                  metadata={"format": "pt"})
        weight_map.update({n: file for n in names[p::parts]})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def make(out: str) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128, tie_word_embeddings=False, num_experts_per_tok=2)
    models = {
        "deepseek": DeepseekV3ForCausalLM(DeepseekV3Config(
            **common, intermediate_size=512, moe_intermediate_size=256, first_k_dense_replace=1,
            num_key_value_heads=4, n_routed_experts=NUM_EXPERTS, n_shared_experts=1, n_group=1, topk_group=1,
            q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=128)),
        "qwen3moe": Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **common, intermediate_size=512, moe_intermediate_size=256, num_key_value_heads=2, head_dim=128,
            num_experts=NUM_EXPERTS, decoder_sparse_step=1, mlp_only_layers=[])),
    }
    for name, model in models.items():
        with torch.no_grad():  # transformers initialises some weights (the router) to zeros
            for param in model.parameters():
                param.normal_(0, 0.05)
        model = model.to(torch.bfloat16)
        # transformers' own save: its checkpoint names (one tensor per expert and projection), in
        # several files with an index, as checkpoints on the Hub are.
        whole = os.path.join(out, f"{name}-bf16")
        model.save_pretrained(whole, max_shard_size="2MB")
        state = {}
        for file in sorted(os.listdir(whole)):
            if file.endswith(".safetensors"):
                state.update(load_file(os.path.join(whole, file)))
        with open(os.path.join(whole, "config.json")) as f:
            config = json.load(f)
        if name == "deepseek":
            config.update(DEEPSEEK_ROUTER)
            with open(os.path.join(whole, "config.json"), "w") as f:
                json.dump(config, f, indent=1)
        quantized = fp8_state(state)
        kept = sorted(n[: -len(".weight")] for n, t in quantized.items()
                      if n.endswith(".weight") and t.dim() == 2 and t.dtype != torch.float8_e4m3fn)
        save(os.path.join(out, f"{name}-fp8"), quantized,
             {**config, "quantization_config": {**QUANTIZATION_CONFIG, "modules_to_not_convert": kept}})


if __name__ == "__main__":
    make(sys.argv[1])
