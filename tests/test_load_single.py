"""Single-process loads through the public API, checked bit for bit against a plain safetensors read."""

from __future__ import annotations

import glob
import os

import pytest
import torch

import distload
from distload.errors import BackendUnavailableError, CheckpointError, ShardLayoutError

from conftest import ALL_DTYPES, every_dtype_state, plain_read, write_sharded, write_whole

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


@pytest.fixture(autouse=True)
def single_process_env(monkeypatch):
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)


def raw(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().reshape(-1).contiguous().cpu()
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def assert_bit_equal(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(expected)
    for name, want in expected.items():
        got = loaded[name]
        assert got.dtype == want.dtype, name
        assert tuple(got.shape) == tuple(want.shape), name
        assert raw(got) == raw(want), name


@pytest.fixture
def sharded_ckpt(tmp_path):
    folder = str(tmp_path / "sharded")
    states = write_sharded(folder, world_size=1, parts=2)
    files = sorted(glob.glob(os.path.join(folder, "model-rank-0-part-*.safetensors")))
    assert len(files) == 2
    return folder, states[0], files


def test_fixture_covers_every_dtype_zero_d_and_empty(whole_ckpt):
    _, state = whole_ckpt
    dtypes = {t.dtype for t in state.values()}
    assert set(ALL_DTYPES) <= dtypes
    assert any(t.dim() == 0 for t in state.values())
    assert any(t.numel() == 0 for t in state.values())


@pytest.mark.parametrize("fmt", ["safetensors", "runai_streamer", "auto"])
def test_whole_checkpoint_bit_for_bit(whole_ckpt, fmt):
    folder, state = whole_ckpt
    expected = plain_read(sorted(glob.glob(os.path.join(folder, "*.safetensors"))))
    assert_bit_equal(expected, state)  # the fixture's own round trip
    loaded = distload.load(folder, fmt)
    assert_bit_equal(loaded, expected)


@pytest.mark.parametrize("fmt", ["sharded_state", "runai_streamer_sharded", "auto"])
def test_sharded_checkpoint_bit_for_bit(sharded_ckpt, fmt):
    folder, state, files = sharded_ckpt
    expected = plain_read(files)
    assert_bit_equal(expected, state)
    loaded = distload.load(folder, fmt)
    assert_bit_equal(loaded, expected)


def test_single_file_source(tmp_path):
    state = every_dtype_state(seed=5)
    path = write_whole(str(tmp_path / "one"), state, num_files=1)[0]
    for fmt in ("safetensors", "runai_streamer", "auto"):
        assert_bit_equal(distload.load(path, fmt), plain_read([path]))


def test_loaded_tensors_do_not_share_the_file_mapping(tmp_path):
    folder = str(tmp_path / "w")
    paths = write_whole(folder, {"x": torch.arange(16, dtype=torch.float32)}, num_files=1)
    loaded = distload.load(folder, "safetensors", device="cpu")
    # Overwrite the file in place: a loaded tensor must not change under its user.
    with open(paths[0], "r+b") as f:
        size = os.path.getsize(paths[0])
        f.seek(size - 64)
        f.write(b"\xff" * 64)
    assert torch.equal(loaded["x"], torch.arange(16, dtype=torch.float32))


def test_sharded_format_on_whole_checkpoint_fails(whole_ckpt):
    folder, _ = whole_ckpt
    with pytest.raises(ShardLayoutError, match="only pre-sharded checkpoints are currently supported"):
        distload.load(folder, "sharded_state")


def test_sharded_custom_pattern(tmp_path):
    pattern = "tp{rank}-shard{part}.safetensors"
    folder = str(tmp_path / "custom")
    states = write_sharded(folder, world_size=1, parts=3, pattern=pattern)
    loaded = distload.load(folder, "runai_streamer_sharded", {"pattern": pattern})
    assert_bit_equal(loaded, states[0])
    loaded = distload.load(folder, "sharded_state", '{"pattern": "tp{rank}-shard{part}.safetensors"}')
    assert_bit_equal(loaded, states[0])


def test_sharded_for_two_ranks_refused_on_one(tmp_path):
    folder = str(tmp_path / "two")
    write_sharded(folder, world_size=2)
    with pytest.raises(ShardLayoutError, match="saved for 2 ranks, this job has 1"):
        distload.load(folder, "sharded_state")


def test_runai_knobs_load_the_same_and_restore_environment(whole_ckpt, monkeypatch):
    folder, state = whole_ckpt
    monkeypatch.delenv("RUNAI_STREAMER_CONCURRENCY", raising=False)
    monkeypatch.delenv("RUNAI_STREAMER_MEMORY_LIMIT", raising=False)
    before = dict(os.environ)
    loaded = distload.load(folder, "runai_streamer", {"concurrency": 2, "memory_limit": 0})
    assert_bit_equal(loaded, state)
    assert dict(os.environ) == before


# -- dummy -----------------------------------------------------------------------------------

def test_dummy_same_names_shapes_dtypes_and_deterministic(whole_ckpt):
    folder, state = whole_ckpt
    first = distload.load(folder, "dummy")
    second = distload.load(folder, "dummy")
    assert sorted(first) == sorted(state)
    for name, want in state.items():
        got = first[name]
        assert got.dtype == want.dtype, name
        assert tuple(got.shape) == tuple(want.shape), name
        assert raw(got) == raw(second[name]), name
        if got.dtype.is_floating_point and got.numel():
            # Uniform in [-1e-3, 1e-3] before rounding to the dtype: |v| <= 1e-3 rounded to it
            # (for float8_e4m3fn that is its smallest subnormal, 2**-9).
            bound = torch.tensor(1e-3).to(got.dtype).double().item()
            values = got.double().cpu()
            assert values.abs().max().item() <= bound, name
            if got.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16) and got.numel() > 4:
                assert values.abs().max().item() > 1e-4, name  # real random values, not zeros
                assert bound <= 1.01e-3
    # Dummy values are not the checkpoint's values.
    big = [n for n, t in state.items() if t.dtype == torch.float32 and t.numel() > 1]
    assert big and any(raw(first[n]) != raw(state[n]) for n in big)


def test_dummy_still_validates_headers(tmp_path):
    folder = str(tmp_path / "w")
    paths = write_whole(folder, every_dtype_state(), num_files=2)
    with open(paths[0], "r+b") as f:
        f.truncate(os.path.getsize(paths[0]) - 1)
    with pytest.raises(CheckpointError, match="shorter than its header says"):
        distload.load(folder, "dummy")


def test_dummy_on_sharded_folder_uses_this_ranks_shards(sharded_ckpt):
    folder, state, _ = sharded_ckpt
    loaded = distload.load(folder, "dummy")
    assert sorted(loaded) == sorted(state)


# -- instanttensor ---------------------------------------------------------------------------

def test_instanttensor_on_cpu_is_unavailable(whole_ckpt):
    folder, _ = whole_ckpt
    with pytest.raises(BackendUnavailableError) as info:
        distload.load(folder, "instanttensor", device="cpu")
    message = str(info.value)
    assert "CUDA" in message
    assert "cpu" in message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="InstantTensor reads only onto CUDA devices; this machine has no GPU")
def test_instanttensor_on_cuda_bit_for_bit(whole_ckpt):
    folder, state = whole_ckpt
    loaded = distload.load(folder, "instanttensor", device="cuda")
    assert all(t.device.type == "cuda" for t in loaded.values())
    assert_bit_equal(loaded, state)


# -- iter_tensors ----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["safetensors", "runai_streamer", "auto"])
def test_iter_tensors_matches_load(whole_ckpt, fmt):
    folder, state = whole_ckpt
    with distload.WorkerGroup() as group:
        pairs = list(distload.iter_tensors(folder, fmt, group=group))
        loaded = distload.load(folder, fmt, group=group)
    names = [name for name, _ in pairs]
    assert len(names) == len(set(names))
    streamed = dict(pairs)
    assert_bit_equal(streamed, loaded)
    assert_bit_equal(streamed, state)


def test_iter_tensors_sharded(sharded_ckpt):
    folder, state, _ = sharded_ckpt
    with distload.WorkerGroup() as group:
        streamed = dict(distload.iter_tensors(folder, "sharded_state", group=group))
    assert_bit_equal(streamed, state)


def test_loader_report_digest_matches_plain_read(whole_ckpt):
    folder, state = whole_ckpt
    with distload.WorkerGroup() as group:
        result = distload.Loader(folder, "safetensors", group=group).load(gather=True, digest=True)
        loaded, report = result.state, result.report
    assert_bit_equal(loaded, state)
    assert report.world_size == 1
    assert len(report.ranks) == 1
    rank = report.ranks[0]
    assert rank.digest == distload.state_digest(state)
    assert rank.num_tensors == len(state)
    assert rank.nbytes == sum(t.numel() * t.element_size() for t in state.values())
    assert rank.files == sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    assert rank.path == "safetensors"


def test_instanttensor_gets_only_its_own_knobs():
    """`auto` may carry distload's keys (pattern, huge_pages) to InstantTensor on a GPU: they must
    not reach its safe_open, which rejects unknown keyword arguments."""
    import enum
    import types

    from distload.loading.backends.instanttensor import instanttensor_knobs
    from distload.loading.formats import make_load_config

    fake = types.SimpleNamespace(Backend=enum.Enum("Backend", "URING AIO"),
                                 BackendPolicy=enum.Enum("BackendPolicy", "BUFFERED"))
    extra = make_load_config("auto", {"pattern": "w-{rank}-{part}.safetensors", "huge_pages": True}).extra
    assert instanttensor_knobs(extra, fake) == {}
    extra = make_load_config("instanttensor", {"concurrency": 4, "backend": "uring,buffered"}).extra
    assert instanttensor_knobs(extra, fake) == {
        "concurrency": 4, "backend": [fake.Backend.URING, fake.BackendPolicy.BUFFERED]}


# -- every file a rank's glob matches (vLLM's pattern.format(rank=r, part="*")) --------------------

def _two_files(folder, first: str, second: str):
    import os

    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(os.path.join(folder, first)), exist_ok=True)
    os.makedirs(os.path.dirname(os.path.join(folder, second)), exist_ok=True)
    a, b = {"a": torch.arange(4.0)}, {"b": torch.arange(3, dtype=torch.int32)}
    save_file(a, os.path.join(folder, first))
    save_file(b, os.path.join(folder, second))
    return {**a, **b}


@pytest.mark.parametrize("fmt", ["sharded_state", "runai_streamer_sharded", "auto"])
def test_a_non_numbered_part_is_read_not_dropped(tmp_path, fmt):
    state = _two_files(str(tmp_path), "model-rank-0-part-0.safetensors", "model-rank-0-part-final.safetensors")
    assert_bit_equal(distload.load(str(tmp_path), fmt, device="cpu"), state)


@pytest.mark.parametrize("pattern, first, second", [
    ("rank{rank}/part-{part}.safetensors", "rank0/part-0.safetensors", "rank0/part-1.safetensors"),
    ("model-rank-{rank}.safetensors", "model-rank-0.safetensors", None),
])
def test_vllm_patterns_without_part_or_with_a_subfolder_load(tmp_path, pattern, first, second):
    from safetensors.torch import save_file

    if second is None:
        state = {"a": torch.arange(4.0)}
        save_file(state, str(tmp_path / first))
    else:
        state = _two_files(str(tmp_path), first, second)
    for fmt in ("sharded_state", "runai_streamer_sharded"):
        assert_bit_equal(distload.load(str(tmp_path), fmt, {"pattern": pattern}, device="cpu"), state)
