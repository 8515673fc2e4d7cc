"""Writing per-rank sharded checkpoints: from a running job, or offline from a whole checkpoint.

Both produce ``pattern.format(rank=r, part=p)`` files, a new part whenever the next tensor would
push a part past ``max_file_size`` (a tensor larger than that gets a part of its own), the
source's non-weight files, and last the manifest (see manifest.py), so a save that dies midway is
never mistaken for a complete checkpoint.

Offline resharding streams: it reads one tensor at a time with plain reads into a buffer (no
memory map, whose touched pages would count against the process), writes every rank's slice of
it, and drops it, so its peak memory is about the largest tensor, not the model.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from distload.loading.index import TensorInfo, build_index, dtype_code
from distload.loading.backends.pread import read_exactly
from distload.config import DEFAULT_SHARD_PATTERN, check_pattern
from distload.errors import CheckpointError, ConfigError
from distload.loading.manifest import MANIFEST_NAME, SAVING_MARKER, Manifest, ShardFile, read_manifest, write_manifest
from distload.loading.layout import find_shard_layout
from distload.sharding import ShardingPlan, load_plan, shard_shape, take_shard
from distload.loading.sources import INDEX_FILE, check_source, is_object_store, list_names, read_header, whole_checkpoint
from distload.tensor_io import host_view
from distload.sharded.writer import HEADER_OVERHEAD_BYTES, Entry, SafetensorsWriter

DEFAULT_MAX_FILE_SIZE = 5 * 1024**3


def split_into_parts(entries: Sequence[Entry], max_file_size: int) -> list[list[Entry]]:
    """Group entries, in order, into parts whose files stay within ``max_file_size`` bytes.

    A file's size counts its header too (exactly, padding at its widest), so a part never exceeds
    the limit unless it holds a single tensor that does by itself. A rank with no tensors still
    gets one (empty) part, so its loader finds a file.
    """
    parts: list[list[Entry]] = []
    current: list[Entry] = []
    data = header = 0
    for entry in entries:
        grown = HEADER_OVERHEAD_BYTES + header + entry.header_bytes(data) + data + entry.nbytes
        if current and grown > max_file_size:
            parts.append(current)
            current, data, header = [], 0, 0
        current.append(entry)
        header += entry.header_bytes(data)
        data += entry.nbytes
    parts.append(current)
    return parts


def check_save_args(output: str, pattern: str, max_file_size: int, world_size: int | None = None) -> None:
    if not isinstance(output, str) or not output or "://" in output:
        raise ConfigError(f"output must be a local folder path, got {output!r}")
    check_pattern("--file-pattern", pattern)
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
    names = list_names(output)
    existing = [n for n in names if n == MANIFEST_NAME or n == SAVING_MARKER]
    layout = find_shard_layout(names, pattern)
    if existing or layout.parts_by_rank:
        shown = existing + [name for parts in layout.parts_by_rank.values() for _, name in parts][:5]
        raise CheckpointError(
            f"{output} already holds a sharded checkpoint ({', '.join(shown)}); save into a new or "
            f"empty folder, or remove the old checkpoint first"
        )
    with open(os.path.join(output, SAVING_MARKER), "w") as f:
        f.write(f"a distload save started at {time.strftime('%Y-%m-%d %H:%M:%S')} and has not finished\n")


class _RankWriter:
    """Writes one rank's parts in order, opening part p+1 when part p is complete."""

    def __init__(self, output: str, pattern: str, rank: int, parts: list[list[Entry]]):
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
                                    [e.name for e in entries]))
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
                   ".onnx", ".npz", ".distload-tmp")
WEIGHT_INDEXES = (INDEX_FILE, "pytorch_model.bin.index.json", "tf_model.h5.index.json",
                  "flax_model.msgpack.index.json", MANIFEST_NAME, SAVING_MARKER)


def copy_metadata_files(source_folder: str, output: str) -> list[str]:
    """Copy every non-weight file (config, tokenizer, generation config, ...) of the source."""
    copied = []
    for name in list_names(source_folder):
        path = os.path.join(source_folder, name)
        if not os.path.isfile(path) or name.endswith(WEIGHT_SUFFIXES) or name in WEIGHT_INDEXES:
            continue
        tmp = os.path.join(output, f".{name}.distload-tmp")
        shutil.copyfile(path, tmp)
        os.replace(tmp, os.path.join(output, name))
        copied.append(name)
    return copied


# -- from a running job ------------------------------------------------------------------------


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


def save_sharded(state_dict: Mapping[str, torch.Tensor], output: str, *, group: Any = None,
                 pattern: str = DEFAULT_SHARD_PATTERN, max_file_size: int = DEFAULT_MAX_FILE_SIZE,
                 metadata_from: str | None = None) -> Manifest:
    """Save this rank's ``state_dict`` as its shard files; call on every rank of ``group``.

    Rank 0 prepares OUTPUT (refusing one that already holds a checkpoint), every rank writes its
    parts, then rank 0 copies ``metadata_from``'s non-weight files and commits the manifest. A
    failure on any rank fails the save on all ranks and leaves no manifest.
    """
    from distload.group import WorkerGroup

    check_save_args(output, pattern, max_file_size)
    if group is None:
        with WorkerGroup() as own:
            return save_sharded(state_dict, output, group=own, pattern=pattern,
                                max_file_size=max_file_size, metadata_from=metadata_from)
    unique, aliases = find_aliases(state_dict)
    group.agree("preparing the save", lambda: prepare_output(output, pattern) if group.rank == 0 else None)

    def write_rank() -> list[ShardFile]:
        entries = [Entry(n, dtype_code(t.dtype), tuple(t.shape)) for n, t in unique.items()]
        writer = _RankWriter(output, pattern, group.rank, split_into_parts(entries, max_file_size))
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


# -- offline reshard ---------------------------------------------------------------------------


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
            lines.append(f"  replicated because no rule of the plan matched them: {shown}{more}")
        return lines


def _read_tensor(f, info: TensorInfo, buffer: torch.Tensor) -> torch.Tensor:
    """Read one tensor with plain reads (no memory map) into ``buffer``, reused for every tensor:
    one allocation of the largest tensor's size instead of one per tensor, which would leave the
    allocator's heap fragmented and the process's memory well above the largest tensor."""
    read_exactly(f.fileno(), host_view(buffer)[: info.nbytes], info.begin, info.file, info.name)
    return buffer[: info.nbytes].view(info.torch_dtype).reshape(info.shape)


def _source_config(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
        return value if isinstance(value, dict) else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}


def reshard(source: str, output: str, world_size: int, *, pattern: str = DEFAULT_SHARD_PATTERN,
            max_file_size: int = DEFAULT_MAX_FILE_SIZE, plan: str | ShardingPlan | None = None) -> ReshardReport:
    """Turn a whole safetensors checkpoint into ``world_size`` per-rank shards, streaming.

    Every tensor's action and shard shape is decided from the headers before a byte is written,
    so a plan that does not fit the model (an indivisible dimension) fails with nothing written.
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
    if os.path.isdir(path):
        layout = find_shard_layout(list_names(path), DEFAULT_SHARD_PATTERN)
        if layout.parts_by_rank or read_manifest(path) is not None:
            raise CheckpointError(
                f"{source} is already a per-rank sharded checkpoint; reshard from the whole "
                f"(Hugging Face style) checkpoint it was made from"
            )
    if os.path.abspath(folder) == os.path.abspath(output):
        raise ConfigError(f"output {output} must differ from the source folder")
    files, _ = whole_checkpoint(path)
    index = build_index(read_header(p) for p in files)
    sharding = plan if isinstance(plan, ShardingPlan) else load_plan(plan, _source_config(folder))

    actions = {}
    entries: list[Entry] = []
    for info in index.tensors:
        action = sharding.action(info.name, info.shape)
        actions[info.name] = action
        entries.append(Entry(info.name, info.dtype, shard_shape(info.name, info.shape, action, world_size)))
    parts = split_into_parts(entries, max_file_size)  # identical shapes, so identical parts per rank

    prepare_output(output, pattern)
    writers: list[_RankWriter] = []
    nbytes_read = 0
    buffer = torch.empty(max((t.nbytes for t in index.tensors), default=0), dtype=torch.uint8)
    try:
        writers = [_RankWriter(output, pattern, rank, parts) for rank in range(world_size)]
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
        world_size=world_size, pattern=pattern, files=all_files, plan=sharding.to_json(),
        replicated_unmatched=unmatched, source=source, created_by="distload save-sharded",
    ))
    return ReshardReport(
        output=output, world_size=world_size, files=all_files, replicated_unmatched=unmatched,
        copied=copied, nbytes_read=nbytes_read, seconds=time.perf_counter() - start,
        split={name: a.dim for name, a in actions.items() if a.dim is not None},
    )
