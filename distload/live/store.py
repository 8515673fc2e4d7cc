"""The rendezvous store, authenticated: torch's Store API over connections that prove the job secret.

Everything two jobs say to each other before their bytes move (hellos, the session record, each
update's metadata and verdicts, the pairs' process-group addresses, heartbeats) goes through one
key-value store that one process serves. torch's ``TCPStore`` reads and answers anyone who reaches
its port, on every interface. This one:

- listens on the address it is given, not on every interface (:class:`StoreServer`);
- reads nothing from a connection until the peer has proved it knows the job secret: a
  challenge and answer on connect (HMAC-SHA256 over both sides' fresh nonces), both ways, so a
  member never talks to a server that does not know it either;
- then tags every frame in each direction with an HMAC keyed for that connection and counted, so
  a frame injected, replayed or reordered on the wire ends the connection before it is decoded;
- decodes requests with ``struct``: a peer never makes it run code.

:class:`StoreClient` is a ``torch.distributed.Store``: process groups (gloo, NCCL) and
``PrefixStore`` take it as they take a TCPStore. Calls from several threads go out at once on one
connection and are answered by request id, so a gloo ``get`` waiting for a peer's key does not hold
up a heartbeat. Without a secret (loopback only, or ``insecure``) the same handshake runs with a
fixed public key: it proves nothing, and the server's hello says so, so a member that has a secret
refuses such a server.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Any, Iterable

import torch.distributed as dist

from distload.live.secret import HOW, Secret

log = logging.getLogger("distload")

MAGIC = b"DLSTORE1"
NONCE = 32
TAG = 16  # bytes of a frame's HMAC-SHA256 kept
HANDSHAKE_S = 10.0  # a peer that has not proved the secret by then is dropped
UNPROVEN = 16  # one address's connections at once still in their handshake: past it, closed at once
MAX_FRAME = 1 << 30  # a frame's length is read only from an authenticated peer; this bounds mistakes
_PUBLIC_KEY = b"distload store without a secret"  # an HMAC key anyone knows: proves nothing
_NO_SECRET, _HAS_SECRET = 0, 1
_ACCEPTED, _REFUSED = b"\x01", b"\x00"

# requests
SET, GET, ADD, CHECK, WAIT, CAS, DELETE, NUM, MGET, MSET, APPEND, LIST = range(1, 13)
# answers
OK, TIMEOUT, FAILED = 0, 1, 2


class AuthError(ConnectionError):
    """The peer did not prove the job secret (or this process lacks it); the message says which
    and what to set. Never names the secret."""


class NotAStore(ConnectionError):
    """What answered at the address is not a distload store (another program)."""


def _key_of(secret: Secret | None) -> bytes:
    return _PUBLIC_KEY if secret is None else secret.key("store")


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


class _Framed:
    """One authenticated connection: length-prefixed frames, each followed by its tag, keyed
    per direction and counted (the count is in the tag, not on the wire)."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes):
        self.sock = sock
        self._send_key, self._recv_key = send_key, recv_key
        self._sent = self._received = 0
        self._lock = threading.Lock()

    def send(self, payload: bytes) -> None:
        with self._lock:
            tag = hmac.new(self._send_key, struct.pack(">Q", self._sent) + payload, hashlib.sha256).digest()[:TAG]
            self._sent += 1
            self.sock.sendall(struct.pack(">I", len(payload)) + payload + tag)

    def recv(self) -> bytes:
        """The next frame's payload (one reader at a time); ConnectionError on EOF or a bad tag."""
        (length,) = struct.unpack(">I", _read(self.sock, 4))
        if length > MAX_FRAME:
            raise ConnectionError(f"a frame of {length} bytes (at most {MAX_FRAME})")
        payload = _read(self.sock, length)
        tag = _read(self.sock, TAG)
        expected = hmac.new(self._recv_key, struct.pack(">Q", self._received) + payload, hashlib.sha256).digest()
        if not hmac.compare_digest(tag, expected[:TAG]):
            raise ConnectionError("a frame failed its authentication tag (injected or altered on the wire)")
        self._received += 1
        return payload

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _read(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_magic(sock: socket.socket) -> bytes:
    """The peer's first bytes, as long as they are MAGIC's: ValueError at the first that is not
    (another program answered: said at once, not after the timeout)."""
    got = b""
    while len(got) < len(MAGIC):
        chunk = sock.recv(len(MAGIC) - len(got))
        if not chunk:
            raise ConnectionError("the connection closed")
        got += chunk
        if not MAGIC.startswith(got):
            raise ValueError(got)
    return got


def _keys(key: bytes, server_nonce: bytes, client_nonce: bytes) -> tuple[bytes, bytes]:
    """(client -> server, server -> client) frame keys for one connection."""
    return (_mac(key, b"c2s", server_nonce, client_nonce), _mac(key, b"s2c", server_nonce, client_nonce))


def _pack(op: int, req: int, fields: Iterable[bytes]) -> bytes:
    fields = list(fields)
    out = [struct.pack(">BIH", op, req, len(fields))]
    for f in fields:
        out.append(struct.pack(">I", len(f)))
        out.append(f)
    return b"".join(out)


def _unpack(payload: bytes) -> tuple[int, int, list[bytes]]:
    op, req, count = struct.unpack_from(">BIH", payload)
    at, fields = 7, []
    for _ in range(count):
        (n,) = struct.unpack_from(">I", payload, at)
        at += 4
        if at + n > len(payload):
            raise ConnectionError("a malformed frame")
        fields.append(payload[at:at + n])
        at += n
    return op, req, fields


def _int(value: int) -> bytes:
    return struct.pack(">q", value)


def _as_int(data: bytes) -> int:
    return struct.unpack(">q", data)[0]


# -- the server ---------------------------------------------------------------------------------

class StoreServer:
    """Serves a store at ``(host, port)``, that interface only, to peers that prove ``secret``
    (None: the public key, for loopback or an explicit ``insecure``). ``port`` 0 takes a free
    one (``self.port``). ``name`` is how its log lines call it ("the rendezvous at tcp://...")."""

    def __init__(self, host: str, port: int, secret: Secret | None, name: str):
        self._key = _key_of(secret)
        self._has_secret = secret is not None
        self.name = name
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, where = infos[0]
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind(where)
            self._sock.listen(1024)
        except OSError:
            self._sock.close()
            raise
        self.port = self._sock.getsockname()[1]
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._closed = False
        self._conns: set[_Framed] = set()
        self.refused: list[str] = []  # the addresses refused for not proving the secret (last few)
        self._warned: dict[str, float] = {}
        # A stranger opening connections that never speak holds a thread each for HANDSHAKE_S:
        # bounded per address, so that it can neither exhaust the process's threads nor crowd
        # out the members (who connect from other addresses, or prove the secret at once).
        self._unproven: dict[str, int] = {}
        self._unproven_lock = threading.Lock()
        threading.Thread(target=self._accept, name="distload-store-accept", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass
        for conn in list(self._conns):
            conn.close()
        with self._changed:
            self._changed.notify_all()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return
            with self._unproven_lock:
                pending = self._unproven.get(peer[0], 0)
                if pending < UNPROVEN:
                    self._unproven[peer[0]] = pending + 1
            if pending >= UNPROVEN:
                sock.close()
                self._refuse(f"{peer[0]}:{peer[1]}", f"{UNPROVEN} of its connections were already in their handshake")
                continue
            threading.Thread(target=self._serve, args=(sock, peer), name="distload-store-conn", daemon=True).start()

    def _serve(self, sock: socket.socket, peer: Any) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        where = f"{peer[0]}:{peer[1]}"
        try:
            conn = self._handshake(sock, where)
        except (OSError, ConnectionError, struct.error):
            sock.close()
            return
        finally:
            with self._unproven_lock:
                self._unproven[peer[0]] -= 1
                if not self._unproven[peer[0]]:
                    del self._unproven[peer[0]]
        if conn is None:
            return
        self._conns.add(conn)
        try:
            while not self._closed:
                op, req, fields = _unpack(conn.recv())
                self._handle(conn, op, req, fields)
        except (OSError, ConnectionError, struct.error, UnicodeDecodeError) as exc:
            if not self._closed and "closed" not in str(exc):
                log.warning("%s: dropped the connection from %s: %s", self.name, where, exc)
        finally:
            self._conns.discard(conn)
            conn.close()

    def _handshake(self, sock: socket.socket, where: str) -> _Framed | None:
        sock.settimeout(HANDSHAKE_S)
        if _read(sock, len(MAGIC)) != MAGIC:  # the client speaks first: another program is told at once
            sock.close()
            self._refuse(where, "it is not a distload member")
            return None
        nonce = os.urandom(NONCE)
        sock.sendall(MAGIC + bytes([_HAS_SECRET if self._has_secret else _NO_SECRET]) + nonce)
        hello = _read(sock, NONCE + 32)
        theirs, proof = hello[:NONCE], hello[NONCE:]
        if not hmac.compare_digest(proof, _mac(self._key, b"client", nonce, theirs)):
            sock.sendall(_REFUSED)
            sock.close()
            self._refuse(where, "it did not prove the job secret")
            return None
        sock.sendall(_ACCEPTED + _mac(self._key, b"server", theirs, nonce))
        sock.settimeout(None)
        c2s, s2c = _keys(self._key, nonce, theirs)
        return _Framed(sock, s2c, c2s)

    def _refuse(self, where: str, why: str) -> None:
        host = where.rsplit(":", 1)[0]
        self.refused = (self.refused + [f"{host} ({why})"])[-8:]
        now = time.monotonic()
        if now - self._warned.get(host, -1e9) > 60:  # one line per peer a minute: no log flood
            self._warned[host] = now
            log.warning("%s refused a connection from %s: %s", self.name, where, why)

    # -- requests --------------------------------------------------------------------------------
    def _handle(self, conn: _Framed, op: int, req: int, f: list[bytes]) -> None:
        if op in (GET, WAIT, MGET):
            keys = [k.decode() for k in (f[1:] if op != GET else f[:1])]
            timeout_ms = _as_int(f[0] if op != GET else f[1])
            with self._changed:
                if all(k in self._data for k in keys):
                    self._answer(conn, op, req, keys)
                    return
            # Waits for keys another member will set: on a thread of their own, so that this
            # connection's other requests (a heartbeat) are answered meanwhile.
            threading.Thread(target=self._wait_then_answer, args=(conn, op, req, keys, timeout_ms),
                             daemon=True).start()
            return
        with self._changed:
            data = self._data
            if op == SET:
                data[f[0].decode()] = f[1]
                out = []
            elif op == ADD:
                key = f[0].decode()
                value = (int(data[key]) if key in data else 0) + _as_int(f[1])
                data[key] = str(value).encode()
                out = [_int(value)]
            elif op == CHECK:
                out = [b"\x01" if all(k.decode() in data for k in f) else b"\x00"]
            elif op == CAS:
                key = f[0].decode()
                current = data.get(key)
                if (current is None and f[1] == b"") or current == f[1]:
                    data[key] = f[2]
                    current = f[2]
                out = [current if current is not None else f[1]]
            elif op == DELETE:
                out = [b"\x01" if data.pop(f[0].decode(), None) is not None else b"\x00"]
            elif op == NUM:
                out = [_int(len(data))]
            elif op == MSET:
                for k, v in zip(f[0::2], f[1::2]):
                    data[k.decode()] = v
                out = []
            elif op == APPEND:
                key = f[0].decode()
                data[key] = data.get(key, b"") + f[1]
                out = []
            elif op == LIST:
                out = [k.encode() for k in data]
            else:
                conn.send(_pack(FAILED, req, [f"unknown request {op}".encode()]))
                return
            if op in (SET, ADD, CAS, MSET, APPEND):
                self._changed.notify_all()
        conn.send(_pack(OK, req, out))

    def _answer(self, conn: _Framed, op: int, req: int, keys: list[str]) -> None:
        out = [] if op == WAIT else [self._data[k] for k in keys]
        conn.send(_pack(OK, req, out))

    def _wait_then_answer(self, conn: _Framed, op: int, req: int, keys: list[str], timeout_ms: int) -> None:
        deadline = time.monotonic() + timeout_ms / 1000
        with self._changed:
            while not all(k in self._data for k in keys):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    break
                self._changed.wait(left)
            ready = all(k in self._data for k in keys)
            out = None if not ready else ([] if op == WAIT else [self._data[k] for k in keys])
        try:
            conn.send(_pack(OK, req, out) if out is not None else
                      _pack(TIMEOUT, req, [", ".join(k for k in keys if k not in self._data).encode()]))
        except OSError:
            pass


# -- the client ---------------------------------------------------------------------------------

class _Pending:
    __slots__ = ("done", "status", "fields")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.status = FAILED
        self.fields: list[bytes] = []


class StoreClient(dist.Store):
    """A ``torch.distributed.Store`` at ``(host, port)``, reached within ``connect_s`` and
    authenticated both ways (``secret``: see the module's docstring). ``where`` names the server
    in messages (``tcp://HOST:PORT``). Raises :class:`AuthError` when either side does not prove
    the secret, ConnectionError when nothing answers as a distload store."""

    def __init__(self, host: str, port: int, secret: Secret | None, timeout: timedelta, connect_s: float,
                 where: str):
        super().__init__()
        self.set_timeout(timeout)
        self.where = where
        self._conn = _connect(host, port, secret, connect_s, where)
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._next = 0
        self.lost: BaseException | None = None
        threading.Thread(target=self._read, name="distload-store-client", daemon=True).start()

    def close(self) -> None:
        self.lost = self.lost or dist.DistNetworkError(f"this process closed its connection to {self.where}")
        self._conn.close()

    def _read(self) -> None:
        try:
            while True:
                status, req, fields = _unpack(self._conn.recv())
                with self._lock:
                    pending = self._pending.pop(req, None)
                if pending is not None:
                    pending.status, pending.fields = status, fields
                    pending.done.set()
        except (OSError, ConnectionError, struct.error) as exc:
            self.lost = self.lost or dist.DistNetworkError(f"lost the connection to the store at {self.where} ({exc})")
        with self._lock:
            pending_all, self._pending = list(self._pending.values()), {}
        for pending in pending_all:
            pending.done.set()

    def _call(self, op: int, fields: list[bytes], wait_s: float | None = None) -> list[bytes]:
        pending = _Pending()
        with self._lock:
            if self.lost is not None:
                raise self.lost
            req, self._next = self._next, (self._next + 1) & 0xFFFFFFFF
            self._pending[req] = pending
        try:
            self._conn.send(_pack(op, req, fields))
        except OSError as exc:
            self.lost = self.lost or dist.DistNetworkError(f"lost the connection to the store at {self.where} ({exc})")
            raise self.lost from None
        # A wait's own timeout is the server's; a second more here covers the round trip.
        limit = None if wait_s is None else wait_s + 5.0
        if not pending.done.wait(limit):
            raise dist.DistStoreError(f"the store at {self.where} did not answer within {limit:.0f} s")
        if pending.status == OK:
            return pending.fields
        if pending.status == TIMEOUT:
            raise dist.DistStoreError(f"wait timeout: keys {pending.fields[0].decode()} not set in the store at "
                                      f"{self.where} within {wait_s:.0f} s")
        if self.lost is not None and not pending.fields:
            raise self.lost
        raise dist.DistStoreError(pending.fields[0].decode() if pending.fields else "the store failed the request")

    def _timeout_s(self, timeout: timedelta | None = None) -> float:
        return (self.timeout if timeout is None else timeout).total_seconds()

    # -- torch.distributed.Store ----------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        self._call(SET, [key.encode(), _bytes(value)])

    def get(self, key: str) -> bytes:
        wait_s = self._timeout_s()
        return self._call(GET, [key.encode(), _int(int(wait_s * 1000))], wait_s)[0]

    def add(self, key: str, amount: int) -> int:
        return _as_int(self._call(ADD, [key.encode(), _int(int(amount))])[0])

    def check(self, keys: list[str]) -> bool:
        return self._call(CHECK, [k.encode() for k in keys])[0] == b"\x01"

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        wait_s = self._timeout_s(timeout)
        self._call(WAIT, [_int(int(wait_s * 1000))] + [k.encode() for k in keys], wait_s)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call(CAS, [key.encode(), _bytes(expected), _bytes(desired)])[0]

    def delete_key(self, key: str) -> bool:
        return self._call(DELETE, [key.encode()])[0] == b"\x01"

    def num_keys(self) -> int:
        return _as_int(self._call(NUM, [])[0])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        wait_s = self._timeout_s()
        return self._call(MGET, [_int(int(wait_s * 1000))] + [k.encode() for k in keys], wait_s)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        fields: list[bytes] = []
        for k, v in zip(keys, values):
            fields += [k.encode(), _bytes(v)]
        self._call(MSET, fields)

    def append(self, key: str, value: Any) -> None:
        self._call(APPEND, [key.encode(), _bytes(value)])

    def list_keys(self) -> list[str]:
        return [k.decode() for k in self._call(LIST, [])]

    def has_extended_api(self) -> bool:
        return True


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    return bytes(value)  # torch hands a list of ints (std::vector<uint8_t>)


def _connect(host: str, port: int, secret: Secret | None, connect_s: float, where: str) -> _Framed:
    sock = socket.create_connection((host, port), timeout=max(0.1, connect_s))
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(MAGIC)
        try:
            hello = _read_magic(sock) + _read(sock, 1 + NONCE)
        except (socket.timeout, TimeoutError):
            # the caller names it (rendezvous.open_store): a stopped server or another program
            raise TimeoutError(f"nothing answered the handshake at {where}") from None
        except ValueError:
            hello = b""
        if hello[:len(MAGIC)] != MAGIC:
            raise NotAStore(f"the program at {where} is not a distload sync rendezvous (it answered the handshake "
                            f"with something else): another program holds the port, or the other side runs a "
                            f"distload older than this one; point both jobs at a free port")
        server_has_secret = hello[len(MAGIC)] == _HAS_SECRET
        if secret is not None and not server_has_secret:
            raise AuthError(f"the rendezvous at {where} runs without the job secret and this process has one: "
                            f"it refuses to trust it (anyone could have started it); {HOW}")
        key = _key_of(secret)
        theirs = hello[len(MAGIC) + 1:]
        nonce = os.urandom(NONCE)
        sock.sendall(nonce + _mac(key, b"client", theirs, nonce))
        answer = _read(sock, 1)
        if answer != _ACCEPTED:
            if secret is None:
                raise AuthError(f"the rendezvous at {where} requires the job secret and this process has none: "
                                f"{HOW}")
            raise AuthError(f"the rendezvous at {where} refused this process's job secret ({secret.origin}): it "
                            f"differs from the one the other side was started with; {HOW}")
        proof = _read(sock, 32)
        if not hmac.compare_digest(proof, _mac(key, b"server", nonce, theirs)):
            raise AuthError(f"the rendezvous at {where} could not prove it knows the job secret: it is not the "
                            f"job's (another program took the address?); {HOW}")
        sock.settimeout(None)
        c2s, s2c = _keys(key, theirs, nonce)
        return _Framed(sock, c2s, s2c)
    except BaseException:
        sock.close()
        raise


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one (127/8, ::1)."""
    import ipaddress

    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


