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
    """How one rank reads: which layout, which backend, and whether ranks read cooperatively."""

    sharded: bool
    backend: str  # a backend's name (distload.loading.backends.BACKENDS)
    cooperative: bool


# What `auto` picks on a CPU, from benchmarks/results/load.md: on local files distload's own
# parallel-pread reader (no intermediate buffer, no memory map, new tensors prefaulted) is ahead of
# the fastest peer (plain safetensors, fastsafetensors, Run:ai) in every cell, warm and cold, 1
# and 2 ranks, whole and per-rank shards; a file truncated under it is an error naming the file
# and tensor, where a memcpy out of a memory map dies of SIGBUS. With the page cache already
# sharing reads between a node's ranks, each rank reading alone beats Run:ai's distributed mode
# over gloo, so local loads never cooperate.
# On an object store nothing shares the reads, so a whole checkpoint is read cooperatively.
AUTO_CPU_BACKEND = "pread"


def choose_read(load_format: str, *, sharded_layout_found: bool, device_type: str, world_size: int,
                distributed: bool, instanttensor_installed: bool, remote: bool = False,
                whole_job: bool = True, sliced: bool = False) -> ReadChoice:
    """Map a load format (already validated) to a read, for one rank; pure and deterministic.

    Every rank of a job calls this with the same arguments and so takes the same decision,
    which the cooperative backends rely on (the caller still cross-checks the file lists).
    ``remote``: the source is an object store. safetensors' reader needs a local file, so there
    the safetensors formats read the same tensors with ranged GETs (backend ``ranged``).
    ``whole_job``: the group is the job's default group. Run:ai's distributed mode runs only
    there, so ``auto`` on a subgroup reads with Run:ai on each rank alone (an explicit
    ``distributed: true`` on a subgroup stays cooperative, and Run:ai's preflight refuses it).
    ``sliced``: each rank keeps only its tensor-parallel slices of a whole checkpoint. ``auto``
    then reads with the readers that ask for those bytes only (pread, ranged GETs), on any device;
    an explicit format reads whole tensors and the loader keeps the slice.
    """
    many = world_size > 1
    runai_cooperative = many and not sharded_layout_found and whole_job
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
        if sliced:
            return ReadChoice(False, "ranged" if remote else AUTO_CPU_BACKEND, False)
        if device_type == "cuda" and not remote:
            if instanttensor_installed and not sharded_layout_found:
                return ReadChoice(False, "instanttensor", many)
            # Run:ai over NCCL reads each byte once and broadcasts device to device.
            return ReadChoice(sharded_layout_found, "runai", runai_cooperative)
        if remote:
            return ReadChoice(sharded_layout_found, "runai", runai_cooperative)
        return ReadChoice(sharded_layout_found, AUTO_CPU_BACKEND, False)
    raise AssertionError(f"unvalidated load format {load_format!r}")
