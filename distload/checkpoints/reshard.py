"""Offline reshard: a whole safetensors checkpoint into per-rank shards, streaming.

It reads one tensor at a time with plain reads into a buffer (no memory map, whose touched pages
would count against the process), writes every rank's slice of it, and drops it, so its peak
memory is about the largest tensor, not the model.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch

from distload.errors import CheckpointError, ConfigError
from distload.fileio import read_exactly
from distload.loading.index import PACKED, TensorInfo, build_index
from distload.loading.layout import DEFAULT_SHARD_PATTERN, detect_layout
from distload.loading.manifest import Manifest, ShardFile, write_manifest
from distload.loading.sources import (check_source, is_object_store, model_config, read_header, source_string,
                                     whole_checkpoint)
from distload.checkpoints.output import (
    DEFAULT_MAX_FILE_SIZE,
    RankWriter,
    check_save_args,
    copy_metadata_files,
    prepare_output,
    split_into_parts,
)
from distload.checkpoints.writer import HeaderEntry
from distload.tp.experts import ExpertCut, ExpertPlace, cut_experts
from distload.tp.spec import ShardingSpec, carry_block_scales, spec_with_config
from distload.tp.vllm_names import EngineTensor, vllm_state
from distload.tp.slices import shard_shape, take_shard
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
    spec: str = ""
    engine_note: str = ""  # whose names the files hold, and who can load them
    experts_note: str = ""  # an expert-parallel save: its sizes and placement

    def summary_lines(self) -> list[str]:
        written = sum(f.size for f in self.files)
        lines = [
            f"wrote {len(self.files)} file(s) for {self.world_size} rank(s) to {self.output}: "
            f"{written / 2**30:.3f} GiB from {self.nbytes_read / 2**30:.3f} GiB read in {self.seconds:.2f} s",
            f"  split: {len(self.split)} tensor(s); copied: {', '.join(self.copied) or 'nothing'}",
        ]
        if self.spec:
            lines.append(f"  sharding spec {self.spec}: {self.engine_note}")
        if self.experts_note:
            lines.append(f"  expert parallelism: {self.experts_note}")
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


def reshard(source: str, output: str, tensor_parallel_size: int | None = None, *,
            pattern: str = DEFAULT_SHARD_PATTERN, max_file_size: int = DEFAULT_MAX_FILE_SIZE,
            sharding: str | ShardingSpec | None = None, world_size: int | None = None,
            expert_parallel_size: int | None = None, expert_placement_strategy: str | None = None) -> ReshardReport:
    """Turn a whole safetensors checkpoint into one shard per TP rank (``tensor_parallel_size``
    of them; T x P with ``expert_parallel_size`` P), streaming; ``distload reshard`` on the command line.

    Every tensor's action and shard shape is decided from the headers before a byte is written,
    so a sharding spec that does not fit the model (an indivisible dimension) fails with nothing written.

    Args:
        source: a local whole checkpoint: a file or a folder (``model.safetensors.index.json``
            honoured).
        output: a new or empty folder.
        tensor_parallel_size: how many TP ranks to write shards for (required; 1 by default with
            ``expert_parallel_size``).
        pattern: the shard file names, with ``{rank}`` and ``{part}``.
        max_file_size: start a new part past this many tensor bytes (default 5 GiB).
        sharding: the sharding spec: ``vllm`` (vLLM's engine names; the default where they are
            known), ``decoder`` (the same slices under the checkpoint's names; what a TP load
            holds), ``plain``, ``replicate``, a JSON spec file or a ShardingSpec.
        world_size: the old name of ``tensor_parallel_size``.
        expert_parallel_size: P: shard ``ep_rank * T + tp_rank`` holds EP rank ``ep_rank``'s routed
            experts (TP-sliced) and TP rank ``tp_rank``'s slices of the rest (distload/tp/place.py);
            the manifest records P, T and the placement, and a load of the folder checks them.
        expert_placement_strategy: ``linear`` (default) or ``round_robin``, as vLLM names them.

    Returns:
        What was written: files, split tensors, copied files, bytes and seconds.
    """
    if world_size is not None:
        if tensor_parallel_size is not None:
            raise ConfigError("reshard: pass tensor_parallel_size only (world_size is its old name)")
        warnings.warn("reshard(world_size=...) is the old name of tensor_parallel_size", DeprecationWarning,
                      stacklevel=2)
        tensor_parallel_size = world_size
    if tensor_parallel_size is None and expert_parallel_size is not None:
        tensor_parallel_size = 1  # experts whole on each EP rank, the rest whole on every rank
    if tensor_parallel_size is None:
        raise ConfigError("reshard: tensor_parallel_size (the number of TP ranks to write shards for) is required")
    tp_size = tensor_parallel_size
    check_save_args(output, pattern, max_file_size, tp_size)
    experts = None
    if expert_parallel_size is not None or expert_placement_strategy is not None:
        if expert_parallel_size is None:
            raise ConfigError("--expert-placement-strategy places experts over --expert-parallel-size ranks; "
                              "give --expert-parallel-size too")
        experts = ExpertPlace(expert_parallel_size, 0, expert_placement_strategy or "linear")
        experts.check()
        if experts.size == 1:  # every expert in every shard: no expert parallelism to record
            experts = None
    # The saved checkpoint's ranks, as its manifest counts them: shard s is TP rank s % T of EP rank s // T.
    world_size = tp_size * (experts.size if experts is not None else 1)
    start = time.perf_counter()
    path, folder = check_reshard_source(source)
    if os.path.abspath(folder) == os.path.abspath(output):
        raise ConfigError(f"output {output} must differ from the source folder")
    files, _ = whole_checkpoint(path)
    index = build_index(read_header(p) for p in files)
    config = model_config(path)
    default_reason = ""
    if sharding is None:
        sharding, default_reason = default_save_spec(config, [t.name for t in index.tensors], source)
    spec = spec_with_config(sharding, lambda: config)

    actions = {}
    for info in index.tensors:
        actions[info.name] = spec.action(info.name, info.shape, PACKED.get(info.dtype, 1))
    # A split weight's FP8 block scales go with it, cut on its blocks (refused off them).
    actions = carry_block_scales([(info.name, info.shape, actions[info.name]) for info in index.tensors], config)
    outputs = _output_tensors(index, spec, config, source)
    tensors = {info.name: info for info in index.tensors}
    # Each EP rank's actions (its experts' rows, other experts dropped); one for all without EP.
    cuts = [ExpertCut(actions, frozenset(), (), 0)]
    if experts is not None:
        if spec.engine is not None:
            raise ConfigError(f"--sharding {spec.name} with --expert-parallel-size: expert-parallel shards hold "
                              f"the checkpoint's own names; use --sharding decoder (the default with it)")
        shapes = [(info.name, info.shape, actions[info.name]) for info in index.tensors]
        cuts = [cut_experts(shapes, replace(experts, rank=ep), config) for ep in range(experts.size)]
    # Identical shapes within an EP rank, so identical parts for its T ranks.
    parts_of = [split_into_parts([_entry(out, tensors, cut.actions, tp_size) for out in outputs
                                  if out.name not in cut.dropped], max_file_size) for cut in cuts]

    prepare_output(output, pattern)
    writers: list[RankWriter] = []
    nbytes_read = 0
    # One buffer per part of the largest output tensor (q, k and v of a fused qkv_proj), reused.
    widest = max((len(out.parts) for out in outputs), default=0)
    biggest = max((t.nbytes for t in index.tensors), default=0)
    buffers = [torch.empty(biggest, dtype=torch.uint8) for _ in range(widest)]
    handles: dict[str, Any] = {}
    try:
        writers = [RankWriter(output, pattern, rank, parts_of[rank // tp_size]) for rank in range(world_size)]
        for out in outputs:  # in the files' order, so reads mostly move forward
            if out.constant is not None:
                for writer in writers:
                    writer.write(out.name, torch.tensor(out.constant, dtype=torch.float32))
                continue
            read = []
            for name, buffer in zip(out.parts, buffers):
                info = tensors[name]
                if info.file not in handles:
                    handles[info.file] = open(info.file, "rb", buffering=0)
                read.append(_read_tensor(handles[info.file], info, buffer))
                nbytes_read += info.nbytes
            for rank, writer in enumerate(writers):
                cut = cuts[rank // tp_size]
                if out.name in cut.dropped:
                    continue
                shards = [take_shard(t, cut.actions[n], rank % tp_size, tp_size, n) for n, t in zip(out.parts, read)]
                writer.write(out.name, shards[0] if len(shards) == 1 else torch.cat(shards, dim=0))
            del read
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    finally:
        for handle in handles.values():
            handle.close()
    copied = copy_metadata_files(folder, output)
    unmatched = sorted(name for name, action in actions.items() if action.rule is None)
    all_files = [f for writer in writers for f in writer.files]
    write_manifest(output, Manifest(
        world_size=world_size, pattern=pattern, files=all_files, sharding=spec.to_json(),
        replicated_unmatched=unmatched, source=source_string(source), created_by="distload reshard",
        expert_parallel=None if experts is None else {
            "size": experts.size, "tensor_parallel_size": tp_size, "placement": experts.placement,
            "num_experts": cuts[0].num_experts},
    ))
    return ReshardReport(
        output=output, world_size=world_size, files=all_files, replicated_unmatched=unmatched,
        copied=copied, nbytes_read=nbytes_read, seconds=time.perf_counter() - start,
        split={name: a.dim for name, a in cuts[0].actions.items() if a.dim is not None and name not in cuts[0].dropped},
        spec=spec.name, engine_note=_engine_note(spec, default_reason),
        experts_note="" if experts is None else (
            f"{experts.size} EP ranks x {tp_size} TP ranks, {experts.placement} placement of "
            f"{cuts[0].num_experts} experts; shard s holds EP rank s // {tp_size}'s experts "
            f"({', '.join(f'{ep}: {list(cut.experts)}' for ep, cut in enumerate(cuts))})"),
    )


def check_reshard_source(source: str) -> tuple[str, str]:
    """The path of a whole, local checkpoint to reshard, and its folder (ConfigError or
    CheckpointError saying what else it is)."""
    path = check_source(source)
    if is_object_store(path):
        raise ConfigError(
            f"{source}: reshard reads a local checkpoint; copy it from the object store first "
            f"(the sharded output can then be uploaded and loaded straight from there)"
        )
    if detect_layout(path).sharded:
        raise CheckpointError(
            f"{source} is already a pre-sharded (per-rank) checkpoint; reshard from the whole "
            f"(Hugging Face style) checkpoint it was made from"
        )
    return path, path if os.path.isdir(path) else os.path.dirname(path)


def default_save_spec(config: Mapping[str, Any], names: list[str], source: str) -> tuple[str, str]:
    """The spec a save without ``--sharding`` uses: ``vllm`` where vLLM's engine names are known
    for this checkpoint (its save then loads in vLLM's sharded_state loaders), else ``decoder``
    with the reason, which the summary prints."""
    try:
        vllm_state(names, config, source)
    except ConfigError as exc:
        return "decoder", str(exc)
    return "vllm", ""


def _engine_note(spec: ShardingSpec, default_reason: str) -> str:
    if spec.engine == "vllm":
        return "vLLM's engine names (fused qkv_proj and gate_up_proj, attention scales): loads with vLLM's sharded_state"
    note = "the checkpoint's own names: distload's loaders read this save, vLLM's sharded_state loader does not"
    return f"{note} (not the vllm layout, because {default_reason})" if default_reason else note


def _output_tensors(index, spec: ShardingSpec, config: Mapping[str, Any], source: str) -> list[EngineTensor]:
    names = [info.name for info in index.tensors]
    if spec.engine == "vllm":
        return vllm_state(names, config, source)
    return [EngineTensor(name, (name,)) for name in names]


def _entry(out: EngineTensor, tensors: Mapping[str, TensorInfo], actions, world_size: int) -> HeaderEntry:
    """The header entry of one output tensor: a part's shard shape, or the parts' shards stacked."""
    if out.constant is not None:
        return HeaderEntry(out.name, "F32", ())
    shapes = [shard_shape(n, tensors[n].shape, actions[n], world_size) for n in out.parts]
    dtypes = {tensors[n].dtype for n in out.parts}
    if len(out.parts) == 1:
        return HeaderEntry(out.name, dtypes.pop(), shapes[0])
    if len(dtypes) > 1 or any(not s or len(s) != len(shapes[0]) or s[1:] != shapes[0][1:] for s in shapes):
        described = ", ".join(f"{n} {tensors[n].dtype} {list(tensors[n].shape)}" for n in out.parts)
        raise CheckpointError(f"{out.name}: its parts cannot be stacked into one tensor ({described}): "
                              f"they need one dtype and equal trailing dimensions")
    return HeaderEntry(out.name, dtypes.pop(), (sum(s[0] for s in shapes),) + tuple(shapes[0][1:]))
