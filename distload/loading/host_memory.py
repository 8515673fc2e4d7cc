"""New host tensors for loaded weights, on transparent huge pages where the kernel allows it.

Why: reading a checkpoint that is already in the page cache into fresh memory is bound by page
faults, not by I/O. Every 4 KiB of a new tensor costs a fault (a trap, a zeroed page, a page-table
update) on first touch; a 2 MiB huge page costs one fault for 512 of them. Measured on the
2-core VM (benchmarks/results/profile_warm.md): a warm 1 GiB load into new tensors runs at
3.6 GiB/s on 4 KiB pages (one fault per page, 97% of the CPU time in the kernel) and at 8.5 GiB/s
with huge pages, right after memory was freed (see the first cost below).

Most distributions run transparent huge pages in ``madvise`` mode: only ranges marked with
``madvise(MADV_HUGEPAGE)`` get them. We mark the 2 MiB-aligned interior of each new tensor of at
least ``MIN_TENSOR_PAGES`` huge pages before distload writes to it. The tensor stays an ordinary
``torch.empty`` tensor (torch's allocator, a resizable storage that frees normally); only the
kernel's backing changes. The mark is advice: memory that glibc hands out again from its heap
(after a large free it raises its mmap threshold, up to 32 MiB) is already backed by 4 KiB pages,
and there the mark changes nothing until khugepaged collapses it; ``marked_bytes`` counts advice
given, not huge pages obtained (smaps' AnonHugePages says that).

Two costs to avoid. First, a virtual machine whose balloon driver does free page reporting
(virtio-balloon with VIRTIO_BALLOON_F_REPORTING, as on this project's Firecracker VMs) hands every
free 2 MiB block back to its host a few seconds after it is freed; a huge page is always such a
block, so its first touch takes host faults and runs several times slower than 4 KiB pages (1 vs
4 GiB/s measured here after a 4 s pause; 6.5 vs 4 GiB/s without the pause). ``auto`` stays on
4 KiB pages there. Second, with the default ``defrag`` setting a fault on a marked range finds no free
2 MiB block, the kernel compacts memory on the spot, and the load stalls. So in ``auto`` mode we
mark only as many bytes as the free 2 MiB (and larger) blocks in ``/proc/buddyinfo`` cover, shared
between the node's ranks. ``huge_pages: true`` marks everything (and fails when the kernel has
huge pages off); ``false`` marks nothing.

Prefaulting. A new tensor can be *prefaulted* before it is read into: one
``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14) backs a range in one walk of its page table,
instead of one fault (a trap, a page-table lock, a zeroed page) per 4 KiB taken inside the reader
threads' copies, where the threads also contend for the same locks. Measured here on 1 GiB of new
tensors: 0.32-0.34 s to prefault on one thread, 0.18-0.20 s on two, then 0.12 s to pread a warm
file into them; reading into new memory without it costs 0.73-0.89 s of kernel CPU time, with it
0.51-0.63 s (the pread reader's units: ``distload/loading/backends/pread.py``). Where the kernel
refuses (older than 5.14, a seccomp filter), tensors fault as they are written, ``why_not_prefault``
says why and ``prefaulted_bytes`` how many bytes were prefaulted.

Each marked tensor splits its mapping into up to two more VMAs; a process has at most
``vm.max_map_count`` of them, so a process marks at most an eighth of that many tensors, over all
its loads (the count is per process: marks outlive a load while its tensors live).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from typing import Optional

import torch

from distload.errors import ConfigError
from distload.runtime import RUNTIME

_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
_THP_SIZE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"
_MADV_HUGEPAGE = 14  # <asm-generic/mman-common.h>
_MADV_POPULATE_WRITE = 23
# Below this a tensor's faults cost little next to the call (and to its reads).
MIN_PREFAULT_BYTES = 1 << 20
_BUDDYINFO = "/proc/buddyinfo"
_MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"
_VIRTIO_DEVICES = "/sys/bus/virtio/devices"
_VIRTIO_ID_BALLOON = 5
_VIRTIO_BALLOON_F_REPORTING = 5

PAGE_BYTES = mmap.PAGESIZE


def _read_int(path: str, default: int) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return default


def huge_page_bytes(path: str = _THP_SIZE) -> int:
    """The kernel's huge page size: 2 MiB with 4 KiB base pages (x86-64, most arm64 kernels)."""
    return _read_int(path, 2 * 1024 * 1024)


# Below this many huge pages a tensor's aligned interior is at most one (and often none).
MIN_TENSOR_PAGES = 2


def thp_mode(path: str = _THP_ENABLED) -> Optional[str]:
    """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``), None if unknown."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def free_huge_page_bytes(path: str = _BUDDYINFO) -> int:
    """Bytes in free blocks of at least a huge page (buddy order 9 with 4 KiB pages), over every zone."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    page = huge_page_bytes()
    huge_order = (page // os.sysconf("SC_PAGE_SIZE")).bit_length() - 1
    total = 0
    for line in lines:
        # "Node 0, zone   Normal  16988  23957 ..." : free block counts by order 0, 1, 2, ...
        counts = line.split()[4:]
        for order, count in enumerate(counts):
            if order >= huge_order:
                total += int(count) << (order - huge_order)
    return total * page


def free_page_reporting(devices: str = _VIRTIO_DEVICES) -> Optional[str]:
    """The virtio balloon that reports free pages to the host (its sysfs name), None if there is none."""
    try:
        names = sorted(os.listdir(devices))
    except OSError:
        return None
    for name in names:
        try:
            with open(os.path.join(devices, name, "device")) as f:
                device_id = int(f.read().strip(), 16)
            with open(os.path.join(devices, name, "features")) as f:
                features = f.read().strip()  # negotiated feature bits, bit 0 first
        except (OSError, ValueError):
            continue
        if (device_id == _VIRTIO_ID_BALLOON and len(features) > _VIRTIO_BALLOON_F_REPORTING
                and features[_VIRTIO_BALLOON_F_REPORTING] == "1"):
            return name
    return None


def _libc_call(name: str, third: type):
    """libc's ``name(void *address, size_t length, third)`` returning int (madvise, mincore)."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, third]
    fn.restype = ctypes.c_int
    return fn


def _madvise():
    return _libc_call("madvise", ctypes.c_int)


class HostMemory:
    """Allocates a load's new host tensors; thread-safe; counts the bytes it marked for huge pages.

    ``huge_pages``: None (auto: mark within the free-block budget when the kernel's mode is
    ``madvise`` and no balloon reports free pages), True (mark every large tensor), False (never).
    ``why_not``: why nothing is marked, for the log; None when marking is on.
    ``local_ranks``: ranks on this node, which share the free blocks.
    """

    def __init__(self, huge_pages: Optional[bool] = None, local_ranks: int = 1, *,
                 mode: Optional[str] = "detect", free_bytes: Optional[int] = None,
                 reporting: Optional[str] = "detect"):
        # mode, free_bytes and reporting stand in for what the kernel says (tests).
        self.marked_bytes = 0  # bytes marked MADV_HUGEPAGE so far
        self.prefaulted_bytes = 0  # bytes backed by MADV_POPULATE_WRITE before any write
        self.why_not_prefault: Optional[str] = None  # set once the kernel refused it
        self.huge_page_bytes = huge_page_bytes()
        self._lock = threading.Lock()
        self._required = bool(huge_pages)
        self._budget: Optional[int] = None  # bytes auto may still mark; None: no limit
        self.why_not = self._reason_not_to_mark(huge_pages, local_ranks, mode, free_bytes, reporting)
        self.enabled = self.why_not is None
        self._madvise = _madvise()
        self._mincore = _libc_call("mincore", ctypes.c_char_p)

    def _reason_not_to_mark(self, huge_pages: Optional[bool], local_ranks: int, mode: Optional[str],
                            free_bytes: Optional[int], reporting: Optional[str]) -> Optional[str]:
        """Why this load marks nothing, or None (setting ``_budget`` for auto); asks the kernel
        only as much as the setting needs."""
        if huge_pages is False:
            return "extra config 'huge_pages' is false"
        mode = thp_mode() if mode == "detect" else mode
        if huge_pages and mode not in ("always", "madvise"):
            raise ConfigError(
                f"extra config 'huge_pages' is true but this kernel's transparent huge pages are "
                f"{mode or 'not available'} ({_THP_ENABLED}); set that to madvise (as root), or drop "
                f"'huge_pages' to let distload decide"
            )
        if mode == "always":
            # The kernel already backs aligned ranges with huge pages, under its own defrag
            # policy; marking them would make their faults compact memory.
            return "the kernel gives huge pages to every large allocation itself (mode always)"
        if mode != "madvise":
            return f"transparent huge pages are {mode or 'not available'}"
        if huge_pages:
            return None
        reporting = free_page_reporting() if reporting == "detect" else reporting
        if reporting:
            return (f"the balloon {reporting} reports free pages to the host, so huge pages fault "
                    f"slowly; 'huge_pages': true overrides")
        free = free_huge_page_bytes() if free_bytes is None else free_bytes
        self._budget = free // max(1, local_ranks)
        if self._budget < self.huge_page_bytes:
            return "the kernel has no free huge-page-sized blocks (/proc/buddyinfo)"
        return None

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """``torch.empty(shape, dtype)`` on the host, its aligned interior marked for huge pages."""
        tensor = torch.empty(shape, dtype=dtype)
        if self.enabled:
            self._mark(tensor)
        return tensor

    def prefault(self, address: int, length: int) -> None:
        """Back ``[address, address + length)`` of a new tensor with memory now, in one call
        (where the kernel can; the bytes count in ``prefaulted_bytes``)."""
        if self.why_not_prefault is not None or length < MIN_PREFAULT_BYTES:
            return
        first = address // PAGE_BYTES * PAGE_BYTES
        if self._madvise(first, address + length - first, _MADV_POPULATE_WRITE) == 0:
            with self._lock:
                self.prefaulted_bytes += length
            return
        err = ctypes.get_errno()
        # EINVAL: a kernel before 5.14; EPERM: a filter. ENOMEM (no memory to back it) would
        # come back on the first write as well: nothing to gain from trying the next tensor.
        self.why_not_prefault = f"madvise(MADV_POPULATE_WRITE) failed: {os.strerror(err)}"

    def backed(self, address: int, length: int) -> bool:
        """Whether every page of ``[address, address + length)`` already has memory (mincore):
        a caller's tensor that was written before, as opposed to one made by torch.empty."""
        first = address // PAGE_BYTES * PAGE_BYTES
        span = address + length - first
        vector = ctypes.create_string_buffer(-(-span // PAGE_BYTES))
        if self._mincore(first, span, vector) != 0:
            return False  # cannot tell: prefaulting is safe either way
        return b"\x00" not in vector.raw  # one byte a page, its lowest bit set where resident

    def _mark(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        page = self.huge_page_bytes
        if nbytes < MIN_TENSOR_PAGES * page:
            return
        start = tensor.data_ptr()
        first = -(-start // page) * page
        last = (start + nbytes) // page * page
        length = last - first
        if length <= 0:
            return
        with self._lock:
            if self._budget is not None and self._budget < length:
                return
            if not _take_slot():
                return
            if self._budget is not None:
                self._budget -= length
            if self._madvise(first, length, _MADV_HUGEPAGE) != 0:
                err = ctypes.get_errno()
                if self._required:
                    raise ConfigError(f"extra config 'huge_pages' is true but madvise(MADV_HUGEPAGE) "
                                      f"failed: {os.strerror(err)}; drop 'huge_pages' to let "
                                      f"distload decide")
                # The kernel said madvise mode but refused (a seccomp filter): stop marking. The
                # tensor is fine, its backing stays 4 KiB pages; the report's count shows it.
                self.enabled = False
                self.why_not = f"madvise(MADV_HUGEPAGE) failed: {os.strerror(err)}"
                return
            self.marked_bytes += length


def _take_slot() -> bool:
    """Count one more marked tensor against this process's share of vm.max_map_count."""
    with RUNTIME.lock:
        if RUNTIME.huge_page_slots is None:
            RUNTIME.huge_page_slots = _read_int(_MAX_MAP_COUNT, 65530) // 8
        if RUNTIME.huge_page_slots <= 0:
            return False
        RUNTIME.huge_page_slots -= 1
        return True
