"""The weight-sync channel: trainer ranks push versions, inference ranks receive them in place.

The two sides may be separately launched jobs (each its own torchrun or srun, its own world, its
own loads) that meet at a TCP rendezvous address, or ranks of one job (:class:`~distload.live.
sync.WeightSync` runs this channel over the job's own store). Neither job's default group is used.

Control goes through the store; data through a two-member process group between each trainer
rank and each inference rank it sends to (a *pair*; and between neighbours of a relay chain),
built on the store, or, for a pair whose members share a
host, through a segment of memory both map (distload/live/handoff.py: the trainer packs a bucket
there once for all its same-host receivers, each unpacks from it): both belong to the session
(distload/live/session.py), which every update runs over. Every trainer rank calls
:meth:`SyncChannel.push` for a version, every inference rank :meth:`SyncChannel.receive` (which
first waits for the metadata); one update, numbered within its session:

1. *metadata*: each trainer rank posts its version, tensors (name, dtype, whole shape) and bucket
   grouping;
2. *agreement*: each member posts what stops it (an inference rank: tensors that do not fit its
   slices, a model asleep; every member: versions that disagree, a name two trainers send) and
   every member reads every answer: if any member refused, every member raises, and no byte moved;
3. *data*: each trainer rank sends each inference rank exactly the bytes it keeps (its
   tensor-parallel slices, or whole tensors), bucket by bucket, two buckets in flight (receivers
   at one place on other hosts than the trainer rank's take them along a relay chain, each passing
   every message on to the next: pairing.relay, :class:`_Relay`); a
   receiver takes a bucket of small tensors into a buffer and copies it into its tensors in place;
   a big tensor lands in its tensor straight. A verified update is checked once all of it has
   landed (a mismatch fails it, so the version does not advance): the trainer sums each bucket
   while it is in flight, a receiver once it has landed, and after the last bucket the trainer
   sends each receiver the checksums of all its buckets in one message; a receiver that finds a
   bucket that differs fails the update. One group per pair, so a
   lost receiver stalls only its own stream. A given-up update's transfer that may still land in
   a tensor (its trainer stopped, not died) is waited for before the next update writes there;
   if it has not ended within SETTLE_S, that update is refused;
4. *done*: every member posts that its part finished and waits for all the others: only then
   does a receiver's ``version`` advance. Each then says it saw that, and the process serving
   the store returns only once every member has (Session.finish): a trainer that exits the
   instant ``push`` returned leaves no receiver unsure whether it has the version.

Any failure (a checksum, a peer that died or stopped, a deadline) is posted as the update's abort
reason: every member raises it within its timeout, receivers keep their old ``version`` (and,
by default, exactly its bytes: what had landed is rolled back; without rollback ``consistent``
is False once data moved), and the session is over: the next push or receive forms a
new one (a restarted trainer rejoins the same address). The data step runs under the session's
supervisor, which watches the abort key and every member's heartbeat while it moves.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from distload.errors import ConfigError, DistloadError, SyncError, UpdateRefused
from distload.workers.group import DEFAULT_TIMEOUT_S
from distload.workers.launch import detect_launch, resolve_device
from distload.live import delta as deltas
from distload.live import handoff, pairing, rendezvous, verdicts
from distload.live import refit as refits
from distload.live.rendezvous import ROLES, BoundedStore, StoreLost, describe
from distload.live.secret import job_secret
from distload.live.session import Session, gpu_identity, join, leave
from distload.live.targets import model_tensors
from distload.live.transfer import (BucketKey, BucketLayout, Cuts, KeptSlice, SyncTensor, TPPlace, check_pieces,
                                    checksum, first_mismatch, group_entries, layouts, pack, run_bytes, unpack)
from distload.loading.buckets import ALIGN, flat_bytes, offsets
from distload.loading.index import DTYPE_CODES, DTYPES, dtype_code
from distload.tp.spec import ShardingSpec, load_spec

log = logging.getLogger("distload")

DEFAULT_BUCKET_BYTES = 512 * 1024**2
ABORT_LINGER_S = 0.5  # how long the process serving the store keeps it after an update failed
SETTLE_S = 10.0  # how long a receiver waits for a given-up update's transfers before it refuses
_SHOWN = 4  # mismatches listed per rank in a refusal; the rest are counted


class _Unkept(Exception):
    """Why this rank cannot take an update's tensors as sent (its refusal, posted as ready)."""


@dataclass
class SyncStats:
    """One update as this rank saw it."""

    version: int
    nbytes: int  # bytes of tensors this rank sent (a trainer) or received into its tensors
    num_tensors: int
    num_buckets: int
    seconds: float
    wire_bytes: int = 0  # bytes that crossed the transport (alignment and checksums included)
    verified: bool = False
    delta: bool = False  # a receiver: it took a delta update; a trainer: some receiver did
    # Of a delta update, the tensors that went whole, each in its own (sorted): where a patch
    # would not pay (delta.WORTH: too many changes) or there is no base for it; a trainer's, those
    # any receiver took whole. whole_bytes: their bytes (this rank's pieces of them).
    sent_whole: tuple[str, ...] = ()
    whole_bytes: int = 0
    # How the bytes moved between this rank and its peers: "socket" (the pair's process group),
    # "shm" (same host: shared memory), "cuda-ipc" (same host, on GPUs); several joined by "+".
    transport: str = "socket"

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / 1e9 / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Route:
    """Receivers a trainer rank sends the same buckets: one place, one kind of update."""

    place: TPPlace
    ranks: list[int]  # their session ranks
    layouts: list[BucketLayout]
    delta: bool  # they hold this trainer rank's base: sent what changed since it
    chained: bool = True  # at a TP place (not cuts): its far members pass the messages on (relays)


@dataclass
class _Changes:
    """What a push makes of the trainer's base once every receiver holds it (delta.Base.commit)."""

    patches: dict[str, deltas.Patch] = field(default_factory=dict)  # tensors the base holds
    copies: dict[str, torch.Tensor] = field(default_factory=dict)  # tensors it does not yet hold
    pending: int = 0  # the copies' bytes
    names: dict[tuple, str] = field(default_factory=dict)  # the first name of each tensor's memory
    # held, but sent whole for the base's sake: name -> "gave up", "rested" or "refreshed" (delta.Base.commit)
    whole: dict[str, str] = field(default_factory=dict)
    sent_whole: dict[str, int] = field(default_factory=dict)  # what a delta route sent whole: name -> bytes


class SyncChannel:
    """One member of a weight-sync channel.

    ``rendezvous``: ``tcp://HOST:PORT``; rank 0 of the ``host`` side (``trainer`` by default)
    serves it. ``role``: ``trainer`` (calls :meth:`push`) or ``inference`` (calls
    :meth:`receive`). ``rank``/``size``: this process's place in its own side, by default its
    job's (torchrun's or Slurm's environment); no process group is made for it. An inference
    side declares ``tensor_parallel_size`` T and ``sharding`` (the specs ``save-sharded`` takes,
    default ``decoder``; ``model_config``, the model's config.json as a dict or path, sizes the
    head-aware rules): rank r keeps TP rank ``r % T``'s slices, the tensors ``save-sharded
    --tensor-parallel-size T`` writes for it, and receives only those bytes. ``delta`` (default
    on; the trainer's setting): after the first update a receiver holding the trainer's last
    version is sent only the elements that changed (distload/live/delta.py), applied in place,
    undone if the update fails, and always checked; a receiver that does not hold that version
    (new, restarted, after a failed update, its tensors moved) is sent every byte.
    ``max_base_bytes`` bounds the host memory the trainer keeps for it (a copy of what it pushed;
    None: all of it). ``verify`` (default on): check a checksum of every bucket of a full update
    (either side may ask; both sides turn it off). ``transport`` ("auto", or "socket", also
    forced by DISTLOAD_SYNC_TRANSPORT=socket): "auto" hands a same-host pair's bytes off through
    shared memory (handoff.py), "socket" keeps every pair of this member on its process group.
    Every wait is bounded by ``timeout_s``.
    ``keeps`` (an inference side whose slices no sharding rule describes, instead of
    ``tensor_parallel_size``): a function given each update's tensors (SyncTensor: name, dtype,
    whole shape) that returns what this rank keeps of them, ``{name: (dim, [(start, stop), ...])}``
    (a name it leaves out: whole; no ranges: nothing of it). It is posted with the update and
    the trainer sends only those ranges (a vLLM worker's: distload/vllm/sync.py).
    ``secret_file`` (default: ``DISTLOAD_SECRET_FILE``, else ``DISTLOAD_SECRET``): the job secret
    every member proves before the store reads a value from it, and that keys every bucket's
    check (docs/security.md); without one the store is served on a loopback address only, unless
    ``insecure``.
    ``store`` and ``member_name`` are WeightSync's: the job's own store instead of an address,
    and how its messages name members (by job rank); ``server``, how they name the process serving
    the store (distload/live/server.py's loads: "server rank 0").
    """

    def __init__(self, rendezvous_address: str | None = None, role: str = "inference", *,
                 rank: int | None = None, size: int | None = None, host: str = "trainer",
                 device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
                 tensor_parallel_size: int = 1, sharding: str | ShardingSpec | None = None,
                 model_config: Mapping[str, Any] | str | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, verify: bool = True, delta: bool = True,
                 max_base_bytes: int | None = None, transport: str = "auto", store: Any = None,
                 member_name: Callable[[str, int], str] = describe, server: str | None = None,
                 keeps: Callable[[Sequence[SyncTensor]], Mapping[str, tuple[int, Sequence]]] | None = None,
                 secret_file: str | None = None, insecure: bool = False,
                 expert_parallel_size: int | None = None, expert_placement_strategy: str | None = None):
        if role not in ROLES:
            raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if host not in ROLES:
            raise ConfigError(f"host must be the side whose rank 0 serves the rendezvous ({', '.join(ROLES)}), "
                              f"got {host!r}")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ConfigError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        if max_base_bytes is not None and (isinstance(max_base_bytes, bool) or not isinstance(max_base_bytes, int)
                                           or max_base_bytes < 0):
            raise ConfigError(f"max_base_bytes must be None or a non-negative int, got {max_base_bytes!r}")
        if not timeout_s or timeout_s <= 0:
            raise ConfigError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        launch = detect_launch()
        self._name = member_name  # how messages call a member ("inference rank 1", or a job's rank)
        self.role = role
        self.rank = launch.rank if rank is None else int(rank)
        self.size = launch.world_size if size is None else int(size)
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"rank {self.rank} is not within this side's {self.size} ranks")
        self.device = resolve_device(device, launch.local_rank)
        self.timeout_s = float(timeout_s)
        self.bucket_bytes = bucket_bytes
        self.verify = bool(verify)
        self.delta = bool(delta)
        self.transport = handoff.transport_choice(transport)
        # The trainer's copy of the version its receivers hold (delta.py), named by this process
        # and its count of completed pushes: a restarted trainer's base is never a receiver's.
        self._base = deltas.Base(max_base_bytes)
        self._nonce = uuid.uuid4().hex[:12]
        self._pushes = 0  # completed pushes: turns the audit window
        self._attempts = 0
        # A receiver: per trainer rank, the base its next delta may patch (the version received
        # last from it), and where its tensors were then (a tensor that moved was rewritten).
        self._held: dict[int, str] = {}
        self._marks: dict[str, tuple] = {}
        self._scratch = deltas.PatchScratch(lanes=4)  # a receiver's per-change arrays, kept between updates
        self._whole_aside: dict[tuple, torch.Tensor] = {}  # a receiver's undo of whole pieces of deltas (Undo.space)
        self.place = pairing.with_experts(  # expert parallelism: which experts this rank keeps
            self._place(tensor_parallel_size, sharding, model_config), role, self.rank, self.size,
            expert_parallel_size, expert_placement_strategy,
            None if model_config is None else lambda: _config(model_config))
        if keeps is not None and self.place.experts is not None:
            raise ConfigError("keeps= says what an inference rank keeps of each update, expert_parallel_size "
                              "places its experts: pass one or the other (keeps= can leave other ranks' experts out)")
        if keeps is not None and (role != "inference" or self.place.size != 1):
            raise ConfigError("keeps= says what an inference rank keeps, instead of tensor_parallel_size and "
                              "sharding: pass one or the other, on the inference side")
        self._keeps = keeps
        if store is None and rendezvous_address is None:
            raise ConfigError("a SyncChannel needs a rendezvous address (tcp://HOST:PORT) for two jobs; "
                              "inside one job use distload.WeightSync")
        self.address = rendezvous_address or "the job's rendezvous store"
        # The job secret (distload/live/secret.py): proves this member to the store and keys the
        # buckets' checks; None where none is set (then only loopback is served).
        self._secret = job_secret(secret_file)
        self._serving = store is None and role == host and self.rank == 0
        self._reconnects = store is None and not self._serving  # a restarted host serves again
        # How messages name the process that serves the store: it is the one whose loss they report.
        self._server = server or (describe(host, 0) if store is None else
                                  "the process serving the job's rendezvous store")
        # the member serving it, if one does: its host, once a session says, goes in those messages
        self._server_member = (host, 0) if store is None and server is None else None
        self._store: BoundedStore | None = (
            BoundedStore(store, self.address, self._server) if store is not None
            else rendezvous.open_store(self.address, self._serving, self.timeout_s, self._server, self._secret,
                                       insecure))
        self._session: Session | None = None
        self._into_model: list[Any] = []  # given-up transfers still landing in this rank's tensors
        self._buffers: dict[tuple, torch.Tensor] = {}
        # Host tensors the rollback sets old bytes aside in, kept from update to update: fresh ones
        # each time would cost their page faults every update, and grow the heap after reconnects.
        self._set_aside_in: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self._absent: str | None = None  # why the update this rank waits for may not come (said once)
        self.last_error: str | None = None
        self.consistent = True

    def _place(self, tp_size: int, sharding: Any, model_config: Any) -> TPPlace:
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive int, got {tp_size!r}")
        if self.role == "trainer":
            if tp_size != 1 or sharding is not None:
                raise ConfigError("tensor_parallel_size and sharding describe what an inference rank keeps; "
                                  "a trainer sends whole tensors (pass them on the inference side)")
            return TPPlace()
        if self.size % tp_size:
            raise ConfigError(f"the inference side has {self.size} ranks, not a multiple of "
                              f"tensor_parallel_size {tp_size}")
        if tp_size == 1:
            return TPPlace()
        spec = sharding if isinstance(sharding, ShardingSpec) else load_spec(sharding)
        if spec.engine is not None:
            raise ConfigError(f"sharding {spec.name!r} writes {spec.engine}'s engine names, for saves only; "
                              f"sync slices with 'decoder' (the same slices under the checkpoint's names)")
        if spec.needs_model_config and not spec.config:
            if model_config is None:
                raise ConfigError(f"sharding {spec.name!r} splits attention heads: pass model_config= (the "
                                  f"model's config.json, as a dict or a path) so every rank cuts between heads")
            spec = ShardingSpec(spec.name, spec.rules, _config(model_config), spec.engine)
        return TPPlace(tp_size, self.rank % tp_size, spec)

    # -- sessions (distload/live/session.py) --------------------------------------------------
    def _info(self) -> dict[str, Any]:
        spec = self.place.spec
        return {"tp_size": self.place.size, "spec": None if spec is None else spec.to_json(),
                "device": self.device.type, "gpu": gpu_identity(self.device),
                # with a job secret every update is checked: the tags prove who sent the bytes
                "verify": self.verify or self._secret is not None,
                "pid": os.getpid(), "cuts": self._keeps is not None,
                # its EP place (pairing.info_place): a trainer rank sends it only its experts
                "experts": pairing.expert_info(self.place),
                # Only a member that posts its host may hand off to a same-host peer (handoff.py).
                "host": handoff.host_identity() if self.transport == "auto" else None,
                # for messages that name a member lost: its host, and the address it reaches the
                # rendezvous from (a pulled cable is told from a dead process by whose host it names)
                "hostname": socket.gethostname(), "address": self._reach_address()}

    def _reach_address(self) -> str | None:
        try:
            return rendezvous.pair_address(self.address)
        except Exception:  # noqa: BLE001 - only for messages: no route says nothing here
            return None

    def _join(self, deadline: float) -> Session:
        if self._session is not None:
            if self._session.current(self._store):
                return self._session
            self._drop_session()
        self._session = join(self._store, self.role, self.rank, self.size, self._info(), deadline,
                             address=self.address, timeout_s=self.timeout_s, name=self._name,
                             device=self.device, serving=self._serving)
        if self._server_member is not None and self._server_member[0] in ROLES:
            record = self._session.record
            self._store.locate(self._session.where(record.channel_rank(*self._server_member)))
        return self._session

    def _drop_session(self) -> None:
        session, self._session = self._session, None
        if session is None:
            return
        if self._serving and session.aborted():
            # The store goes with this process, which may exit as soon as push() raises: a member
            # that did not see the abort yet would then only learn that the store was lost, not
            # why (a dead peer the leader named first). Members look at least every POLL_S.
            time.sleep(ABORT_LINGER_S)
        self._into_model += session.end()
        if session.unfinished:
            # A transfer given up may still write into its buffer: the next updates take new ones.
            # (After an update that ended, the next session reuses them: no new memory per reconnect.)
            self._buffers.clear()

    # -- trainer ------------------------------------------------------------------------------
    def push(self, state: Mapping[str, torch.Tensor], version: int) -> SyncStats:
        """Send ``state`` as ``version``; every trainer rank calls it (each with its own part,
        disjoint names, or the same DTensors). Raises SyncError if any member refuses or fails."""
        if self.role != "trainer":
            raise ConfigError(f"{self._name(self.role, self.rank)} receives; push() is for trainer ranks")
        if isinstance(version, bool) or not isinstance(version, int):
            raise ConfigError(f"version must be an int, got {version!r}")
        start = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        session = self._join(deadline)
        self._base.begin()  # the last push's commit written, if it still was; its patches' memory free
        entries, tensors, dtensors = _describe_state(state, leader=self.rank == 0)
        groups = group_entries(entries, self.bucket_bytes)
        verify = self.verify or any(i.get("verify") for i in session.record.infos.values())
        # The base's name once this push is done: one per attempt, so that no receiver that
        # completed an attempt its trainer then failed can hold a name the base later takes.
        self._attempts += 1
        following = f"{self._nonce}:{self._attempts}"
        changes = _Changes()
        # A push that compares nothing (every tensor's copy rests: its compares gave up, every
        # element changing) sends every byte whole: it goes as a full update, one hand-off a
        # bucket as a full channel's, with no base named, so no receiver takes it as a delta. Its
        # "next" still names the base: the receivers hold it after, and the next push that
        # compares is a delta again. A delta carries its own checks; this only where the update is
        # verified anyway.
        compares = self.delta and not (verify and self._base.compares_none([e.name for e in entries]))
        meta = {"version": version, "entries": entries, "groups": groups, "verify": verify,
                "gathered": list(dtensors), "delta": self.delta, "base": self._base.id if compares else None,
                "next": following if self.delta else None, "audit": self._pushes, "bucket_bytes": self.bucket_bytes}
        try:
            session.put("meta", meta)
            if session.leader:  # every trainer rank's metadata read here, and every receiver's answer
                metas = verdicts.post_route(session, meta, version, deadline)
                verdict = verdicts.post_verdict(session, metas, version, deadline)
            else:
                metas = {self.rank: meta}
                verdict = verdicts.await_verdict(session, deadline)
            if verdict.refused:
                raise UpdateRefused(verdict.refused)
            if verdict.refit.get(self.rank):  # its receivers hold these as FP8: quantized here (refit.py)
                entries, groups, tensors, meta = refits.for_push(entries, tensors, meta, verdict.refit[self.rank])
                metas[self.rank] = meta
            if not session.leader and dtensors:  # the leader's order of gathering them
                metas[0] = rendezvous.get(session.store, session.key("meta", 0))
            routes = self._routes(session, entries, groups, verify, verdict.takes)
            peers = sorted(rank for route in routes for rank in route.ranks)
            sent = session.supervise(lambda cancelled: self._send(session, peers, routes, tensors, dtensors, metas,
                                                                  groups, changes, cancelled, deadline), deadline)
            session.finish(deadline, self._serving)
        except UpdateRefused:
            raise
        except BaseException:
            self._drop_session()
            raise
        session.seq += 1
        self._pushes += 1
        if self.delta:  # every receiver now holds this version: so does the base (written while
            # the trainer goes on: the next push waits for it)
            self._base.commit(changes.patches, changes.copies, following, later=True, whole=changes.whole)
        any_delta = any(route.delta for route in routes)
        return SyncStats(version, sum(e.nbytes for e in entries), len(entries), len(groups),
                         time.perf_counter() - start, sent, verify or (any_delta and all(r.delta for r in routes)),
                         any_delta, tuple(sorted(changes.sent_whole)), sum(changes.sent_whole.values()),
                         session.transport(peers))

    def _routes(self, session: Session, entries: Sequence[SyncTensor], groups: Sequence[Sequence[int]],
                verify: bool, takes_of: Mapping[int, Sequence[int]]) -> list[_Route]:
        """Each distinct receiver place and kind of update (delta or full), the session ranks
        that take it, and its bucket layouts; only receivers this rank carries bytes for
        (pairing.py): it pairs with no other. A receiver takes a delta from this trainer rank
        where it said it holds this rank's base (its answer, in the verdict's ``takes``)."""
        by_place: dict[tuple, _Route] = {}
        record = session.record
        cut = set(pairing.cut_receivers(record))
        for member in sorted(set(pairing.receivers(entries, record)) | cut):
            rank = member - record.trainer_size
            info = record.infos[rendezvous.member_key("inference", rank)]
            cuts = None
            if member in cut:  # what it keeps, posted with this update (read before its ready)
                cuts = rendezvous.get(session.store, session.key("cuts", member))
                if not pairing.carries(entries, TPPlace(1, 0, Cuts.from_json(cuts))):
                    continue
            takes = self.delta and self._base.id is not None and self.rank in takes_of.get(member, ())
            # the receivers of a route are those pairing.route_members names (a relay chain's members
            # derive it alike)
            key: tuple = (pairing.place_key(info, rank), takes) if cuts is None else (
                "cuts", json.dumps(cuts, sort_keys=True), takes)
            if key not in by_place:
                place = pairing.info_place(info, rank) if cuts is None else TPPlace(1, 0, Cuts.from_json(cuts))
                # A delta update carries its own checks (delta.py): its layouts need no bucket sums.
                by_place[key] = _Route(place, [], layouts(entries, groups, place, verify and not takes), takes,
                                       chained=cuts is None)
            by_place[key].ranks.append(member)
        for route in by_place.values():
            if route.chained:  # sent to its same-host members and its chain's head only: the head passes it on
                direct, chains = pairing.relay(record, self.rank, route.ranks)
                route.ranks = direct + [chain[0] for chain in chains]
        return list(by_place.values())

    def _send(self, session: Session, peers: Sequence[int], routes: Sequence[_Route],
              tensors: Mapping[int, torch.Tensor], dtensors: Mapping[str, torch.Tensor],
              metas: Mapping[int, Mapping[str, Any]], groups: Sequence[Sequence[int]], changes: "_Changes",
              cancelled: threading.Event, deadline: float) -> int:
        session.connect(peers, cancelled, deadline)
        key = self._bucket_key(session, self.rank)
        if self.rank != 0 and dtensors:
            _gather_with_leader(metas[0], dtensors)
        entries = metas[self.rank]["entries"]
        in_flight: dict[tuple[int, int], list[tuple[int, Any]]] = {}
        held: dict[tuple[int, int], list[torch.Tensor]] = {}  # what a slot's sends read, until they end
        sums: dict[int, list[torch.Tensor]] = {v: [] for v in range(len(routes))}  # per route: its checksums
        audited: dict[int, list[torch.Tensor]] = {v: [] for v in range(len(routes))}  # a delta's audit rows
        audits = [deltas.audit_parts(route.layouts, metas[self.rank]["audit"]) if route.delta else {}
                  for route in routes]

        def wait(works: list[tuple[int, Any]]) -> None:
            for dst, work in works:
                session.wait(work, cancelled, lambda d=dst: f"sending to {session.named(d)}")

        # Each slot's region in the segment sized once, for its biggest bucket (a delta's
        # messages may take a little more: that region then grows).
        session.reserve({("send", v, s): max(layout.size for layout in route.layouts[s::2])
                         for v, route in enumerate(routes) if self._hands_off(session, route.ranks)
                         for s in (0, 1) if route.layouts[s::2]})
        wire = 0
        # A delta route's messages: consecutive buckets merged (delta.merged), each sent once its
        # last bucket is compared; what its buckets bring, gathered until then.
        merged = [dict(deltas.merged(route.layouts, self.bucket_bytes)) if route.delta else {} for route in routes]
        worth = self._worth(session, routes)
        gathered: list[tuple[dict, dict]] = [({}, {}) for _ in routes]
        sent = [0] * len(routes)
        whole: dict[int, torch.Tensor] | None = None
        for i, group in enumerate(groups):
            whole = None  # the last bucket's tensors let go first (a refit's FP8 copies: refit.Quantizing)
            whole = {index: _whole(tensors[index]) for index in group}
            patches = self._changes(group, entries, whole, changes, tensors, worth) if self.delta else {}
            for v, route in enumerate(routes):
                device = self._transport_device()
                if route.delta:
                    audited[v] += deltas.sent_audit(audits[v].get(i, ()), whole, route.place, key)
                    gathered[v][0].update(whole)
                    gathered[v][1].update(patches)
                    if i not in merged[v]:
                        continue
                    slot = (v, sent[v] % 2)
                    sent[v] += 1
                    wait(in_flight.pop(slot, []))  # two messages in flight; a slot's buffer is free again
                    held.pop(slot, None)
                    (kept, found), gathered[v] = gathered[v], ({}, {})
                    layout = merged[v][i]
                    out = deltas.plan_bucket(layout, entries, found, route.place, worth)
                    messages = self._delta_messages(session, route.ranks, ("send",) + slot, out)
                    data = messages[1] if out.size else torch.empty(0, dtype=torch.uint8)
                    deltas.write_bucket(out, data, layout, entries, kept, route.place)
                    for piece, count in zip((piece for piece, _ in layout.items), out.counts):
                        if count == deltas.RAW:
                            name = entries[piece.entry].name
                            changes.sent_whole[name] = max(changes.sent_whole.get(name, 0), piece.nbytes)
                    held[slot] = messages
                    in_flight[slot] = [(dst, session.post(dst, m)) for dst in route.ranks for m in messages]
                    # tagged while the transport moves it (as a full bucket is): the sends never wait for it
                    sums[v].append(deltas.bucket_row(out, data, key))
                    wire += sum(m.numel() * m.element_size() for m in messages) * len(route.ranks)
                    continue
                slot = (v, i % 2)
                wait(in_flight.pop(slot, []))  # two buckets in flight; a slot's buffer is free again
                held.pop(slot, None)
                layout = route.layouts[i]
                if not layout.size:
                    continue
                if layout.direct:
                    data = run_bytes(whole[layout.items[0][0].entry].to(device), layout.items[0][0])
                    (data,) = self._staged(session, route.ranks, ("send",) + slot, [data])
                else:  # packed where same-host receivers read it, if any: written once for all of them
                    data = (session.staging(("send",) + slot, layout.size) if self._hands_off(session, route.ranks)
                            else self._buffer(("send",) + slot, layout.size))
                    pack(data, layout, {k: t.to(device) for k, t in whole.items()}, route.place)
                in_flight[slot] = [(dst, session.post(dst, data)) for dst in route.ranks]
                if layout.verified:  # summed while the transport copies it: the sends never wait for a sum
                    sums[v].append(checksum(data, key))
                wire += layout.wire_bytes * len(route.ranks)
        for works in in_flight.values():
            wait(works)
        for v, route in enumerate(routes):
            rows = sums[v] + audited[v]
            if rows:  # the update's checks, one message to each receiver after its data
                table = torch.stack(rows).to(self._transport_device())
                (message,) = self._staged(session, route.ranks, ("table", v), [table])
                wait([(dst, session.post(dst, message)) for dst in route.ranks])
                if route.delta:
                    wire += table.numel() * table.element_size() * len(route.ranks)
        return wire

    def _delta_messages(self, session: Session, ranks: Sequence[int], key: tuple, out: "deltas.Outgoing"
                        ) -> list[torch.Tensor]:
        """A delta bucket's messages, its header written and its data (``out.size`` bytes, if
        any) to be written: in this trainer's segment (region ``key``) where any of ``ranks`` is a
        same-host receiver, else in a buffer kept for ``key`` from update to update. Written
        where they are sent from: no copy after, and no new memory (and its page faults) each time."""
        header = torch.tensor(out.counts, dtype=torch.int64)
        if not self._hands_off(session, ranks):
            messages = [header.to(self._transport_device())]
            if out.size:
                messages.append(self._buffer(key, out.size))
            return messages
        sizes = [header.numel() * 8] + ([out.size] if out.size else [])
        spots, size = offsets(sizes, ALIGN)
        region = session.staging(key, size)
        messages = [region[at:at + nbytes] for at, nbytes in zip(spots, sizes)]
        messages[0].copy_(flat_bytes(header))
        return messages

    @staticmethod
    def _worth(session: Session, routes: Sequence[_Route]) -> int:
        """The margin a patch must save this push (delta.pays): where every receiver this rank
        sends a delta to reads its host memory (same host, no relay), a byte whole costs a memory
        copy and a patch must be far smaller to pay (delta.WORTH_SAME_HOST); where any one's bytes
        cross a link, delta.WORTH. One margin for the push: its compare (one per tensor) serves
        every route. GPU memory handed off by CUDA IPC keeps delta.WORTH: not measured yet."""
        ranks = [rank for route in routes if route.delta for rank in route.ranks]
        if ranks and session.transport(ranks) == "shm":
            return deltas.WORTH_SAME_HOST
        return deltas.WORTH

    @staticmethod
    def _hands_off(session: Session, ranks: Sequence[int]) -> bool:
        return any(session.maps(rank) for rank in ranks)

    def _staged(self, session: Session, ranks: Sequence[int], key: tuple, messages: Sequence[torch.Tensor]
                ) -> list[torch.Tensor]:
        """``messages`` as they go to ``ranks``: copied once into this trainer's segment (region
        ``key``) where any of them is a same-host receiver, which reads only from there (a
        socket peer reads the copy as well); as they are otherwise."""
        if not self._hands_off(session, ranks):
            return list(messages)
        spots, size = offsets([m.numel() * m.element_size() for m in messages], ALIGN)
        region = session.staging(key, size)
        staged = []
        for message, at in zip(messages, spots):
            raw = flat_bytes(message.contiguous())
            staged.append(region[at:at + raw.numel()].copy_(raw))
        return staged

    def _changes(self, group: Sequence[int], entries: Sequence[SyncTensor], whole: Mapping[int, torch.Tensor],
                 changes: "_Changes", tensors: Mapping[int, torch.Tensor], worth: int = deltas.WORTH
                 ) -> dict[int, deltas.Patch]:
        """Each entry's patch since the base (by entry index; none where the base does not hold
        it: it travels raw), its compare given up past the changes that pay by the margin
        ``worth``. What the base becomes once the push is done goes into ``changes``.
        ``tensors``: the caller's, which live through the push (``whole``'s gathered DTensors do
        not: their memory may come back for a later one)."""
        out = {}
        for index in group:
            name = entries[index].name
            tensor = whole[index].detach()
            first = changes.names.setdefault(_pushed_key(tensors, index), name)
            if first != name:  # one tensor under two names (tied weights): compared and kept once
                if first in changes.copies:  # new to the base: both travel whole, one copy kept
                    changes.copies[name] = changes.copies[first]
                    continue
                held = self._base.tensors.get(name)
                if first in changes.patches and held is not None and held is self._base.tensors.get(first):
                    out[index] = changes.patches[name] = changes.patches[first]  # one base, one patch
                    continue
                if first in changes.whole and held is not None and held is self._base.tensors.get(first):
                    changes.whole[name] = changes.whole[first]  # whole, as its other name
                    continue
                # tied now but not in the base (a name new to it, or kept apart): on its own below
            rests = self._base.rests(name)
            if rests is not None and self._base.tensors[name].shape == tensor.shape \
                    and self._base.tensors[name].dtype == tensor.dtype:
                # Its last compare gave up (every element changed, say): whole, and not compared
                # again until its rest is over; then its copy takes these bytes (refreshed).
                if rests:
                    changes.whole[name] = "rested"
                else:
                    self._base.refresh(name, tensor)
                    changes.whole[name] = "refreshed"
                continue
            base = self._base.held(name, tensor)
            if base is not None:  # compared where the tensor lives: a GPU's state never comes down whole
                # given up as soon as the patch clearly would not pay (delta.gives_up): then it
                # goes whole, its copy left as it is (resting: delta.MAX_REST)
                limit = deltas.most_changes(tensor.numel(), tensor.element_size(), worth)
                patch = (deltas.diff(tensor.contiguous(), base, self._base.scratch, limit)
                         if tensor.device.type == "cpu" else deltas.diff_on_device(tensor, base, limit))
                if patch is not None:
                    out[index] = changes.patches[name] = patch
                else:
                    changes.whole[name] = "gave up"
            elif self._base.room_for(name, entries[index].nbytes, changes.pending):
                # a copy of its own: the caller's tensor may change after push() returns
                changes.copies[name] = tensor.to("cpu", copy=True).contiguous()
                changes.pending += entries[index].nbytes
        return out

    # -- inference ----------------------------------------------------------------------------
    def receive(self, target: torch.nn.Module | Mapping[str, torch.Tensor] | Callable[[dict], Mapping[str, torch.Tensor]],
                timeout_s: float | None = None, *, rollback: bool | None = None) -> SyncStats:
        """Wait for the next update (up to ``timeout_s``, default the channel's) and receive it
        into ``target``'s tensors in place. ``target`` may also be a function that is given what
        the update brings this rank (name -> (torch dtype, shape it keeps)) and returns the
        tensors to receive into (a staging copy, say, applied only once the update is whole).

        On success ``version`` advances. On failure SyncError is raised, ``version`` is unchanged
        and ``last_error`` says why. ``rollback`` (the default for a module or a dict, which keep
        serving; not for a function's tensors, a staging copy already): each tensor's old bytes
        are copied aside (host memory) before the update first writes it, and copied back if the
        update fails, so the tensors hold exactly the old version again. It costs host memory for
        the bytes this rank receives, one copy of them per update, and it lands every bucket in a
        buffer first (no bucket straight into a tensor). ``consistent`` says whether the tensors
        hold exactly ``version``: False only after a failed update without rollback once data
        moved. A trainer that goes away between updates is waited for: when it (or its restart)
        pushes again within the timeout, the update arrives."""
        if self.role != "inference":
            raise ConfigError(f"{self._name(self.role, self.rank)} sends; receive() is for inference ranks")
        if isinstance(target, (torch.nn.Module, Mapping)):
            tensors = model_tensors(target)
            targets_for: Callable[[dict], Mapping[str, torch.Tensor]] = lambda wanted: tensors
            rollback = True if rollback is None else bool(rollback)
        elif callable(target):
            targets_for = target
            rollback = bool(rollback)
        else:
            raise ConfigError(f"receive() takes an nn.Module, a dict of tensors, or a function that makes the "
                              f"tensors to receive into; got {type(target).__name__}")
        wait_s = self.timeout_s if timeout_s is None else float(timeout_s)
        wait_deadline = time.monotonic() + wait_s
        try:
            session, version, metas = self._next_update(wait_deadline, wait_s)
            return self._receive_update(session, version, metas, targets_for, rollback)
        except SyncError as exc:
            self.last_error = str(exc)
            raise

    def _next_update(self, wait_deadline: float, wait_s: float
                     ) -> tuple[Session, int, dict[int, Mapping[str, Any]]]:
        """Wait for the next update's metadata; a trainer that goes away meanwhile (or restarts,
        or the process serving the store restarts, or stops and resumes) is waited for until the
        deadline, and named once it is not answering."""
        me = self._name(self.role, self.rank)
        self._absent = None
        while True:
            try:
                found = self._wait_metadata(wait_deadline, wait_s)
            except StoreLost as exc:
                if time.monotonic() > wait_deadline or not (exc.stalled or self._reconnects):
                    self._drop_session()
                    raise SyncError(f"{me}: {exc}; no update within {wait_s:.0f} s, still at version "
                                    f"{self.version}") from None
                self._note_absent(str(exc), wait_deadline)
                if exc.stalled:
                    # Its server is stopped (or hung): it may resume, and the session with it. A
                    # kill ends the unanswered call, and the next one finds the store lost.
                    time.sleep(rendezvous.POLL_S)
                    continue
                self._drop_session()
                self._store.close()
                try:  # a restarted trainer serves the store again at the same address
                    self._store = rendezvous.open_store(self.address, False, wait_deadline - time.monotonic(),
                                                        self._server, self._secret)
                except SyncError as lost:
                    raise SyncError(f"{me}: no update arrived within {wait_s:.0f} s: {exc}, and no restarted "
                                    f"{self._server} served it again ({lost}); still at version {self.version}"
                                    ) from None
                continue
            if found is not None:
                return found
            self._drop_session()

    def _note_absent(self, reason: str, wait_deadline: float) -> None:
        """Say once, at once, why this rank's wait for an update may be long: what it is waiting
        for is not answering (the wait goes on: it may resume, or a restarted trainer come)."""
        if self._absent is None:
            self._absent = reason
            log.warning("%s: %s; waiting for it (or a restarted trainer) for up to %.0f s more, at version %s",
                        self._name(self.role, self.rank), reason, max(0.0, wait_deadline - time.monotonic()),
                        self.version)

    def _wait_metadata(self, wait_deadline: float, wait_s: float
                       ) -> tuple[Session, int, dict[int, Mapping[str, Any]]] | None:
        """The next update's version and the metadata of the trainer ranks that may send to this
        rank (by trainer rank): those the leader names for this rank's place, or every trainer
        rank for a rank that says what it keeps of the whole update (``keeps``). None: the
        trainer restarted, join its next session."""
        me = self._name(self.role, self.rank)
        try:
            session = self._join(wait_deadline)
        except StoreLost:
            raise
        except SyncError as exc:
            if self._absent is not None:  # it timed out waiting for a trainer already known silent
                raise SyncError(f"{me}: no update arrived within {wait_s:.0f} s: {self._absent}; still at "
                                f"version {self.version}") from None
            raise exc
        route = session.key("route")  # posted by the leader once every trainer rank's metadata is in
        backoff = rendezvous.Backoff()
        while not session.store.check([route]):
            if self._store.check([rendezvous.CLOSING]):
                raise SyncError(f"{me}: the channel at {self.address} was closed by the process serving it; "
                                f"still at version {self.version}")
            gone = session.trainer_gone(self._store)
            if gone == "":
                return None  # the trainer restarted: join its next session
            if gone is not None:
                self._note_absent(gone, wait_deadline)
            if time.monotonic() > wait_deadline:
                why = "" if self._absent is None else f": {self._absent}"
                raise SyncError(f"{me}: no update arrived within {wait_s:.0f} s{why}; still at version "
                                f"{self.version}")
            backoff.pause()
        return (session, *verdicts.read_route(session, self.rank, every=self._keeps is not None))

    def _receive_update(self, session: Session, version: int, metas: dict[int, Mapping[str, Any]],
                        targets_for: Callable[[dict], Mapping[str, torch.Tensor]], rollback: bool) -> SyncStats:
        start = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        sent, claimed = metas, {}  # the metadata as posted, before any refit; what this rank claims of it
        try:
            try:  # what this rank keeps; a spec that cannot cut a tensor is this rank's refusal
                place = self._update_place(session, metas)
                if self._keeps is not None:  # the senders: those it keeps bytes of (as they decide)
                    metas = sent = {t: m for t, m in metas.items() if pairing.carries(m["entries"], place)}
                plans = {t: layouts(m["entries"], m["groups"], place, m["verify"]) for t, m in metas.items()}
            except (ConfigError, _Unkept) as exc:
                plans, problems, advice = {}, [str(exc)], None
            else:
                wanted = {m["entries"][piece.entry].name: (DTYPES[m["entries"][piece.entry].dtype], piece.shape)
                          for t, m in metas.items() for layout in plans[t] for piece, _ in layout.items}
                targets = targets_for(wanted)
                problems = self._settled(min(self.timeout_s, SETTLE_S))
                # targets that hold FP8 where a float is sent: the trainer quantizes (refit.py)
                claimed, unfit = refits.claims(metas, targets, cuts=self._keeps is not None)
                problems += unfit.values()
                if any(claimed.values()):
                    metas, plans = refits.plans(metas, claimed, place, problems)
                advice = None
                for t, meta in metas.items():
                    pieces = [piece for layout in plans[t] for piece, _ in layout.items
                              if meta["entries"][piece.entry].name not in unfit]  # said once, above
                    problems += check_pieces(meta["entries"], pieces, targets)
                    advice = advice or self._whole_targets(meta["entries"], pieces, targets)
            takes = [] if problems else self._takes(metas, plans, targets)
            session.put("ready", verdicts.ready(problems, takes, advice if problems else None,
                                                {} if problems else claimed))
            verdict = verdicts.await_verdict(session, deadline)  # the leader's, from every member's ready
            if verdict.refused:
                raise UpdateRefused(verdict.refused)
            # the deltas it takes as the verdict says: where its relay chain's others cannot take a
            # trainer rank's delta, it takes every byte from that rank with them (chained_takes)
            takes = list(verdict.takes.get(session.me, ()))
            # what the trainer ranks quantize: every receiver's claims (with EP, others' experts too)
            metas, plans = refits.replanned(sent, claimed, verdict.refit, metas, plans, place)
            # per sender: where its messages come from, whom this rank passes them on to (relays)
            where = pairing.places(session.record)
            relays = {t: pairing.links(session.record, session.me, t, verdict.takes, where) for t in metas}
        except UpdateRefused:
            raise
        except BaseException:
            self._drop_session()
            raise
        self.consistent = False  # from here on, a failure may leave a mix of two versions
        undo: dict[str, torch.Tensor] | None = {} if rollback else None
        landing = _Landing(deltas.Undo(space=self._whole_aside))
        self._scratch.reset()  # the last update's undo is done with: its deltas' memory is free
        try:
            wire = session.supervise(lambda cancelled: self._receive_all(session, metas, plans, targets, takes,
                                                                         relays, landing, cancelled, undo, deadline),
                                     deadline)
            session.finish(deadline, self._serving)
        except BaseException as exc:
            # supervise() has ended the transfer thread: nothing of this update lands after this.
            self._drop_session()
            # The full writes' old bytes first, then the deltas' undo: a tensor a delta patched
            # before a full write set its bytes aside holds its old values again only in that order.
            rolled = " (what had landed was rolled back)" if undo else ""
            if undo is not None:
                self._roll_back(undo, targets)
            undone = self._undo(landing)
            if not isinstance(exc, SyncError):
                raise
            raise SyncError(f"version {version} did not arrive whole; still at version {self.version}"
                            f"{rolled or undone}: "
                            f"{exc}") from exc
        session.seq += 1
        self.version, self.consistent, self.last_error = version, True, None
        # What the next delta from each trainer rank may patch: this version, as it now lies here.
        self._held = {t: m["next"] for t, m in metas.items() if m.get("next")}
        self._marks = {name: _mark(targets[name]) for name in _names(metas, plans)}
        nbytes = sum(piece.nbytes for plan in plans.values() for layout in plan for piece, _ in layout.items)
        verified = all(m["verify"] or t in takes for t, m in metas.items())
        # the undo of whole pieces kept for the tensors this rank still has (not for memory it let go)
        here = {deltas.alias_key(t) for t in targets.values()}
        self._whole_aside = {k: v for k, v in self._whole_aside.items() if k in here}
        return SyncStats(version, nbytes, sum(len(m["entries"]) for m in metas.values()),
                         sum(len(p) for p in plans.values()), time.perf_counter() - start, wire, verified, bool(takes),
                         tuple(sorted(landing.whole)), sum(landing.whole.values()), session.transport(metas))

    def _update_place(self, session: Session, metas: Mapping[int, Mapping[str, Any]]) -> TPPlace:
        """Where this rank sits for this update: its TP place, or the cuts its ``keeps`` makes of
        the update's tensors, posted for the trainer ranks (read once every member is ready)."""
        if self._keeps is None:
            return self.place
        try:
            cuts = Cuts(self._keeps([entry for t in sorted(metas) for entry in metas[t]["entries"]]))
        except DistloadError as exc:
            raise _Unkept(str(exc)) from None
        session.put("cuts", cuts.to_json())
        return TPPlace(1, 0, cuts)

    def _takes(self, metas: Mapping[int, Mapping[str, Any]], plans: Mapping[int, Sequence[BucketLayout]],
               targets: Mapping[str, torch.Tensor]) -> list[int]:
        """The trainer ranks whose delta this rank can take: it holds exactly the base that trainer
        rank will patch (received whole from it last, and its tensors have not moved since)."""
        if any(self._marks.get(name) != _mark(targets[name]) for name in _names(metas, plans)):
            self._held.clear()  # a tensor was reallocated, repacked or is new here: its base is unknown
            return []
        return [t for t, m in metas.items() if m.get("base") is not None and self._held.get(t) == m["base"]]

    def _undo(self, landing: "_Landing") -> str:
        """After a failed update: put back what its deltas overwrote (its transfer thread has
        ended). Every base is then unknown: the next update sends every byte. Returns what the
        message adds."""
        self._held.clear()
        self._marks.clear()
        landing.undo.restore()
        if not landing.full:
            self.consistent = True  # only deltas wrote here, and every change is undone
            return " (every change undone)"
        return ""

    def _receive_all(self, session: Session, metas: Mapping[int, Mapping[str, Any]],
                     plans: Mapping[int, Sequence[BucketLayout]], targets: Mapping[str, torch.Tensor],
                     takes: Sequence[int], relays: Mapping[int, tuple[int, int | None]], landing: "_Landing",
                     cancelled: threading.Event, undo: dict[str, torch.Tensor] | None, deadline: float) -> int:
        session.connect(sorted({p for link in relays.values() for p in link if p is not None}), cancelled, deadline)
        wire = 0
        # Senders in rank order on every member: a relay chain's pairs then carry their messages in
        # the same order on both sides (pairing.py).
        for sender in sorted(metas):
            if cancelled.is_set():
                return wire  # given up inside the last sender's: post nothing more (straight into the model)
            meta, plan = metas[sender], plans[sender]
            relay = _Relay(session, *relays[sender], cancelled, self._name("trainer", sender))
            if sender in takes:
                wire += self._receive_delta(session, sender, meta, plan, targets, landing, relay)
                relay.drain()
                continue
            landing.full = True
            # What this sender writes whole: a later sender's delta of the same memory (a tied
            # weight pushed by two trainer ranks) reads it back rather than flipping over it, and
            # a whole piece of it keeps no undo of its own (this write's old bytes are the rollback's).
            written = {deltas.alias_key(targets[meta["entries"][piece.entry].name])
                       for layout in plan for piece, _ in layout.items if piece.nbytes}
            landing.undo.touched.update(written)
            landing.undo.full_writes.update(written)
            posted: dict[int, tuple[torch.Tensor, Any]] = {}  # bucket -> (where it lands, its transfer)
            sums: list[torch.Tensor] = []  # the checksum of every verified bucket that arrived, in order
            key = self._bucket_key(session, sender)

            def post(i: int) -> None:
                if i >= len(plan) or not plan[i].size:
                    return
                layout = plan[i]
                # With rollback, never straight into a tensor: a given-up transfer of a stopped
                # trainer could still land there after the rollback.
                into = None if undo is not None else self._direct_target(layout, meta, targets)
                straight = into is not None
                if not straight and session.transport([relay.source]) == "shm":
                    # From a same-host trainer's host memory: read where it lies (no copy into a
                    # buffer first), released once unpacked. (CUDA IPC memory is on the trainer's
                    # GPU: it is copied onto this rank's, as a process group would.)
                    work = session.take(sender, layout.size)
                else:
                    if into is None:
                        into = self._buffer(("recv", i % 2), layout.size)
                    relay.drain()  # what was passed on from this buffer two buckets ago has left it
                    work = relay.take(into)
                if undo is not None:  # while the bucket is on its way
                    _set_aside(undo, self._set_aside_in, layout, meta["entries"], targets)
                if straight:
                    session.into_model.append(work)
                posted[i] = (into, work)

            post(0)
            post(1)
            for i, layout in enumerate(plan):
                if layout.size:
                    data, work = posted.pop(i)
                    session.wait(work, cancelled, lambda i=i: f"receiving bucket {i} from {relay.origin}")
                    taken = data is None
                    if taken:
                        data = work.data
                    else:
                        relay.pass_on(data)
                    if layout.verified:
                        sums.append(checksum(data, key))
                    if cancelled.is_set():
                        return wire  # the update was given up: never write into the model after that
                    if not layout.direct or not _same_memory(data, targets[meta["entries"][layout.items[0][0].entry].name]):
                        unpack(data, layout, meta["entries"], targets)
                    if taken:
                        work.release()
                    wire += layout.wire_bytes
                post(i + 2)
            if sums:
                self._check_sums(session, sender, plan, torch.stack(sums), relay)
            relay.drain()
        if self.device.type == "cuda":
            # unpack's copies run on this thread's current stream of the device: done before
            # receive() returns, for a consumer on any other stream.
            torch.cuda.current_stream(self.device).synchronize()
        return wire

    def _roll_back(self, undo: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor]) -> None:
        """Copy the old bytes set aside back into every tensor the failed update wrote: the
        tensors hold exactly the old version again."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the transfer thread's copies, on its stream
        with torch.no_grad():
            # Last set aside, first put back: two names of one tensor (tied weights, pushed by
            # two trainer ranks) are both set aside, the second after the first one's bytes
            # landed; put back in the other order, it would leave those in place.
            for name, old in reversed(undo.items()):
                targets[name].detach().copy_(old)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.consistent = True
        undo.clear()

    def _receive_delta(self, session: Session, sender: int, meta: Mapping[str, Any], plan: Sequence[BucketLayout],
                       targets: Mapping[str, torch.Tensor], landing: "_Landing", relay: "_Relay") -> int:
        """Take ``sender``'s delta (delta.py: a header and the data, bucket by bucket, the buckets
        merged as delta.merged says), applying each bucket in place as it lands, then check it: the
        trainer's rows against this rank's."""
        cancelled = relay.cancelled
        entries = meta["entries"]
        trainer = self._name("trainer", sender)
        key = self._bucket_key(session, sender)
        rows, buckets, wire = [], [], 0
        device = self._transport_device()
        sent = [layout for _, layout in deltas.merged(plan, meta["bucket_bytes"])]  # as the trainer merged them

        def header_of(k: int) -> tuple[torch.Tensor, Any] | None:
            if k >= len(sent):
                return None
            header = torch.empty(len(sent[k].items), dtype=torch.int64, device=device)
            return header, relay.take(header)

        following = header_of(0)
        for i, layout in enumerate(sent):
            assert following is not None
            header, work = following
            session.wait(work, cancelled, lambda i=i: f"receiving bucket {i} from {relay.origin}")
            relay.pass_on(header)
            counts = header.cpu().tolist()
            for (piece, _), count in zip(layout.items, counts):
                if not deltas.RAW <= count <= piece.nbytes:
                    raise SyncError(f"bucket {i} from {trainer}: its header is not the header sent ({count} changes "
                                    f"to {entries[piece.entry].name})")
                if count == deltas.RAW:
                    landing.whole[entries[piece.entry].name] = piece.nbytes
            size = offsets(deltas.data_sizes(layout, entries, counts), ALIGN)[1]
            data, taken = None, None
            if size and session.transport([relay.source]) == "shm":
                # From a same-host trainer's segment: read where it lies (as a full update's
                # buckets are), released once applied; a copy into a buffer first would cost a
                # whole piece its bytes once more
                taken = session.take(sender, size)
                session.wait(taken, cancelled, lambda i=i: f"receiving bucket {i} from {relay.origin}")
                data = taken.data
            elif size:
                relay.drain()  # the last bucket's data, passed on from this buffer, has left it
                data = self._buffer(("delta",), size)
                session.wait(relay.take(data), cancelled, lambda i=i: f"receiving bucket {i} from {relay.origin}")
                relay.pass_on(data)
            # The next bucket's header on its way while this one is applied: its data can be taken
            # as soon as this one is in (one wait less per bucket).
            following = header_of(i + 1)
            if cancelled.is_set():
                return wire  # the update was given up: never write into the model after that
            try:
                rows.append(deltas.receive_bucket(data, counts, layout, entries, targets, landing.undo, key,
                                                  self._scratch))
            except deltas.PatchError as exc:
                raise SyncError(f"bucket {i} from {trainer} failed its check on {self._name(self.role, self.rank)}: "
                                f"{exc}: the bytes that arrived are not the bytes sent") from None
            if taken is not None:
                taken.release()
            buckets.append(i)
            wire += header.numel() * 8 + size
        parts = deltas.audit_parts(plan, meta["audit"])
        audited = [part for i in sorted(parts) for part in parts[i]]
        rows += deltas.held_audit(audited, entries, targets, key)
        if rows:
            mine = torch.stack(rows)
            table = torch.empty_like(mine, device=device)
            session.wait(relay.take(table), cancelled, lambda: f"receiving the checks from {relay.origin}")
            relay.pass_on(table)
            wire += table.numel() * 8
            self._check_delta(mine, table.cpu(), buckets, audited, sent, entries, trainer)
        return wire

    def _check_delta(self, mine: torch.Tensor, table: torch.Tensor, buckets: Sequence[int],
                     audited: Sequence[tuple[Any, int, int]], plan: Sequence[BucketLayout],
                     entries: Sequence[SyncTensor], trainer: str) -> None:
        """Raise, naming what differs, where this rank's check rows are not the trainer's."""
        bad = first_mismatch(mine, table)
        if bad is None:
            return
        me = self._name(self.role, self.rank)
        drifted = (f"{me}'s tensors are not the version {self.version} it received (rewritten or repacked in "
                   f"place since, or a bug): the delta was not patched over them; every change is undone and the "
                   f"next push sends {me} every byte")
        if bad >= len(buckets):
            piece, start, stop = audited[bad - len(buckets)]
            raise SyncError(f"{entries[piece.entry].name} bytes [{start}, {stop}) differ from {trainer}'s after "
                            f"the update: {drifted}")
        i = buckets[bad]
        names = ", ".join(entries[piece.entry].name for piece, _ in plan[i].items[:_SHOWN])
        ours, theirs = mine[bad], table[bad]
        if not torch.equal(ours[:2], theirs[:2]):
            raise SyncError(f"bucket {i} from {trainer} failed its checksum on {me} ({plan[i].size} bytes of "
                            f"tensors): the bytes that arrived are not the bytes sent")
        # The bytes arrived as sent, and decoding them is fixed code: the values the flips were
        # applied to were not the base's.
        raise SyncError(f"bucket {i} from {trainer} ({names}): the values it changes were not the base's "
                        f"here (the values written are not the trainer's new values): {drifted}")

    def _check_sums(self, session: Session, sender: int, plan: Sequence[BucketLayout], sums: torch.Tensor,
                    relay: "_Relay") -> None:
        """Receive the trainer's checksums of every verified bucket it sent this rank and compare
        them with ``sums``, those of the buckets that arrived: a mismatch fails the update, naming
        the bucket."""
        table = torch.empty_like(sums)
        session.wait(relay.take(table), relay.cancelled,
                     lambda: f"receiving the checksums from {relay.origin}")
        relay.pass_on(table)
        bad = first_mismatch(sums, table)
        if bad is None:
            return
        i = [i for i, layout in enumerate(plan) if layout.verified and layout.size][bad]
        raise SyncError(f"bucket {i} from {self._name('trainer', sender)} failed its checksum on "
                        f"{self._name(self.role, self.rank)} ({plan[i].size} bytes): the bytes that arrived are "
                        f"not the bytes sent")

    def _direct_target(self, layout: BucketLayout, meta: Mapping[str, Any], targets: Mapping[str, torch.Tensor]
                       ) -> torch.Tensor | None:
        """The receiver's own tensor as bytes, where a direct bucket can land in it straight (one
        copy less; checked, when verified, once it has landed): contiguous, on the transport's
        device."""
        if not layout.direct:
            return None
        dst = targets[meta["entries"][layout.items[0][0].entry].name].detach()
        if not dst.is_contiguous() or dst.device != self._transport_device():
            return None
        return dst.reshape(-1).view(torch.uint8)

    def _settled(self, wait_s: float) -> list[str]:
        """Wait up to ``wait_s`` for the transfers of given-up updates that were landing straight
        in this rank's tensors (their trainer stopped mid-update and may resume): until they have
        ended, a new update could be overwritten by them. Empty: none left."""
        deadline = time.monotonic() + wait_s
        while True:
            self._into_model = [w for w in self._into_model if not w.is_completed()]
            if not self._into_model or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if not self._into_model:
            return []
        return [f"{len(self._into_model)} transfer(s) of an update given up earlier may still land in this rank's "
                f"tensors (its trainer stopped mid-update and has not resumed or died); not receiving over them"]

    # -- shared ------------------------------------------------------------------------------------
    def _whole_targets(self, entries: Sequence[SyncTensor], pieces: Sequence[KeptSlice],
                       targets: Mapping[str, torch.Tensor]) -> str | None:
        """What to do where this rank keeps TP slices but its target holds whole tensors (a
        plain Hugging Face model at ``tensor_parallel_size`` > 1); None otherwise."""
        whole = [entries[p.entry] for p in pieces if p.action is not None and p.shape != entries[p.entry].shape
                 and entries[p.entry].name in targets
                 and tuple(targets[entries[p.entry].name].shape) == entries[p.entry].shape]
        if not whole:
            return None
        size, rank = self.place.size, self.place.rank
        return (f"this rank keeps TP rank {rank} of {size}'s slices (tensor_parallel_size={size}) but its target "
                f"holds whole tensors ({len(whole)}, e.g. {whole[0].name} {list(whole[0].shape)}): receive into "
                f"tensors of the slices' shapes, such as distload.load(CHECKPOINT, tensor_parallel_size={size}) "
                f"or a model built for TP {size}, or keep whole tensors with tensor_parallel_size=1")

    def _bucket_key(self, session: Session, trainer: int) -> BucketKey:
        """The key that tags trainer rank ``trainer``'s buckets in this update (transfer.BucketKey)."""
        return BucketKey(self._secret, session.record.id, session.seq, trainer)

    def _buffer(self, key: tuple, size: int) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < size or buffer.device != self._transport_device():
            buffer = self._buffers[key] = torch.empty(size, dtype=torch.uint8, device=self._transport_device())
        return buffer[:size]

    def _transport_device(self) -> torch.device:
        """Where buffers live: the device with NCCL, host memory with gloo."""
        return self.device if self._session is not None and self._session.backend == "nccl" else torch.device("cpu")

    def close(self) -> None:
        """Leave the channel. The process serving the store first tells the members (their
        heartbeats stop, a waiting receive raises) and gives them CLOSE_WAIT_S to leave."""
        store, self._store = self._store, None
        self._base.settle()
        session = self._session
        self._drop_session()
        self._buffers, self._set_aside_in = {}, {}
        if store is not None:
            leave(store, session, self._serving)
            store.close()

    def __enter__(self) -> "SyncChannel":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class _Relay:
    """One sender's messages at a receiver: taken from ``source`` (the sender, or the member
    before this one in its relay chain: pairing.links) and, where the chain goes on, passed on to
    ``onward`` as each lands. A message passed on is read until :meth:`drain`: its buffer is not
    written again before that."""

    def __init__(self, session: Session, source: int, onward: int | None, cancelled: threading.Event, sender: str):
        self.session, self.source, self.onward, self.cancelled = session, source, onward, cancelled
        self.passing: list[tuple[torch.Tensor, Any]] = []
        # how a failed receive names where it came from: the relay whose connection failed, if any
        self.origin = (sender + session.where(source) if source < session.record.trainer_size
                       else f"{sender} through {session.named(source)}")

    def take(self, tensor: torch.Tensor) -> Any:
        """Start receiving the sender's next message into ``tensor``."""
        return self.session.post(self.source, tensor, send=False)

    def pass_on(self, tensor: torch.Tensor) -> None:
        """``tensor`` has landed: send it on down the chain, if it goes on."""
        if self.onward is not None:
            self.passing.append((tensor, self.session.post(self.onward, tensor, send=True)))

    def drain(self) -> None:
        """Wait until everything passed on has left."""
        for _, work in self.passing:
            self.session.wait(work, self.cancelled, lambda: f"passing messages on to {self.session.named(self.onward)}")
        self.passing = []


@dataclass
class _Landing:
    """What an update wrote into a receiver's tensors so far."""

    undo: deltas.Undo = field(default_factory=deltas.Undo)  # the deltas' overwritten values
    whole: dict[str, int] = field(default_factory=dict)  # pieces the deltas sent whole: name -> bytes
    full: bool = False  # a full update's bytes may have landed: no undo for them


def _mark(tensor: torch.Tensor) -> tuple:
    """Where a receiver's tensor lies, and torch's count of in-place writes to it: a tensor that
    moved (reallocated, repacked) or was written by a torch op on it or a view of it (an engine
    that rewrote it; distload's wake and reload count their writes through memory as well)
    between two updates no longer holds the base it held, whichever of its elements the next
    delta changes. Writes torch does not count (through ``.data`` or another tensor on the same
    storage, a kernel or a numpy view writing through the pointer) are what the patch sums and
    the audit catch (delta.py)."""
    return deltas.alias_key(tensor) + (_writes(tensor),)


def _writes(tensor: torch.Tensor) -> int | None:
    """Torch's version counter of ``tensor`` (shared with its views); None for an inference-mode
    tensor, which keeps none (the sums and the audit still check it)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def _names(metas: Mapping[int, Mapping[str, Any]], plans: Mapping[int, Sequence[BucketLayout]]) -> set[str]:
    return {m["entries"][piece.entry].name for t, m in metas.items() for layout in plans[t]
            for piece, _ in layout.items}


def _config(model_config: Mapping[str, Any] | str) -> dict[str, Any]:
    if isinstance(model_config, Mapping):
        return dict(model_config)
    import json

    path = os.path.join(model_config, "config.json") if os.path.isdir(model_config) else model_config
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model_config {model_config!r}: cannot read a config.json there ({exc})") from None


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "full_tensor")


def _describe_state(state: Mapping[str, torch.Tensor], leader: bool
                    ) -> tuple[list[SyncTensor], dict[int, torch.Tensor], dict[str, torch.Tensor]]:
    """This trainer rank's entries, its tensors by entry index, and its DTensors by name. A
    DTensor is an entry of trainer rank 0 only (whole shape): every trainer rank takes part in
    gathering it while rank 0 sends, and rank 0 sends it."""
    if not isinstance(state, Mapping):
        raise ConfigError(f"push() takes a state dict (name -> tensor), got {type(state).__name__}")
    entries, tensors, dtensors = [], {}, {}
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"state entry {name!r} is a {type(tensor).__name__}, not a tensor")
        if tensor.dtype not in DTYPE_CODES:
            raise ConfigError(f"state entry {name!r} is {tensor.dtype}, which weight sync does not carry "
                              f"(it carries the dtypes safetensors stores)")
        if _is_dtensor(tensor):
            dtensors[name] = tensor
            if not leader:
                continue
        tensors[len(entries)] = tensor
        entries.append(SyncTensor(name, dtype_code(tensor.dtype), tuple(tensor.shape),
                             tensor.numel() * tensor.element_size()))
    return entries, tensors, dtensors


def _gather_with_leader(leader_meta: Mapping[str, Any], dtensors: Mapping[str, torch.Tensor]) -> None:
    """A trainer rank other than 0 takes its part in gathering each DTensor, in the order rank 0
    gathers them (bucket by bucket, in its entry order), and drops the result."""
    entries = leader_meta["entries"]
    for group in leader_meta["groups"]:
        for index in group:
            tensor = dtensors.get(entries[index].name)
            if tensor is not None:
                tensor.full_tensor()


def _memory_key(tensor: torch.Tensor) -> tuple:
    """What one tensor of a pushed state is, so that two names of it (tied weights) are found: its
    memory, or a DTensor's object (its gathered whole is a new tensor each time)."""
    return ("dtensor", id(tensor)) if _is_dtensor(tensor) else deltas.alias_key(tensor)


def _pushed_key(tensors: Mapping[int, torch.Tensor], index: int) -> tuple:
    """:func:`_memory_key` of what the caller pushed as entry ``index``: for a refit entry, of the
    tensor it is quantized from (its FP8 copy is new memory, which a later one may reuse)."""
    if isinstance(tensors, refits.Quantizing):
        source, part = tensors.source(index)
        if part is not None:
            return ("refit", part) + _memory_key(source)
    return _memory_key(tensors[index])


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if _is_dtensor(tensor) else tensor


def _set_aside(undo: dict[str, torch.Tensor], space: dict[str, torch.Tensor], layout: BucketLayout,
               entries: Sequence[SyncTensor], targets: Mapping[str, torch.Tensor]) -> None:
    """Copy the old bytes of each tensor ``layout`` writes into ``undo`` (host tensors, reused
    from ``space``), the first time this update writes it."""
    for piece, _ in layout.items:
        name = entries[piece.entry].name
        if piece.nbytes and name not in undo:
            old = targets[name].detach()
            held = space.get(name)
            if held is None or held.shape != old.shape or held.dtype != old.dtype:
                held = space[name] = torch.empty(old.shape, dtype=old.dtype, device="cpu")
            held.copy_(old)
            undo[name] = held


def _same_memory(data: torch.Tensor, tensor: torch.Tensor) -> bool:
    return data.device == tensor.device and data.data_ptr() == tensor.data_ptr()
