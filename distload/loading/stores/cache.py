"""The node cache: object-store bytes kept on a node's local disk, for every later load there.

``--cache-dir DIR`` (``DISTLOAD_CACHE_DIR``, the extra-config key ``cache_dir``) on a load from
``s3://``, ``gs://`` or ``az://``: distload's ranged reads take each byte range from the cache
where it is there and complete, and fetch only what is missing from the store, keeping it. The
unit is the object's bytes, not a format's or a TP rank's view of them, so a TP 4 load is served
by what a TP 2 load (or a sliced one, or another job) left, and a partial hit fetches only the
missing blocks. The layout (docs/cache.md says the same for an operator)::

    DIR/distload-cache-v1/
      entries/<sha256(uri)[:24]>-<sha256(version, size)[:16]>/   one object version
        lock        held shared (flock) by every process using the entry; eviction takes it
                    exclusive, so it never removes an entry in use; its mtime is the last use
                    (set when a load opens the entry and when it closes it)
        data        the object's bytes at their own offsets (a sparse file of the object's size)
        blocks      one 16-byte record per BLOCK_BYTES block: magic, CRC-32C of the block's
                    bytes, block number, CRC-32 of the record (with the entry's key)
        meta.json   the URI, version and size, for a person looking
      trash/        entries being removed (renamed there first, so no half-removed entry is
                    ever under entries/)

**Keyed by version.** The key holds the object's ETag (S3, Azure) or generation (GCS) as the
prefix's listing gives it while planning (or its header read, where the cache lacks the
header's bytes); an object written again has another version, so another entry, and its old
entry is removed once no process uses it. Bytes are fetched for the cache only with that version
as a precondition, and the answer's version is compared as well (``ObjectStore.read_version``):
bytes of another version are never kept. So a warm load asks the store for the listing alone:
the index and config.json are read through the cache, each header from its first block
(``cached_head``), and no object is asked its version after the load (every byte was of the
version planned with).

**A warm read** (``read_scatter``) reads each block once, ``preadv`` straight into the tensors
its bytes go to, and checks its CRC-32C there (``crc.py``: in place, a 256 KiB piece at a time
while it is still in the core's cache); the bytes no tensor takes only pass through a small
sink to be checked.

**Every node a shared read passes through** keeps what its rank received from the others
(``offer``): the blocks the received bytes cover whole and that have no valid record yet, under
the same lock as a fetch (tried, never waited for: a writer holding it finishes those blocks),
bytes before records (a block two received buckets share: once the second arrives, the ranged
reader carrying the first's part; a file's first block: with the header's raw bytes, which a
load through a cache keeps from planning, ``FileInfo.head``).

**Complete or absent.** A block counts only where its record is valid and the CRC-32C of the
bytes read now matches it. A writer writes the data first and the record after; a process killed
between the two, a torn record, a power loss before the page cache reached the disk, a byte
flipped on disk: each is a block that is missing (a valid record over other bytes is *corrupt*:
logged, counted in the report, fetched again). No fsync is needed for that (every read checks).

**One writer per range.** A process filling blocks takes an exclusive OFD lock (``fcntl``
F_OFD_SETLK: it conflicts between threads too, and the kernel drops it when the process dies)
on their records' bytes in ``blocks``, then checks again what another writer filled while it
waited, and fetches only the rest. Readers take no lock: what they read is checked.

**A size bound** (``--cache-max-gib``, ``DISTLOAD_CACHE_MAX_GIB``, ``cache_max_gib``) evicts the
least recently used entries not in use, by the disk space their files take (sparse: only filled
blocks count), when an entry is opened and when a load ends.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from distload.errors import CheckpointError, ConfigError
from distload.fileio import write_json_atomic
from distload.loading.index import MAX_HEADER_BYTES
from distload.loading.stores.crc import PIECE_BYTES, crc32c
from distload.loading.stores.crc import check_available as check_crc_available

log = logging.getLogger("distload")

CACHE_DIR_VARIABLE = "DISTLOAD_CACHE_DIR"
CACHE_MAX_VARIABLE = "DISTLOAD_CACHE_MAX_GIB"
LAYOUT = "distload-cache-v1"
# The unit of presence, checking and locking. A fetch is rounded out to whole blocks (at most
# two more per range than asked for: the ranged reader already fetches across gaps of 1 MiB), and
# a block is read whole to be checked.
BLOCK_BYTES = 1 << 20
RECORD_FORMAT = "<4sIII"  # magic, CRC-32C of the block, block number, CRC-32 of the record
RECORD_BYTES = 16
MAGIC = b"DLCC"  # CRC-32C
# How long a process waits for another filling the same blocks (which holds the lock only while
# its fetch runs, itself bounded by the store's timeouts) before it gives up with an error.
LOCK_WAIT_S = 600.0
GIB = 1024**3


def check_cache_dir(key: str, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"extra config '{key}' must be a folder path (a non-empty string), got {value!r}")


def check_cache_max_gib(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"extra config '{key}' must be a number of GiB above 0, got {value!r}")


@dataclass(frozen=True)
class CacheSettings:
    folder: str  # the cache's root (DIR above), absolute
    max_bytes: int | None  # None: no bound


def cache_settings(extra: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> CacheSettings | None:
    """The node cache a load uses: the extra config's keys, else the environment's (None: none)."""
    folder = extra.get("cache_dir") or environ.get(CACHE_DIR_VARIABLE, "").strip()
    if not folder:
        return None
    limit = extra.get("cache_max_gib")
    if limit is None and environ.get(CACHE_MAX_VARIABLE, "").strip():
        text = environ[CACHE_MAX_VARIABLE]
        try:
            limit = float(text)
        except ValueError:
            limit = None
        if limit is None or not limit > 0:
            raise ConfigError(f"{CACHE_MAX_VARIABLE}={text!r}: give the node cache's size bound in GiB, a number "
                              f"above 0 (or unset it: no bound)")
    return CacheSettings(os.path.abspath(os.path.expanduser(folder)),
                         None if limit is None else max(1, int(limit * GIB)))


def _lock_range(fd: int, start: int, length: int, deadline: float) -> bool:
    """An exclusive OFD lock on ``[start, start + length)`` of ``fd``'s file; False at the deadline."""
    arg = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, start, length, 0)
    pause = 0.002
    while True:
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, arg)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(0.05, pause * 2)


def _read_all(fd: int, views: list[memoryview], offset: int) -> int:
    """Bytes read into ``views`` (in order) from ``offset``: all of them, fewer only at the end
    of the file (one call but where the kernel returns short)."""
    total = sum(len(v) for v in views)
    done = os.preadv(fd, views, offset)
    while 0 < done < total:
        rest, skip = [], done
        for view in views:
            if skip >= len(view):
                skip -= len(view)
                continue
            rest.append(view[skip:])
            skip = 0
        n = os.preadv(fd, rest, offset + done)
        if n == 0:
            break
        done += n
    return done


def _contiguous(view: memoryview, lo: int) -> "Callable[[int, int], list[memoryview]]":
    """``memory`` for ``_check`` where file bytes go to one buffer that starts at offset ``lo``."""
    return lambda a, b: [view[a - lo:b - lo]]


def _write_all(fd: int, data, offset: int) -> None:
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class _Entry:
    """One object version in the cache, open (and held in use) by this process."""

    def __init__(self, cache: "NodeCache", uri: str, version: str, size: int):
        self.cache = cache
        self.uri, self.version, self.size = uri, version, size
        self.uri_key = hashlib.sha256(uri.encode()).hexdigest()[:24]
        self.key = f"{self.uri_key}-{hashlib.sha256(f'{version}/{size}'.encode()).hexdigest()[:16]}"
        self.salt = self.key.encode()
        self.folder = os.path.join(cache.entries, self.key)
        self.nblocks = -(-size // BLOCK_BYTES)
        self.lock = self._open_in_use()
        try:
            self.data = os.open(os.path.join(self.folder, "data"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self.records = os.open(self.records_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            # Sized, never shrunk: two processes opening it at once both extend to the same size.
            if os.fstat(self.data).st_size < size:
                os.ftruncate(self.data, size)
            if os.fstat(self.records).st_size < self.nblocks * RECORD_BYTES:
                os.ftruncate(self.records, self.nblocks * RECORD_BYTES)
            meta = os.path.join(self.folder, "meta.json")
            if not os.path.exists(meta):
                write_json_atomic(meta, {"uri": uri, "version": version, "size": size, "block_bytes": BLOCK_BYTES})
        except OSError as exc:
            os.close(self.lock)
            raise CheckpointError(f"{self.folder}: cannot use this node cache entry ({exc.strerror or exc}); "
                                  f"check the cache folder's space and permissions") from None

    @property
    def records_path(self) -> str:
        return os.path.join(self.folder, "blocks")

    def _open_in_use(self) -> int:
        """The entry's lock file, held shared. Eviction renames an entry away while holding it
        exclusive: if that happened between our mkdir and our lock, ours is a removed file (its
        inode no longer at the path), and we start again."""
        path = os.path.join(self.folder, "lock")
        for _ in range(100):
            try:
                os.makedirs(self.folder, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:
                continue  # removed between the two calls
            except OSError as exc:
                raise CheckpointError(f"{self.folder}: cannot create this node cache entry "
                                      f"({exc.strerror or exc}); check the cache folder") from None
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.utime(fd)  # the last use: the LRU order
                return fd
            os.close(fd)
        raise CheckpointError(f"{self.folder}: this node cache entry was removed 100 times while being "
                              f"opened; is another process clearing the cache?")

    def close(self) -> None:
        try:
            os.utime(self.lock)  # in use until now: the last use
        except OSError:
            pass
        for fd in (self.data, self.records, self.lock):
            os.close(fd)

    # -- blocks ----------------------------------------------------------------------------------
    def _span(self, i: int) -> tuple[int, int]:
        return i * BLOCK_BYTES, min(self.size, (i + 1) * BLOCK_BYTES)

    def _record(self, i: int, raw: bytes) -> int | None:
        """The block's CRC-32C from a valid record, else None (never written, torn, misplaced)."""
        if len(raw) != RECORD_BYTES:
            return None
        magic, crc, number, check = struct.unpack(RECORD_FORMAT, raw)
        if magic != MAGIC or number != i or check != zlib.crc32(raw[:12] + self.salt):
            return None
        return crc

    def _pack(self, i: int, crc: int) -> bytes:
        head = struct.pack("<4sII", MAGIC, crc, i)
        return head + struct.pack("<I", zlib.crc32(head + self.salt))

    def _check(self, first: int, last: int, memory: "Callable[[int, int], list[memoryview]]", fd: int,
               again: bool = False) -> list[int]:
        """Read blocks ``first..last`` from the data file into ``memory(start, end)`` (the views
        that file bytes ``[start, end)`` go to, in order) and check them: the blocks that are not
        complete. ``again``: the second look, under the lock (a corrupt block was told of at the
        first)."""
        raw = os.pread(fd, (last + 1 - first) * RECORD_BYTES, first * RECORD_BYTES)
        bad = []
        for i in range(first, last + 1):
            crc = self._record(i, raw[(i - first) * RECORD_BYTES:(i - first + 1) * RECORD_BYTES])
            s, e = self._span(i)
            # Read and checked a piece at a time, while the piece is still in the core's cache
            # (crc.py). A block without a valid record is read all the same (the caller's memory
            # needs its bytes when it is filled), and counts as missing.
            got, at = 0, s
            while at < e:
                n = min(PIECE_BYTES, e - at)
                views = memory(at, at + n)
                if _read_all(self.data, views, at) < n:
                    break
                for view in views:
                    got = crc32c(view, got)
                at += n
            if at == e and crc is not None and got == crc:
                self.cache.count(cache=e - s)
                continue
            if crc is not None and not again:
                self.cache.count(corrupt=1)
                log.warning("node cache: block %d of %s (version %s) does not match its checksum: fetched again "
                            "(%s)", i, self.uri, self.version, self.folder)
            bad.append(i)
        return bad

    def read(self, start: int, end: int, fetch: Callable[[int, int], bytes],
             scratch: "Scratch | None" = None) -> memoryview:
        """Bytes ``[start, end)`` of the object: complete blocks from here, the rest fetched
        (``fetch(start, end)``: the store's bytes of this version) and kept. In ``scratch``'s
        memory where given (valid until its next use)."""
        first, last = start // BLOCK_BYTES, (end - 1) // BLOCK_BYTES
        lo, hi = self._span(first)[0], self._span(last)[1]
        view = (scratch or Scratch()).view(hi - lo)
        missing = self._check(first, last, _contiguous(view, lo), self.records)
        for a, b in _runs(missing):
            self._fill(a, b, view, lo, fetch)
        return view[start - lo:end - lo]

    def peek(self, start: int, end: int, scratch: "Scratch") -> memoryview | None:
        """Bytes ``[start, end)`` where every block they need is complete here (in ``scratch``'s
        memory), else None: nothing is fetched."""
        first, last = start // BLOCK_BYTES, (end - 1) // BLOCK_BYTES
        lo, hi = self._span(first)[0], self._span(last)[1]
        view = scratch.view(hi - lo)
        if self._check(first, last, _contiguous(view, lo), self.records):
            return None
        return view[start - lo:end - lo]

    def read_scatter(self, start: int, end: int, targets: list[tuple[int, memoryview]],
                     fetch: Callable[[int, int], bytes], scratch: "Scratch") -> None:
        """Bytes ``[start, end)`` of the object into ``targets`` ((file offset, memory: a tensor's),
        in file order, inside the range, not overlapping). Each block is read once, straight
        into the memory its bytes go to, and checked there; the bytes no target takes (gaps, the
        parts of the edge blocks outside the range: a block is checked whole) land in a small
        sink, a piece at a time, only to be checked. So several tensors in a row cost one read
        of their blocks, with no copy (and no large scratch memory: a new buffer costs a page
        fault per page). Blocks not complete here are fetched through ``scratch`` and copied
        out."""
        first, last = start // BLOCK_BYTES, (end - 1) // BLOCK_BYTES
        sink = scratch.view(PIECE_BYTES)  # _check asks for at most a piece at a time
        starts = [offset for offset, _ in targets]

        def memory(a: int, b: int) -> list[memoryview]:
            views, at, used = [], a, 0
            for offset, view in targets[max(0, bisect.bisect_right(starts, a) - 1):]:
                if offset >= b:
                    break
                top = offset + len(view)
                if top <= at:
                    continue
                if at < offset:
                    views.append(sink[used:used + offset - at])
                    used += offset - at
                    at = offset
                views.append(view[at - offset:min(b, top) - offset])
                at = min(b, top)
            if at < b:
                views.append(sink[used:used + b - at])
            return views

        for a, b in _runs(self._check(first, last, memory, self.records)):
            lo, hi = self._span(a)[0], self._span(b)[1]
            buffer = scratch.view(hi - lo)
            self._fill(a, b, buffer, lo, fetch)
            for offset, view in targets:
                x, y = max(lo, offset), min(hi, offset + len(view))
                if x < y:
                    view[x - offset:y - offset] = buffer[x - lo:y - lo]

    def read_into(self, start: int, end: int, out: memoryview, fetch: Callable[[int, int], bytes],
                  scratch: "Scratch") -> None:
        """Bytes ``[start, end)`` of the object into ``out`` (a tensor's memory)."""
        self.read_scatter(start, end, [(start, out)], fetch, scratch)

    def _fill(self, first: int, last: int, view: memoryview, lo: int, fetch: Callable[[int, int], bytes]) -> None:
        # Its own open file description: OFD locks then conflict with this process's other
        # threads as with other processes; closing it releases the lock.
        fd = os.open(self.records_path, os.O_RDWR | os.O_CLOEXEC)
        try:
            length = (last + 1 - first) * RECORD_BYTES
            if not _lock_range(fd, first * RECORD_BYTES, length, time.monotonic() + LOCK_WAIT_S):
                raise CheckpointError(
                    f"{self.uri}: waited {LOCK_WAIT_S:.0f} s for another process filling blocks {first}-{last} "
                    f"of it in the node cache ({self.folder}); is a load on this node stuck?")
            # What another writer filled while this one waited is complete now: checked, not fetched.
            for a, b in _runs(self._check(first, last, _contiguous(view, lo), fd, again=True)):
                start, end = self._span(a)[0], self._span(b)[1]
                data = fetch(start, end)
                self.cache.count(store=len(data))
                view[start - lo:end - lo] = data
                _write_all(self.data, data, start)  # the bytes first, then the records that vouch for them
                records = b"".join(self._pack(i, crc32c(view[self._span(i)[0] - lo:self._span(i)[1] - lo]))
                                   for i in range(a, b + 1))
                _write_all(fd, records, a * RECORD_BYTES)
        except OSError as exc:
            raise CheckpointError(f"{self.folder}: writing to the node cache failed ({exc.strerror or exc}); "
                                  f"free space there, or load without --cache-dir") from None
        finally:
            os.close(fd)

    def offer(self, segments: list[tuple[int, memoryview]]) -> int:
        """Keep bytes of this version that came from elsewhere (a peer's share of a shared read),
        without any fetch: ``segments`` (file offset, the bytes there), in file order. Only the
        blocks the segments cover whole, and only those without a valid record: a block being
        filled by another writer (its records locked) is left to it, never waited for. The same
        rules as ``_fill``: an exclusive lock on the blocks' records, the bytes first and the
        records after. Returns the bytes kept."""
        kept = 0
        for start, end, parts in _covered(segments):
            first = -(-start // BLOCK_BYTES)
            last = (self.nblocks if end >= self.size else end // BLOCK_BYTES) - 1
            if first > last:
                continue
            raw = os.pread(self.records, (last + 1 - first) * RECORD_BYTES, first * RECORD_BYTES)
            absent = [i for i in range(first, last + 1)
                      if self._record(i, raw[(i - first) * RECORD_BYTES:(i - first + 1) * RECORD_BYTES]) is None]
            for a, b in _runs(absent):
                kept += self._offer_blocks(a, b, parts)
        return kept

    def _offer_blocks(self, first: int, last: int, parts: list[tuple[int, memoryview]]) -> int:
        fd = os.open(self.records_path, os.O_RDWR | os.O_CLOEXEC)  # its own lock, as in _fill
        try:
            if not _lock_range(fd, first * RECORD_BYTES, (last + 1 - first) * RECORD_BYTES, time.monotonic()):
                # Another writer is filling some of them (and finishes them): the others one by one.
                return 0 if first == last else sum(self._offer_blocks(i, i, parts) for i in range(first, last + 1))
            raw = os.pread(fd, (last + 1 - first) * RECORD_BYTES, first * RECORD_BYTES)
            kept = 0
            for i in range(first, last + 1):
                if self._record(i, raw[(i - first) * RECORD_BYTES:(i - first + 1) * RECORD_BYTES]) is not None:
                    continue  # filled while we looked
                s, e = self._span(i)
                views = _slices(parts, s, e)
                crc = 0
                for view in views:
                    crc = crc32c(view, crc)
                at = s
                for view in views:  # the bytes first, then the record that vouches for them
                    _write_all(self.data, view, at)
                    at += len(view)
                _write_all(fd, self._pack(i, crc), i * RECORD_BYTES)
                kept += e - s
            return kept
        except OSError as exc:
            raise CheckpointError(f"{self.folder}: writing to the node cache failed ({exc.strerror or exc}); "
                                  f"free space there, or load without --cache-dir") from None
        finally:
            os.close(fd)

    def disk_bytes(self) -> int:
        return _disk_bytes(self.folder)


class Scratch:
    """Memory a reader reuses for its reads through the cache. A new 64 MiB buffer costs a page
    fault per page (the kernel zeroing it: measured slower than the read and the check together
    here); one buffer reused costs that once."""

    def __init__(self) -> None:
        self._buffer = bytearray(0)

    def view(self, nbytes: int) -> memoryview:
        if len(self._buffer) < nbytes:
            self._buffer = bytearray(nbytes)  # views of the old one (if any) keep it alive
        return memoryview(self._buffer)[:nbytes]


def _covered(segments: list[tuple[int, memoryview]]) -> list[tuple[int, int, list[tuple[int, memoryview]]]]:
    """Segments (file offset, bytes; in file order) as runs that cover ``[start, end)`` unbroken,
    each with its segments."""
    runs: list[tuple[int, int, list[tuple[int, memoryview]]]] = []
    for offset, view in segments:
        if not len(view):
            continue
        if runs and runs[-1][1] == offset:
            runs[-1][2].append((offset, view))
            runs[-1] = (runs[-1][0], offset + len(view), runs[-1][2])
        else:
            runs.append((offset, offset + len(view), [(offset, view)]))
    return runs


def _slices(parts: list[tuple[int, memoryview]], start: int, end: int) -> list[memoryview]:
    """The bytes ``[start, end)`` of an unbroken run of segments, as views of them in order."""
    out = []
    for offset, view in parts:
        a, b = max(start, offset), min(end, offset + len(view))
        if a < b:
            out.append(view[a - offset:b - offset])
    return out


def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i in blocks:
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def _disk_bytes(folder: str) -> int:
    total = 0
    for name in ("data", "blocks"):
        try:
            total += os.stat(os.path.join(folder, name)).st_blocks * 512
        except OSError:
            pass
    return total


class NodeCache:
    """The cache of one load on this process: entries opened as files are first read, the
    bytes each way counted (``cache_bytes``, ``store_bytes``, ``corrupt_blocks``), closed (and
    the size bound kept) at the end."""

    def __init__(self, settings: CacheSettings):
        self.settings = settings
        self.root = os.path.join(settings.folder, LAYOUT)
        self.entries = os.path.join(self.root, "entries")
        self.trash = os.path.join(self.root, "trash")
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._lock = threading.Lock()
        self.cache_bytes = 0
        self.store_bytes = 0
        self.corrupt_blocks = 0
        self.received_bytes = 0  # bytes received from peers and kept here (whole blocks)
        self.evicted = 0

    def check_writable(self) -> None:
        """Create the cache's folders and write there once: a cache that cannot work is an error
        while planning, on every rank, never a load that quietly reads the store instead."""
        check_crc_available()
        try:
            os.makedirs(self.entries, exist_ok=True)
            os.makedirs(self.trash, exist_ok=True)
            probe = os.path.join(self.trash, f"write-check-{os.getpid()}-{threading.get_ident()}")
            with open(probe, "wb") as f:
                f.write(b"x")
            os.unlink(probe)
        except OSError as exc:
            raise CheckpointError(f"{self.settings.folder}: cannot use it as the node cache ({exc.strerror or exc}); "
                                  f"--cache-dir ({CACHE_DIR_VARIABLE}) must be a writable local folder") from None

    def count(self, cache: int = 0, store: int = 0, corrupt: int = 0, received: int = 0) -> None:
        with self._lock:
            self.cache_bytes += cache
            self.store_bytes += store
            self.corrupt_blocks += corrupt
            self.received_bytes += received

    def entry(self, uri: str, version: str | None, size: int) -> _Entry:
        if version is None:
            raise CheckpointError(f"{uri}: the store gave no version (ETag or generation) for it, and the node "
                                  f"cache keeps only versioned bytes (else a rewritten object could be served "
                                  f"stale); load it without --cache-dir")
        with self._lock:
            entry = self._entries.get((uri, version))
            if entry is None:
                self.check_writable()
                entry = self._entries[(uri, version)] = _Entry(self, uri, version, size)
                opened = True
            else:
                opened = False
        if opened:
            self._drop_other_versions(entry)
            self.trim(reserve=max(0, size - entry.disk_bytes()))
        return entry

    def read(self, uri: str, version: str | None, size: int, start: int, end: int,
             fetch: Callable[[int, int], bytes], scratch: Scratch | None = None) -> memoryview:
        return self.entry(uri, version, size).read(start, end, fetch, scratch)

    def read_into(self, uri: str, version: str | None, size: int, start: int, end: int, out: memoryview,
                  fetch: Callable[[int, int], bytes], scratch: Scratch) -> None:
        self.entry(uri, version, size).read_into(start, end, out, fetch, scratch)

    def read_scatter(self, uri: str, version: str | None, size: int, start: int, end: int,
                     targets: list[tuple[int, memoryview]], fetch: Callable[[int, int], bytes],
                     scratch: Scratch) -> None:
        self.entry(uri, version, size).read_scatter(start, end, targets, fetch, scratch)

    def offer(self, uri: str, version: str | None, size: int, segments: list[tuple[int, memoryview]]) -> None:
        """Bytes of this object version received from a peer, kept where they complete blocks."""
        kept = self.entry(uri, version, size).offer(segments)
        self.count(received=kept)

    def close(self) -> None:
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            entry.close()
        self.trim()

    # -- removal ---------------------------------------------------------------------------------
    def _remove(self, key: str) -> bool:
        """Remove an entry nobody uses (False if one does)."""
        folder = os.path.join(self.entries, key)
        try:
            fd = os.open(os.path.join(folder, "lock"), os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = None  # a folder without its lock file: never complete, nobody holds it
        except OSError:
            return False
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False
            target = os.path.join(self.trash, f"{key}.{os.getpid()}.{time.monotonic_ns()}")
            try:
                os.rename(folder, target)
            except OSError:
                return False
        finally:
            if fd is not None:
                os.close(fd)
        shutil.rmtree(target, ignore_errors=True)
        return True

    def _drop_other_versions(self, entry: _Entry) -> None:
        """An object written again leaves its old version's entry behind: removed once unused."""
        try:
            keys = os.listdir(self.entries)
        except OSError:
            return
        for key in keys:
            if key.startswith(entry.uri_key + "-") and key != entry.key:
                self._remove(key)

    def trim(self, reserve: int = 0) -> None:
        """Evict the least recently used entries not in use until the cache (plus ``reserve``
        bytes about to be filled) fits the bound."""
        limit = self.settings.max_bytes
        if limit is None:
            return
        for name in _listdir(self.trash):  # what a removal killed midway left
            shutil.rmtree(os.path.join(self.trash, name), ignore_errors=True)
        found = []
        for key in _listdir(self.entries):
            folder = os.path.join(self.entries, key)
            try:
                used = os.stat(os.path.join(folder, "lock")).st_mtime_ns
            except OSError:
                used = 0
            found.append((used, key, _disk_bytes(folder)))
        total = sum(size for _, _, size in found) + reserve
        with self._lock:
            mine = {entry.key for entry in self._entries.values()}
        for _, key, size in sorted(found):
            if total <= limit:
                break
            if key not in mine and self._remove(key):
                total -= size
                with self._lock:
                    self.evicted += 1
        if total > limit:
            log.warning("node cache %s: %.3f GiB in use by loads on this node, above its bound of %.3f GiB; "
                        "what is in use stays until its loads end", self.settings.folder, total / GIB, limit / GIB)


def _listdir(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


# -- planning's reads: small objects and headers -------------------------------------------------
def read_whole(settings: CacheSettings, uri: str, version: str, size: int,
               fetch: Callable[[int, int], bytes]) -> bytes:
    """A small object's bytes (an index, a config.json) through the cache: the next load reads
    them from here, not from the store."""
    if size == 0:
        return b""
    cache = NodeCache(settings)
    try:
        return bytes(cache.read(uri, version, size, 0, size, fetch))
    finally:
        cache.close()


def cached_head(settings: CacheSettings, uri: str, version: str, size: int) -> bytes | None:
    """A safetensors object's length prefix and header (``[0, 8 + n)``) where the cache holds
    them complete for this version (the load before read the first tensors, so block 0), else
    None: nothing is fetched (the caller reads the header from the store, as without a cache)."""
    if size < 8:
        return None
    cache = NodeCache(settings)
    try:
        entry = cache.entry(uri, version, size)
        scratch = Scratch()
        first = entry.peek(0, min(size, BLOCK_BYTES), scratch)  # most headers fit in the first block
        if first is None:
            return None
        (length,) = struct.unpack("<Q", first[:8])
        if not 2 <= length <= MAX_HEADER_BYTES or 8 + length > size:
            return None  # the store's read names what is wrong with it
        head = first if 8 + length <= len(first) else entry.peek(0, 8 + length, scratch)
        return None if head is None else bytes(head[:8 + length])
    finally:
        cache.close()
