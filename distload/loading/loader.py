"""One load, end to end: plan on every rank, agree, read, check, report.

Order of calls (every rank of the group makes each of them; each is a collective on the group's
gloo control group, with the group's timeout):

1. ``agree("planning the load")``, twice: list the source, detect its layout, take the read
   choice, read this rank's share of the job's headers (:mod:`distload.loading.headers`: each
   object's header leaves the store once per job); then, from every rank's share, the index,
   this rank's slices and the backend's preflight (:mod:`distload.loading.planner`). A fault on
   any rank (missing file, bad header, wrong shard layout) stops every rank here, before any data.
2. ``exchange`` (:mod:`distload.loading.agreement`): every rank's read choice and file list;
   ranks that will share a read must hold the identical list, or every rank stops naming
   the ranks that differ.
3. The backend streams ``(name, tensor)`` pairs onto the rank's device; each is checked against
   the manifest's CRC-32Cs where it records them (:mod:`distload.loading.checksums`), and
   against the rank plan on its way out (:mod:`distload.loading.delivery`). A corrupt tensor
   fails this rank, and step 4 names it on every rank.
4. ``check_all_ok("loading")``: each rank says whether its read completed (every tensor of its
   index arrived); a failed rank is named on all of them.
5. ``exchange(report)`` (``load(gather=True)`` only): the rank reports, for the job's report.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generator, Iterator, Mapping

import torch

from distload.errors import DistloadError
from distload.workers.group import WorkerGroup
from distload.loading.agreement import agree_on_read
from distload.loading.backends import BACKENDS, BackendRun, ReadRequest
from distload.loading.checksums import ChecksumCheck
from distload.loading.delivery import Delivery
from distload.loading.formats import make_load_config
from distload.loading.host_memory import HostMemory
from distload.loading.plan import RankPlan
from distload.loading.headers import headers_by_path, read_dealt
from distload.loading.index import FileInfo
from distload.loading.planner import Survey, finish_plan, survey_source
from distload.loading.rank_slices import Blocks, TPPlace
from distload.loading.sources import check_unchanged, source_string
from distload.loading.report import (
    LoadReport,
    Progress,
    RankReport,
    gib_per_s,
    peak_rss_bytes,
    state_digest,
    storage_read_bytes,
)

if TYPE_CHECKING:
    from distload.tp.spec import ShardingSpec

log = logging.getLogger("distload")


@dataclass
class LoadResult:
    """A finished load on this rank: its tensors, its report, and every rank's when gathered."""

    state: dict[str, torch.Tensor]
    rank_report: RankReport
    report: LoadReport | None = None


class LoadStream:
    """This rank's ``(name, tensor)`` pairs, one at a time; ``rank_report`` once they are all out.

    Iterate it to the end on every rank (the last step is collective). Closing it early
    (``close()``, or dropping it: nothing else holds the steps) tells the other ranks this one
    stopped.
    """

    def __init__(self, steps: Generator[tuple[str, torch.Tensor], None, RankReport]):
        self._outcome = _Outcome()
        # Not a bound method: a generator holding this object would keep it alive in a cycle, and
        # a dropped stream would tell the other ranks only when the garbage collector ran.
        self._tensors = _hand_out(steps, self._outcome)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._tensors

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._tensors)

    def close(self) -> None:
        self._tensors.close()

    @property
    def rank_report(self) -> RankReport:
        if self._outcome.report is None:
            raise DistloadError("the load has not finished: iterate every tensor before asking for its report")
        return self._outcome.report


class _Outcome:
    report: RankReport | None = None


def _hand_out(steps: Generator[tuple[str, torch.Tensor], None, RankReport],
              outcome: _Outcome) -> Iterator[tuple[str, torch.Tensor]]:
    # The steps hand out the tensors, then return the report; closing this closes them.
    outcome.report = yield from steps


class Loader:
    """Load one source onto this rank's device.

    ``stream()`` hands out ``(name, tensor)`` pairs without holding them; ``load()`` returns a
    :class:`LoadResult`. Both make the same collectives on every rank (see the module docstring),
    so every rank of the group must call the same method with the same arguments.

    Args:
        source: as for :func:`load`.
        load_format: as for :func:`load`.
        extra_config: as for :func:`load`; checked here.
        group: the WorkerGroup to load over (required: a Loader lives longer than one call).
        progress: show a progress bar on rank 0 (when stderr is a terminal).
        tensor_parallel_size: as for :func:`load`.
        sharding: as for :func:`load`.
        tensor_parallel_rank: this rank's TP rank where its TP group is not consecutive ranks
            (default ``rank % tensor_parallel_size``).
        expert_parallel_size: as for :func:`load`.
        expert_placement_strategy: as for :func:`load`.
        expert_parallel_rank: this rank's EP rank where it is not the default
            ``(rank // tensor_parallel_size) % expert_parallel_size``.
        blocks: DTensor targets: tensor name -> the block of it this rank reads (used by
            :func:`load_dtensors` and ``reload_into``).
    """

    def __init__(self, source: "str | os.PathLike[str]", load_format: str = "auto",
                 extra_config: str | Mapping[str, Any] | None = None, *, group: WorkerGroup,
                 progress: bool = False, tensor_parallel_size: int | None = None,
                 sharding: "str | ShardingSpec | None" = None, tensor_parallel_rank: int | None = None,
                 blocks: Blocks | None = None, expert_parallel_size: int | None = None,
                 expert_placement_strategy: str | None = None, expert_parallel_rank: int | None = None):
        self.config = make_load_config(load_format, extra_config)
        self.source = source_string(source)  # a pathlib.Path or S3:// works as it does in vLLM
        self.group = group
        self.progress = progress
        # With a size: rank r keeps TP rank r % size's slices (or, pre-sharded, its files).
        # With an EP size too: the ranks are T x P x k, rank r EP rank (r // T) % P (distload/tp/place.py).
        self.tensor_parallel = TPPlace.of(group, tensor_parallel_size, sharding, tensor_parallel_rank,
                                          expert_parallel_size, expert_placement_strategy, expert_parallel_rank)
        # DTensor targets: tensor name -> (offsets, sizes) of its local shard, or a function of the
        # checkpoint's index giving them; only those bytes are read. None (or none): no DTensors.
        self._blocks = blocks if callable(blocks) or blocks else None

    def plan(self) -> RankPlan:
        """Steps 1-2 (collective): every rank plans, then all agree. No tensor data moves.

        Planning is two steps: each rank surveys the source and reads its share of the job's
        headers (object stores: each header leaves the store once per job), then each rank plans
        from every rank's share (distload/loading/headers.py)."""
        group = self.group
        surveyed: list[Survey] = []

        def survey_and_read() -> tuple[FileInfo, ...]:
            surveyed.append(survey_source(self.source, self.config, group, self.tensor_parallel, self._blocks))
            return read_dealt(surveyed[0].layout.source, surveyed[0].job_paths, group.rank, group.world_size)

        shares = group.gather("planning the load", survey_and_read)
        plan = group.agree("planning the load",
                           lambda: finish_plan(surveyed[0], group, self._blocks, headers_by_path(shares)))
        members, needs = agree_on_read(self.group, plan)
        return replace(plan, members=members, needs=needs) if members else plan

    def stream(self, plan: RankPlan | None = None,
               destinations: Mapping[str, torch.Tensor] | None = None) -> LoadStream:
        """Steps 3-4, planning first unless ``plan`` is given.

        ``destinations`` (checkpoint name -> existing tensor of the same dtype and shape): a
        backend that can may read straight into them (see ReadRequest).
        """
        return LoadStream(self._steps(plan, dict(destinations or {})))

    def load(self, *, gather: bool = False, digest: bool = False) -> LoadResult:
        """Every tensor of this rank in a dict.

        Args:
            gather: (collective) every rank's report, as the job's report, on every rank.
            digest: the rank report gets the state's digest (a pass over the bytes).

        Returns:
            The tensors, this rank's report, and with ``gather`` the job's.
        """
        stream = self.stream()
        state = dict(stream)
        rank_report = stream.rank_report
        if digest:
            rank_report.digest = state_digest(state)
        report = None
        if gather:
            report = LoadReport(self.group.world_size, self.config.load_format, self.source,
                                self.group.exchange(rank_report))
        return LoadResult(state, rank_report, report)

    # -- the steps ---------------------------------------------------------------------------
    def _steps(self, plan: RankPlan | None,
               destinations: Mapping[str, torch.Tensor]) -> Generator[tuple[str, torch.Tensor], None, RankReport]:
        group = self.group
        start = time.perf_counter()
        read_before = storage_read_bytes()
        if plan is None:
            plan = self.plan()
        progress = Progress(plan.nbytes, enabled=self.progress and group.rank == 0)
        delivery = Delivery(plan, plan.choice.backend, progress)
        run: BackendRun | None = None
        backend = BACKENDS[plan.choice.backend]
        # A reader of whole tensors: the loader keeps this rank's piece.
        cut = plan.slices if plan.slices is not None and not backend.reads_slices else None
        dropped = plan.slices.dropped if plan.slices is not None else frozenset()
        tp = plan.tensor_parallel
        checksums = ChecksumCheck(plan.checksums, plan.source, plan.index) if plan.checksums else None
        try:
            request = self._request(plan, destinations)
            run = backend.read(request)
            for name, tensor in run.tensors():
                if checksums is not None and name not in run.checked:  # the bytes as read: a slice, or whole
                    checksums.check(name, tensor, request.slices.get(name))
                if cut is not None:
                    tensor = cut.cut(name, tensor, tp)
                delivery.accept(name, tensor)
                if name not in dropped:  # another EP rank's expert: read as nothing, not handed out
                    yield name, tensor
            yield from delivery.finish()
            # After the last byte: a file changed meanwhile fails here. Not the objects read through
            # the node cache: its entries are keyed by the version planned with and its fetches
            # pinned to it (ObjectStore.read_version), so no byte of another version was taken,
            # and asking each object's version again would be a request per file on a warm load.
            through_cache = plan.cache is not None and plan.choice.backend == "ranged"
            check_unchanged([] if through_cache else plan.index.files)
            if group.device.type == "cuda":
                torch.cuda.synchronize(group.device)
        except GeneratorExit:
            # A shared read that failed meanwhile has already told every rank (and they left).
            if not (plan.choice.shared and run is not None and _drain(run)):
                group.report_failure("loading", DistloadError(
                    f"rank {group.rank} stopped consuming tensors before the load finished"))
            raise
        except BaseException as exc:
            if not getattr(exc, "reported", False):  # a shared read's round already told every rank
                group.report_failure("loading", exc)
            raise
        finally:
            progress.close()
        seconds = time.perf_counter() - start
        group.check_all_ok("loading")
        return self._rank_report(plan, run, delivery, seconds, read_before, request.host_memory)

    def _request(self, plan: RankPlan, destinations: Mapping[str, torch.Tensor]) -> ReadRequest:
        """What the backend is given, with the host-memory policy for the tensors it creates.

        ``huge_pages`` concerns only the backends that create host tensors themselves; an explicit
        true must not fail a load it cannot affect. Made inside the read's try: an explicit true on
        a kernel without huge pages fails this rank, and the others hear of it instead of waiting.
        """
        backend = BACKENDS[plan.choice.backend]
        setting = self.config.extra.get("huge_pages") if backend.creates_host_tensors else False
        host_memory = HostMemory(setting, self.group.local_world_size)
        if host_memory.why_not:
            log.debug("not marking new host tensors for huge pages: %s", host_memory.why_not)
        slices = plan.slices.slices if plan.slices is not None and backend.reads_slices else {}
        return ReadRequest(index=plan.index, device=self.group.device, group=self.group,
                           shared=plan.choice.shared, destinations=destinations,
                           host_memory=host_memory, slices=slices, options=backend.options(self.config.extra, plan),
                           checksums=plan.checksums)

    def _rank_report(self, plan: RankPlan, run: BackendRun, delivery: Delivery, seconds: float,
                     read_before: int | None, host_memory: HostMemory) -> RankReport:
        group = self.group
        tp = plan.tensor_parallel
        return RankReport(
            rank=group.rank, local_rank=group.local_rank, device=str(group.device),
            path=run.path, files=[f.path for f in plan.index.files], num_tensors=delivery.num_tensors,
            nbytes=delivery.nbytes, seconds=round(seconds, 6), gib_per_s=gib_per_s(delivery.nbytes, seconds),
            hostname=group.hostname,
            read_bytes=None if read_before is None else (storage_read_bytes() or 0) - read_before,
            requested_bytes=plan.index.nbytes if run.requested_bytes is None else run.requested_bytes,
            tensor_parallel=None if tp is None else [tp.rank, tp.size],
            expert_parallel=None if tp is None or tp.experts is None else [tp.experts.rank, tp.experts.size],
            peak_rss_bytes=peak_rss_bytes(),
            huge_page_marked_bytes=host_memory.marked_bytes,
            prefaulted_bytes=host_memory.prefaulted_bytes,
            reader_bytes=run.reader_bytes,
            received_bytes=run.received_bytes,
            cache_bytes=run.cache_bytes,
            store_bytes=run.store_bytes,
            corrupt_blocks=run.corrupt_blocks,
            cache_received_bytes=run.cache_received_bytes,
        )


def _drain(run: BackendRun) -> bool:
    """The consumer stopped early during a shared read: the other ranks are inside the
    backend's collectives, waiting for this rank's share, so finish the read (dropping the
    tensors) to let them complete. True if the read failed in a way every rank already heard of."""
    try:
        for _ in run.tensors():
            pass
    except Exception as exc:
        return bool(getattr(exc, "reported", False))
    return False


def load(source: str, load_format: str = "auto", extra_config: str | Mapping[str, Any] | None = None,
         *, group: WorkerGroup | None = None, device: str = "auto", progress: bool = False,
         tensor_parallel_size: int | None = None, sharding: "str | ShardingSpec | None" = None,
         expert_parallel_size: int | None = None, expert_placement_strategy: str | None = None,
         ) -> dict[str, torch.Tensor]:
    """Load ``source`` into a dict of tensors on this rank's device.

    Every rank of the group must call it with the same arguments.

    Args:
        source: a ``.safetensors`` file, a folder (whole, or pre-sharded per rank), or an
            object-store URI (``s3://``, ``gs://``, ``az://``); a ``pathlib.Path`` works too.
        load_format: one of :data:`LOAD_FORMATS` (vLLM's ``--load-format`` names; default ``auto``).
        extra_config: the format's extra config, as a dict or its JSON text
            (``--model-loader-extra-config``); checked before anything is read.
        group: the WorkerGroup to load over; None makes one from the environment (torchrun,
            Slurm or one process, on ``device``) for this call and closes it after.
        device: ``auto`` (``cuda:<local_rank>`` or ``cpu``), ``cpu`` or ``cuda``, for a group
            made here.
        progress: show a progress bar on rank 0 (when stderr is a terminal).
        tensor_parallel_size: T: rank r keeps TP rank ``r % T``'s slices of a whole checkpoint,
            reading only their bytes where the reader can; a checkpoint pre-sharded for T gives
            each data-parallel replica its TP rank's files.
        sharding: the sharding spec for ``tensor_parallel_size`` (a built-in name, a JSON spec
            file or a ShardingSpec; default ``decoder``).
        expert_parallel_size: P: the routed experts of a mixture-of-experts checkpoint are placed
            over P expert-parallel ranks; the job's ranks are T x P x k, rank r holds the experts
            of EP rank ``(r // T) % P`` (each TP-sliced between its T ranks) and none of the
            others, reading only their bytes. A checkpoint saved per rank at T x P: each
            rank reads its shard's files. See docs/expert-parallel.md.
        expert_placement_strategy: vLLM's names: ``linear`` (default: contiguous runs of
            experts) or ``round_robin`` (EP rank r holds experts r, r + P, ...).

    Returns:
        This rank's tensors by checkpoint name, on its device.

    Raises:
        ConfigError: a bad format, key, value or size.
        CheckpointError: a missing, incomplete or malformed checkpoint.
        RankFailedError: another rank failed (it is named).
    """
    with WorkerGroup.for_call(group, device=device) as g:
        return Loader(source, load_format, extra_config, group=g, progress=progress,
                      tensor_parallel_size=tensor_parallel_size, sharding=sharding,
                      expert_parallel_size=expert_parallel_size,
                      expert_placement_strategy=expert_placement_strategy).load().state


def iter_tensors(source: str, load_format: str = "auto",
                 extra_config: str | Mapping[str, Any] | None = None, *, group: WorkerGroup | None = None,
                 device: str = "auto", progress: bool = False, tensor_parallel_size: int | None = None,
                 sharding: "str | ShardingSpec | None" = None, expert_parallel_size: int | None = None,
                 expert_placement_strategy: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` on this rank's device without holding them all.

    Args:
        source: as for :func:`load`.
        load_format: as for :func:`load`.
        extra_config: as for :func:`load`; checked here, not at the first ``next()``.
        group: as for :func:`load`; a group made here lives until the iteration ends or the
            iterator is closed (``contextlib.closing`` makes that certain when breaking out early).
        device: as for :func:`load`.
        progress: as for :func:`load`.
        tensor_parallel_size: as for :func:`load`.
        sharding: as for :func:`load`.
        expert_parallel_size: as for :func:`load`.
        expert_placement_strategy: as for :func:`load`.

    Returns:
        An iterator of ``(name, tensor)`` pairs; each tensor is the caller's once handed out.
    """
    config = make_load_config(load_format, extra_config)  # a bad argument fails here, not at first next()
    return _iter_tensors(source, config, group, device, progress, tensor_parallel_size, sharding,
                         expert_parallel_size, expert_placement_strategy)


def _iter_tensors(source: str, config, group: WorkerGroup | None, device: str, progress: bool,
                  tensor_parallel_size: int | None, sharding, expert_parallel_size: int | None,
                  expert_placement_strategy: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    with WorkerGroup.for_call(group, device=device) as g:
        stream = Loader(source, config.load_format, config.extra, group=g, progress=progress,
                        tensor_parallel_size=tensor_parallel_size, sharding=sharding,
                        expert_parallel_size=expert_parallel_size,
                        expert_placement_strategy=expert_placement_strategy).stream()
        try:
            yield from stream
        finally:
            stream.close()
