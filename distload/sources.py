"""Where checkpoint files come from: list a source and read its headers.

A source is a string, never a ``pathlib.Path`` (a Path turns ``s3://b/k`` into ``s3:/b/k``).
Local paths are handled here; object-store URIs (``s3://``, ``gs://``, ``az://``) are recognised
and refused with a clear error until their reader lands.
"""

from __future__ import annotations

import json
import os

from .checkpoint import CheckpointIndex, FileInfo, read_local_header
from .errors import CheckpointError, ConfigError

OBJECT_STORE_SCHEMES = ("s3://", "gs://", "az://")
INDEX_FILE = "model.safetensors.index.json"


def is_object_store(source: str) -> bool:
    return source.startswith(OBJECT_STORE_SCHEMES)


def check_source(source: str) -> str:
    """Validate the source string; return it normalised (no trailing slash, user expanded)."""
    if not isinstance(source, str) or not source:
        raise ConfigError(f"source must be a non-empty path or URI string, got {source!r}")
    if is_object_store(source):
        raise ConfigError(
            f"{source}: object-store sources are not supported by this version of distload yet; "
            f"copy the checkpoint to a local folder (or mount it) and load that path"
        )
    if "://" in source:
        raise ConfigError(f"{source}: unknown URI scheme; use a local path, s3://, gs:// or az://")
    path = os.path.expanduser(source)
    if not os.path.exists(path):
        raise CheckpointError(f"{source}: no such file or directory")
    return path.rstrip("/") or "/"


def list_names(folder: str) -> list[str]:
    """The names in a folder, sorted (for listings and error messages)."""
    try:
        return sorted(os.listdir(folder))
    except NotADirectoryError:
        return [os.path.basename(folder)]
    except PermissionError:
        raise CheckpointError(f"{folder}: permission denied while listing it") from None


def describe_names(names: list[str], limit: int = 12) -> str:
    if not names:
        return "it is empty"
    shown = ", ".join(names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"it holds: {shown}{more}"


def list_whole_checkpoint(path: str) -> list[str]:
    """The safetensors files of a whole (not per-rank) checkpoint, in a stable order."""
    return whole_checkpoint(path)[0]


def whole_checkpoint(path: str) -> tuple[list[str], dict[str, str] | None]:
    """The files of a whole checkpoint, and its index's weight map (None without an index).

    A file is itself; a folder with ``model.safetensors.index.json`` gives exactly the files its
    ``weight_map`` names; any other folder gives its ``*.safetensors`` (not recursive).
    """
    if os.path.isfile(path):
        return [path], None
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map = _read_weight_map(index_path)
        return _files_from_index(path, index_path, weight_map), weight_map
    names = list_names(path)
    files = [os.path.join(path, n) for n in names if n.endswith(".safetensors")]
    if not files:
        raise CheckpointError(f"{path}: no .safetensors files in this folder; {describe_names(names)}")
    return files, None


def check_weight_map(folder: str, weight_map: dict[str, str], index: CheckpointIndex) -> None:
    """Every tensor the index names must be in the file it names (else the index is stale)."""
    where = {t.name: os.path.basename(t.file) for t in index.tensors}
    wrong = [(name, file) for name, file in sorted(weight_map.items()) if where.get(name) != file]
    if wrong:
        shown = "; ".join(
            f"{name!r} -> {file} but " + (f"it is in {where[name]}" if name in where else "no file has it")
            for name, file in wrong[:5])
        raise CheckpointError(
            f"{os.path.join(folder, INDEX_FILE)} does not match the files' headers "
            f"({len(wrong)} tensor(s)): {shown}; regenerate the index or remove it"
        )


def _read_weight_map(index_path: str) -> dict[str, str]:
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
        bad = [k for k, v in weight_map.items() if not isinstance(v, str) or not v]
        if bad:
            raise TypeError(f"weight_map values must be file names, but {bad[0]!r} maps to "
                            f"{weight_map[bad[0]]!r}")
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{index_path}: not a valid safetensors index ({type(exc).__name__}: {exc}); it must be "
            f"a JSON object with a 'weight_map' of tensor name -> file name"
        ) from None
    return weight_map


def _files_from_index(folder: str, index_path: str, weight_map: dict[str, str]) -> list[str]:
    names = sorted(set(weight_map.values()))
    missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        raise CheckpointError(
            f"{index_path} names files that are not in {folder}: {', '.join(missing)}"
        )
    return [os.path.join(folder, n) for n in names]


def read_header(path: str) -> FileInfo:
    return read_local_header(path)
