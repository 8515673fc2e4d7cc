"""Where checkpoint files come from: a local file or folder, or an object-store file or prefix.

Inside distload a source is a string, never a ``pathlib.Path`` (a Path turns ``s3://b/k`` into
``s3:/b/k``); :func:`source_string` turns what a user passes (a Path, ``S3://``) into one.
:func:`open_source` gives a :class:`LocalSource` or an :class:`ObjectSource`; both answer the same
questions (what is in the folder, how big is a file, its header, a small JSON file), so the loader,
``inspect`` and ``verify`` are written once. Object stores are listed one level deep, like a
folder: ``s3://bucket/model`` holds the objects ``model/*`` (not ``model/sub/*``); ``glob`` lists
below it (recursively, once) for the shard patterns that ask. A URI whose last segment ends in
``.safetensors`` names one object; any other URI is a prefix.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import hashlib
import json
import os
import stat
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence, TypeVar, Union

from distload.loading.index import MAX_HEADER_BYTES, CheckpointIndex, FileInfo, parse_header
from distload.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from distload.loading.stores.cache import CacheSettings

OBJECT_STORE_SCHEMES = ("s3://", "gs://", "az://")
INDEX_FILE = "model.safetensors.index.json"
# Header reads in flight at once on an object store (each is one or two small ranged GETs).
HEADER_READ_THREADS = 8


def is_object_store(source: str) -> bool:
    return source.startswith(OBJECT_STORE_SCHEMES)


def source_string(source: "str | os.PathLike[str]") -> str:
    """A source as distload's string: a ``pathlib.Path`` (or any os.PathLike) as its path, an
    object-store scheme in lower case (``S3://b/k`` -> ``s3://b/k``, as vLLM lower-cases it)."""
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str) or not source:
        raise ConfigError(f"source must be a non-empty path, pathlib.Path or URI string, got {source!r}")
    scheme, sep, rest = source.partition("://")
    if sep and f"{scheme.lower()}://" in OBJECT_STORE_SCHEMES:
        return f"{scheme.lower()}://{rest}"
    return source


def check_source(source: "str | os.PathLike[str]") -> str:
    """Validate the source; return it normalised (no trailing slash, user expanded).

    Local paths must exist; object-store URIs are only parsed here (no request is made).
    """
    source = source_string(source)
    if is_object_store(source):
        from distload.loading.stores import parse_uri

        return str(parse_uri(source))
    if "://" in source:
        raise ConfigError(f"{source}: unknown URI scheme; use a local path, s3://, gs:// or az://")
    path = os.path.expanduser(source)
    if not os.path.exists(path):
        if os.path.islink(path):
            raise CheckpointError(f"{source}: a dangling symbolic link (to {os.readlink(path)}, which does not exist)")
        raise CheckpointError(f"{source}: no such file or directory")
    return path.rstrip("/") or "/"


def open_source(source: "str | Source") -> "Source":
    if isinstance(source, (LocalSource, ObjectSource)):
        return source
    checked = check_source(source)
    return ObjectSource(checked) if is_object_store(checked) else LocalSource(checked)


def list_names(folder: str) -> list[str]:
    """The names in a local folder, sorted (for listings and error messages)."""
    try:
        return sorted(os.listdir(folder))
    except NotADirectoryError:
        return [os.path.basename(folder)]
    except PermissionError:
        raise CheckpointError(f"{folder}: permission denied while listing it") from None


def describe_names(names: list[str], limit: int = 12) -> str:
    if not names:
        return "it is empty"
    shown = ", ".join(names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"it holds: {shown}{more}"


def check_regular_file(path: str) -> None:
    """Refuse what is not a regular file before opening it: opening a FIFO blocks until a writer
    comes (no timeout covers it), a device or a directory is never a checkpoint file."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        what = "a dangling symbolic link" if os.path.islink(path) else "no such file"
        raise CheckpointError(f"{path}: {what}") from None
    except PermissionError:
        raise CheckpointError(f"{path}: permission denied") from None
    if stat.S_ISDIR(mode):
        raise CheckpointError(f"{path}: is a directory, expected a .safetensors file")
    if not stat.S_ISREG(mode):
        kind = "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise CheckpointError(f"{path}: is {kind}, not a regular file; distload reads checkpoint files "
                              f"from regular files only (copy it to a file first)")


def read_local_header(path: str) -> FileInfo:
    """Read and parse the header of a local safetensors file."""
    check_regular_file(path)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            size = st.st_size
            head = f.read(8)
            if len(head) == 8:
                (header_len,) = struct.unpack("<Q", head)
                if 2 <= header_len <= MAX_HEADER_BYTES:
                    head += f.read(header_len)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, expected a .safetensors file") from None
    except PermissionError:
        raise CheckpointError(f"{path}: permission denied") from None
    return dataclasses.replace(parse_header(path, head, size), stamp=file_stamp(st))


def file_stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


T = TypeVar("T")


def _each(fn: Callable[[Any], T], items: Sequence[Any], thread_name: str) -> list[T]:
    """``fn`` of every item, in order; several at a time (object-store requests wait on the network)."""
    if len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(min(HEADER_READ_THREADS, len(items)), thread_name_prefix=thread_name) as pool:
        return list(pool.map(fn, items))


def check_unchanged(files: "Iterable[FileInfo]") -> None:
    """Raise if a local file was replaced, resized or rewritten, or an object written again,
    since its header was read."""
    files = list(files)
    objects = [info for info in files if info.version is not None]
    if objects:
        from distload.loading.stores import store_for

        def now(info: FileInfo) -> str | None:
            store, location = store_for(info.path)
            return store.version(location)

        for info, version in zip(objects, _each(now, objects, "distload-version")):
            if version != info.version:
                raise CheckpointError(f"{info.path}: it was written again while it was being loaded (its version "
                                      f"was {info.version}, now {version}), so the tensors read from it may mix two "
                                      f"versions; load again once it is no longer written")
    for info in files:
        if info.stamp is None:
            continue
        try:
            now = file_stamp(os.stat(info.path))
        except OSError:
            raise CheckpointError(f"{info.path}: it disappeared while it was being loaded; load again") from None
        if now != info.stamp:
            what = ("replaced by another file" if now[:2] != info.stamp[:2] else
                    f"resized from {info.stamp[2]} to {now[2]} bytes" if now[2] != info.stamp[2] else "rewritten")
            raise CheckpointError(f"{info.path}: it was {what} while it was being loaded, so the tensors read "
                                  f"from it may mix two versions; load again once it is no longer written")


# The fingerprint reads the header and one small block every FINGERPRINT_STRIDE_BYTES of data
# (more apart in files above 4 GiB, so that no file costs more than FINGERPRINT_MAX_SAMPLES
# reads), on several threads, with readahead off so that each sample reads only its block.
FINGERPRINT_SAMPLE_BYTES = 4096
FINGERPRINT_STRIDE_BYTES = 1 << 20
FINGERPRINT_MAX_SAMPLES = 4096
FINGERPRINT_THREADS = 8


def fingerprint_samples(info: FileInfo, data_start: int | None = None) -> list[tuple[int, int]]:
    """``(offset, size)`` of what the fingerprint reads: the header, then a block at every
    stride of the data and the data's last block. ``data_start``: where the sampled part begins
    (default: a safetensors file's data; a file without tensors is read whole)."""
    if data_start is None:
        data_start = info.tensors[0].begin if info.tensors else info.size
    samples = [(0, data_start)]
    data = info.size - data_start
    if data <= 0:
        return samples
    stride = max(FINGERPRINT_STRIDE_BYTES, -(-data // FINGERPRINT_MAX_SAMPLES))
    for offset in range(data_start, info.size, stride):
        samples.append((offset, min(FINGERPRINT_SAMPLE_BYTES, info.size - offset)))
    last = max(data_start, info.size - FINGERPRINT_SAMPLE_BYTES)
    if samples[-1][0] != last:
        samples.append((last, info.size - last))
    return samples


def content_fingerprint(info: FileInfo, data_start: int | None = None) -> str:
    """SHA-256 of a local file's header and of a 4 KiB block every 1 MiB of its data.

    Two nodes can hold different versions of a checkpoint at the same path with the same sizes
    (a fine-tune of the same model, a copy corrupted in transit); the ranks of a shared read would then
    silently hand one node's bytes to the other. The samples catch every difference of more than
    a stride, and every tensor that differs throughout, at the cost of 0.4% of the file's bytes
    (measured in benchmarks/results/fingerprint.md). What they cannot catch is a difference that
    lies wholly between two samples. ``data_start``: as for fingerprint_samples.
    """
    samples = fingerprint_samples(info, data_start)
    try:
        fd = os.open(info.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # each sample reads its block only
            def read(batch: list[tuple[int, int]]) -> list[bytes]:
                return [os.pread(fd, size, offset) for offset, size in batch]

            # Batches, not one task per sample: the pool's overhead would cost more than a warm read.
            batch = max(1, -(-len(samples) // (4 * FINGERPRINT_THREADS)))
            batches = [samples[i:i + batch] for i in range(0, len(samples), batch)]
            if len(batches) == 1:
                blocks = read(batches[0])
            else:
                with ThreadPoolExecutor(FINGERPRINT_THREADS, thread_name_prefix="distload-fingerprint") as pool:
                    blocks = [block for part in pool.map(read, batches) for block in part]
        finally:
            os.close(fd)
    except OSError as exc:
        raise CheckpointError(f"{info.path}: cannot read it to compare its content across ranks "
                              f"({exc.strerror or exc}): was it moved or deleted while planning?") from None
    hasher = hashlib.sha256()
    for (offset, size), block in zip(samples, blocks):
        if len(block) != size:
            raise CheckpointError(f"{info.path}: it ended at byte {offset + len(block)} while its content was "
                                  f"being compared across ranks, but its header says {info.size} bytes: was it "
                                  "truncated while planning?")
        hasher.update(block)
    return hasher.hexdigest()


# Weights in formats distload does not read (PyTorch pickles above all), for a message that says so.
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".npz")


def other_weights_hint(names: list[str]) -> str:
    others = [n for n in names if n.endswith(OTHER_WEIGHT_SUFFIXES)]
    if not others:
        return ""
    return (f". distload reads safetensors only, and {others[0]} is not one: convert the weights "
            f"first, e.g. with safetensors.torch.save_file(torch.load(PATH, weights_only=True), "
            f"'model.safetensors') for a PyTorch file (or the Hugging Face Hub's convert tool, or "
            f"`save_pretrained(..., safe_serialization=True)` in transformers)")


class LocalSource:
    """A local ``.safetensors`` file or a folder."""

    remote = False

    def __init__(self, path: str):
        self.uri = path
        self.is_file = not os.path.isdir(path)
        self.folder = (os.path.dirname(path) or ".") if self.is_file else path

    def names(self) -> list[str]:
        return list_names(self.folder)

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def has_file(self, name: str) -> bool:
        return os.path.isfile(self.path(name))

    def glob(self, pattern: str) -> list[str]:
        """Names (relative, may hold ``/``) of the files below the folder matching a glob."""
        found = glob.glob(os.path.join(glob.escape(self.folder), pattern))
        return sorted(os.path.relpath(path, self.folder) for path in found if os.path.isfile(path))

    def file_size(self, name: str) -> int:
        return os.path.getsize(self.path(name))

    def read_bytes(self, name: str) -> bytes:
        with open(self.path(name), "rb") as f:
            return f.read()

    def iter_chunks(self, name: str, block: int = 16 * 1024 * 1024) -> Iterator[bytes]:
        with open(self.path(name), "rb") as f:
            while chunk := f.read(block):
                yield chunk

    def read_headers(self, paths: list[str]) -> list[FileInfo]:
        return [read_local_header(p) for p in paths]

    def no_weights_message(self, names: list[str]) -> str:
        return f"{self.uri}: no .safetensors files in this folder; {describe_names(names)}{other_weights_hint(names)}"


class ObjectSource:
    """An object in, or a prefix of, an S3 bucket, a GCS bucket or an Azure container.

    The prefix is listed once (one level, names relative to it, sub-prefixes as ``name/``) and the
    listing's sizes are used for every later question; no request is made before the first one.

    With a node cache (``cache``: a load's ``--cache-dir``), the small objects it reads whole (an
    index, a config.json) go through the cache, and a header comes from there where the cache
    holds its bytes, both under the version the listing gives: a warm load asks the store for
    that one listing (an object written again has another version, so another entry).
    """

    remote = True

    def __init__(self, uri: str, cache: "CacheSettings | None" = None):
        from distload.loading.stores import get_store, parse_uri

        self.uri = uri
        self.cache = cache
        self.location = parse_uri(uri)
        self.store = get_store(self.location.scheme)
        self.is_file = self.location.key.endswith(".safetensors")
        if self.is_file:
            parent = self.location.key.rpartition("/")[0]
            self.folder_location = type(self.location)(self.location.scheme, self.location.bucket, parent)
        else:
            self.folder_location = self.location
        self.folder = str(self.folder_location)
        self._listing = None
        self._deep_listing = None

    def _list(self):
        if self._listing is None:
            self._listing = self.store.list(self.folder_location)
        return self._listing

    def names(self) -> list[str]:
        return self._list().names()

    def path(self, name: str) -> str:
        return str(self.folder_location.child(name))

    def has_file(self, name: str) -> bool:
        # The recursive listing only where a glob already asked for it: a probe for a marker or
        # an index must not walk every prefix below (a bucket of many models).
        return name in self._list().objects or (self._deep_listing is not None and name in self._deep_listing.objects)

    def glob(self, pattern: str) -> list[str]:
        """Names (relative, may hold ``/``) of the objects below the prefix matching a glob,
        from one recursive listing (the folder's own listing stays one level deep)."""
        return sorted(name for name in self._deep_objects() if fnmatch.fnmatchcase(name, pattern))

    def _deep_objects(self) -> dict[str, int]:
        if self._deep_listing is None:
            self._deep_listing = self.store.list(self.folder_location, recursive=True)
        return self._deep_listing.objects

    def file_size(self, name: str) -> int:
        listing = self._list()
        if name in listing.objects:
            return listing.objects[name]
        if self._deep_listing is not None and name in self._deep_listing.objects:
            return self._deep_listing.objects[name]
        return self.store.size(self.folder_location.child(name))

    def listed(self, path: str) -> tuple[int, str] | None:
        """The size and version the listing gave for an object's URI (None: not listed with one)."""
        folder = f"{self.folder}/"
        if not path.startswith(folder):
            return None
        name = path[len(folder):]
        for listing in (self._listing, self._deep_listing):
            if listing is not None and name in listing.versions:
                return listing.objects[name], listing.versions[name]
        return None

    def read_bytes(self, name: str) -> bytes:
        location = self.folder_location.child(name)
        size = self.file_size(name)
        listed = self.listed(str(location)) if self.cache is not None else None
        if listed is None:
            return self.store.read(location, 0, size)
        from distload.loading.stores.cache import read_whole

        size, version = listed
        return read_whole(self.cache, str(location), version, size,
                          lambda a, b: self.store.read_version(location, a, b, version))

    def iter_chunks(self, name: str, block: int = 16 * 1024 * 1024) -> Iterator[bytes]:
        location = self.folder_location.child(name)
        size = self.file_size(name)
        for start in range(0, size, block):
            yield self.store.read(location, start, min(size, start + block))

    def stats(self, names: list[str]) -> list[tuple[int, str | None]]:
        """Each object's size and version, asked for together (several at a time)."""
        return _each(lambda name: self.store.stat(self.folder_location.child(name)), names, "distload-stat")

    def read_headers(self, paths: list[str]) -> list[FileInfo]:
        """The node cache's (one after another: local reads) where it holds them, the others from
        the store: one ranged GET each gives the header, the size and the version of the same
        object (several at a time)."""
        found = {path: self.cached_header(path) for path in paths} if self.cache is not None else {}
        missing = [path for path in paths if found.get(path) is None]
        read = (lambda path: self.store.read_header(path, keep_head=True)) if self.cache is not None \
            else self.store.read_header
        found.update(zip(missing, _each(read, missing, "distload-header")))
        return [found[path] for path in paths]

    def cached_header(self, path: str) -> FileInfo | None:
        """The header from the node cache where it holds its bytes under the listed version."""
        listed = self.listed(path)
        if listed is None:
            return None
        from distload.loading.stores.cache import cached_head

        size, version = listed
        head = cached_head(self.cache, path, version, size)
        return None if head is None else dataclasses.replace(parse_header(path, head, size), version=version, head=head)

    def no_weights_message(self, names: list[str]) -> str:
        if not names:
            return (f"{self.uri}: no .safetensors objects under this prefix, and nothing else either: "
                    f"nothing is stored under {self.folder_location.prefix or 'the bucket root'} "
                    f"(check the bucket and the prefix)")
        return (f"{self.uri}: no .safetensors objects under this prefix; {describe_names(names)}"
                f"{other_weights_hint(names)}")


Source = Union[LocalSource, ObjectSource]


MODEL_CONFIG_FILE = "config.json"


def model_config(source: "str | Source") -> dict:
    """The Hugging Face ``config.json`` beside the weights ({} when there is none).

    The sharding specs size attention heads from it. A config.json that is there but not a JSON
    object is an error naming it: guessing the heads would give silently wrong slices.
    """
    src = open_source(source)
    if not src.has_file(MODEL_CONFIG_FILE):
        return {}
    where = src.path(MODEL_CONFIG_FILE)
    try:
        value = json.loads(src.read_bytes(MODEL_CONFIG_FILE).decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{where}: not valid JSON ({exc}); fix or remove it") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: expected a JSON object (a model config), got {type(value).__name__}")
    return value


def list_whole_checkpoint(path: str) -> list[str]:
    """The safetensors files of a whole (not per-rank) checkpoint, in a stable order."""
    return whole_checkpoint(path)[0]


def whole_checkpoint(source: "str | LocalSource | ObjectSource") -> tuple[list[str], dict[str, str] | None]:
    """The files of a whole checkpoint, and its index's weight map (None without an index).

    A file is itself; a folder with ``model.safetensors.index.json`` gives exactly the files its
    ``weight_map`` names; any other folder gives its ``*.safetensors`` (not recursive).
    """
    src = open_source(source)
    if src.is_file:
        return [src.uri], None
    if src.has_file(INDEX_FILE):
        index_path = src.path(INDEX_FILE)
        weight_map = _read_weight_map(src, index_path)
        return _files_from_index(src, index_path, weight_map), weight_map
    names = src.names()
    files = [src.path(n) for n in names if n.endswith(".safetensors")]
    if not files:
        raise CheckpointError(src.no_weights_message(names))
    return files, None


def check_weight_map(folder: str, weight_map: dict[str, str], index: CheckpointIndex) -> None:
    """Every tensor the index names must be in the file it names (else the index is stale)."""
    where = {t.name: t.file.rsplit("/", 1)[-1] for t in index.tensors}
    wrong = [(name, file) for name, file in sorted(weight_map.items()) if where.get(name) != file]
    if wrong:
        shown = "; ".join(
            f"{name!r} -> {file} but " + (f"it is in {where[name]}" if name in where else "no file has it")
            for name, file in wrong[:5])
        raise CheckpointError(
            f"{folder.rstrip('/')}/{INDEX_FILE} does not match the files' headers "
            f"({len(wrong)} tensor(s)): {shown}; regenerate the index or remove it"
        )


def _read_weight_map(src, index_path: str) -> dict[str, str]:
    try:
        index = json.loads(src.read_bytes(INDEX_FILE).decode("utf-8"))
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
        bad = [k for k, v in weight_map.items() if not isinstance(v, str) or not v]
        if bad:
            raise TypeError(f"weight_map values must be file names, but {bad[0]!r} maps to "
                            f"{weight_map[bad[0]]!r}")
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{index_path}: not a valid safetensors index ({type(exc).__name__}: {exc}); it must be "
            f"a JSON object with a 'weight_map' of tensor name -> file name"
        ) from None
    return weight_map


def _files_from_index(src, index_path: str, weight_map: dict[str, str]) -> list[str]:
    names = sorted(set(weight_map.values()))
    missing = [n for n in names if not src.has_file(n)]
    if missing:
        raise CheckpointError(
            f"{index_path} names files that are not in {src.folder}: {', '.join(missing)}"
        )
    return [src.path(n) for n in names]


def read_header(path: str) -> FileInfo:
    """The parsed header of a local file or an object (8 bytes, then the header, by range)."""
    if is_object_store(path):
        from distload.loading.stores import store_for

        store, _ = store_for(path)
        return store.read_header(path)
    return read_local_header(path)
