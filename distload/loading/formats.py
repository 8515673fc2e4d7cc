"""Load formats (vLLM's ``--load-format`` names) and the extra-config keys each one takes.

A format's keys are its own (``pattern`` for the pre-sharded layouts, ``distributed`` for the
cooperative reads: Run:ai's, and distload's own shared reads under ``auto``) plus those of the backends it reads with, each checked by the backend's own
check: adding a key to a backend adds it to every format that reads with it. ``auto`` takes only
the keys that mean something whichever backend it picks.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Mapping

from distload.config import LoadConfig, check_distributed, parse_extra_config
from distload.errors import ConfigError
from distload.loading.backends import BACKENDS
from distload.loading.backends.base import Check
from distload.loading.layout import check_pattern


@dataclass(frozen=True)
class LoadFormat:
    name: str
    backends: tuple[str, ...]  # the backends this format may read with
    own_keys: Mapping[str, Check] = field(default_factory=dict)
    # Of the backends' keys, only these (None: all of them).
    backend_keys: tuple[str, ...] | None = None
    # Keys a user may reasonably try here that this format cannot honour, with the reason.
    why_not: Mapping[str, str] = field(default_factory=dict)

    @property
    def keys(self) -> dict[str, Check]:
        keys: dict[str, Check] = {}
        for backend in self.backends:
            for key, check in BACKENDS[backend].keys.items():
                if self.backend_keys is None or key in self.backend_keys:
                    keys.setdefault(key, check)
        keys.update(self.own_keys)
        return keys


_PATTERN = {"pattern": check_pattern}

FORMATS: dict[str, LoadFormat] = {f.name: f for f in (
    LoadFormat("auto", ("pread", "ranged", "instanttensor", "runai"), {**_PATTERN, "distributed": check_distributed},
               backend_keys=("huge_pages", "concurrency")),
    LoadFormat("safetensors", ("safetensors", "ranged")),
    LoadFormat("runai_streamer", ("runai",), {"distributed": check_distributed}),
    LoadFormat("instanttensor", ("instanttensor",)),
    LoadFormat("sharded_state", ("safetensors", "ranged"), _PATTERN),
    # vLLM rejects concurrency/memory_limit for the sharded Run:ai format although its docs
    # promise them (vLLM issue 30100); distload accepts them.
    LoadFormat("runai_streamer_sharded", ("runai",), _PATTERN, why_not={"distributed": (
        "each rank of a pre-sharded checkpoint reads different files, and Run:ai's distributed "
        "mode would silently exchange data between them")}),
    LoadFormat("dummy", ("dummy",)),
)}
LOAD_FORMATS = tuple(FORMATS)


def allowed_keys(load_format: str) -> list[str]:
    return sorted(FORMATS[load_format].keys)


def make_load_config(load_format: str, extra_config: str | Mapping[str, Any] | None = None) -> LoadConfig:
    """Validate a format and its extra config; raise ConfigError before anything is applied."""
    if not isinstance(load_format, str):
        raise ConfigError(f"load format must be a string, got {load_format!r}")
    name = load_format.strip().lower()
    if name not in FORMATS:
        close = difflib.get_close_matches(name.replace("-", "_"), LOAD_FORMATS, n=1, cutoff=0.6)
        guess = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"unknown load format {load_format!r}; {guess}choose one of: {', '.join(LOAD_FORMATS)}")
    fmt = FORMATS[name]
    extra = parse_extra_config(extra_config)
    allowed = fmt.keys
    unexpected = sorted(set(extra) - set(allowed))
    if unexpected:
        reasons = [f"'{key}': {fmt.why_not[key]}" for key in unexpected if key in fmt.why_not]
        allowed_text = ", ".join(sorted(allowed)) if allowed else "none"
        message = f"Unexpected extra config keys {unexpected} for load format {name!r}; allowed keys: {allowed_text}"
        if reasons:
            message += " (" + "; ".join(reasons) + ")"
        raise ConfigError(message)
    for key, value in extra.items():
        allowed[key](key, value)
    return LoadConfig(name, dict(extra))
