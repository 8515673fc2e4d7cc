"""The read choice: which backend reads, from which layout, and whether ranks cooperate.

Pure and deterministic: every rank calls :func:`choose_read` with the same facts and so takes the
same decision, which cooperative backends rely on (the agreement step still cross-checks it).

A *read group* is the set of ranks that need exactly the same files:

- whole checkpoint: every rank needs every tensor, so all ranks form one group and may read
  cooperatively (Run:ai distributed, InstantTensor with the group's handle);
- per-rank shards saved for the job's world size: each rank is its own group and reads only its
  files, with no collective in the read path.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReadChoice:
    """How one rank reads: which layout, which backend, and whether ranks read cooperatively.

    ``scope`` (cooperative reads only): which ranks split the reading of bytes they all need,
    those of each node (``node``: Run:ai's default mode) or those of the whole job (``job``:
    each byte leaves storage once per job).
    """

    sharded: bool
    backend: str  # a backend's name (distload.loading.backends.BACKENDS)
    cooperative: bool
    scope: str = "node"


def sharing_scope(distributed: bool | str | None) -> str | bool | None:
    """The extra config's ``distributed`` as a scope: None (unset: the format decides), False
    (never cooperate), ``node`` (true means what it means in Run:ai: per node) or ``job``."""
    if distributed is True:
        return "node"
    return distributed


# What `auto` picks on a CPU, from benchmarks/results/load.md: on local files distload's own
# parallel-pread reader (no intermediate buffer, no memory map, new tensors prefaulted) is ahead of
# the fastest peer (plain safetensors, fastsafetensors, Run:ai) in every cell, warm and cold, 1
# and 2 ranks, whole and per-rank shards; a file truncated under it is an error naming the file
# and tensor, where a memcpy out of a memory map dies of SIGBUS. With the page cache already
# sharing reads between a node's ranks, each rank reading alone beats Run:ai's distributed mode
# over gloo, so local loads cooperate only when asked to (``distributed``). The same for TP slices
# of local files: pread asks for each rank's slices only, so TP ranks read each byte once per job
# already; sharing them anyway took a median 0.56 s against 0.32 s alone (TP 2 on 2 ranks,
# 315 MiB, warm page cache, 6 runs each: the exchange over gloo is the cost).
# On an object store nothing shares the reads, so ranks that need the same bytes read them
# cooperatively, across the whole job, with distload's own shared ranged reads: on two nodes x 2
# ranks they served each byte once, as Run:ai's job-wide mode does, and loaded faster than it
# (benchmarks/results/shared.md); they also split what Run:ai cannot (a subgroup, the slices of
# TP ranks and their data-parallel replicas, shard files replicas share). A GPU job keeps Run:ai's
# device path.
AUTO_CPU_BACKEND = "pread"


def choose_read(load_format: str, *, sharded_layout_found: bool, device_type: str, world_size: int,
                distributed: bool | str | None, instanttensor_installed: bool, remote: bool = False,
                whole_job: bool = True, sliced: bool = False, replicas: int = 1) -> ReadChoice:
    """Map a load format (already validated) to a read, for one rank; pure and deterministic.

    Every rank of a job calls this with the same arguments and so takes the same decision,
    which the cooperative backends rely on (the caller still cross-checks the file lists).
    ``distributed``: the extra config's value (None where it is not set; see sharing_scope).
    ``remote``: the source is an object store. safetensors' reader needs a local file, so there
    the safetensors formats read the same tensors with ranged GETs (backend ``ranged``).
    ``whole_job``: the group is the job's default group. Run:ai's distributed mode runs only
    there, so ``auto`` on a subgroup shares reads with distload's own readers (an explicit
    ``runai_streamer`` with ``distributed`` on a subgroup stays Run:ai's, and its preflight refuses it).
    ``sliced``: each rank keeps only its tensor-parallel slices of a whole checkpoint. ``auto``
    then reads with the readers that ask for those bytes only (pread, ranged GETs), on any device;
    an explicit format reads whole tensors and the loader keeps the slice.
    ``replicas``: ranks holding the same tensor-parallel rank (data-parallel replicas); with more
    than one, ``auto`` lets them share the reading of their shard files (the slices of a whole
    checkpoint are shared between all ranks, replicas or not).
    """
    many = world_size > 1
    scope = sharing_scope(distributed)
    asked = scope if isinstance(scope, str) else None  # an explicit node or job
    runai_cooperative = many and not sharded_layout_found and whole_job
    plain = "ranged" if remote else "safetensors"
    own = "ranged" if remote else AUTO_CPU_BACKEND  # distload's readers of byte ranges
    if load_format == "safetensors":
        return ReadChoice(False, plain, False)
    if load_format == "sharded_state":
        return ReadChoice(True, plain, False)
    if load_format == "runai_streamer":
        return ReadChoice(False, "runai", asked is not None and many, asked or "node")
    if load_format == "runai_streamer_sharded":
        return ReadChoice(True, "runai", False)
    if load_format == "instanttensor":
        return ReadChoice(False, "instanttensor", many)
    if load_format == "dummy":
        return ReadChoice(sharded_layout_found, "dummy", False)
    if load_format != "auto":
        raise AssertionError(f"unvalidated load format {load_format!r}")
    # Whether ranks that need the same bytes share their reading: where asked, or by default on
    # an object store (job-wide: on one node that is the same ranks).
    share = scope is not False and (asked is not None or remote)
    shared_scope = asked or "job"
    if sliced:
        # Every rank of a whole checkpoint shares: replicas keep the same slices, and TP ranks keep
        # parts of the same tensors (a slice along dim 1 is half of every row: a ranged read of one
        # rank's rows fetches the other's with them, so alone each TP rank fetches those whole).
        return ReadChoice(False, own, share and many, shared_scope)
    if sharded_layout_found:
        if share and replicas > 1:  # each replica of a TP rank needs the same shard files
            return ReadChoice(True, own, True, shared_scope)
        return ReadChoice(True, "pread" if not remote and device_type != "cuda" else "runai", False)
    if device_type == "cuda" and not remote:
        if instanttensor_installed:
            return ReadChoice(False, "instanttensor", many and scope is not False)
        # Run:ai over NCCL reads each byte once per node (each node has its own files) and
        # broadcasts device to device.
        return ReadChoice(False, "runai", runai_cooperative and scope is not False, asked or "node")
    if not (share and many):
        return ReadChoice(False, "runai" if remote else AUTO_CPU_BACKEND, False)
    if remote and whole_job and device_type == "cuda":
        # Run:ai streams to the device and broadcasts device to device (not measured here yet:
        # benchmarks/gpu_check.sh).
        return ReadChoice(False, "runai", True, shared_scope)
    return ReadChoice(False, own, True, shared_scope)
