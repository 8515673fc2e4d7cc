"""A streaming safetensors writer: the header is fixed up front, tensor data follows one tensor at
a time, so a save never holds more than the tensor being written.

The file is written under a temporary name and renamed into place by :meth:`commit`, with its
size and SHA-256 (hashed while writing: no second pass over the bytes) and each tensor's CRC-32C
per chunk, which every load checks (``distload/loading/checksums.py``). The header is padded to a
multiple of 8 bytes as safetensors itself does, so every tensor starts 8-byte aligned.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from distload.errors import CheckpointError
from distload.fileio import temporary_name, write_failed
from distload.loading.checksums import CHUNK_BYTES, chunk_crcs
from distload.loading.index import DTYPES, header_shape, nbytes_of
from distload.tensor_io import tensor_bytes


@dataclass(frozen=True)
class HeaderEntry:
    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]  # as torch holds it

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)

    def header(self, offset: int) -> dict[str, object]:
        """The header entry when the data starts at ``offset`` (the shape as safetensors counts it)."""
        return {"dtype": self.dtype, "shape": list(header_shape(self.dtype, self.shape)),
                "data_offsets": [offset, offset + self.nbytes]}



class SafetensorsWriter:
    def __init__(self, path: str, entries: Sequence[HeaderEntry], metadata: Mapping[str, str] | None = None):
        self.path = path
        self._entries = list(entries)
        self._next = 0
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        offset = 0
        for entry in self._entries:
            header[entry.name] = entry.header(offset)
            offset += entry.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-(8 + len(raw)) % 8)
        self._hash = hashlib.sha256()
        self.crc32c: dict[str, list[int]] = {}  # tensor name -> CRC-32C per CHUNK_BYTES of its data
        self.crc32c_chunk_bytes = CHUNK_BYTES
        self._size = 0
        self._total = 8 + len(raw) + offset  # the file's size once written
        self._tmp = temporary_name(path)
        try:
            self._file = open(self._tmp, "wb")
        except OSError as exc:
            raise write_failed(self.path, exc, self._total) from None
        self._write(len(raw).to_bytes(8, "little") + raw)

    def _write(self, data) -> None:
        try:
            self._file.write(data)
        except OSError as exc:
            raise write_failed(self.path, exc, self._total - self._size) from None
        self._hash.update(data)
        self._size += len(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next tensor; it must be the next entry of the header, in order."""
        if self._next >= len(self._entries):
            raise CheckpointError(f"{self.path}: tensor {name!r} written after the last header entry")
        entry = self._entries[self._next]
        if name != entry.name or tuple(tensor.shape) != entry.shape or DTYPES[entry.dtype] != tensor.dtype:
            raise CheckpointError(
                f"{self.path}: expected tensor {entry.name!r} {entry.dtype} {list(entry.shape)}, "
                f"got {name!r} {tensor.dtype} {list(tensor.shape)}"
            )
        data = tensor_bytes(tensor)
        self._write(data)
        self.crc32c[name] = chunk_crcs(data, self.crc32c_chunk_bytes)
        self._next += 1

    @property
    def done(self) -> bool:
        return self._next == len(self._entries)

    def commit(self) -> tuple[int, str]:
        """Flush, fsync and rename into place; returns (size, sha256 hex)."""
        if not self.done:
            missing = [e.name for e in self._entries[self._next:]]
            raise CheckpointError(f"{self.path}: closed before tensors {missing[:5]} were written")
        try:
            self._file.flush()
            os.fsync(self._file.fileno())  # a full disk may only show here, on a filesystem that defers
            self._file.close()
            os.replace(self._tmp, self.path)
        except OSError as exc:
            raise write_failed(self.path, exc) from None
        return self._size, self._hash.hexdigest()

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        if os.path.exists(self._tmp):
            os.unlink(self._tmp)
