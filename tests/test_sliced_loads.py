"""Sharding-aware loads (issue 14): a tensor-parallel rank reads only the bytes of its own slices.

The reference for every rank is what ``reshard --tensor-parallel-size T`` writes for its TP
rank, read back with the safetensors library (and the slicing itself is checked against vLLM's
rules in test_vllm_shard_shapes.py). ``requested_bytes`` is asserted against the bytes of the
rank's slices, computed here from the shapes alone.
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch

import distload
from distload.errors import ConfigError
from distload.workers.group import WorkerGroup
from distload.loading.backends.pread import batch_extents
from distload.loading.report import state_digest
from distload.tp.slices import Action, Part, slice_bytes, take_shard

from conftest import plain_read, read_report, run_distload, write_whole

HEADS, KV, HEAD_DIM, HIDDEN, INTER, VOCAB = 4, 2, 4, 16, 24, 200
CONFIG = {"num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HEAD_DIM, "hidden_size": HIDDEN,
          "vocab_size": VOCAB}


def llama_state(layers: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """A Llama-shaped state: separate and fused projections, GQA, a vocabulary vLLM pads, dtypes."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, dtype=torch.bfloat16):
        return (torch.randn(shape, generator=g) * 0.1).to(dtype)

    q, kv = HEADS * HEAD_DIM, KV * HEAD_DIM
    state = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "lm_head.weight": w(VOCAB, HIDDEN),
             "model.norm.weight": w(HIDDEN, dtype=torch.float32)}
    for i in range(layers):
        p = f"model.layers.{i}"
        state.update({
            f"{p}.self_attn.q_proj.weight": w(q, HIDDEN), f"{p}.self_attn.k_proj.weight": w(kv, HIDDEN),
            f"{p}.self_attn.v_proj.weight": w(kv, HIDDEN), f"{p}.self_attn.q_proj.bias": w(q),
            f"{p}.self_attn.o_proj.weight": w(HIDDEN, q, dtype=torch.float32),
            f"{p}.mlp.gate_up_proj.weight": w(2 * INTER, HIDDEN), f"{p}.mlp.down_proj.weight": w(HIDDEN, INTER),
            f"{p}.input_layernorm.weight": w(HIDDEN),
        })
    state["model.layers.0.self_attn.qkv_proj.weight"] = w(q + 2 * kv, HIDDEN)  # fused, GQA
    state["model.layers.1.mlp.down_proj.weight"] = w(HIDDEN, INTER).to(torch.int8)  # dim 1, 1-byte
    return state


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(whole folder, {T: reshard folder}) for T = 1, 2, 4."""
    root = str(tmp_path_factory.mktemp("llama"))
    whole = os.path.join(root, "whole")
    write_whole(whole, llama_state(), num_files=2)
    with open(os.path.join(whole, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    saved = {}
    for t in (1, 2, 4):
        saved[t] = os.path.join(root, f"tp{t}")
        distload.reshard(whole, saved[t], t, sharding="decoder")
    return whole, saved


def rank_reference(folder: str, rank: int) -> dict[str, torch.Tensor]:
    names = sorted(n for n in os.listdir(folder) if n.startswith(f"model-rank-{rank}-part-"))
    return plain_read([os.path.join(folder, n) for n in names])


def slice_request_bytes(state: dict[str, torch.Tensor], rank: int, tp: int) -> int:
    """What a reader of slices must ask for: each split tensor's rows of this rank, no padding."""
    spec = distload.load_spec("decoder", CONFIG)
    total = 0
    for name, t in state.items():
        action = spec.action(name, tuple(t.shape))
        piece = slice_bytes(name, tuple(t.shape), t.element_size(), action, rank, tp)
        total += t.numel() * t.element_size() if piece is None else piece.requested_bytes
    return total


def load_as(folder, fmt, rank, tp, **kw):
    with WorkerGroup(device="cpu") as group:
        return distload.Loader(folder, fmt, group=group, tensor_parallel_size=tp, tensor_parallel_rank=rank,
                               **kw).load(digest=True)


# -- pure: extents and batching ------------------------------------------------------------------

def test_slice_bytes_dim0_is_one_extent_and_dim1_one_per_row():
    shape = (8, 6)  # float32 rows of 24 bytes
    piece = slice_bytes("t", shape, 4, Action(0), 1, 2)
    assert piece.shape == (4, 6) and piece.extents == ((4 * 24, 0, 4 * 24),) and piece.zeros == ()
    piece = slice_bytes("t", shape, 4, Action(1), 1, 2)
    assert piece.shape == (8, 3)
    assert piece.extents == tuple((r * 24 + 12, r * 12, 12) for r in range(8))
    fused = slice_bytes("t", (16, 2), 2, Action(0, (Part(8), Part(4), Part(4))), 0, 2)
    assert fused.extents == ((0, 0, 16), (32, 16, 8), (48, 24, 8))  # q rows 0-3, k rows 8-9, v rows 12-13
    padded = slice_bytes("t", (100, 2), 2, Action(0, pad_to=64), 1, 2)  # 128 rows, 64 per rank
    assert padded.extents == ((64 * 4, 0, 36 * 4),) and padded.zeros == ((36 * 4, 28 * 4),)
    assert padded.requested_bytes == 36 * 4 and padded.nbytes == 64 * 4


def test_slice_bytes_match_take_shard_on_every_layout():
    t = torch.arange(4 * 6 * 10, dtype=torch.int16).reshape(4, 6, 10)
    for action in (Action(0), Action(1), Action(2), Action(1, (Part(4), Part(2))), Action(2, pad_to=8)):
        for world in (1, 2):
            for rank in range(world):
                piece = slice_bytes("t", tuple(t.shape), 2, action, rank, world)
                out = torch.zeros(math.prod(piece.shape), dtype=torch.int16)
                src, dst = t.reshape(-1).view(torch.uint8), out.view(torch.uint8)
                for s, d, n in piece.extents:
                    dst[d:d + n] = src[s:s + n]
                assert torch.equal(out.reshape(piece.shape), take_shard(t, action, rank, world)), (action, rank)


def test_batch_extents_cuts_large_and_groups_small():
    assert batch_extents([(0, 0, 25)], 10) == [[(0, 0, 10)], [(10, 10, 10)], [(20, 20, 5)]]
    rows = [(i * 8, i * 4, 4) for i in range(5)]
    assert batch_extents(rows, 10) == [rows[:2], rows[2:4], rows[4:]]
    assert batch_extents([], 10) == []


# -- one process, each TP rank in turn ------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("fmt", ["auto", "safetensors", "runai_streamer"])
def test_each_tp_rank_gets_what_save_sharded_writes(llama, fmt, tp):
    whole, saved = llama
    state = plain_read([os.path.join(whole, n) for n in sorted(os.listdir(whole)) if n.endswith(".safetensors")])
    for rank in range(tp):
        result = load_as(whole, fmt, rank, tp)
        want = rank_reference(saved[tp], rank)
        assert sorted(result.state) == sorted(want)
        for name, tensor in want.items():
            got = result.state[name]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
            assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), (fmt, rank, name)
        report = result.rank_report
        assert report.digest == state_digest(want) and report.tensor_parallel == [rank, tp]
        whole_bytes = sum(t.numel() * t.element_size() for t in state.values())
        if fmt == "auto":  # distload's reader asks for the slices' bytes, exactly
            assert report.path == "pread"
            assert report.requested_bytes == slice_request_bytes(state, rank, tp)
            if tp > 1:
                assert report.requested_bytes < 0.75 * whole_bytes
        else:  # a library reads whole tensors; the loader keeps the slice
            assert report.requested_bytes == whole_bytes


def test_sliced_read_fills_existing_tensors_in_place(llama, tmp_path):
    whole, saved = llama
    want = rank_reference(saved[2], 1)
    model = {name: torch.zeros_like(t) for name, t in want.items()}
    pointers = {name: t.data_ptr() for name, t in model.items()}
    with WorkerGroup(device="cpu") as group:
        report = distload.reload_into(model, whole, group=group, sharding="decoder", tensor_parallel_rank=1,
                                      tensor_parallel_size=2)
        assert {name: t.data_ptr() for name, t in model.items()} == pointers
        for name, tensor in want.items():
            assert torch.equal(model[name].view(torch.uint8), tensor.view(torch.uint8)), name
        assert report.nbytes == sum(t.numel() * t.element_size() for t in want.values())
        state = llama_state()
        assert report.requested_bytes == slice_request_bytes(state, 1, 2)
        # tp_rank/tp_size are the first names of those keywords: the same load, with a warning
        for tensor in model.values():
            tensor.zero_()
        with pytest.warns(DeprecationWarning, match="old name of tensor_parallel_size"), \
                pytest.warns(DeprecationWarning, match="old name of tensor_parallel_rank"):
            distload.reload_into(model, whole, group=group, sharding="decoder", tp_rank=1, tp_size=2)
        for name, tensor in want.items():
            assert torch.equal(model[name].view(torch.uint8), tensor.view(torch.uint8)), name
        with pytest.raises(distload.ReloadError, match="tensor_parallel_size=4 and tp_size=2 disagree"):
            distload.reload_into(model, whole, group=group, tensor_parallel_size=4, tp_size=2)


def test_reload_into_a_model_shaped_for_another_layout_is_refused(llama):
    whole, saved = llama
    model = {name: torch.zeros_like(t) for name, t in rank_reference(saved[2], 0).items()}
    model["model.embed_tokens.weight"] = torch.zeros(VOCAB // 2, HIDDEN, dtype=torch.bfloat16)  # unpadded
    with WorkerGroup(device="cpu") as group, pytest.raises(distload.ReloadError) as err:
        distload.reload_into(model, whole, group=group, tensor_parallel_size=2, tensor_parallel_rank=0)
    assert "model.embed_tokens.weight: the rank's slice [128, 16] in the checkpoint, [100, 16]" in str(err.value)


def test_indivisible_split_is_refused_naming_the_tensor(llama):
    whole, _ = llama
    with pytest.raises(ConfigError) as err:
        load_as(whole, "auto", 0, 3)
    msg = str(err.value)
    assert "cannot be split over 3 ranks" in msg and "tensor 'model." in msg, msg


def test_bad_tensor_parallel_sizes(llama):
    whole, _ = llama
    with WorkerGroup(device="cpu") as group:
        for bad in (0, -1, 1.5, "2"):
            with pytest.raises(ConfigError, match="whole number >= 1"):
                distload.Loader(whole, group=group, tensor_parallel_size=bad)
        with pytest.raises(ConfigError, match="tensor-parallel rank 2 is not in 0..1"):
            distload.Loader(whole, group=group, tensor_parallel_size=2, tensor_parallel_rank=2).plan()


def test_placements_that_do_not_fit_the_tensor_or_the_mesh_are_named():
    """torch says IndexError (Shard(2) of a 2-D tensor) or AssertionError (two placements on a
    1-D mesh); load_dtensors names the tensor and what to give instead, on every rank."""
    from torch.distributed.tensor import Replicate, Shard

    from distload.errors import ConfigError
    from distload.loading.dtensors import check_placements

    assert check_placements("w", (4, 6), (Shard(1),), 1) == (Shard(1),)
    assert check_placements("w", (4, 6), (Shard(-1), Replicate()), 2) == (Shard(-1), Replicate())
    with pytest.raises(ConfigError, match=r"tensor 'w' has 2 dimension\(s\) \(shape \[4, 6\]\), so it cannot be "
                                          r"placed as Shard\(dim=2\): shard along a dimension it has \(0 to 1\)"):
        check_placements("w", (4, 6), (Shard(2),), 1)
    with pytest.raises(ConfigError, match=r"tensor 'b': 2 placement\(s\) .* on a 1-D device mesh: give exactly one "
                                          r"placement per mesh dimension"):
        check_placements("b", (4,), (Shard(0), Replicate()), 1)


def test_tensor_parallelism_that_splits_nothing_is_refused(tmp_path):
    """A checkpoint whose names no spec knows (GPT-2's) under --tensor-parallel-size 2 used to
    load every tensor whole on every rank and exit 0, as if it were split."""
    from safetensors.torch import save_file

    folder = tmp_path / "gpt2"
    folder.mkdir()
    save_file({"h.0.attn.c_attn.weight": torch.zeros(8, 24), "h.0.mlp.c_fc.weight": torch.zeros(8, 32),
               "wte.weight": torch.zeros(50, 8)}, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError) as err:
        load_as(str(folder), "auto", 0, 2)
    message = str(err.value)
    assert "--tensor-parallel-size 2: sharding spec 'decoder' splits none of this checkpoint's 3 tensors" in message
    assert "'h.0.attn.c_attn.weight'" in message and "or load without --tensor-parallel-size" in message
    whole = load_as(str(folder), "auto", 1, 2, sharding="replicate")  # replicated on purpose: loads
    assert whole.state["wte.weight"].shape == (50, 8)


def test_tensor_parallel_size_one_is_the_vllm_tp1_layout(llama):
    whole, saved = llama
    result = load_as(whole, "auto", 0, 1)
    assert result.state["model.embed_tokens.weight"].shape == (256, HIDDEN)  # padded as vLLM at TP 1
    assert result.rank_report.digest == state_digest(rank_reference(saved[1], 0))


def test_plain_spec_and_no_config(llama, tmp_path):
    whole, _ = llama
    bare = str(tmp_path / "bare")
    state = llama_state()
    write_whole(bare, state, num_files=1)  # no config.json
    with pytest.raises(ConfigError) as err:
        load_as(bare, "auto", 0, 2)
    assert "config.json" in str(err.value) and "--sharding plain" in str(err.value)
    with pytest.raises(ConfigError) as err:  # plain splits evenly, but a fused qkv needs its sizes
        load_as(bare, "auto", 0, 2, sharding="plain")
    assert "into q, k and v" in str(err.value) and '"fused": [q, k, v]' in str(err.value)
    del state["model.layers.0.self_attn.qkv_proj.weight"]
    write_whole(bare, state, num_files=1)
    result = load_as(bare, "auto", 1, 2, sharding="plain")
    k = state["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(result.state["model.layers.0.self_attn.k_proj.weight"], k[k.shape[0] // 2:])
    assert result.state["model.embed_tokens.weight"].shape == (VOCAB // 2, HIDDEN)


def test_pre_sharded_checkpoint_refuses_a_sharding_spec(llama):
    _, saved = llama
    with pytest.raises(ConfigError, match="already sharded per rank"):
        load_as(saved[2], "auto", 0, 2, sharding="decoder")


# -- under torchrun: TP groups and data-parallel replicas ---------------------------------------------

FOUR_RANK_CASES = [(4, 2, "whole"), (4, 2, "saved"), (4, 4, "whole")]


@pytest.fixture(scope="module")
def four_rank_job(llama, tmp_path_factory):
    """The 4-rank cases of test_ranks_keep_their_tp_ranks_slices in one torchrun job
    (dist_helpers.CliJob), not one job each."""
    from dist_helpers import CliJob

    whole, saved = llama
    cases = {case: [whole if case[2] == "whole" else saved[case[1]], "--tensor-parallel-size", str(case[1])]
             for case in FOUR_RANK_CASES}
    return CliJob(str(tmp_path_factory.mktemp("four-ranks")), 4, cases)


@pytest.mark.dist
@pytest.mark.parametrize("n,tp,which", [(2, 2, "whole")] + [pytest.param(*case, marks=pytest.mark.slow)
                                                            for case in FOUR_RANK_CASES])
def test_ranks_keep_their_tp_ranks_slices(llama, tmp_path, request, n, tp, which):
    whole, saved = llama
    if n == 4:
        job = request.getfixturevalue("four_rank_job")
        codes, stdout = job.case((n, tp, which))
        assert codes == [0] * n and job.result.returncode == 0, stdout + job.result.stderr[-4000:]
        report_path = job.reports[n, tp, which]
    else:  # the quick subset's case: a job of its own
        report_path = str(tmp_path / "report.json")
        source = whole if which == "whole" else saved[tp]
        result = run_distload(["load", source, "--tensor-parallel-size", str(tp), "--report-json", report_path,
                               "--no-progress"], nproc=n, timeout=240)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        stdout = result.stdout
    report = read_report(report_path)
    assert len(report["ranks"]) == n
    for r in report["ranks"]:
        tp_rank = r["rank"] % tp
        assert r["tensor_parallel"] == [tp_rank, tp]
        assert r["digest"] == state_digest(rank_reference(saved[tp], tp_rank)), r["rank"]
    if which == "whole":
        assert f"TP rank 1 of {tp}" in stdout


FAULT_SCRIPT = """
import sys, time
import distload
import distload.loading.backends.pread as pread
from distload.errors import CheckpointError

real = pread.read_exactly


def failing(fd, view, offset, path, name):
    if name == "lm_head.weight":  # a disk error on this rank's rows of lm_head, mid-read
        raise CheckpointError(f"{path}: reading tensor {name!r} failed: [Errno 5] Input/output error")
    return real(fd, view, offset, path, name)


with distload.WorkerGroup(device="cpu", timeout_s=60) as group:
    if group.rank == 1:
        pread.read_exactly = failing
    start = time.monotonic()
    try:
        distload.load(sys.argv[1], group=group, tensor_parallel_size=2)
    except distload.DistloadError as exc:
        print(f"rank {group.rank} stopped after {time.monotonic() - start:.1f} s: {exc}", flush=True)
        sys.exit(3)
    print(f"rank {group.rank} loaded", flush=True)
"""


@pytest.mark.slow
@pytest.mark.dist
def test_a_rank_whose_slice_read_fails_stops_every_rank(llama, tmp_path):
    """A read error on TP rank 1 only: rank 0 read all of its own slices, and still stops at
    once, naming rank 1 (no hang until the timeout)."""
    from dist_helpers import run_script, write_script

    whole, _ = llama
    script = write_script(tmp_path, "fault.py", FAULT_SCRIPT)
    result = run_script(script, [whole], nproc=2, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert "rank 1 stopped" in out and "Input/output error" in out, out[-3000:]
    found = re.search(r"rank 0 stopped after ([0-9.]+) s: loading failed on rank\(s\) 1", out)
    assert found, out[-3000:]
    assert float(found.group(1)) < 30


# -- DTensor targets -------------------------------------------------------------------------------

DTENSOR_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, empty
from safetensors.torch import load_file
import distload

folder, out, shape = sys.argv[1], sys.argv[2], tuple(int(x) for x in sys.argv[3].split("x"))
# As a training job does: its own process group and mesh; distload's group wraps the default
# group and leaves it alone on close; the job tears it down last, after its DTensors.
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", shape)
with distload.WorkerGroup(device="cpu", timeout_s=60) as group:
    full = {}
    for name in sorted(n for n in __import__("os").listdir(folder) if n.endswith(".safetensors")):
        full.update(load_file(f"{folder}/{name}"))
    two_d = len(shape) == 2

    def placements(name):
        if name.endswith("norm.weight"):
            return [Replicate()] * len(shape)
        if full[name].dim() == 1:  # FSDP x TP: a bias split on one mesh dimension only
            return [Shard(0), Replicate()] if two_d else [Shard(0)]
        if name.endswith("o_proj.weight"):  # row-parallel; on 2-d meshes both dims split
            return [Shard(1), Shard(0)] if two_d else [Shard(1)]
        return [Shard(0), Shard(1)] if two_d else [Shard(0)]

    # A model of DTensors (as FSDP2 / torch's TP API make them), filled in place
    model = {n: empty(t.shape, dtype=t.dtype, device_mesh=mesh, placements=placements(n)) for n, t in full.items()}
    pointers = {n: t.to_local().data_ptr() for n, t in model.items()}
    report = distload.reload_into(model, folder, group=group)
    same_memory = all(model[n].to_local().data_ptr() == p for n, p in pointers.items())
    exact = all(torch.equal(model[n].to_local(), distribute_tensor(t, mesh, placements(n)).to_local())
                for n, t in full.items())
    local_bytes = sum(t.to_local().numel() * t.to_local().element_size() for t in model.values())
    # and the state dict made for a mesh and placements, from the headers alone
    state = distload.load_dtensors(folder, mesh, placements, group=group)
    made = all(torch.equal(state[n].to_local(), distribute_tensor(t, mesh, placements(n)).to_local())
               and state[n].placements == tuple(placements(n)) for n, t in full.items())
    results = group.exchange({"rank": group.rank, "exact": exact, "same_memory": same_memory, "made": made,
                              "local_bytes": local_bytes, "nbytes": report.nbytes,
                              "requested": report.requested_bytes})
    if group.rank == 0:
        json.dump(results, open(out, "w"))
del model, state, mesh
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("mesh", ["2", "2x2"])
def test_dtensor_targets_get_their_local_shards(llama, tmp_path, mesh):
    from dist_helpers import run_script, write_script

    whole, _ = llama
    script = write_script(tmp_path, "dtensor.py", DTENSOR_SCRIPT)
    out = str(tmp_path / "out.json")
    n = math.prod(int(x) for x in mesh.split("x"))
    result = run_script(script, [whole, out, mesh], nproc=n, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    with open(out) as f:
        ranks = json.load(f)
    for r in ranks:
        assert r["exact"], f"rank {r['rank']}: a local shard differs from distribute_tensor's"
        assert r["same_memory"], f"rank {r['rank']}: the DTensors' local memory was replaced"
        assert r["made"], f"rank {r['rank']}: load_dtensors differs from distribute_tensor"
        assert r["nbytes"] == r["local_bytes"]
        assert r["requested"] == r["local_bytes"], "a rank must read its local shards' bytes only"


def test_block_bytes_of_a_2d_shard():
    from distload.tp.slices import block_bytes

    t = torch.arange(6 * 8, dtype=torch.int16).reshape(6, 8)
    for offsets, sizes in [((0, 0), (6, 8)), ((3, 0), (3, 8)), ((0, 4), (6, 4)), ((2, 2), (3, 4)), ((0, 0), (0, 8))]:
        piece = block_bytes(t.shape, 2, offsets, sizes)
        out = torch.zeros(math.prod(sizes), dtype=torch.int16)
        src, dst = t.reshape(-1).view(torch.uint8), out.view(torch.uint8)
        for s, d, n in piece.extents:
            dst[d:d + n] = src[s:s + n]
        want = t[offsets[0]:offsets[0] + sizes[0], offsets[1]:offsets[1] + sizes[1]]
        assert torch.equal(out.reshape(sizes), want), (offsets, sizes)
    assert len(block_bytes(t.shape, 2, (3, 0), (3, 8)).extents) == 1  # whole rows: one range
    assert len(block_bytes(t.shape, 2, (2, 2), (3, 4)).extents) == 3  # one per row
    with pytest.raises(ConfigError, match="do not lie inside"):
        block_bytes(t.shape, 2, (4, 0), (3, 8))


@pytest.mark.parametrize("fmt", ["auto", "safetensors"])
def test_runs_of_rows_read_as_one_tensor(tmp_path, fmt):
    """A fused tensor's rows for one rank (what the vLLM plugin asks of a checkpoint's fused q/k/v):
    read as byte ranges by distload's reader, cut from the whole tensor for a library's; either way
    the runs one after the other, bit for bit, and only their bytes requested by the range reader."""
    from safetensors.torch import save_file

    from distload.loading.loader import Loader
    from distload.loading.rank_slices import Rows

    g = torch.Generator().manual_seed(3)
    state = {"fused": torch.randn(8, 6, generator=g).to(torch.bfloat16), "other": torch.randn(5, generator=g)}
    save_file(state, str(tmp_path / "model.safetensors"))
    rows = Rows(((2, 4), (5, 6), (7, 8)))
    with WorkerGroup.for_call(None) as group:
        stream = Loader(str(tmp_path), fmt, group=group, blocks={"fused": rows}).stream()
        got = dict(stream)
    assert torch.equal(got["fused"], torch.cat([state["fused"][2:4], state["fused"][5:6], state["fused"][7:8]]))
    assert torch.equal(got["other"], state["other"])
    if fmt == "auto":
        assert stream.rank_report.requested_bytes == 4 * 6 * 2 + 5 * 4
    with pytest.raises(ConfigError, match="not ascending, disjoint runs"):
        with WorkerGroup.for_call(None) as group:
            dict(Loader(str(tmp_path), fmt, group=group, blocks={"fused": Rows(((4, 6), (2, 3)))}).stream())


def test_the_object_store_reader_fills_a_callers_tensors_in_place(tmp_path, monkeypatch):
    """The ranged reader (object stores) puts a tensor, or a rank's piece of it, straight into the
    caller's destination where it fits (what the vLLM plugin passes: views of its parameters),
    and into new memory where it does not (another shape)."""
    from safetensors.torch import save_file

    import distload.loading.stores as stores
    from distload.loading.backends.ranged import RangedBackend
    from distload.loading.index import build_index
    from distload.loading.request import ReadRequest
    from distload.loading.sources import read_header

    class Folder:  # a store whose objects are this folder's files
        def read(self, location, start, end):
            with open(location, "rb") as f:
                f.seek(start)
                return f.read(end - start)

    monkeypatch.setattr(stores, "store_for", lambda path: (Folder(), path))
    g = torch.Generator().manual_seed(4)
    state = {"a": torch.randn(6, 4, generator=g), "b": torch.randn(3, generator=g)}
    save_file(state, str(tmp_path / "model.safetensors"))
    index = build_index([read_header(str(tmp_path / "model.safetensors"))])
    into = {"a": torch.zeros(6, 4), "b": torch.zeros(5)}  # b's shape differs: not taken
    run = RangedBackend().read(ReadRequest(index=index, device=torch.device("cpu"), group=None,
                                           destinations=into))
    got = dict(run.tensors())
    assert got["a"] is into["a"] and torch.equal(into["a"], state["a"])
    assert got["b"] is not into["b"] and torch.equal(got["b"], state["b"]) and not into["b"].any()
