"""Where a load's bytes are (distload.loading.residency) and the pread reader's prefaulted units."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

import torch

import distload
from distload.loading import host_memory as host_memory_module
from distload.loading.backends import pread
from distload.loading.backends.base import ReadRequest
from distload.loading.backends.pread import PreadBackend
from distload.loading.formats import make_load_config
from distload.loading.planner import plan_rank
from distload.loading.host_memory import HostMemory
from distload.loading.residency import PAGE, Residency, probe

from conftest import plain_read, write_whole

MIB = 1024 * 1024


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def probe_path(path: str) -> Residency:
    fd = os.open(path, os.O_RDONLY)
    try:
        residency = probe(fd)
    finally:
        os.close(fd)
    assert residency is not None, "mincore over a file map works on Linux"
    return residency


def test_probe_sees_what_was_read_and_nothing_else(tmp_path):
    path = str(tmp_path / "f.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(64 * PAGE))
    evict(path)
    assert probe_path(path).resident_bytes() == 0
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead beyond the pages read
        f.seek(10 * PAGE + 100)
        f.read(3 * PAGE)  # pages 10..13
    residency = probe_path(path)
    assert residency.size == 64 * PAGE
    assert residency.resident_bytes(10 * PAGE, 14 * PAGE) == 4 * PAGE
    assert residency.resident_bytes(0, 10 * PAGE) == 0
    # Ranges that cut a page count only their part of it.
    assert residency.resident_bytes(10 * PAGE + 1000, 11 * PAGE + 10) == PAGE - 1000 + 10
    assert residency.fraction(10 * PAGE, 12 * PAGE) == 1.0
    assert residency.fraction(8 * PAGE, 12 * PAGE) == 0.5
    with open(path, "rb") as f:
        f.read()
    assert probe_path(path).fraction() == 1.0


def test_probe_of_an_empty_or_truncated_file(tmp_path):
    path = str(tmp_path / "f.bin")
    open(path, "wb").close()
    assert probe_path(path).size == 0 and probe_path(path).fraction() == 1.0
    with open(path, "wb") as f:
        f.write(b"x" * (5 * PAGE))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.truncate(path, PAGE)  # shrunk under an open descriptor: the probe only maps what is there
        residency = probe(fd)
    finally:
        os.close(fd)
    assert residency.size == PAGE and residency.fraction() == 1.0


def resident_pages(address: int, length: int) -> int:
    """How many pages of a range the kernel has backed (mincore works on anonymous maps)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    vector = ctypes.create_string_buffer(-(-length // PAGE))
    assert libc.mincore(address, length, vector) == 0
    return sum(b & 1 for b in vector.raw)


def test_prefault_backs_the_memory_before_any_write():
    # A fresh anonymous map (torch's allocator may hand out memory an earlier test already touched).
    length = 16 * MIB
    fresh = mmap.mmap(-1, length)
    address = ctypes.addressof(ctypes.c_char.from_buffer(fresh))
    try:
        assert resident_pages(address, length) == 0
        memory = HostMemory(False)
        memory.prefault(address, length)
        assert resident_pages(address, length) == length // PAGE
        assert memory.prefaulted_bytes == length and memory.why_not_prefault is None
        memory.prefault(address, 1000)  # not worth a call
        assert memory.prefaulted_bytes == length
    finally:
        fresh.close()


def test_a_kernel_that_refuses_prefaulting_is_asked_once_and_said(monkeypatch, tmp_path):
    calls = []

    def refusing(address, length, advice):
        calls.append(advice)
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(host_memory_module, "_madvise", lambda: refusing)
    memory = HostMemory(False)
    for _ in range(3):
        tensor = memory.empty((4 * MIB,), torch.uint8)
        memory.prefault(tensor.data_ptr(), 4 * MIB)
    assert calls == [host_memory_module._MADV_POPULATE_WRITE]
    assert memory.prefaulted_bytes == 0
    assert "MADV_POPULATE_WRITE" in memory.why_not_prefault and "Invalid argument" in memory.why_not_prefault
    # A load on such a kernel still gives the right bytes.
    monkeypatch.setattr(pread, "PREFAULT_UNIT_BYTES", MIB)
    paths = write_whole(str(tmp_path / "ck"), {"w": torch.randn(3 * MIB // 4)}, num_files=1)
    with distload.WorkerGroup(device="cpu") as group:
        result = distload.Loader(str(tmp_path / "ck"), "auto", group=group).load()
    assert torch.equal(result.state["w"], plain_read(paths)["w"])
    assert result.rank_report.prefaulted_bytes == 0


def test_the_report_says_where_the_bytes_were_and_what_was_prefaulted(tmp_path, monkeypatch):
    # Units of 1 MiB over tensors of 3 MiB: each tensor is three prefaulted units of reads.
    monkeypatch.setattr(pread, "PREFAULT_UNIT_BYTES", MIB)
    monkeypatch.setattr(pread, "CHUNK_BYTES", 256 * 1024)
    state = {f"w{i}": torch.randn(3 * MIB // 4) for i in range(4)}
    state["small"] = torch.arange(10, dtype=torch.int64)
    paths = write_whole(str(tmp_path / "ck"), state, num_files=2)
    want = plain_read(paths)
    for path in paths:
        with open(path, "rb") as f:
            f.read()
    evict(paths[1])
    cold_bytes = sum(t.numel() * t.element_size() for t in plain_read([paths[1]]).values())
    evict(paths[1])  # plain_read mapped it in again
    with distload.WorkerGroup(device="cpu") as group:
        result = distload.Loader(str(tmp_path / "ck"), "auto", group=group).load()
    report = result.rank_report
    assert set(result.state) == set(want)
    assert all(torch.equal(result.state[n].view(torch.uint8), want[n].view(torch.uint8)) for n in want)
    assert report.reader_bytes == {"pread/page-cache": report.nbytes - cold_bytes, "pread/storage": cold_bytes}
    assert report.prefaulted_bytes == 4 * 3 * MIB  # the small tensor is not worth a call
    assert "pread/storage" in "\n".join(distload.LoadReport(1, "auto", "x", [report]).summary_lines())


def _read_a_into(tmp_path, target: torch.Tensor, memory: HostMemory):
    """A checkpoint of tensors a and b (4 MiB each) read by pread, a into ``target`` in place:
    what the read handed out, a plain read of the same files, and the backend's run."""
    paths = write_whole(str(tmp_path / "ck"), {"a": torch.randn(MIB), "b": torch.randn(MIB)}, num_files=1)
    with distload.WorkerGroup(device="cpu") as group:
        plan = plan_rank(str(tmp_path / "ck"), make_load_config("auto"), group)
        run = PreadBackend().read(ReadRequest(index=plan.index, device=group.device, group=group,
                                              destinations={"a": target}, host_memory=memory))
        got = dict(run.tensors())
    return got, plain_read(paths), run


def test_in_place_reads_prefault_a_destination_only_where_it_is_not_backed_yet(tmp_path):
    """A caller's tensor never written (torch.empty, a DTensor model before its first load) is
    prefaulted like a new one; one already backed is not (the call would only cost)."""
    import mmap

    region = mmap.mmap(-1, 4 * MIB)  # fresh anonymous memory: no page backed yet
    fresh = torch.frombuffer(region, dtype=torch.float32)
    memory = HostMemory(False)
    assert not memory.backed(fresh.data_ptr(), 4 * MIB)
    got, want, _ = _read_a_into(tmp_path, fresh, memory)
    assert got["a"] is fresh and torch.equal(fresh, want["a"]) and torch.equal(got["b"], want["b"])
    if memory.why_not_prefault is None:
        assert memory.prefaulted_bytes == 8 * MIB  # a (not backed yet) and b (new)
    assert memory.backed(fresh.data_ptr(), 4 * MIB)
    del got, fresh


def test_in_place_reads_prefault_nothing_already_backed(tmp_path):
    """Existing tensors that are already backed: only new ones are prefaulted."""
    target = torch.zeros(MIB)
    memory = HostMemory(False)
    got, want, run = _read_a_into(tmp_path, target, memory)
    assert got["a"] is target and torch.equal(target, want["a"]) and torch.equal(got["b"], want["b"])
    assert memory.prefaulted_bytes == 4 * MIB  # b only
    assert sum(run.reader_bytes.values()) == 8 * MIB
