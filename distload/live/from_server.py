"""Loading from a running job: every rank takes its tensors from a server's memory, not storage.

The other side is distload/live/server.py. A load is one update of the weight-sync channel with
the loading job as its inference side: rank 0 takes a ticket from the server's store, every rank
joins the ticket's channel, and each receives only its tensor-parallel slices, and with expert
parallelism only its EP rank's experts (what a load of the files with the same sizes, sharding
and placement gives it: the ranks laid out by distload/tp/place.py, the experts counted by
distload/tp/experts.py), checked, into new tensors on its device. Every failure is the
channel's, bounded by the timeout and named, and says which server it was.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import torch
import torch.distributed as dist

from distload.errors import ConfigError, SyncError
from distload.live import rendezvous, server
from distload.live.channel import SyncChannel
from distload.loading.host_memory import HostMemory
from distload.loading.loader import LoadResult
from distload.loading.report import (LoadReport, RankReport, gib_per_s, peak_rss_bytes, state_digest,
                                     storage_read_bytes)
from distload.live.secret import job_secret
from distload.tp.experts import EXPERT_COUNT_KEYS, num_experts
from distload.tp.place import TPPlace
from distload.tp.slices import shard_shape, take_shard
from distload.tp.spec import ShardingSpec, load_spec
from distload.workers.group import WorkerGroup

log = logging.getLogger("distload")

LOAD_FORMAT = "server"  # what a load from a server reports as its load format


def is_server_address(source: Any) -> bool:
    """Whether ``source`` names a server (``tcp://HOST:PORT``) rather than files."""
    return isinstance(source, str) and source.startswith("tcp://")


def load_from_server(address: str, *, group: WorkerGroup | None = None, device: str = "auto",
                     tensor_parallel_size: int | None = None, sharding: str | ShardingSpec | None = None,
                     expert_parallel_size: int | None = None, expert_placement_strategy: str | None = None,
                     timeout_s: float | None = None, digest: bool = False, gather: bool = True,
                     secret_file: str | None = None) -> LoadResult:
    """Load the weights a server (``distload serve``, or a :class:`~distload.live.server.WeightServer`)
    holds at ``address`` onto every rank of ``group``.

    Every rank of the group calls it. With ``tensor_parallel_size`` T rank r receives only TP rank
    ``r % T``'s slices under ``sharding`` (default ``decoder``; heads sized from the config.json
    the server posted), the same tensors a load of the checkpoint's files with those settings
    gives it. With ``expert_parallel_size`` P (and ``expert_placement_strategy``, ``linear`` or
    ``round_robin``) the ranks are T x P x k as :func:`distload.load` lays them out: rank r
    receives only the routed experts of EP rank ``(r // T) % P``, TP-sliced at T > 1, refused
    as a load of the files refuses it (a dense model, P not dividing the experts). Nothing is
    read from storage. ``timeout_s`` (default the group's) bounds the join
    and the transfer: a server that dies or stops mid-load fails every rank within it, naming the
    server. ``digest``: each rank report gets its state's digest; ``gather``: the job's report on
    every rank (a collective). ``secret_file`` (default ``DISTLOAD_SECRET_FILE``, else
    ``DISTLOAD_SECRET``): the job secret the server was started with (docs/security.md).
    """
    if not is_server_address(address):
        raise ConfigError(f"a server's address is tcp://HOST:PORT, got {address!r}")
    rendezvous.parse_address(address)  # a malformed address fails here, before any group
    with WorkerGroup.for_call(group, device=device) as g:
        # The ranks laid out as a load of the files lays them out (T x P x k), refused alike: a
        # bad setting fails every rank at once, before the server is asked anything.
        layout = TPPlace.of(g, tensor_parallel_size, None, expert_parallel_size=expert_parallel_size,
                            expert_placement_strategy=expert_placement_strategy)
        return _load(address, g, layout, sharding,
                     g.timeout.total_seconds() if timeout_s is None else float(timeout_s), digest, gather,
                     secret_file)


def _load(address: str, group: WorkerGroup, layout: TPPlace | None, sharding: Any, timeout_s: float, digest: bool,
          gather: bool, secret_file: str | None) -> LoadResult:
    start = time.perf_counter()
    read_before = storage_read_bytes()
    tp_size = None if layout is None else layout.size  # EP alone is TP 1, as in a load of the files
    experts = None if layout is None else layout.experts
    store = channel = None
    try:
        store = group.agree("reaching the server", lambda: _reach(address, timeout_s, secret_file))
        info = group.broadcast(group.agree("reaching the server", lambda: _info(store, address, timeout_s)
                                           if group.rank == 0 else None), 0)
        # Refused here, before the job takes a ticket: the server never waits for a job that will
        # not come. The experts first, as a load of the files plans them: a dense model is refused
        # as one whatever its config.json.
        model_config = None
        if experts is not None:
            counted = group.broadcast(group.agree("reaching the server", lambda: _count_experts(
                store, info, address, experts.size, timeout_s) if group.rank == 0 else None), 0)
            # The channel places experts by the count in its model_config (pairing.with_experts).
            model_config = {EXPERT_COUNT_KEYS[0]: group.agree("checking the experts", lambda: _counted(counted))}
        spec = group.agree("checking the sharding", lambda: _sharding(sharding, tp_size, info, address))
        # One ticket for the whole job: every rank joins the same channel.
        ticket = group.broadcast(group.agree("joining the server", lambda: store.add(server.TICKETS, 1)
                                             if group.rank == 0 else None), 0)
        if group.rank == 0:  # the server's log names each job by its ticket
            log.info("loading from the server at %s as its loading job %d", address, ticket)
        channel = group.agree("joining the server", lambda: SyncChannel(
            address, "inference", rank=group.rank, size=group.world_size, device=str(group.device),
            timeout_s=timeout_s, tensor_parallel_size=tp_size or 1, sharding=spec if (tp_size or 1) > 1 else None,
            model_config=model_config, expert_parallel_size=None if experts is None else experts.size,
            expert_placement_strategy=None if experts is None else experts.placement,
            store=dist.PrefixStore(server.job_prefix(ticket), store.raw),
            member_name=server.member_name(ticket), server=server.SERVER, secret_file=secret_file))
        state: dict[str, torch.Tensor] = {}
        # New host tensors on huge pages where the kernel has them free (host_memory.py): a fault
        # per 2 MiB instead of per 4 KiB as the bytes land. Not prefaulted: faults taken while the
        # bytes land overlap the server's packing of the next bucket; a prefault up front would not.
        memory = HostMemory(None, group.local_world_size) if group.device.type == "cpu" else None

        def allocate(wanted: dict) -> dict[str, torch.Tensor]:
            for name, (dtype, shape) in wanted.items():
                state[name] = (torch.empty(shape, dtype=dtype, device=group.device) if memory is None
                               else memory.empty(shape, dtype))
            return state

        try:
            stats = channel.receive(allocate, timeout_s)
        except SyncError as exc:
            error = SyncError(f"loading from the server at {address} failed: {_reason(exc)}")
            group.report_failure("loading from the server", error)
            raise error from None
        except BaseException as exc:
            group.report_failure("loading from the server", exc)
            raise
        group.check_all_ok("loading from the server")
        if tp_size == 1:
            _pad_as_tp1(state, spec)
    finally:
        if channel is not None:
            channel.close()
        if store is not None:
            store.close()
    seconds = time.perf_counter() - start
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    report = RankReport(
        rank=group.rank, local_rank=group.local_rank, device=str(group.device), path=address, files=[],
        num_tensors=len(state), nbytes=nbytes, seconds=round(seconds, 6),
        gib_per_s=gib_per_s(nbytes, seconds), digest=state_digest(state) if digest else None,
        hostname=group.hostname,
        read_bytes=None if read_before is None else (storage_read_bytes() or 0) - read_before,
        peak_rss_bytes=peak_rss_bytes(), requested_bytes=0, server_bytes=stats.wire_bytes,
        huge_page_marked_bytes=0 if memory is None else memory.marked_bytes,
        tensor_parallel=None if layout is None else [layout.rank, layout.size],
        expert_parallel=None if experts is None else [experts.rank, experts.size])
    job = None
    if gather:
        job = LoadReport(group.world_size, LOAD_FORMAT, address, group.exchange(report))
    log.debug("loaded version %s from %s (%s) as loading job %d", stats.version, address, info.get("source"), ticket)
    return LoadResult(state, report, job)


def _reach(address: str, timeout_s: float, secret_file: str | None) -> rendezvous.BoundedStore:
    try:
        return rendezvous.open_store(address, False, timeout_s, server.SERVER, job_secret(secret_file))
    except SyncError as exc:
        raise SyncError(f"cannot load from the server at {address}: {exc} (a server is `distload serve SOURCE "
                        f"--address {address}`, or a WeightServer)") from None


def _info(store: rendezvous.BoundedStore, address: str, timeout_s: float) -> dict:
    """What the server serves (server.INFO: posted just after its store starts to answer)."""
    deadline = time.monotonic() + timeout_s
    backoff = rendezvous.Backoff()
    while not store.check([server.INFO]):
        if time.monotonic() > deadline:
            raise SyncError(f"the program at {address} serves a sync rendezvous but is not a distload server "
                            f"(it posted no {server.INFO!r} within {timeout_s:.0f} s): point the load at "
                            f"`distload serve`'s --address")
        backoff.pause()
    return rendezvous.get(store, server.INFO)


def _count_experts(store: rendezvous.BoundedStore, info: dict, address: str, ep_size: int, timeout_s: float
                   ) -> dict[str, Any]:
    """Rank 0: the routed experts of what the server serves, counted as a load of the files counts
    them (config.json checked against the names, else the names, else the stacks' rows: the same
    function), from the names and shapes every server rank posted. ``{"count": n}``, or
    ``{"refused": why}`` (a dense model, an EP size that does not divide them): every rank raises it."""
    keys = [server.tensors_key(rank) for rank in range(info["ranks"])]
    deadline = time.monotonic() + timeout_s
    backoff = rendezvous.Backoff()
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
            raise SyncError(f"the server at {address} posted no names of its tensors from server rank(s) "
                            f"{', '.join(map(str, missing))} within {timeout_s:.0f} s, and an expert-parallel load "
                            f"counts the experts in them: run the same distload version on the server")
        backoff.pause()
    shapes: dict[str, list[int]] = {}
    for key in keys:
        shapes.update(rendezvous.get(store, key))
    try:
        return {"count": num_experts(sorted(shapes.items()), info["config"] or {}, ep_size)}
    except ConfigError as exc:
        return {"refused": str(exc)}


def _counted(counted: dict[str, Any]) -> int:
    """Rank 0's count of the experts on every rank, or its refusal raised on every rank."""
    if "refused" in counted:
        raise ConfigError(counted["refused"])
    return int(counted["count"])


def _sharding(sharding: Any, tp_size: int | None, info: dict, address: str) -> ShardingSpec | None:
    """The sharding spec (sized with the server's config.json where it sizes heads), refused up
    front where it needs heads and the server has none."""
    if not tp_size:
        return None
    spec = sharding if isinstance(sharding, ShardingSpec) else load_spec(sharding)
    if spec.needs_model_config and not spec.config and info["config"]:
        spec = ShardingSpec(spec.name, spec.rules, dict(info["config"]), spec.engine)
    if spec.needs_model_config and not spec.config:
        raise ConfigError(f"sharding {spec.name!r} sizes attention heads from the model's config.json, and the "
                          f"server at {address} has none (it serves {info.get('source') or 'a state dict'} without "
                          f"one): serve the checkpoint with its config.json beside the weights, or load with "
                          f"--sharding plain")
    return spec


def _reason(exc: SyncError) -> str:
    """A failed receive's reason in a load's words: the channel speaks of updates and versions
    (a receiver keeps its old version), a load has neither (its tensors are new, and dropped)."""
    while isinstance(exc.__cause__, SyncError):  # "version v did not arrive whole ...: <the reason>"
        exc = exc.__cause__
    text = re.sub(r"[;,] still at version None", "", str(exc))
    return re.sub(r"no update (arrived )?within", "nothing arrived within", text)


def _pad_as_tp1(state: dict[str, torch.Tensor], spec: ShardingSpec) -> None:
    """A load from files at TP size 1 is vLLM's TP 1 layout (a vocabulary padded to its multiple:
    zero rows); the channel sends whole tensors at TP 1, so the padding is added here."""
    for name, tensor in state.items():
        action = spec.action(name, tuple(tensor.shape))
        if not action.replicated and shard_shape(name, tuple(tensor.shape), action, 1) != tuple(tensor.shape):
            state[name] = take_shard(tensor, action, 0, 1, name)
