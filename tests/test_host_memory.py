"""New host tensors on transparent huge pages (distload.loading.host_memory) and the huge_pages setting."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

import distload
from distload.runtime import RUNTIME
from distload.errors import ConfigError
from distload.loading.host_memory import (
    huge_page_bytes,
    HostMemory,
    free_huge_page_bytes,
    free_page_reporting,
    thp_mode,
)
from distload.live.sleep import WeightSleeper

HUGE_PAGE_BYTES = huge_page_bytes()

from conftest import plain_read, write_whole

MIB = 1024 * 1024


def marked_in_kernel(tensor: torch.Tensor) -> bool:
    """Whether the kernel holds the tensor's memory as eligible for huge pages (smaps THPeligible)."""
    address = tensor.data_ptr() + tensor.numel() * tensor.element_size() // 2
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                low, high = (int(x, 16) for x in fields[0].split("-"))
                inside = low <= address < high
            elif inside and fields[0] == "THPeligible:":
                return fields[1] == "1"
    raise AssertionError("the tensor's mapping is not in /proc/self/smaps")


def aligned_interior(tensor: torch.Tensor) -> int:
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return max(0, end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES - -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES)


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert thp_mode(str(path)) == "madvise"
    path.write_text("[always] madvise never\n")
    assert thp_mode(str(path)) == "always"
    assert thp_mode(str(tmp_path / "missing")) is None


def test_free_huge_page_bytes_counts_blocks_of_order_9_and_up(tmp_path):
    path = tmp_path / "buddyinfo"
    # Orders 0..10; order 9 = one 2 MiB huge page, order 10 = two.
    path.write_text("Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1      3\n"
                    "Node 0, zone   Normal  16988  23957   4738    884   1125   4332   3646    834   1323    285   2126\n")
    assert free_huge_page_bytes(str(path)) == (1 + 3 * 2 + 285 + 2126 * 2) * HUGE_PAGE_BYTES
    assert free_huge_page_bytes(str(tmp_path / "missing")) == 0


def _virtio(root, name, device_id, features):
    os.makedirs(root / name)
    (root / name / "device").write_text(device_id + "\n")
    (root / name / "features").write_text(features + "\n")


def test_free_page_reporting_is_the_balloon_with_feature_bit_5(tmp_path):
    _virtio(tmp_path, "virtio0", "0x0002", "0" * 5 + "1" + "0" * 58)  # a block device, bit 5 set
    _virtio(tmp_path, "virtio1", "0x0005", "01100000" + "0" * 56)  # a balloon without reporting
    assert free_page_reporting(str(tmp_path)) is None
    _virtio(tmp_path, "virtio2", "0x0005", "01100101" + "0" * 56)  # a balloon that reports
    assert free_page_reporting(str(tmp_path)) == "virtio2"
    assert free_page_reporting(str(tmp_path / "missing")) is None


# madvise(MADV_HUGEPAGE) fails with EINVAL on a kernel built without transparent huge pages.
needs_thp_kernel = pytest.mark.skipif(
    thp_mode() is None,
    reason="this kernel has no transparent huge pages at all (no /sys/kernel/mm/transparent_hugepage)",
)
needs_madvise_thp = pytest.mark.skipif(
    thp_mode() not in ("madvise", "always"),
    reason=f"the kernel has no transparent huge pages (mode {thp_mode()}); smaps would never say THPeligible",
)


@needs_madvise_thp
def test_marked_tensors_are_huge_page_eligible_in_the_kernel():
    memory = HostMemory(None, mode="madvise", reporting=None, free_bytes=1 << 40)
    big = memory.empty((16 * MIB,), torch.float32)  # 64 MiB
    plain = torch.empty(16 * MIB, dtype=torch.float32)
    assert memory.enabled and memory.why_not is None
    assert memory.marked_bytes == aligned_interior(big) >= 62 * MIB
    assert marked_in_kernel(big)
    if thp_mode() == "madvise":
        assert not marked_in_kernel(plain)
    # Still an ordinary tensor: writable, and its storage resizes (WeightSleeper relies on it).
    big.fill_(3.0)
    assert float(big[12345]) == 3.0
    big.untyped_storage().resize_(0)


def test_small_tensors_are_not_marked():
    memory = HostMemory(None, mode="madvise", reporting=None, free_bytes=1 << 40)
    memory.empty((MIB - 1,), torch.float32)  # just under 4 MiB
    assert memory.marked_bytes == 0


@needs_thp_kernel
def test_auto_stays_within_the_free_blocks_shared_by_the_node_ranks():
    # 100 MiB of free 2 MiB blocks shared by 2 ranks: 50 MiB each; one 64 MiB tensor does not fit.
    memory = HostMemory(None, local_ranks=2, mode="madvise", reporting=None, free_bytes=100 * MIB)
    memory.empty((64 * MIB,), torch.uint8)
    assert memory.marked_bytes == 0
    memory.empty((40 * MIB,), torch.uint8)
    assert 38 * MIB <= memory.marked_bytes <= 40 * MIB
    # Explicit true ignores the budget.
    memory = HostMemory(True, local_ranks=2, mode="madvise", reporting=None, free_bytes=0)
    memory.empty((64 * MIB,), torch.uint8)
    assert memory.marked_bytes >= 62 * MIB


@needs_thp_kernel
def test_the_process_marks_at_most_its_share_of_the_map_count(monkeypatch):
    monkeypatch.setattr(RUNTIME, "huge_page_slots", 2)  # as if earlier loads had used the rest
    memory = HostMemory(True, mode="madvise", reporting=None)
    first = memory.empty((8 * MIB,), torch.uint8)
    assert memory.marked_bytes == aligned_interior(first)
    # A second load in the same process shares the count.
    other = HostMemory(True, mode="madvise", reporting=None)
    second = other.empty((8 * MIB,), torch.uint8)
    other.empty((8 * MIB,), torch.uint8)
    assert other.marked_bytes == aligned_interior(second)
    assert RUNTIME.huge_page_slots == 0


@pytest.mark.parametrize("setting, mode, reporting, why", [
    (False, "madvise", None, "'huge_pages' is false"),
    (None, "never", None, "transparent huge pages are never"),
    (None, "always", None, "mode always"),
    (None, "madvise", "virtio0", "balloon virtio0 reports free pages"),
])
def test_when_nothing_is_marked_the_reason_is_given(setting, mode, reporting, why):
    memory = HostMemory(setting, mode=mode, reporting=reporting, free_bytes=1 << 40)
    memory.empty((8 * MIB,), torch.uint8)
    assert not memory.enabled and memory.marked_bytes == 0
    assert why in memory.why_not


def test_auto_without_free_huge_blocks_marks_nothing_and_says_why():
    memory = HostMemory(None, local_ranks=4, mode="madvise", reporting=None, free_bytes=3 * MIB)
    memory.empty((8 * MIB,), torch.uint8)
    assert not memory.enabled and memory.marked_bytes == 0
    assert "no free huge-page-sized blocks" in memory.why_not


@pytest.mark.parametrize("backend, used", [("pread", True), ("ranged", True), ("safetensors", True),
                                           ("runai", False), ("instanttensor", False), ("dummy", False)])
def test_huge_pages_true_concerns_only_backends_that_create_host_tensors(monkeypatch, backend, used):
    import distload.loading.host_memory as host_memory
    from distload.loading.backends import BACKENDS
    from distload.loading.choice import ReadChoice
    from distload.loading.index import CheckpointIndex
    from distload.loading.plan import RankPlan

    assert BACKENDS[backend].creates_host_tensors is used
    monkeypatch.setattr(host_memory, "thp_mode", lambda: "never")  # a kernel with huge pages off
    plan = RankPlan("/ckpt", ReadChoice(False, backend, False), CheckpointIndex(()))
    with distload.WorkerGroup(device="cpu") as group:
        loader = distload.Loader("/ckpt", "auto", {"huge_pages": True}, group=group)
        if used:
            with pytest.raises(ConfigError, match="'huge_pages' is true"):
                loader._request(plan, {})
        else:
            assert not loader._request(plan, {}).host_memory.enabled


@needs_thp_kernel
def test_explicit_true_overrides_free_page_reporting():
    memory = HostMemory(True, mode="madvise", reporting="virtio0")
    memory.empty((8 * MIB,), torch.uint8)
    assert memory.enabled and memory.marked_bytes > 0


@pytest.mark.parametrize("mode", ["never", None])
def test_explicit_true_without_kernel_support_fails_loudly(mode):
    with pytest.raises(ConfigError, match=r"'huge_pages' is true .*transparent_hugepage/enabled"):
        HostMemory(True, mode=mode, reporting=None)


@needs_madvise_thp
@pytest.mark.parametrize("load_format, layout", [("auto", "whole"), ("auto", "sharded"),
                                                 ("safetensors", "whole"), ("sharded_state", "sharded")])
def test_loads_on_huge_pages_are_bit_identical_and_reported(tmp_path, load_format, layout):
    state = {f"w{i}": torch.randn(1024 + i, 1024) for i in range(3)}  # 4 MiB+ each
    state["small"] = torch.arange(10, dtype=torch.int16)
    folder = str(tmp_path / "ck")
    if layout == "whole":
        paths = write_whole(folder, state, num_files=2)
    else:  # one rank's pre-sharded files
        os.makedirs(folder)
        names = sorted(state)
        paths = [os.path.join(folder, f"model-rank-0-part-{part}.safetensors") for part in range(2)]
        for part, path in enumerate(paths):
            save_file({n: state[n] for n in names[part::2]}, path)
    with distload.WorkerGroup(device="cpu") as group:
        result = distload.Loader(folder, load_format, {"huge_pages": True}, group=group).load()
        loaded, report = result.state, result.rank_report
    want = plain_read(paths)
    assert set(loaded) == set(want)
    for name in want:
        assert loaded[name].dtype == want[name].dtype and loaded[name].equal(want[name]), name
    assert report.huge_page_marked_bytes >= 3 * 2 * MIB
    WeightSleeper(loaded).sleep(2)  # storages stay resizable


def test_huge_pages_setting_is_validated():
    from distload.loading.formats import make_load_config

    with pytest.raises(ConfigError, match=r"'huge_pages' must be a bool"):
        make_load_config("auto", {"huge_pages": "yes"})
    with pytest.raises(ConfigError, match=r"Unexpected extra config keys \['huge_pages'\]"):
        make_load_config("runai_streamer", {"huge_pages": True})
