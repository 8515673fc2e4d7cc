"""How much of a file the page cache holds, per page, without reading it.

Why: a load from the page cache and one from storage are bound by different things (the
destination's page faults, benchmarks/results/profile_warm.md, against the device), and a user
who loads a checkpoint twice wants to know which one ran. The pread reader asks when it opens
each file and reports, per rank, which bytes were where. (It was built to choose a reader per
file; measured, the same prefaulted preads were fastest both ways: backends/pread.py.)

How: ``mincore(2)`` over a read-only shared map of the file. The map is never touched (so a file
truncated meanwhile cannot raise SIGBUS here), only its residency vector is read: one byte per
page, one system call per file. Measured on a 2 GiB checkpoint (benchmarks/results/load.md, last
line): 4 ms per GiB cold and 14 warm, against 317-573 ms per GiB for one ``preadv2(RWF_NOWAIT)``
probe per page (sampling fewer pages would guess).

Where the kernel or a seccomp filter refuses the map or the call, :func:`probe` returns None and
the reader says so in its report (every byte counted as read from storage).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from dataclasses import dataclass
from typing import Optional

PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class Residency:
    """Which pages of one file the page cache held when it was probed."""

    size: int
    vector: bytes  # one byte per page; bit 0 set where the page was resident

    def resident_bytes(self, begin: int = 0, end: Optional[int] = None) -> int:
        """Bytes of ``[begin, end)`` on resident pages (whole pages, clipped to the range)."""
        end = self.size if end is None else min(end, self.size)
        if end <= begin:
            return 0
        first, last = begin // PAGE, (end - 1) // PAGE
        nbytes = self.vector[first:last + 1].translate(_low_bit_table()).count(1) * PAGE
        if self.vector[first] & 1:  # the end pages count only their part inside the range
            nbytes -= begin - first * PAGE
        if self.vector[last] & 1:
            nbytes -= (last + 1) * PAGE - end
        return nbytes

    def fraction(self, begin: int = 0, end: Optional[int] = None) -> float:
        end = self.size if end is None else min(end, self.size)
        return self.resident_bytes(begin, end) / (end - begin) if end > begin else 1.0


@functools.lru_cache(maxsize=1)
def _low_bit_table() -> bytes:
    """Each byte to its bit 0: mincore sets bit 0 of a resident page; the other bits are reserved."""
    return bytes(b & 1 for b in range(256))


@functools.lru_cache(maxsize=1)
def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.mmap.restype = ctypes.c_void_p
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        libc.mincore.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):  # not Linux, or a libc without them
        return None


_MAP_FAILED = ctypes.c_void_p(-1).value


def probe(fd: int) -> Optional[Residency]:
    """The residency of the open file ``fd`` now, or None where this system cannot say."""
    libc = _libc()
    if libc is None:
        return None
    size = os.fstat(fd).st_size
    if size == 0:
        return Residency(0, b"")
    address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address in (None, _MAP_FAILED):
        return None
    try:
        vector = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
        if libc.mincore(address, size, vector) != 0:
            return None
        return Residency(size, vector.raw)
    finally:
        libc.munmap(address, size)
