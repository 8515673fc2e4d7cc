"""Sharding specs: which tensors are split across tensor-parallel ranks, along which dimension.

A sharding spec is an ordered list of rules; the first rule whose glob matches a tensor's full name wins.
A rule either replicates the tensor or splits it along ``dim`` (column-parallel layers split the
output rows, dim 0; row-parallel layers split the input columns, dim 1). A *fused* tensor (one qkv
or gate_up weight) is cut into its parts along ``dim`` first and each part is split separately,
so rank r gets ``[q_r; k_r; v_r]`` rather than a slice straddling q and k.

Spec file (JSON)::

    {"name": "my-model",
     "rules": [
       {"match": "*.qkv_proj.weight", "split": 0, "fused": [4096, 1024, 1024]},
       {"match": "*.gate_up_proj.weight", "split": 0, "fused": 2},
       {"match": "*.o_proj.weight", "split": 1},
       {"match": "*norm*", "replicate": true}
     ]}

``fused`` is a list of part sizes along ``dim``, an int (that many equal parts), or ``"qkv"``
(sizes from the source's config.json: heads x head_dim, kv_heads x head_dim twice).
Pure: no I/O besides reading a spec file; no torch.distributed.
"""

from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from distload.errors import ConfigError


@dataclass(frozen=True)
class Rule:
    match: str
    split: int | None = None  # None: replicate
    fused: tuple[int, ...] | int | str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"match": self.match}
        if self.split is None:
            out["replicate"] = True
        else:
            out["split"] = self.split
        if self.fused is not None:
            out["fused"] = list(self.fused) if isinstance(self.fused, tuple) else self.fused
        return out


@dataclass(frozen=True)
class Action:
    """What happens to one tensor: replicate, or split along ``dim`` (in ``parts`` if fused)."""

    dim: int | None
    parts: tuple[int, ...] | None = None  # sizes along dim of the fused parts
    rule: str | None = None  # the glob that decided; None: no rule matched (replicated)

    @property
    def replicated(self) -> bool:
        return self.dim is None


@dataclass(frozen=True)
class ShardingSpec:
    name: str
    rules: tuple[Rule, ...]
    config: Mapping[str, Any] = field(default_factory=dict)  # the source's config.json, for "qkv"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "rules": [r.to_json() for r in self.rules]}

    def action(self, name: str, shape: Sequence[int]) -> Action:
        for rule in self.rules:
            if fnmatch.fnmatchcase(name, rule.match):
                if rule.split is None:
                    return Action(None, None, rule.match)
                return Action(rule.split, self._parts(rule, name, shape), rule.match)
        return Action(None, None, None)

    def _parts(self, rule: Rule, name: str, shape: Sequence[int]) -> tuple[int, ...] | None:
        if rule.fused is None:
            return None
        assert rule.split is not None
        if rule.split >= len(shape):
            return None  # checked (with a clear error) in shard_shape
        length = shape[rule.split]
        if isinstance(rule.fused, int):
            if length % rule.fused:
                raise ConfigError(
                    f"tensor {name!r} shape {list(shape)}: dim {rule.split} ({length}) cannot be cut "
                    f"into {rule.fused} equal fused parts (rule {rule.match!r})"
                )
            return (length // rule.fused,) * rule.fused
        if rule.fused == "qkv":
            parts = qkv_sizes(self.config, name)
        else:
            parts = tuple(rule.fused)
        if sum(parts) != length:
            raise ConfigError(
                f"tensor {name!r} shape {list(shape)}: the fused parts {list(parts)} of rule "
                f"{rule.match!r} add up to {sum(parts)}, but dim {rule.split} is {length}"
            )
        return parts


def qkv_sizes(config: Mapping[str, Any], name: str) -> tuple[int, int, int]:
    try:
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads", heads))
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError):
        raise ConfigError(
            f"tensor {name!r} is a fused qkv weight, but the source has no config.json with "
            f"num_attention_heads and hidden_size (or head_dim) to size q, k and v; give the sizes "
            f"in a sharding spec file: {{\"match\": \"*qkv_proj.weight\", \"split\": 0, \"fused\": [q, k, v]}}"
        ) from None
    return heads * head_dim, kv_heads * head_dim, kv_heads * head_dim


def _decoder_rules() -> tuple[Rule, ...]:
    column = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3"]
    row = ["o_proj", "down_proj", "w2"]
    rules = [Rule("*embed_tokens.weight", 0), Rule("lm_head.weight", 0), Rule("*.lm_head.weight", 0)]
    rules += [Rule(f"*.{proj}.weight", 0) for proj in column]
    rules += [Rule(f"*.{proj}.bias", 0) for proj in column]
    rules += [Rule("*.qkv_proj.weight", 0, "qkv"), Rule("*.qkv_proj.bias", 0, "qkv"),
              Rule("*.gate_up_proj.weight", 0, 2)]
    rules += [Rule(f"*.{proj}.weight", 1) for proj in row]
    # A row-parallel layer's bias is added once, after the all-reduce: every rank keeps it whole.
    rules += [Rule(f"*.{proj}.bias", None) for proj in row]
    rules += [Rule("*norm*", None), Rule("*rotary_emb*", None)]
    return tuple(rules)


BUILTIN_SPECS: dict[str, tuple[Rule, ...]] = {
    # Llama, Mistral, Qwen2/3 and most Hugging Face decoders share these names.
    "decoder": _decoder_rules(),
    "replicate": (Rule("*", None),),
}
SPEC_ALIASES = {"llama": "decoder", "mistral": "decoder", "qwen2": "decoder", "qwen3": "decoder"}


def load_spec(spec: str | None, config: Mapping[str, Any] | None = None) -> ShardingSpec:
    """A built-in sharding spec by name (default ``decoder``), or a JSON spec file by path."""
    config = dict(config or {})
    spec = spec or "decoder"
    key = SPEC_ALIASES.get(spec.lower(), spec.lower())
    if key in BUILTIN_SPECS:
        return ShardingSpec(key, BUILTIN_SPECS[key], config)
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
    if not isinstance(raw, dict) or not isinstance(raw.get("rules"), list):
        raise ConfigError(f"{where}: expected an object with a 'rules' list")
    rules = []
    for i, item in enumerate(raw["rules"]):
        rules.append(_rule_from_json(item, f"{where}, rule {i}"))
    return ShardingSpec(str(raw.get("name", "custom")), tuple(rules), dict(config or {}))


def _rule_from_json(item: Any, where: str) -> Rule:
    if not isinstance(item, dict) or not isinstance(item.get("match"), str):
        raise ConfigError(f"{where}: each rule needs a 'match' glob string")
    unknown = set(item) - {"match", "split", "replicate", "fused"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; allowed: match, split, replicate, fused")
    if item.get("replicate") is True:
        if "split" in item or "fused" in item:
            raise ConfigError(f"{where}: a rule either replicates or splits, not both")
        return Rule(item["match"], None)
    split = item.get("split")
    if isinstance(split, bool) or not isinstance(split, int) or split < 0:
        raise ConfigError(f"{where}: 'split' must be a dimension index >= 0 (or use \"replicate\": true)")
    fused = item.get("fused")
    if fused is None or fused == "qkv":
        return Rule(item["match"], split, fused)
    if isinstance(fused, int) and not isinstance(fused, bool) and fused >= 1:
        return Rule(item["match"], split, fused)
    if (isinstance(fused, list) and fused
            and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in fused)):
        return Rule(item["match"], split, tuple(fused))
    raise ConfigError(f"{where}: 'fused' must be a list of part sizes, a number of equal parts, or \"qkv\"")


def shard_shape(name: str, shape: Sequence[int], action: Action, world_size: int) -> tuple[int, ...]:
    """The shape each rank holds; raises if the split dimension is not divisible."""
    if action.replicated:
        return tuple(shape)
    dim = action.dim
    assert dim is not None
    if dim >= len(shape):
        raise ConfigError(
            f"tensor {name!r} has shape {list(shape)}, so it has no dim {dim} to split "
            f"(rule {action.rule!r}); fix the sharding spec"
        )
    parts = action.parts or (shape[dim],)
    bad = [p for p in parts if p % world_size]
    if bad:
        what = f"dim {dim} ({shape[dim]})" if action.parts is None else f"fused parts {list(parts)} of dim {dim}"
        raise ConfigError(
            f"tensor {name!r} with shape {list(shape)} cannot be split over {world_size} ranks: "
            f"{what} is not divisible by {world_size} (rule {action.rule!r})"
        )
    out = list(shape)
    out[dim] = shape[dim] // world_size
    return tuple(out)


def take_shard(tensor: torch.Tensor, action: Action, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous piece of ``tensor`` under ``action``."""
    if action.replicated:
        return tensor.contiguous()
    dim = action.dim
    assert dim is not None
    parts = action.parts or (tensor.shape[dim],)
    pieces = []
    for part in torch.split(tensor, list(parts), dim=dim):
        size = part.shape[dim] // world_size
        pieces.append(part.narrow(dim, rank * size, size))
    return pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def reassemble(shards: Sequence[torch.Tensor], action: Action) -> torch.Tensor:
    """The inverse of take_shard over all ranks (for checks and tests)."""
    if action.replicated:
        return shards[0]
    dim = action.dim
    assert dim is not None
    world_size = len(shards)
    parts = action.parts or (sum(s.shape[dim] for s in shards),)
    per_rank = [torch.split(s, [p // world_size for p in parts], dim=dim) for s in shards]
    return torch.cat([torch.cat([pr[i] for pr in per_rank], dim=dim) for i in range(len(parts))], dim=dim)
