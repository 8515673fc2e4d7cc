"""Settings: ``--model-loader-extra-config`` parsing, the value checks every key uses, and the
validated load request.

Which keys a load format takes is the backends' and formats' business
(``distload.loading.formats``); this module only knows what a valid value of each kind is. Every
check raises before anything is applied, so a bad config never leaves a half-applied state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from distload.errors import ConfigError


def is_int(value: Any) -> bool:
    # bool is a subclass of int; `{"concurrency": true}` must not pass as 1.
    return isinstance(value, int) and not isinstance(value, bool)


def check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"extra config '{key}' must be a bool (true/false), got {value!r}")


def check_distributed(key: str, value: Any) -> None:
    if not isinstance(value, bool) and value not in ("node", "job"):
        raise ConfigError(
            f"extra config '{key}' must be true (share reads within each node, as Run:ai does), "
            f"\"node\", \"job\" (share them across the whole job: each byte leaves storage once) or "
            f"false, got {value!r}")


def check_positive_int(key: str, value: Any) -> None:
    if not is_int(value) or value <= 0:
        raise ConfigError(f"extra config '{key}' must be a positive int, got {value!r}")


def check_fraction(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"extra config '{key}' must be a number in (0, 1], got {value!r}")


@dataclass(frozen=True)
class LoadConfig:
    """A validated load request: format plus its extra config."""

    load_format: str
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def pattern(self) -> str | None:
        """The shard file-name pattern the user asked for; None: the checkpoint's own or the default."""
        return self.extra.get("pattern")

    @property
    def distributed(self) -> bool | str | None:
        """The ``distributed`` setting as given (None: not set, the format decides)."""
        return self.extra.get("distributed")


def parse_extra_config(text: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """Accept the CLI's JSON text, a mapping from Python, or None."""
    if text is None or text == "":
        return {}
    if isinstance(text, Mapping):
        return dict(text)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"--model-loader-extra-config is not valid JSON ({exc.msg} at column {exc.colno}): "
            f"{text!r}; pass an object such as '{{\"distributed\": true}}'"
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(
            f"--model-loader-extra-config must be a JSON object, got {type(value).__name__}: {text!r}"
        )
    return value
