"""What every object store shares: URIs, bounded requests, and errors that say what and where.

A store wraps one SDK client (boto3, google-cloud-storage, azure-storage-blob: the SDKs that
Run:ai's object-store packages already install), built from the same environment variables that
Run:ai's reader reads, with short connect timeouts and few retries, so that distload's own listing
and header reads fail in seconds where an SDK default would retry for minutes.

Every request goes through :meth:`ObjectStore.call`, which turns an SDK exception into an
:class:`ObjectStoreError` naming the URI, the cause (bucket or object missing, access denied, no
credentials, endpoint unreachable) and the endpoint used, with every credential scrubbed out.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import socket
import ssl
import struct
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar

from distload.loading.index import MAX_HEADER_BYTES, FileInfo, parse_header
from distload.errors import BackendUnavailableError, CheckpointError, ConfigError, ObjectStoreError
from distload.runtime import RUNTIME

T = TypeVar("T")

SCHEMES = ("s3", "gs", "az")

# One TCP connect to the endpoint before the first request: an endpoint that is down or wrong
# fails here in seconds, whatever the SDK's (or Run:ai's C++ reader's) own retry policy.
CONNECT_TIMEOUT_S = 5.0
# An endpoint that accepts connections must answer a first request (a TLS handshake and an
# HTTP HEAD, or a proxy's CONNECT) within this: a stalled server fails in seconds, where the
# SDKs' read timeouts and retries would wait minutes (4 x 60 s for boto3).
ANSWER_TIMEOUT_S = 5.0
# Per socket read, not per request: a large ranged read may take longer in total. The
# DISTLOAD_STORE_READ_TIMEOUT variable (seconds) overrides it for distload's own requests and
# for Run:ai's S3 reader (RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS, unless that is set).
READ_TIMEOUT_S = 60.0
READ_TIMEOUT_VARIABLE = "DISTLOAD_STORE_READ_TIMEOUT"
# Total time an SDK may spend retrying one request.
RETRY_DEADLINE_S = 20.0
# The first read of a safetensors file: the 8-byte length and, for most checkpoints, the whole
# header in one request (Llama-3-8B's largest header is ~30 KB); a bigger header takes a second.
HEADER_PROBE_BYTES = 64 * 1024

# Variables whose values are credentials: never shown in a message, whatever an SDK puts in its
# exception text.
SECRET_VARIABLES = (
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_KEY", "AZURE_CLIENT_SECRET",
    "AZURE_STORAGE_CONNECTION_STRING",
)
_SECRET_PATTERNS = [
    re.compile(r"(AccountKey=)[^;\s'\"]+", re.IGNORECASE),
    re.compile(r"(SharedAccessSignature=)[^;\s'\"]+", re.IGNORECASE),
    re.compile(r"([?&;]sig=)[^&;\s'\"]+", re.IGNORECASE),
    re.compile(r"(X-Amz-Signature=)[^&\s'\"]+", re.IGNORECASE),
    re.compile(r"(X-Amz-Security-Token=)[^&\s'\"]+", re.IGNORECASE),
    re.compile(r"(Signature=)[0-9a-fA-F]{16,}"),
]


def scrub(text: str, environ: Mapping[str, str] = os.environ) -> str:
    """``text`` with every credential from the environment (and any signature) replaced."""
    for name in SECRET_VARIABLES:
        value = environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "<redacted>")
            for part in re.findall(r"(?:AccountKey|SharedAccessSignature)=([^;]+)", value, re.IGNORECASE):
                text = text.replace(part, "<redacted>")
    for pattern in _SECRET_PATTERNS:
        text = pattern.sub(r"\1<redacted>", text)
    return text


def first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


@dataclass(frozen=True)
class ObjectURI:
    """``scheme://bucket/key``; ``key`` has no leading or trailing slash ("" for the bucket root)."""

    scheme: str
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}" if self.key else f"{self.scheme}://{self.bucket}"

    def child(self, name: str) -> "ObjectURI":
        return ObjectURI(self.scheme, self.bucket, f"{self.key}/{name}" if self.key else name)

    @property
    def prefix(self) -> str:
        """The listing prefix of this URI taken as a folder."""
        return f"{self.key}/" if self.key else ""


def parse_uri(uri: str) -> ObjectURI:
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ConfigError(f"{uri}: not an object-store URI; use s3://BUCKET/PREFIX, gs://BUCKET/PREFIX "
                          f"or az://CONTAINER/PREFIX")
    bucket, _, key = rest.partition("/")
    key = key.strip("/")
    if not bucket:
        word = "container" if scheme == "az" else "bucket"
        raise ConfigError(f"{uri}: no {word} name; use {scheme}://{word.upper()}/PREFIX")
    if "//" in key:
        raise ConfigError(f"{uri}: empty path segment ('//') in the object key")
    return ObjectURI(scheme, bucket, key)


@dataclass(frozen=True)
class Endpoint:
    """Where requests go, and which setting said so (for messages)."""

    url: str
    origin: str

    def host_port(self) -> tuple[str, int]:
        """Host and port; a malformed setting is a ConfigError naming it (every request goes
        through here first, so nothing later meets a half-parsed URL)."""
        try:
            parsed = urllib.parse.urlsplit(self.url if "://" in self.url else f"http://{self.url}")
            port = parsed.port or (443 if parsed.scheme == "https" else 80)
        except ValueError as exc:
            raise ConfigError(f"the endpoint {self.describe()} is not a valid URL ({exc}); fix that "
                              f"setting") from None
        host = parsed.hostname or ""
        if not host or "" in host.rstrip(".").split("."):
            raise ConfigError(f"the endpoint {self.describe()} has no valid host name; fix that setting")
        return host, port

    def describe(self) -> str:
        return f"{self.url} (from {self.origin})"


@dataclass
class Listing:
    """One level of a prefix: objects (name relative to the prefix -> size) and sub-prefixes."""

    objects: dict[str, int] = field(default_factory=dict)
    folders: list[str] = field(default_factory=list)  # "sub/"
    # Each object's version as the listing gives it (the same string a read or a stat gives:
    # the node cache keys on it), where the store's listing says.
    versions: dict[str, str] = field(default_factory=dict)

    def names(self) -> list[str]:
        return sorted(list(self.objects) + self.folders)


def is_aws_host(host: str) -> bool:
    return host.endswith(".amazonaws.com") or host.endswith(".amazonaws.com.cn")


def _proxy_target(url: str) -> tuple[str, int] | None:
    """The HTTP(S) proxy the SDKs would use for ``url`` (from *_PROXY / NO_PROXY), if any."""
    parsed = urllib.parse.urlsplit(url)
    host = parsed.hostname or ""
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(parsed.scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass_environment(host, proxies):
        return None
    target = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    return target.hostname or "", target.port or 8080


def _connect_address(host: str) -> str:
    # RFC 6761: *.localhost is loopback. curl (inside Run:ai's Azure reader) resolves it so itself;
    # glibc may not, so the probe does the same as the reader.
    if host == "localhost" or host.endswith(".localhost"):
        return "127.0.0.1"
    return host


# How long an endpoint that answered is taken to be up (distload.runtime holds the times).
REACHABLE_CACHE_S = 30.0


def read_timeout() -> float:
    """The per-read timeout of data requests: DISTLOAD_STORE_READ_TIMEOUT, else READ_TIMEOUT_S."""
    text = os.environ.get(READ_TIMEOUT_VARIABLE)
    if text is None or not text.strip():
        return READ_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (0 < value <= 86400):
        raise ConfigError(f"{READ_TIMEOUT_VARIABLE}={text!r}: give the object-store read timeout in seconds, "
                          "a number above 0 and at most 86400 (default 60)")
    return value


def probe_endpoint(endpoint: Endpoint, timeout: float = CONNECT_TIMEOUT_S,
                   answer_timeout: float = ANSWER_TIMEOUT_S) -> str | None:
    """None if the endpoint (or its proxy) accepts a TCP connection within ``timeout`` and then
    answers a first request within ``answer_timeout``; else why not."""
    host, port = endpoint.host_port()
    proxy = _proxy_target(endpoint.url)
    target = proxy or (host, port)
    now = time.monotonic()
    with RUNTIME.lock:
        if RUNTIME.reachable_until.get(target, 0) > now:
            return None
    via = f" (through the proxy {target[0]}:{target[1]})" if proxy else ""
    try:
        connection = socket.create_connection((_connect_address(target[0]), target[1]), timeout=timeout)
    except socket.gaierror as exc:
        return f"cannot resolve the host name {target[0]!r}{via} ({exc.strerror or exc})"
    except ConnectionRefusedError:
        return f"connection refused by {target[0]}:{target[1]}{via}: nothing listens there"
    except (socket.timeout, TimeoutError):
        return f"no answer from {target[0]}:{target[1]}{via} within {timeout:.0f} s"
    except OSError as exc:
        return f"cannot connect to {target[0]}:{target[1]}{via}: {exc.strerror or exc}"
    with connection:
        if not _answers(connection, endpoint, host, port, bool(proxy), answer_timeout):
            return (f"{target[0]}:{target[1]}{via} accepted the connection but sent no answer within "
                    f"{answer_timeout:.0f} s (a stalled or overloaded server, or not an HTTP endpoint)")
    with RUNTIME.lock:
        RUNTIME.reachable_until[target] = time.monotonic() + REACHABLE_CACHE_S
    return None


def _answers(connection: socket.socket, endpoint: Endpoint, host: str, port: int, proxied: bool,
             timeout: float) -> bool:
    """Whether the server says anything within ``timeout`` to the first request a client makes.

    Only silence counts against it: an HTTP error, a closed connection or a failed TLS handshake
    are the SDK's to report, with their own words, on the real request.
    """
    connection.settimeout(timeout)
    try:
        if proxied:  # what an SDK sends a proxy first, for http and https targets alike
            request = f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n"
        else:
            if endpoint.url.startswith("https://"):
                context = ssl.create_default_context()
                context.check_hostname = False  # nothing is sent but a HEAD; the SDK verifies
                context.verify_mode = ssl.CERT_NONE
                connection = context.wrap_socket(connection, server_hostname=host)
            request = f"HEAD / HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n"
        connection.sendall(request.encode("ascii"))
        connection.recv(1)
    except (socket.timeout, TimeoutError):
        return False
    except (OSError, ssl.SSLError, UnicodeError):
        return True
    return True


class ObjectStore:
    """One object store's client and its error vocabulary. Subclasses implement the ``_`` methods
    with their SDK (raising its exceptions) and :meth:`classify`."""

    scheme = ""
    product = ""
    bucket_word = "bucket"
    # What to check when access is denied or no credentials are found.
    credential_hint = ""
    # Environment variables that configure this store: a change makes a new client.
    ENV_KEYS: tuple[str, ...] = ()

    # What the store's SDK and Run:ai reader are, the pip extra that installs them, the modules.
    needs: tuple[str, str, tuple[str, ...]] = ("", "", ())

    def __init__(self) -> None:
        what, extra, modules = self.needs
        for module in modules:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise BackendUnavailableError(
                    f"{self.scheme}:// sources need {what}: pip install 'distload[{extra}]' ({exc})") from None
        self._client_obj: Any = None
        self._client_lock = threading.Lock()

    def _client(self):
        """The SDK client, made on first use (building one costs a credential lookup)."""
        with self._client_lock:
            if self._client_obj is None:
                self._client_obj = self._make_client()
            return self._client_obj

    # -- to implement --------------------------------------------------------------------------
    def _make_client(self) -> Any:
        raise NotImplementedError

    def endpoint(self) -> Endpoint:
        raise NotImplementedError

    def reader_endpoint(self) -> Endpoint:
        """Where Run:ai's C++ reader connects (Azure's differs from the SDK client's)."""
        return self.endpoint()

    def reader_environment(self) -> dict[str, str]:
        """Variables Run:ai's reader needs that the user may have left unset (applied per load)."""
        return {}

    def _list(self, location: ObjectURI, recursive: bool) -> Listing:
        """One level below the prefix (sub-prefixes as folders), or with ``recursive`` every
        object below it (names relative to the prefix, holding ``/``)."""
        raise NotImplementedError

    def _read(self, location: ObjectURI, start: int, end: int) -> bytes:
        raise NotImplementedError

    def _read_version(self, location: ObjectURI, start: int, end: int, version: str) -> tuple[bytes, str | None]:
        """Bytes ``[start, end)`` of the object's version ``version`` (asked as a precondition
        where the store takes one), and the version the answer says it holds (None where the
        store's answer does not say: the caller then asks again)."""
        raise NotImplementedError

    def _read_head(self, location: ObjectURI, nbytes: int) -> tuple[bytes, int, str | None]:
        """The first ``nbytes`` (fewer if the object is shorter), the object's size and version,
        as one request gives them where the store allows (its version is that of those bytes)."""
        size, version = self._stat(location)
        return (self._read(location, 0, min(nbytes, size)) if size else b""), size, version

    def _stat(self, location: ObjectURI) -> tuple[int, str | None]:
        """The object's size and version (a new one whenever the object is written again)."""
        raise NotImplementedError

    def _bucket_exists(self, bucket: str) -> bool:
        raise NotImplementedError

    def classify(self, exc: BaseException) -> tuple[str, str] | None:
        """``(cause, detail)`` for an SDK exception this store understands, else None."""
        raise NotImplementedError

    # -- shared --------------------------------------------------------------------------------
    def check_reachable(self, uri: str, endpoint: Endpoint | None = None) -> None:
        endpoint = endpoint or self.endpoint()
        why = probe_endpoint(endpoint)
        if why:
            raise ObjectStoreError(self.message(uri, "unreachable", why, endpoint), "unreachable")

    def message(self, uri: str, cause: str, detail: str, endpoint: Endpoint | None = None) -> str:
        endpoint = endpoint or self.endpoint()
        where = f"the {self.product} endpoint {endpoint.describe()}"
        location = parse_uri(uri) if "://" in uri else None
        bucket = location.bucket if location else "?"
        if cause == "bucket-missing":
            text = (f"{uri}: the {self.bucket_word} {bucket!r} does not exist at {where}; check the "
                    f"{self.bucket_word} name and the endpoint")
        elif cause == "object-missing":
            text = (f"{uri}: the object does not exist (the {self.bucket_word} {bucket!r} does, at {where}); "
                    f"check the path, or whether the upload finished")
        elif cause == "access-denied":
            text = f"{uri}: access denied by {where} ({detail}); {self.credential_hint}"
        elif cause == "no-credentials":
            text = f"{uri}: no {self.product} credentials found ({detail}); {self.credential_hint}"
        elif cause == "unreachable":
            text = (f"{uri}: cannot reach {where}: {detail}; check the endpoint setting and that the "
                    f"server is up")
        else:
            text = f"{uri}: {self.product} request failed at {where}: {detail}"
        return scrub(text)

    def error(self, exc: BaseException, uri: str, *, object_level: bool = True) -> ObjectStoreError:
        """The ObjectStoreError for an SDK exception raised while working on ``uri``."""
        if isinstance(exc, ObjectStoreError):
            return exc
        found = self.classify(exc)
        cause, detail = found if found else ("other", f"{type(exc).__name__}: {first_line(str(exc))}")
        if cause == "bucket-missing-or-object":
            # A 404 that does not say what is missing (a HEAD has no body; GCS says neither):
            # a listing can only miss its bucket; for an object, ask whether the bucket exists.
            cause = "object-missing" if object_level else "bucket-missing"
            if object_level and "://" in uri:
                try:
                    if not self._bucket_exists(parse_uri(uri).bucket):
                        cause = "bucket-missing"
                except Exception:  # noqa: BLE001 - a failed check leaves the first answer
                    pass
        return ObjectStoreError(self.message(uri, cause, scrub(detail)), cause)

    def call(self, uri: str, fn: Callable[[], T], *, object_level: bool = True) -> T:
        """Run one SDK request for ``uri``, with the endpoint checked first and errors mapped."""
        self.check_reachable(uri)
        try:
            return fn()
        except ObjectStoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - every SDK has its own tree; classify() sorts them
            raise self.error(exc, uri, object_level=object_level) from None

    def list(self, location: ObjectURI, recursive: bool = False) -> Listing:
        return self.call(str(location), lambda: self._list(location, recursive), object_level=False)

    def read(self, location: ObjectURI, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        data = self.call(str(location), lambda: self._read(location, start, end))
        if len(data) != end - start:
            raise ObjectStoreError(
                f"{location}: asked for bytes {start}-{end - 1} but got {len(data)} bytes; the object is "
                f"shorter than its header says, or it was replaced during the load", "other")
        return data

    def read_version(self, location: ObjectURI, start: int, end: int, version: str) -> bytes:
        """Bytes ``[start, end)`` of the object, which must still be at ``version`` (the one
        planned with): what the node cache keeps under that version, so bytes of another one
        must never pass. A real store refuses the request itself (If-Match, ifGenerationMatch);
        the answer's own version is compared too (the emulators ignore preconditions), and where
        the answer does not name one (GCS), the object is asked its version after the read (a
        GCS generation is never live again once replaced: still live now, live throughout)."""
        if end <= start:
            return b""
        data, answered = self.call(str(location), lambda: self._read_version(location, start, end, version))
        if answered is None:
            answered = self.version(location)
        if answered != version:
            raise CheckpointError(
                f"{location}: it was written again while it was being loaded (its version was {version}, now "
                f"{answered}), so its bytes were not kept in the node cache; load again once it is no longer written")
        if len(data) != end - start:
            raise ObjectStoreError(
                f"{location}: asked for bytes {start}-{end - 1} but got {len(data)} bytes; the object is "
                f"shorter than its header says", "other")
        return data

    def stat(self, location: ObjectURI) -> tuple[int, str | None]:
        """The object's size and version, from one request."""
        return self.call(str(location), lambda: self._stat(location))

    def size(self, location: ObjectURI) -> int:
        return self.stat(location)[0]

    def version(self, location: ObjectURI) -> str | None:
        return self.stat(location)[1]

    def read_header(self, uri: str, keep_head: bool = False) -> FileInfo:
        """The object's parsed header, with its size and version (one ranged GET where the header
        fits in the first probe; GCS asks for the version first); ``keep_head``: its raw bytes too."""
        location = parse_uri(uri)
        head, size, version = self.call(uri, lambda: self._read_head(location, HEADER_PROBE_BYTES))
        if len(head) >= 8:
            (header_len,) = struct.unpack("<Q", head[:8])
            if 2 <= header_len <= MAX_HEADER_BYTES and len(head) < 8 + header_len <= size:
                head += self.read(location, len(head), 8 + header_len)
        info = dataclasses.replace(parse_header(uri, head, size), version=version)
        if keep_head:  # parsed: its length prefix is valid
            (length,) = struct.unpack("<Q", head[:8])
            info = dataclasses.replace(info, head=bytes(head[:8 + length]))
        return info

    def diagnose(self, uris: list[str]) -> ObjectStoreError | None:
        """After a reader failed on ``uris``: the first fault a fresh request finds, or None."""
        if not uris:
            return None
        self.check_reachable(uris[0], self.reader_endpoint())
        for uri in uris:
            try:
                self.size(parse_uri(uri))
            except ObjectStoreError as exc:
                return exc
        return None
