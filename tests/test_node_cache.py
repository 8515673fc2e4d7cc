"""The node cache for object-store reads (issue 33, item 1): ``--cache-dir``.

Two halves. Without a server, the cache itself (``distload.loading.stores.cache``) on a local
"object" whose fetches are counted: partial hits, corrupt and torn blocks, several processes
filling one entry at once, a writer killed while it holds its lock, the LRU bound. With S3
(s3rver) and GCS (the emulator), loads through the cache: bit for bit against a plain read of the
local files, the bytes the server served (a byte-counting proxy), a TP load served by what other
TP ranks' loads left, an object rewritten in the store between two loads, two jobs filling one
cache at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import distload
from distload.errors import CheckpointError, ConfigError
from distload.loading.stores.cache import (BLOCK_BYTES, LAYOUT, RECORD_BYTES, CacheSettings, NodeCache,
                                           cache_settings)

from conftest import plain_digest, write_whole
from dist_helpers import run_job

MIB = 1024 * 1024
TESTS = os.path.dirname(os.path.abspath(__file__))
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# -- without a server ------------------------------------------------------------------------------

class LocalObject:
    """A local file standing in for an object: ``fetch`` reads it and counts what it fetched."""

    def __init__(self, path: str, size: int, seed: int = 0):
        self.path = path
        generator = torch.Generator().manual_seed(seed)
        self.bytes = bytes(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).numpy())
        with open(path, "wb") as f:
            f.write(self.bytes)
        self.fetched: list[tuple[int, int]] = []

    def fetch(self, start: int, end: int) -> bytes:
        self.fetched.append((start, end))
        return self.bytes[start:end]

    def read(self, cache: NodeCache, start: int, end: int, version: str = "v1") -> bytes:
        return bytes(cache.read("s3://bucket/model.safetensors", version, len(self.bytes), start, end, self.fetch))


def entry_folders(root: str) -> list[str]:
    entries = os.path.join(root, LAYOUT, "entries")
    return sorted(os.listdir(entries)) if os.path.isdir(entries) else []


def test_settings_come_from_the_extra_config_then_the_environment():
    assert cache_settings({}, {}) is None
    assert cache_settings({}, {"DISTLOAD_CACHE_DIR": "/c"}) == CacheSettings("/c", None)
    assert cache_settings({"cache_dir": "/x", "cache_max_gib": 2}, {"DISTLOAD_CACHE_DIR": "/c",
                                                                    "DISTLOAD_CACHE_MAX_GIB": "1"}) \
        == CacheSettings("/x", 2 * 1024**3)
    assert cache_settings({}, {"DISTLOAD_CACHE_DIR": "/c", "DISTLOAD_CACHE_MAX_GIB": "0.5"}).max_bytes == 512 * MIB
    with pytest.raises(ConfigError, match="DISTLOAD_CACHE_MAX_GIB='lots'"):
        cache_settings({}, {"DISTLOAD_CACHE_DIR": "/c", "DISTLOAD_CACHE_MAX_GIB": "lots"})
    with pytest.raises(ConfigError, match="'cache_max_gib' must be a number of GiB above 0"):
        distload.make_load_config("auto", {"cache_dir": "/c", "cache_max_gib": -1})
    # Run:ai's reader fetches past the cache: its formats refuse the keys and say what to use
    with pytest.raises(ConfigError, match="the node cache cannot serve it; load with --load-format auto"):
        distload.make_load_config("runai_streamer", {"cache_dir": "/c"})
    assert distload.make_load_config("safetensors", {"cache_dir": "/c"}).extra == {"cache_dir": "/c"}


def test_the_cache_flags_are_the_extra_config_keys_and_never_disagree_with_them():
    from distload.cli.main import _with_cache_flags, build_parser

    def extra(*argv: str):
        return _with_cache_flags(build_parser().parse_args(["load", "s3://b/m", *argv]))

    assert extra() is None
    assert extra("--cache-dir", "/c", "--cache-max-gib", "2") == {"cache_dir": "/c", "cache_max_gib": 2.0}
    assert extra("--cache-dir", "/c", "--model-loader-extra-config", '{"cache_dir": "/c", "concurrency": 2}') == \
        {"cache_dir": "/c", "concurrency": 2}
    with pytest.raises(ConfigError, match="--cache-dir /d and the extra config's 'cache_dir': '/c' disagree"):
        extra("--cache-dir", "/d", "--model-loader-extra-config", '{"cache_dir": "/c"}')


def test_auto_reads_an_object_store_with_ranged_reads_when_a_cache_is_set():
    from distload.loading.choice import ReadFacts
    from distload.loading.formats import FORMATS

    for device, world, sharded in (("cpu", 1, False), ("cuda", 2, False), ("cpu", 1, True), ("cuda", 1, True)):
        facts = dict(sharded_layout_found=sharded, device_type=device, world_size=world, distributed=None,
                     instanttensor_installed=False, remote=True)
        assert FORMATS["auto"].choose(ReadFacts(**facts, cached=True)).backend == "ranged"
        assert FORMATS["auto"].choose(ReadFacts(**facts)).backend in ("runai", "ranged")


def test_a_partial_hit_fetches_only_the_missing_blocks_and_every_read_is_exact(tmp_path):
    obj = LocalObject(str(tmp_path / "object"), 5 * BLOCK_BYTES + 1234)
    cache = NodeCache(CacheSettings(str(tmp_path / "cache"), None))
    assert obj.read(cache, 100, 200) == obj.bytes[100:200]  # one block, fetched whole
    assert obj.fetched == [(0, BLOCK_BYTES)]
    assert obj.read(cache, 2 * BLOCK_BYTES + 5, 3 * BLOCK_BYTES + 7) == obj.bytes[2 * BLOCK_BYTES + 5:3 * BLOCK_BYTES + 7]
    assert obj.fetched[1:] == [(2 * BLOCK_BYTES, 4 * BLOCK_BYTES)]  # blocks 2 and 3, one request
    obj.fetched.clear()
    whole = obj.read(cache, 0, len(obj.bytes))
    assert whole == obj.bytes
    # only blocks 1, 4 and the short last one were missing
    assert obj.fetched == [(BLOCK_BYTES, 2 * BLOCK_BYTES), (4 * BLOCK_BYTES, len(obj.bytes))]
    cache.close()
    again = NodeCache(CacheSettings(str(tmp_path / "cache"), None))
    obj.fetched.clear()
    assert obj.read(again, 0, len(obj.bytes)) == obj.bytes and obj.fetched == []
    assert again.store_bytes == 0 and again.cache_bytes == len(obj.bytes)
    again.close()


def test_bytes_received_from_a_peer_fill_only_whole_blocks_and_never_a_range_another_writer_holds(tmp_path):
    """offer (a shared read's receiver): segments in several pieces (two tensors' memory) keep
    the blocks they cover whole, without any fetch; a block another writer has locked is left to
    it; a later read takes the kept blocks from the cache, exact, and fetches only the rest."""
    import fcntl
    import struct

    obj = LocalObject(str(tmp_path / "object"), 6 * BLOCK_BYTES + 999)
    uri, size = "s3://bucket/model.safetensors", len(obj.bytes)
    cache = NodeCache(CacheSettings(str(tmp_path / "cache"), None))
    entry = cache.entry(uri, "v1", size)
    # another writer holds block 4's record (an OFD lock on its own open file description)
    holder = os.open(entry.records_path, os.O_RDWR)
    fcntl.fcntl(holder, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET,
                                                        4 * RECORD_BYTES, RECORD_BYTES, 0))
    # bytes [BLOCK/2, end) as two segments meeting inside block 2, in writable memory (a tensor's)
    memory = bytearray(obj.bytes)
    cut = 2 * BLOCK_BYTES + 4321
    cache.offer(uri, "v1", size, [(BLOCK_BYTES // 2, memoryview(memory)[BLOCK_BYTES // 2:cut]),
                                  (cut, memoryview(memory)[cut:])])
    os.close(holder)
    # blocks 1, 2, 3, 5 and the short last one (6): block 0 is half covered, block 4 was held
    assert cache.received_bytes == size - 2 * BLOCK_BYTES
    assert obj.fetched == []
    cache.close()
    again = NodeCache(CacheSettings(str(tmp_path / "cache"), None))
    assert obj.read(again, 0, size) == obj.bytes
    assert obj.fetched == [(0, BLOCK_BYTES), (4 * BLOCK_BYTES, 5 * BLOCK_BYTES)]
    assert again.corrupt_blocks == 0
    again.close()


def test_a_block_two_received_buckets_share_is_kept_once_the_second_arrives(tmp_path):
    """A shared read's receiver offers each bucket as it arrives: the part of a block the first
    bucket ends in is carried until the next bucket (of the same file, in file order) completes it."""
    from distload.loading.backends.ranged import ObjectBytes
    from distload.loading.index import FileInfo, TensorInfo

    uri = "s3://bucket/model.safetensors"
    obj = LocalObject(str(tmp_path / "object"), 4 * BLOCK_BYTES)
    a = TensorInfo("a", "U8", (BLOCK_BYTES,), uri, BLOCK_BYTES // 2, 3 * BLOCK_BYTES // 2)
    b = TensorInfo("b", "U8", (2 * BLOCK_BYTES,), uri, 3 * BLOCK_BYTES // 2, 7 * BLOCK_BYTES // 2)
    memory = bytearray(obj.bytes)
    cache = NodeCache(CacheSettings(str(tmp_path / "cache"), None))
    received = ObjectBytes([FileInfo(uri, len(obj.bytes), (a, b), None, version="v1")], cache)
    received.offer([(a, a.begin, memoryview(memory)[a.begin:a.end])])  # bucket 1: block 1 half
    assert cache.received_bytes == 0
    received.offer([(b, b.begin, memoryview(memory)[b.begin:b.end])])  # bucket 2: blocks 1 and 2
    assert cache.received_bytes == 2 * BLOCK_BYTES
    cache.close()
    again = NodeCache(CacheSettings(str(tmp_path / "cache"), None))
    assert obj.read(again, 0, len(obj.bytes)) == obj.bytes
    assert obj.fetched == [(0, BLOCK_BYTES), (3 * BLOCK_BYTES, 4 * BLOCK_BYTES)]  # the ends only
    again.close()


def test_a_read_straight_into_tensors_checks_every_block_it_uses(tmp_path):
    """read_into / read_scatter: each block read once into the tensors' own memory (the bytes no
    tensor takes, gaps and the edges' outer parts, only checked), every block checked; a partial
    hit, a corrupt interior block, several tensors with gaps between them in one read."""
    from distload.loading.stores.cache import Scratch
    from distload.tensor_io import host_view

    size = 6 * BLOCK_BYTES + 777
    obj = LocalObject(str(tmp_path / "object"), size)
    settings = CacheSettings(str(tmp_path / "cache"), None)
    cache = NodeCache(settings)
    obj.read(cache, BLOCK_BYTES + 3, 2 * BLOCK_BYTES)  # block 1 only, before
    for start, end in [(0, size), (5, 4 * BLOCK_BYTES - 5), (BLOCK_BYTES, 3 * BLOCK_BYTES), (7, 9),
                       (5 * BLOCK_BYTES - 1, size)]:
        out = torch.empty(end - start, dtype=torch.uint8)
        cache.read_into("s3://bucket/model.safetensors", "v1", size, start, end, host_view(out), obj.fetch, Scratch())
        assert bytes(out.numpy()) == obj.bytes[start:end], (start, end)
    covered = sorted(i for a, b in obj.fetched for i in range(a // BLOCK_BYTES, -(-b // BLOCK_BYTES)))
    assert covered == list(range(7))  # each block fetched once
    cache.close()
    with open(os.path.join(_entry(tmp_path), "data"), "r+b") as f:  # an interior block corrupted
        f.seek(3 * BLOCK_BYTES + 100)
        f.write(b"\0" if obj.bytes[3 * BLOCK_BYTES + 100] else b"\1")
    obj.fetched.clear()
    cache = NodeCache(settings)
    # three tensors, gaps between them, the corrupt block inside the second
    spans = [(10, BLOCK_BYTES + 5), (BLOCK_BYTES + 99, 4 * BLOCK_BYTES - 3), (4 * BLOCK_BYTES - 3, size - 1)]
    outs = [torch.empty(b - a, dtype=torch.uint8) for a, b in spans]
    cache.read_scatter("s3://bucket/model.safetensors", "v1", size, 10, size - 1,
                       [(a, host_view(out)) for (a, _), out in zip(spans, outs)], obj.fetch, Scratch())
    assert [bytes(out.numpy()) for out in outs] == [obj.bytes[a:b] for a, b in spans]
    assert obj.fetched == [(3 * BLOCK_BYTES, 4 * BLOCK_BYTES)] and cache.corrupt_blocks == 1
    assert cache.cache_bytes == size - BLOCK_BYTES  # every other block read (and checked) once
    cache.close()


def _entry(tmp_path) -> str:
    (key,) = entry_folders(str(tmp_path / "cache"))
    return os.path.join(str(tmp_path / "cache"), LAYOUT, "entries", key)


def test_a_corrupt_block_is_detected_fetched_again_and_counted(tmp_path, caplog):
    obj = LocalObject(str(tmp_path / "object"), 4 * BLOCK_BYTES)
    settings = CacheSettings(str(tmp_path / "cache"), None)
    cache = NodeCache(settings)
    obj.read(cache, 0, len(obj.bytes))
    cache.close()
    with open(os.path.join(_entry(tmp_path), "data"), "r+b") as f:  # a bit flipped on disk
        f.seek(2 * BLOCK_BYTES + 17)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    obj.fetched.clear()
    cache = NodeCache(settings)
    with caplog.at_level("WARNING", logger="distload"):
        assert obj.read(cache, 0, len(obj.bytes)) == obj.bytes
    assert obj.fetched == [(2 * BLOCK_BYTES, 3 * BLOCK_BYTES)] and cache.corrupt_blocks == 1
    assert "block 2 of s3://bucket/model.safetensors" in caplog.text and "fetched again" in caplog.text
    cache.close()
    obj.fetched.clear()
    cache = NodeCache(settings)
    assert obj.read(cache, 0, len(obj.bytes)) == obj.bytes and obj.fetched == []  # repaired for good
    cache.close()


def test_torn_or_misplaced_records_and_bytes_without_a_record_count_as_missing(tmp_path):
    obj = LocalObject(str(tmp_path / "object"), 4 * BLOCK_BYTES)
    settings = CacheSettings(str(tmp_path / "cache"), None)
    cache = NodeCache(settings)
    obj.read(cache, 0, 3 * BLOCK_BYTES)  # blocks 0-2 complete, 3 never fetched
    cache.close()
    folder = _entry(tmp_path)
    with open(os.path.join(folder, "blocks"), "r+b") as f:
        records = f.read()
        f.seek(0)  # block 0: a record torn halfway (its second half zeros)
        f.write(records[:8] + bytes(8))
        f.seek(RECORD_BYTES)  # block 1: block 2's valid record copied over it (misplaced)
        f.write(records[2 * RECORD_BYTES:3 * RECORD_BYTES])
    with open(os.path.join(folder, "data"), "r+b") as f:  # block 3: the right bytes, no record
        f.seek(3 * BLOCK_BYTES)
        f.write(obj.bytes[3 * BLOCK_BYTES:])
    obj.fetched.clear()
    cache = NodeCache(settings)
    assert obj.read(cache, 0, len(obj.bytes)) == obj.bytes
    assert obj.fetched == [(0, 2 * BLOCK_BYTES), (3 * BLOCK_BYTES, 4 * BLOCK_BYTES)]
    cache.close()


def test_another_version_is_another_entry_and_the_old_one_goes(tmp_path):
    settings = CacheSettings(str(tmp_path / "cache"), None)
    old = LocalObject(str(tmp_path / "old"), 2 * BLOCK_BYTES, seed=1)
    new = LocalObject(str(tmp_path / "new"), 2 * BLOCK_BYTES, seed=2)  # the same size, other bytes
    cache = NodeCache(settings)
    assert old.read(cache, 0, 2 * BLOCK_BYTES, "etag-1") == old.bytes
    cache.close()
    cache = NodeCache(settings)
    assert new.read(cache, 0, 2 * BLOCK_BYTES, "etag-2") == new.bytes  # never the old bytes
    assert new.fetched == [(0, 2 * BLOCK_BYTES)]
    assert len(entry_folders(settings.folder)) == 1  # the old version's entry removed
    cache.close()
    with pytest.raises(CheckpointError, match="gave no version"):
        NodeCache(settings).read("s3://b/k", None, 10, 0, 10, new.fetch)


def test_the_size_bound_evicts_the_least_recently_used_entry_not_in_use(tmp_path):
    settings = CacheSettings(str(tmp_path / "cache"), 3 * BLOCK_BYTES + BLOCK_BYTES // 2)
    objects = {name: LocalObject(str(tmp_path / name), BLOCK_BYTES, seed=i) for i, name in enumerate("abcd")}

    def use(name: str, cache: NodeCache | None = None) -> NodeCache:
        cache = cache or NodeCache(settings)
        cache.read(f"s3://b/{name}", "v", BLOCK_BYTES, 0, BLOCK_BYTES, objects[name].fetch)
        return cache

    for name in "abc":
        use(name).close()
    use("a").close()  # a used again: b is now the least recently used
    held = use("b")  # ... but in use (not closed) while d comes in
    use("d").close()
    uris = sorted(json.load(open(os.path.join(settings.folder, LAYOUT, "entries", k, "meta.json")))["uri"]
                  for k in entry_folders(settings.folder))
    assert uris == ["s3://b/a", "s3://b/b", "s3://b/d"]  # c went: b was in use
    held.close()  # b's last use is now, after d's
    use("c").close()  # c again: a is the least recently used now, and goes
    uris = sorted(json.load(open(os.path.join(settings.folder, LAYOUT, "entries", k, "meta.json")))["uri"]
                  for k in entry_folders(settings.folder))
    assert uris == ["s3://b/b", "s3://b/c", "s3://b/d"]


# Several processes using one cache: each reads ranges of one object through it, logging every
# fetch; they all start at once (a file they wait for) and each fetch takes a while, so they meet.
WORKER = r"""
import json, os, sys, time
from distload.loading.stores.cache import CacheSettings, NodeCache
obj, cache_dir, log, ranges, delay, go = sys.argv[1:7]
ranges, delay = json.loads(ranges), float(delay)
size = os.path.getsize(obj)
fd = os.open(obj, os.O_RDONLY)
def fetch(a, b):
    with open(log, "a") as f:
        f.write(f"{os.getpid()} {a} {b}\n")
    time.sleep(delay)
    return os.pread(fd, b - a, a)
cache = NodeCache(CacheSettings(cache_dir, None))
print("READY", flush=True)
while not os.path.exists(go):
    time.sleep(0.005)
for a, b in ranges:
    data = cache.read("s3://bucket/shared.safetensors", "v1", size, a, b, fetch)
    assert bytes(data) == os.pread(fd, b - a, a), (a, b)
    print("READ", a, b, flush=True)
print("OK", cache.cache_bytes, cache.store_bytes, flush=True)
cache.close()
"""


def start_workers(tmp_path, obj: LocalObject, orders: list[list[tuple[int, int]]], delay: float):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    go = str(tmp_path / "go")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = os.path.dirname(TESTS) + os.pathsep + env.get("PYTHONPATH", "")
    procs = [subprocess.Popen([sys.executable, str(script), obj.path, str(tmp_path / "cache"), str(tmp_path / "log"),
                               json.dumps(order), str(delay), go], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, start_new_session=True) for order in orders]
    for proc in procs:
        assert proc.stdout.readline().strip() == "READY", proc.stderr.read()[-3000:]
    open(go, "w").close()
    return procs


def fetch_log(tmp_path) -> list[tuple[int, int, int]]:
    if not os.path.exists(tmp_path / "log"):
        return []
    return [tuple(map(int, line.split())) for line in open(tmp_path / "log")]


def test_processes_filling_one_entry_at_once_fetch_each_block_once(tmp_path):
    size = 8 * BLOCK_BYTES - 99
    obj = LocalObject(str(tmp_path / "object"), size)
    blocks = [(i * BLOCK_BYTES, min(size, (i + 1) * BLOCK_BYTES)) for i in range(8)]
    # Not one reader of the whole object first: it would lock every block at once, and the others
    # would find it all there. Forwards, backwards and from the middle, they meet.
    orders = [
        blocks,  # block by block, forwards
        blocks[::-1],  # backwards
        [(3 * BLOCK_BYTES + 5, 6 * BLOCK_BYTES - 5), (10, 2 * BLOCK_BYTES + 10), (0, size)],  # unaligned
        [(2 * BLOCK_BYTES, 3 * BLOCK_BYTES), (0, size)],
    ]
    procs = start_workers(tmp_path, obj, orders, delay=0.2)
    outs = [proc.communicate(timeout=120) for proc in procs]
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0 and "OK" in out, err[-3000:]
    fetched = sorted((a, b) for _, a, b in fetch_log(tmp_path))
    # every block fetched exactly once, whoever fetched it; the rest came from the cache
    covered = [i for a, b in fetched for i in range(a // BLOCK_BYTES, -(-b // BLOCK_BYTES))]
    assert sorted(covered) == list(range(8)), fetched
    assert len({pid for pid, _, _ in fetch_log(tmp_path)}) > 1  # they did fill it together
    stores = [int(out.split()[-1]) for out, _ in outs]
    caches = [int(out.split()[-2]) for out, _ in outs]
    assert sum(stores) == size and all(c + s >= size for c, s in zip(caches, stores))


def test_a_writer_killed_mid_fill_leaves_only_complete_blocks_and_its_lock_goes_with_it(tmp_path):
    size = 8 * BLOCK_BYTES
    obj = LocalObject(str(tmp_path / "object"), size)
    blocks = [(i * BLOCK_BYTES, (i + 1) * BLOCK_BYTES) for i in range(8)]
    # One fetch of the whole object would hold the lock on every block: the writer asks block by
    # block, and is killed while it holds the lock of one (inside its fetch).
    (proc,) = start_workers(tmp_path, obj, [blocks], delay=0.3)
    deadline = time.monotonic() + 60
    while len(fetch_log(tmp_path)) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    complete = len(fetch_log(tmp_path)) - 1  # the last fetch was under way
    assert 3 <= complete < 8
    obj.fetched.clear()
    cache = NodeCache(CacheSettings(str(tmp_path / "cache"), None))
    data = bytes(cache.read("s3://bucket/shared.safetensors", "v1", size, 0, size, obj.fetch))
    assert data == obj.bytes
    # only what the killed writer had not completed was fetched: its last block among them
    assert sum(b - a for a, b in obj.fetched) == size - complete * BLOCK_BYTES, obj.fetched
    assert cache.store_bytes == size - complete * BLOCK_BYTES and cache.corrupt_blocks == 0
    cache.close()


def test_a_cache_folder_that_cannot_be_written_is_an_error_before_any_read(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(CheckpointError, match="cannot use it as the node cache"):
        NodeCache(CacheSettings(str(blocker), None)).check_writable()


# -- with S3 and GCS: loads through the cache ----------------------------------------------------

# Inside the Azure namespace (test_azure_in_private_namespace below) only Azurite runs.
IN_AZURE_NAMESPACE = os.environ.get("DISTLOAD_AZURE_NAMESPACE") == "1"


# As in test_object_stores.py, every test on a store server is in the slow set.
@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.slow)
                                        for name in (["azure"] if IN_AZURE_NAMESPACE else ["s3rver", "gcs"])])
def store(request, tmp_path_factory):
    from object_store_servers import start_azurite, start_gcs, start_s3rver

    workdir = str(tmp_path_factory.mktemp(f"cache-{request.param}"))
    if request.param == "azure":
        server = start_azurite(workdir, os.environ["DISTLOAD_AZURE_CERT_DIR"])
    else:
        server = (start_s3rver if request.param == "s3rver" else start_gcs)(workdir)
    yield server
    server.stop()


class Llama:
    """A Llama-shaped whole checkpoint (16 MiB, config.json beside it) in the store, and what a
    plain read of it gives: whole, and per TP rank (reshard's files) for TP 2 and 4."""

    def __init__(self, store, root: str):
        from distload.cli.demo import write_demo_checkpoint

        self.whole, _ = write_demo_checkpoint(os.path.join(root, "src"), 1, size_mib=16)
        self.files = sorted(os.path.join(self.whole, n) for n in os.listdir(self.whole) if n.endswith(".safetensors"))
        self.nbytes = sum(os.path.getsize(p) for p in self.files)
        self.tp = {}
        for size in (2, 4):
            out = os.path.join(root, f"tp{size}")
            distload.reshard(self.whole, out, size, sharding="decoder")
            self.tp[size] = [sorted(os.path.join(out, n) for n in os.listdir(out) if n.startswith(f"model-rank-{r}-"))
                             for r in range(size)]
        self.store = store
        self.uri = store.upload_folder(self.whole, "llama")


@pytest.fixture(scope="module")
def llama(store, tmp_path_factory):
    return Llama(store, str(tmp_path_factory.mktemp("llama")))


@pytest.fixture
def through_proxy(store, monkeypatch):
    """This process's environment set for ``store`` behind a byte-counting proxy (the proxy)."""
    from object_store_servers import ByteCountingProxy

    proxy = ByteCountingProxy(store.port)
    for key in LAUNCH_VARS + tuple(store.unset_keys()):
        monkeypatch.delenv(key, raising=False)
    for key, value in store.env(proxy.port).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("DISTLOAD_CACHE_DIR", raising=False)
    yield proxy
    proxy.close()


def cached_load(uri: str, cache_dir: str, fmt: str = "auto", **kwargs):
    with distload.WorkerGroup(device="cpu") as group:
        result = distload.Loader(uri, fmt, {"cache_dir": cache_dir}, group=group, **kwargs).load(digest=True)
    return result.rank_report


def test_a_warm_cache_serves_a_load_bit_for_bit_and_the_store_at_most_2_percent(store, llama, through_proxy, tmp_path):
    cache = str(tmp_path / "cache")
    cold = cached_load(llama.uri, cache, "safetensors")
    cold_served = through_proxy.served
    assert cold.path == "ranged-reads" and cold.digest == plain_digest(llama.files)
    # whole blocks, each fetched once: the files whole (a block two tensors share is fetched for
    # the first and comes from the cache for the second)
    assert cold.store_bytes == llama.nbytes and cold.cache_bytes < 0.2 * llama.nbytes
    warm = cached_load(llama.uri, cache, "auto")  # another format: the same bytes
    served = through_proxy.served - cold_served
    assert warm.path == "ranged-reads" and warm.digest == plain_digest(llama.files)
    assert warm.store_bytes == 0 and warm.cache_bytes >= warm.requested_bytes
    # what the store still serves: the one listing (each object's version); the index and the
    # headers come from the cache under those versions, and no object is asked its version again
    assert served <= 0.02 * llama.nbytes and served < 16 * 1024, (served, llama.nbytes)
    assert cold_served >= llama.nbytes


def test_tp_ranks_fill_what_a_later_tp_size_takes(store, llama, through_proxy, tmp_path):
    """TP 2's two ranks (two loads, in turn) each fetch only what the cache lacks; then TP 4's
    ranks need nothing from the store: the cache holds the objects' bytes, not a rank's view."""
    cache = str(tmp_path / "cache")
    first = cached_load(llama.uri, cache, tensor_parallel_size=2, tensor_parallel_rank=0)
    assert first.digest == plain_digest(llama.tp[2][0])
    assert 0 < first.store_bytes < llama.nbytes
    second = cached_load(llama.uri, cache, tensor_parallel_size=2, tensor_parallel_rank=1)
    assert second.digest == plain_digest(llama.tp[2][1])
    assert second.cache_bytes > 0  # replicated tensors, shared blocks: a partial hit
    assert first.store_bytes + second.store_bytes == llama.nbytes  # each block fetched once
    for rank in range(4):
        later = cached_load(llama.uri, cache, tensor_parallel_size=4, tensor_parallel_rank=rank)
        assert later.digest == plain_digest(llama.tp[4][rank]) and later.store_bytes == 0, rank


def test_an_object_rewritten_in_the_store_is_never_served_stale(store, llama, through_proxy, tmp_path):
    folder = str(tmp_path / "rewritten")
    files = write_whole(folder, {"a": torch.arange(300_000, dtype=torch.int32), "b": torch.ones(1000)}, num_files=2)
    prefix = f"rewritten-{time.monotonic_ns()}"
    uri = store.upload_folder(folder, prefix)
    cache = str(tmp_path / "cache")
    assert cached_load(uri, cache).digest == plain_digest(files)
    with open(files[0], "r+b") as f:  # the same size, other bytes (the last tensor byte)
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    with open(files[0], "rb") as f:
        store.put(f"{prefix}/{os.path.basename(files[0])}", f.read())
    again = cached_load(uri, cache)
    assert again.digest == plain_digest(files)  # the new bytes
    assert again.store_bytes == os.path.getsize(files[0])  # that object fetched again, the other not
    assert len(entry_folders(cache)) == 2  # the old version's entry is gone


def test_an_object_rewritten_during_a_load_leaves_nothing_of_the_new_bytes_under_the_old_version(
        store, llama, through_proxy, tmp_path):
    folder = str(tmp_path / "during")
    files = write_whole(folder, {"a": torch.arange(300_000, dtype=torch.int32)}, num_files=1)
    prefix = f"during-{time.monotonic_ns()}"
    uri = store.upload_folder(folder, prefix)
    cache = str(tmp_path / "cache")
    with distload.WorkerGroup(device="cpu") as group:
        loader = distload.Loader(uri, "safetensors", {"cache_dir": cache}, group=group)
        plan = loader.plan()  # the version is read here
        with open(files[0], "rb") as f:
            data = bytearray(f.read())
        data[-1] ^= 0xFF
        store.put(f"{prefix}/{os.path.basename(files[0])}", bytes(data))
        with pytest.raises(CheckpointError, match="it was written again while it was being loaded"):
            dict(loader.stream(plan))
    (key,) = entry_folders(cache)
    with open(os.path.join(cache, LAYOUT, "entries", key, "blocks"), "rb") as f:
        assert not any(f.read())  # no block of the old version's entry was kept


def test_two_jobs_filling_one_cache_at_once_each_load_exactly_and_the_store_serves_it_once(
        store, llama, through_proxy, tmp_path):
    spec, cache = str(tmp_path / "spec.json"), str(tmp_path / "cache")
    with open(spec, "w") as f:
        json.dump([{"source": llama.uri, "format": "auto", "extra": {"cache_dir": cache}}], f)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = "1"
    script = os.path.join(TESTS, "store_load_driver.py")
    jobs = [subprocess.Popen([sys.executable, script, spec, str(tmp_path / f"out{i}.json")], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for job in jobs:
        out, err = job.communicate(timeout=240)
        assert job.returncode == 0, err[-3000:]
    reports = [json.load(open(tmp_path / f"out{i}.json"))[0]["ranks"][0] for i in range(2)]
    assert [r["digest"] for r in reports] == [plain_digest(llama.files)] * 2
    assert sum(r["store_bytes"] for r in reports) == llama.nbytes  # each block fetched by one of them
    assert through_proxy.served <= 1.05 * llama.nbytes, (through_proxy.served, llama.nbytes)


def test_a_cache_in_the_environment_with_run_ai_is_refused_while_planning(store, llama, through_proxy, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("DISTLOAD_CACHE_DIR", str(tmp_path / "cache"))
    with distload.WorkerGroup(device="cpu") as group:
        with pytest.raises(ConfigError, match="DISTLOAD_CACHE_DIR is set, and --load-format runai_streamer reads "
                                              "with Run:ai"):
            distload.Loader(llama.uri, "runai_streamer", group=group).plan()
        # auto takes distload's ranged reads instead, through the cache
        assert distload.Loader(llama.uri, "auto", group=group).plan().choice.backend == "ranged"


@pytest.mark.slow
def test_two_ranks_share_the_read_into_the_node_cache_from_the_command_line(store, llama, tmp_path):
    """2 ranks, --cache-dir: the shared read's ranks each fetch their share into the
    node's cache (each block once per job); the next job's ranks, TP 2 this time, take it all
    from there."""
    from conftest import run_distload

    cache, report_path = str(tmp_path / "cache"), str(tmp_path / "report.json")
    stored = []
    for tp in (None, 2):
        result = run_distload(["load", llama.uri, "--cache-dir", cache, "--report-json", report_path, "--no-progress"]
                              + ([] if tp is None else ["--tensor-parallel-size", str(tp)]),
                              nproc=2, env={**store.env(), "DISTLOAD_CACHE_DIR": ""}, timeout=240)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "node cache" in result.stdout
        ranks = json.load(open(report_path))["ranks"]
        assert [r["path"] for r in ranks] == ["ranged-shared"] * 2
        expected = [plain_digest(llama.files)] * 2 if tp is None else [plain_digest(f) for f in llama.tp[2]]
        assert [r["digest"] for r in ranks] == expected, tp
        stored.append(sum(r["store_bytes"] for r in ranks))
    assert stored == [llama.nbytes, 0]


@pytest.mark.slow
@pytest.mark.parametrize("store", ["s3rver"], indirect=True)  # the exchange is the store's; one is enough
def test_the_ranks_that_receive_a_shared_read_fill_their_own_node_cache_too(store, llama, tmp_path):
    """Two ranks, each with its own cache folder (two nodes): each fetches about half the blocks
    and receives the rest from its peer, and keeps both (a file's first block with the header's
    bytes every rank has). Then either alone loads from its cache: the store serves it its
    listing, nothing else."""
    from object_store_servers import ByteCountingProxy

    caches = [str(tmp_path / f"node{r}") for r in range(2)]
    spec, out = str(tmp_path / "spec.json"), str(tmp_path / "out.json")
    with open(spec, "w") as f:
        json.dump([{"source": llama.uri, "format": "auto", "extra": {"distributed": True},
                    "rank_extra": {str(r): {"cache_dir": caches[r]} for r in range(2)}}], f)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS + tuple(store.unset_keys())}
    env.update({**store.env(), "OMP_NUM_THREADS": "1", "DISTLOAD_CACHE_DIR": "",
                "PYTHONPATH": os.pathsep.join([os.path.dirname(TESTS)] + sys.path)})
    result = run_job([os.path.join(TESTS, "store_load_driver.py"), spec, out], 2, 240, env)
    assert result.returncode == 0, result.stderr[-3000:]
    (report,) = json.load(open(out))
    ranks = report["ranks"]
    assert [r["path"] for r in ranks] == ["ranged-shared"] * 2, report
    assert [r["digest"] for r in ranks] == [plain_digest(llama.files)] * 2
    # each rank fetched its share (whole blocks: a block two buckets share is fetched by both
    # nodes), and kept what it received from the other in its own cache
    assert all(r["store_bytes"] < 0.7 * llama.nbytes for r in ranks), ranks
    assert all(r["cache_received_bytes"] > 0.3 * llama.nbytes for r in ranks), ranks
    proxy = ByteCountingProxy(store.port)
    try:
        with pytest.MonkeyPatch.context() as patch:
            for key in LAUNCH_VARS + tuple(store.unset_keys()):
                patch.delenv(key, raising=False)
            for key, value in store.env(proxy.port).items():
                patch.setenv(key, value)
            patch.delenv("DISTLOAD_CACHE_DIR", raising=False)
            for cache in caches:
                before = proxy.served
                alone = cached_load(llama.uri, cache)
                assert alone.digest == plain_digest(llama.files)
                assert alone.store_bytes == 0 and proxy.served - before < 16 * 1024, (cache, alone)
    finally:
        proxy.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_azure_in_private_namespace(tmp_path):
    """This module's store tests against Azurite, inside ``unshare -rnm`` with a test CA bound
    over the system bundle (Run:ai's and the SDK's HTTPS trust it there only): as
    test_object_stores.py runs its Azure half."""
    if IN_AZURE_NAMESPACE:
        pytest.skip("the inner run")
    import shutil

    from object_store_servers import in_ci, make_test_certificates

    unshare = shutil.which("unshare")
    azurite = os.path.join(TESTS, "node", "node_modules", ".bin", "azurite-blob")
    works = unshare is not None and subprocess.run([unshare, "-rnm", "true"], capture_output=True).returncode == 0
    if not (works and os.path.exists(azurite)):
        message = "Azure tests need Azurite (cd tests/node && npm ci) and unshare -rnm"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    certs = make_test_certificates(str(tmp_path / "certs"))
    inner = (
        "set -e; ip link set lo up; "
        f"mount --bind {certs['bundle.pem']} /etc/ssl/certs/ca-certificates.crt; "
        f"exec {sys.executable} -m pytest -q -p no:cacheprovider -p no:xdist -k 'azure and not private' "
        f"{os.path.abspath(__file__)} -o addopts='' --timeout 500"
    )
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update({"DISTLOAD_AZURE_NAMESPACE": "1", "DISTLOAD_AZURE_CERT_DIR": os.path.dirname(certs["ca.pem"])})
    result = subprocess.run([unshare, "-rnm", "bash", "-c", inner], capture_output=True, text=True, timeout=560,
                            env=env, cwd=os.path.dirname(TESTS))
    output = result.stdout + result.stderr
    print(output[-4000:])
    assert result.returncode == 0, output[-8000:]
    assert " passed" in output and " failed" not in output
