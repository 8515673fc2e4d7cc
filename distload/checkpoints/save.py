"""Saving a pre-sharded checkpoint from a running job: each rank writes its own shard files.

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
from distload.workers.group import WorkerGroup
from distload.loading.index import dtype_code
from distload.loading.layout import DEFAULT_SHARD_PATTERN
from distload.loading.manifest import Manifest, ShardFile, Subtensor, write_manifest
from distload.checkpoints.output import (
    DEFAULT_MAX_FILE_SIZE,
    RankWriter,
    check_save_args,
    copy_metadata_files,
    prepare_output,
    split_into_parts,
)
from distload.checkpoints.writer import HeaderEntry


def find_aliases(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, Subtensor]]:
    """Split a state dict into the tensors to write, the aliases of them, and the views into them.

    Aliases are the very same view under two names (same storage, offset, shape, strides and
    dtype): tied embeddings, written once. A tensor whose bytes lie within another contiguous
    tensor of the same storage (a scale inside a bigger buffer) is not written either, as vLLM's
    saver drops it (``_filter_subtensors``; vLLM's sharded_state loader would fail on the extra key):
    the manifest records where it lies, and a load gives it back as a view of that tensor. Nothing
    is lost; only the bytes that no tensor owns twice are written.
    """
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name in sorted(state):
        tensor = state[name]
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"state dict entry {name!r} is a {type(tensor).__name__}, not a tensor")
        if tensor.layout != torch.strided:
            raise ConfigError(f"state dict entry {name!r} is a {tensor.layout} tensor: safetensors holds "
                              f"dense tensors only; save tensor.to_dense() instead")
        if tensor.device.type == "meta":
            raise ConfigError(f"state dict entry {name!r} is on the meta device and has no data: "
                              f"materialise the model (load or initialise its weights) before saving")
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
               tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if tensor.numel() > 0 and key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            unique[name] = tensor
    views = _views(unique)
    for name in views:
        del unique[name]
    return unique, aliases, views


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The byte addresses ``[start, end)`` a (non-negatively strided) tensor touches."""
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.data_ptr(), tensor.data_ptr() + (last + 1) * tensor.element_size()


def _views(tensors: Mapping[str, torch.Tensor]) -> dict[str, Subtensor]:
    """vLLM's rule: a tensor is dropped when a contiguous tensor of the same storage covers its
    bytes and is larger, or covers the same bytes and is contiguous where it is not, or is the
    same bytes under a smaller name. Each dropped one is a view of the largest tensor covering it."""
    groups: dict[tuple, list[str]] = {}
    for name, tensor in tensors.items():
        if tensor.numel() and all(s >= 0 for s in tensor.stride()):
            groups.setdefault((tensor.device, tensor.untyped_storage().data_ptr()), []).append(name)
    views: dict[str, Subtensor] = {}
    for names in groups.values():
        spans = {name: _span(tensors[name]) for name in names}
        for name in names:
            start, end = spans[name]
            covers = [other for other in names if other != name and tensors[other].is_contiguous()
                      and spans[other][0] <= start and end <= spans[other][1]
                      and (spans[other] != (start, end) or not tensors[name].is_contiguous() or other < name)]
            if not covers:
                continue
            # The largest cover, smallest name first: never itself dropped for a larger one.
            base = min(covers, key=lambda o: (-(spans[o][1] - spans[o][0]), spans[o][0], o))
            offset = start - spans[base][0]
            if offset % tensors[name].element_size():
                continue  # not expressible as a view of it: written whole instead
            views[name] = Subtensor(base, offset, tuple(tensors[name].shape), tuple(tensors[name].stride()),
                               dtype_code(tensors[name].dtype))
    # A cover of the same bytes as a larger cover is itself dropped: point at what is kept.
    for name, view in list(views.items()):
        while view.of in views:
            outer = views[view.of]
            view = Subtensor(outer.of, outer.offset + view.offset, view.shape, view.stride, view.dtype)
        views[name] = view
    return views


def save_sharded(state_dict: Mapping[str, torch.Tensor], output: str, *, group: WorkerGroup | None = None,
                 pattern: str = DEFAULT_SHARD_PATTERN, max_file_size: int = DEFAULT_MAX_FILE_SIZE,
                 metadata_from: str | None = None) -> Manifest:
    """Save this rank's ``state_dict`` as its shard files, from a running job.

    Rank 0 prepares ``output`` (refusing one that already holds a checkpoint), every rank writes
    its parts, then rank 0 copies ``metadata_from``'s non-weight files and commits the manifest.

    Args:
        state_dict: this rank's tensors (tied tensors are written once, views inside another
            tensor are recorded as views).
        output: a new or empty folder, the same on every rank.
        group: the ranks that save (every one must call); None: a group from the environment,
            for this call.
        pattern: the shard file names, with ``{rank}`` and ``{part}``.
        max_file_size: start a new part past this many tensor bytes.
        metadata_from: a folder whose non-weight files (config, tokenizer) are copied along.

    Returns:
        The manifest written (``distload.json``).
    """
    check_save_args(output, pattern, max_file_size)
    with WorkerGroup.for_call(group) as g:
        return _save(state_dict, output, g, pattern, max_file_size, metadata_from)


def _save(state_dict: Mapping[str, torch.Tensor], output: str, group: WorkerGroup, pattern: str,
          max_file_size: int, metadata_from: str | None) -> Manifest:
    unique, aliases, views = find_aliases(state_dict)
    group.agree("preparing the save", lambda: prepare_output(output, pattern) if group.rank == 0 else None)

    def write_rank() -> list[ShardFile]:
        entries = [HeaderEntry(n, dtype_code(t.dtype), tuple(t.shape)) for n, t in unique.items()]
        writer = RankWriter(output, pattern, group.rank, split_into_parts(entries, max_file_size))
        try:
            for name, tensor in unique.items():
                writer.write(name, tensor)
        except BaseException:
            writer.abort()
            raise
        return writer.files

    files = group.agree("writing the shards", write_rank)
    everyone = group.exchange((files, aliases, views))

    def commit() -> Manifest:
        manifest = Manifest(
            world_size=group.world_size, pattern=pattern,
            files=[f for rank_files, _, _ in everyone for f in rank_files],
            aliases={rank: a for rank, (_, a, _) in enumerate(everyone) if a},
            views={rank: v for rank, (_, _, v) in enumerate(everyone) if v},
            source=metadata_from, created_by="distload save_sharded",
        )
        if group.rank == 0:
            if metadata_from:
                folder = metadata_from if os.path.isdir(metadata_from) else os.path.dirname(metadata_from)
                copy_metadata_files(folder, output)
            write_manifest(output, manifest)
        return manifest

    return group.agree("committing the manifest", commit)
