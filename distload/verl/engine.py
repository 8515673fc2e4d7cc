"""verl's checkpoint engine ``distload``: verl's protocol on distload's weight-sync channel.

verl drives a checkpoint engine the same way for every backend (CheckpointEngineManager, each
update): ``prepare()`` on every actor and rollout worker, ``build_topology`` once with all their
metadata, ``init_process_group(**kwargs)`` on each, then ``send_weights(generator, global_steps)``
on the actor workers while the rollout workers iterate ``receive_weights(global_steps)``, then
``finalize()``. Under that protocol this engine runs a :class:`~distload.live.channel.SyncChannel`:

- actor rank 0 (``is_master``, as verl constructs it) is the channel's one trainer rank and
  serves its rendezvous; the other actor workers only walk the generator (producing each full
  tensor is collective over the actor group, as in verl's own NCCL engine);
- every rollout worker is an inference rank and receives whole tensors (verl's server adapters
  take whole tensors and let the engine's loaders cut them);
- the channel lives from update to update (``finalize`` keeps it, unless ``rebuild_group``), so
  after the first version each update sends only what changed (delta updates), every update
  is verified, and a failed, killed or stopped member ends every other member's wait within
  ``timeout_s`` with a SyncError naming it.

What verl's protocol asks that the channel did not have: the weights come as a generator, one
full tensor at a time, while the channel describes a whole version before any byte moves. The
master therefore stages each tensor as it comes in a host copy of the model, kept and refilled
every update (no page faults after the first). A rollout worker receives into host tensors of
its own, also kept (a delta update patches them in place), and yields them to verl's server
adapter, which loads them into its engine. Host memory: one model on the master and on each
rollout worker, plus the trainer's delta base (``max_base_bytes`` bounds it).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any, AsyncGenerator, Mapping

import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.utils import ensure_async_iterator

from distload.errors import ConfigError, SyncError
from distload.live.channel import SyncChannel, SyncStats
from distload.workers.group import DEFAULT_TIMEOUT_S

log = logging.getLogger("distload")

TRAINER, WALKER, INFERENCE = "trainer", "walker", "inference"  # what init_process_group makes of a worker
_SERVE_TRIES = 3  # a free port found, then served: another process may take it in between


@CheckpointEngineRegistry.register("distload")
class DistloadCheckpointEngine(CheckpointEngine):
    """distload's weight-sync channel as a verl checkpoint engine.

    ``bucket_size`` (bytes; verl passes ``update_weights_bucket_megabytes << 20``) is the
    channel's bucket. ``is_master``: verl sets it on actor rank 0, which sends. The rest come
    from ``checkpoint_engine.engine_kwargs.distload``: ``timeout_s`` (every wait of every member),
    ``verify`` and ``delta`` (both on by default), ``max_base_bytes``, ``transport`` (``auto``: a rollout worker on the actor's host takes the bytes
    through shared memory; ``socket``), ``host`` (the address
    the rollout workers reach the master at; default Ray's node IP, else this host's),
    ``rebuild_group`` (close the channel after every update, as verl's NCCL engine can: each
    update is then a full one), ``secret_file`` and ``insecure`` (SyncChannel's: every worker
    proves the job secret, ``DISTLOAD_SECRET`` or ``DISTLOAD_SECRET_FILE`` from the environment
    Ray gives it by default: docs/verl.md).
    """

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int, is_master: bool = False, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 verify: bool = True, delta: bool = True, max_base_bytes: int | None = None,
                 transport: str = "auto", host: str | None = None, rebuild_group: bool = False,
                 secret_file: str | None = None, insecure: bool = False) -> None:
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0:
            raise ConfigError(f"the distload checkpoint engine's bucket_size must be a positive number of bytes, "
                              f"got {bucket_size!r} (verl's update_weights_bucket_megabytes << 20)")
        self.bucket_size = bucket_size
        self.is_master = bool(is_master)
        self.options = {"timeout_s": float(timeout_s), "verify": bool(verify), "delta": bool(delta),
                        "max_base_bytes": max_base_bytes, "bucket_bytes": bucket_size, "transport": transport,
                        "secret_file": secret_file, "insecure": bool(insecure)}
        self.host = host
        self.rebuild_group = bool(rebuild_group)
        self.role: str | None = None
        self._channel: SyncChannel | None = None
        self._topology: tuple | None = None
        self._staged: dict[str, torch.Tensor] = {}  # the master's host copy of the version it sends
        self._held: dict[str, torch.Tensor] = {}  # a rollout worker's host copy of the version it holds
        self._last_version = 0  # the master's: global_steps None sends the one after it
        self.last_stats: SyncStats | None = None

    # -- verl's protocol: forming ------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """The master serves the channel's rendezvous (once: it stays for the next updates) and
        says where; the other workers have nothing to say (the channel decides each pair's
        transport itself when its session forms)."""
        metadata: dict[str, Any] = {}
        if self.is_master:
            if self._channel is None:
                self._channel = self._serve()
            metadata["address"] = self._channel.address
        return metadata

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[Mapping[str, Any]]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Actor rank 0 is the channel's trainer; the other actor workers walk; rollout worker i is
        inference rank i of ``rollout_world_size``. ``metadata``: the actor workers' then the
        rollout workers', as verl lists them."""
        if len(metadata) != actor_wg_world_size + rollout_world_size:
            raise ConfigError(f"verl handed build_topology {len(metadata)} workers' metadata for "
                              f"{actor_wg_world_size} actor and {rollout_world_size} rollout workers")
        address = metadata[0].get("address") if metadata else None
        if address is None:
            raise ConfigError("actor rank 0's distload checkpoint engine is not the master: verl constructs it with "
                              "is_master=(torch.distributed.get_rank() == 0); construct it so")
        masters = [i for i, m in enumerate(metadata[1:], start=1) if m.get("address")]
        if masters:
            raise ConfigError(f"worker {masters[0]} also says it is the master: only actor rank 0 may be")
        actor = {"role": [TRAINER] + [WALKER] * (actor_wg_world_size - 1),
                 "rank": [0] + [-1] * (actor_wg_world_size - 1),
                 "size": [1] * actor_wg_world_size,
                 "address": [address] * actor_wg_world_size}
        rollout = {"role": [INFERENCE] * rollout_world_size, "rank": list(range(rollout_world_size)),
                   "size": [rollout_world_size] * rollout_world_size, "address": [address] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, role: str, rank: int, size: int, address: str) -> None:
        """Join the channel at ``address`` in ``role`` (build_topology's kwargs). A worker already
        in that channel at that place keeps it: its delta base and buffers stay."""
        if role not in (TRAINER, WALKER, INFERENCE):
            raise ConfigError(f"unknown role {role!r} for the distload checkpoint engine (build_topology makes "
                              f"{TRAINER}, {WALKER} or {INFERENCE})")
        if role == TRAINER and not self.is_master:
            raise ConfigError("build_topology made this worker the trainer, but it is not the master")
        self.role = role
        topology = (role, rank, size, address)
        if role == INFERENCE and self._topology != topology:
            self._close_channel()  # another channel, or another place in it: a new member
            self._channel = SyncChannel(address, "inference", rank=rank, size=size, device="cpu", **self.options)
        elif role == TRAINER and self._channel is None:
            raise ConfigError("init_process_group before prepare() on the master: verl calls prepare() first")
        self._topology = topology

    def finalize(self) -> None:
        """After every update: the channel stays for the next (its delta base with it), unless
        ``rebuild_group``."""
        if self.rebuild_group:
            self.close()

    def close(self) -> None:
        """Leave the channel for good (the master's rendezvous closes; members waiting are told)."""
        self._close_channel()
        self._staged, self._held = {}, {}

    # -- verl's protocol: one update ---------------------------------------------------------
    @torch.no_grad()
    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        """The master stages every tensor of the generator and pushes them as version
        ``global_steps`` (verl's step; when None, one more than the last); the other actor workers
        walk the generator. Returns the update's figures (verl merges them into its metrics)."""
        if self.role == INFERENCE:
            raise ConfigError("send_weights on a rollout worker: rollout workers receive (receive_weights)")
        if self.role == WALKER:
            async for _ in ensure_async_iterator(weights):
                pass
            return {}
        if self.role != TRAINER or self._channel is None:
            raise ConfigError("send_weights before init_process_group: verl calls prepare, build_topology and "
                              "init_process_group first")
        version = self._version(global_steps)
        state = await self._stage(weights)
        stats = await asyncio.to_thread(self._channel.push, state, version)
        self.last_stats = stats
        return {"distload/seconds": stats.seconds, "distload/bytes": stats.nbytes,
                "distload/wire_bytes": stats.wire_bytes, "distload/delta": stats.delta,
                "distload/verified": stats.verified, "distload/transport": stats.transport}

    @torch.no_grad()
    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Receive the next version (verified; a delta patches the tensors held from the last)
        and yield each tensor, whole, in the trainer's order. The tensors are this engine's and
        are rewritten by the next update: a consumer copies them (verl's adapters load them)."""
        if self.role != INFERENCE or self._channel is None:
            raise ConfigError("receive_weights on a worker that is not a rollout worker of a formed channel: verl "
                              "calls prepare, build_topology and init_process_group first")
        start = time.perf_counter()
        stats = await asyncio.to_thread(self._channel.receive, self._receive_into)
        self.last_stats = stats
        if global_steps is not None and stats.version != global_steps:
            raise SyncError(f"rollout worker {self._channel.rank} received version {stats.version}, but verl asked "
                            f"for step {global_steps}: the actor pushed another step than the one announced")
        log.info("rollout worker %d: version %d, %d tensors (%s, verified %s) in %.2f s", self._channel.rank,
                 stats.version, stats.num_tensors, "delta" if stats.delta else "full", stats.verified,
                 time.perf_counter() - start)
        for name, tensor in self._held.items():
            yield name, tensor

    # -- its parts -----------------------------------------------------------------------------
    def _serve(self) -> SyncChannel:
        """The master's channel, serving its rendezvous on a free port of this host."""
        host = self.host or _node_address()
        for attempt in range(_SERVE_TRIES):
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
                probe.bind((host, 0))
                port = probe.getsockname()[1]
            address = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
            try:
                return SyncChannel(address, "trainer", rank=0, size=1, device="cpu", **self.options)
            except SyncError:
                if attempt == _SERVE_TRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def _version(self, global_steps: int | None) -> int:
        if global_steps is None:
            global_steps = self._last_version + 1
        elif isinstance(global_steps, bool) or not isinstance(global_steps, int):
            raise ConfigError(f"global_steps must be an int or None, got {global_steps!r}")
        self._last_version = global_steps
        return global_steps

    async def _stage(self, weights: Any) -> dict[str, torch.Tensor]:
        """Copy each tensor of the generator into the master's host copy as it comes (a generator
        may hand out a buffer it reuses, or a gathered tensor it frees next)."""
        staged: dict[str, torch.Tensor] = {}
        on_gpu = False
        async for name, tensor in ensure_async_iterator(weights):
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise ConfigError(f"the actor's weights must yield (name, tensor) pairs, got "
                                  f"({type(name).__name__}, {type(tensor).__name__})")
            if name in staged:
                raise ConfigError(f"the actor's weights yield {name!r} twice in one step")
            if hasattr(tensor, "full_tensor"):  # gathering it is collective: only the master is here
                raise ConfigError(f"the actor's weights yield {name!r} as a DTensor: the distload checkpoint "
                                  f"engine takes full tensors, as verl's get_per_tensor_param yields them")
            tensor = tensor.detach()
            copy = self._staged.get(name)
            if copy is None or copy.dtype != tensor.dtype or copy.shape != tensor.shape:
                copy = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                                   pin_memory=tensor.is_cuda)
            copy.copy_(tensor, non_blocking=tensor.is_cuda)
            on_gpu = on_gpu or tensor.is_cuda
            staged[name] = copy
        if on_gpu:
            torch.cuda.synchronize()
        if not staged:
            raise ConfigError("the actor's weights yielded no tensor")
        self._staged = staged
        return staged

    def _receive_into(self, wanted: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
        """The host tensors an update lands in: the ones held from the last update where the name,
        dtype and shape are the same (a delta update patches them), new ones otherwise."""
        held = {}
        for name, (dtype, shape) in wanted.items():
            tensor = self._held.get(name)
            if tensor is None or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                tensor = torch.empty(shape, dtype=dtype)
            held[name] = tensor
        self._held = held
        return held

    def _close_channel(self) -> None:
        channel, self._channel, self._topology = self._channel, None, None
        if channel is not None:
            channel.close()


def _node_address() -> str:
    """The address other hosts reach this one at: Ray's node IP inside Ray (what verl's own engines
    use), else what this host's name resolves to."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address().strip("[]")
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())
