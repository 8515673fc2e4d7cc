"""Serving weights from a running job: a new job loads them from its memory, not from storage.

A *server* (one process, or every rank of a job) holds a state dict and serves it at a
``tcp://HOST:PORT`` address until it is stopped; a loading job (distload/live/from_server.py)
takes its tensors from there, each of its ranks only its tensor-parallel slices. Every load is one
update of the weight-sync channel (distload/live/channel.py), with the server as its trainer side
and the loading job as its inference side, so it has the channel's agreement before any byte
moves, its checksums, its same-host handoff and its bounded failures. What serving adds:

- **One channel per loading job.** Server rank 0 serves the store at the address. A loading job's
  rank 0 takes a *ticket* (a counter in that store); the job's channel lives under the ticket's
  prefix of the store, and every server rank pushes the state into it once, on a thread of its
  own, then leaves it. So jobs that start at once never meet in one channel (a channel takes one
  job per side), each is served as soon as it joins, and a job that fails (killed, stopped, gave
  up) fails only its own channel: the server goes on serving the next.
- **What a loading job needs to cut its slices**, posted once by server rank 0: the checkpoint's
  ``config.json`` (the head-aware sharding rules size heads from it), where the weights came from;
  and by every server rank, the names and shapes of the tensors it serves (an expert-parallel load
  counts the routed experts in them, as a load from storage does, before it takes a ticket).

The state is never copied (no delta base: it does not change between loads) and never written.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Mapping

import torch
import torch.distributed as dist

from distload.errors import ConfigError, DistloadError, SyncError
from distload.live import rendezvous
from distload.live.channel import DEFAULT_BUCKET_BYTES, SyncChannel
from distload.live.secret import job_secret
from distload.workers.group import DEFAULT_TIMEOUT_S
from distload.workers.launch import detect_launch

log = logging.getLogger("distload")

TICKETS = "serve/tickets"  # how many loading jobs have taken a ticket (the counter they add to)
INFO = "serve/info"  # server rank 0's description of what it serves
TENSORS = "serve/tensors/"  # + a server rank: the names and shapes of the tensors that rank serves
SERVER = "server rank 0"  # how messages name the process serving the store
POLL_S = 0.005  # how often every server rank looks for new tickets (a store call: ~0.1 ms)
STOP_WAIT_S = 5.0  # how long a stopping server gives the loads in flight to end


def job_prefix(ticket: int) -> str:
    """The part of the server's store that loading job ``ticket``'s channel lives in."""
    return f"serve/job/{ticket}/"


def tensors_key(rank: int) -> str:
    """Where server rank ``rank`` posts the names and shapes of its tensors (name -> shape)."""
    return f"{TENSORS}{rank}"


def member_name(ticket: int) -> Any:
    """How one job's channel names its members, on both sides."""
    def name(role: str, rank: int) -> str:
        return f"server rank {rank}" if role == "trainer" else f"loading job {ticket} rank {rank}"
    return name


class WeightServer:
    """Serve ``state`` (name -> tensor) at ``address`` (``tcp://HOST:PORT``) to loading jobs.

    Every rank of a serving job makes one, each with its own part of the weights (disjoint names)
    or all with the same DTensors (gathered while they are sent, as a weight-sync push does);
    ``rank``/``size`` are its place in the serving job (default: the launcher's). Rank 0 serves the
    address. :meth:`start` serves in a background thread (an engine or a trainer goes on with its
    work), :meth:`serve_forever` in this one; :meth:`close` stops. The tensors are read while a load
    is in flight, never written: a trainer that changes them meanwhile sends a mix (serve a copy,
    or stop serving during the optimizer step). ``version`` is reported to the loading jobs.
    ``model_config`` (the model's config.json, a dict) lets loading jobs cut head-aware slices;
    ``source`` says where the weights came from. ``timeout_s`` bounds every wait of one load
    (its joining too); ``bucket_bytes`` and ``transport`` are SyncChannel's. Every load is verified.
    ``secret_file`` and ``insecure`` are SyncChannel's: a loading job must prove the same job secret
    (``DISTLOAD_SECRET``), and without one only a loopback address is served.
    """

    def __init__(self, state: Mapping[str, torch.Tensor], address: str, *, rank: int | None = None,
                 size: int | None = None, version: int = 0, model_config: Mapping[str, Any] | None = None,
                 source: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, transport: str = "auto", secret_file: str | None = None,
                 insecure: bool = False):
        if not isinstance(state, Mapping):
            raise ConfigError(f"WeightServer serves a state dict (name -> tensor), got {type(state).__name__}")
        launch = detect_launch()
        self.rank = launch.rank if rank is None else int(rank)
        self.size = launch.world_size if size is None else int(size)
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"rank {self.rank} is not within the serving job's {self.size} ranks")
        self.state = dict(state)
        self.address = address
        self.version = version
        self.timeout_s = float(timeout_s)
        # Always verified: a load is checked bit for bit (a loading job asks for it anyway).
        self._options = {"bucket_bytes": bucket_bytes, "verify": True, "transport": transport,
                         "device": _device_of(self.state)}
        # DTensors are gathered by every server rank together, bucket by bucket: two loads at
        # once would interleave those collectives, so such a server serves one load at a time.
        self._one_at_a_time = threading.Lock() if any(_is_dtensor(t) for t in self.state.values()) else None
        self.served = 0  # loads completed
        self.failed = 0  # loads that failed (the server went on)
        self._stop = threading.Event()
        self._jobs: dict[int, threading.Thread] = {}
        self._thread: threading.Thread | None = None
        # Every loading job proves the job secret before the store reads a value from it, and
        # every bucket it takes is tagged with it (docs/security.md).
        self._secret_file = secret_file
        self._store = rendezvous.open_store(address, self.rank == 0, self.timeout_s, SERVER,
                                            job_secret(secret_file), insecure)
        if self.rank == 0:
            rendezvous.put(self._store, INFO, {"source": source, "version": version, "ranks": self.size,
                                               "config": dict(model_config or {})})
            self._store.add(TICKETS, 0)  # the counter exists before any job asks for it
        # Whole shapes (a DTensor's too): a loading job reads them only to place experts.
        rendezvous.put(self._store, tensors_key(self.rank), {name: list(t.shape) for name, t in self.state.items()})

    # -- serving ------------------------------------------------------------------------------
    def start(self) -> "WeightServer":
        """Serve in a background thread; returns at once."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="distload-server", daemon=True)
            self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until :meth:`close` (from another thread or a signal handler), or
        until the store is lost (this is not rank 0, and rank 0 went away: SyncError)."""
        self._serve()

    def _serve(self) -> None:
        seen = 0
        while not self._stop.is_set():
            try:
                tickets = self._store.add(TICKETS, 0)
            except rendezvous.StoreLost as exc:
                if self._stop.is_set():
                    return
                raise SyncError(f"server rank {self.rank}: {exc}: it stops serving") from None
            for ticket in range(seen + 1, tickets + 1):
                log.info("server rank %d: loading job %d asks for the weights", self.rank, ticket)
                thread = threading.Thread(target=self._serve_job, args=(ticket,), name=f"distload-serve-{ticket}",
                                          daemon=True)
                self._jobs[ticket] = thread
                thread.start()
            seen = max(seen, tickets)
            self._jobs = {t: th for t, th in self._jobs.items() if th.is_alive()}
            self._stop.wait(POLL_S)

    def _serve_job(self, ticket: int) -> None:
        """Push the state once into loading job ``ticket``'s channel; a failure is that job's."""
        start = time.perf_counter()
        channel = None
        try:
            channel = SyncChannel(self.address, "trainer", rank=self.rank, size=self.size, timeout_s=self.timeout_s,
                                  delta=False, store=dist.PrefixStore(job_prefix(ticket), self._store.raw),
                                  member_name=member_name(ticket), server=SERVER, secret_file=self._secret_file,
                                  **self._options)
            if self._one_at_a_time is None:
                stats = channel.push(self.state, self.version)
            else:
                with self._one_at_a_time:
                    stats = channel.push(self.state, self.version)
        except DistloadError as exc:  # a ConfigError too (a slice it cannot cut): that job's, not the server's
            self.failed += 1
            if not self._stop.is_set():
                log.warning("server rank %d: loading job %d failed, still serving: %s", self.rank, ticket, exc)
            return
        finally:
            if channel is not None:
                channel.close()
        self.served += 1
        log.info("server rank %d: served loading job %d: %.3f GiB sent (%s) in %.2f s", self.rank, ticket,
                 stats.wire_bytes / 2**30, stats.transport, time.perf_counter() - start)

    def close(self) -> None:
        """Stop serving: no new load starts; the loads in flight are told the server closes
        (a loading job waiting for its data raises at once, naming the address) and given up
        to STOP_WAIT_S to end; then rank 0 stops serving the address."""
        if self._store is None:
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        deadline = time.monotonic() + STOP_WAIT_S
        for ticket, thread in list(self._jobs.items()):
            if thread.is_alive() and self.rank == 0:
                try:
                    self._store.set(job_prefix(ticket) + rendezvous.CLOSING, b"1")
                except SyncError:
                    break
        for thread in self._jobs.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        store, self._store = self._store, None
        store.close()

    def __enter__(self) -> "WeightServer":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _is_dtensor(tensor: Any) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "full_tensor")


def _device_of(state: Mapping[str, torch.Tensor]) -> str:
    """The device the channel stages buckets on: the tensors' GPU where they are all on one,
    else host memory."""
    devices = {t.device for t in state.values() if isinstance(t, torch.Tensor)}
    if len(devices) == 1:
        (device,) = devices
        if device.type == "cuda":
            return str(device)
    return "cpu"


def serve_checkpoint(source: str, address: str, group: Any, *, load_format: str = "auto",
                     extra_config: Any = None, progress: bool = False, **options: Any) -> WeightServer:
    """Load ``source`` (any checkpoint distload loads) over ``group`` and make the server of it:
    each rank of the serving job keeps and serves its own part of the tensors (about equal bytes),
    read with the job's shared reads; not started (call :meth:`WeightServer.serve_forever` or
    :meth:`WeightServer.start`). ``options`` are WeightServer's."""
    from distload.loading.loader import Loader
    from distload.loading.sources import model_config

    loader = Loader(source, load_format, extra_config, group=group, progress=progress)
    plan = loader.plan()
    owners = split_by_bytes({t.name: t.end - t.begin for t in plan.index.tensors}, group.world_size)
    stream = loader.stream(plan)
    # Streamed: a rank holds only its own part, never the whole checkpoint at once.
    state = {name: tensor for name, tensor in stream if owners.get(name, 0) == group.rank}
    config = group.agree("reading config.json", lambda: model_config(loader.source) if group.rank == 0 else None)
    return WeightServer(state, address, rank=group.rank, size=group.world_size, source=loader.source,
                        model_config=config, **options)


def split_by_bytes(sizes: Mapping[str, int], parts: int) -> dict[str, int]:
    """Name -> the part (0..parts-1) that holds it: the biggest first, each to the lightest part."""
    loads = [0] * parts
    owners = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        part = loads.index(min(loads))
        owners[name] = part
        loads[part] += sizes[name]
    return owners
