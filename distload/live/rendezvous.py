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

import functools
import json
import logging
import os
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Mapping

import torch.distributed as dist

from distload.errors import ConfigError, SyncError
from distload.live import wire
from distload.live.store import AuthError, NotAStore, StoreClient, StoreServer, is_loopback
from distload.runtime import RUNTIME
from distload.live.secret import HOW, Secret
from distload.workers.group import NCCL_CLEANUP_ONLY

log = logging.getLogger("distload")

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
        self.where = ""  # where the process serving the store runs, once a session said (locate)
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

    def __init__(self, raw: Any, address: str, server: str, caller: _Caller | None = None, served: Any = None):
        self.raw = raw
        self.address = address
        self.server = server  # how messages name the process serving it ("trainer rank 0")
        self._caller = caller or _Caller()
        self.served = served  # the StoreServer, where this process serves the store

    def locate(self, where: str) -> None:
        """Say where the process serving the store runs (" on host NAME (ADDRESS)", from its hello),
        for the messages of this store and of every store over its connection."""
        self._caller.where = where

    @property
    def serving(self) -> str:
        """The process serving the store, as messages name it, with its host once known."""
        return self.server + self._caller.where

    def prefixed(self, prefix: str) -> "BoundedStore":
        """This store's keys under ``prefix``, over the same connection."""
        return BoundedStore(dist.PrefixStore(prefix, self.raw), self.address, self.server, self._caller)

    def _call(self, name: str, *args: Any) -> Any:
        try:
            ok, value = self._caller.call(getattr(self.raw, name), args, ANSWER_S)
        except TimeoutError:
            raise StoreLost(f"the rendezvous store at {self.address} has not answered for {ANSWER_S:g} s: "
                            f"{self.serving}, which serves it, is unreachable (its host or this one cut off "
                            f"the network), stopped (SIGSTOP) or hung{cut_off(self.address)}", True) from None
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
        """Stop this connection's caller thread (once its last call has ended); close the
        connection where this store opened it, and stop serving where this process serves it."""
        self._caller.close()
        if isinstance(self.raw, StoreClient):
            self.raw.close()
        if self.served is not None:
            self.served.close()

    def refused(self) -> str:
        """Where this process serves the store: the peers it refused lately, for a message
        that says why a member never came ("" if none)."""
        if self.served is None or not self.served.refused:
            return ""
        return f" (refused meanwhile: {', '.join(self.served.refused)})"


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


def open_store(address: str, serve: bool, timeout_s: float, server: str, secret: Secret | None = None,
               insecure: bool = False) -> BoundedStore:
    """The channel's store (distload/live/store.py): served here (``serve``), on the address's
    interface only, or reached at ``address`` within the timeout (``server``: how messages name
    the process that serves it). Every connection proves ``secret`` (the job's) both ways before
    a value is read. With no secret a store is served on a loopback address only, unless
    ``insecure`` (logged once)."""
    host, port = parse_address(address)
    timeout = timedelta(seconds=timeout_s)
    if serve:
        check_listen(host, address, secret, insecure)
        try:
            served = StoreServer(host, port, secret, f"the sync rendezvous at {address}")
        except OSError as exc:
            raise SyncError(f"cannot serve the sync rendezvous at {address}: {exc.strerror or exc} (is another "
                            f"process already serving it? each channel needs a port of its own; the host must "
                            f"be an address of this machine)") from None
        try:
            raw = StoreClient(host, served.port, secret, timeout, timeout_s, address)
        except BaseException:
            served.close()
            raise
        return BoundedStore(raw, address, server, served=served)
    deadline = time.monotonic() + timeout_s
    while True:
        _await_listener(host, port, deadline, address, timeout_s)
        # The handshake runs on a thread of its own: a listener that accepts and never answers (a
        # stopped server, another program) must not hold this process past its timeout.
        wait_s = max(1.0, deadline - time.monotonic())
        try:
            raw = within(wait_s, StoreClient, host, port, secret, timeout, wait_s, address)
            break
        except (ConnectionRefusedError, ConnectionResetError):
            # What accepted the probe is gone again: a server restarting, or the probe's own
            # connection to itself (a port in the ephemeral range can self-connect while nothing
            # listens). Wait for a listener again, within the same deadline.
            if time.monotonic() + 0.1 > deadline:
                raise SyncError(f"nobody serves the sync rendezvous at {address} (waited {timeout_s:.0f} s): start "
                                f"the side that hosts it (its rank 0), or check the address and port") from None
            time.sleep(0.1)
        except TimeoutError:
            raise SyncError(f"something accepts connections at {address} but does not answer as a sync "
                            f"rendezvous store (waited {timeout_s:.0f} s): {server}, which serves it, is stopped "
                            f"(SIGSTOP) or hung, or another program holds the port; check the address") from None
        except (AuthError, NotAStore) as exc:
            raise SyncError(str(exc)) from None
        except (OSError, ConnectionError) as exc:
            raise SyncError(f"the sync rendezvous at {address} accepted a connection but did not answer as a "
                            f"distload store within {timeout_s:.0f} s: {exc}") from None
    return BoundedStore(raw, address, server)


def check_listen(host: str, address: str, secret: Secret | None, insecure: bool) -> None:
    """Refuse to listen beyond this host without the job secret (unless ``insecure``: warned once)."""
    if secret is not None or is_loopback(host):
        return
    if not insecure:
        raise ConfigError(f"refusing to serve {address} without a job secret: anyone who reaches it could push "
                          f"or take weights; {HOW} (or listen on 127.0.0.1, or pass insecure=True / --insecure "
                          f"on a network only this job's hosts reach)")
    with RUNTIME.lock:
        first = address not in RUNTIME.warned_insecure
        RUNTIME.warned_insecure.add(address)
    if first:
        log.warning("serving %s without a job secret (insecure): anyone who reaches it can push or take "
                    "weights", address)


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


def get(store: Any, key: str) -> Any:
    """The value under ``key`` (distload/live/wire.py: JSON, never pickle)."""
    return wire.decode(store.get(key))


def put(store: Any, key: str, value: Any) -> None:
    store.set(key, wire.encode(value))


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
            refused = store.refused() if isinstance(store, BoundedStore) else ""
            raise SyncError(f"{who} did not join the sync channel at {address} in time: start the "
                            f"other job (or its missing ranks), pointed at the same address{refused}")
        time.sleep(POLL_S)
    record = SessionRecord(uuid.uuid4().hex, trainer_size, inference_size,
                           {k: h.nonce for k, h in hellos.items()}, {k: dict(h.info) for k, h in hellos.items()})
    _post_current(store, {"id": record.id, "nonces": dict(record.nonces), "record": record})
    return record


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


def process_group(store: Any, rank: int, size: int, backend: str, timeout_s: float,
                  address: str | None = None) -> Any:
    """A process group of the session's members over ``store``, outside torch's default world.

    A gloo pair listens on :func:`pair_address` (the local address that routes to the rendezvous
    host of ``address``, ``tcp://HOST:PORT``), unless GLOO_SOCKET_IFNAME names an interface: not
    on whatever this host's name resolves to, which on a Debian-style /etc/hosts is 127.0.1.1,
    where no peer on another host can reach it. A pair that cannot connect fails with one line
    naming the addresses tried and the setting that fixes it."""
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
    local = None if interface else pair_address(address)
    if interface:
        device = dist.ProcessGroupGloo.create_device(interface=interface.split(",")[0])
    elif local is not None:
        device = dist.ProcessGroupGloo.create_device(hostname=local)
    else:  # the job's own store (WeightSync): as torch's default group does
        device = dist.ProcessGroupGloo.create_default_device()
    options._devices = [device]
    try:
        return dist.ProcessGroupGloo(store, rank, size, options)
    except Exception as exc:  # noqa: BLE001 - gloo's connect failed (refused, unreachable, timed out)
        raise SyncError(pair_failure(exc, address, local, interface)) from None


FIX = ("set GLOO_SOCKET_IFNAME to the interface that reaches the other job's hosts, on every member, or "
       "make each host's name resolve to that interface's address in /etc/hosts")


def _rendezvous_host(address: str | None) -> str | None:
    """The host of a ``tcp://HOST:PORT`` address; None for anything else (a job's own store)."""
    if not address:
        return None
    try:
        return parse_address(address)[0]
    except ConfigError:
        return None


def _is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::", "*")


def _route_from(host: str, port: int = 9) -> str:
    """The local address this host's routes send from to reach ``host`` (no packet is sent:
    connecting a UDP socket only looks the route up). Raises OSError without a route."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    last: OSError | None = None
    for family, _, _, _, where in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect(where)
                return probe.getsockname()[0]
            except OSError as exc:
                last = exc
    raise last or OSError(f"no address for {host}")


def _own_address() -> str | None:
    """A serving member on a wildcard address (0.0.0.0): this host's name where it resolves to an
    address of this host that is not loopback, else the source of the default route, else the
    first address of an interface that is up and not loopback; None if there is none."""
    import ipaddress

    try:
        name = socket.gethostbyname(socket.gethostname())
        if not ipaddress.ip_address(name).is_loopback:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.bind((name, 0))  # an address of this host
            return name
    except OSError:
        pass
    try:
        return _route_from("192.0.2.1")  # TEST-NET-1: only the default route reaches it
    except OSError:
        pass
    for _, ifname in socket.if_nameindex():
        found = _interface_address(ifname)
        if found and not ipaddress.ip_address(found).is_loopback:
            return found
    return None


def _interface_address(ifname: str) -> str | None:
    """The IPv4 address of ``ifname`` (Linux: SIOCGIFADDR), None where it has none."""
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except (OSError, ImportError):
        return None


def pair_address(address: str | None) -> str | None:
    """The local address a gloo pair of the channel at ``address`` listens on and connects from:
    the one that routes to the rendezvous host (a loopback rendezvous: loopback, both jobs are on
    this host); on a wildcard host (the serving member of ``tcp://0.0.0.0:PORT``),
    :func:`_own_address`. None where ``address`` is no ``tcp://`` address (a job's own store).
    Raises SyncError, one line, where no route leads to the rendezvous host."""
    host = _rendezvous_host(address)
    if host is None:
        return None
    if _is_wildcard(host):
        found = _own_address()
        if found is None:
            raise SyncError(f"the sync pairs of {address} found no address of this host to listen on (no "
                            f"interface but loopback is up): {FIX}")
        return found
    try:
        return _route_from(host)
    except OSError as exc:
        raise SyncError(f"no route from this host to the sync rendezvous host {host} ({address}: "
                        f"{exc.strerror or exc}), so no pair can listen on the interface that reaches it: "
                        f"{FIX}") from None


def pair_hint(address: str | None) -> str:
    """For a pair that did not connect in time: where this member listened, and the setting that
    fixes a wrong interface ("" where that is not known)."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    try:
        local = None if interface else pair_address(address)
    except SyncError:
        local = None
    where = f"interface {interface} (GLOO_SOCKET_IFNAME)" if interface else local
    if where is None:
        return ""
    return f", or the hosts cannot reach each other: this member listened on {where}; {FIX}"


@functools.lru_cache(maxsize=64)
def _local_address(address: str | None) -> str | None:
    """pair_address, looked up once per address: a failure's message must not wait on a name
    lookup through a network that may be the thing gone."""
    try:
        return pair_address(address)
    except SyncError:
        return None


def cut_off(address: str | None) -> str:
    """For a message about peers or a store gone quiet: where the interface this host reaches the
    rendezvous through has lost its link (no carrier: a pulled cable, its switch port down), a
    clause saying this host is the one cut off; "" where its link is up, or that is not known
    (no ``tcp://`` address, a loopback one, no such interface, not Linux)."""
    import ipaddress

    try:
        local = _local_address(address)
        if local is None or ipaddress.ip_address(local).is_loopback:
            return ""
        names = [n for _, n in socket.if_nameindex() if _interface_address(n) == local]
    except Exception:  # noqa: BLE001 - only for a message: unknown says nothing
        return ""
    for name in names:
        try:
            with open(f"/sys/class/net/{name}/carrier", encoding="ascii") as f:
                carrier = f.read().strip()
        except OSError:  # an interface set down reads EINVAL: no link either
            carrier = "0"
        if carrier == "0":
            return (f"; this host's own link is down ({name}, {local}: no carrier), so this host, "
                    f"{socket.gethostname()}, is the one cut off the network")
    return ""


def pair_failure(exc: BaseException, address: str | None, local: str | None, interface: str | None) -> str:
    """One line for a gloo pair that could not connect: the addresses tried, and what fixes it."""
    import re

    text = (short(exc).splitlines() or [type(exc).__name__])[0][:300]
    remote = re.search(r"remote=([^\s,;)$]+)", str(exc))
    listening = (f"interface {interface} (GLOO_SOCKET_IFNAME)" if interface else
                 f"{local}, the address routing to the rendezvous host {_rendezvous_host(address)}" if local else
                 f"the address this host's name resolves to ({_resolved()})")
    peer = f"; connecting to the peer at {remote.group(1)} failed" if remote else ""
    return (f"the sync pair could not connect: this member listened on {listening}{peer} ({text}); {FIX}")


def _resolved() -> str:
    try:
        return f"{socket.gethostname()} -> {socket.gethostbyname(socket.gethostname())}"
    except OSError as exc:
        return f"{socket.gethostname()}: {exc.strerror or exc}"
