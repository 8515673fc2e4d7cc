"""One load, end to end: plan on every rank, agree, read, check, report.

Order of calls (every rank makes each of them; each ``agree``/``exchange`` is a collective on the
group's gloo control group, with the group's timeout):

1. ``agree("planning")``: list the source, read the headers, pick the reader. A fault on any
   rank (missing file, bad header, wrong shard layout) stops every rank here, before any data.
2. ``exchange(signature)``: every rank's reader choice and file list; ranks that will read
   cooperatively must hold the identical list, or every rank stops naming the ranks that differ.
   (Run:ai's distributed mode silently swaps data between ranks otherwise.)
3. The backend streams ``(name, tensor)`` pairs onto the rank's device.
4. ``check_all_ok("loading")``: each rank says whether its read completed (every tensor of its
   index arrived); a failed rank is named on all of them.
5. ``exchange(report)`` (``load_with_report`` only): rank reports gathered for the JSON report.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch

from .backends import BACKENDS, ReadRequest
from .backends.instanttensor import check_instanttensor_device
from .checkpoint import CheckpointIndex, build_index
from .config import LoadConfig, make_load_config
from .errors import CheckpointError, DistloadError, GroupError
from .group import WorkerGroup
from .manifest import manifest_files_for_rank, read_manifest
from .plan import (
    ReadChoice,
    choose_read,
    find_shard_layout,
    mismatched_ranks,
    shard_files_for_rank,
)
from .report import LoadReport, Progress, RankReport, gib_per_s, state_digest
from .sources import (
    check_source,
    check_weight_map,
    describe_names,
    list_names,
    read_header,
    whole_checkpoint,
)

log = logging.getLogger("distload")


@dataclass(frozen=True)
class RankPlan:
    """What this rank will read and how."""

    source: str
    choice: ReadChoice
    index: CheckpointIndex
    # From a distload manifest: the keys this rank must end up with, and names that share a
    # tensor's storage (tied embeddings; restored as the same tensor).
    expected_keys: frozenset[str] | None = None
    aliases: Mapping[str, str] = field(default_factory=dict)


def plan_rank(source: str, config: LoadConfig, group: WorkerGroup) -> RankPlan:
    """List the source and read its headers for this rank (local I/O only, no collective)."""
    path = check_source(source)
    is_folder = os.path.isdir(path)
    folder = path if is_folder else os.path.dirname(path)
    names = list_names(folder) if is_folder else []
    manifest = read_manifest(folder) if is_folder else None
    pattern = config.pattern
    if manifest is not None and "pattern" not in config.extra:
        pattern = manifest.pattern
    layout = find_shard_layout(names, pattern)
    if config.load_format == "instanttensor":
        check_instanttensor_device(group.device)  # fail at once, before any listing cost
    choice = choose_read(
        config.load_format,
        sharded_layout_found=bool(layout.parts_by_rank) or manifest is not None,
        device_type=group.device.type,
        world_size=group.world_size,
        distributed=config.distributed,
        instanttensor_installed=importlib.util.find_spec("instanttensor") is not None,
    )
    if not choice.sharded:
        paths, weight_map = whole_checkpoint(path)
        hint = ""
        if layout.parts_by_rank:
            hint = (f"; {folder} looks like a pre-sharded checkpoint (files for ranks "
                    f"{layout.ranks}): load it with --load-format sharded_state or "
                    f"runai_streamer_sharded")
        index = build_index((read_header(p) for p in paths), hint=hint)
        if weight_map is not None:
            check_weight_map(path, weight_map, index)
        return RankPlan(source, choice, index)
    if not is_folder:
        raise CheckpointError(f"{source}: a pre-sharded load format needs a folder of per-rank files, got a file")
    if manifest is None:
        files = shard_files_for_rank(layout, folder, group.rank, group.world_size, describe_names(names))
        index = build_index(read_header(os.path.join(folder, name)) for name in files)
        return RankPlan(source, choice, index)
    files = manifest_files_for_rank(manifest, folder, pattern, group.rank, group.world_size)
    index = build_index(read_header(os.path.join(folder, name)) for name in files)
    return RankPlan(source, choice, index, frozenset(manifest.keys_for_rank(group.rank)),
                    dict(manifest.aliases.get(group.rank, {})))


def check_cooperative_lists(group: WorkerGroup, plan: RankPlan) -> None:
    """Every rank must take the same read decision, and cooperative reads need identical lists."""
    mine = (plan.choice, plan.index.signature())
    everyone = group.exchange(mine)
    choices = {rank: choice for rank, (choice, _) in enumerate(everyone)}
    if len(set(choices.values())) > 1:
        raise GroupError(
            "ranks chose different readers for the same load: "
            + "; ".join(f"rank {r}: {c}" for r, c in choices.items())
            + ". Every rank must run the same command with the same extra config."
        )
    if not plan.choice.cooperative:
        return
    differing = mismatched_ranks([signature for _, signature in everyone])
    if differing:
        details = "; ".join(f"rank {r} {what}" for r, what in differing.items())
        raise GroupError(
            f"cooperative read refused: every rank must read the identical file list, but {details}. "
            f"Make the checkpoint visible at the same path with the same files on every node, or "
            f"read without cooperation (extra config distributed=false)."
        )


def missing_keys_error(missing: set[str], why: str) -> CheckpointError:
    shown = sorted(missing)
    return CheckpointError(
        f"Missing keys ({', '.join(shown[:10])}{' ...' if len(shown) > 10 else ''}) in loaded state! ({why})"
    )


class Loader:
    """Load one source onto this rank's device.

    ``tensors()`` streams ``(name, tensor)`` pairs without holding them; ``load()`` returns a
    dict. Both make the same collectives on every rank (see the module docstring), so every rank
    of the group must call the same method with the same arguments.
    """

    def __init__(self, source: str, load_format: str = "auto",
                 extra_config: str | Mapping[str, Any] | None = None, *, group: WorkerGroup,
                 progress: bool = False):
        self.config = make_load_config(load_format, extra_config)
        self.source = source
        self.group = group
        self.progress = progress
        self.rank_report: RankReport | None = None

    def plan(self) -> RankPlan:
        """Steps 1-2 (collective): every rank plans, then all agree. No tensor data moves."""
        plan = self.group.agree("planning the load", lambda: plan_rank(self.source, self.config, self.group))
        check_cooperative_lists(self.group, plan)
        return plan

    def tensors(self, plan: RankPlan | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Steps 3-4: stream this rank's tensors (planning first unless ``plan`` is given)."""
        group = self.group
        start = time.perf_counter()
        if plan is None:
            plan = self.plan()
        request = ReadRequest(plan.index, group.device, group, self.config.extra, plan.choice.cooperative)
        expected = {t.name for t in plan.index.tensors}
        received: set[str] = set()
        alias_targets: dict[str, torch.Tensor | None] = {target: None for target in plan.aliases.values()}
        nbytes = 0
        progress = Progress(plan.index.nbytes, enabled=self.progress and group.rank == 0)
        run = None
        try:
            run = BACKENDS[plan.choice.backend](request)
            for name, tensor in run.tensors():
                if name in received or name not in expected:
                    raise CheckpointError(
                        f"{plan.choice.backend} returned tensor {name!r} "
                        f"{'twice' if name in received else 'that no header of this rank names'}"
                    )
                received.add(name)
                size = tensor.numel() * tensor.element_size()
                nbytes += size
                progress.update(size)
                if name in alias_targets:
                    alias_targets[name] = tensor
                yield name, tensor
            if received != expected:
                raise missing_keys_error(expected - received, f"the {plan.choice.backend} reader "
                                         f"delivered {len(received)} of {len(expected)} tensors")
            for alias, target in plan.aliases.items():
                if alias_targets.get(target) is None:
                    raise missing_keys_error({alias}, f"it shares storage with {target!r}, which is "
                                             f"not in this rank's files")
                received.add(alias)
                yield alias, alias_targets[target]  # the same tensor: tied weights stay tied
            if plan.expected_keys is not None and not plan.expected_keys <= received:
                raise missing_keys_error(plan.expected_keys - received,
                                         "the manifest lists them for this rank but its files lack them")
            if group.device.type == "cuda":
                torch.cuda.synchronize(group.device)
        except GeneratorExit:
            group.report_failure("loading", DistloadError(
                f"rank {group.rank} stopped consuming tensors before the load finished"))
            raise
        except BaseException as exc:
            group.report_failure("loading", exc)
            raise
        finally:
            progress.close()
        seconds = time.perf_counter() - start
        group.check_all_ok("loading")
        self.rank_report = RankReport(
            rank=group.rank, local_rank=group.local_rank, device=str(group.device),
            path=run.path, files=[f.path for f in plan.index.files], num_tensors=len(received),
            nbytes=nbytes, seconds=round(seconds, 6), gib_per_s=gib_per_s(nbytes, seconds),
            hostname=group.hostname,
        )

    def load(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors())

    def load_with_report(self, digest: bool = True) -> tuple[dict[str, torch.Tensor], LoadReport]:
        """Load, then gather every rank's report (a collective: every rank gets the full report)."""
        state = self.load()
        assert self.rank_report is not None
        if digest:
            self.rank_report.digest = state_digest(state)
        reports = self.group.exchange(self.rank_report)
        report = LoadReport(self.group.world_size, self.config.load_format, self.source, reports)
        return state, report


def _with_group(device: str, group: WorkerGroup | None, fn):
    if group is not None:
        return fn(group)
    with WorkerGroup(device=device) as own:
        return fn(own)


def load(source: str, load_format: str = "auto", extra_config: str | Mapping[str, Any] | None = None,
         *, group: WorkerGroup | None = None, device: str = "auto",
         progress: bool = False) -> dict[str, torch.Tensor]:
    """Load ``source`` into a dict of tensors on this rank's device.

    With ``group=None`` a group is made from the environment (torchrun, Slurm or one process)
    and torn down afterwards; pass a :class:`WorkerGroup` to reuse one across loads.
    """
    return _with_group(device, group, lambda g: Loader(
        source, load_format, extra_config, group=g, progress=progress).load())


def iter_tensors(source: str, load_format: str = "auto",
                 extra_config: str | Mapping[str, Any] | None = None, *, group: WorkerGroup,
                 progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` on this rank's device without holding them all.

    Needs an explicit group: a generator cannot own a process group's lifetime safely.
    """
    return Loader(source, load_format, extra_config, group=group, progress=progress).tensors()
