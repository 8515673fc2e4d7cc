"""The manifest of a pre-sharded checkpoint (``distload.json``), written last by every save.

A checkpoint is complete only when its manifest exists. A save first drops a marker
(``distload.saving``) and removes it only after the manifest is in place, so a save that died
midway is recognised as incomplete rather than loaded with parts missing. Checkpoints written by
other tools (vLLM's sharded_state) have no manifest and still load; they just get fewer checks.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from distload.fileio import write_json_atomic
from distload.loading.index import DTYPES
from distload.errors import CheckpointError, ConfigError, ShardLayoutError
from distload.loading.sources import Source, open_source

MANIFEST_NAME = "distload.json"
SAVING_MARKER = "distload.saving"
MANIFEST_FORMAT = "distload-sharded"
# 2: each file's tensors' CRC-32Cs (crc32c, crc32c_chunk_bytes). A distload that reads version 1
# only says "not supported" of them, rather than calling the manifest corrupt.
MANIFEST_VERSION = 2
READABLE_VERSIONS = (1, 2)


@dataclass(frozen=True)
class ShardFile:
    name: str
    rank: int
    part: int
    size: int
    sha256: str
    tensors: list[str]
    # Tensor name -> the CRC-32C of each crc32c_chunk_bytes chunk of its data, checked by every
    # load (distload/loading/checksums.py). None: saved before distload recorded them.
    crc32c: dict[str, list[int]] | None = None
    crc32c_chunk_bytes: int = 0


@dataclass(frozen=True)
class Subtensor:
    """A tensor saved inside another one: vLLM's saver drops a tensor whose bytes lie within
    another saved tensor (``_filter_subtensors``), and so does distload, recording here where it
    lies so that a load gives it back as a view of that tensor (sharing its memory, as in the
    model it came from)."""

    of: str  # the saved tensor that holds its bytes
    offset: int  # bytes from the start of that tensor
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # in elements, as torch counts them
    dtype: str  # safetensors code


@dataclass
class Manifest:
    world_size: int
    pattern: str
    files: list[ShardFile]
    sharding: dict[str, Any] | None = None  # the sharding spec an offline reshard used
    # rank -> {alias name: name of the tensor it shares storage with}
    aliases: dict[int, dict[str, str]] = field(default_factory=dict)
    # rank -> {name: where it lies in a saved tensor}
    views: dict[int, dict[str, Subtensor]] = field(default_factory=dict)
    replicated_unmatched: list[str] = field(default_factory=list)
    # An expert-parallel reshard's layout: {"size": P, "tensor_parallel_size": T, "placement":
    # "linear" | "round_robin", "num_experts": E}; shard ``ep_rank * T + tp_rank``. None: none.
    expert_parallel: dict[str, Any] | None = None
    source: str | None = None
    format: str = MANIFEST_FORMAT
    version: int = MANIFEST_VERSION
    created_by: str = ""

    def files_for_rank(self, rank: int) -> list[ShardFile]:
        return sorted((f for f in self.files if f.rank == rank), key=lambda f: f.part)

    def keys_for_rank(self, rank: int) -> set[str]:
        keys = {name for f in self.files_for_rank(rank) for name in f.tensors}
        return keys | set(self.aliases.get(rank, {})) | set(self.views.get(rank, {}))

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["aliases"] = {str(rank): names for rank, names in self.aliases.items()}
        out["views"] = {str(rank): {name: asdict(view) for name, view in views.items()}
                        for rank, views in self.views.items()}
        # format and version first, for a human reading the file
        return {"format": out.pop("format"), "version": out.pop("version"), **out}


def _view_from_json(name: str, raw: Any) -> Subtensor:
    """A view entry, checked: a damaged one is a corrupt manifest, not a torch error at load."""
    def counts(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                               for x in value)

    offset = raw.get("offset")
    if (not isinstance(raw.get("of"), str) or isinstance(offset, bool) or not isinstance(offset, int)
            or offset < 0 or not counts(raw.get("shape")) or not counts(raw.get("stride"))
            or len(raw["shape"]) != len(raw["stride"]) or raw.get("dtype") not in DTYPES):
        raise ValueError(f"view {name!r} is malformed: {raw!r}")
    return Subtensor(raw["of"], offset, tuple(raw["shape"]), tuple(raw["stride"]), raw["dtype"])


def _experts_from_json(raw: Any, world_size: int) -> dict[str, Any] | None:
    """The expert-parallel record, checked: a damaged one is a corrupt manifest."""
    if raw is None:
        return None
    sizes = [raw.get(key) if isinstance(raw, dict) else None for key in ("size", "tensor_parallel_size", "num_experts")]
    if (not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes)
            or raw.get("placement") not in ("linear", "round_robin") or sizes[0] * sizes[1] != world_size):
        raise ValueError(f"expert_parallel is malformed: {raw!r}")
    return dict(raw)


def check_saved_experts(manifest: Manifest, place: Any, source: str) -> None:
    """Refuse a load whose expert parallelism (``place``: a TPPlace or None) is not the saved one.

    Without sizes, rank r reads shard r: the saved layout as it is (the job's ranks are checked
    against the saved count with the files)."""
    saved = manifest.expert_parallel
    experts = getattr(place, "experts", None)
    if saved is None:
        if experts is not None:
            raise ConfigError(
                f"--expert-parallel-size {experts.size}: {source} was saved per rank without expert parallelism "
                f"(for {manifest.world_size} ranks, see {MANIFEST_NAME}); load it without --expert-parallel-size, "
                f"or reshard the whole checkpoint with --expert-parallel-size {experts.size}")
        return
    if place is None:
        return
    tp, ep, placement = saved["tensor_parallel_size"], saved["size"], saved["placement"]
    given = (place.size, experts.size if experts else 1, experts.placement if experts else placement)
    if given != (tp, ep, placement):
        raise ConfigError(
            f"{source} was saved per rank at tensor-parallel size {tp} x expert-parallel size {ep} ({placement} "
            f"placement, {tp * ep} ranks; see {MANIFEST_NAME}), but the load asks for {given[0]} x {given[1]} "
            f"({given[2]}); load it with --tensor-parallel-size {tp} --expert-parallel-size {ep} "
            f"--expert-placement-strategy {placement}, or without them on {tp * ep} ranks, or reshard the whole "
            f"checkpoint for the sizes you want")


def _file_from_json(raw: Any) -> ShardFile:
    """A file entry, its checksums checked: a damaged list is a corrupt manifest, not a false alarm."""
    entry = ShardFile(**raw)
    if entry.crc32c is not None:
        chunk = entry.crc32c_chunk_bytes
        if (not isinstance(entry.crc32c, dict) or isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0
                or not all(isinstance(crcs, list) and all(isinstance(c, int) and not isinstance(c, bool)
                                                          and 0 <= c < 2**32 for c in crcs)
                           for crcs in entry.crc32c.values())):
            raise ValueError(f"the CRC-32C entries of {entry.name!r} are malformed")
    return entry


def write_manifest(folder: str, manifest: Manifest) -> None:
    """Write the manifest atomically, then remove the saving marker: the commit point of a save."""
    write_json_atomic(os.path.join(folder, MANIFEST_NAME), manifest.to_json())
    marker = os.path.join(folder, SAVING_MARKER)
    if os.path.exists(marker):
        os.unlink(marker)


def read_manifest(folder: "str | Source") -> Manifest | None:
    """The folder's manifest; None if there is none (a checkpoint from another tool).

    ``folder`` is a local path, an object-store prefix, or a Source. Raises CheckpointError if a
    save into the folder did not finish, or the manifest is corrupt.
    """
    src = open_source(folder)
    if src.has_file(SAVING_MARKER):
        raise CheckpointError(
            f"{src.folder}: the checkpoint is incomplete: a save into this folder did not finish "
            f"({SAVING_MARKER} is still there and the manifest was not committed); remove the folder "
            f"and run the save again, or save into a new folder"
        )
    if not src.has_file(MANIFEST_NAME):
        return None
    path = src.path(MANIFEST_NAME)
    try:
        raw = json.loads(src.read_bytes(MANIFEST_NAME).decode("utf-8"))
        if raw.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format is {raw.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        if raw.get("version") not in READABLE_VERSIONS:
            raise ValueError(f"version {raw.get('version')!r} is not supported (this distload reads "
                             f"versions {', '.join(map(str, READABLE_VERSIONS))}; a newer distload wrote it?)")
        files = [_file_from_json(entry) for entry in raw["files"]]
        return Manifest(
            world_size=int(raw["world_size"]), pattern=raw["pattern"], files=files,
            sharding=raw.get("sharding", raw.get("plan")),  # "plan" in manifests before 2026-12
            aliases={int(rank): dict(names) for rank, names in raw.get("aliases", {}).items()},
            views={int(rank): {name: _view_from_json(name, v) for name, v in views.items()}
                   for rank, views in raw.get("views", {}).items()},
            replicated_unmatched=list(raw.get("replicated_unmatched", [])),
            expert_parallel=_experts_from_json(raw.get("expert_parallel"), int(raw["world_size"])),
            source=raw.get("source"), created_by=raw.get("created_by", ""),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: corrupt manifest ({type(exc).__name__}: {exc})") from None


def manifest_files_for_rank(manifest: Manifest, folder: "str | Source", pattern: str, rank: int,
                            world_size: int) -> list[str]:
    """This rank's file names per the manifest, after checking they match the job and the storage."""
    src = open_source(folder)
    folder = src.folder
    if pattern != manifest.pattern:
        raise ShardLayoutError(
            f"{folder} was saved with the file pattern {manifest.pattern!r} (see {MANIFEST_NAME}), "
            f"but the load asks for {pattern!r}; drop the 'pattern' extra config or pass the saved one"
        )
    if manifest.world_size != world_size:
        raise ShardLayoutError(
            f"{folder} was saved for {manifest.world_size} ranks, but this job has {world_size}: "
            f"start the job with {manifest.world_size} ranks, or reshard the whole checkpoint for "
            f"{world_size}: python -m distload reshard <whole checkpoint> <new folder> "
            f"--tensor-parallel-size {world_size}{replicas_hint(manifest.world_size, world_size)}"
        )
    entries = manifest.files_for_rank(rank)
    if not entries:
        raise ShardLayoutError(f"{folder}: {MANIFEST_NAME} lists no file for rank {rank}; the manifest is damaged")
    problems = []
    for entry in entries:
        if not src.has_file(entry.name):
            problems.append(f"{entry.name} is missing")
        elif src.file_size(entry.name) != entry.size:
            problems.append(f"{entry.name} is {src.file_size(entry.name)} bytes, the manifest says {entry.size}")
    if problems:
        raise CheckpointError(
            f"{folder}: rank {rank}'s files do not match {MANIFEST_NAME}: {'; '.join(problems)}; "
            f"run `python -m distload verify {folder}` and re-copy or re-save the checkpoint"
        )
    return [entry.name for entry in entries]


def replicas_hint(saved: int, world_size: int) -> str:
    """What to say when a job is a whole multiple of the ranks a checkpoint was saved for."""
    if world_size > saved and world_size % saved == 0:
        return (f"; or load it as {world_size // saved} data-parallel replicas with "
                f"--tensor-parallel-size {saved} (Python: tensor_parallel_size={saved})")
    return ""
