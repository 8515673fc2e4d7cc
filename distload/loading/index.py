"""The index of a checkpoint: its files and every tensor's name, dtype, shape and byte range.

Pure: parsing only; reading the bytes is the source's job (distload.loading.sources). Headers are
parsed here rather than by a backend so that every reader gets the same precise
errors (which file, which tensor, what is wrong) before any tensor data moves, and so that the
``dummy`` format and the cross-rank checks need nothing but headers.

Format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N, N bytes
of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then
the data; offsets are relative to the first byte after the header.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Iterable

import torch

from distload.errors import CheckpointError

# Every dtype safetensors (0.8) knows: its code -> the torch dtype's name. MXFP8 scales (F8_E8M0),
# FP4 (F4: two 4-bit values per byte, torch.float4_e2m1fn_x2) and the FNUZ fp8 variants (AMD)
# need a recent torch; DTYPES holds those the installed torch has.
DTYPE_NAMES: dict[str, str] = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
    "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu", "F4": "float4_e2m1fn_x2",
}
DTYPES: dict[str, torch.dtype] = {code: getattr(torch, name) for code, name in DTYPE_NAMES.items()
                                  if isinstance(getattr(torch, name, None), torch.dtype)}
DTYPE_CODES: dict[torch.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}

# Header elements per torch element along the last dimension: a safetensors header counts F4 in
# 4-bit values (shape [r, 2k], k bytes a row), torch holds it as k float4_e2m1fn_x2 per row.
# Everything in distload past the parser uses torch's shape; the writer turns it back.
PACKED: dict[str, int] = {"F4": 2}


def torch_shape(code: str, header_shape: tuple[int, ...]) -> tuple[int, ...]:
    pack = PACKED.get(code, 1)
    return header_shape if pack == 1 else header_shape[:-1] + (header_shape[-1] // pack,)


def header_shape(code: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a safetensors header gives a tensor of torch ``shape`` and dtype ``code``."""
    pack = PACKED.get(code, 1)
    return shape if pack == 1 else shape[:-1] + (shape[-1] * pack,)


def nbytes_of(code: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of torch ``shape``."""
    return math.prod(shape) * DTYPES[code].itemsize


def check_dtype(code: object, where: str) -> str:
    """``code`` if the installed torch can hold it, else a CheckpointError that says why not."""
    if code in DTYPES:
        return code  # type: ignore[return-value]
    if code in DTYPE_NAMES:
        raise CheckpointError(
            f"{where}: dtype {code} needs torch.{DTYPE_NAMES[code]}, which this torch "
            f"({torch.__version__}) does not have; upgrade torch (2.7 or newer has every safetensors dtype)"
        )
    raise CheckpointError(f"{where}: unsupported dtype {code!r}; safetensors knows: {', '.join(DTYPE_NAMES)}")


# A header larger than this is not a header: the first 8 bytes of some other file.
# safetensors' own limits (its MAX_HEADER_SIZE; every size and offset a u64): one rule for every
# format, dummy and inspect included.
MAX_HEADER_BYTES = 100_000_000
MAX_U64 = 2**64 - 1
MAX_TORCH_DIM = 2**63 - 1  # torch sizes are signed 64-bit
MAX_INT_DIGITS = 20  # the digits of 2**64 - 1: a longer integer cannot be a size or an offset
MAX_NESTING = 3  # {tensor: {"shape": [...]}}: anything deeper is not a safetensors header


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]  # as torch holds it (F4: half the header's last dimension)
    file: str
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class FileInfo:
    path: str
    size: int
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str] | None
    # A local file's (device, inode, size, mtime in ns) when its header was read: a file changed
    # or replaced before its read ended is an error, never a mix of two versions.
    stamp: tuple[int, int, int, int] | None = None
    # An object's version (S3 and Azure: its ETag; GCS: its generation) when its header was read:
    # the same check for object stores.
    version: str | None = None
    # The header's raw bytes (its length prefix included), kept only for a load through a node
    # cache: a rank that receives the first tensors from another keeps the block they share.
    head: bytes | None = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def dtype_code(dtype: torch.dtype) -> str:
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise CheckpointError(f"dtype {dtype} has no safetensors code") from None


def parse_header(path: str, head: bytes, file_size: int) -> FileInfo:
    """Parse a safetensors header from the file's first bytes (at least 8 + N of them)."""
    if file_size < 8:
        raise CheckpointError(
            f"{path}: not a safetensors file: it is {file_size} bytes long, shorter than the "
            f"8-byte header length"
        )
    (header_len,) = struct.unpack("<Q", head[:8])
    if header_len > MAX_HEADER_BYTES or header_len < 2:
        raise CheckpointError(
            f"{path}: not a safetensors file: its first 8 bytes give a header length of "
            f"{header_len} bytes; is this a PyTorch .bin/.pt or another format saved with a "
            f".safetensors name?"
        )
    if 8 + header_len > file_size:
        raise CheckpointError(
            f"{path}: truncated header: the header says it is {header_len} bytes but the file "
            f"holds only {file_size - 8} after the length field; the file was cut short "
            f"(re-download or re-save it)"
        )
    raw = head[8 : 8 + header_len]
    if len(raw) < header_len:
        raise CheckpointError(f"{path}: truncated header: could read {len(raw)} of {header_len} bytes")
    text = _decode(path, raw)
    try:
        header = json.loads(text, parse_int=_parse_int, parse_constant=_no_constant)
    except _BadValue as exc:
        raise CheckpointError(f"{path}: corrupt header: {exc}") from None
    except RecursionError:  # nested far deeper than a header's 3 levels
        raise CheckpointError(f"{path}: corrupt header: nested deeper than a safetensors header "
                              f"({MAX_NESTING} levels)") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: corrupt header: not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt header: expected a JSON object, got {type(header).__name__}")
    data_start = 8 + header_len
    data_len = file_size - data_start
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: corrupt header: __metadata__ must be an object")
    bad = [k for k, v in (metadata or {}).items() if not isinstance(v, str)]
    if bad:  # safetensors: a map of strings to strings
        raise CheckpointError(f"{path}: corrupt header: __metadata__ value {bad[0]!r} is a "
                              f"{type(metadata[bad[0]]).__name__}, not a string (safetensors allows strings only)")
    tensors = []
    for name, entry in header.items():
        tensors.append(_parse_entry(path, name, entry, data_start, data_len))
    tensors.sort(key=lambda t: (t.begin, t.end))
    _check_coverage(path, tensors, data_start, data_len)
    return FileInfo(path=path, size=file_size, tensors=tuple(tensors), metadata=metadata)


class _BadValue(ValueError):
    pass


def _decode(path: str, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: corrupt header: not valid UTF-8 ({exc})") from None


def _parse_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise _BadValue(f"an integer of {len(digits)} digits cannot be a size or an offset")
    return int(digits)


def _no_constant(name: str) -> None:
    raise _BadValue(f"{name} is not a value a safetensors header holds")


def _is_u64(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_U64


def _check_coverage(path: str, tensors: list[TensorInfo], data_start: int, data_len: int) -> None:
    """Tensors must fill the data section back to back, as safetensors itself requires."""
    cursor = data_start
    previous = None
    for tensor in tensors:
        if tensor.begin != cursor:
            what = "overlaps" if tensor.begin < cursor else f"leaves a gap of {tensor.begin - cursor} bytes after"
            after = f"tensor {previous.name!r}" if previous else "the header"
            raise CheckpointError(
                f"{path}: corrupt header: tensor {tensor.name!r} {what} {after}; a safetensors file "
                f"stores its tensors back to back (re-download or re-save it)"
            )
        cursor, previous = tensor.end, tensor
    if cursor != data_start + data_len:
        raise CheckpointError(
            f"{path}: {data_start + data_len - cursor} bytes after the last tensor belong to no tensor "
            f"of the header: the file is corrupt or something was appended to it (re-download or re-save it)"
        )


def _parse_entry(path: str, name: str, entry: object, data_start: int, data_len: int) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: corrupt header entry (expected an object)")
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    dtype = check_dtype(dtype, where)
    if not isinstance(shape, list) or not all(_is_u64(d) for d in shape):
        raise CheckpointError(f"{where}: corrupt shape {shape!r} (a list of whole numbers >= 0)")
    if any(d > MAX_TORCH_DIM for d in shape):
        raise CheckpointError(f"{where}: shape {shape} has a dimension over 2**63 - 1, which no 64-bit "
                              f"torch size holds")
    if math.prod(shape) * 8 > MAX_U64:  # the widest dtype's bytes must fit 64 bits, as safetensors checks
        raise CheckpointError(f"{where}: shape {shape} holds more elements than a file can (64-bit sizes)")
    pack = PACKED.get(dtype, 1)
    if pack > 1 and (not shape or shape[-1] % pack):
        raise CheckpointError(f"{where}: a {dtype} tensor packs {pack} values a byte, so its last "
                              f"dimension must be a multiple of {pack}; the header says {shape}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_u64(o) for o in offsets) or offsets[0] > offsets[1]):
        raise CheckpointError(f"{where}: corrupt data_offsets {offsets!r}")
    begin, end = offsets
    expected = nbytes_of(dtype, torch_shape(dtype, tuple(shape)))
    if end - begin != expected:
        raise CheckpointError(
            f"{where}: header says {end - begin} bytes but {dtype} {shape} needs {expected}"
        )
    if end > data_len:
        raise CheckpointError(
            f"{path}: file is shorter than its header says: tensor {name!r} ends at data byte "
            f"{end}, but the file holds only {data_len} data bytes; it was truncated "
            f"(re-download or re-save it)"
        )
    return TensorInfo(name, dtype, torch_shape(dtype, tuple(shape)), path, data_start + begin, data_start + end)


@dataclass(frozen=True)
class CheckpointIndex:
    """The tensors a rank will read: files in read order, every tensor once."""

    files: tuple[FileInfo, ...]

    @property
    def tensors(self) -> list[TensorInfo]:
        return [t for f in self.files for t in f.tensors]

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def num_tensors(self) -> int:
        return sum(len(f.tensors) for f in self.files)

    def signature(self) -> list[tuple]:
        """What ranks compare before a shared read: each file's path and size (and an
        object's version: ranks that read the headers of two versions must not mix them)."""
        return [(f.path, f.size) if f.version is None else (f.path, f.size, f.version) for f in self.files]


def build_index(files: Iterable[FileInfo], hint: str = "") -> CheckpointIndex:
    """Check that no tensor name appears in two files, and freeze the list."""
    seen: dict[str, str] = {}
    files = tuple(files)
    for info in files:
        for tensor in info.tensors:
            if tensor.name in seen:
                raise CheckpointError(
                    f"tensor {tensor.name!r} appears in two files: {seen[tensor.name]} and "
                    f"{info.path}; a checkpoint must name each tensor once{hint}"
                )
            seen[tensor.name] = info.path
    return CheckpointIndex(files)
