"""Object-store servers for the tests, each on 127.0.0.1 on a free port, stopped afterwards.

- S3: s3rver (npm, fast) and moto's server (``moto[server]``).
- GCS: ``gcp-storage-emulator start ... -M`` (objects in memory).
- Azure Blob: Azurite (npm) over HTTPS with a test CA. Run:ai's Azure reader trusts only
  /etc/ssl/certs/ca-certificates.crt, so the Azure tests run inside ``unshare -rnm`` (private user,
  mount and network namespaces) with a bundle of the system CAs plus the test CA bind-mounted over
  that file: the machine's real trust store is never touched (see test_object_stores.py).

Also: a byte-counting TCP proxy (what a server really served) and a server that answers every
request 403 (GCS's emulator checks no credentials). Nothing here sends traffic off loopback.

The npm servers come from tests/node (``cd tests/node && npm ci``, which .ci/run does). A server
missing is a skip on a developer machine and a failure under CI (CI=true).
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest

from conftest import in_ci

TESTS = os.path.dirname(os.path.abspath(__file__))
NODE_BIN = os.path.join(TESTS, "node", "node_modules", ".bin")
VENV_BIN = os.path.dirname(sys.executable)

# Azurite's published development account and key (not a secret: the same in every Azurite).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

# A recognisable secret: no output of any test may contain it.
CANARY_SECRET = "DistloadCanarySecret-4b1d7e0c9a"


def need(path: str | None, what: str, install: str) -> str:
    """The executable's path; skip (developer machine) or fail (CI) when it is missing."""
    if path and os.path.exists(path):
        return path
    message = f"{what} is not installed ({install})"
    if in_ci():
        pytest.fail(message + "; .ci/run must install it", pytrace=False)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def closed_port() -> int:
    """A port nothing listens on (bound and released: refused until someone takes it)."""
    return free_port()


def wait_for_port(port: int, process: subprocess.Popen | None, log: str, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}: {_tail(log)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"server did not listen on 127.0.0.1:{port} within {deadline_s} s: {_tail(log)}")


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return "(no log)"


class ServerProcess:
    """A server started in its own session; ``stop()`` ends it (TERM, then KILL) by its own pid."""

    def __init__(self, cmd: list[str], port: int, log: str, env: dict | None = None, cwd: str | None = None):
        self.port = port
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                            start_new_session=True)
        try:
            wait_for_port(port, self.process, log)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


# -- a byte-counting TCP proxy ---------------------------------------------------------------

class ByteCountingProxy:
    """Forwards 127.0.0.1:port to 127.0.0.1:upstream_port and counts the bytes each way.

    ``served``: bytes the server sent to clients (response headers and bodies, TLS records for
    HTTPS): what the readers fetched, seen from the server's side.
    """

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.served = 0
        self.sent = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._accept_loop, daemon=True)
        self._accept.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self.connections += 1
            for src, dst, served in ((upstream, client, True), (client, upstream, False)):
                thread = threading.Thread(target=self._pump, args=(src, dst, served), daemon=True)
                thread.start()
                self._threads.append(thread)

    def _pass_on(self, served: bool) -> bool:
        """Called before each chunk is passed on; False drops the connection (subclasses)."""
        return True

    def _pump(self, src: socket.socket, dst: socket.socket, served: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 20)
                if not data or not self._pass_on(served):
                    break
                dst.sendall(data)
                with self._lock:
                    if served:
                        self.served += len(data)
                    else:
                        self.sent += len(data)
        except OSError:
            pass
        finally:
            for s in (dst, src):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._sock.close()


class StallingProxy(ByteCountingProxy):
    """A ByteCountingProxy that, once ``stall()`` is called, stops passing the server's bytes on
    (connections stay open): a server that hangs in the middle of a load; or, after ``kill()``,
    drops every connection it moves bytes on and refuses new ones: a server that dies."""

    def __init__(self, upstream_port: int):
        self._stalled = threading.Event()
        super().__init__(upstream_port)

    def stall(self) -> None:
        self._stalled.set()

    def kill(self) -> None:
        self.close()

    def _pass_on(self, served: bool) -> bool:
        while served and self._stalled.is_set() and not self._closed:
            time.sleep(0.1)  # hold the server's bytes: the client sees a silent server
        return not self._closed


class Forbidding403Server:
    """Answers every HTTP request 403 with a GCS-style JSON error: access denied, server side."""

    def __init__(self):
        class Handler(http.server.BaseHTTPRequestHandler):
            def _deny(self):
                body = json.dumps({"error": {"code": 403, "message": "distload-test does not have "
                                             "storage.objects.list access to the Google Cloud Storage bucket.",
                                             "errors": [{"reason": "forbidden"}]}}).encode()
                self.send_response(403)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_HEAD = do_POST = do_PUT = _deny

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- the stores --------------------------------------------------------------------------------

@dataclass
class StoreServer:
    """A running store: its URIs, the environment a load needs, uploads, and failure setups."""

    name: str  # s3rver, moto, gcs, azure
    scheme: str  # s3, gs, az
    bucket: str
    port: int
    workdir: str
    process: ServerProcess | None = None
    extra: dict = field(default_factory=dict)
    # The upload client per scheme, made once: a boto3 client costs about 0.3 s to make (it
    # parses its service models again each time), and a checkpoint is dozens of uploads.
    _clients: dict = field(default_factory=dict, repr=False, compare=False)

    def uri(self, prefix: str = "") -> str:
        return f"{self.scheme}://{self.bucket}/{prefix}".rstrip("/")

    # Environment -------------------------------------------------------------------------------
    def env(self, port: int | None = None) -> dict[str, str]:
        """What a user would set for this server (distload derives the rest), at ``port``
        (a proxy's) or the server's own."""
        port = port or self.port
        if self.scheme == "s3":
            # Not set on purpose: RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING and
            # AWS_EC2_METADATA_DISABLED (distload sets both for a non-AWS endpoint).
            return {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
                    "AWS_ACCESS_KEY_ID": self.extra.get("access_key", "distload-test"),
                    "AWS_SECRET_ACCESS_KEY": CANARY_SECRET,
                    "AWS_DEFAULT_REGION": "us-east-1",
                    "AWS_CONFIG_FILE": os.path.join(self.workdir, "no-aws-config"),
                    "AWS_SHARED_CREDENTIALS_FILE": os.path.join(self.workdir, "no-aws-credentials")}
        if self.scheme == "gs":
            # Only the Python client's variable: distload gives Run:ai's reader its own.
            return {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
                    "RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS": "1"}
        key = self.extra.get("key", AZURITE_KEY)
        return {"AZURE_STORAGE_ACCOUNT_NAME": AZURITE_ACCOUNT,
                "AZURE_STORAGE_ACCOUNT_KEY": key,
                "AZURE_STORAGE_ENDPOINT_SUFFIX": f"blob.localhost:{port}",
                "AZURE_STORAGE_CONNECTION_STRING": (
                    f"DefaultEndpointsProtocol=https;AccountName={AZURITE_ACCOUNT};AccountKey={key};"
                    f"BlobEndpoint=https://127.0.0.1:{port}/{AZURITE_ACCOUNT};"),
                "REQUESTS_CA_BUNDLE": "/etc/ssl/certs/ca-certificates.crt"}

    def unset_keys(self) -> list[str]:
        """Variables of other setups a test's environment must not inherit."""
        return ["AWS_ENDPOINT_URL", "RUNAI_STREAMER_S3_ENDPOINT", "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING",
                "RUNAI_STREAMER_S3_UNSIGNED", "AWS_PROFILE", "AWS_SESSION_TOKEN", "STORAGE_EMULATOR_HOST",
                "CLOUD_STORAGE_EMULATOR_ENDPOINT", "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_SAS_TOKEN"]

    def denied_env(self) -> tuple[dict[str, str], dict[str, str] | None]:
        """(environment, None) under which this server denies access; for GCS a 403 server is
        started and stopped by the caller via ``extra['forbidding']``."""
        if self.name == "s3rver":
            return {**self.env(), "AWS_ACCESS_KEY_ID": "NOT-A-KEY-OF-THIS-SERVER"}, None
        if self.name == "moto":  # unsigned requests to a private bucket
            return {**self.env(), "RUNAI_STREAMER_S3_UNSIGNED": "1"}, None
        if self.scheme == "az":
            wrong = "RGlzdGxvYWRDYW5hcnlTZWNyZXQtNGIxZDdlMGM5YQ=="  # base64 of the canary
            return {**self.env(), "AZURE_STORAGE_ACCOUNT_KEY": wrong,
                    "AZURE_STORAGE_CONNECTION_STRING": self.env()["AZURE_STORAGE_CONNECTION_STRING"].replace(
                        AZURITE_KEY, wrong)}, None
        forbidding = Forbidding403Server()
        return {**self.env(forbidding.port)}, {"close": forbidding.close}

    # Uploads --------------------------------------------------------------------------------------
    def _apply(self, env: dict[str, str]):
        saved = {k: os.environ.get(k) for k in list(env) + self.unset_keys()}
        for k in self.unset_keys():
            os.environ.pop(k, None)
        os.environ.update(env)
        return saved

    @staticmethod
    def _restore(saved):
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def upload_folder(self, folder: str, prefix: str, bucket: str | None = None, public: bool = False) -> str:
        """Upload every file under ``folder`` (recursively) to ``prefix``; returns the URI."""
        for root, _, names in os.walk(folder):
            for name in sorted(names):
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    self.put(f"{prefix}/{os.path.relpath(path, folder)}", f.read(), bucket, public)
        return f"{self.scheme}://{bucket or self.bucket}/{prefix}"

    def put(self, key: str, data: bytes, bucket: str | None = None, public: bool = False) -> None:
        saved = self._apply(self.env())
        try:
            if self.scheme == "s3":
                self._s3().put_object(Bucket=bucket or self.bucket, Key=key, Body=data,
                                      **({"ACL": "public-read"} if public else {}))
            elif self.scheme == "gs":
                self._gcs().bucket(bucket or self.bucket).blob(key).upload_from_string(data)
            else:
                self._azure().get_blob_client(bucket or self.bucket, key).upload_blob(data, overwrite=True)
        finally:
            self._restore(saved)

    def delete(self, key: str) -> None:
        saved = self._apply(self.env())
        try:
            if self.scheme == "s3":
                self._s3().delete_object(Bucket=self.bucket, Key=key)
            elif self.scheme == "gs":
                self._gcs().bucket(self.bucket).blob(key).delete()
            else:
                self._azure().get_blob_client(self.bucket, key).delete_blob()
        finally:
            self._restore(saved)

    def create_bucket(self, name: str, public: bool = False) -> None:
        saved = self._apply(self.env())
        try:
            if self.scheme == "s3":
                self._s3().create_bucket(Bucket=name, **({"ACL": "public-read"} if public else {}))
            elif self.scheme == "gs":
                self._gcs().create_bucket(name)
            else:
                self._azure().create_container(name)
        finally:
            self._restore(saved)

    # Each made under this server's own environment (the callers apply self.env() first), which
    # does not change: one client serves every later call.
    def _s3(self):
        if "s3" not in self._clients:
            import boto3

            self._clients["s3"] = boto3.session.Session().client("s3")
        return self._clients["s3"]

    def _gcs(self):
        if "gs" not in self._clients:
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage

            self._clients["gs"] = storage.Client(project="distload-test", credentials=AnonymousCredentials())
        return self._clients["gs"]

    def _azure(self):
        if "az" not in self._clients:
            from azure.storage.blob import BlobServiceClient

            self._clients["az"] = BlobServiceClient.from_connection_string(
                self.env()["AZURE_STORAGE_CONNECTION_STRING"])
        return self._clients["az"]

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


def start_s3rver(workdir: str, bucket: str = "distload-models") -> StoreServer:
    exe = need(os.path.join(NODE_BIN, "s3rver"), "s3rver", "cd tests/node && npm ci")
    port = free_port()
    data = os.path.join(workdir, "s3rver-data")
    os.makedirs(data, exist_ok=True)
    process = ServerProcess([exe, "-d", data, "-a", "127.0.0.1", "-p", str(port), "--no-vhost-buckets",
                             "--configure-bucket", bucket, "--silent"], port, os.path.join(workdir, "s3rver.log"))
    # s3rver checks the access key id (its only one: S3RVER) but not the secret.
    return StoreServer("s3rver", "s3", bucket, port, workdir, process, {"access_key": "S3RVER"})


def start_moto(workdir: str, bucket: str = "distload-models") -> StoreServer:
    exe = need(shutil.which("moto_server", path=VENV_BIN + os.pathsep + os.environ.get("PATH", "")),
               "moto_server", "pip install 'moto[server]'")
    port = free_port()
    process = ServerProcess([exe, "-H", "127.0.0.1", "-p", str(port)], port, os.path.join(workdir, "moto.log"))
    server = StoreServer("moto", "s3", bucket, port, workdir, process)
    try:
        server.create_bucket(bucket)
    except BaseException:
        server.stop()
        raise
    return server


def start_gcs(workdir: str, bucket: str = "distload-models") -> StoreServer:
    exe = need(shutil.which("gcp-storage-emulator", path=VENV_BIN + os.pathsep + os.environ.get("PATH", "")),
               "gcp-storage-emulator", "pip install gcp-storage-emulator")
    port = free_port()
    process = ServerProcess([exe, "start", "-H", "127.0.0.1", "--port", str(port), "--default-bucket", bucket,
                             "-M"], port, os.path.join(workdir, "gcs.log"), cwd=workdir)
    return StoreServer("gcs", "gs", bucket, port, workdir, process)


def make_test_certificates(folder: str) -> dict[str, str]:
    """A test CA and a server certificate for Azurite's host names and 127.0.0.1 (openssl)."""
    os.makedirs(folder, exist_ok=True)
    openssl = need(shutil.which("openssl"), "openssl", "apt-get install openssl")
    paths = {name: os.path.join(folder, name) for name in ("ca.pem", "ca.key", "server.pem", "server.key",
                                                         "server.csr", "ext.cnf", "bundle.pem")}
    with open(paths["ext.cnf"], "w") as f:
        f.write(f"subjectAltName=DNS:{AZURITE_ACCOUNT}.blob.localhost,DNS:*.blob.localhost,DNS:localhost,"
                f"IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
                f"extendedKeyUsage=serverAuth\n")
    run = lambda *args: subprocess.run([openssl, *args], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", paths["ca.key"], "-out", paths["ca.pem"],
        "-days", "2", "-subj", "/CN=distload test CA (never trusted outside a test namespace)")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", paths["server.key"], "-out", paths["server.csr"],
        "-subj", f"/CN={AZURITE_ACCOUNT}.blob.localhost")
    run("x509", "-req", "-in", paths["server.csr"], "-CA", paths["ca.pem"], "-CAkey", paths["ca.key"],
        "-CAcreateserial", "-out", paths["server.pem"], "-days", "2", "-extfile", paths["ext.cnf"])
    with open(paths["bundle.pem"], "wb") as out:
        with open("/etc/ssl/certs/ca-certificates.crt", "rb") as system:
            out.write(system.read())
        with open(paths["ca.pem"], "rb") as ca:
            out.write(b"\n" + ca.read())
    return paths


def start_azurite(workdir: str, cert_dir: str, bucket: str = "distload-models") -> StoreServer:
    """Azurite over HTTPS; only usable inside the test namespace (see the module docstring)."""
    exe = need(os.path.join(NODE_BIN, "azurite-blob"), "azurite", "cd tests/node && npm ci")
    port = free_port()
    data = os.path.join(workdir, "azurite-data")
    os.makedirs(data, exist_ok=True)
    process = ServerProcess([exe, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", data,
                             "--disableTelemetry", "--skipApiVersionCheck", "--loose", "--silent",
                             "--cert", os.path.join(cert_dir, "server.pem"),
                             "--key", os.path.join(cert_dir, "server.key")],
                            port, os.path.join(workdir, "azurite.log"))
    server = StoreServer("azure", "az", bucket, port, workdir, process)
    try:
        server.create_bucket(bucket)
    except BaseException:
        server.stop()
        raise
    return server
