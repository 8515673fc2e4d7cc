"""Offline reshard: a whole safetensors checkpoint into per-rank shards, streaming.

It reads one tensor at a time with plain reads into a buffer (no memory map, whose touched pages
would count against the process), writes every rank's slice of it, and drops it, so its peak
memory is about the largest tensor, not the model.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from distload.errors import CheckpointError, ConfigError
from distload.fileio import read_exactly
from distload.loading.index import PACKED, TensorInfo, build_index
from distload.loading.layout import DEFAULT_SHARD_PATTERN, detect_layout
from distload.loading.manifest import Manifest, ShardFile, write_manifest
from distload.loading.sources import (check_source, is_object_store, model_config, read_header, source_string,
                                     whole_checkpoint)
from distload.sharded.output import (
    DEFAULT_MAX_FILE_SIZE,
    RankWriter,
    check_save_args,
    copy_metadata_files,
    prepare_output,
    split_into_parts,
)
from distload.sharded.writer import Entry
from distload.sharding import ShardingSpec, check_scales, spec_with_config
from distload.slicing import shard_shape, take_shard
from distload.tensor_io import host_view


@dataclass
class ReshardReport:
    output: str
    world_size: int
    files: list[ShardFile]
    replicated_unmatched: list[str]
    copied: list[str]
    nbytes_read: int
    seconds: float
    split: dict[str, int] = field(default_factory=dict)  # tensor -> dim

    def summary_lines(self) -> list[str]:
        written = sum(f.size for f in self.files)
        lines = [
            f"wrote {len(self.files)} file(s) for {self.world_size} rank(s) to {self.output}: "
            f"{written / 2**30:.3f} GiB from {self.nbytes_read / 2**30:.3f} GiB read in {self.seconds:.2f} s",
            f"  split: {len(self.split)} tensor(s); copied: {', '.join(self.copied) or 'nothing'}",
        ]
        if self.replicated_unmatched:
            shown = ", ".join(self.replicated_unmatched[:20])
            more = f" and {len(self.replicated_unmatched) - 20} more" if len(self.replicated_unmatched) > 20 else ""
            lines.append(f"  replicated because no rule of the sharding spec matched them: {shown}{more}")
        return lines


def _read_tensor(f, info: TensorInfo, buffer: torch.Tensor) -> torch.Tensor:
    """Read one tensor with plain reads (no memory map) into ``buffer``, reused for every tensor:
    one allocation of the largest tensor's size instead of one per tensor, which would leave the
    allocator's heap fragmented and the process's memory well above the largest tensor."""
    read_exactly(f.fileno(), host_view(buffer)[: info.nbytes], info.begin, info.file, info.name)
    return buffer[: info.nbytes].view(info.torch_dtype).reshape(info.shape)


def reshard(source: str, output: str, world_size: int, *, pattern: str = DEFAULT_SHARD_PATTERN,
            max_file_size: int = DEFAULT_MAX_FILE_SIZE, sharding: str | ShardingSpec | None = None) -> ReshardReport:
    """Turn a whole safetensors checkpoint into ``world_size`` per-rank shards, streaming.

    Every tensor's action and shard shape is decided from the headers before a byte is written,
    so a sharding spec that does not fit the model (an indivisible dimension) fails with nothing written.
    """
    start = time.perf_counter()
    check_save_args(output, pattern, max_file_size, world_size)
    path = check_source(source)
    if is_object_store(path):
        raise ConfigError(
            f"{source}: save-sharded reads a local checkpoint; copy it from the object store first "
            f"(the sharded output can then be uploaded and loaded straight from there)"
        )
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    if detect_layout(path).sharded:
        raise CheckpointError(
            f"{source} is already a per-rank sharded checkpoint; reshard from the whole "
            f"(Hugging Face style) checkpoint it was made from"
        )
    if os.path.abspath(folder) == os.path.abspath(output):
        raise ConfigError(f"output {output} must differ from the source folder")
    files, _ = whole_checkpoint(path)
    index = build_index(read_header(p) for p in files)
    spec = spec_with_config(sharding, lambda: model_config(path))

    actions = {}
    entries: list[Entry] = []
    for info in index.tensors:
        action = spec.action(info.name, info.shape, PACKED.get(info.dtype, 1))
        actions[info.name] = action
        entries.append(Entry(info.name, info.dtype, shard_shape(info.name, info.shape, action, world_size)))
    check_scales([(info.name, info.shape, actions[info.name]) for info in index.tensors])
    parts = split_into_parts(entries, max_file_size)  # identical shapes, so identical parts per rank

    prepare_output(output, pattern)
    writers: list[RankWriter] = []
    nbytes_read = 0
    buffer = torch.empty(max((t.nbytes for t in index.tensors), default=0), dtype=torch.uint8)
    try:
        writers = [RankWriter(output, pattern, rank, parts) for rank in range(world_size)]
        for file_info in index.files:
            with open(file_info.path, "rb", buffering=0) as f:
                for info in file_info.tensors:
                    tensor = _read_tensor(f, info, buffer)
                    nbytes_read += info.nbytes
                    for rank, writer in enumerate(writers):
                        writer.write(info.name, take_shard(tensor, actions[info.name], rank, world_size))
                    del tensor
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    copied = copy_metadata_files(folder, output)
    unmatched = sorted(name for name, action in actions.items() if action.rule is None)
    all_files = [f for writer in writers for f in writer.files]
    write_manifest(output, Manifest(
        world_size=world_size, pattern=pattern, files=all_files, sharding=spec.to_json(),
        replicated_unmatched=unmatched, source=source_string(source), created_by="distload save-sharded",
    ))
    return ReshardReport(
        output=output, world_size=world_size, files=all_files, replicated_unmatched=unmatched,
        copied=copied, nbytes_read=nbytes_read, seconds=time.perf_counter() - start,
        split={name: a.dim for name, a in actions.items() if a.dim is not None},
    )
