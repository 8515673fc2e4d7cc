"""Load formats (vLLM's ``--load-format`` names): one entry each, in ``FORMATS``.

An entry says everything about its format: the backends it may read with, the extra-config keys
it takes, and its ``choose``: the read choice (backend, layout, shared or not) from one rank's facts,
as vLLM registers a loader class per format. A new format is one entry; the CLI, the Python API
(:func:`make_load_config`) and the vLLM plugin all validate names and keys against ``FORMATS``.

A format's keys are its own (``pattern`` for the pre-sharded layouts, ``distributed`` for
shared reads: Run:ai's, and distload's own shared reads under ``auto``) plus those of the backends it reads with, each checked by the backend's own
check: adding a key to a backend adds it to every format that reads with it. ``auto`` takes only
the keys that mean something whichever backend it picks.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from distload.config import LoadConfig, check_distributed, parse_extra_config
from distload.errors import ConfigError
from distload.loading.backends import BACKENDS
from distload.loading.backends.base import Check
from distload.loading.choice import ReadChoice, ReadFacts
from distload.loading.layout import check_pattern


@dataclass(frozen=True)
class LoadFormat:
    """One load format. ``choose`` is pure and deterministic: every rank of a job calls it with
    the same facts and so takes the same decision, which shared reads rely on (the
    caller still cross-checks the file lists)."""

    name: str
    backends: tuple[str, ...]  # the backends this format may read with
    choose: Callable[[ReadFacts], ReadChoice]  # the read, from one rank's facts
    own_keys: Mapping[str, Check] = field(default_factory=dict)
    # Of the backends' keys, only these (None: all of them).
    backend_keys: tuple[str, ...] | None = None
    # Keys a user may reasonably try here that this format cannot honour, with the reason.
    why_not: Mapping[str, str] = field(default_factory=dict)
    # False: the weights are made up, not read (vLLM's plugin leaves those to vLLM's own format).
    reads_checkpoint: bool = True

    @property
    def keys(self) -> dict[str, Check]:
        keys: dict[str, Check] = {}
        for backend in self.backends:
            for key, check in BACKENDS[backend].keys.items():
                if self.backend_keys is None or key in self.backend_keys:
                    keys.setdefault(key, check)
        keys.update(self.own_keys)
        return keys


# -- each format's read choice ----------------------------------------------------------------

def _plain(facts: ReadFacts) -> str:
    """safetensors' reader needs a local file: on an object store the safetensors formats read
    the same tensors with ranged GETs."""
    return "ranged" if facts.remote else "safetensors"


def _safetensors(facts: ReadFacts) -> ReadChoice:
    return ReadChoice(False, _plain(facts), False)


def _sharded_state(facts: ReadFacts) -> ReadChoice:
    return ReadChoice(True, _plain(facts), False)


def _runai_streamer(facts: ReadFacts) -> ReadChoice:
    return ReadChoice(False, "runai", facts.asked is not None and facts.many, facts.asked or "node")


def _runai_streamer_sharded(facts: ReadFacts) -> ReadChoice:
    return ReadChoice(True, "runai", False)


def _instanttensor(facts: ReadFacts) -> ReadChoice:
    # InstantTensor shares over the whole group it is handed (its preflight refuses `node` on
    # several nodes).
    return ReadChoice(False, "instanttensor", facts.many, facts.asked or "job")


def _dummy(facts: ReadFacts) -> ReadChoice:
    return ReadChoice(facts.sharded_layout_found, "dummy", False)


# What `auto` picks on a CPU, from benchmarks/results/load.md: on local files distload's own
# parallel-pread reader (no intermediate buffer, no memory map, new tensors prefaulted) is ahead of
# the fastest peer (plain safetensors, fastsafetensors, Run:ai) in every cell, warm and cold, 1
# and 2 ranks, whole and per-rank shards; a file truncated under it is an error naming the file
# and tensor, where a memcpy out of a memory map dies of SIGBUS. With the page cache already
# sharing reads between a node's ranks, each rank reading alone beats Run:ai's distributed mode
# over gloo, so local loads share reads only when asked to (``distributed``). The same for TP slices
# of local files: pread asks for each rank's slices only, so TP ranks read each byte once per job
# already; sharing them anyway took a median 0.56 s against 0.32 s alone (TP 2 on 2 ranks,
# 315 MiB, warm page cache, 6 runs each: the exchange over gloo is the cost).
# On an object store nothing shares the reads, so ranks that need the same bytes read them
# in a shared read, across the whole job, with distload's own shared ranged reads: on two nodes x 2
# ranks they served each byte once, as Run:ai's job-wide mode does, and loaded faster than it
# (benchmarks/results/shared.md); they also split what Run:ai cannot (a subgroup, the slices of
# TP ranks and their data-parallel replicas, shard files replicas share). A GPU job keeps Run:ai's
# device path.
AUTO_CPU_BACKEND = "pread"


def _auto(facts: ReadFacts) -> ReadChoice:
    """The measured pick for this machine and source (see the comment above)."""
    many, scope, asked, remote = facts.many, facts.scope, facts.asked, facts.remote
    runai_shared = many and not facts.sharded_layout_found and facts.whole_job
    own = "ranged" if remote else AUTO_CPU_BACKEND  # distload's readers of byte ranges
    # Run:ai's reader fetches from the store itself: with a node cache, distload's ranged reads
    # (which go through it) instead.
    store_reader = "ranged" if facts.cached else "runai"
    # Whether ranks that need the same bytes share their reading: where asked, or by default on
    # an object store (job-wide: on one node that is the same ranks).
    share = scope is not False and (asked is not None or remote)
    shared_scope = asked or "job"
    if facts.sliced:
        # Every rank of a whole checkpoint shares: replicas keep the same slices, and TP ranks keep
        # parts of the same tensors (a slice along dim 1 is half of every row: a ranged read of one
        # rank's rows fetches the other's with them, so alone each TP rank fetches those whole).
        return ReadChoice(False, own, share and many, shared_scope)
    if facts.sharded_layout_found:
        if share and facts.replicas > 1:  # each replica of a TP rank needs the same shard files
            return ReadChoice(True, own, True, shared_scope)
        if remote:
            return ReadChoice(True, store_reader, False)
        return ReadChoice(True, "pread" if facts.device_type != "cuda" else "runai", False)
    if facts.device_type == "cuda" and not remote:
        if many and not facts.device_data:
            # A group that cannot carry device tensors (vLLM's gloo cpu_group): InstantTensor
            # and Run:ai share over NCCL only; distload's readers stage the buckets through the host.
            return ReadChoice(False, own, share, shared_scope)
        if facts.instanttensor_installed:
            return ReadChoice(False, "instanttensor", many and scope is not False, asked or "job")
        # Run:ai over NCCL reads each byte once per node (each node has its own files) and
        # broadcasts device to device.
        return ReadChoice(False, "runai", runai_shared and scope is not False, asked or "node")
    if not (share and many):
        return ReadChoice(False, store_reader if remote else AUTO_CPU_BACKEND, False)
    if remote and facts.whole_job and facts.device_type == "cuda" and not facts.cached:
        # Run:ai streams to the device and broadcasts device to device (not measured here yet:
        # benchmarks/gpu_check.sh).
        return ReadChoice(False, "runai", True, shared_scope)
    return ReadChoice(False, own, True, shared_scope)


# -- the registry -----------------------------------------------------------------------------

_PATTERN = {"pattern": check_pattern}
# Run:ai's reader fetches from the store itself, past the node cache.
_RUNAI_PAST_THE_CACHE = ("Run:ai's reader fetches from the store itself, so the node cache cannot serve it; "
                         "load with --load-format auto or safetensors (distload's ranged reads go through it)")
_NOT_CACHED = (("cache_dir", _RUNAI_PAST_THE_CACHE), ("cache_max_gib", _RUNAI_PAST_THE_CACHE))

FORMATS: dict[str, LoadFormat] = {f.name: f for f in (
    LoadFormat("auto", ("pread", "ranged", "instanttensor", "runai"), _auto,
               {**_PATTERN, "distributed": check_distributed},
               backend_keys=("huge_pages", "concurrency", "cache_dir", "cache_max_gib")),
    LoadFormat("safetensors", ("safetensors", "ranged"), _safetensors),
    LoadFormat("runai_streamer", ("runai",), _runai_streamer, {"distributed": check_distributed},
               why_not=dict(_NOT_CACHED)),
    LoadFormat("instanttensor", ("instanttensor",), _instanttensor),
    LoadFormat("sharded_state", ("safetensors", "ranged"), _sharded_state, _PATTERN),
    # vLLM rejects concurrency/memory_limit for the sharded Run:ai format although its docs
    # promise them (vLLM issue 30100); distload accepts them.
    LoadFormat("runai_streamer_sharded", ("runai",), _runai_streamer_sharded, _PATTERN, why_not={"distributed": (
        "each rank of a pre-sharded checkpoint reads different files, and Run:ai's distributed "
        "mode would silently exchange data between them"), **dict(_NOT_CACHED)}),
    LoadFormat("dummy", ("dummy",), _dummy, reads_checkpoint=False),
)}
LOAD_FORMATS = tuple(FORMATS)


def allowed_keys(load_format: str) -> list[str]:
    return sorted(FORMATS[load_format].keys)


def did_you_mean(name: str, names: tuple[str, ...] | list[str]) -> str:
    """``did you mean 'x'? `` for a name close to one of ``names`` (a typo), else nothing."""
    close = difflib.get_close_matches(name.replace("-", "_"), names, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def make_load_config(load_format: str, extra_config: str | Mapping[str, Any] | None = None) -> LoadConfig:
    """Validate a format and its extra config before anything is applied.

    Args:
        load_format: a name of :data:`LOAD_FORMATS`, in any case.
        extra_config: the format's keys, as a dict or JSON text (None: none).

    Returns:
        The validated request.

    Raises:
        ConfigError: an unknown format or key (with a guess where one is close), or a bad value.
    """
    if not isinstance(load_format, str):
        raise ConfigError(f"load format must be a string, got {load_format!r}")
    name = load_format.strip().lower()
    if name not in FORMATS:
        raise ConfigError(f"unknown load format {load_format!r}; {did_you_mean(name, LOAD_FORMATS)}"
                          f"choose one of: {', '.join(LOAD_FORMATS)}")
    fmt = FORMATS[name]
    extra = parse_extra_config(extra_config)
    allowed = fmt.keys
    unexpected = sorted(set(extra) - set(allowed))
    if unexpected:
        reasons = [f"'{key}': {fmt.why_not[key]}" for key in unexpected if key in fmt.why_not]
        allowed_text = ", ".join(sorted(allowed)) if allowed else "none"
        # A typo of an allowed key (or of another format's key that this one also takes).
        guesses = "".join(did_you_mean(str(key), sorted(allowed)).replace("did you mean", f"'{key}': did you mean")
                          for key in unexpected if key not in fmt.why_not)
        message = (f"Unexpected extra config keys {unexpected} for load format {name!r}; {guesses}"
                   f"allowed keys: {allowed_text}")
        if reasons:
            message += " (" + "; ".join(reasons) + ")"
        raise ConfigError(message)
    for key, value in extra.items():
        allowed[key](key, value)
    return LoadConfig(name, dict(extra))
