"""``distload pull SRC DEST``: a checkpoint folder copied onto every node, each byte read once per job.

Engines that read local files (vLLM's own loaders, a training job's DCP reader) want the
checkpoint on each node's disk. Run:ai's ``pull_files`` copies it per process, so a job of N nodes
downloads it N times. Here the ranks of the whole job split the source's bytes into chunks, each
chunk read by one rank (round robin over the job) and broadcast over the job's group; the first
rank of each node (local rank 0) writes what it receives. So the store serves each byte once per
job, and every node ends with the whole folder.

What a user can rely on:

- **Agreement first.** Every rank lists the source (every file, subfolders included, as
  ``aws s3 sync`` and ``huggingface-cli download`` copy them; names relative to it with ``/``) and
  the lists must be identical before any byte moves (names, sizes, and for a local source each
  file's content fingerprint, for an object its version); a save still in progress (its marker) or
  a corrupt manifest is refused.
- **Nothing half-written is visible.** A file is written under ``.NAME.distload-tmp`` in DEST
  (the name loaders skip), checked, fsynced and renamed into place. The weights go first, then
  the other files, and the index and the manifest last, so a folder that has its manifest has
  everything. A process killed mid-pull leaves only complete files and hidden partials; a pull
  that fails removes its partials (a full disk is not left full of them), and a rerun removes
  those an earlier killed pull left before it writes.
- **Checked.** Every file's size; where the source has a distload manifest, each shard's SHA-256
  (computed as the chunks arrive, in order); an object's version, still the one listed before the
  file is renamed into place. A mismatch fails the pull naming the file.
- **Rerun.** A file already in DEST with the right size (and SHA-256 where known) is kept on that
  node; the others are fetched again from the start (partials are rewritten). Only files some
  node lacks are read, once.
- **Bounded failure.** After each round (one chunk per rank) every rank says whether its read and
  its writes worked: a failed read or write ends every rank with that rank and its error named,
  and a rank that dies ends the others at the group's timeout.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from distload.errors import CheckpointError, GroupError
from distload.fileio import NO_SPACE, TEMPORARY_SUFFIX, temporary_name
from distload.workers.group import WorkerGroup, collective_cause
from distload.loading.manifest import MANIFEST_NAME, SAVING_MARKER, read_manifest
from distload.loading.shared_reads.rounds import run_rounds
from distload.loading.sources import Source, content_fingerprint, open_source

CHUNK_BYTES = 64 * 1024 * 1024
# Each rank has at most this many of its chunks read or being read: this round's and the next
# round's (the round engine one round ahead).
CHUNKS_IN_FLIGHT = 2
# Written last, in this order: a folder with its index (and its manifest) has every other file.
LAST_NAMES = ("model.safetensors.index.json", MANIFEST_NAME)


@dataclass(frozen=True)
class SourceFile:
    name: str
    size: int
    sha256: Optional[str]  # from the source's distload manifest, where it has one
    # An object's version when it was listed (its size is of that version): a file whose object is
    # written again before its last byte is pulled fails, never a mix of two versions.
    version: Optional[str] = None


@dataclass
class PullReport:
    rank: int
    hostname: str
    writes: bool  # this rank writes its node's copy (local rank 0)
    dest: str
    files: int  # files in the source
    fetched: list[str] = field(default_factory=list)  # written on this node by this pull
    kept: list[str] = field(default_factory=list)  # already complete on this node
    requested_bytes: int = 0  # bytes this rank read from the source
    written_bytes: int = 0
    seconds: float = 0.0


def list_source(src: Source) -> list[SourceFile]:
    """The files of the source folder (or the one file it names), in the order a pull writes them."""
    if src.is_file:  # one .safetensors file: that file only, not its folder
        name = os.path.basename(src.uri.rstrip("/"))
        if src.remote:
            ((size, version),) = src.stats([name])
            return [SourceFile(name, size, None, version)]
        return [SourceFile(name, src.file_size(name), None)]
    names = src.names()
    if SAVING_MARKER in names:
        read_manifest(src)  # raises: a save into the folder did not finish
    manifest = read_manifest(src) if MANIFEST_NAME in names else None
    sha = {f.name: f.sha256 for f in manifest.files} if manifest else {}
    files = [n for n in _every_file(src) if not os.path.basename(n).endswith(TEMPORARY_SUFFIX)]
    if not files:
        raise CheckpointError(f"{src.uri}: nothing to pull: the folder holds no files")

    def order(name: str) -> tuple[int, int, str]:
        if name in LAST_NAMES:  # the top-level index and manifest only ("/" never in LAST_NAMES)
            return (2, LAST_NAMES.index(name), name)
        return (0 if name.endswith(".safetensors") else 1, 0, name)

    files = sorted(files, key=order)
    if src.remote:
        return [SourceFile(n, size, sha.get(n), version) for n, (size, version) in zip(files, src.stats(files))]
    return [SourceFile(n, src.file_size(n), sha.get(n)) for n in files]


def _every_file(src: Source) -> list[str]:
    """Every file below the folder, subfolders included (a Hugging Face repository's
    ``1_Pooling/config.json``, ``original/consolidated.00.pth``), as names relative to it with
    ``/``: what ``aws s3 sync`` and ``huggingface-cli download`` copy. An object name that would
    leave DEST (a ``..`` or empty segment, as a hand-made key can hold) is refused."""
    if src.remote:
        names = sorted(src.store.list(src.folder_location, recursive=True).objects)
    else:
        names = []
        for root, folders, files in os.walk(src.folder):
            folders.sort()
            for name in files:
                path = os.path.join(root, name)
                if os.path.isfile(path):  # a dangling link, a FIFO: not a file to copy
                    names.append(os.path.relpath(path, src.folder).replace(os.sep, "/"))
        names.sort()
    for name in names:
        parts = name.split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise CheckpointError(f"{src.path(name)}: its name has a {'..' if '..' in parts else 'empty'} "
                                  f"path segment, which would not land inside DEST; rename the object")
    return names


def _file_sha256(path: str) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(16 * 1024 * 1024):
            hasher.update(block)
    return hasher.hexdigest()


def _complete(dest: str, entry: SourceFile) -> bool:
    path = os.path.join(dest, entry.name)
    try:
        if not os.path.isfile(path) or os.path.getsize(path) != entry.size:
            return False
    except OSError:
        return False
    return entry.sha256 is None or _file_sha256(path) == entry.sha256


def _read_range(src: Source, name: str, start: int, end: int) -> bytes:
    if src.remote:
        return src.store.read(src.folder_location.child(name), start, end)
    with open(src.path(name), "rb") as f:
        data = os.pread(f.fileno(), end - start, start)
    if len(data) != end - start:
        raise CheckpointError(f"{src.path(name)}: ended at byte {start + len(data)}, but the listing "
                              f"said {name} has more: was it changed during the pull?")
    return data


class _NodeCopy:
    """The files this node's writer is fetching: partial files, their hashes, their checks."""

    def __init__(self, dest: str, report: PullReport, version_now: Callable[[str], Optional[str]] | None = None):
        self.dest = dest
        self.report = report
        self.version_now = version_now  # an object's version now, by name (object-store sources)
        self._open: dict[str, tuple[int, "hashlib._Hash", SourceFile]] = {}

    def start(self, entry: SourceFile) -> None:
        partial = temporary_name(os.path.join(self.dest, entry.name))
        os.makedirs(os.path.dirname(partial), exist_ok=True)  # a subfolder of the source
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._open[entry.name] = (fd, hashlib.sha256(), entry)

    def write(self, name: str, offset: int, data: memoryview) -> None:
        fd, hasher, _ = self._open[name]
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], offset + done)
        hasher.update(data)
        self.report.written_bytes += len(data)

    def finish(self, name: str) -> None:
        fd, hasher, entry = self._open.pop(name)
        partial = temporary_name(os.path.join(self.dest, name))
        try:
            os.fsync(fd)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size != entry.size:
            os.unlink(partial)
            raise CheckpointError(f"{name}: pulled {size} bytes, the source listed {entry.size}")
        if entry.sha256 is not None and hasher.hexdigest() != entry.sha256:
            os.unlink(partial)
            raise CheckpointError(f"{name}: SHA-256 of the pulled bytes is {hasher.hexdigest()}, the "
                                  f"source's manifest says {entry.sha256}: the source file changed or is "
                                  f"corrupt (distload verify checks it); nothing was written under DEST")
        if entry.version is not None and self.version_now is not None:
            now = self.version_now(name)
            if now != entry.version:
                os.unlink(partial)
                raise CheckpointError(f"{name}: the object was written again during the pull (version "
                                      f"{entry.version} when listed, now {now}), so the pulled bytes may mix two "
                                      f"versions; nothing was written under DEST for it: pull again")
        os.replace(partial, os.path.join(self.dest, name))
        self.report.fetched.append(name)

    def discard(self, name: str) -> None:
        """Close and remove ``name``'s partial file: it is never resumed (a rerun fetches the
        file from the start), and on a full disk it holds the space the next try needs."""
        if name not in self._open:
            return
        fd, _, _ = self._open.pop(name)
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temporary_name(os.path.join(self.dest, name)))

    def abandon(self) -> None:
        for name in list(self._open):
            self.discard(name)


def pull(source: str, dest: str, *, group: WorkerGroup | None = None,
         chunk_bytes: int = CHUNK_BYTES) -> PullReport:
    """Copy the folder ``source`` (local or ``s3://``/``gs://``/``az://``) to ``dest`` on every node.

    Call on every rank of ``group`` (None: a CPU group from the environment). ``dest`` is a local
    folder (created); relative paths are each process's own.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    with WorkerGroup.for_call(group, device="cpu") as g:
        return _pull(source, os.path.abspath(dest), g, chunk_bytes)


def _pull(source: str, dest: str, g: WorkerGroup, chunk_bytes: int) -> PullReport:
    start_time = time.perf_counter()
    writes = g.local_rank == 0
    # Agreed, as the listing: a source that is not there fails every rank, in one line for the job.
    src = g.agree("opening the source", lambda: open_source(source))
    listing = g.agree("listing the source", lambda: list_source(src))
    prints = g.agree("comparing the source's content", lambda: _fingerprints(src, listing))
    listings = g.exchange([(f.name, f.size, f.sha256, fp) for f, fp in zip(listing, prints)])
    for rank, other in enumerate(listings):
        if other != listings[0]:
            raise CheckpointError(
                f"{source}: ranks 0 and {rank} see different files ({len(listings[0])} against "
                f"{len(other)}; first difference: {_first_difference(listings[0], other)}); every "
                f"rank must see the same source (is it changing, or another copy on another node?)")
    report = PullReport(g.rank, g.hostname, writes, dest, len(listing))

    def check_node() -> list[str]:
        if not writes:
            return []
        try:
            os.makedirs(dest, exist_ok=True)
            probe = temporary_name(os.path.join(dest, "write-check"))
            open(probe, "wb").close()
            os.unlink(probe)
        except OSError as exc:
            raise CheckpointError(f"{dest}: cannot write there ({exc.strerror or exc}) on "
                                  f"{g.hostname}: DEST must be a writable local folder") from None
        lacking = []
        for entry in listing:
            if _complete(dest, entry):
                report.kept.append(entry.name)
            else:
                lacking.append(entry.name)
                # A partial an earlier pull left (it was killed): rewritten from the start anyway,
                # and until then it holds disk space this pull needs.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temporary_name(os.path.join(dest, entry.name)))
        return lacking

    lacking = g.agree("checking what each node has", check_node)
    wanted = set().union(*g.exchange(lacking))
    here = set(lacking)
    fetch = [entry for entry in listing if entry.name in wanted]
    chunks = [(entry, offset, min(entry.size, offset + chunk_bytes))
              for entry in fetch for offset in range(0, max(entry.size, 1), chunk_bytes)]
    copy = _NodeCopy(dest, report, (lambda name: src.stats([name])[0][1]) if src.remote else None)
    try:
        _transfer(src, g, chunks, here, copy, report)
    finally:
        copy.abandon()
    if writes:
        for folder in sorted({os.path.dirname(os.path.join(dest, n)) for n in report.fetched} | {dest}):
            _sync_folder(folder)
    g.check_all_ok("pulling")
    report.seconds = round(time.perf_counter() - start_time, 6)
    return report


def _first_difference(a: list, b: list) -> str:
    for x, y in zip(a, b):
        if x[:2] == y[:2]:
            if x != y:
                return f"{x[0]}: the same size, other contents"
        elif x != y:
            return f"{x[0]} ({x[1]} bytes) against {y[0]} ({y[1]} bytes)"
    return f"{len(a)} files against {len(b)}"


# A local file that is not safetensors (config, tokenizer) is fingerprinted from this many bytes on
# like a safetensors file's data (whole where it is smaller): its first bytes, then a block a MiB.
PLAIN_FILE_HEAD_BYTES = 64 * 1024


def _fingerprints(src: Source, listing: list[SourceFile]) -> list[str]:
    """For a local source, each file's content fingerprint (as shared reads compare them: two
    nodes may hold different files at the same path); for an object, its version."""
    if src.remote:
        return [entry.version or "" for entry in listing]
    from distload.loading.index import FileInfo

    prints = []
    for entry in listing:
        path = src.path(entry.name)
        if entry.name.endswith(".safetensors"):
            info = src.read_headers([path])[0]
            prints.append(content_fingerprint(info))
        else:
            prints.append(content_fingerprint(FileInfo(path, entry.size, (), None),
                                              min(entry.size, PLAIN_FILE_HEAD_BYTES)))
    return prints


def _transfer(src: Source, g: WorkerGroup, chunks: list, here: set[str], copy: _NodeCopy,
              report: PullReport) -> None:
    """Rounds of one chunk per rank (the round engine of shared reads): each rank reads its own
    (ahead), every rank says it is fine, then each chunk is broadcast from its reader and written
    where this node needs it. A write that failed is told to every rank in the next round's
    agreement, or after the last round."""
    world = g.world_size
    reads: dict[int, Future] = {}
    error: Optional[BaseException] = None
    with ThreadPoolExecutor(CHUNKS_IN_FLIGHT, thread_name_prefix="distload-pull") as pool:

        def read(r: int) -> None:  # this rank's chunk of round r
            k = r * world + g.rank
            if k < len(chunks):
                entry, start, end = chunks[k]
                reads[k] = pool.submit(_read_range, src, entry.name, start, end)

        def take(r: int) -> Optional[bytes]:
            if error is not None:  # a write of the round before
                raise error
            own = r * world + g.rank
            if own >= len(chunks):
                return None
            data = reads.pop(own).result()
            report.requested_bytes += len(data)
            return data

        rounds = run_rounds(g, -(-len(chunks) // world), "pulling", read, take, ahead=CHUNKS_IN_FLIGHT - 1,
                            describe=lambda exc: f"{type(exc).__name__}: {exc}")
        for r, data in enumerate(rounds):
            for k in range(r * world, min((r + 1) * world, len(chunks))):
                entry, start, end = chunks[k]
                owner = k % world
                buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if owner == g.rank and end > start
                          else torch.empty(end - start, dtype=torch.uint8))
                if world > 1 and end > start:
                    try:
                        dist.broadcast(buffer, src=g.ranks[owner], group=g.process_group)
                    except Exception as exc:
                        doing = ("while sending" if owner == g.rank else f"while rank {owner} sent")
                        raise GroupError(f"rank {g.rank}: lost contact with the other ranks {doing} {entry.name} "
                                         f"bytes {start}-{end}: {collective_cause(exc)}{g.lost_peers(exc)}") from exc
                if error is None and entry.name in here:
                    try:
                        if start == 0:
                            copy.start(entry)
                        copy.write(entry.name, start, memoryview(buffer.numpy()))
                        if end >= entry.size:
                            copy.finish(entry.name)
                    except OSError as exc:  # a full disk, a folder removed under the pull
                        error = _write_failed(copy, entry, exc, chunks, here, g.hostname)
                    except BaseException as exc:  # reported in the next round, or below
                        error = exc
        if error is not None:
            g.report_failure("pulling", error)
            raise error


def _write_failed(copy: _NodeCopy, entry: SourceFile, exc: OSError, chunks: list, here: set[str],
                  hostname: str) -> CheckpointError:
    """The error for a failed write into DEST, after removing the file's partial: for a full disk,
    how much this node still lacks and how much is free once the partial is gone (the partial
    itself was what filled it, so the advice must count without it)."""
    path = os.path.join(copy.dest, entry.name)
    copy.discard(entry.name)
    if exc.errno not in NO_SPACE:
        return CheckpointError(f"{path}: writing it failed on {hostname} ({exc.strerror or exc}); DEST keeps "
                               f"only complete files (the partial one was removed): run the pull again")
    done = set(copy.report.fetched)
    lacking = sum({e.name: e.size for e, _, _ in chunks if e.name in here and e.name not in done}.values())
    try:
        free: int | None = shutil.disk_usage(copy.dest).free
    except OSError:
        free = None
    short = f"free at least {lacking - free} more bytes" if free is not None and lacking > free else "free space"
    return CheckpointError(
        f"{path}: no space left on {hostname} to write it: the files this node still lacks hold {lacking} "
        f"bytes, and {'an unknown number of' if free is None else free} bytes are free there now that the "
        f"pull's own partial file ({os.path.basename(temporary_name(path))}) is removed; {short} or pull to "
        f"another folder, then run the pull again (DEST keeps only complete files: the "
        f"{len(done) + len(copy.report.kept)} complete file(s) there are kept)")


def _sync_folder(path: str) -> None:
    """The renames are durable once the folder is synced."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
