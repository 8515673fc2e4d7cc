"""Headers once per job: each object's header read by one rank of the load's group, and handed to
the others.

Planning needs, on every rank of a whole checkpoint, every file's header (the index: each
tensor's dtype, shape and bytes). Read by each rank, a 1T checkpoint's 387 headers (6 MB) left the
store once per rank: 6 GB at 1,024 ranks (docs/scale.md). Here the files whose headers the job
reads are dealt out over the ranks (the i-th, in sorted order, to rank i mod N); each rank reads
and parses its share (the checks of ``parse_header``: a header that fails names its file, and the
planning step's verdicts name the rank and its error on every rank), and the planning step's
exchange hands every rank all of them, parsed (unpickling a 1T index took 0.6x the time of parsing its headers, measured here).
A header nobody dealt to this rank's files (ranks that listed different files) is read here, as
before: the agreement then names the ranks whose file lists differ.

Local files are read by each rank: a path on another node may name other bytes (the agreement
compares their contents for a shared read, and each rank checks its own files' stamps), and the
page cache makes the read cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from distload.loading.index import FileInfo

if TYPE_CHECKING:
    from distload.loading.sources import Source


def dealt(paths: Iterable[str], rank: int, world_size: int) -> list[str]:
    """The paths whose headers ``rank`` reads for the job: the i-th of the sorted distinct paths
    for i mod ``world_size`` == ``rank`` (every rank computes the same from the same listing)."""
    return [p for i, p in enumerate(sorted(set(paths))) if i % world_size == rank]


def read_dealt(src: "Source", paths: Iterable[str], rank: int, world_size: int) -> tuple[FileInfo, ...]:
    """This rank's share of the job's headers, parsed (none for local files)."""
    if not src.remote:
        return ()
    return tuple(src.read_headers(dealt(paths, rank, world_size)))


def headers_by_path(shares: Sequence[Sequence[FileInfo]]) -> dict[str, FileInfo]:
    """Every rank's share (the planning step's exchange), by path."""
    return {info.path: info for share in shares for info in share}


def read_headers(src: "Source", paths: list[str], shared: Mapping[str, FileInfo] | None) -> list[FileInfo]:
    """The headers of ``paths``: from ``shared`` where another rank read them, the rest read here."""
    shared = shared or {}
    missing = [p for p in paths if p not in shared]
    read = dict(zip(missing, src.read_headers(missing))) if missing else {}
    return [read[p] if p in read else shared[p] for p in paths]
