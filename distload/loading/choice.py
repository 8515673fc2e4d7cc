"""The read choice: which backend reads, from which layout, and whether ranks share their reads.

Each load format takes it from the facts of one rank's load (:class:`ReadFacts`) with its own
``choose`` (``distload.loading.formats``). Pure and deterministic: every rank has the same facts
and so takes the same decision, which shared reads rely on (the agreement step still
cross-checks it).

A *read group* is the set of ranks that need exactly the same files:

- whole checkpoint: every rank needs every tensor, so all ranks form one group and may read
  in a shared read (Run:ai distributed, InstantTensor with the group's handle, distload's own);
- per-rank shards saved for the job's world size: each rank is its own group and reads only its
  files, with no collective in the read path.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReadChoice:
    """How one rank reads: which layout, which backend, and whether the read is shared.

    ``scope`` (shared reads only): which ranks split the reading of bytes they all need,
    those of each node (``node``: Run:ai's default mode) or those of the whole job (``job``:
    each byte leaves storage once per job).
    """

    sharded: bool
    backend: str  # a backend's name (distload.loading.backends.BACKENDS)
    shared: bool
    scope: str = "node"

    def __post_init__(self) -> None:
        # A read that is not shared has no scope: two ranks reading alone agree whatever scope a
        # format would have given a shared read (a rank whose targets are DTensors reads slices,
        # one whose are not reads whole; both alone). Unequal choices then always differ in
        # what the agreement's message shows.
        if not self.shared and self.scope != "node":
            object.__setattr__(self, "scope", "node")


def scope_from_key(distributed: bool | str | None) -> str | bool | None:
    """The extra config's ``distributed`` as a scope: None (unset: the format decides), False
    (never share), ``node`` (true means what it means in Run:ai: per node) or ``job``."""
    if distributed is True:
        return "node"
    return distributed


@dataclass(frozen=True)
class ReadFacts:
    """What a format's read choice depends on, for one rank; the same on every rank of a load.

    ``distributed``: the extra config's value (None where it is not set; see scope_from_key).
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
    ``device_data``: the group's data group carries tensors on the device (NCCL for CUDA;
    ``WorkerGroup.wire_device``); InstantTensor shares a read only then.
    ``cached``: an object-store load with a node cache (``--cache-dir``): only distload's ranged
    reads go through it, so ``auto`` reads with them where it would otherwise take Run:ai.
    """

    sharded_layout_found: bool
    device_type: str
    world_size: int
    distributed: bool | str | None
    instanttensor_installed: bool
    remote: bool = False
    whole_job: bool = True
    sliced: bool = False
    replicas: int = 1
    device_data: bool = True
    cached: bool = False

    @property
    def many(self) -> bool:
        return self.world_size > 1

    @property
    def scope(self) -> str | bool | None:
        return scope_from_key(self.distributed)

    @property
    def asked(self) -> str | None:
        """An explicit ``node`` or ``job`` (None: unset or false)."""
        scope = self.scope
        return scope if isinstance(scope, str) else None
