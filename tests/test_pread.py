"""distload's own parallel-pread reader (the `auto` path on local CPU files)."""

from __future__ import annotations

import os

import pytest
import torch

import distload
from distload.loading.backends import pread
from distload.loading.backends.base import ReadRequest
from distload.loading.backends.pread import PreadBackend
from distload.loading.formats import make_load_config
from distload.errors import CheckpointError
from distload.loading.planner import plan_rank
from distload.live.sleep import WeightSleeper

from conftest import every_dtype_state, plain_read, write_whole


def read_all(folder: str, group, backend: PreadBackend = PreadBackend(), **extra) -> dict[str, torch.Tensor]:
    plan = plan_rank(folder, make_load_config("auto"), group)
    request = ReadRequest(index=plan.index, device=group.device, group=group, options=backend.options(extra, plan))
    return dict(backend.read(request).tensors())


@pytest.fixture
def group():
    with distload.WorkerGroup(device="cpu") as g:
        yield g


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8)))


@pytest.mark.parametrize("concurrency", [1, 3])
def test_bit_identical_with_chunks_and_read_ahead(tmp_path, group, concurrency):
    # Small chunks and window, so one tensor spans several chunks and the window fills.
    small = PreadBackend(chunk_bytes=4096, read_ahead_bytes=16384)
    state = every_dtype_state()
    state["big"] = torch.randn(100, 301)  # 120 KB: 30 chunks
    paths = write_whole(str(tmp_path / "ck"), state, num_files=3)
    got = read_all(str(tmp_path / "ck"), group, small, concurrency=concurrency)
    want = plain_read(paths)
    assert set(got) == set(want)
    assert all(same_bytes(got[n], want[n]) for n in want)


def test_tensors_are_owned_and_can_sleep(tmp_path, group):
    """No memory map and no numpy view: the tensor survives the file and its storage resizes."""
    paths = write_whole(str(tmp_path / "ck"), every_dtype_state(), num_files=1)
    got = read_all(str(tmp_path / "ck"), group)
    want = plain_read(paths)
    os.unlink(paths[0])
    assert all(same_bytes(got[n], want[n]) for n in want)
    sizes = {n: t.untyped_storage().nbytes() for n, t in got.items()}
    sleeper = WeightSleeper(got)
    sleeper.sleep(2)
    assert all(t.untyped_storage().nbytes() == 0 for t in got.values())  # released, not copied
    sleeper.wake()
    assert {n: t.untyped_storage().nbytes() for n, t in got.items()} == sizes
    assert all(got[n].shape == want[n].shape and got[n].dtype == want[n].dtype for n in want)


def test_file_shrinking_after_planning_names_file_and_tensor(tmp_path, group):
    paths = write_whole(str(tmp_path / "ck"), {"a": torch.ones(1000), "b": torch.ones(1000)}, num_files=1)
    plan = plan_rank(str(tmp_path / "ck"), make_load_config("auto"), group)
    os.truncate(paths[0], os.path.getsize(paths[0]) - 100)  # a copy still in progress, say
    with pytest.raises(CheckpointError, match=r"ended while reading tensor 'b'") as info:
        dict(PreadBackend().read(ReadRequest(index=plan.index, device=group.device, group=group)).tensors())
    assert paths[0] in str(info.value)


def test_auto_reports_the_pread_path(tmp_path, group):
    write_whole(str(tmp_path / "ck"), every_dtype_state(), num_files=2)
    result = distload.Loader(str(tmp_path / "ck"), "auto", group=group).load()
    state, report = result.state, result.rank_report
    assert report.path == "pread"
    assert report.nbytes == sum(t.numel() * t.element_size() for t in state.values())
    assert report.peak_rss_bytes > 0


def test_reads_straight_into_fitting_destinations(tmp_path, group):
    """An in-place reload hands its tensors over: a fitting one is filled, a misfit is not used."""
    paths = write_whole(str(tmp_path / "ck"), {"a": torch.randn(64, 8), "b": torch.randn(16)}, num_files=1)
    plan = plan_rank(str(tmp_path / "ck"), make_load_config("auto"), group)
    fits, misfit = torch.zeros(64, 8), torch.zeros(16, dtype=torch.float64)
    request = ReadRequest(index=plan.index, device=group.device, group=group, destinations={"a": fits, "b": misfit})
    got = dict(PreadBackend().read(request).tensors())
    want = plain_read(paths)
    assert got["a"] is fits and torch.equal(fits, want["a"])
    assert got["b"] is not misfit and torch.equal(got["b"], want["b"]) and not misfit.any()


def test_auto_concurrency_sets_the_reader_threads(tmp_path, group, monkeypatch):
    workers = []

    class Recording(pread.ThreadPoolExecutor):
        def __init__(self, max_workers=None, **kwargs):
            workers.append(max_workers)
            super().__init__(max_workers=max_workers, **kwargs)

    monkeypatch.setattr(pread, "ThreadPoolExecutor", Recording)
    monkeypatch.setattr(pread, "PREFAULT_UNIT_BYTES", 64)  # more units of work than threads
    paths = write_whole(str(tmp_path / "ck"), every_dtype_state(), num_files=2)
    got = distload.load(str(tmp_path / "ck"), "auto", {"concurrency": 3}, group=group)
    want = plain_read(paths)
    assert workers == [3]
    assert set(got) == set(want) and all(same_bytes(got[n], want[n]) for n in want)


def test_a_small_load_starts_no_more_threads_than_units_of_work(tmp_path, group, monkeypatch):
    """Each reader thread costs its start: a checkpoint smaller than one unit (32 MiB) is read
    by one thread, one of three units by three, not by the default eight."""
    workers = []

    class Recording(pread.ThreadPoolExecutor):
        def __init__(self, max_workers=None, **kwargs):
            workers.append(max_workers)
            super().__init__(max_workers=max_workers, **kwargs)

    monkeypatch.setattr(pread, "ThreadPoolExecutor", Recording)
    paths = write_whole(str(tmp_path / "small"), every_dtype_state(), num_files=2)
    got = distload.load(str(tmp_path / "small"), "auto", group=group)
    want = plain_read(paths)
    assert set(got) == set(want) and all(same_bytes(got[n], want[n]) for n in want)
    state = {f"w{i}": torch.randn(256, generator=torch.Generator().manual_seed(i)) for i in range(3)}
    paths = write_whole(str(tmp_path / "three"), state, num_files=1)  # 3 KiB: three units of 1 KiB
    monkeypatch.setattr(pread, "PREFAULT_UNIT_BYTES", 1024)
    got = distload.load(str(tmp_path / "three"), "auto", group=group)
    assert workers == [1, 3]
    assert all(same_bytes(got[n], state[n]) for n in state) and set(got) == set(state)


def test_many_small_ranges_are_copied_out_of_the_map_exactly_and_a_truncated_file_is_named(tmp_path):
    """A slice along a later dimension is one small range per row: those are copied out of the
    file's map in a few process_vm_readv calls (more ranges than one call takes), byte for byte."""
    from distload.loading.mapped import IOV_BATCH, safe_copy_available

    if not safe_copy_available():
        pytest.skip("process_vm_readv is refused here: the reader uses preads (tested above)")
    rows, row = IOV_BATCH + 300, 96
    data = torch.randint(0, 256, (rows * row,), dtype=torch.uint8)
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(data.numpy()))
    extents = [(r * row + 16, r * 40, 40) for r in range(rows)]  # 40 of every 96 bytes
    expected = data.view(rows, row)[:, 16:56].reshape(-1)
    out = torch.zeros(rows * 40, dtype=torch.uint8)
    opened = pread._OpenFile.open(str(path))
    try:
        pread._read_extents(opened, out.data_ptr(), memoryview(out.numpy()), 0, extents, "w")
        assert torch.equal(out, expected)
        os.truncate(path, row * 100)  # shrinks under the map: the copy stops, it never SIGBUSes
        with pytest.raises(CheckpointError, match=r"data\.bin.*'w'.*shorter"):
            pread._read_extents(opened, out.data_ptr(), memoryview(out.numpy()), 0, extents, "w")
    finally:
        opened.close()
