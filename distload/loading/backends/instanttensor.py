"""InstantTensor: CUDA-only reader; with the group's handle every rank reads a share of the same
files and all-gathers the rest over NCCL, so each byte leaves storage once.

It cannot run without CUDA; distload says so at once instead of falling back to another reader.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch

from distload.config import check_fraction, check_positive_int
from distload.errors import BackendUnavailableError, ConfigError
from distload.loading.backends.base import Backend, BackendRun, ReadOptions, ReadRequest
from distload.loading.index import PACKED
from distload.loading.sources import is_object_store
from distload.workers.group import carries

if TYPE_CHECKING:
    from distload.loading.plan import RankPlan
    from distload.workers.group import WorkerGroup

# InstantTensor's I/O backends, as its `backend` knob names them (comma-separated: tried in order).
IO_BACKENDS = ("URING", "AIO", "URING_BUFFERED", "AIO_BUFFERED", "CUFILE", "MMAP", "BUFFERED")


def check_io_backends(key: str, value: Any) -> None:
    names = value.split(",") if isinstance(value, str) else None
    if not names or any(name.strip().upper() not in IO_BACKENDS for name in names):
        raise ConfigError(
            f"extra config '{key}' must be one or more of {', '.join(IO_BACKENDS)} "
            f"(comma-separated), got {value!r}"
        )


def _import_instanttensor():
    try:
        import instanttensor
    except ImportError as exc:
        raise BackendUnavailableError(
            f"--load-format instanttensor needs the instanttensor package: "
            f"pip install 'distload[instanttensor]' ({exc})"
        ) from None
    return instanttensor


def check_instanttensor_device(device: torch.device) -> None:
    if device.type != "cuda":
        raise BackendUnavailableError(
            f"--load-format instanttensor reads only onto CUDA devices, and this rank's device is "
            f"{device} (torch.cuda.is_available() is {torch.cuda.is_available()}); use "
            f"--load-format safetensors or runai_streamer on a machine without GPUs"
        )


def check_instanttensor_read(shared: bool, scope: str, backend: str | None, world_size: int,
                             local_world_size: int, tensors: list[tuple[str, str, str]]) -> None:
    """Raise for a read InstantTensor 0.2.2 would get wrong (``tensors``: file, name, dtype).

    - A shared read needs an NCCL group: InstantTensor calls ``process_group._get_backend(device)
      ._comm_ptr()`` (``_impl.py:947``), which a gloo group (registered for "cuda" too) lacks.
    - It shares over the whole group it is given: no per-node scope.
    - Packed dtypes (F4: two values per byte): it keeps the header's shape, which counts 4-bit
      values, so it asks ``_C.get_dl_tensor`` for twice the tensor's bytes (``get_tensor_size``,
      ``_impl.py:383-387``) and clones past the tensor.
    """
    if shared and world_size > 1 and not carries(backend, "cuda"):
        raise BackendUnavailableError(
            f"InstantTensor shares a read over an NCCL process group only, and this load's group is "
            f"{backend} ({world_size} ranks): load over an NCCL group (vLLM: its device group; "
            f"WorkerGroup(process_group=<an NCCL group>)), or use --load-format auto or safetensors")
    if shared and world_size > 1 and scope == "node" and local_world_size < world_size:
        raise BackendUnavailableError(
            f"InstantTensor shares a read over the whole group, and this group of {world_size} ranks spans "
            f"nodes of {local_world_size}: a per-node shared read (distributed: node) is Run:ai's "
            f"(--load-format runai_streamer) or distload's own (auto on a subgroup); for InstantTensor "
            f"set distributed: job")
    packed = [(file, name, dtype) for file, name, dtype in tensors if dtype in PACKED]
    if packed:
        shown = "; ".join(f"{file}: tensor {name!r} is {dtype}" for file, name, dtype in packed[:5])
        more = f" (and {len(packed) - 5} more)" if len(packed) > 5 else ""
        raise BackendUnavailableError(
            f"{shown}{more}: InstantTensor 0.2.2 reads {'/'.join(sorted({d for _, _, d in packed}))} with the "
            f"header's shape, twice its bytes; load this checkpoint with --load-format safetensors "
            f"(or sharded_state for per-rank files)")


@dataclass(frozen=True)
class InstantTensorOptions(ReadOptions):
    """InstantTensor's own extra-config keys and values (``instanttensor_knobs`` turns them into
    ``safe_open``'s arguments once the module is imported)."""

    settings: Mapping[str, Any] = field(default_factory=dict)


class InstantTensorBackend(Backend):
    name = "instanttensor"
    keys = {
        "buffer_size": check_positive_int,
        "chunk_size": check_positive_int,
        "concurrency": check_positive_int,
        "io_depth": check_positive_int,
        "max_free_mem_usage": check_fraction,
        "backend": check_io_backends,
    }
    reads_object_stores = False
    package = "instanttensor"

    def check_source(self, source: str, group: "WorkerGroup") -> None:
        if is_object_store(source):
            raise BackendUnavailableError(
                f"{source}: --load-format instanttensor reads local files only; load an "
                f"object-store source with runai_streamer (extra config {{\"distributed\": true}} "
                f"reads each byte once per node), or copy the checkpoint to local disk first"
            )
        check_instanttensor_device(group.device)

    def preflight(self, plan: "RankPlan", group: "WorkerGroup") -> None:
        """The refusals InstantTensor would otherwise meet only once reading started."""
        super().preflight(plan, group)
        check_instanttensor_read(plan.choice.shared, plan.choice.scope, group.backend, group.world_size,
                                 group.local_world_size, [(t.file, t.name, t.dtype) for t in plan.index.tensors])

    def options(self, extra: Mapping[str, Any], plan: "RankPlan") -> InstantTensorOptions:
        return InstantTensorOptions(settings={key: value for key, value in extra.items() if key in self.keys})

    def read(self, request: ReadRequest) -> BackendRun:
        check_instanttensor_device(request.device)
        module = _import_instanttensor()
        group = request.group
        process_group = group.process_group if (request.shared and group.world_size > 1) else None
        knobs = instanttensor_knobs(request.options_as(InstantTensorOptions).settings, module)
        path = "instanttensor-group" if process_group is not None else "instanttensor"
        return BackendRun(path).start(_stream(module, request, process_group, knobs))


def instanttensor_knobs(extra: Mapping[str, Any], module) -> dict[str, Any]:
    """InstantTensor's own settings from a validated extra config, as ``safe_open`` takes them.

    Only its own keys: ``auto`` may bring others (``pattern``, ``huge_pages``) that are distload's
    and that ``safe_open`` would reject as unexpected keyword arguments.
    """
    knobs = {key: value for key, value in extra.items() if key in InstantTensorBackend.keys}
    if "backend" in knobs:
        knobs["backend"] = [module.Backend[name.strip().upper()] if name.strip().upper() != "BUFFERED"
                            else module.BackendPolicy.BUFFERED
                            for name in knobs["backend"].split(",")]
    return knobs


def _stream(module, request: ReadRequest, process_group, knobs) -> Iterator[tuple[str, torch.Tensor]]:
    paths = [info.path for info in request.index.files]
    # InstantTensor's all-gathers run on torch's communicator from its own thread and stream,
    # which torch's watchdog does not track: neither the group's timeout nor NCCL's applies,
    # and a lost peer would leave the others waiting for good. The watch aborts the communicator.
    watch = request.group.watched("InstantTensor's shared read") if process_group is not None \
        else contextlib.nullcontext()
    with watch, module.safe_open(paths, framework="pt", device=request.device,
                                 process_group=process_group, **knobs) as handle:
        yield from handle.tensors()
