"""Saving a sharded checkpoint from a running job: each rank writes its own shard files.

Order of calls (every rank of the group): ``agree("preparing the save")`` (rank 0 creates OUTPUT
and the saving marker), ``agree("writing the shards")``, ``exchange`` of every rank's files, and
``agree("committing the manifest")`` (rank 0 copies the metadata and writes the manifest). A failure
on any rank fails the save on all ranks and leaves no manifest.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

from distload.errors import ConfigError
from distload.group import WorkerGroup
from distload.loading.index import dtype_code
from distload.loading.layout import DEFAULT_SHARD_PATTERN
from distload.loading.manifest import Manifest, ShardFile, write_manifest
from distload.sharded.output import (
    DEFAULT_MAX_FILE_SIZE,
    RankWriter,
    check_save_args,
    copy_metadata_files,
    prepare_output,
    split_into_parts,
)
from distload.sharded.writer import Entry


def find_aliases(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Split a state dict into the tensors to write and the aliases of them.

    Two names are aliases only when they are the very same view (same storage, offset, shape,
    strides and dtype): tied embeddings. Tensors whose bytes merely overlap (a scale inside a
    bigger buffer) are both written, so no tensor is ever lost.
    """
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name in sorted(state):
        tensor = state[name]
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"state dict entry {name!r} is a {type(tensor).__name__}, not a tensor")
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
               tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if tensor.numel() > 0 and key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            unique[name] = tensor
    return unique, aliases


def save_sharded(state_dict: Mapping[str, torch.Tensor], output: str, *, group: WorkerGroup | None = None,
                 pattern: str = DEFAULT_SHARD_PATTERN, max_file_size: int = DEFAULT_MAX_FILE_SIZE,
                 metadata_from: str | None = None) -> Manifest:
    """Save this rank's ``state_dict`` as its shard files; call on every rank of ``group`` (None:
    a group from the environment, for this call).

    Rank 0 prepares OUTPUT (refusing one that already holds a checkpoint), every rank writes its
    parts, then rank 0 copies ``metadata_from``'s non-weight files and commits the manifest.
    """
    check_save_args(output, pattern, max_file_size)
    with WorkerGroup.for_call(group) as g:
        return _save(state_dict, output, g, pattern, max_file_size, metadata_from)


def _save(state_dict: Mapping[str, torch.Tensor], output: str, group: WorkerGroup, pattern: str,
          max_file_size: int, metadata_from: str | None) -> Manifest:
    unique, aliases = find_aliases(state_dict)
    group.agree("preparing the save", lambda: prepare_output(output, pattern) if group.rank == 0 else None)

    def write_rank() -> list[ShardFile]:
        entries = [Entry(n, dtype_code(t.dtype), tuple(t.shape)) for n, t in unique.items()]
        writer = RankWriter(output, pattern, group.rank, split_into_parts(entries, max_file_size))
        try:
            for name, tensor in unique.items():
                writer.write(name, tensor)
        except BaseException:
            writer.abort()
            raise
        return writer.files

    files = group.agree("writing the shards", write_rank)
    everyone = group.exchange((files, aliases))

    def commit() -> Manifest:
        manifest = Manifest(
            world_size=group.world_size, pattern=pattern,
            files=[f for rank_files, _ in everyone for f in rank_files],
            aliases={rank: a for rank, (_, a) in enumerate(everyone) if a},
            source=metadata_from, created_by="distload save_sharded",
        )
        if group.rank == 0:
            if metadata_from:
                folder = metadata_from if os.path.isdir(metadata_from) else os.path.dirname(metadata_from)
                copy_metadata_files(folder, output)
            write_manifest(output, manifest)
        return manifest

    return group.agree("committing the manifest", commit)
