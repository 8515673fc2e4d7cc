"""Where two jobs meet for weight sync: a TCP store, and the sessions formed in it.

One process (rank 0 of the hosting side, the trainer by default) serves a ``TCPStore`` at the
channel's address; every other member connects to it. Neither job's default group is touched.

Members come and go (a trainer restarts, an inference job is replaced), so the members of one
working group are a *session*, formed afresh after every failure:

1. each member posts a hello under its role and rank, with a new random nonce, its job's size and
   what it keeps (tensor-parallel size, sharding spec, device);
2. the leader (trainer rank 0) waits for a fresh hello from every member: a nonce the previous
   session did not list, so a dead process's stale hello never counts, then writes the session
   record: an id and every member's nonce;
3. a member whose nonce the record lists is in; each builds the session's process group (gloo, or
   NCCL where every member is on CUDA) on the session's part of the store.

While the leader forms a session, the record says so (``id`` None): a member idle in an older
session sees that its session is over and joins again. Every wait has a deadline and names what
it waited for.
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import socket
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Mapping

import torch.distributed as dist

from distload.errors import ConfigError, SyncError
from distload.runtime import RUNTIME
from distload.workers.group import NCCL_CLEANUP_ONLY

ROLES = ("trainer", "inference")
_SESSION = "session"  # the record: every member's nonce and what it keeps (grows with the members)
# A few bytes beside it, written after it: (the current session's id or None, whether forming it
# failed, a token new with every post). Members poll this one, and read the record only when it
# changes: polling the record itself would cost every member the whole record per poll, quadratic
# in the members. The token: two failed formations in a row post the same id and flag, and a
# member that missed the post between them must still read the second's record (its reason).
_SESSION_ID = "session/id"
POLL_S = 0.02  # the longest pause between two looks at the store
ANSWER_S = 5.0  # a store call unanswered this long: the process serving the store is stopped or hung


class StoreLost(SyncError):
    """A call to the channel's store failed (its server died or closed it) or went unanswered
    for ANSWER_S (``stalled``: its server is stopped or hung, and may resume)."""

    def __init__(self, message: str, stalled: bool):
        super().__init__(message)
        self.stalled = stalled


class _Job:
    def __init__(self, fn: Any, args: tuple):
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class _Caller:
    """Makes one store connection's calls on a thread of its own, so that whoever asks can stop
    waiting. A TCPStore call to a server that stopped (SIGSTOP) or hangs blocks in recv for good:
    torch's store timeout bounds only the wait for a key, not a reply. And torch's client makes
    one call at a time, so one unanswered call holds up every later one: while it is unanswered,
    the next calls fail at once (``stalled``). When it is answered (the server resumed) or fails
    (the server died), calls go through again."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.stalled = False
        self.closed = False
        self.lost: BaseException | None = None  # the connection's failure, once its server is gone
        threading.Thread(target=self._run, name="distload-store", daemon=True).start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job.result = job.fn(*job.args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                job.error = exc
            job.done.set()
            self.stalled = False
            del job

    def call(self, fn: Any, args: tuple, answer_s: float) -> tuple[bool, Any]:
        """(True, result), (False, the exception it raised); raises TimeoutError unanswered."""
        if self.closed:
            return False, RuntimeError("this member closed its connection to the store")
        if self.lost is not None:
            return False, self.lost
        if self.stalled:
            raise TimeoutError
        job = _Job(fn, args)
        self._jobs.put(job)
        if not job.done.wait(answer_s):
            self.stalled = True
            raise TimeoutError
        return (True, job.result) if job.error is None else (False, job.error)

    def close(self) -> None:
        self.closed = True
        self._jobs.put(None)


class BoundedStore:
    """A store whose every call answers within ANSWER_S or raises StoreLost, naming the member
    that serves it. ``raw`` is the torch store (for process groups, heartbeats, prefixes)."""

    def __init__(self, raw: Any, address: str, server: str, caller: _Caller | None = None):
        self.raw = raw
        self.address = address
        self.server = server  # how messages name the process serving it ("trainer rank 0")
        self._caller = caller or _Caller()

    def prefixed(self, prefix: str) -> "BoundedStore":
        """This store's keys under ``prefix``, over the same connection."""
        return BoundedStore(dist.PrefixStore(prefix, self.raw), self.address, self.server, self._caller)

    def _call(self, name: str, *args: Any) -> Any:
        try:
            ok, value = self._caller.call(getattr(self.raw, name), args, ANSWER_S)
        except TimeoutError:
            raise StoreLost(f"the rendezvous store at {self.address} has not answered for {ANSWER_S:g} s: "
                            f"{self.server}, which serves it, is stopped (SIGSTOP) or hung", True) from None
        if not ok:
            if isinstance(value, dist.DistNetworkError):
                # Its server is gone: the next calls fail here at once instead of each going to
                # torch's client, which prints a C++ backtrace for every failed call.
                self._caller.lost = value
            raise StoreLost(f"lost the rendezvous store at {self.address} ({self.server}, which served it, died "
                            f"or closed it: {short(value)})", False) from None
        return value

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key, value)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def close(self) -> None:
        """Stop this connection's caller thread (once its last call has ended)."""
        self._caller.close()


def short(exc: BaseException) -> str:
    """A torch exception's first line, without its C++ frames and boilerplate."""
    text = str(exc).split(". This is typically caused")[0].split("\nException raised from")[0]
    return text.split("] ", 1)[-1] if text.startswith("[") else text


class Backoff:
    """Pauses between polls of the store: short at first (an answer that comes at once costs
    well under a millisecond), growing to POLL_S (a long wait costs the store little)."""

    def __init__(self) -> None:
        self._pause = 0.0002

    def pause(self) -> None:
        time.sleep(self._pause)
        self._pause = min(POLL_S, self._pause * 2)


def parse_address(address: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (host, port)."""
    if not isinstance(address, str) or not address.startswith("tcp://"):
        raise ConfigError(f"the sync rendezvous must be tcp://HOST:PORT, got {address!r}")
    host, sep, port = address[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"the sync rendezvous must be tcp://HOST:PORT with a port in 1-65535, got {address!r}")
    return host.strip("[]"), int(port)


def open_store(address: str, serve: bool, timeout_s: float, server: str) -> BoundedStore:
    """The channel's store: served here (``serve``) or reached at ``address`` within the timeout
    (``server``: how messages name the process that serves it)."""
    host, port = parse_address(address)
    timeout = timedelta(seconds=timeout_s)
    if serve:
        try:
            raw = dist.TCPStore(host, port, None, True, timeout, wait_for_workers=False)
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/DistNetworkError
            raise SyncError(f"cannot serve the sync rendezvous at {address}: {short(exc)} (is another process "
                            f"already serving it? each channel needs a port of its own)") from None
        return BoundedStore(raw, address, server)
    deadline = time.monotonic() + timeout_s
    _await_listener(host, port, deadline, address, timeout_s)
    # torch's handshake is not bounded by its timeout: a listener that accepts and never answers
    # (a stopped server, another program) holds it for good. It runs on a thread of its own.
    # torch's own retries overrun the timeout it is given by up to about two seconds.
    wait_s = max(1.0, deadline - time.monotonic())
    try:
        raw = within(wait_s, dist.TCPStore, host, port, None, False, timedelta(seconds=max(0.5, wait_s - 2.0)))
    except TimeoutError:
        raise SyncError(f"something accepts connections at {address} but does not answer as a sync rendezvous "
                        f"store (waited {timeout_s:.0f} s): {server}, which serves it, is stopped (SIGSTOP) or "
                        f"hung, or another program holds the port; check the address") from None
    except Exception as exc:  # noqa: BLE001 - torch raises DistNetworkError/RuntimeError
        if "invalid value returned from server" in str(exc):
            raise SyncError(f"the program at {address} is not a distload sync rendezvous (it answered the store's "
                            f"handshake with something else): another program holds the port; point both jobs at "
                            f"a free port") from None
        raise SyncError(f"the sync rendezvous at {address} accepted a connection but its store did not answer "
                        f"within {timeout_s:.0f} s: {short(exc)}") from None
    return BoundedStore(raw, address, server)


def within(seconds: float, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a thread of its own, waited for up to ``seconds``: TimeoutError if it has
    not ended (the thread is left to end on its own), its exception if it raised."""
    caller = _Caller()
    try:
        ok, value = caller.call(fn, args, seconds)
    finally:
        caller.close()
    if not ok:
        raise value
    return value


def _await_listener(host: str, port: int, deadline: float, address: str, timeout_s: float) -> None:
    """Wait until something accepts connections at host:port: torch's own client first tries for
    the whole timeout and then retries after a random pause, which overruns the deadline."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(1.0, max(0.1, deadline - time.monotonic()))):
                return
        except OSError as exc:
            if time.monotonic() + 0.1 > deadline:
                raise SyncError(f"nobody serves the sync rendezvous at {address} (waited {timeout_s:.0f} s): start "
                                f"the side that hosts it (its rank 0), or check the address and port "
                                f"({exc.strerror or exc})") from None
        time.sleep(0.1)


CLOSING = "closing"  # posted by the process that serves the store before it stops serving
CLOSE_WAIT_S = 5.0  # how long that process waits for the members to leave first


# A value pickled to more than this is stored compressed (zlib, level 1). A trainer rank's metadata
# (tensor names, shapes, buckets) compresses about 11:1 (names repeat per layer and expert), and it
# is the store's largest traffic: each inference rank reads that of every trainer rank that sends
# to it. A pickle (protocol 2 and later) begins with 0x80, zlib's stream with 0x78: get() tells them
# apart by the first byte.
COMPRESS_FROM = 2048


def get(store: Any, key: str) -> Any:
    data = store.get(key)
    return pickle.loads(zlib.decompress(data) if data[:1] == b"\x78" else data)


def put(store: Any, key: str, value: Any) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    store.set(key, zlib.compress(data, 1) if len(data) > COMPRESS_FROM else data)


@dataclass(frozen=True)
class Hello:
    nonce: str
    size: int  # ranks of this member's side
    info: Mapping[str, Any] = field(default_factory=dict)  # what it keeps, its device type


@dataclass(frozen=True)
class SessionRecord:
    id: str
    trainer_size: int
    inference_size: int
    nonces: Mapping[str, str]  # "role/rank" -> nonce
    infos: Mapping[str, Mapping[str, Any]]  # "role/rank" -> Hello.info

    @property
    def world_size(self) -> int:
        return self.trainer_size + self.inference_size

    def channel_rank(self, role: str, rank: int) -> int:
        """Trainer ranks first, then inference ranks: one numbering for the session's group."""
        return rank if role == "trainer" else self.trainer_size + rank

    def member(self, channel_rank: int) -> tuple[str, int]:
        if channel_rank < self.trainer_size:
            return "trainer", channel_rank
        return "inference", channel_rank - self.trainer_size


def member_key(role: str, rank: int) -> str:
    return f"{role}/{rank}"


def describe(role: str, rank: int) -> str:
    return f"{role} rank {rank}"


def _current(store: Any) -> dict[str, Any] | None:
    return get(store, _SESSION) if store.check([_SESSION]) else None


def _post_current(store: Any, value: dict[str, Any]) -> None:
    put(store, _SESSION, value)
    put(store, _SESSION_ID, (value.get("id"), "failed" in value, uuid.uuid4().hex))


def _state(store: Any) -> tuple[str | None, bool, str] | None:
    return get(store, _SESSION_ID) if store.check([_SESSION_ID]) else None


def post_hello(store: Any, role: str, rank: int, size: int, info: Mapping[str, Any]) -> str:
    nonce = uuid.uuid4().hex
    put(store, f"hello/{member_key(role, rank)}", Hello(nonce, size, dict(info)))
    return nonce


def session_id(store: Any) -> str | None:
    """The current session's id; None while the leader forms one (or before any was formed)."""
    state = _state(store)
    return None if state is None else state[0]


def form_session(store: Any, trainer_size: int, leader: Hello, deadline: float, address: str) -> SessionRecord:
    """The leader's side: wait for a fresh hello from every member, then write the record. If it
    cannot, the members whose hellos it read are told why at once (they do not wait their
    timeout for a session that will not come)."""
    previous = _current(store)
    old_nonces = previous.get("nonces", {}) if previous else {}
    _post_current(store, {"id": None, "nonces": old_nonces})
    seen: set[str] = set()
    try:
        return _form(store, trainer_size, leader, deadline, address, set(old_nonces.values()), seen)
    except SyncError as exc:
        _post_current(store, {"id": None, "nonces": old_nonces, "failed": str(exc), "seen": seen})
        raise


def _form(store: Any, trainer_size: int, leader: Hello, deadline: float, address: str, stale: set[str],
          seen: set[str]) -> SessionRecord:
    hellos: dict[str, Hello] = {member_key("trainer", 0): leader}
    inference_size: int | None = None
    def wanted() -> list[str]:
        keys = [member_key("trainer", r) for r in range(1, trainer_size)]
        return keys + ([member_key("inference", 0)] if inference_size is None
                       else [member_key("inference", r) for r in range(inference_size)])

    while True:
        for key in wanted():
            if key in hellos or not store.check([f"hello/{key}"]):
                continue
            hello = get(store, f"hello/{key}")
            if hello.nonce in stale:
                continue
            seen.add(hello.nonce)
            role = key.split("/")[0]
            expected = trainer_size if role == "trainer" else inference_size
            if expected is not None and hello.size != expected:
                raise SyncError(f"{describe(*_split(key))} says its job has {hello.size} ranks, but "
                                f"{'trainer rank 0' if role == 'trainer' else 'inference rank 0'} says "
                                f"{expected}: every rank of one side must be started with the same world size")
            hellos[key] = hello
            if key == member_key("inference", 0):
                inference_size = hello.size
        missing = [k for k in wanted() if k not in hellos]
        if inference_size is not None and not missing:
            break
        if time.monotonic() > deadline:
            who = ", ".join(describe(*_split(k)) for k in missing) or "every inference rank"
            raise SyncError(f"{who} did not join the sync channel at {address} in time: start the "
                            f"other job (or its missing ranks), pointed at the same address")
        time.sleep(POLL_S)
    record = SessionRecord(uuid.uuid4().hex, trainer_size, inference_size,
                           {k: h.nonce for k, h in hellos.items()}, _shared_specs({k: h.info for k, h in hellos.items()}))
    _post_current(store, {"id": record.id, "nonces": dict(record.nonces), "record": record})
    return record


def _shared_specs(infos: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The members' infos, each distinct sharding spec one object: pickle writes an object once
    however often it is referred to, so the record (read by every member) holds each spec once,
    not once per inference rank (a spec's JSON is a few KB; 128 of them, read by 384 members,
    would be most of a session's store traffic)."""
    specs: dict[str, Any] = {}
    out = {}
    for key, info in infos.items():
        info = dict(info)
        if info.get("spec") is not None:
            info["spec"] = specs.setdefault(json.dumps(info["spec"], sort_keys=True), info["spec"])
        out[key] = info
    return out


def await_session(store: Any, role: str, rank: int, nonce: str, deadline: float, address: str) -> SessionRecord:
    """A member's side: wait for a session record that lists this member's nonce."""
    key = member_key(role, rank)
    state: Any = ()
    current = None
    while True:
        now = _state(store)
        if now != state:  # the record changed: read it once
            state, current = now, _current(store)
        if current and current.get("id") and current["nonces"].get(key) == nonce:
            return current["record"]
        if current and current.get("failed") and nonce in current.get("seen", ()):
            raise SyncError(f"trainer rank 0 could not form the sync session at {address}: {current['failed']}")
        if time.monotonic() > deadline:
            if current and current.get("id") and key in current["nonces"]:
                pid = current["record"].infos.get(key, {}).get("pid")
                raise SyncError(f"the sync channel at {address} is taken: its current session already has an "
                                f"{describe(role, rank)} (process {pid}), another job's: a channel takes one job "
                                f"per side, so point this job at an address of its own (if that was this rank's "
                                f"previous process, the trainer's next update forms a session with this one)")
            raise SyncError(f"no trainer formed a sync session with {describe(role, rank)} at {address} in "
                            f"time: is the trainer job running, and pointed at this address?")
        time.sleep(POLL_S)


def _split(key: str) -> tuple[str, int]:
    role, rank = key.split("/")
    return role, int(rank)


PAIR_NCCL_ENV = NCCL_CLEANUP_ONLY + (("TORCH_NCCL_DUMP_ON_TIMEOUT", "0"),)


def process_group(store: Any, rank: int, size: int, backend: str, timeout_s: float) -> Any:
    """A process group of the session's members over ``store``, outside torch's default world."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        # Read by the constructor. A failed or timed-out transfer in a pair is this update's
        # failure (SyncError), not the process's (NCCL_CLEANUP_ONLY). No flight-recorder dump
        # either: its signal goes through the store under the pair's, the job's own for
        # WeightSync, and ends every rank of the job (ProcessGroupNCCL's heartbeat monitor).
        with RUNTIME.environment(dict(PAIR_NCCL_ENV), restore_prefix=""):
            return dist.ProcessGroupNCCL(store, rank, size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    options._devices = [dist.ProcessGroupGloo.create_device(interface=interface.split(",")[0]) if interface
                        else dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, size, options)
