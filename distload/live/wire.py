"""How values are written into a store that another process reads: JSON, never pickle.

A value read from the rendezvous store (or the job's store, for WeightSync) may have been written
by any process that reached it; decoding it must not be able to run code. ``pickle.loads`` runs
whatever the bytes say (the class of flaw behind vLLM's CVE-2025-47277 and CVE-2025-32444), so
every value is JSON, with a few tagged objects for what JSON lacks:

- ``{"\\u0000t": [...]}`` a tuple, ``{"\\u0000s": [...]}`` a set, ``{"\\u0000b": "base64"}`` bytes;
- ``{"\\u0000d": [[key, value], ...]}`` a dict whose keys are not all strings;
- ``{"\\u0000c": "Name", "f": [...]}`` one of the dataclasses :data:`TYPES` names (its fields in
  order): nothing else is ever constructed.

So a value comes back as it was put (a tuple as a tuple, an int key as an int), and a name that
is not among them is refused. Values over :data:`COMPRESS_FROM` bytes are stored compressed
(zlib, level 1): a trainer rank's metadata (names repeat per layer and expert) compresses about
11:1, and it is the store's largest traffic. JSON never begins with ``x`` (0x78, zlib's first byte).
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import json
import zlib
from typing import Any

COMPRESS_FROM = 2048
MAX_DECODED = 1 << 31  # a compressed value expands to at most this
_TUPLE, _SET, _BYTES, _DICT, _CLASS = "\x00t", "\x00s", "\x00b", "\x00d", "\x00c"
# The dataclasses that travel, by name, and the module that defines each: nothing else is built.
TYPES = (("Hello", "distload.live.rendezvous"), ("SessionRecord", "distload.live.rendezvous"),
         ("SyncTensor", "distload.live.transfer"))


class WireError(ValueError):
    """A stored value could not be decoded (not distload's, or from another version)."""


def _travels(kind: type) -> bool:
    return (kind.__name__, kind.__module__) in TYPES and dataclasses.is_dataclass(kind)


def _class(name: str) -> type:
    module = dict(TYPES).get(name)
    if module is None:
        raise WireError(f"a stored value names the type {name!r}, which is not one distload writes")
    return getattr(importlib.import_module(module), name)


def _plain(value: Any) -> Any:
    """``value`` as JSON's types, tagged where JSON would lose what it is."""
    kind = type(value)
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return value
    if kind is list:
        return [_plain(v) for v in value]
    if kind is tuple:
        return {_TUPLE: [_plain(v) for v in value]}
    if kind is dict:
        if all(type(k) is str and not k.startswith("\x00") for k in value):
            return {k: _plain(v) for k, v in value.items()}
        return {_DICT: [[_plain(k), _plain(v)] for k, v in value.items()]}
    if kind in (bytes, bytearray, memoryview):
        return {_BYTES: base64.b64encode(bytes(value)).decode()}
    if kind in (set, frozenset):
        return {_SET: [_plain(v) for v in value]}
    if _travels(kind):
        return {_CLASS: kind.__name__, "f": [_plain(getattr(value, f.name)) for f in dataclasses.fields(value)]}
    if isinstance(value, dict):  # a Mapping subclass (OrderedDict, ...)
        return _plain(dict(value))
    if isinstance(value, int):  # an IntEnum, numpy ints through int()
        return int(value)
    if hasattr(value, "__index__"):
        return int(value.__index__())
    if isinstance(value, float) or hasattr(value, "__float__") and type(value).__module__ == "numpy":
        return float(value)
    raise TypeError(f"a {kind.__name__} cannot be written to the store (name it in distload.live.wire.TYPES)")


def _hook(obj: dict) -> Any:
    if len(obj) > 2 or not obj:
        return obj
    tag = next(iter(obj))
    if not tag.startswith("\x00"):
        return obj
    body = obj[tag]
    if tag == _TUPLE:
        return tuple(body)
    if tag == _SET:
        return set(body)
    if tag == _BYTES:
        return base64.b64decode(body, validate=True)
    if tag == _DICT:
        return {(tuple(k) if isinstance(k, list) else k): v for k, v in body}
    if tag == _CLASS:
        return _class(body)(*obj["f"])
    raise WireError(f"a stored value has the unknown tag {tag!r}")


def encode(value: Any) -> bytes:
    data = json.dumps(_plain(value), separators=(",", ":"), allow_nan=True).encode()
    return zlib.compress(data, 1) if len(data) > COMPRESS_FROM else data


def decode(data: bytes) -> Any:
    """The value :func:`encode` wrote; :class:`WireError` for anything else."""
    try:
        if data[:1] == b"x":
            unpack = zlib.decompressobj()
            data = unpack.decompress(data, MAX_DECODED)
            if unpack.unconsumed_tail:
                raise WireError(f"a stored value expands past {MAX_DECODED} bytes")
        return json.loads(data, object_hook=_hook)
    except WireError:
        raise
    except (ValueError, TypeError, zlib.error, RecursionError, UnicodeDecodeError) as exc:
        raise WireError(f"a stored value is not one distload wrote ({type(exc).__name__}: {str(exc)[:120]})") from None
