"""The sync session: the members of a weight-sync channel working together, until a failure.

Members come and go, so a session is formed afresh after every failure over the channel's
rendezvous store (distload/live/rendezvous.py: hellos, the leader's record). Everything a
protocol run over the members needs lives here: the session's part of the store, a two-member
process group with each peer it moves bytes with (a *pair*), the heartbeats, the abort and the
supervisor. The update protocol (distload/live/channel.py) runs over it. On every member:

1. :func:`join` forms it: trainer rank 0 (the leader) writes the record, every other member
   waits for a record that lists it and starts its heartbeat; a member whose peer shares its host
   hands off through memory both map (distload/live/handoff.py). Pairs are not made here: before
   an update's data moves, :meth:`Session.connect` makes the ones that update needs and lacks
   (gloo, or NCCL where every member is on CUDA), with the peers it moves bytes with only
   (distload/live/pairing.py), and they last as long as the session. Before the next update
   :meth:`Session.current` says whether to keep it (the leader's lasts until an update fails;
   another member's while the rendezvous still names it); an inference rank waiting for an
   update asks :meth:`Session.trainer_gone` (the leader formed a new one, or a trainer went silent);
2. each step of an update (numbered ``seq``): :meth:`Session.put` posts this member's answer
   under :meth:`Session.key`. Nobody reads everyone's answers but the leader: it
   :meth:`Session.collect` s them and :meth:`Session.announce` s one verdict, which every other
   member :meth:`Session.await_posted` s, so the store's traffic is one key and one read per
   member and step, not one read per pair of members;
3. the data step runs in :meth:`Session.supervise`: a transfer thread connects the pairs it lacks
   and posts transfers (:meth:`Session.post`: a trainer sends to its peer, an inference rank
   receives from it, and sends on what it passes down a relay chain) and polls them (:meth:`Session.wait`), while the calling thread watches the
   abort key and the heartbeats it watches: the leader's every member's, any other member its
   peers' and the leader's (a member that dies unwatched by the others is the leader's to name);
   on a failure it stops the transfer thread (whose waits poll, because a gloo wait can be
   neither interrupted nor timed out without closing its connection) before it raises;
4. any failure (a peer that died or stopped, a deadline, the protocol's own) is posted as the
   update's abort reason (:meth:`Session.fail`: the first one posted wins) and every member
   raises it within its timeout; each then ends its session (:meth:`Session.end`: its heartbeat
   stops, its pairs are released) and the next update forms a new one;
5. :func:`leave` when the channel closes: a member says it left; the process serving the store
   first tells the members and waits for them.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist

from distload.errors import SyncError
from distload.runtime import RUNTIME
from distload.workers.heartbeat import Beat, PeerWatch
from distload.live import handoff, rendezvous
from distload.live.rendezvous import BoundedStore, SessionRecord, StoreLost, short

DEAD_AFTER_S = 5.0  # a member whose heartbeat stood still this long stopped (killed, SIGSTOP, hung, its host cut off)
LEADER = 0  # trainer rank 0's session rank: it forms sessions and posts each step's verdict


def silence(names: str) -> str:
    """The reason for members (``names``, with their hosts) whose heartbeat stood still."""
    return (f"{names} stopped answering (no heartbeat for {DEAD_AFTER_S:g} s: its host unreachable, or it "
            f"was killed, stopped or hung)")


def host_words(info: Mapping[str, Any]) -> str:
    """" on host NAME (ADDRESS)" from a member's hello info (channel.SyncChannel._info): its
    hostname and the address it reaches the rendezvous from, left out where loopback; "" where
    the hello did not say (an older member)."""
    host, address = info.get("hostname"), info.get("address")
    if not host:
        return ""
    if address and not _loopback(address):
        return f" on host {host} ({address})"
    return f" on host {host}"


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


class _GivenUp(SyncError):
    """Raised in a transfer thread whose update was given up (the supervisor says why)."""


@dataclass
class Session:
    """One member's part of a formed session."""

    record: SessionRecord
    store: BoundedStore  # the session's part of the rendezvous store
    pairs: dict[int, Any]  # a two-member process group with each peer connected (trainer: rank 0 in it)
    backend: str
    me: int  # this member's rank in the session
    beat: Beat
    watch: PeerWatch
    address: str  # the rendezvous's, for messages
    timeout_s: float  # the channel's, for messages
    name: Callable[[str, int], str]  # how messages call a member ("inference rank 1", or a job's rank)
    lanes: dict[int, handoff.Lane] = field(default_factory=dict)  # same-host peers: no process group
    segment: Any = None  # a trainer's: the memory its lanes hand buckets off through
    seq: int = 0  # the next update's number
    issued: dict[int, list[Any]] = field(default_factory=dict)  # the last data step's works, by peer
    into_model: list[Any] = field(default_factory=list)  # its receives straight into the model
    unfinished: bool = False  # set by end(): some transfer had not ended (its buffer may still be written)

    def who(self, member: int | None = None) -> str:
        """A member (by default this one) as messages name it."""
        return self.name(*self.record.member(self.me if member is None else member))

    def where(self, member: int) -> str:
        """Where ``member`` runs, as its hello said, for a message: " on host NAME (ADDRESS)", the
        address it reaches the rendezvous from (left out where it is loopback); "" where unknown."""
        return host_words(self.record.infos.get(rendezvous.member_key(*self.record.member(member)), {}))

    def named(self, member: int) -> str:
        """``member`` as a message about losing it names it: with its host ("inference rank 1 on
        host infer-b (10.77.3.2)"), the one thing that tells a lost host from a lost process."""
        return self.who(member) + self.where(member)

    def current(self, root: Any) -> bool:
        """Whether this member keeps the session for its next update (``root``: the channel's store)."""
        if self.record.member(self.me) == ("trainer", 0):
            return True  # the leader's session lasts until an update fails
        return rendezvous.session_id(root) == self.record.id

    def trainer_gone(self, root: Any) -> str | None:
        """For an inference rank waiting for an update: None while the session stands; "" once
        the leader formed a new one (a trainer restarted: join it); a reason while a trainer
        rank stopped beating (killed, stopped or hung). The session stands then: a stopped
        trainer may resume and push in it, and a restarted one forms a new one."""
        if rendezvous.session_id(root) != self.record.id:
            return ""
        silent = [r for r in self.watch.silent(time.monotonic()) if r < self.record.trainer_size]
        if silent:
            return silence(", ".join(self.named(r) for r in silent)) + rendezvous.cut_off(self.address)
        return None

    # -- the steps of an update ----------------------------------------------------------------
    @property
    def leader(self) -> bool:
        return self.me == LEADER

    def key(self, what: str, member: int | None = None) -> str:
        return f"u/{self.seq}/{what}" + ("" if member is None else f"/{member}")

    def put(self, what: str, value: Any) -> None:
        """Post this member's answer to step ``what`` of this update."""
        rendezvous.put(self.store, self.key(what, self.me), value)

    def collect(self, what: str, deadline: float, members: Iterable[int] | None = None) -> list[Any]:
        """The value for ``what`` in this update of each of ``members`` (session ranks; by default
        every member), in that order. The leader's, and a member's of its peers' only: a member
        that read every member's would make the store's traffic quadratic in the members."""
        ranks = list(range(self.record.world_size) if members is None else members)
        keys = [self.key(what, r) for r in ranks]
        backoff = rendezvous.Backoff()
        while keys and not self._check(keys):
            reason = self._interruption()
            if reason is None and time.monotonic() > deadline:
                late = [self.named(r) for r, k in zip(ranks, keys) if not self.store.check([k])]
                reason = f"{', '.join(late)} did not reach the {what} step within {self.timeout_s:.0f} s"
            if reason is not None:
                raise SyncError(self.fail(reason))
            backoff.pause()
        return [rendezvous.get(self.store, k) for k in keys]

    def announce(self, what: str, value: Any) -> None:
        """The leader's: post step ``what``'s verdict of this update, for every other member."""
        rendezvous.put(self.store, self.key(what), value)

    def await_posted(self, what: str, deadline: float) -> Any:
        """Wait for the leader's verdict of step ``what`` of this update (or an abort, a silent
        peer or leader, the deadline)."""
        key = self.key(what)
        backoff = rendezvous.Backoff()
        while not self._check([key]):
            reason = self._interruption()
            if reason is None and time.monotonic() > deadline:
                # The leader names what it waited for, if it waited: its reason, posted, wins.
                reason = (f"{self.named(LEADER)} did not post the {what} step of the update within "
                          f"{self.timeout_s:.0f} s")
            if reason is not None:
                raise SyncError(self.fail(reason))
            backoff.pause()
        return rendezvous.get(self.store, key)

    def _check(self, keys: list[str]) -> bool:
        try:
            return self.store.check(keys)
        except StoreLost as exc:
            raise SyncError(f"{self.who()}: {exc}") from None

    def _interruption(self) -> str | None:
        abort = self.key("abort")
        try:
            if self.store.check([abort]):
                return rendezvous.get(self.store, abort)
            silent = self.watch.silent(time.monotonic())
            left = [r for r in silent if self.store.check([f"left/{r}"])]
        except StoreLost as exc:
            return str(exc)
        if left:  # its heartbeat stopped because it closed the channel: it did not die
            return f"{', '.join(self.who(r) for r in left)} left the channel (closed it) during the update"
        if silent:
            return silence(", ".join(self.named(r) for r in silent)) + rendezvous.cut_off(self.address)
        return None

    def finish(self, deadline: float, serving: bool) -> None:
        """The update's last step: every member posts that its part is done; the leader waits for
        every other's and posts that the update is complete, which the others wait for. Then each member says it saw that,
        and the process serving the store (``serving``) waits for those, so that it never returns
        (and perhaps exits, taking the store with it) while a member still has to learn that the
        update completed: "done" is done on both sides. A member that went silent or left is not
        waited for; after the deadline nobody is.

        The serving process returns only if every other member said it saw the update complete:
        one that did not (it went silent, or it gave the update up, rolled back, while this
        process was stopped and its store did not answer) may hold the previous version, so the
        update fails here too, and a trainer never reports a version some receiver rolled back."""
        self.put("done", None)
        if self.leader:  # the leader reads every member's "done" and says once that all are
            self.collect("done", deadline)
            self.announce("complete", True)
        else:
            self.await_posted("complete", deadline)
        if not serving:
            try:
                self.put("seen", None)
            except SyncError:
                pass  # the update is complete here; a store gone now changes nothing for this member
            return
        keys = {r: self.key("seen", r) for r in range(self.record.world_size) if r != self.me}
        others = dict(keys)
        backoff = rendezvous.Backoff()
        try:
            while others and not self.store.check(list(others.values())) and time.monotonic() < deadline:
                gone = self.watch.silent(time.monotonic())  # killed (or left) since it posted "done"
                others = {r: k for r, k in others.items() if r not in gone}
                backoff.pause()
            unconfirmed = [r for r, k in keys.items() if not self.store.check([k])]
        except StoreLost:
            return  # this process serves the store: it fails only while it closes
        if unconfirmed:
            names = ", ".join(self.who(r) for r in unconfirmed)
            raise SyncError(self.fail(
                f"{names} did not say within {self.timeout_s:.0f} s that it saw the update complete (it "
                f"stopped, died or gave the update up after posting its part done), so it may still hold "
                f"the previous version"))

    def aborted(self) -> bool:
        """Whether this update's abort was posted (False where the store does not answer)."""
        try:
            return self.store.check([self.key("abort")])
        except StoreLost:
            return False

    def fail(self, reason: str) -> str:
        """Post ``reason`` as this update's abort (the first one posted wins) and return it."""
        abort = self.key("abort")
        try:
            if not self.store.check([abort]):
                rendezvous.put(self.store, abort, f"{self.who()}: {reason}")
            return rendezvous.get(self.store, abort)
        except Exception:  # noqa: BLE001 - the store itself is gone: our own reason stands
            return f"{self.who()}: {reason}"

    # -- the data step ------------------------------------------------------------------------
    def supervise(self, work: Callable[[threading.Event], Any], deadline: float) -> Any:
        """Run ``work(cancelled)`` in a thread while watching for an abort, a silent member and
        the deadline; raise SyncError (posting the reason) on any of them."""
        cancelled = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["result"] = work(cancelled)
            except BaseException as exc:  # noqa: BLE001 - handed to the supervising thread
                box["error"] = exc

        self.issued = {}
        thread = threading.Thread(target=run, name="distload-sync-transfer", daemon=True)
        thread.start()
        while True:
            thread.join(rendezvous.POLL_S)
            if not thread.is_alive():
                break
            reason = self._interruption()
            if reason is None and time.monotonic() > deadline:
                reason = f"the data did not move within {self.timeout_s:.0f} s{self._pending()}"
            if reason is not None:
                cancelled.set()
                # Its waits poll ``cancelled``: it ends within one copy, and after that nothing
                # of this update is written anywhere.
                thread.join()
                raise SyncError(self.fail(reason))
        if "error" in box:
            error = box.pop("error")
            text = str(error) if isinstance(error, SyncError) else f"{type(error).__name__}: {short(error)}"
            # Its traceback holds the thread's frames and their pending transfers: let them go
            # now, before the session's group is released.
            error.__traceback__ = None
            del error
            raise SyncError(self.fail(text))
        return box["result"]

    def _pending(self) -> str:
        """For a data step past its deadline: the peers whose transfers with this member had not
        ended, with their hosts (a slow or cut link between them), as a clause; "" where none."""
        issued = list(self.issued.items())  # the transfer thread may be adding to it: a copy, at once
        peers = [p for p, works in issued if any(not w.is_completed() for w in list(works))]
        if not peers:
            return ""
        return (f" (bytes still moving between {self.named(self.me)} and "
                f"{', '.join(self.named(p) for p in sorted(peers))}: a link between them slow or cut)")

    def post(self, peer: int, tensor: torch.Tensor, send: bool | None = None) -> Any:
        """Start moving ``tensor`` between this member and ``peer`` (a broadcast in their pair
        group, from the one that sends): ``send`` (default: whether this member is a trainer
        rank) sends it, else it is received; an inference rank sends only what it passes on along
        a relay chain (pairing.relay). To a same-host peer (:meth:`maps`) a trainer sends only
        what lies in :meth:`staging`."""
        if send is None:
            send = self.me < self.record.trainer_size
        lane = self.lanes.get(peer)
        if lane is not None:
            work = lane.post(tensor)
            self.issued.setdefault(peer, []).append(work)
            return work
        options = dist.BroadcastOptions()
        # The pair's group ranks: the lower session rank is 0 (connect)
        options.rootRank = int((self.me > peer) == send)
        try:
            work = self.pairs[peer].broadcast([tensor], options)
        except Exception as exc:  # noqa: BLE001 - a closed connection fails at once
            verb = "sending to" if send else "receiving from"
            raise SyncError(f"{verb} {self.named(peer)} failed: {short(exc)}") from None
        self.issued.setdefault(peer, []).append(work)
        return work

    def connect(self, peers: Iterable[int], cancelled: threading.Event, deadline: float) -> None:
        """Make the pairs with ``peers`` (session ranks this member moves bytes with in this
        update) that this session lacks; from then on their heartbeats are watched too. Called in
        the transfer thread, so a given-up update stops it between two connects or within one.

        A pair's group ranks are its members' session ranks in order (a trainer rank, then an
        inference rank; two inference ranks of a relay chain, the lower first). Every member
        connects its pairs in that order of pairs, (lower, higher) ascending, so no two wait on
        each other: the lowest pair anyone waits on has both members at it. Each connect runs on a
        thread of its own: it goes through the store, whose server may have stopped answering
        (SIGSTOP), and nothing in torch bounds that."""
        missing = sorted((p for p in peers if p not in self.pairs and p not in self.lanes),
                         key=lambda p: (min(p, self.me), max(p, self.me)))
        self.watch.add([p for p in peers if p != self.me])
        for peer in missing:
            pair = (min(self.me, peer), max(self.me, peer))
            self.pairs[peer] = _within_unless(
                cancelled, deadline, f"connecting to {self.who(peer)}",
                lambda: f"{self.named(peer)} did not connect within {self.timeout_s:.0f} s (stopped, or "
                        f"{self.store.serving}, which serves the store, stopped{rendezvous.pair_hint(self.address)})",
                rendezvous.process_group, dist.PrefixStore(f"pg/{pair[0]}-{pair[1]}/", self.store.raw),
                int(self.me > peer), 2, self.backend, self.timeout_s, self.address)

    def maps(self, peer: int) -> bool:
        """Whether this member and ``peer`` hand bytes off through memory both map (same host)."""
        return peer in self.lanes

    def staging(self, key: Any, nbytes: int) -> torch.Tensor:
        """A trainer's: ``nbytes`` of its segment, kept for ``key`` (a slot of buckets in flight)
        from update to update: what it writes there, it sends to any same-host peer without a copy."""
        return self.segment.region(key, nbytes)

    def reserve(self, wanted: Mapping[Any, int]) -> None:
        """Size :meth:`staging`'s regions (key -> bytes) at once, before an update's first bucket."""
        if wanted:
            self.segment.reserve(wanted)

    def take(self, peer: int, nbytes: int) -> Any:
        """An inference rank's, from a same-host trainer: receive ``nbytes`` where they lie in the
        trainer's segment; once waited for, the work's ``data`` is them until its ``release()``."""
        work = self.lanes[peer].post(None, nbytes)
        self.issued.setdefault(peer, []).append(work)
        return work

    def transport(self, peers: Iterable[int]) -> str:
        """How bytes move between this member and ``peers``: "socket", "shm", "cuda-ipc", or
        several of them joined by "+"."""
        kinds = {self.lanes[p].kind if p in self.lanes else "socket" for p in peers}
        return "+".join(sorted(kinds)) or "socket"

    def wait(self, work: Any, cancelled: threading.Event, what: Callable[[], str]) -> None:
        """Wait for ``work`` by polling, so that a given-up update's thread can stop at once."""
        pause = 0.00005
        while not work.is_completed():
            if cancelled.is_set():
                raise _GivenUp()
            time.sleep(pause)
            pause = min(0.002, pause * 2)
        # A failed NCCL work is completed too (WorkNCCL::isCompleted: exception() or finished),
        # and wait() without a timeout does not raise it: ask for it first (gloo's wait raises).
        failure = work.exception() if self.backend == "nccl" else None
        if failure is not None:
            raise SyncError(f"{what()} failed: {short(failure)}")
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - the peer died, or the group's timeout passed
            raise SyncError(f"{what()} failed: {short(exc)}") from None

    # -- its end ------------------------------------------------------------------------------
    def end(self) -> list[Any]:
        """Stop this member's heartbeat and release its pairs. Returns the receives into the
        model that have not ended (a given-up update's, whose trainer stopped, not died)."""
        self.beat.stop()
        # A lane's bytes move on the waiting thread, and the transfer thread has ended: whatever
        # has not moved never will. The segment goes with the last process that maps it.
        _close(self.lanes, self.segment)
        self.lanes, self.segment = {}, None
        landing = [work for work in self.into_model if not work.is_completed()]
        self.unfinished = any(not work.is_completed() for works in self.issued.values() for work in works)
        for peer, pair in self.pairs.items():
            if any(not work.is_completed() for work in self.issued.get(peer, ())):
                if self.backend == "nccl":
                    # A given-up NCCL transfer is a kernel spinning on the GPU: it never fails as a
                    # closed gloo connection does; a device-wide synchronize waits behind it, and at
                    # the pair's timeout torch's watchdog would end the process. ncclCommAbort
                    # (ProcessGroupNCCL.abort) ends the kernel; the pair was made not to tear the
                    # process down for it (rendezvous.process_group).
                    pair.abort()
                    landing = []  # every unfinished landing was in an aborted pair (one backend)
                else:
                    # A given-up gloo transfer still waits in this pair's worker thread, until its
                    # peer goes or the group's timeout passes; destroying the group would wait with
                    # it. Kept until then (keep_given_up), not for the life of the process.
                    keep_given_up(pair, self.issued.get(peer, ()))
        # Destroying the others closes their connections: a peer still waiting on this member
        # gets an error at once.
        self.pairs, self.issued = {}, {}
        return landing


class _Beating:
    """A store as a heartbeat uses it: while its server does not answer (stopped, and it may
    resume) a beat is skipped, not the last one; once the server is gone the beat ends."""

    def __init__(self, store: BoundedStore):
        self.store = store

    def add(self, key: str, amount: int) -> int:
        try:
            return self.store.add(key, amount)
        except StoreLost as exc:
            if exc.stalled:
                return 0
            raise

    def check(self, keys: list[str]) -> bool:
        try:
            return self.store.check(keys)
        except StoreLost as exc:
            if exc.stalled:
                return False
            raise


def session_backend(infos: Iterable[Mapping[str, Any]]) -> str:
    """The pairs' backend: NCCL where every member is on a GPU of its own, else gloo (buckets
    through the host). NCCL refuses two ranks of one communicator on one GPU (init.cc:
    "Duplicate GPU detected", ncclInvalidUsage): co-located trainer and inference processes,
    or two jobs on a one-GPU machine. Members post their GPU's UUID (``gpu_identity``)."""
    infos = list(infos)
    if not infos or any(info["device"] != "cuda" for info in infos):
        return "gloo"
    gpus = [info.get("gpu") for info in infos]
    return "nccl" if None not in gpus and len(set(gpus)) == len(gpus) else "gloo"


def gpu_identity(device: torch.device) -> str | None:
    """The physical GPU behind ``device`` (its UUID: the same whatever CUDA_VISIBLE_DEVICES
    numbers it), None off CUDA."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def join(root: BoundedStore, role: str, rank: int, size: int, info: Mapping[str, Any], deadline: float, *,
         address: str, timeout_s: float, name: Callable[[str, int], str],
         device: torch.device = torch.device("cpu"), serving: bool = False) -> Session:
    """Form a new session with this member (``role`` rank ``rank`` of ``size``; ``info``: what it
    keeps, its device type, its host unless it forces the socket path; ``device``: its tensors')
    over ``root``, the channel's store. ``serving``: this process serves the store (it waits for
    every member to say it saw an update complete, so it watches every member's heartbeat)."""
    release_given_up()
    nonce = rendezvous.post_hello(root, role, rank, size, info)
    if role == "trainer" and rank == 0:
        record = rendezvous.form_session(root, size, rendezvous.Hello(nonce, size, info), deadline, address)
    else:
        record = rendezvous.await_session(root, role, rank, nonce, deadline, address)
    me = record.channel_rank(role, rank)
    store = root.prefixed(f"s/{record.id}/")
    backend = session_backend(record.infos.values())
    beat = Beat(_Beating(store), me, until=lambda: _Beating(root).check([rendezvous.CLOSING]))
    peers = range(record.trainer_size, record.world_size) if role == "trainer" else range(record.trainer_size)
    lanes: dict[int, handoff.Lane] = {}
    segment = None
    try:
        # Same-host peers (every member decides them alike): no process group for them, ever.
        lanes, segment = handoff.form(store, record, me, peers, backend, device, deadline,
                                      lambda r: name(*record.member(r)))
    except BaseException as exc:
        beat.stop()
        _close(lanes, segment)
        if not isinstance(exc, Exception):
            raise
        raise SyncError(f"{name(role, rank)}: the sync session at {address} did not come together (a member "
                        f"died while joining, or the timeout passed): {short(exc)}") from None
    # The leader (and the process serving the store) watch every member; any other member the
    # leader, and its peers once it has them (connect).
    watched = ([r for r in range(record.world_size) if r != me] if me == LEADER or serving
               else [LEADER] + [p for p in lanes])
    return Session(record, store, {}, backend, me, beat, _Watch(store, watched, DEAD_AFTER_S), address,
                   timeout_s, name, lanes, segment)


def _close(lanes: Mapping[int, handoff.Lane], segment: Any) -> None:
    """Close this member's lanes and its segment (a trainer's): what has not moved never will."""
    for lane in lanes.values():
        lane.close()
    if segment is not None:
        segment.close()


def leave(root: Any, session: Session | None, serving: bool) -> None:
    """Leave the channel's store ``root`` (``session``: the one this member was in, already
    ended). A member says it left; the process serving the store first tells the members (their
    heartbeats stop, a waiting receive raises) and gives them CLOSE_WAIT_S to leave."""
    try:
        if not serving:
            if session is not None:
                session.store.set(f"left/{session.me}", b"1")
            return
        root.set(rendezvous.CLOSING, b"1")
        if session is not None:
            keys = [f"left/{r}" for r in range(session.record.world_size) if r != session.me]
            deadline = time.monotonic() + rendezvous.CLOSE_WAIT_S
            while keys and not session.store.check(keys) and time.monotonic() < deadline:
                time.sleep(rendezvous.POLL_S)
    except Exception:  # noqa: BLE001 - the store is already gone: nothing to tell anyone
        pass


class _Watch(PeerWatch):
    """A PeerWatch whose ranks grow as the member connects to peers."""

    def add(self, ranks: Iterable[int]) -> None:
        self._ranks += [r for r in ranks if r not in self._ranks]


def _within_unless(cancelled: threading.Event, deadline: float, what: str, late: Callable[[], str], fn: Any,
                   *args: Any) -> Any:
    """``fn(*args)`` (``what`` it does, for its failure) on a thread of its own, waited for until
    ``deadline`` (SyncError ``late()``) or ``cancelled`` (_GivenUp); a thread given up on is left
    to end on its own."""
    done = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = exc
        done.set()

    threading.Thread(target=run, name="distload-sync-connect", daemon=True).start()
    while not done.wait(0.01):
        if cancelled.is_set():
            raise _GivenUp()
        if time.monotonic() > deadline:
            raise SyncError(late())
    if "error" in box:
        raise SyncError(f"{what} failed: {short(box['error'])}")
    return box["result"]


def keep_given_up(pair: Any, works: Iterable[Any]) -> None:
    """Keep a gloo pair of an ended session whose transfers had not ended: a given-up transfer
    waits in its pair's worker thread until the peer goes or the pair's timeout passes, and
    destroying the pair before then would wait with it. It is released once its transfers have
    ended (:func:`release_given_up`, whenever a session ends or forms), not kept for the life of
    the process (at exit those still waiting are left to it: RUNTIME._at_exit)."""
    with RUNTIME.lock:
        RUNTIME.given_up_pairs.append((pair, [w for w in works if not w.is_completed()]))
    release_given_up()


def release_given_up() -> int:
    """Drop the kept pairs whose transfers have all ended; returns how many are still kept."""
    with RUNTIME.lock:
        RUNTIME.given_up_pairs = [(pair, works) for pair, works in RUNTIME.given_up_pairs
                                  if not all(w.is_completed() for w in works)]
        return len(RUNTIME.given_up_pairs)

