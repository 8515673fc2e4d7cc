"""What a load reports: per-tensor digest, byte-counting progress, timing, and the JSON report.

The digest lets anyone check a load against a plain safetensors read: SHA-256 over the rank's
tensors sorted by name, feeding for each ``name|DTYPE|d0,d1,...|`` followed by its raw bytes.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import torch

from distload.loading.index import dtype_code
from distload.fileio import write_json_atomic
from distload.tensor_io import tensor_bytes

GIB = 1024**3


def update_digest(hasher: "hashlib._Hash", name: str, tensor: torch.Tensor) -> None:
    shape = ",".join(str(d) for d in tensor.shape)
    hasher.update(f"{name}|{dtype_code(tensor.dtype)}|{shape}|".encode("utf-8"))
    hasher.update(tensor_bytes(tensor))


def state_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """The report's digest of a name -> tensor mapping, to check a load against any other read.

    Args:
        tensors: name -> tensor (any device; the bytes are read as stored).

    Returns:
        Hex SHA-256 over the tensors sorted by name, feeding for each
        ``name|DTYPE|d0,d1,...|`` and then its raw bytes.
    """
    hasher = hashlib.sha256()
    for name in sorted(tensors):
        update_digest(hasher, name, tensors[name])
    return hasher.hexdigest()


def gib_per_s(nbytes: int, seconds: float) -> float:
    return round(nbytes / GIB / seconds, 4) if seconds > 0 else 0.0


@dataclass
class RankReport:
    rank: int
    local_rank: int
    device: str
    path: str
    files: list[str]
    num_tensors: int
    nbytes: int
    seconds: float
    gib_per_s: float
    digest: str | None = None
    hostname: str = ""
    # Bytes this process read from storage during the load (psutil read_bytes: page-cache hits
    # do not count) and its peak resident memory so far; None where the OS does not say.
    read_bytes: int | None = None
    peak_rss_bytes: int | None = None
    # Bytes of the new host tensors marked for transparent huge pages (advice to the kernel; see
    # distload.loading.host_memory).
    huge_page_marked_bytes: int = 0
    # Bytes of new host tensors backed in one call before they were read into (page-cache reads).
    prefaulted_bytes: int = 0
    # Bytes by the way the reader took them, e.g. {"pread/page-cache": n, "pread/storage": m}
    # (distload.loading.backends.pread); None where one library read everything its own way.
    reader_bytes: dict[str, int] | None = None
    # Bytes distload asked the source for (counted by distload's own readers; a library that
    # reads whole tensors counts as their bytes), whatever the page cache then served.
    requested_bytes: int | None = None
    # Bytes other ranks read and sent to this one (distload's shared reads); None: not counted.
    received_bytes: int | None = None
    tensor_parallel: list[int] | None = None  # [TP rank, TP size] of a tensor-parallel load
    expert_parallel: list[int] | None = None  # [EP rank, EP size] of an expert-parallel load
    # Through a node cache (--cache-dir): bytes from it, bytes fetched from the store into it (whole
    # blocks), blocks found corrupt there and fetched again; None: no cache.
    cache_bytes: int | None = None
    store_bytes: int | None = None
    corrupt_blocks: int | None = None
    # Bytes other ranks read and sent this one (a shared read) that it kept in its node's cache
    # (whole blocks that were not there yet), so that every node the read passes through has them.
    cache_received_bytes: int | None = None
    # Loaded from a running job (``distload load tcp://HOST:PORT``): the bytes the server sent this
    # rank (its slices, with their alignment and checksums); None: a load from storage.
    server_bytes: int | None = None


@dataclass
class LoadReport:
    world_size: int
    load_format: str
    source: str
    ranks: list[RankReport] = field(default_factory=list)

    @property
    def total(self) -> dict[str, Any]:
        nbytes = sum(r.nbytes for r in self.ranks)
        seconds = max((r.seconds for r in self.ranks), default=0.0)
        return {"nbytes": nbytes, "seconds": round(seconds, 6), "gib_per_s": gib_per_s(nbytes, seconds)}

    def to_json(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "load_format": self.load_format,
            "source": self.source,
            "ranks": [asdict(r) for r in self.ranks],
            "total": self.total,
        }

    def write(self, path: str) -> None:
        """Write atomically: a reader never sees half a report."""
        write_json_atomic(path, self.to_json(), indent=2)

    def summary_lines(self) -> list[str]:
        """The lines ``distload load`` prints: a header, one line per rank, a total.

        Every rank's line has the same fields (a field that some rank reports is shown for all,
        ``-`` where a rank has no number), so the lines line up and compare. Rates are shown only
        for a load large and long enough to measure one (:func:`rate_means_something`): a tiny
        load's rate is its fixed costs, not a speed.
        """
        lines = [f"distload: {self.load_format} from {self.source} on {self.world_size} rank(s)"]
        total = self.total
        rates = rate_means_something(min((r.nbytes for r in self.ranks), default=0),
                                     min((r.seconds for r in self.ranks), default=0.0))
        show_requested = any(r.requested_bytes is not None for r in self.ranks)
        show_received = any(r.received_bytes for r in self.ranks)
        show_cache = any(r.cache_bytes is not None for r in self.ranks)
        show_server = any(r.server_bytes is not None for r in self.ranks)
        # Every way any rank read by, on every line (a rank that did not count ways shows -).
        ways = (sorted({way for r in self.ranks for way in (r.reader_bytes or {})})
                if any(r.reader_bytes and len(r.reader_bytes) > 1 for r in self.ranks) else [])
        for r in self.ranks:
            digest = r.digest[:16] if r.digest else "-"
            tp = f", TP rank {r.tensor_parallel[0]} of {r.tensor_parallel[1]}" if r.tensor_parallel else ""
            if r.expert_parallel:
                tp += f", EP rank {r.expert_parallel[0]} of {r.expert_parallel[1]}"
            rate = f" = {r.gib_per_s:.2f} GiB/s" if rates else ""
            fields = ""
            if show_requested:
                fields += f", requested {gib_text(r.requested_bytes)}"
            if show_received:
                fields += f", received {gib_text(r.received_bytes or 0)} from other ranks"
            if show_cache:
                fields += f", node cache {gib_text(r.cache_bytes)}, store {gib_text(r.store_bytes)}"
                if r.cache_received_bytes:
                    fields += f", {gib_text(r.cache_received_bytes)} received from other ranks kept in it"
                if r.corrupt_blocks:
                    fields += f", {r.corrupt_blocks} corrupt block(s) fetched again"
            if show_server:
                fields += f", from the server {gib_text(r.server_bytes)}"
            if ways:
                fields += " (" + ", ".join(
                    f"{way} {gib_text(r.reader_bytes.get(way, 0) if r.reader_bytes is not None else None)}"
                    for way in ways) + ")"
            lines.append(
                f"  rank {r.rank} ({r.device}, {r.path}{tp}): {r.num_tensors} tensors, "
                f"{gib_text(r.nbytes)} in {r.seconds:.2f} s{rate}{fields}, digest {digest}"
            )
        rate = (f", {total['gib_per_s']:.2f} GiB/s" if rates else
                f" (no rate: under {MIN_RATE_BYTES // 2**20} MiB or {MIN_RATE_SECONDS} s a rank is "
                f"mostly fixed costs)")
        lines.append(f"  total: {gib_text(total['nbytes'])}, slowest rank {total['seconds']:.2f} s{rate}")
        return lines


# A rate over less than this is mostly a load's fixed costs (headers, planning, agreement),
# not a read speed: the summary leaves it out (the JSON report keeps every number).
MIN_RATE_BYTES = 64 * 2**20
MIN_RATE_SECONDS = 0.05


def rate_means_something(nbytes: int, seconds: float) -> bool:
    """Whether ``nbytes`` in ``seconds`` is a load big and long enough for its rate to be a speed."""
    return nbytes >= MIN_RATE_BYTES and seconds >= MIN_RATE_SECONDS


def gib_text(nbytes: int | None) -> str:
    """Bytes as distload prints them everywhere: GiB (2**30 bytes), three decimals; ``-``: unknown."""
    return "-" if nbytes is None else f"{nbytes / GIB:.3f} GiB"


def storage_read_bytes() -> int | None:
    """This process's bytes read from storage so far (None if the OS does not tell).

    Read from /proc/self/io where there is one, as psutil reads it: importing psutil cost a
    one-process load of 64 MiB more than its read (tens of milliseconds)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    try:
        import psutil

        return psutil.Process().io_counters().read_bytes
    except Exception:  # no /proc/self/io (some containers), or psutil refused
        return None


def peak_rss_bytes() -> int:
    """This process's peak resident memory.

    From /proc/self/status (VmHWM) where there is one: getrusage's ru_maxrss survives exec, so a
    process started from a big parent (a test runner, torchrun's agent) would report the
    parent's peak as its own.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class Progress:
    """A byte-counting bar in GiB and GiB/s (the unit of every report) on one rank; silent when
    off or stderr is not a terminal."""

    def __init__(self, total: int, enabled: bool, description: str = "Loading weights"):
        self._bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            # Counted in GiB, not bytes with tqdm's unit_scale: that prints k/M/G prefixes of
            # powers of 1000 (GB), where the summary and the report count GiB.
            self._bar = tqdm(total=total / GIB, unit="GiB", desc=description, file=sys.stderr,
                             dynamic_ncols=True,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.2f}/{total:.2f} GiB "
                                        "[{elapsed}<{remaining}, {rate_fmt}]")

    def update(self, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.update(nbytes / GIB)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
