"""Who reads what: pure functions over file names, with no I/O and no torch.distributed.

A *read group* is the set of ranks that need exactly the same files:

- whole checkpoint: every rank needs every tensor, so all ranks form one group and may read
  cooperatively (Run:ai distributed, InstantTensor with the group's handle);
- per-rank shards saved for the job's world size: each rank is its own group and reads only its
  files, with no collective in the read path.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

from distload.errors import ShardLayoutError


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """A regex matching file names made from ``pattern``; groups ``rank`` and ``part``."""
    regex = ""
    for literal, field, _spec, _conv in string.Formatter().parse(pattern):
        regex += re.escape(literal)
        if field in ("rank", "part"):
            # A name may repeat a field; only the first occurrence is captured.
            regex += rf"(?P<{field}>\d+)" if f"(?P<{field}>" not in regex else r"\d+"
    return re.compile(regex + r"\Z")


def rank_glob(pattern: str, rank: int) -> str:
    """The glob a rank uses to find its own files, e.g. ``model-rank-3-part-*.safetensors``."""
    return pattern.format(rank=rank, part="*")


@dataclass(frozen=True)
class ShardLayout:
    """The ranks and parts found in a folder for one pattern."""

    pattern: str
    parts_by_rank: dict[int, list[tuple[int, str]]]  # rank -> [(part, name)] sorted by part

    @property
    def ranks(self) -> list[int]:
        return sorted(self.parts_by_rank)

    @property
    def saved_world_size(self) -> int:
        return max(self.parts_by_rank) + 1 if self.parts_by_rank else 0


def find_shard_layout(names: list[str], pattern: str) -> ShardLayout:
    """Group the names that match ``pattern`` by rank."""
    regex = pattern_regex(pattern)
    parts_by_rank: dict[int, list[tuple[int, str]]] = {}
    for name in names:
        match = regex.match(name)
        if match:
            parts_by_rank.setdefault(int(match["rank"]), []).append((int(match["part"]), name))
    for parts in parts_by_rank.values():
        parts.sort()
    return ShardLayout(pattern, parts_by_rank)


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'"""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans)


def shard_files_for_rank(layout: ShardLayout, folder: str, rank: int, world_size: int,
                         listing_hint: str) -> list[str]:
    """The names of this rank's shard files, or a ShardLayoutError that says what is there."""
    wanted = f"{folder}/{rank_glob(layout.pattern, rank)}"
    if not layout.parts_by_rank:
        raise ShardLayoutError(
            f"Could not find checkpoint files '{wanted}', only pre-sharded checkpoints are "
            f"currently supported! No file in {folder} matches the pattern {layout.pattern!r}; "
            f"{listing_hint}. Pass the pattern the checkpoint was saved with "
            f"(extra config 'pattern'), or load a whole checkpoint with --load-format safetensors."
        )
    saved = layout.saved_world_size
    mismatch = ""
    if saved != world_size:
        mismatch = (
            f": the checkpoint was saved for {saved} ranks, this job has {world_size}; start the "
            f"job with {saved} ranks or reshard the checkpoint for {world_size}"
        )
    if rank not in layout.parts_by_rank:
        raise ShardLayoutError(
            f"Could not find checkpoint files '{wanted}', only pre-sharded checkpoints are "
            f"currently supported! Files exist for ranks {_ranges(layout.ranks)}{mismatch}."
        )
    if saved > world_size:
        # Without this check a job smaller than the checkpoint loads happily and silently
        # drops the shards of ranks it does not have.
        raise ShardLayoutError(
            f"{folder} holds shards for ranks {_ranges(layout.ranks)}{mismatch}; "
            f"the shards of ranks {_ranges(list(range(world_size, saved)))} would never be loaded."
        )
    parts = [part for part, _ in layout.parts_by_rank[rank]]
    if len(set(parts)) != len(parts):
        raise ShardLayoutError(
            f"rank {rank} has two files for the same part number in {folder}: "
            f"{', '.join(name for _, name in layout.parts_by_rank[rank])}"
        )
    return [name for _, name in layout.parts_by_rank[rank]]


def mismatched_ranks(signatures: list[list[tuple]]) -> dict[int, str]:
    """Ranks whose file list differs from rank 0's, with what differs (for a clear error).

    A signature lists ``(path, size)`` or ``(path, size, content fingerprint)`` per file.
    """
    def as_map(signature: list[tuple]) -> dict[str, tuple[int, str]]:
        return {item[0]: (item[1], item[2] if len(item) > 2 else "") for item in signature}

    reference = signatures[0]
    differing: dict[int, str] = {}
    for rank, signature in enumerate(signatures[1:], start=1):
        if signature == reference:
            continue
        ref, own = as_map(reference), as_map(signature)
        only_here = sorted(set(own) - set(ref))
        only_ref = sorted(set(ref) - set(own))
        common = set(own) & set(ref)
        sizes = sorted(p for p in common if own[p][0] != ref[p][0])
        contents = sorted(p for p in common if own[p][0] == ref[p][0] and own[p][1] != ref[p][1])
        what = []
        if only_here:
            what.append(f"has {only_here} that rank 0 lacks")
        if only_ref:
            what.append(f"lacks {only_ref} that rank 0 has")
        if sizes:
            what.append(f"sees other sizes for {sizes}")
        if contents:
            what.append(f"sees other contents (same size, different bytes) for {contents}")
        if not what:
            what.append("lists the same files in another order")
        differing[rank] = "; ".join(what)
    return differing


@dataclass(frozen=True)
class ReadChoice:
    """How one rank reads: which layout, which backend, and whether ranks read cooperatively."""

    sharded: bool
    backend: str  # a key of distload.loading.backends.BACKENDS
    cooperative: bool


# What `auto` picks on a CPU, from benchmarks/results/load.md: on local files distload's own
# parallel-pread reader (no intermediate buffer, no memory map) beats safetensors (copied out of
# its map) and Run:ai from disk in 3 of the 4 cold cases. From a warm page cache, on per-rank
# shards, safetensors' memcpy is 20-25% faster, but a file truncated under a memory map kills the process with SIGBUS, where pread raises an error
# naming the file and tensor: we keep pread. And with the page cache already sharing reads
# between a node's ranks, each rank reading alone beats Run:ai's distributed mode over gloo, so
# local loads never cooperate.
# On an object store nothing shares the reads, so a whole checkpoint is read cooperatively.
AUTO_CPU_BACKEND = "pread"


def choose_read(load_format: str, *, sharded_layout_found: bool, device_type: str, world_size: int,
                distributed: bool, instanttensor_installed: bool, remote: bool = False) -> ReadChoice:
    """Map a load format (already validated) to a read, for one rank; pure and deterministic.

    Every rank of a job calls this with the same arguments and so takes the same decision,
    which the cooperative backends rely on (the caller still cross-checks the file lists).
    ``remote``: the source is an object store. safetensors' reader needs a local file, so there
    the safetensors formats read the same tensors with ranged GETs (backend ``ranged``).
    """
    many = world_size > 1
    plain = "ranged" if remote else "safetensors"
    if load_format == "safetensors":
        return ReadChoice(False, plain, False)
    if load_format == "sharded_state":
        return ReadChoice(True, plain, False)
    if load_format == "runai_streamer":
        return ReadChoice(False, "runai", distributed and many)
    if load_format == "runai_streamer_sharded":
        return ReadChoice(True, "runai", False)
    if load_format == "instanttensor":
        return ReadChoice(False, "instanttensor", many)
    if load_format == "dummy":
        return ReadChoice(sharded_layout_found, "dummy", False)
    if load_format == "auto":
        if device_type == "cuda" and not remote:
            if instanttensor_installed and not sharded_layout_found:
                return ReadChoice(False, "instanttensor", many)
            # Run:ai over NCCL reads each byte once and broadcasts device to device.
            return ReadChoice(sharded_layout_found, "runai", many and not sharded_layout_found)
        if remote:
            return ReadChoice(sharded_layout_found, "runai", many and not sharded_layout_found)
        return ReadChoice(sharded_layout_found, AUTO_CPU_BACKEND, False)
    raise AssertionError(f"unvalidated load format {load_format!r}")
