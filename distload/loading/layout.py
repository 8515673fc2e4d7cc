"""What layout a checkpoint folder has, by one rule: whole, or pre-sharded per rank.

A folder is *pre-sharded* when it holds a distload manifest, or files whose names match the shard
pattern (``model-rank-{rank}-part-{part}.safetensors`` unless the user or the manifest says
otherwise); anything else is a *whole* checkpoint that every rank needs all of.
:func:`detect_layout` is the one place that rule is written: the loader, ``inspect``, both
savers and the demo all ask it. The name functions below it are pure (no I/O).
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Any

from distload.errors import ConfigError, ShardLayoutError
from distload.loading.manifest import Manifest, manifest_files_for_rank, read_manifest, replicas_hint
from distload.loading.sources import Source, describe_names, open_source

DEFAULT_SHARD_PATTERN = "model-rank-{rank}-part-{part}.safetensors"


def check_pattern(key: str, value: Any, *, for_saving: bool = False) -> None:
    """A shard file-name pattern: plain ``{rank}`` and optionally ``{part}`` fields, as vLLM takes
    them (it globs a rank's files with ``pattern.format(rank=r, part="*")``).

    Loading also takes a pattern with a subfolder (``rank{rank}/part-{part}.safetensors``) and one
    without ``{part}`` (``model-rank-{rank}.safetensors``). Saving needs ``{part}`` (vLLM's saver
    would write every part over the same file) and a plain file name.
    """
    example = f"e.g. {DEFAULT_SHARD_PATTERN!r}"
    label = key if key.startswith("--") else f"extra config '{key}'"
    if not isinstance(value, str):
        raise ConfigError(f"{label} must be a string, {example}; got {value!r}")
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(value)
                  if name is not None]
    except ValueError as exc:
        raise ConfigError(f"{label} {value!r} is not a valid pattern ({exc}); {example}") from None
    names = {name for name, _, _ in fields}
    needed = {"rank", "part"} if for_saving else {"rank"}
    if not needed <= names or not names <= {"rank", "part"} or any(spec or conv for _, spec, conv in fields):
        what = "the fields {rank} and {part}" if for_saving else "the field {rank} (and {part} if it has parts)"
        raise ConfigError(
            f"{label} must contain {what} and no other field, format spec or conversion (such as "
            f"{{part:05d}}), {example}; got {value!r}"
        )
    if for_saving and "/" in value:
        raise ConfigError(f"{label} {value!r} must be a file name, not a path")
    if value.startswith("/") or ".." in value.split("/"):
        raise ConfigError(f"{label} {value!r} must be a name inside the checkpoint folder")


def pattern_regex(pattern: str, any_depth: bool = False) -> re.Pattern[str]:
    """A regex matching the names ``pattern`` globs: ``{rank}`` a number (captured), ``{part}``
    anything without a ``/`` (glob's ``*``, as vLLM's ``part="*"``); ``any_depth``: also below
    sub-prefixes (``sub/...``), as vLLM's ``s3_glob`` finds them on object stores."""
    regex = "(?:.+/)?" if any_depth else ""
    for literal, field, _spec, _conv in string.Formatter().parse(pattern):
        regex += re.escape(literal)
        if field == "rank":
            # A name may repeat a field; only the first occurrence is captured.
            regex += r"(?P<rank>\d+)" if "(?P<rank>" not in regex else r"\d+"
        elif field == "part":
            regex += r"(?P<part>[^/]*)" if "(?P<part>" not in regex else r"[^/]*"
    return re.compile(regex + r"\Z")


def rank_glob(pattern: str, rank: int | str) -> str:
    """The glob a rank uses to find its own files, e.g. ``model-rank-3-part-*.safetensors``
    (``rank`` "*": every rank's)."""
    return pattern.format(rank=rank, part="*")


def _part_order(part: str) -> tuple[int, int, str]:
    # Numbered parts in number order (part-10 after part-9), any other name after them.
    return (0, int(part), part) if part.isdigit() else (1, 0, part)


@dataclass(frozen=True)
class ShardLayout:
    """The ranks and parts found in a folder for one pattern."""

    pattern: str
    parts_by_rank: dict[int, list[tuple[str, str]]]  # rank -> [(part, name)], numbered parts first

    @property
    def ranks(self) -> list[int]:
        return sorted(self.parts_by_rank)

    @property
    def saved_world_size(self) -> int:
        return max(self.parts_by_rank) + 1 if self.parts_by_rank else 0

    def names(self) -> list[str]:
        """Every matching file name, by rank then part."""
        return [name for rank in self.ranks for _, name in self.parts_by_rank[rank]]


def find_shard_layout(names: list[str], pattern: str, any_depth: bool = False) -> ShardLayout:
    """Group the names that match ``pattern`` by rank: every name a rank's glob matches."""
    regex = pattern_regex(pattern, any_depth)
    parts_by_rank: dict[int, list[tuple[str, str]]] = {}
    for name in names:
        match = regex.match(name)
        if match:
            part = match.groupdict().get("part") or ""
            parts_by_rank.setdefault(int(match["rank"]), []).append((part, name))
    for parts in parts_by_rank.values():
        parts.sort(key=lambda item: (_part_order(item[0]), item[1]))
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
        # No rank's files: every rank says the same, so the job's one line names them all.
        raise ShardLayoutError(
            f"Could not find checkpoint files '{folder}/{rank_glob(layout.pattern, '*')}' for any rank, "
            f"only pre-sharded checkpoints are "
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
            f"{replicas_hint(saved, world_size)}"
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
    numbers = [int(part) for part, _ in layout.parts_by_rank[rank] if part.isdigit()]
    if len(set(numbers)) != len(numbers):
        raise ShardLayoutError(
            f"rank {rank} has two files for the same part number in {folder}: "
            f"{', '.join(name for _, name in layout.parts_by_rank[rank])}"
        )
    return [name for _, name in layout.parts_by_rank[rank]]


@dataclass(frozen=True)
class CheckpointLayout:
    """What a source holds, as :func:`detect_layout` found it."""

    source: Source
    pattern: str  # the shard pattern the folder was tested against
    shards: ShardLayout  # the files matching it, by rank (empty for a whole checkpoint)
    manifest: Manifest | None
    names: tuple[str, ...]  # the folder's listing (empty for a single file)

    @property
    def sharded(self) -> bool:
        return self.manifest is not None or bool(self.shards.parts_by_rank)

    @property
    def saved_world_size(self) -> int:
        return self.manifest.world_size if self.manifest else self.shards.saved_world_size

    def rank_files(self, rank: int, world_size: int) -> list[str]:
        """The names of ``rank``'s files for a job of ``world_size`` ranks, or a
        ShardLayoutError that says what is there and what to do."""
        if self.manifest is not None:
            return manifest_files_for_rank(self.manifest, self.source, self.pattern, rank, world_size)
        return shard_files_for_rank(self.shards, self.source.folder, rank, world_size,
                                    describe_names(list(self.names)))

    def rank_paths(self, rank: int, world_size: int) -> list[str]:
        return [self.source.path(name) for name in self.rank_files(rank, world_size)]


def detect_layout(source: "str | Source", pattern: str | None = None) -> CheckpointLayout:
    """The layout of ``source``: whole, or pre-sharded for N ranks.

    Args:
        source: a local file or folder, or an object-store URI.
        pattern: the shard file-name pattern to look for; None takes the manifest's, else
            :data:`DEFAULT_SHARD_PATTERN`.

    Returns:
        The layout, with the source, the pattern, the shard files found and the manifest.

    Raises:
        CheckpointError: a folder a save did not finish.
    """
    src = open_source(source)
    if src.is_file:
        return CheckpointLayout(src, pattern or DEFAULT_SHARD_PATTERN, ShardLayout(pattern or DEFAULT_SHARD_PATTERN, {}),
                      None, ())
    names = tuple(src.names())
    manifest = read_manifest(src)
    pattern = pattern or (manifest.pattern if manifest else DEFAULT_SHARD_PATTERN)
    if "/" in pattern:  # shards in subfolders: the names below the folder that the pattern globs
        return CheckpointLayout(src, pattern, find_shard_layout(src.glob(pattern.format(rank="*", part="*")), pattern),
                      manifest, names)
    shards = find_shard_layout(list(names), pattern)
    if (src.remote and not shards.parts_by_rank and manifest is None
            and not any(n.endswith(".safetensors") for n in names) and any(n.endswith("/") for n in names)):
        # vLLM's s3_glob finds a rank's shards at any depth below the prefix. Listed recursively
        # only here, where the prefix holds nothing else to load: a whole checkpoint's listing
        # stays one level deep (a prefix of many models is never walked to load one of them).
        shards = find_shard_layout(src.glob("*"), pattern, any_depth=True)
    return CheckpointLayout(src, pattern, shards, manifest, names)
