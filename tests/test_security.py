"""Nobody in without the job's secret (docs/security.md).

Each attack is a separate stranger process with nothing but the package (or only torch) and no
secret, or a wrong one, against a real job: the legitimate members finish their updates exactly or
fail them cleanly with a message that names the refused peer, within their timeout; the same jobs
with the secret work as before. Plus the pieces: the store's handshake and frames, the decoder that
cannot run code, where a server listens, the secret's sources, and that it is never printed.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from distload.errors import ConfigError, SyncError
from distload.live import rendezvous, wire
from distload.live.store import AuthError, StoreClient, StoreServer
from distload.live.secret import Secret, job_secret

from dist_helpers import clean_env, free_port, write_script

ROOT = Path(__file__).resolve().parents[1]
SECRET = "s3cret-for-the-tests-" + "x" * 24
WRONG = "another-secret-entirely-" + "y" * 24
TIMEOUT_S = 15.0

# A member of a channel: pushes or receives versions of a small state and says what happened,
# one JSON line per step. ``forge``: from that version on, the trainer tags its buckets with a
# key made from another secret (what a process without the secret sends into a pair's data
# connection looks like to the receiver).
_MEMBER = r'''
import json, sys, time, torch
cfg = json.loads(sys.argv[1])
from distload.errors import SyncError
from distload.live import channel as channel_module
from distload.live.channel import SyncChannel
from distload.live.transfer import BucketKey
from distload.live.secret import Secret

def state(version):
    g = torch.Generator().manual_seed(version)
    return {f"w{i}": torch.randn(64, 256, generator=g) for i in range(4)}

def say(**fields):
    print(json.dumps(fields), flush=True)

start = time.monotonic()
try:
    ch = SyncChannel(cfg["address"], cfg["role"], rank=0, size=1, device="cpu", host=cfg.get("host", "trainer"),
                     timeout_s=cfg["timeout"])
except SyncError as exc:
    say(event="refused", error=str(exc), seconds=time.monotonic() - start)
    sys.exit(3)
say(event="joined")
if cfg["role"] == "trainer":
    while cfg.get("gate") and not __import__("os").path.exists(cfg["gate"]):  # the test says when to push
        time.sleep(0.05)
    real = BucketKey.__init__
    for version in cfg["versions"]:
        if version >= cfg.get("forge", 10**9) and version < cfg.get("forge_until", 10**9):
            BucketKey.__init__ = lambda self, secret, *a: real(self, Secret(b"not-the-job-secret-at-all", "forger"), *a)
        else:
            BucketKey.__init__ = real
        begun = time.monotonic()
        try:
            stats = ch.push(state(version), version)
            say(event="pushed", version=version, delta=stats.delta)
        except SyncError as exc:
            say(event="failed", version=version, error=str(exc), seconds=time.monotonic() - begun)
else:
    target = {n: torch.zeros_like(t) for n, t in state(0).items()}
    for _ in range(cfg["receives"]):
        try:
            stats = ch.receive(target, timeout_s=cfg["timeout"])
            exact = all(torch.equal(target[n], t) for n, t in state(stats.version).items())
            say(event="received", version=stats.version, exact=exact, delta=stats.delta, verified=stats.verified)
        except SyncError as exc:
            held = ch.version
            exact = held is None or all(torch.equal(target[n], t) for n, t in state(held).items())
            say(event="failed", version=held, exact=exact, error=str(exc))
ch.close()
'''


def _member(tmp_path: Path, cfg: dict, secret: str | None) -> subprocess.Popen:
    script = write_script(tmp_path, "member.py", _MEMBER)
    env = clean_env({"DISTLOAD_SECRET": secret} if secret else {}, drop_prefixes=("DISTLOAD_SECRET",))
    return subprocess.Popen([sys.executable, script, json.dumps(cfg)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _events(proc: subprocess.Popen, timeout: float = 90) -> tuple[list[dict], str]:
    out, _ = proc.communicate(timeout=timeout)
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return events, out


def _address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def _wait_listening(address: str, timeout: float = 30) -> None:
    host, port = rendezvous.parse_address(address)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"nothing listens at {address}")


# -- no pickle where a peer writes -----------------------------------------------------------------

NETWORK_MODULES = ["live/session.py", "live/rendezvous.py", "live/pairing.py", "live/verdicts.py", "live/server.py",
                   "live/from_server.py", "live/handoff.py", "live/channel.py", "live/store.py", "live/wire.py",
                   "live/delta.py", "live/transfer.py", "live/sync.py", "live/server_dtensors.py", "verl/engine.py",
                   "vllm/plugin.py", "vllm/push.py"]


def test_no_pickle_or_torch_load_on_the_network_paths():
    """Nothing a network peer can write is unpickled: no pickle.load(s), Unpickler or torch.load
    in the modules that read the store, the pairs or the server."""
    found = []
    for rel in NETWORK_MODULES:
        path = ROOT / "distload" / rel
        assert path.exists(), rel
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if re.search(r"pickle\.loads?\(|Unpickler|torch\.load\(|import pickle|from pickle", code):
                found.append(f"{rel}:{number}: {line.strip()}")
    assert not found, found


def test_a_crafted_pickle_in_the_store_runs_no_code(tmp_path):
    """What the old code would have run: a pickle whose loading creates a file. The decoder
    refuses it, and nothing is created."""
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    for payload in (pickle.dumps(Exploit()), pickle.dumps(Exploit(), protocol=2)):
        store = torch.distributed.HashStore()  # the job's own store, for WeightSync, takes any value
        store.set("hello/inference/0", payload)
        with pytest.raises(wire.WireError):
            rendezvous.get(store, "hello/inference/0")
    assert not marker.exists()
    # and a type that was never registered is not constructed
    with pytest.raises(wire.WireError, match="not one distload writes"):
        wire.decode(b'{"\\u0000c": "Popen", "f": [["touch", "x"]]}')


def test_the_wire_format_round_trips_what_distload_stores():
    from distload.live.rendezvous import Hello
    from distload.live.transfer import SyncTensor

    value = {"entries": [SyncTensor("a.weight", "BF16", (4, 8), 64)], "groups": [(0,)], 3: {(1, 2): b"\x00\xff"},
             "hello": Hello("n", 2, {"spec": None}), "set": {1, 2}, "none": None, "f": 1.5, "\x00odd": "key"}
    assert wire.decode(wire.encode(value)) == value
    big = {"names": [f"model.layers.{i}.mlp.experts.{j}.w1" for i in range(8) for j in range(64)]}
    data = wire.encode(big)
    assert data[:1] == b"x" and wire.decode(data) == big  # compressed past COMPRESS_FROM


# -- the store: handshake, frames, listening ---------------------------------------------------------

def _client(port: int, secret: Secret | None) -> StoreClient:
    return StoreClient("127.0.0.1", port, secret, timedelta(seconds=5), 5, f"tcp://127.0.0.1:{port}")


def test_the_store_admits_only_who_proves_the_secret_and_says_what_to_set():
    right, wrong = Secret(SECRET.encode(), "DISTLOAD_SECRET"), Secret(WRONG.encode(), "DISTLOAD_SECRET")
    server = StoreServer("127.0.0.1", 0, right, "the test rendezvous")
    try:
        with pytest.raises(AuthError, match="requires the job secret and this process has none: set DISTLOAD_SECRET"):
            _client(server.port, None)
        with pytest.raises(AuthError, match="refused this process's job secret"):
            _client(server.port, wrong)
        assert any("did not prove the job secret" in r for r in server.refused)
        ok = _client(server.port, right)
        ok.set("k", b"v")
        assert ok.get("k") == b"v" and ok.add("n", 2) == 2 and ok.check(["k"]) and not ok.check(["z"])
        ok.close()
    finally:
        server.close()
    open_server = StoreServer("127.0.0.1", 0, None, "an open rendezvous")
    try:  # a member with a secret never trusts a store anyone could have started
        with pytest.raises(AuthError, match="runs without the job secret and this process has one"):
            _client(open_server.port, right)
    finally:
        open_server.close()
    for message in (str(e) for e in server.refused):
        assert SECRET not in message and WRONG not in message


def test_connections_that_never_prove_the_secret_are_bounded_and_dropped(monkeypatch):
    """A stranger that opens connections and says nothing holds at most UNPROVEN of them (per
    address), each for HANDSHAKE_S; past that they are closed, and a member gets in."""
    from distload.live import store as store_module

    monkeypatch.setattr(store_module, "HANDSHAKE_S", 1.0)
    secret = Secret(SECRET.encode(), "test")
    server = StoreServer("127.0.0.1", 0, secret, "the test rendezvous")
    idle = []
    try:
        for _ in range(store_module.UNPROVEN + 4):
            conn = socket.create_connection(("127.0.0.1", server.port))
            conn.settimeout(5)
            idle.append(conn)
        extra_closed_at = []
        for conn in idle[store_module.UNPROVEN:]:  # over the bound: closed at once, before any byte
            start = time.monotonic()
            assert conn.recv(64) == b""
            extra_closed_at.append(time.monotonic() - start)
        assert max(extra_closed_at) < 0.9
        assert any(f"{store_module.UNPROVEN} of its connections" in r for r in server.refused)
        for conn in idle[:store_module.UNPROVEN]:  # silent past HANDSHAKE_S: dropped
            assert conn.recv(64) == b""
        ok = _client(server.port, secret)
        ok.set("k", b"v")
        assert ok.get("k") == b"v"
        ok.close()
    finally:
        for conn in idle:
            conn.close()
        server.close()


def test_a_frame_altered_on_the_wire_ends_the_connection_before_it_is_decoded():
    """A man in the middle that flips one byte of a request after the handshake: the server
    drops the connection (the value is never stored) and the client's next call fails."""
    secret = Secret(SECRET.encode(), "test")
    server = StoreServer("127.0.0.1", 0, secret, "the test rendezvous")
    relay = socket.create_server(("127.0.0.1", 0))
    flipped = threading.Event()

    def pump(src: socket.socket, dst: socket.socket, tamper: bool) -> None:
        seen = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if tamper and seen > 200 and not flipped.is_set():  # past the handshake: a request
                    data = data[:-1] + bytes([data[-1] ^ 1])
                    flipped.set()
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def accept() -> None:
        conn, _ = relay.accept()
        upstream = socket.create_connection(("127.0.0.1", server.port))
        threading.Thread(target=pump, args=(conn, upstream, True), daemon=True).start()
        threading.Thread(target=pump, args=(upstream, conn, False), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        client = _client(relay.getsockname()[1], secret)
        with pytest.raises(Exception):
            for i in range(50):
                client.set(f"key{i}", b"x" * 100)
        assert flipped.is_set()
        reader = _client(server.port, secret)
        assert not reader.check([f"key{i}" for i in range(50)][-1:])  # the altered request never landed
        reader.close()
    finally:
        relay.close()
        server.close()


def test_a_server_listens_on_its_address_only_and_not_beyond_loopback_without_a_secret(caplog):
    server = StoreServer("127.0.0.1", 0, None, "t")
    try:  # bound to 127.0.0.1: another loopback address of the host does not reach it
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.2", server.port), timeout=2).close()
    finally:
        server.close()
    host = _non_loopback_address()
    with pytest.raises(ConfigError, match="refusing to serve .* without a job secret.*DISTLOAD_SECRET.*--insecure"):
        rendezvous.check_listen(host, f"tcp://{host}:1", None, insecure=False)
    caplog.set_level("WARNING", logger="distload")
    rendezvous.check_listen(host, f"tcp://{host}:2", None, insecure=True)
    rendezvous.check_listen(host, f"tcp://{host}:2", None, insecure=True)
    assert sum("without a job secret (insecure)" in r.message for r in caplog.records) == 1
    rendezvous.check_listen(host, f"tcp://{host}:3", Secret(SECRET.encode(), "t"), insecure=False)
    rendezvous.check_listen("127.0.0.1", "tcp://127.0.0.1:4", None, insecure=False)


def _non_loopback_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent: it only picks a route
            address = probe.getsockname()[0]
        except OSError:
            address = "192.0.2.1"
    return "192.0.2.1" if address.startswith("127.") else address


def test_the_secret_comes_from_a_private_file_or_the_environment_and_is_never_shown(tmp_path, monkeypatch):
    monkeypatch.delenv("DISTLOAD_SECRET", raising=False)
    monkeypatch.delenv("DISTLOAD_SECRET_FILE", raising=False)
    assert job_secret() is None
    monkeypatch.setenv("DISTLOAD_SECRET", SECRET)
    secret = job_secret()
    assert secret.origin == "DISTLOAD_SECRET" and SECRET not in repr(secret) and SECRET not in str(secret)
    path = tmp_path / "secret"
    path.write_text(WRONG + "\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=f"can be read by other users .*chmod 600 {path}"):
        job_secret(str(path))
    path.chmod(0o600)
    assert job_secret(str(path)).key("store") == Secret(WRONG.encode(), "x").key("store")  # the file wins
    monkeypatch.setenv("DISTLOAD_SECRET", "short")
    with pytest.raises(ConfigError, match="at least 16") as caught:
        job_secret()
    assert "short" not in str(caught.value)


# -- strangers against real jobs ---------------------------------------------------------------------

def _stranger_with_torch_only(address: str) -> subprocess.CompletedProcess:
    """What a stranger with nothing but torch tries: torch's own store client, writing a crafted
    pickle under the key the trainer reads."""
    host, port = rendezvous.parse_address(address)
    code = (f"import torch.distributed as d, datetime, pickle\n"
            f"s = d.TCPStore({host!r}, {port}, None, False, datetime.timedelta(seconds=4))\n"
            f"s.set('hello/inference/0', b'crafted')\nprint('WROTE')\n")
    return subprocess.run([sys.executable, "-c", code], env=clean_env(drop_prefixes=("DISTLOAD_SECRET",)),
                          capture_output=True, text=True, timeout=60)


@pytest.mark.dist
def test_strangers_cannot_write_into_join_or_take_from_a_trainer(tmp_path):
    """The trainer serves the rendezvous with the secret. A stranger with torch's TCPStore
    writes nothing; one that joins as inference without the secret, or with a wrong one, is
    refused at once with one line; the trainer goes on and the real inference job, with the
    secret, receives every version exactly."""
    address = _address()
    trainer = _member(tmp_path, {"address": address, "role": "trainer", "versions": [1, 2], "timeout": 40}, SECRET)
    _wait_listening(address)
    stranger = _stranger_with_torch_only(address)
    assert "WROTE" not in stranger.stdout, stranger.stdout
    for secret, words in ((None, "requires the job secret and this process has none"),
                          (WRONG, "refused this process's job secret")):
        events, out = _events(_member(tmp_path, {"address": address, "role": "inference", "receives": 1,
                                                  "timeout": TIMEOUT_S}, secret))
        assert events and events[0]["event"] == "refused" and words in events[0]["error"], out
        assert events[0]["seconds"] < TIMEOUT_S / 3, out  # at once, not at the timeout
        assert SECRET not in out and WRONG not in out
    events, out = _events(_member(tmp_path, {"address": address, "role": "inference", "receives": 2,
                                              "timeout": 40}, SECRET))
    assert [(e["version"], e["exact"], e["verified"]) for e in events if e["event"] == "received"] == \
        [(1, True, True), (2, True, True)], out
    pushed, out = _events(trainer)
    assert [e["version"] for e in pushed if e["event"] == "pushed"] == [1, 2], out


@pytest.mark.dist
def test_a_stranger_cannot_push_into_a_waiting_inference_job(tmp_path):
    """The inference side hosts the rendezvous (host="inference"): a process that joins as
    trainer without the secret pushes nothing; the real trainer then does."""
    address = _address()
    inference = _member(tmp_path, {"address": address, "role": "inference", "host": "inference", "receives": 1,
                                   "timeout": 40}, SECRET)
    _wait_listening(address)
    events, out = _events(_member(tmp_path, {"address": address, "role": "trainer", "host": "inference",
                                              "versions": [7], "timeout": TIMEOUT_S}, None))
    assert events[0]["event"] == "refused" and "requires the job secret" in events[0]["error"], out
    events, out = _events(_member(tmp_path, {"address": address, "role": "trainer", "host": "inference",
                                              "versions": [1], "timeout": 40}, SECRET))
    assert [e["event"] for e in events] == ["joined", "pushed"], out
    received, out = _events(inference)
    assert [(e["event"], e["version"], e["exact"]) for e in received[1:]] == [("received", 1, True)], out


@pytest.mark.dist
def test_a_wrong_secret_is_one_line_on_both_sides_within_the_timeout(tmp_path):
    """Trainer and inference started with different secrets: the inference side is refused at
    once; the trainer's push fails within its timeout naming the refused peer."""
    address = _address()
    # The trainer pushes once the refused member has tried (its timeout counts from then).
    gate = tmp_path / "push"
    trainer = _member(tmp_path, {"address": address, "role": "trainer", "versions": [1], "timeout": 6,
                                 "gate": str(gate)}, SECRET)
    _wait_listening(address)
    events, out = _events(_member(tmp_path, {"address": address, "role": "inference", "receives": 1,
                                              "timeout": 8}, WRONG))
    assert events[0]["event"] == "refused" and "\n" not in events[0]["error"], out
    gate.touch()
    events, out = _events(trainer)
    failed = [e for e in events if e["event"] == "failed"]
    assert failed and "did not join the sync channel" in failed[0]["error"], out
    assert "refused meanwhile: 127.0.0.1 (it did not prove the job secret)" in failed[0]["error"], out
    assert "\n" not in failed[0]["error"] and failed[0]["seconds"] < 6 + 5, out  # within its timeout
    assert SECRET not in out and WRONG not in out


@pytest.mark.dist
def test_bytes_without_the_secret_in_a_pair_fail_the_update_and_roll_it_back(tmp_path):
    """Version 2's buckets arrive tagged under another secret (what bytes written into a pair's
    data connection by anyone without the job secret look like): the receiver fails the update
    and is at version 1 exactly; version 3, tagged right, lands, as does 4 (a delta)."""
    address = _address()
    trainer = _member(tmp_path, {"address": address, "role": "trainer", "versions": [1, 2, 3, 4], "forge": 2,
                                 "forge_until": 3, "timeout": 30}, SECRET)
    _wait_listening(address)
    events, out = _events(_member(tmp_path, {"address": address, "role": "inference", "receives": 4,
                                              "timeout": 30}, SECRET))
    steps = [(e["event"], e["version"], e["exact"]) for e in events if e["event"] != "joined"]
    assert steps[:2] == [("received", 1, True), ("failed", 1, True)], out
    assert "failed its checksum" in events[2]["error"] and "not the bytes sent" in events[2]["error"], out
    assert steps[2:] == [("received", 3, True), ("received", 4, True)], out
    pushed, out = _events(trainer)
    assert [e["event"] for e in pushed[1:]] == ["pushed", "failed", "pushed", "pushed"], out


@pytest.mark.dist
def test_a_load_from_serve_without_the_secret_gets_nothing(tmp_path):
    """`distload serve` with the secret; `distload load tcp://` without it (or with a wrong
    one) fails with one line and the server goes on; with it the load gets every tensor."""
    from safetensors.torch import save_file

    state = {f"w{i}": torch.randn(32, 64) for i in range(3)}
    save_file(state, str(tmp_path / "model.safetensors"))
    address = _address()
    env = clean_env({"DISTLOAD_SECRET": SECRET}, drop_prefixes=("DISTLOAD_SECRET",))
    server = subprocess.Popen([sys.executable, "-m", "distload", "serve", str(tmp_path), "--address", address,
                               "--no-progress"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_listening(address, 60)
        for secret in (None, WRONG):
            load_env = clean_env({"DISTLOAD_SECRET": secret} if secret else {}, drop_prefixes=("DISTLOAD_SECRET",))
            done = subprocess.run([sys.executable, "-m", "distload", "load", address, "--timeout", "15"],
                                  env=load_env, capture_output=True, text=True, timeout=60)
            assert done.returncode != 0 and "job secret" in done.stderr, done.stderr
            assert "digest" not in done.stdout and SECRET not in done.stderr + done.stdout
        done = subprocess.run([sys.executable, "-m", "distload", "load", address, "--timeout", "30"],
                              env=env, capture_output=True, text=True, timeout=90)
        assert done.returncode == 0, done.stderr
        from distload.loading.report import state_digest
        assert state_digest(state)[:16] in done.stdout, done.stdout
    finally:
        server.terminate()
        out, _ = server.communicate(timeout=30)
    assert "1 load(s) served" in out, out
    assert SECRET not in out
