"""The output folder of a save: argument checks, parts, per-rank writers, the metadata copy.

Both savers (from a running job, :mod:`distload.checkpoints.save`; offline from a whole checkpoint,
:mod:`distload.checkpoints.reshard`) write ``pattern.format(rank=r, part=p)`` files, a new part
whenever the next tensor would push a part's tensor bytes past ``max_file_size`` (vLLM's rule; a
tensor larger than that gets a part of its own), then the source's non-weight files, and last the manifest
(:mod:`distload.loading.manifest`), so a save that dies midway is never mistaken for a complete
checkpoint.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

import torch

from distload.errors import CheckpointError, ConfigError
from distload.fileio import TEMPORARY_SUFFIX, copy_file_atomic
from distload.loading.layout import check_pattern, detect_layout
from distload.loading.manifest import MANIFEST_NAME, SAVING_MARKER, ShardFile
from distload.loading.sources import INDEX_FILE, list_names
from distload.checkpoints.writer import HeaderEntry, SafetensorsWriter

DEFAULT_MAX_FILE_SIZE = 5 * 1024**3


def split_into_parts(entries: Sequence[HeaderEntry], max_file_size: int) -> list[list[HeaderEntry]]:
    """Group entries, in order, into parts by vLLM's rule (``ShardedStateLoader.save_model``): a new
    part starts when the next tensor would push the part's tensor bytes past ``max_file_size``
    (headers are not counted, so a file may exceed it by its header). A tensor larger than the
    limit gets a part of its own; where vLLM would first write an empty part, distload does not.
    A rank with no tensors still gets one (empty) part, so its loader finds a file.
    """
    parts: list[list[HeaderEntry]] = []
    current: list[HeaderEntry] = []
    size = 0
    for entry in entries:
        if current and size + entry.nbytes > max_file_size:
            parts.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry.nbytes
    parts.append(current)
    return parts


def check_save_args(output: str, pattern: str, max_file_size: int, world_size: int | None = None) -> None:
    if not isinstance(output, str) or not output or "://" in output:
        raise ConfigError(f"output must be a local folder path, got {output!r}")
    check_pattern("--file-pattern", pattern, for_saving=True)
    if isinstance(max_file_size, bool) or not isinstance(max_file_size, int) or max_file_size <= 0:
        raise ConfigError(f"--max-file-size must be a positive number of bytes, got {max_file_size!r}")
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                   or world_size < 1):
        raise ConfigError(f"--tensor-parallel-size must be an int >= 1, got {world_size!r}")


def prepare_output(output: str, pattern: str) -> None:
    """Create OUTPUT and drop the saving marker; refuse to mix with an existing checkpoint."""
    if os.path.exists(output) and not os.path.isdir(output):
        raise ConfigError(f"output {output} exists and is not a folder; give a new or empty folder")
    try:
        os.makedirs(output, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the output folder {output}: {exc.strerror}") from None
    try:
        layout = detect_layout(output, pattern)
        existing = ([MANIFEST_NAME] if layout.manifest else []) + layout.shards.names()[:5]
    except CheckpointError:  # an unfinished save's marker, or a corrupt manifest
        existing = [name for name in list_names(output) if name in (MANIFEST_NAME, SAVING_MARKER)]
    if existing:
        raise CheckpointError(
            f"{output} already holds a pre-sharded checkpoint ({', '.join(existing)}); save into a new or "
            f"empty folder, or remove the old checkpoint first"
        )
    with open(os.path.join(output, SAVING_MARKER), "w") as f:
        f.write(f"a distload save started at {time.strftime('%Y-%m-%d %H:%M:%S')} and has not finished\n")


class RankWriter:
    """Writes one rank's parts in order, opening part p+1 when part p is complete."""

    def __init__(self, output: str, pattern: str, rank: int, parts: list[list[HeaderEntry]]):
        self.output, self.pattern, self.rank = output, pattern, rank
        self.parts = parts
        self.part = -1
        self.writer: SafetensorsWriter | None = None
        self.files: list[ShardFile] = []
        self._open_next()

    def _open_next(self) -> None:
        self.part += 1
        name = self.pattern.format(rank=self.rank, part=self.part)
        self.writer = SafetensorsWriter(os.path.join(self.output, name), self.parts[self.part])
        if self.writer.done:  # an empty part
            self._commit()

    def _commit(self) -> None:
        assert self.writer is not None
        size, sha = self.writer.commit()
        entries = self.parts[self.part]
        self.files.append(ShardFile(os.path.basename(self.writer.path), self.rank, self.part, size, sha,
                                    [e.name for e in entries], self.writer.crc32c, self.writer.crc32c_chunk_bytes))
        self.writer = None
        if self.part + 1 < len(self.parts):
            self._open_next()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        assert self.writer is not None, f"rank {self.rank}: write after the last part"
        self.writer.write(name, tensor)
        if self.writer.done:
            self._commit()

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()


# Weights in any format, and the indexes of whole checkpoints: never metadata. A folder often
# holds the same model as .safetensors and .bin; copying the .bin would double OUTPUT for nothing.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack",
                   ".onnx", ".npz", TEMPORARY_SUFFIX)
WEIGHT_INDEXES = (INDEX_FILE, "pytorch_model.bin.index.json", "tf_model.h5.index.json",
                  "flax_model.msgpack.index.json", MANIFEST_NAME, SAVING_MARKER)


def copy_metadata_files(source_folder: str, output: str) -> list[str]:
    """Copy every non-weight file (config, tokenizer, generation config, ...) of the source."""
    copied = []
    for name in list_names(source_folder):
        path = os.path.join(source_folder, name)
        if not os.path.isfile(path) or name.endswith(WEIGHT_SUFFIXES) or name in WEIGHT_INDEXES:
            continue
        copy_file_atomic(path, os.path.join(output, name))
        copied.append(name)
    return copied
