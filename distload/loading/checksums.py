"""CRC-32C of every tensor's bytes: recorded by every save, checked by every load.

A save (``save_sharded``, ``reshard``) records in the manifest, for each tensor of each file,
the CRC-32C of each ``CHUNK_BYTES`` chunk of its data (chunks counted from the tensor's first
byte; the last one shorter). A load of a checkpoint whose manifest has them checks every tensor
as it arrives, before it is handed out: a flipped byte fails the load naming the file and the
tensor, on every rank, instead of loading a silently different model.

Why per tensor, in chunks: a load reads tensors, not files, so a checksum of a whole file could
be checked only by a load that reads all of it. A tensor-parallel slice reads part of a tensor: it
checks each chunk its slice touches, reading the bytes of those chunks it does not keep too (a
slice along dim 0 reads at most two chunks more per run; a slice along a later dimension touches
every chunk, and so reads the whole tensor). Chunks of 4 MiB keep that extra reading small and
the manifest small (one number per 4 MiB: 35,000 for a 140 GB model).

The CRC is crc32c-rs's hardware CRC-32C, the node cache's function (``stores/crc.py``),
computed in place a ``PIECE_BYTES`` piece at a time. ``distload verify`` still hashes every file
with SHA-256 against the manifest; this check is the one every load makes on the bytes it reads.
Checkpoints saved before checksums were recorded have none and load unchecked, as before.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from distload.errors import CheckpointError
from distload.loading.sources import open_source
from distload.loading.stores.crc import PIECE_BYTES, crc32c
from distload.tensor_io import host_view

if TYPE_CHECKING:
    from distload.loading.index import CheckpointIndex, TensorInfo
    from distload.loading.manifest import Manifest
    from distload.loading.sources import Source
    from distload.tp.slices import SliceBytes

CHUNK_BYTES = 4 * 1024 * 1024

log = logging.getLogger("distload")


def chunk_crcs(view: memoryview, chunk_bytes: int = CHUNK_BYTES) -> list[int]:
    """The CRC-32C of each ``chunk_bytes`` chunk of ``view`` (a writable, contiguous byte view)."""
    crcs = []
    for start in range(0, len(view), chunk_bytes):
        crc = 0
        for at in range(start, min(start + chunk_bytes, len(view)), PIECE_BYTES):
            crc = crc32c(view[at:min(at + PIECE_BYTES, start + chunk_bytes, len(view))], crc)
        crcs.append(crc)
    return crcs


@dataclass(frozen=True)
class TensorChecksums:
    """What a load checks one tensor against: its chunks' CRC-32Cs from the manifest."""

    file: str  # the file's name in the checkpoint folder, as the manifest lists it
    chunk_bytes: int
    crcs: tuple[int, ...]


def plan_checksums(manifest: "Manifest | None", src: "Source", index: "CheckpointIndex") -> dict[str, TensorChecksums]:
    """The checksums of the tensors of ``index`` whose file the manifest lists with checksums
    (none: no manifest, or one saved before checksums were recorded)."""
    if manifest is None:
        return {}
    entries = {src.path(f.name): f for f in manifest.files}
    out: dict[str, TensorChecksums] = {}
    unchecked = []
    for info in index.files:
        entry = entries.get(info.path)
        if entry is None:
            continue
        if entry.crc32c is None:
            unchecked.append(entry.name)
            continue
        for tensor in info.tensors:
            crcs = entry.crc32c.get(tensor.name)
            want = -(-tensor.nbytes // entry.crc32c_chunk_bytes)
            if crcs is None or len(crcs) != want:
                raise CheckpointError(
                    f"{src.path(entry.name)}: the manifest's CRC-32C list for tensor {tensor.name!r} has "
                    f"{'no entry' if crcs is None else f'{len(crcs)} chunk(s)'}, its {tensor.nbytes} bytes need "
                    f"{want}: the manifest does not belong to this file; run `python -m distload verify "
                    f"{src.folder}` and re-copy or re-save the checkpoint")
            out[tensor.name] = TensorChecksums(entry.name, entry.crc32c_chunk_bytes, tuple(crcs))
    if unchecked:
        log.debug("%s: the manifest records no CRC-32C for %s (saved before distload recorded them): "
                  "loaded unchecked", src.folder, ", ".join(unchecked[:3]))
    return out


class ChecksumCheck:
    """Checks each tensor a load delivers (whole, or the slice a rank read) against its CRCs."""

    def __init__(self, checksums: Mapping[str, TensorChecksums], source: str, index: "CheckpointIndex"):
        self.checksums = checksums
        self.source = source  # the checkpoint folder: where a slice's other bytes are read from
        self._src: "Source | None" = None
        self.tensors = {t.name: t for t in index.tensors if t.name in checksums}

    @property
    def src(self) -> "Source":
        if self._src is None:  # opened only for a slice's other bytes
            self._src = open_source(self.source)
        return self._src

    def check(self, name: str, tensor: torch.Tensor, piece: "SliceBytes | None" = None) -> None:
        """Raise CheckpointError if a chunk of tensor ``name``'s data, as read into ``tensor``,
        differs from the manifest's CRC-32C. ``piece``: the slice ``tensor`` holds (None: whole)."""
        want = self.checksums.get(name)
        info = self.tensors.get(name)
        if want is None or info is None or info.nbytes == 0:
            return
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            tensor = tensor.detach().to("cpu").contiguous()  # a reader that delivered on the device
        view = host_view(tensor)
        if piece is None:
            got = chunk_crcs(view, want.chunk_bytes)
            for i, (a, b) in enumerate(zip(got, want.crcs)):
                if a != b:
                    self._fail(info, want, i)
            return
        for i, crc in self._slice_crcs(info, want, view, piece.extents):
            if crc != want.crcs[i]:
                self._fail(info, want, i)

    def _slice_crcs(self, info: "TensorInfo", want: TensorChecksums, view: memoryview,
                    extents: Sequence[tuple[int, int, int]]):
        """(chunk, CRC) of every chunk the slice's extents touch. A chunk the rank holds whole is
        checked in place; one it holds part of (a slice's edge, or every row of a slice along a
        later dimension) is read from the file in one request, the rank's own bytes laid over it,
        and checked: what the rank holds is what is checked, the rest of the chunk completes it."""
        size = want.chunk_bytes
        by_chunk: dict[int, list[tuple[int, int, int]]] = {}
        for src, dst, length in extents:
            while length:
                chunk = src // size
                take = min(length, (chunk + 1) * size - src)
                by_chunk.setdefault(chunk, []).append((src - chunk * size, dst, take))
                src, dst, length = src + take, dst + take, length - take
        for chunk in sorted(by_chunk):
            pieces = sorted(by_chunk[chunk])
            first, last = chunk * size, min((chunk + 1) * size, info.nbytes)
            if sum(length for _, _, length in pieces) == last - first:  # held whole (pieces never overlap)
                crc = 0
                for _, dst, length in pieces:
                    crc = crc32c(view[dst:dst + length], crc)
                yield chunk, crc
                continue
            data = bytearray(self._read_range(want.file, info.begin + first, info.begin + last))
            if len(data) != last - first:
                raise CheckpointError(f"{info.file}: ended while checking tensor {info.name!r}: the file is "
                                      f"shorter than its header says (truncated while loading?)")
            for offset, dst, length in pieces:
                data[offset:offset + length] = view[dst:dst + length]
            yield chunk, crc32c(memoryview(data))

    def _read_range(self, name: str, start: int, end: int) -> bytes:
        src = self.src
        if src.remote:
            return src.store.read(src.folder_location.child(name), start, end)
        fd = os.open(src.path(name), os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, end - start, start)
        finally:
            os.close(fd)

    def _fail(self, info: "TensorInfo", want: TensorChecksums, chunk: int) -> None:
        raise corrupt_error(info, want, chunk, self.source)


def corrupt_error(info: "TensorInfo", want: TensorChecksums, chunk: int, folder: str) -> CheckpointError:
    """The one line a load fails with when chunk ``chunk`` of ``info``'s data is not as saved."""
    start = chunk * want.chunk_bytes
    end = min(start + want.chunk_bytes, info.nbytes)
    return CheckpointError(
        f"{info.file}: tensor {info.name!r} is corrupt: bytes {info.begin + start}-{info.begin + end} of the file "
        f"differ from the CRC-32C its manifest records (changed after the save, or damaged in a copy); re-copy "
        f"the file from the original or re-save the checkpoint, and run `python -m distload verify {folder}` "
        f"to check every file")
