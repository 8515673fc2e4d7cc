"""The tensors vLLM's engine holds for a Hugging Face decoder, named from the checkpoint's tensors.

Used where vLLM is not installed (``reshard --sharding vllm`` is otherwise made by vLLM's own
engine, distload/vllm/save.py, for any architecture) and as a cross-check of that save in the
tests.

vLLM's ``sharded_state`` loader copies each file tensor into the engine parameter of the same
name and fails unless every parameter was given one (vllm/model_executor/model_loader/
sharded_state_loader.py, 0.32). The engine's names are not the checkpoint's:

- q, k and v are one parameter ``qkv_proj`` (QKVParallelLinear), gate and up one ``gate_up_proj``
  (MergedColumnParallelLinear): on TP rank r, the concatenation along dim 0 of each part's slice
  for rank r (the ``decoder`` spec's slices, head-aware);
- every attention layer holds four 0-d float32 scales, ``self_attn.attn._k_scale``, ``_v_scale``,
  ``_q_scale`` and ``_prob_scale`` (1.0 unless a quantized KV cache is configured);
- with tied embeddings (``tie_word_embeddings``) the embedding and the output layer are one
  tensor, which the loader knows by the smaller of its two names, ``lm_head.weight``;
- ``rotary_emb.inv_freq`` (some older checkpoints save it) is recomputed, not loaded.

What only the engine knows is refused, not guessed: an architecture outside those below, and
quantization tensors (weight scales, KV-cache scales) that vLLM's quantization methods rename
and reshape. Pure: names and config in, a plan out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from distload.errors import ConfigError

# Decoders whose vLLM model class names its parameters as above (checked on vLLM 0.32: Llama and
# Qwen2 served and compared token for token; Mistral and Qwen3 share the classes' naming).
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
ATTENTION_SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
FUSED = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))
_QUANTIZATION = re.compile(r"(weight_scale|weight_scale_inv|input_scale|weight_zero_point|"
                           r"(^|[._])[kvq]_scale|qweight|qzeros|scales)$")


@dataclass(frozen=True)
class EngineTensor:
    """One tensor of the engine's state dict: the checkpoint tensors it is made of (each sliced
    for the rank, then concatenated along dim 0), or a 0-d float32 ``constant``."""

    name: str
    parts: tuple[str, ...] = ()
    constant: float | None = None


def vllm_state(names: Sequence[str], config: Mapping[str, Any], source: str) -> list[EngineTensor]:
    """The engine tensors for a checkpoint with tensors ``names`` and this config.json, in the
    checkpoint's order (a fused tensor where its first part was)."""
    _check_architecture(config, source)
    quantized = [n for n in names if _QUANTIZATION.search(n)]
    if quantized:
        raise ConfigError(
            f"{source}: {quantized[0]} (and {len(quantized) - 1} more) are quantization tensors, which "
            f"vLLM's quantization methods rename and reshape inside the engine: distload cannot write "
            f"them as the engine holds them. Save this checkpoint with vLLM's own saver "
            f"(save_sharded_state), or use --sharding decoder for distload's loaders only")
    present = set(names)
    tied = bool(config.get("tie_word_embeddings", False))
    embed = next((n for n in names if n.endswith("embed_tokens.weight")), None)
    fused_into: dict[str, tuple[str, tuple[str, ...]]] = {}  # part name -> (engine name, parts)
    for fused, members in FUSED:
        for name in names:
            for suffix in ("weight", "bias"):
                first = f".{members[0]}.{suffix}"
                if not name.endswith(first):
                    continue
                stem = name[: -len(first)]
                parts = tuple(f"{stem}.{m}.{suffix}" for m in members)
                missing = [p for p in parts if p not in present]
                if missing:
                    raise ConfigError(f"{source}: {name} has no {missing[0]} beside it; vLLM's engine holds "
                                      f"them as one tensor {stem}.{fused}.{suffix}")
                for part in parts:
                    fused_into[part] = (f"{stem}.{fused}.{suffix}", parts)
    out: list[EngineTensor] = []
    seen: set[str] = set()
    for name in names:
        if name.endswith("rotary_emb.inv_freq"):
            continue  # the engine computes it
        if tied and name == "lm_head.weight" and embed is not None:
            continue  # one tensor with the embedding: written once, from embed_tokens, below
        if name in fused_into:
            engine_name, parts = fused_into[name]
            if engine_name not in seen:
                seen.add(engine_name)
                out.append(EngineTensor(engine_name, parts))
            continue
        if tied and name == embed:
            out.append(EngineTensor("lm_head.weight", (name,)))
            continue
        out.append(EngineTensor(name, (name,)))
        if name.endswith(".self_attn.o_proj.weight"):
            stem = name[: -len(".o_proj.weight")]
            out += [EngineTensor(f"{stem}.attn.{scale}", constant=1.0) for scale in ATTENTION_SCALES]
    return out


def _check_architecture(config: Mapping[str, Any], source: str) -> None:
    architectures = config.get("architectures") if isinstance(config, Mapping) else None
    if not isinstance(architectures, list) or not architectures:
        raise ConfigError(f"{source}: config.json names no 'architectures'; the vllm layout needs it to know "
                          f"the engine's parameter names (supported: {', '.join(ARCHITECTURES)})")
    unknown = [a for a in architectures if a not in ARCHITECTURES]
    if unknown:
        raise ConfigError(
            f"{source}: distload's own table of vLLM's parameter names knows {', '.join(ARCHITECTURES)} only, "
            f"not {unknown[0]}. Where vLLM is installed, its engine saves any architecture it builds (reshard's "
            f"default there, and --sharding vllm): install vLLM where you reshard. Or use --sharding decoder "
            f"(distload's loaders read it; vLLM's sharded_state loader does not)")
