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
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch

from distload.loading.backends import BACKENDS, HOST_TENSOR_BACKENDS, ReadRequest
from distload.loading.backends.instanttensor import check_instanttensor_device
from distload.loading.backends.runai import check_runai_source
from distload.loading.index import CheckpointIndex, build_index, content_fingerprint
from distload.config import LoadConfig, make_load_config
from distload.errors import BackendUnavailableError, CheckpointError, DistloadError, GroupError
from distload.group import WorkerGroup
from distload.loading.host_memory import HostMemory
from distload.loading.manifest import manifest_files_for_rank, read_manifest
from distload.loading.layout import (
    ReadChoice,
    choose_read,
    find_shard_layout,
    mismatched_ranks,
    shard_files_for_rank,
)
from distload.loading.report import (
    LoadReport,
    Progress,
    RankReport,
    gib_per_s,
    peak_rss_bytes,
    state_digest,
    storage_read_bytes,
)
from distload.loading.sources import check_weight_map, describe_names, open_source, whole_checkpoint

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
    # For a cooperative read of local files: each file's content fingerprint, compared across ranks.
    fingerprints: tuple[str, ...] = ()

    def signature(self) -> list[tuple]:
        """What ranks compare before a cooperative read: path, size (and content) per file."""
        if not self.fingerprints:
            return self.index.signature()
        return [(path, size, fp) for (path, size), fp in zip(self.index.signature(), self.fingerprints)]


def plan_rank(source: str, config: LoadConfig, group: WorkerGroup) -> RankPlan:
    """List the source and read its headers for this rank (I/O on the source only, no collective).

    The same on a local folder and an object-store prefix: both go through a Source (one listing,
    headers by ranged reads on object stores).
    """
    src = open_source(source)
    if config.load_format == "instanttensor":
        if src.remote:
            raise BackendUnavailableError(
                f"{source}: --load-format instanttensor reads local files only; load an object-store "
                f"source with runai_streamer (extra config {{\"distributed\": true}} reads each byte "
                f"once per node), or copy the checkpoint to local disk first"
            )
        check_instanttensor_device(group.device)  # fail at once, before any listing cost
    is_folder = not src.is_file
    folder = src.folder
    names = src.names() if is_folder else []
    manifest = read_manifest(src) if is_folder else None
    pattern = config.pattern
    if manifest is not None and "pattern" not in config.extra:
        pattern = manifest.pattern
    layout = find_shard_layout(names, pattern)
    choice = choose_read(
        config.load_format,
        sharded_layout_found=bool(layout.parts_by_rank) or manifest is not None,
        device_type=group.device.type,
        world_size=group.world_size,
        distributed=config.distributed,
        # InstantTensor reads local files only; `auto` takes Run:ai for an object store.
        instanttensor_installed=not src.remote and importlib.util.find_spec("instanttensor") is not None,
        remote=src.remote,
    )
    if not choice.sharded:
        paths, weight_map = whole_checkpoint(src)
        hint = ""
        if layout.parts_by_rank:
            hint = (f"; {folder} looks like a pre-sharded checkpoint (files for ranks "
                    f"{layout.ranks}): load it with --load-format sharded_state or "
                    f"runai_streamer_sharded")
        index = build_index(src.read_headers(paths), hint=hint)
        if weight_map is not None:
            check_weight_map(folder, weight_map, index)
        fingerprints: tuple[str, ...] = ()
        if choice.cooperative and not src.remote:
            # An object key names the same bytes for every rank; a local path may not.
            fingerprints = tuple(content_fingerprint(info) for info in index.files)
        return RankPlan(source, choice, index, fingerprints=fingerprints)
    if not is_folder:
        raise CheckpointError(f"{source}: a pre-sharded load format needs a folder of per-rank files, got a file")
    if manifest is None:
        files = shard_files_for_rank(layout, folder, group.rank, group.world_size, describe_names(names))
        index = build_index(src.read_headers([src.path(name) for name in files]))
        return RankPlan(source, choice, index)
    files = manifest_files_for_rank(manifest, src, pattern, group.rank, group.world_size)
    index = build_index(src.read_headers([src.path(name) for name in files]))
    return RankPlan(source, choice, index, frozenset(manifest.keys_for_rank(group.rank)),
                    dict(manifest.aliases.get(group.rank, {})))


def check_cooperative_lists(group: WorkerGroup, plan: RankPlan) -> None:
    """Every rank must take the same read decision, and cooperative reads need identical lists."""
    mine = (plan.choice, plan.signature())
    everyone = group.exchange(mine)
    choices = {rank: choice for rank, (choice, _) in enumerate(everyone)}
    if len(set(choices.values())) > 1:
        def describe(c: ReadChoice) -> str:
            return (f"{c.backend} ({'per-rank shards' if c.sharded else 'whole checkpoint'}"
                    f"{', cooperative' if c.cooperative else ''})")

        raise GroupError(
            "ranks chose different readers for the same load: "
            + "; ".join(f"rank {r}: {describe(c)}" for r, c in choices.items())
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


def host_memory_for(choice: ReadChoice, extra: Mapping[str, Any], local_ranks: int) -> HostMemory:
    """Where a read's new host tensors come from. ``huge_pages`` concerns only the backends that
    create host tensors themselves; the others (Run:ai, InstantTensor, dummy) ignore it, and an
    explicit true must not fail a load it cannot affect."""
    setting = extra.get("huge_pages") if choice.backend in HOST_TENSOR_BACKENDS else False
    return HostMemory(setting, local_ranks)


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
        def plan_and_check() -> RankPlan:
            plan = plan_rank(self.source, self.config, self.group)
            if plan.choice.backend == "runai":
                check_runai_source([info.path for info in plan.index.files])
            return plan

        plan = self.group.agree("planning the load", plan_and_check)
        check_cooperative_lists(self.group, plan)
        return plan

    def tensors(self, plan: RankPlan | None = None,
                destinations: Mapping[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Steps 3-4: stream this rank's tensors (planning first unless ``plan`` is given).

        ``destinations`` (checkpoint name -> existing tensor of the same dtype and shape): a
        backend that can may read straight into them (see ReadRequest).
        """
        group = self.group
        start = time.perf_counter()
        read_before = storage_read_bytes()
        if plan is None:
            plan = self.plan()
        expected = {t.name for t in plan.index.tensors}
        received: set[str] = set()
        alias_targets: dict[str, torch.Tensor | None] = {target: None for target in plan.aliases.values()}
        nbytes = 0
        progress = Progress(plan.index.nbytes, enabled=self.progress and group.rank == 0)
        run = None
        try:
            # Inside the try: an explicit huge_pages=true on a kernel without them fails this
            # rank, and the others hear of it instead of waiting.
            host_memory = host_memory_for(plan.choice, self.config.extra, group.local_world_size)
            if host_memory.why_not:
                log.debug("not marking new host tensors for huge pages: %s", host_memory.why_not)
            request = ReadRequest(plan.index, group.device, group, self.config.extra,
                                  plan.choice.cooperative, dict(destinations or {}), host_memory)
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
            if plan.choice.cooperative and run is not None:
                # The other ranks are inside the backend's collectives, waiting for this rank's
                # share: finish the read (dropping the tensors) so that they can complete.
                try:
                    for _ in run.tensors():
                        pass
                except Exception:
                    pass
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
            read_bytes=None if read_before is None else (storage_read_bytes() or 0) - read_before,
            peak_rss_bytes=peak_rss_bytes(),
            huge_page_marked_bytes=request.host_memory.marked_bytes,
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
