"""Sharding specs: which tensors are split across tensor-parallel ranks, along which dimension.

A sharding spec is an ordered list of rules; the first rule whose glob matches a tensor's full name
wins. A rule either replicates the tensor or splits it along ``dim`` (column-parallel layers split
the output rows, dim 0; row-parallel layers split the input columns, dim 1). What rank r then
holds of a tensor (head boundaries, KV-head replication, vocabulary padding) is decided in one
place, distload/tp/slices.py.

Built-in specs:

- ``decoder`` (aliases llama, mistral, qwen2, qwen3): vLLM's layout, shape for shape: q/k/v split
  between heads, KV heads replicated when the tensor-parallel size exceeds them, embed_tokens and
  lm_head padded to a multiple of 64 rows first. Heads come from the model's config.json.
- ``vllm``: the ``decoder`` slices under the names vLLM's engine holds (fused ``qkv_proj`` and
  ``gate_up_proj``, the attention layers' 0-d scales, tied embeddings as ``lm_head``), so that
  vLLM's ``sharded_state`` loaders read a save; the default of ``reshard``. For the
  architectures distload/tp/vllm_names.py names.
- ``plain``: the same tensors split evenly, ignoring heads and padding (for models that are not
  served by vLLM, and for checkpoints saved before vLLM's layout was the default).
- ``replicate``: every tensor whole on every rank.

Spec file (JSON)::

    {"name": "my-model",
     "rules": [
       {"match": "*.qkv_proj.weight", "split": 0, "fused": [4096, 1024, 1024]},
       {"match": "*.gate_up_proj.weight", "split": 0, "fused": 2},
       {"match": "*.k_proj.weight", "split": 0, "heads": "kv"},
       {"match": "*embed_tokens.weight", "split": 0, "pad_to": 64},
       {"match": "*.o_proj.weight", "split": 1},
       {"match": "*norm*", "replicate": true}
     ]}

``fused`` is a list of part sizes along ``dim``, an int (that many equal parts), or ``"qkv"``
(q, k and v sized from config.json, each split between heads; with ``"heads": "none"`` each
evenly). ``heads`` ("attention" or "kv") says the dimension is made of heads; ``pad_to`` pads it
with zero rows before splitting.
Pure: no I/O besides reading a spec file; no torch.distributed.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from distload.errors import ConfigError
from distload.tp.slices import Action, BlockScales, Part, file_shape


HEAD_KINDS = ("attention", "kv", "none")  # what a "heads" rule counts; "none": split evenly, ignore heads
VLLM_VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE: embed_tokens and lm_head rows


@dataclass(frozen=True)
class Rule:
    match: str
    split: int | None = None  # None: replicate
    fused: tuple[int, ...] | int | str | None = None
    heads: str | None = None  # "attention"/"kv": the split dim is made of heads, never cut; "none": even
    pad_to: int | None = None  # pad the split dim with zero rows to a multiple of this first

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"match": self.match}
        if self.split is None:
            out["replicate"] = True
        else:
            out["split"] = self.split
        if self.fused is not None:
            out["fused"] = list(self.fused) if isinstance(self.fused, tuple) else self.fused
        if self.heads is not None:
            out["heads"] = self.heads
        if self.pad_to is not None:
            out["pad_to"] = self.pad_to
        return out


@dataclass(frozen=True)
class ShardingSpec:
    name: str
    rules: tuple[Rule, ...]
    config: Mapping[str, Any] = field(default_factory=dict)  # the source's config.json, for heads
    # Whose state-dict names a save writes: None, the checkpoint's own; "vllm", vLLM's engine's
    # (fused q/k/v and gate/up, its attention scales, tied embeddings: distload/tp/vllm_names.py).
    engine: str | None = None

    @property
    def needs_model_config(self) -> bool:
        """Some rule sizes heads or fused q/k/v parts from the model's config.json."""
        return any(r.heads in ("attention", "kv") or r.fused == "qkv" for r in self.rules)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "rules": [r.to_json() for r in self.rules]}
        if self.engine is not None:
            out["engine"] = self.engine
        dims = attention_dims(self.config)
        if dims is not None and any(r.heads or r.fused == "qkv" for r in self.rules):
            # What the head-aware rules were sized with, so the manifest alone says how to reassemble.
            out["config"] = {"num_attention_heads": dims.heads, "num_key_value_heads": dims.kv_heads,
                             "head_dim": dims.head_dim, **mla_config(self.config)}
        return out

    def action(self, name: str, shape: Sequence[int], packing: int = 1) -> Action:
        """The action for tensor ``name`` of torch ``shape``. ``packing``: values per torch element
        along the last dimension (2 for F4: rules count the header's values, torch holds pairs)."""
        for rule in self.rules:
            if fnmatch.fnmatchcase(name, rule.match):
                if rule.split is None:
                    return Action(None, None, rule.match)
                if rule.split >= len(shape):  # shard_shape says so, naming the tensor
                    return Action(rule.split, None, rule.match)
                if rule.pad_to is not None:
                    return Action(rule.split, None, rule.match, pad_to=rule.pad_to, packing=packing)
                along = packing if rule.split == len(shape) - 1 else 1  # only the last dimension is packed
                try:
                    return Action(rule.split, self._parts(rule, name, shape, along), rule.match, packing=packing)
                except _Deferred as exc:  # only an error once the tensor is split (TP > 1)
                    return Action(rule.split, None, rule.match, unresolved=str(exc), packing=packing)
        return Action(None, None, None)

    def _parts(self, rule: Rule, name: str, shape: Sequence[int], packing: int) -> tuple[Part, ...] | None:
        """``packing``: values per torch element along the split dimension (F4's last)."""
        assert rule.split is not None
        length = shape[rule.split] * packing  # in the header's values, as the rules count
        shape = file_shape(shape, packing) if packing > 1 else shape  # messages quote the file's
        if rule.heads in ("attention", "kv"):
            dims = self._dims(rule, name)
            heads = dims.heads if rule.heads == "attention" else dims.kv_heads
            head_dim = mla_head_dim(self.config, name) or dims.head_dim
            parts: tuple[Part, ...] = (_heads_part(heads, head_dim, rule.heads),)
        elif rule.fused is None:
            return None
        elif isinstance(rule.fused, int):
            if length % rule.fused:
                raise ConfigError(
                    f"tensor {name!r} shape {list(shape)}: dim {rule.split} ({length}) cannot be cut "
                    f"into {rule.fused} equal fused parts (rule {rule.match!r})"
                )
            parts = (Part(length // rule.fused),) * rule.fused
        elif rule.fused == "qkv" and rule.heads == "none":  # the plain spec: each part split evenly
            dims = self._dims(rule, name)
            parts = (Part(dims.heads * dims.head_dim),) + (Part(dims.kv_heads * dims.head_dim),) * 2
        elif rule.fused == "qkv":
            dims = self._dims(rule, name)
            parts = (_heads_part(dims.heads, dims.head_dim, "attention"),
                     _heads_part(dims.kv_heads, dims.head_dim, "kv"),
                     _heads_part(dims.kv_heads, dims.head_dim, "kv"))
        else:
            parts = tuple(Part(size) for size in rule.fused)
        total = sum(p.size for p in parts)
        if total != length:
            from_config = rule.heads in ("attention", "kv") or rule.fused == "qkv"
            what = "the fused parts " + str([p.size for p in parts]) if len(parts) > 1 else \
                f"{parts[0].units} {parts[0].what} of {parts[0].unit} rows (from config.json)"
            # Sized from config.json, a mismatch may be a tensor the config does not describe (a
            # vision tower's q_proj): an error only once it is split.
            error = _Deferred if from_config else ConfigError
            raise error(
                f"tensor {name!r} shape {list(shape)}: {what} of rule {rule.match!r} add up to "
                f"{total}, but dim {rule.split} is {length}; the config.json beside the weights does "
                f"not describe this tensor, or the sharding spec does not fit the model"
            )
        if packing > 1:
            if any(p.size % packing or p.unit % packing and p.unit > 1 for p in parts):
                raise ConfigError(f"tensor {name!r}: the parts {[p.size for p in parts]} of rule {rule.match!r} "
                                  f"cut between the {packing} values packed in one element")
            parts = tuple(Part(p.size // packing, max(1, p.unit // packing), p.replicable, p.what) for p in parts)
        return parts

    def _dims(self, rule: Rule, name: str) -> "AttentionDims":
        dims = attention_dims(self.config)
        if dims is None:
            # One message per rule, not per tensor: a 32-layer model must not print it 96 times.
            needs = ("the model's config.json beside the weights with num_attention_heads, "
                     f"num_key_value_heads and hidden_size (or head_dim); {_config_problem(self.config)}")
            example = _layer_free(name)
            # A config.json that is there but says something wrong is fixed, not put there.
            fix = "Fix that in the config.json beside the weights" if self.config else \
                "Put the model's config.json next to the weights"
            if rule.heads == "none":  # an even split, but the fused parts still need their sizes
                raise _NeedsConfig(
                    f"sharding spec {self.name!r} cuts the fused tensors matching {rule.match!r} (such as "
                    f"{example!r}) into q, k and v, sized from {needs}. {fix}, or give the sizes in a spec file: "
                    f'{{"match": "{rule.match}", "split": 0, "fused": [q, k, v]}}'
                )
            raise _NeedsConfig(
                f"sharding spec {self.name!r} splits the tensors matching {rule.match!r} (such as "
                f"{example!r}) between attention heads, as vLLM does, which needs {needs}. {fix}, or "
                f"choose --sharding plain for an even split that does not look at heads"
            )
        return dims


class _Deferred(ConfigError):
    """A problem that matters only once the tensor is split (at TP 1 every rank holds it whole)."""


class _NeedsConfig(_Deferred):
    pass


def _layer_free(name: str) -> str:
    """``model.layers.7.self_attn.q_proj.weight`` -> ``model.layers.N.self_attn.q_proj.weight``."""
    return ".".join("N" if part.isdigit() else part for part in name.split("."))


def _heads_part(heads: int, head_dim: int, kind: str) -> Part:
    if kind == "kv":
        return Part(heads * head_dim, head_dim, replicable=True, what="KV heads")
    return Part(heads * head_dim, head_dim, replicable=False, what="attention heads")


@dataclass(frozen=True)
class AttentionDims:
    heads: int
    kv_heads: int
    head_dim: int


def attention_dims(config: Mapping[str, Any]) -> AttentionDims | None:
    """Heads, KV heads and head size from a Hugging Face config.json (None if it has not them).

    As transformers and vLLM read them: ``num_key_value_heads`` defaults to the attention heads,
    ``head_dim`` to hidden_size // heads; a multimodal model's text part is its ``text_config``.
    """
    if "num_attention_heads" not in config and isinstance(config.get("text_config"), Mapping):
        config = config["text_config"]
    try:
        heads = _positive(config["num_attention_heads"])
        kv = config.get("num_key_value_heads")  # 0 is a wrong value, not an absent one
        kv_heads = heads if kv is None else _positive(kv)
        head_dim = config.get("head_dim")
        head_dim = _positive(head_dim) if head_dim else _positive(config["hidden_size"]) // heads
    except (KeyError, TypeError, ValueError):
        return None
    if head_dim < 1:
        return None
    return AttentionDims(heads, kv_heads, head_dim)


MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")  # what sizes MLA's heads


def mla_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config.json keys :func:`mla_head_dim` sizes heads with (none for a model without MLA):
    a spec's JSON form carries them, or a weight-sync trainer rank given a receiver's spec would
    size MLA's heads by ``head_dim`` and refuse its ``kv_b_proj``."""
    if "kv_lora_rank" not in config and isinstance(config.get("text_config"), Mapping):
        config = config["text_config"]
    return {key: config[key] for key in MLA_KEYS if key in config} if config.get("kv_lora_rank") else {}


def mla_head_dim(config: Mapping[str, Any], name: str) -> int | None:
    """The rows one attention head has in a multi-head latent attention (DeepSeek-V2/V3, Kimi-K2)
    projection, as vLLM splits them: q (``q_proj``, ``q_b_proj``) qk_nope + qk_rope, ``kv_b_proj``
    qk_nope + v_head_dim, ``o_proj`` v_head_dim. None: not MLA (config.json has no kv_lora_rank)."""
    if "kv_lora_rank" not in config and isinstance(config.get("text_config"), Mapping):
        config = config["text_config"]
    try:
        if not config.get("kv_lora_rank"):
            return None
        nope, rope, v = (_positive(config[k]) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    except (KeyError, TypeError, ValueError):
        return None
    layer = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
    return {"q_proj": nope + rope, "q_b_proj": nope + rope, "kv_b_proj": nope + v, "o_proj": v}.get(layer)


def _config_problem(config: Mapping[str, Any]) -> str:
    """Why attention_dims found no sizes in ``config``, for a message."""
    if not config:
        return "there is none"
    if "num_attention_heads" not in config and isinstance(config.get("text_config"), Mapping):
        config = config["text_config"]
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size"):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return f"its {key} is {value!r} ({type(value).__name__}), not a positive int"
    if "num_attention_heads" not in config:
        return "it has no num_attention_heads"
    return "it has neither head_dim nor hidden_size, or hidden_size is smaller than its heads"


def _positive(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(value)
    return value


_COLUMN = ("gate_proj", "up_proj", "w1", "w3")  # MLP layers whose output rows are split
_ROW = ("down_proj", "w2")  # MLP layers whose input columns are split


# Where vLLM keeps a layer's stacks: ``mlp.experts.w13_weight``, and from 0.32 on
# ``mlp.experts.routed_experts.w13_weight`` (its engine's saves name them so).
_STACKS = ("experts", "routed_experts")


def _stacked_expert_rules() -> list[Rule]:
    """vLLM's fused MoE stacks, every expert along dim 0, as its FusedMoE splits them by TP:
    ``w13_weight`` [E, 2I, H] as [gate; up], each half by rows; ``w2_weight`` [E, H, I] by its
    input columns. Expert parallelism keeps a rank's experts' rows of dim 0 (distload/tp/experts.py),
    each cut so. Their block scales (``w13_weight_scale_inv``) go with them on block boundaries;
    a stack that is not gate and up (gpt-oss interleaves them, a non-gated MoE has no up) and
    companions that vary along the split (per-channel scales, biases) are refused by
    :func:`carry_block_scales`, which sees every tensor.
    transformers 5's in-memory ``experts.gate_up_proj`` has no rule: Llama 4's checkpoints save a
    stack of that name as [E, H, 2I], so the name does not say which dim is the output's."""
    return [Rule(f"*.{stack}.w13_weight", 1, 2) for stack in _STACKS] + \
        [Rule(f"*.{stack}.w2_weight", 2) for stack in _STACKS]


def _decoder_rules() -> tuple[Rule, ...]:
    """vLLM's tensor-parallel layout of a Hugging Face decoder, tensor for tensor."""
    rules = [Rule("*embed_tokens.weight", 0, pad_to=VLLM_VOCAB_PADDING),
             Rule("lm_head.weight", 0, pad_to=VLLM_VOCAB_PADDING),
             Rule("*.lm_head.weight", 0, pad_to=VLLM_VOCAB_PADDING)]
    rules += _stacked_expert_rules()
    for suffix in ("weight", "bias"):
        rules += [Rule(f"*.q_proj.{suffix}", 0, heads="attention"),
                  Rule(f"*.k_proj.{suffix}", 0, heads="kv"), Rule(f"*.v_proj.{suffix}", 0, heads="kv"),
                  Rule(f"*.qkv_proj.{suffix}", 0, "qkv")]
        rules += [Rule(f"*.{proj}.{suffix}", 0) for proj in _COLUMN]
    # Multi-head latent attention (DeepSeek-V3): the up-projections split between heads, as vLLM's
    # ColumnParallelLinear; the low-rank q_a_proj and kv_a_proj_with_mqa stay whole (ReplicatedLinear).
    rules += [Rule("*.q_b_proj.weight", 0, heads="attention"), Rule("*.kv_b_proj.weight", 0, heads="attention")]
    rules += [Rule("*.gate_up_proj.weight", 0, 2), Rule("*.o_proj.weight", 1, heads="attention")]
    rules += [Rule(f"*.{proj}.weight", 1) for proj in _ROW]
    rules += _whole_rules()
    return tuple(rules)


def _plain_rules() -> tuple[Rule, ...]:
    """The same tensors split evenly over the ranks: no head boundaries, no vocabulary padding."""
    column = ("q_proj", "k_proj", "v_proj") + _COLUMN
    rules = [Rule("*embed_tokens.weight", 0), Rule("lm_head.weight", 0), Rule("*.lm_head.weight", 0)]
    rules += _stacked_expert_rules()
    rules += [Rule(f"*.{proj}.{suffix}", 0) for suffix in ("weight", "bias") for proj in column]
    rules += [Rule("*.qkv_proj.weight", 0, "qkv", heads="none"), Rule("*.qkv_proj.bias", 0, "qkv", heads="none"),
              Rule("*.gate_up_proj.weight", 0, 2), Rule("*.o_proj.weight", 1),
              Rule("*.q_b_proj.weight", 0), Rule("*.kv_b_proj.weight", 0)]
    rules += [Rule(f"*.{proj}.weight", 1) for proj in _ROW]
    rules += _whole_rules()
    return tuple(rules)


def _whole_rules() -> list[Rule]:
    # A row-parallel layer's bias is added once, after the all-reduce: every rank keeps it whole.
    return [Rule(f"*.{proj}.bias", None) for proj in ("o_proj",) + _ROW] + \
        [Rule("*norm*", None), Rule("*rotary_emb*", None)]


BUILTIN_SPECS: dict[str, tuple[Rule, ...]] = {
    # Llama, Mistral, Qwen2/3 and most Hugging Face decoders share these names.
    "decoder": _decoder_rules(),
    "vllm": _decoder_rules(),  # the decoder's slices under vLLM's engine names (ENGINES)
    "plain": _plain_rules(),
    "replicate": (Rule("*", None),),
}
SPEC_ALIASES = {"llama": "decoder", "mistral": "decoder", "qwen2": "decoder", "qwen3": "decoder"}
ENGINES = {"vllm": "vllm"}  # built-in spec -> the engine whose names its saves write


def spec_with_config(sharding: "str | ShardingSpec | None", read_config: Callable[[], Mapping[str, Any]]) -> ShardingSpec:
    """The spec, sized with the model's config.json only when a rule needs heads (a checkpoint's
    config.json is not read, and a broken one not refused, for a spec that never looks at it)."""
    spec = sharding if isinstance(sharding, ShardingSpec) else load_spec(sharding)
    if spec.config or not spec.needs_model_config:
        return spec
    return ShardingSpec(spec.name, spec.rules, dict(read_config()), spec.engine)


def load_spec(spec: str | None, config: Mapping[str, Any] | None = None) -> ShardingSpec:
    """A built-in sharding spec by name, or a JSON spec file by path.

    Args:
        spec: ``vllm``, ``decoder`` (aliases ``llama``, ``mistral``, ``qwen2``, ``qwen3``),
            ``plain``, ``replicate``, or a JSON spec file's path; None: ``decoder``.
        config: the model's ``config.json`` as a dict: the heads head-aware rules split by.

    Returns:
        The spec, which gives each tensor's action (replicate, or split along a dimension).

    Raises:
        ConfigError: neither a built-in spec nor a readable spec file.
    """
    config = dict(config or {})
    spec = spec or "decoder"
    key = SPEC_ALIASES.get(spec.lower(), spec.lower())
    if key in BUILTIN_SPECS:
        return ShardingSpec(key, BUILTIN_SPECS[key], config, ENGINES.get(key))
    if not os.path.isfile(spec):
        raise ConfigError(
            f"--sharding {spec!r} is neither a built-in sharding spec ({', '.join(sorted(BUILTIN_SPECS))}, "
            f"or {', '.join(sorted(SPEC_ALIASES))}) nor a spec file"
        )
    try:
        with open(spec, encoding="utf-8") as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"sharding spec file {spec}: not valid JSON ({exc})") from None
    return spec_from_json(raw, config, where=f"sharding spec file {spec}")


def spec_from_json(raw: Any, config: Mapping[str, Any] | None = None, where: str = "sharding spec") -> ShardingSpec:
    """A spec from its JSON form (a spec file, or the one a manifest recorded with its "config")."""
    if not isinstance(raw, dict) or not isinstance(raw.get("rules"), list):
        raise ConfigError(f"{where}: expected an object with a 'rules' list")
    rules = []
    for i, item in enumerate(raw["rules"]):
        rules.append(_rule_from_json(item, f"{where}, rule {i}"))
    recorded = raw.get("config")
    if recorded is not None and not isinstance(recorded, dict):
        raise ConfigError(f"{where}: 'config' must be an object (num_attention_heads, num_key_value_heads, head_dim)")
    engine = raw.get("engine")
    if engine is not None and engine not in set(ENGINES.values()):
        raise ConfigError(f"{where}: 'engine' must be one of {sorted(set(ENGINES.values()))} (whose state-dict "
                          f"names a save writes), or absent for the checkpoint's own names")
    return ShardingSpec(str(raw.get("name", "custom")), tuple(rules), {**(recorded or {}), **(config or {})}, engine)


_RULE_KEYS = ("match", "split", "replicate", "fused", "heads", "pad_to")


def _rule_from_json(item: Any, where: str) -> Rule:
    if not isinstance(item, dict) or not isinstance(item.get("match"), str):
        raise ConfigError(f"{where}: each rule needs a 'match' glob string")
    unknown = set(item) - set(_RULE_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; allowed: {', '.join(_RULE_KEYS)}")
    if item.get("replicate") is True:
        if set(item) - {"match", "replicate"}:
            raise ConfigError(f"{where}: a rule either replicates or splits, not both")
        return Rule(item["match"], None)
    split = item.get("split")
    if isinstance(split, bool) or not isinstance(split, int) or split < 0:
        raise ConfigError(f"{where}: 'split' must be a dimension index >= 0 (or use \"replicate\": true)")
    given = [key for key in ("fused", "heads", "pad_to") if item.get(key) is not None]
    if len(given) > 1 and not (given == ["fused", "heads"] and item["fused"] == "qkv"):
        raise ConfigError(f"{where}: a rule takes one of 'fused', 'heads' and 'pad_to', not {' and '.join(given)} "
                          f"(only \"fused\": \"qkv\" takes \"heads\": \"none\")")
    heads = item.get("heads")
    if heads is not None and heads not in HEAD_KINDS:
        raise ConfigError(f"{where}: 'heads' must be \"attention\", \"kv\" (KV heads, replicated "
                          f"when there are fewer than ranks) or \"none\" (an even split)")
    if item.get("fused") == "qkv" and heads not in (None, "none"):
        raise ConfigError(f"{where}: \"fused\": \"qkv\" is split between heads already; \"heads\" may "
                          f"only be \"none\" there (an even split of each part)")
    pad_to = item.get("pad_to")
    if pad_to is not None and (isinstance(pad_to, bool) or not isinstance(pad_to, int) or pad_to < 1):
        raise ConfigError(f"{where}: 'pad_to' must be a whole number of rows >= 1 (vLLM pads vocabularies to 64)")
    fused = item.get("fused")
    if fused is None or fused == "qkv":
        return Rule(item["match"], split, fused, heads=heads, pad_to=pad_to)
    if isinstance(fused, int) and not isinstance(fused, bool) and fused >= 1:
        return Rule(item["match"], split, fused)
    if (isinstance(fused, list) and fused
            and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in fused)):
        return Rule(item["match"], split, tuple(fused))
    raise ConfigError(f"{where}: 'fused' must be a list of part sizes, a number of equal parts, or \"qkv\"")


# Quantization tensors that belong to a weight: block scales (FP8 block-wise, MXFP4/NVFP4) have
# one entry per block of the weight and would have to be split with it.
# vLLM's fused MoE layers name a stacked weight's block scales the same way with "_"
# (``experts.w13_weight``, ``experts.w13_weight_scale_inv`` [E, ...]); its other stacked scales
# (``w13_weight_scale`` [E] or [E, 2]: one per expert, or per expert and shard) stay whole.
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".weight_scale_2", ".weight_zero_point",
                   ".weight_global_scale", ".weight_packed_scale", ".scales", ".qzeros", "_weight_scale_inv")
# The ones a split weight carries with it, cut on its blocks: FP8 block-wise scales as DeepSeek-V3
# and Qwen3-FP8 name them (``X.weight`` float8_e4m3fn, ``X.weight_scale_inv`` float32 beside it,
# one per block of ``quantization_config.weight_block_size``), and vLLM's stacked ones.
BLOCK_SCALE_SUFFIXES = (".weight_scale_inv", "_weight_scale_inv")
# A vLLM stack's other companions (``w13_weight_scale``, ``w13_bias``): whole where they hold one
# value per expert or per expert and shard ([E], [E, 2]); refused beside a split stack where they
# vary along the split dim (per-channel scales [E, 2I, 1], biases [E, 2I], MXFP4 scales).
_STACK_COMPANIONS = ("_weight_scale", "_weight_scale_2", "_weight_zero_point", "_weight_global_scale",
                     "_weight_packed_scale", "_bias")
# vLLM's built-in rule for a stack of [gate; up] (its FusedMoE's w13), checked against w2 beside it.
_GATE_UP = "w13_weight"
_COMMON_BLOCK = 128  # DeepSeek-V3's and Qwen3-FP8's weight_block_size, preferred where shapes allow


def carry_block_scales(tensors: Sequence[tuple[str, Sequence[int], Action]],
                       config: "Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None" = None
                       ) -> dict[str, Action]:
    """Every tensor's action, with the block scales of a split weight split with it.

    ``tensors``: (name, torch shape, the spec's action) of a whole checkpoint. A weight ``X.weight``
    that the spec splits carries ``X.weight_scale_inv`` (one scale per block) along the same
    dimension, cut on block boundaries: weight rows ``[a, b)`` -> scale rows ``[a / B, b / B)``;
    whether every rank's rows fall on them is checked once the TP size is known (rank_slice).
    The block size ``B`` is config.json's ``quantization_config.weight_block_size`` where given,
    else inferred from the two shapes. A scale beside a replicated weight stays replicated; a scale
    a rule of the spec matches keeps that rule. Other block-wise quantization tensors beside a
    split weight (zero points, NVFP4's scales) are refused, as a rank would get all of them.

    ``config``: the model's config.json, or a function that reads it (called only if needed).
    """
    actions = {name: action for name, _, action in tensors}
    shapes = {name: tuple(int(n) for n in shape) for name, shape, _ in tensors}
    read: list[Mapping[str, Any]] = []

    def model_config() -> Mapping[str, Any]:
        if not read:
            read.append(dict((config() if callable(config) else config) or {}))
        return read[0]

    for name, shape, action in tensors:
        if name.endswith("." + _GATE_UP) and action.parts is not None and len(action.parts) == 2:
            _check_gate_up(name, shapes, action, model_config)
        if not action.replicated or action.rule is not None:
            continue  # a rule chose what happens to it
        companion = next((s for s in _STACK_COMPANIONS if name.endswith(s)), None)
        if companion is not None:
            _check_companion(name, shapes, actions, companion)
            continue
        suffix = next((s for s in _SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix is None or math.prod(shape) <= 1:
            continue
        weight = name[: -len(suffix)] + suffix[0] + "weight"  # X.weight's, or vLLM's stacked X_weight's
        split = actions.get(weight)
        if split is None or split.replicated:
            continue
        if suffix not in BLOCK_SCALE_SUFFIXES or split.ranges is not None:
            raise ConfigError(
                f"tensor {name!r} (shape {list(shape)}) holds the quantization scales of {weight!r}, which "
                f"the sharding spec splits along dim {split.dim}; distload splits FP8 block scales named "
                f"'X.weight_scale_inv' (DeepSeek-V3, Qwen3-FP8) with their weight, not {suffix[1:]!r}, and a "
                f"rank would get part of a weight with all of its scales. Load this checkpoint without tensor "
                f"parallelism, or give a rule for the scales in a sharding spec file"
            )
        block, source = block_size(name, shape, weight, shapes[weight], split.dim, model_config())
        actions[name] = Action(split.dim, None, f"{split.rule} (block scales of {weight})",
                               scales=BlockScales(weight, shapes[weight], split, block, source))
    return actions


def _check_gate_up(name: str, shapes: Mapping[str, tuple[int, ...]], action: Action,
                   model_config: Callable[[], Mapping[str, Any]]) -> None:
    """Refuse a stack that a rule splits as [gate; up] where it is not: gpt-oss interleaves gate
    and up rows (vLLM gives each rank a contiguous run of them), and a non-gated MoE's w13 holds
    one matrix, its rows w2's columns (vLLM splits it in one part)."""
    config = model_config()
    model_type = config.get("model_type") or (config.get("text_config") or {}).get("model_type")
    w2 = shapes.get(name[: -len(_GATE_UP)] + "w2_weight")
    rows = shapes[name][action.dim] if action.dim is not None and action.dim < len(shapes[name]) else None
    if model_type == "gpt_oss":
        why = "gpt-oss interleaves the gate and up rows of each expert"
    elif w2 is not None and len(w2) == 3 and rows is not None and rows == w2[2]:
        why = f"it has {rows} rows, as many as w2 {list(w2)} has columns: a non-gated MoE, no up half"
    else:
        return
    raise ConfigError(
        f"tensor {name!r} (shape {list(shapes[name])}) is not gate and up stacked one after the other, which rule "
        f"{action.rule!r} splits in two halves: {why}. Give a sharding spec file whose rule splits it along dim "
        f"{action.dim} in one part ({{\"match\": \"*.experts.{_GATE_UP}\", \"split\": {action.dim}}}), or load "
        f"without tensor parallelism")


def _check_companion(name: str, shapes: Mapping[str, tuple[int, ...]], actions: Mapping[str, Action],
                     suffix: str) -> None:
    """Refuse a stack's companion (``w13_bias``, ``w13_weight_scale``) that varies along the dim
    a rule splits its stack: a rank would get part of the stack with all of it."""
    stack = name[: -len(suffix)] + "_weight"
    split = actions.get(stack)
    shape = shapes[name]
    if split is None or split.replicated or split.dim is None or stack not in shapes:
        return
    if split.dim < len(shape) and shape[split.dim] == shapes[stack][split.dim] > 1:
        raise ConfigError(
            f"tensor {name!r} (shape {list(shape)}) goes with {stack!r} (shape {list(shapes[stack])}), which the "
            f"sharding spec splits along dim {split.dim} (rule {split.rule!r}), and it varies along that dim too; "
            f"distload splits only FP8 block scales ('X_weight_scale_inv') with a stack, and a rank would get part "
            f"of the stack with all of it. Give a rule for it in a sharding spec file, or load without tensor "
            f"parallelism")


def check_scales(tensors: Sequence[tuple[str, Sequence[int], Action]]) -> None:
    """Refuse quantization scales that cannot go with their split weight (carry_block_scales,
    block sizes inferred from the shapes)."""
    carry_block_scales(tensors)


def block_size(name: str, shape: Sequence[int], weight: str, weight_shape: Sequence[int], dim: int,
               config: Mapping[str, Any]) -> tuple[int, str]:
    """The weight's rows (or columns) per scale entry along ``dim``, and where that came from."""
    shape, weight_shape = list(shape), list(weight_shape)
    if len(shape) != len(weight_shape):
        raise ConfigError(
            f"tensor {name!r} (shape {shape}) is not one scale per block of {weight!r} (shape {weight_shape}): "
            f"they have different numbers of dimensions, so the scales cannot be split with the weight")
    quant = config.get("quantization_config")
    if not isinstance(quant, Mapping) and isinstance(config.get("text_config"), Mapping):
        quant = config["text_config"].get("quantization_config")
    given = quant.get("weight_block_size") if isinstance(quant, Mapping) else None
    if isinstance(given, list) and len(given) == len(shape) - 1 >= 1 and shape[0] == weight_shape[0]:
        given = [1] + given  # a stack of experts [E, ...]: the blocks are each expert's, one expert a row
    if given is not None:
        where = "config.json's quantization_config.weight_block_size"
        if (not isinstance(given, list) or len(given) != len(shape)
                or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in given)):
            raise ConfigError(f"{where} is {given!r}: expected {len(shape)} whole numbers >= 1, one per "
                              f"dimension of {weight!r}")
        want = [-(-w // b) for w, b in zip(weight_shape, given)]
        if want != shape:
            raise ConfigError(
                f"tensor {name!r} has shape {shape}, but {weight!r} (shape {weight_shape}) in blocks of {given} "
                f"({where}) has {want}: the scales do not belong to blocks of that size")
        return given[dim], f"{where} {given}"
    inferred = _infer_block(weight_shape[dim], shape[dim])
    if inferred is None:
        raise ConfigError(
            f"tensor {name!r} (shape {shape}) is not one scale per block of {weight!r} (shape {weight_shape}) "
            f"along dim {dim}: no block size gives {shape[dim]} blocks of {weight_shape[dim]}. Give the block "
            f"size in config.json as quantization_config.weight_block_size")
    return inferred, f"inferred from the shapes {weight_shape} and {shape}; config.json gives no weight_block_size"


def _infer_block(length: int, count: int) -> int | None:
    """A block size B with ceil(length / B) == count: 128 where it fits (DeepSeek-V3, Qwen3-FP8),
    else the exact tiling, else the largest power of two that fits, else the smallest that does."""
    if count < 1 or count > max(length, 1):
        return None
    lo = -(-length // count)  # the smallest B that makes at most ``count`` blocks
    hi = -(-length // (count - 1)) - 1 if count > 1 else max(length, _COMMON_BLOCK)
    if lo > hi or -(-length // lo) != count:
        return None
    if lo <= _COMMON_BLOCK <= hi:
        return _COMMON_BLOCK
    if length % count == 0:
        return length // count
    powers = [1 << k for k in range(hi.bit_length() + 1) if lo <= 1 << k <= hi]
    return powers[-1] if powers else lo
