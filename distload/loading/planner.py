"""The planning step of a load, on one rank: list the source, detect its layout, take the read
choice, read the headers of this rank's files, and let the backend refuse what it could not do.

I/O on the source only, no collective: the loader runs it inside the group's agreement steps, so
a fault on one rank stops every rank before any data moves. In two halves, so that a load's
ranks can share the header reads between them (distload/loading/headers.py): ``survey_source``
(the listing, the layout, the choice, the files whose headers are needed), then ``finish_plan``
(the index from the headers, this rank's slices, the manifest's checksums, the backend's preflight); ``plan_rank`` runs
both on one rank, reading every header it needs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Mapping

from distload.config import LoadConfig
from distload.errors import CheckpointError, ConfigError, DistloadError
from distload.loading.backends import BACKENDS
from distload.loading.checksums import plan_checksums
from distload.loading.choice import ReadChoice, ReadFacts
from distload.loading.formats import FORMATS
from distload.loading.headers import read_headers
from distload.loading.index import FileInfo, build_index
from distload.loading.layout import CheckpointLayout, detect_layout
from distload.loading.manifest import check_saved_experts
from distload.loading.plan import RankPlan
from distload.loading.rank_slices import Blocks, TPPlace, plan_blocks, plan_slices
from distload.loading.stores.cache import CACHE_DIR_VARIABLE, CacheSettings, cache_settings
from distload.loading.sources import (ObjectSource, check_source, check_weight_map, content_fingerprint,
                                     is_object_store, model_config, whole_checkpoint)

if TYPE_CHECKING:
    from distload.workers.group import WorkerGroup


@dataclass(frozen=True)
class Survey:
    """What a rank finds before it reads any header: the layout, the read choice, and the files
    whose headers this rank (``paths``) and the job (``job_paths``: every rank's, so that the
    ranks can share the reading, distload/loading/headers.py) need."""

    source: str
    layout: CheckpointLayout
    choice: ReadChoice
    cache: CacheSettings | None
    tensor_parallel: TPPlace | None
    paths: list[str]
    job_paths: list[str]
    weight_map: dict[str, str] | None = None
    hint: str = ""


def plan_rank(source: str, config: LoadConfig, group: "WorkerGroup",
              tensor_parallel: TPPlace | None = None, blocks: Blocks | None = None) -> RankPlan:
    """Plan this rank's read of ``source`` (the same on a local folder and an object-store prefix:
    both go through a Source, one listing, headers by ranged reads on object stores), reading
    every header it needs itself (a load shares them: ``Loader.plan``).

    ``tensor_parallel``: a whole checkpoint is sliced for its TP rank; a pre-sharded one saved
    for its TP size gives TP rank r's files to every data-parallel replica of r.
    ``blocks``: tensor name -> (offsets, sizes) of the local shard of a DTensor it goes to, or a
    function of this rank's index that gives them (called once, here); only those bytes of a
    whole checkpoint are read. None: no DTensor targets.
    """
    return finish_plan(survey_source(source, config, group, tensor_parallel, blocks), group, blocks)


def survey_source(source: str, config: LoadConfig, group: "WorkerGroup", tensor_parallel: TPPlace | None = None,
                  blocks: Blocks | None = None) -> Survey:
    """The first half of planning: list the source, detect its layout, take the read choice, and
    name the files whose headers are needed (no header read yet)."""
    fmt = FORMATS[config.load_format]
    only = fmt.backends
    if len(only) == 1:  # the format fixes the reader: refuse what it can never serve before listing
        BACKENDS[only[0]].check_source(source, group)
    # The node cache serves object-store reads (local files have the page cache); planning's
    # own reads too (the index, config.json, headers) where a reader that uses it may be chosen.
    settings = cache_settings(config.extra) if is_object_store(source) else None
    layout = detect_layout(ObjectSource(check_source(source), settings if "ranged" in only else None)
                           if settings is not None else source, config.pattern)
    src = layout.source
    tp = tensor_parallel
    if tp is not None:
        tp.check()
    if tp is not None and layout.sharded and tp.spec is not None:
        raise ConfigError(
            f"{source} is already sharded per rank (saved for {layout.saved_world_size} ranks): load it "
            f"without a sharding spec (--tensor-parallel-size alone gives each data-parallel replica "
            f"its TP rank's files)")
    cache = settings
    choice = fmt.choose(ReadFacts(
        sharded_layout_found=layout.sharded,
        device_type=group.device.type,
        world_size=group.world_size,
        whole_job=group.is_world,
        distributed=config.distributed,
        # InstantTensor reads local files only; `auto` takes Run:ai for an object store.
        instanttensor_installed=not src.remote and BACKENDS["instanttensor"].available(),
        remote=src.remote,
        sliced=(tp is not None or blocks is not None) and not layout.sharded,
        # Ranks that load the same shard files of a pre-sharded checkpoint (data-parallel replicas).
        replicas=group.world_size // tp.shard_count if tp is not None else 1,
        device_data=group.wire_device == group.device,
        cached=cache is not None,
    ))
    if cache is not None and choice.backend == "runai":
        # Only the environment can bring a cache here (the Run:ai formats refuse the keys): say
        # so rather than read past it.
        raise ConfigError(f"{CACHE_DIR_VARIABLE} is set, and --load-format {config.load_format} reads with "
                          f"Run:ai, whose reader fetches from the store itself, past the node cache; load with "
                          f"--load-format auto or safetensors (distload's ranged reads use the cache), or unset "
                          f"{CACHE_DIR_VARIABLE}")
    if blocks is not None and layout.sharded:
        raise ConfigError(f"{source} is sharded per rank; a model of DTensors loads from a whole checkpoint, "
                          f"each rank reading its local shards' bytes")
    if not choice.sharded:
        paths, weight_map = whole_checkpoint(src)
        hint = ""
        if layout.shards.parts_by_rank:
            hint = (f"; {src.folder} looks like a pre-sharded checkpoint (files for ranks "
                    f"{layout.shards.ranks}): load it with --load-format sharded_state or "
                    f"runai_streamer_sharded")
        return Survey(source, layout, choice, cache, tp, paths, paths, weight_map, hint)
    if src.is_file:
        raise CheckpointError(f"{source}: a pre-sharded load format needs a folder of per-rank files, got a file")
    if layout.manifest is not None:
        check_saved_experts(layout.manifest, tp, source)
    rank, world_size = (tp.shard_rank, tp.shard_count) if tp is not None else (group.rank, group.world_size)
    paths = layout.rank_paths(rank, world_size)
    job = set(paths)
    for other in range(world_size):
        try:
            job.update(layout.rank_paths(other, world_size))
        except DistloadError:
            continue  # that rank's own survey fails with this error, and every rank hears of it
    return Survey(source, layout, choice, cache, tp, paths, sorted(job))


def finish_plan(survey: Survey, group: "WorkerGroup", blocks: Blocks | None = None,
                headers: Mapping[str, FileInfo] | None = None) -> RankPlan:
    """The second half of planning: the index from the headers (``headers``: those other ranks
    read, by path; the rest are read here), this rank's slices, and the backend's preflight."""
    source, layout, choice, tp = survey.source, survey.layout, survey.choice, survey.tensor_parallel
    src = layout.source
    index = build_index(read_headers(src, survey.paths, headers), hint=survey.hint)
    if not choice.sharded:
        if survey.weight_map is not None:
            check_weight_map(src.folder, survey.weight_map, index)
        plan = RankPlan(source, choice, index, fingerprints=_fingerprints(choice, src, index))
        if tp is not None:
            plan = replace(plan, tensor_parallel=tp, slices=plan_slices(plan.index, tp, lambda: model_config(src)))
        elif blocks is not None:
            plan = replace(plan, slices=plan_blocks(plan.index, blocks(plan.index) if callable(blocks) else blocks))
    else:
        rank = tp.shard_rank if tp is not None else group.rank
        manifest = layout.manifest
        plan = RankPlan(source, choice, index,
                        frozenset(manifest.keys_for_rank(rank)) if manifest else None,
                        dict(manifest.aliases.get(rank, {})) if manifest else {},
                        dict(manifest.views.get(rank, {})) if manifest else {},
                        fingerprints=_fingerprints(choice, src, index),
                        tensor_parallel=tp)
    if survey.cache is not None and choice.backend == "ranged":
        plan = replace(plan, cache=survey.cache)
    # Whatever the format: a whole-checkpoint read of a manifest's files is checked too.
    plan = replace(plan, checksums=plan_checksums(layout.manifest, src, index))
    BACKENDS[choice.backend].preflight(plan, group)
    return plan


def _fingerprints(choice: ReadChoice, src, index) -> tuple[str, ...]:
    """For a shared read of local files, each file's content fingerprint: an object key names
    the same bytes for every rank, a local path on two nodes may not."""
    if not choice.shared or src.remote:
        return ()
    return tuple(content_fingerprint(info) for info in index.files)
