"""The tensors a live update writes into: a module's parameters and buffers, or a dict."""

from __future__ import annotations

from typing import Mapping

import torch

from distload.errors import ConfigError


def model_tensors(target: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Name -> tensor of a module's parameters and buffers (tied names included), or a dict's."""
    if isinstance(target, torch.nn.Module):
        named = dict(target.named_parameters(remove_duplicate=False))
        named.update(target.named_buffers(remove_duplicate=False))
        return named
    if isinstance(target, Mapping):
        bad = [k for k, v in target.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise ConfigError(f"target entry {bad[0]!r} is a {type(target[bad[0]]).__name__}, not a tensor")
        return dict(target)
    raise ConfigError(f"the target must be an nn.Module or a dict of tensors, got {type(target).__name__}")


def non_persistent_buffers(target: torch.nn.Module | Mapping[str, torch.Tensor]) -> frozenset[str]:
    """Names of a module's non-persistent buffers (``rotary_emb.inv_freq``, BERT's
    ``token_type_ids``): not in its state dict, so a strict load does not require them, as
    ``nn.Module.load_state_dict(strict=True)`` does not. A checkpoint that has them still fills them."""
    if not isinstance(target, torch.nn.Module):
        return frozenset()
    names = set()
    for prefix, module in target.named_modules(remove_duplicate=False):
        for name in getattr(module, "_non_persistent_buffers_set", ()):
            names.add(f"{prefix}.{name}" if prefix else name)
    return frozenset(names)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The memory this rank writes: a DTensor's local shard, or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return tensor if to_local is None else to_local()
