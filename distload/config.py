"""Load formats, ``--model-loader-extra-config`` validation, and the environment it implies.

Names follow vLLM's ``--load-format`` so users can switch. Every key and value is checked before
anything is written to the environment: a bad config never leaves a half-applied state, and the
environment is restored when the load ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import string
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from distload.errors import ConfigError

DEFAULT_SHARD_PATTERN = "model-rank-{rank}-part-{part}.safetensors"

WHOLE_FORMATS = ("safetensors", "runai_streamer", "instanttensor")
SHARDED_FORMATS = ("sharded_state", "runai_streamer_sharded")
LOAD_FORMATS = ("auto",) + WHOLE_FORMATS + SHARDED_FORMATS + ("dummy",)

INSTANTTENSOR_BACKENDS = ("URING", "AIO", "URING_BUFFERED", "AIO_BUFFERED", "CUFILE", "MMAP", "BUFFERED")


def _is_int(value: Any) -> bool:
    # bool is a subclass of int; `{"concurrency": true}` must not pass as 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"extra config '{key}' must be a bool (true/false), got {value!r}")


def _check_positive_int(key: str, value: Any) -> None:
    if not _is_int(value) or value <= 0:
        raise ConfigError(f"extra config '{key}' must be a positive int, got {value!r}")


def _check_memory_limit(key: str, value: Any) -> None:
    if not _is_int(value) or value < -1:
        raise ConfigError(
            f"extra config '{key}' must be an int >= -1 (-1: unlimited, 0: the largest tensor, "
            f"N: bytes), got {value!r}"
        )


def check_pattern(key: str, value: Any) -> None:
    """A shard file-name pattern: plain ``{rank}`` and ``{part}`` fields, each at least once."""
    example = f"e.g. {DEFAULT_SHARD_PATTERN!r}"
    label = key if key.startswith("--") else f"extra config '{key}'"
    if not isinstance(value, str):
        raise ConfigError(f"{label} must be a string, {example}; got {value!r}")
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(value)
                  if name is not None]
    except ValueError as exc:
        raise ConfigError(f"{label} {value!r} is not a valid pattern ({exc}); {example}") from None
    names = {name for name, _, _ in fields}
    if names != {"rank", "part"} or any(spec or conv for _, spec, conv in fields):
        raise ConfigError(
            f"{label} must contain the fields {{rank}} and {{part}} and no other field, "
            f"format spec or conversion (such as {{part:05d}}), {example}; got {value!r}"
        )
    if "/" in value:
        raise ConfigError(f"{label} {value!r} must be a file name, not a path")


def _check_positive_number(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"extra config '{key}' must be a number in (0, 1], got {value!r}")


def _check_instanttensor_backend(key: str, value: Any) -> None:
    names = value.split(",") if isinstance(value, str) else None
    if not names or any(name.strip().upper() not in INSTANTTENSOR_BACKENDS for name in names):
        raise ConfigError(
            f"extra config '{key}' must be one or more of {', '.join(INSTANTTENSOR_BACKENDS)} "
            f"(comma-separated), got {value!r}"
        )


_RUNAI_KEYS: dict[str, Callable[[str, Any], None]] = {
    "concurrency": _check_positive_int,
    "memory_limit": _check_memory_limit,
}

# The whitelist per format. vLLM rejects concurrency/memory_limit for the sharded Run:ai format
# although its docs promise them (vLLM issue 30100); distload accepts them.
ALLOWED_KEYS: dict[str, dict[str, Callable[[str, Any], None]]] = {
    # concurrency: reader threads for pread, RUNAI_STREAMER_CONCURRENCY for Run:ai, InstantTensor's own.
    "auto": {"pattern": check_pattern, "huge_pages": _check_bool, "concurrency": _check_positive_int},
    "safetensors": {"huge_pages": _check_bool},
    "runai_streamer": {"distributed": _check_bool, **_RUNAI_KEYS},
    "runai_streamer_sharded": {"pattern": check_pattern, **_RUNAI_KEYS},
    "sharded_state": {"pattern": check_pattern, "huge_pages": _check_bool},
    "instanttensor": {
        "buffer_size": _check_positive_int,
        "chunk_size": _check_positive_int,
        "concurrency": _check_positive_int,
        "io_depth": _check_positive_int,
        "max_free_mem_usage": _check_positive_number,
        "backend": _check_instanttensor_backend,
    },
    "dummy": {},
}

# Keys a user may reasonably try on a format that cannot honour them, with the reason.
_WHY_NOT: dict[tuple[str, str], str] = {
    ("runai_streamer_sharded", "distributed"): (
        "each rank of a pre-sharded checkpoint reads different files, and Run:ai's distributed "
        "mode would silently exchange data between them"
    ),
}


@dataclass(frozen=True)
class LoadConfig:
    """A validated load request: format plus its extra config."""

    load_format: str
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def pattern(self) -> str:
        return self.extra.get("pattern", DEFAULT_SHARD_PATTERN)

    @property
    def distributed(self) -> bool:
        return bool(self.extra.get("distributed", False))


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


def make_load_config(load_format: str, extra_config: str | Mapping[str, Any] | None = None) -> LoadConfig:
    """Validate a format and its extra config; raise ConfigError before anything is applied."""
    if not isinstance(load_format, str):
        raise ConfigError(f"load format must be a string, got {load_format!r}")
    fmt = load_format.strip().lower()
    if fmt not in LOAD_FORMATS:
        raise ConfigError(f"unknown load format {load_format!r}; choose one of: {', '.join(LOAD_FORMATS)}")
    extra = parse_extra_config(extra_config)
    allowed = ALLOWED_KEYS[fmt]
    unexpected = sorted(set(extra) - set(allowed))
    if unexpected:
        reasons = [f"'{key}': {_WHY_NOT[(fmt, key)]}" for key in unexpected if (fmt, key) in _WHY_NOT]
        allowed_text = ", ".join(sorted(allowed)) if allowed else "none"
        message = f"Unexpected extra config keys {unexpected} for load format {fmt!r}; allowed keys: {allowed_text}"
        if reasons:
            message += " (" + "; ".join(reasons) + ")"
        raise ConfigError(message)
    for key, value in extra.items():
        allowed[key](key, value)
    return LoadConfig(fmt, dict(extra))


def runai_environment(extra: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment a Run:ai read needs for a validated extra config (nothing is written here)."""
    env: dict[str, str] = {}
    if "concurrency" in extra:
        env["RUNAI_STREAMER_CONCURRENCY"] = str(extra["concurrency"])
    if "memory_limit" in extra:
        env["RUNAI_STREAMER_MEMORY_LIMIT"] = str(extra["memory_limit"])
    env.update(endpoint_environment(environ))
    return env


def endpoint_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Bridge the two S3 endpoint spellings users set.

    Run:ai 0.17 reads only AWS_ENDPOINT_URL; older docs (and older vLLM) use
    RUNAI_STREAMER_S3_ENDPOINT. If only one is set, the other gets its value.
    """
    aws = environ.get("AWS_ENDPOINT_URL")
    legacy = environ.get("RUNAI_STREAMER_S3_ENDPOINT")
    if aws and not legacy:
        return {"RUNAI_STREAMER_S3_ENDPOINT": aws}
    if legacy and not aws:
        return {"AWS_ENDPOINT_URL": legacy}
    return {}


@contextlib.contextmanager
def applied_environment(changes: Mapping[str, str]) -> Iterator[None]:
    """Set ``changes`` in os.environ for the duration of a load, then restore what was there.

    Every ``RUNAI_STREAMER_*`` variable is restored too: Run:ai sets some itself (e.g.
    RUNAI_STREAMER_PROCESS_GROUP_SIZE in distributed mode) and never removes them, and a later
    load with another group would inherit them.
    """
    keys = set(changes) | {key for key in os.environ if key.startswith("RUNAI_STREAMER_")}
    saved = {key: os.environ.get(key) for key in keys}
    os.environ.update(changes)
    try:
        yield
    finally:
        for key in keys | {key for key in os.environ if key.startswith("RUNAI_STREAMER_")}:
            old = saved.get(key)
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
