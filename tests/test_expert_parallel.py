"""Expert parallelism in loads and reshard (issue 46, item 1), on tiny real MoE checkpoints.

The checkpoints are made by transformers (tests/moe_checkpoints.py, in vLLM's environment): a
DeepSeek-V3 (MLA, a dense layer, four routed experts, a shared expert, the router) and a
Qwen3-MoE, each in BF16 and in DeepSeek's FP8 block-scaled form. The reference for every rank
is independent of distload's specs: read the whole checkpoint, keep the rank's experts (vLLM's
placements written out by hand), ``chunk`` the TP-split projections and their scales.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess

import pytest
import torch

import distload
from distload.checkpoints.inspection import summary_lines
from distload.errors import ConfigError
from distload.loading.report import state_digest
from distload.tp.experts import ExpertPlace, cut_experts, local_experts
from distload.tp.place import TPPlace
from distload.tp.slices import Action, shard_shape, slice_bytes, take_shard
from distload.tp.spec import BUILTIN_SPECS, carry_block_scales, load_spec, spec_from_json
from distload.workers.group import WorkerGroup

from conftest import in_ci, plain_read, read_report, run_distload, write_whole
from dist_helpers import free_port, run_script, write_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAKER = os.path.join(ROOT, "tests", "moe_checkpoints.py")
NUM_EXPERTS = 4
MODELS = ("deepseek-bf16", "deepseek-fp8", "qwen3moe-bf16", "qwen3moe-fp8")
COLUMN = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj")  # chunked on dim 0
ROW = ("o_proj", "down_proj")  # chunked on dim 1
SIZES = [(2, 1), (1, 2), (2, 2)]  # (TP, EP): TP 2, EP 2, TP 2 x EP 2


def transformers_python() -> str:
    """vLLM's environment, which has transformers (the project's own does not)."""
    path = os.environ.get("DISTLOAD_VLLM_PYTHON") or os.path.join(ROOT, ".vllm-venv", "bin", "python")
    if not os.path.exists(path):
        message = f"no environment with transformers at {path}; bash .ci/run makes it (or set DISTLOAD_VLLM_PYTHON)"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict[str, str]:
    """The four checkpoints, made once for the module: name -> folder."""
    root = tmp_path_factory.mktemp("moe")
    made = subprocess.run([transformers_python(), MAKER, str(root)], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-4000:]
    return {name: str(root / name) for name in MODELS}


def whole(folder: str) -> dict[str, torch.Tensor]:
    return plain_read(sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors")))


def experts_of(ep_rank: int, ep: int, placement: str = "linear") -> set[int]:
    """vLLM's placements by hand: contiguous runs, or every ep-th expert."""
    if placement == "linear":
        per = NUM_EXPERTS // ep
        return set(range(ep_rank * per, (ep_rank + 1) * per))
    return set(range(ep_rank, NUM_EXPERTS, ep))


def reference(state: dict[str, torch.Tensor], rank: int, tp: int, ep: int,
              placement: str = "linear") -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors by slicing a whole read: TP rank r % tp, EP rank (r // tp) % ep."""
    tp_rank, ep_rank = rank % tp, (rank // tp) % ep
    mine = experts_of(ep_rank, ep, placement)
    out = {}
    for name, t in state.items():
        expert = re.search(r"\.experts\.(\d+)\.", name)
        if expert and int(expert.group(1)) not in mine:
            continue
        layer = name.split(".")[-2]
        if layer in COLUMN or name.endswith(("embed_tokens.weight", "lm_head.weight")):
            t = t.chunk(tp, 0)[tp_rank]
        elif layer in ROW:
            t = t.chunk(tp, 1)[tp_rank]
        out[name] = t.contiguous()
    return out


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


def load_as(folder: str, rank: int, tp: int, ep: int, fmt: str = "auto", placement: str | None = None):
    """Rank ``rank`` of a T x P job, loaded in this process (its ranks given, not a group's)."""
    with WorkerGroup(device="cpu") as group:
        return distload.Loader(folder, fmt, group=group, tensor_parallel_size=tp, tensor_parallel_rank=rank % tp,
                               expert_parallel_size=ep, expert_parallel_rank=(rank // tp) % ep,
                               expert_placement_strategy=placement).load(digest=True)


def kept_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# -- pure: vLLM's placements -------------------------------------------------------------------------

def test_placements_are_vllms():
    """vLLM's ParallelConfig docs: 4 experts on 2 ranks, linear [0, 1] / [2, 3], round robin [0, 2] /
    [1, 3]; an uneven count gives the first ranks one more (determine_expert_map)."""
    assert [local_experts(4, 2, r) for r in range(2)] == [(0, 1), (2, 3)]
    assert [local_experts(4, 2, r, "round_robin") for r in range(2)] == [(0, 2), (1, 3)]
    assert [local_experts(5, 2, r) for r in range(2)] == [(0, 1, 2), (3, 4)]
    assert [local_experts(5, 2, r, "round_robin") for r in range(2)] == [(0, 2, 4), (1, 3)]
    assert ExpertPlace(4, 3, "linear").experts(256) == tuple(range(192, 256))
    with pytest.raises(ConfigError, match="--expert-placement-strategy 'packed' is not one of linear, round_robin"):
        ExpertPlace(2, 0, "packed").check()


def test_ranks_are_tp_then_ep_then_replicas():
    """Rank r of T x P x k ranks: TP rank r % T, EP rank (r // T) % P; its shard of a T x P save."""
    class Group:  # what TPPlace.of asks of a group
        def __init__(self, rank, world_size):
            self.rank, self.world_size = rank, world_size

    places = [TPPlace.of(Group(r, 8), 2, expert_parallel_size=2) for r in range(8)]
    assert [(p.rank, p.experts.rank, p.shard_rank) for p in places] == [
        (0, 0, 0), (1, 0, 1), (0, 1, 2), (1, 1, 3)] * 2
    assert {p.shard_count for p in places} == {4}
    assert [TPPlace.of(Group(r, 4), None, expert_parallel_size=4).experts.rank for r in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match=r"^--tensor-parallel-size 2 x --expert-parallel-size 2 \(4\) does not "
                                          r"divide the group's 6 ranks"):
        TPPlace.of(Group(0, 6), 2, expert_parallel_size=2)


def test_a_spec_in_its_json_form_keeps_mlas_head_sizes(moe):
    """A weight-sync receiver (a load from a server too) posts its spec as JSON, and the trainer
    ranks cut by it: MLA's heads (kv_b_proj: qk_nope + v_head_dim rows each) must survive that."""
    with open(os.path.join(moe["deepseek-fp8"], "config.json")) as f:
        spec = load_spec("decoder", json.load(f))
    again = spec_from_json(spec.to_json())
    for name, tensor in whole(moe["deepseek-fp8"]).items():
        assert again.action(name, tuple(tensor.shape)) == spec.action(name, tuple(tensor.shape)), name


def test_mixtral_names_drop_other_ranks_experts_and_keep_the_tp_rules():
    """Mixtral's ``block_sparse_moe.experts.E.w1/w2/w3``: a rank's experts keep the spec's split
    (w1/w3 rows, w2 columns), the others become empty cuts, the router stays whole."""
    spec = load_spec("decoder")
    names = [f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in range(8) for w in ("w1", "w2", "w3")]
    names.append("model.layers.0.block_sparse_moe.gate.weight")
    tensors = [(n, (256, 256), spec.action(n, (256, 256))) for n in names]
    cut = cut_experts(tensors, ExpertPlace(4, 1, "round_robin"), {"num_local_experts": 8})
    assert cut.experts == (1, 5)
    kept = sorted(n for n in names if n not in cut.dropped)
    assert kept == [f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in (1, 5) for w in ("w1", "w2", "w3")] \
        + ["model.layers.0.block_sparse_moe.gate.weight"]
    assert {cut.actions[n].dim for n in kept if ".w2." in n} == {1} and {cut.actions[n].dim for n in kept if ".w1." in n} == {0}
    assert all(cut.actions[n].ranges == () for n in cut.dropped) and len(cut.dropped) == 18
    assert cut.actions["model.layers.0.block_sparse_moe.gate.weight"].replicated


def test_stacked_experts_keep_their_rows_and_a_rule_through_them_is_refused():
    """vLLM's fused stacks ([E, 2I, H], [E, H, I], their scales [E, ...]) are cut on dim 0 by expert
    (here under a spec that splits no tensor, so each keeps its experts' rows whole)."""
    shapes = {"model.layers.0.mlp.experts.w13_weight": (4, 512, 256),
              "model.layers.0.mlp.experts.w2_weight": (4, 256, 256),
              "model.layers.0.mlp.experts.w13_weight_scale_inv": (4, 4, 2),
              "model.layers.0.mlp.gate.weight": (4, 256)}
    spec = load_spec("replicate")
    tensors = [(n, s, spec.action(n, s)) for n, s in shapes.items()]
    tensors = [(n, s, a) for (n, s, _), a in zip(tensors, carry_block_scales(tensors).values())]
    rr = cut_experts(tensors, ExpertPlace(2, 1, "round_robin"), {"num_experts": 4})
    assert rr.experts == (1, 3) and not rr.dropped
    for name in list(shapes)[:3]:
        assert rr.actions[name].ranges == ((1, 2), (3, 4)), name
    assert rr.actions["model.layers.0.mlp.gate.weight"].replicated  # the router stays whole
    linear = cut_experts(tensors, ExpertPlace(2, 1), {})  # no config.json: stacked rows still count
    assert linear.actions["model.layers.0.mlp.experts.w2_weight"].ranges == ((2, 4),)
    # A rule that splits a stack along dim 0 cuts through its experts: refused, naming it.
    bad = [("m.layers.0.mlp.experts.w2_weight", (4, 8, 8), load_spec("plain").action("x.up_proj.weight", (4, 8, 8)))]
    with pytest.raises(ConfigError) as err:
        cut_experts(bad, ExpertPlace(2, 0), {"num_experts": 4})
    assert str(err.value) == (
        "tensor 'm.layers.0.mlp.experts.w2_weight' (shape [4, 8, 8]) stacks all 4 experts along dim 0, which expert "
        "parallelism cuts by expert (--expert-parallel-size 2); the sharding spec also cuts it along dim 0 (rule "
        "'*.up_proj.weight'), through the experts. Split a stacked expert tensor along a later dim (vLLM's "
        "w13_weight [E, 2I, H] along dim 1, w2_weight [E, H, I] along dim 2), or drop that rule")


# vLLM's fused MoE layers split by TP (FusedMoE): w13 as [gate; up], each half by rows; w2 by its
# input columns. A spec file's rules for stacked experts, ahead of the decoder's for the rest.
STACKED_RULES = [{"match": "*.experts.w13_weight", "split": 1, "fused": 2},
                 {"match": "*.experts.w2_weight", "split": 2}]


@pytest.mark.parametrize("spec_name", ["file", "decoder", "plain"])
def test_a_stack_the_spec_splits_keeps_its_tp_slice_of_each_of_its_experts(spec_name):
    """TP x EP on a stacked tensor: its EP rank's expert rows of dim 0 (``rows``), each split along
    the spec's dim; its FP8 block scales (vLLM's ``w13_weight_scale_inv``) carried on the blocks of
    config.json's 2-d weight_block_size, an expert a row; the bytes read are the bytes kept. The
    built-in specs split vLLM's stacks as a spec file with STACKED_RULES does."""
    config = {"num_experts": 4, "quantization_config": {"weight_block_size": [128, 128]}}
    spec = spec_from_json({"rules": STACKED_RULES}, config) if spec_name == "file" else load_spec(spec_name, config)
    shapes = {"m.layers.0.mlp.experts.w13_weight": (4, 512, 256),
              "m.layers.0.mlp.experts.w13_weight_scale_inv": (4, 4, 2),
              "m.layers.0.mlp.experts.w2_weight": (4, 256, 256),
              "m.layers.0.mlp.experts.w2_weight_scale_inv": (4, 2, 2)}
    carried = carry_block_scales([(n, s, spec.action(n, s)) for n, s in shapes.items()], config)
    assert carried["m.layers.0.mlp.experts.w13_weight_scale_inv"].scales.block == 128
    cut = cut_experts([(n, s, carried[n]) for n, s in shapes.items()], ExpertPlace(2, 1, "round_robin"), config)
    whole = {n: torch.arange(math.prod(s), dtype=torch.float32).reshape(s) for n, s in shapes.items()}
    for tp_rank in range(2):
        for name, shape in shapes.items():
            action = cut.actions[name]
            assert action.rows == ((1, 2), (3, 4)) and action.dim == len(shape) - 2 + (".w2_" in name), name
            mine = whole[name][[1, 3]]
            want = (torch.cat([half.chunk(2, 1)[tp_rank] for half in mine.chunk(2, 1)], 1) if ".w13_" in name
                    else mine.chunk(2, 2)[tp_rank])
            assert torch.equal(take_shard(whole[name], action, tp_rank, 2, name), want), (name, tp_rank)
            assert shard_shape(name, shape, action, 2) == tuple(want.shape)
            piece = slice_bytes(name, shape, 4, action, tp_rank, 2)
            raw, out = whole[name].view(torch.uint8).reshape(-1), torch.empty(want.numel() * 4, dtype=torch.uint8)
            for src, dst, n in piece.extents:
                out[dst:dst + n] = raw[src:src + n]
            assert torch.equal(out.view(torch.float32).reshape(want.shape), want), (name, tp_rank)
            assert piece.requested_bytes == want.numel() * 4
    # A per-tensor scale per expert (vLLM's w13_weight_scale [E]) is not a block scale: whole on
    # every TP rank, its experts' rows by EP rank.
    per_expert = ("m.layers.0.mlp.experts.w13_weight_scale", (4,), Action(None))
    every = [(n, s, spec.action(n, s)) for n, s in shapes.items()] + [per_expert]
    scale = carry_block_scales(every, config)[per_expert[0]]
    assert scale.replicated
    assert cut_experts([per_expert[:2] + (scale,)], ExpertPlace(2, 1, "round_robin"), config).actions[
        per_expert[0]].ranges == ((1, 2), (3, 4))


def test_the_built_in_rules_refuse_stacks_and_companions_they_would_cut_wrongly(tmp_path):
    """The built-in rules split w13 as [gate; up]: a non-gated stack (as many rows as w2 has
    columns) and gpt-oss's (gate and up rows interleaved) are refused, naming the tensor and the
    rule to give; so are a split stack's companions that vary along its split dim (a per-channel
    scale, a bias), where per-expert and per-shard scales stay whole. vLLM 0.32's
    ``experts.routed_experts`` stacks split as ``experts`` ones do."""
    def actions(shapes, config=None):
        spec = load_spec("decoder", config or {})
        return carry_block_scales([(n, s, spec.action(n, s)) for n, s in shapes.items()], config or {})

    stack = "m.layers.0.mlp.experts"
    gated = {f"{stack}.w13_weight": (4, 16, 8), f"{stack}.w2_weight": (4, 8, 8),
             f"{stack}.w13_weight_scale": (4, 2), f"{stack}.w2_weight_scale": (4,)}
    done = actions(gated)
    assert done[f"{stack}.w13_weight"].dim == 1 and len(done[f"{stack}.w13_weight"].parts) == 2
    assert done[f"{stack}.w13_weight_scale"].replicated and done[f"{stack}.w2_weight_scale"].replicated
    with pytest.raises(ConfigError) as err:
        actions({f"{stack}.w13_weight": (4, 8, 8), f"{stack}.w2_weight": (4, 8, 8)})
    assert str(err.value).startswith(
        f"tensor '{stack}.w13_weight' (shape [4, 8, 8]) is not gate and up stacked one after the other, which rule "
        f"'*.experts.w13_weight' splits in two halves: it has 8 rows, as many as w2 [4, 8, 8] has columns: a "
        f"non-gated MoE, no up half. Give a sharding spec file whose rule splits it along dim 1 in one part")
    with pytest.raises(ConfigError, match=r"gpt-oss interleaves the gate and up rows of each expert"):
        actions(gated, {"model_type": "gpt_oss"})
    for companion, shape in (("w13_weight_scale", (4, 16, 1)), ("w13_bias", (4, 16)), ("w2_weight_scale", (4, 8, 8))):
        with pytest.raises(ConfigError) as err:
            actions(dict(gated, **{f"{stack}.{companion}": shape}))
        assert str(err.value).startswith(f"tensor '{stack}.{companion}' (shape {list(shape)}) goes with "), str(err.value)
        assert "which the sharding spec splits along dim" in str(err.value)
    routed = {f"{stack}.routed_experts.w13_weight": (4, 16, 8), f"{stack}.routed_experts.w2_weight": (4, 8, 8)}
    done = actions(routed)
    assert [done[n].dim for n in routed] == [1, 2]
    cut = cut_experts([(n, s, done[n]) for n, s in routed.items()], ExpertPlace(2, 1), {"num_experts": 4})
    assert [cut.actions[n].rows for n in routed] == [((2, 4),), ((2, 4),)]


# -- loads, each rank in this process in turn -----------------------------------------------------------

@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("tp,ep", SIZES)
def test_each_rank_equals_slicing_a_whole_read_and_reads_only_its_bytes(moe, model, tp, ep):
    state = whole(moe[model])
    for rank in range(tp * ep):
        result = load_as(moe[model], rank, tp, ep)
        want = reference(state, rank, tp, ep)
        same(result.state, want)
        assert result.rank_report.nbytes == kept_bytes(want) and result.rank_report.num_tensors == len(want)
        assert result.rank_report.requested_bytes <= 1.05 * kept_bytes(want), (rank, result.rank_report)


@pytest.mark.parametrize("model", ["deepseek-fp8", "qwen3moe-bf16"])
def test_round_robin_and_a_whole_tensor_reader(moe, model):
    """Round robin places experts 0, 2 / 1, 3; the safetensors library reads whole tensors, which
    the loader cuts: the same state (its requested bytes are the whole tensors it read)."""
    state = whole(moe[model])
    for rank in range(4):
        same(load_as(moe[model], rank, 2, 2, placement="round_robin").state,
             reference(state, rank, 2, 2, "round_robin"))
    for rank in range(2):
        same(load_as(moe[model], rank, 1, 2, fmt="safetensors").state, reference(state, rank, 1, 2))


def stacked(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The per-expert tensors as vLLM's fused stacks: ``w13`` = [gate; up] per expert, ``w2`` = down,
    stacked along dim 0 (their FP8 scales alike); the rest as it is."""
    out = {n: t for n, t in state.items() if ".experts." not in n}
    layers = sorted({n.split(".experts.")[0] for n in state if ".experts." in n})
    for layer in layers:
        for suffix in ("weight", "weight_scale_inv"):
            if f"{layer}.experts.0.gate_proj.{suffix}" not in state:
                continue
            per = [state[f"{layer}.experts.{e}.{{}}.{suffix}".format(p)] for e in range(NUM_EXPERTS)
                   for p in ("gate_proj", "up_proj", "down_proj")]
            out[f"{layer}.experts.w13_{suffix}"] = torch.stack([torch.cat(per[3 * e: 3 * e + 2]) for e in range(NUM_EXPERTS)])
            out[f"{layer}.experts.w2_{suffix}"] = torch.stack([per[3 * e + 2] for e in range(NUM_EXPERTS)])
    return out


@pytest.mark.parametrize("tp,ep,placement", [(1, 2, "linear"), (2, 2, "round_robin")])
def test_stacked_experts_load_as_their_rows(moe, tmp_path, tp, ep, placement):
    """Fused stacks [E, 2I, H] / [E, H, I] and their scales under the built-in decoder spec: each
    rank reads its experts' rows only, each TP-sliced as vLLM's FusedMoE splits them."""
    folder = stacked_folder(moe, str(tmp_path / "stacked"))
    state = whole(folder)
    for rank in range(tp * ep):
        want = stacked_reference(state, rank, tp, ep, placement)
        assert want["model.layers.0.mlp.experts.w13_weight"].shape == (2, 512 // tp, 256)
        result = load_as(folder, rank, tp, ep, placement=placement)
        same(result.state, want)
        assert result.rank_report.requested_bytes <= 1.05 * kept_bytes(want)


def stacked_folder(moe, folder: str) -> str:
    """FP8 Qwen3-MoE as vLLM's fused stacks (with their block scales), its config.json beside them."""
    write_whole(folder, stacked(whole(moe["qwen3moe-fp8"])), 2)
    with open(os.path.join(moe["qwen3moe-fp8"], "config.json")) as f, \
            open(os.path.join(folder, "config.json"), "w") as g:
        g.write(f.read())
    return folder


def stacked_spec(path: str) -> str:
    """A spec file: STACKED_RULES, then the decoder's rules for the rest."""
    with open(path, "w") as f:
        json.dump({"name": "decoder-stacked",
                   "rules": STACKED_RULES + [r.to_json() for r in BUILTIN_SPECS["decoder"]]}, f)
    return path


def stacked_reference(state: dict[str, torch.Tensor], rank: int, tp: int, ep: int, placement: str):
    """Rank ``rank``'s tensors by slicing a whole read: its experts' rows of each stack, w13 (and
    its scales) as [gate; up] each chunked by rows, w2 (and its scales) chunked by columns."""
    tp_rank, mine = rank % tp, sorted(experts_of((rank // tp) % ep, ep, placement))
    out = reference(state, rank, tp, ep, placement)
    for name, t in state.items():
        if ".experts.w13_" in name:
            out[name] = torch.cat([half.chunk(tp, 1)[tp_rank] for half in t[mine].chunk(2, 1)], 1)
        elif ".experts.w2_" in name:
            out[name] = t[mine].chunk(tp, 2)[tp_rank].contiguous()
    return out


@pytest.mark.parametrize("tp,ep,placement", [(2, 1, "linear"), (2, 2, "linear"), (2, 2, "round_robin")])
def test_stacked_experts_a_spec_splits_load_and_reshard_as_the_tp_slice_of_their_rows(moe, tmp_path, tp, ep, placement):
    """TP x EP on stacked experts: each rank keeps its experts' rows, each TP-sliced as the spec says
    (FP8 block scales with them, on their blocks), and reads only those bytes; at EP 1 the same
    split of every expert. Reshard writes each rank's shard the same."""
    folder = stacked_folder(moe, str(tmp_path / "stacked"))
    spec = stacked_spec(str(tmp_path / "spec.json"))
    state = whole(folder)
    saved = str(tmp_path / "saved")
    distload.reshard(folder, saved, tp, sharding=spec, expert_parallel_size=ep,
                     expert_placement_strategy=placement if ep > 1 else None)
    for rank in range(tp * ep):
        want = stacked_reference(state, rank, tp, ep, placement)
        assert want["model.layers.0.mlp.experts.w13_weight"].shape == (4 // ep, 512 // tp, 256)
        with WorkerGroup(device="cpu") as group:
            result = distload.Loader(folder, group=group, tensor_parallel_size=tp, tensor_parallel_rank=rank % tp,
                                     sharding=spec, expert_parallel_size=ep, expert_parallel_rank=(rank // tp) % ep,
                                     expert_placement_strategy=placement if ep > 1 else None).load()
        same(result.state, want)
        assert result.rank_report.requested_bytes <= 1.05 * kept_bytes(want), (rank, result.rank_report)
        names = sorted(n for n in os.listdir(saved) if n.startswith(f"model-rank-{rank}-part-"))
        same(plain_read([os.path.join(saved, n) for n in names]), want)


@pytest.mark.parametrize("model,tp,ep", [("deepseek-fp8", 2, 2), ("qwen3moe-fp8", 2, 1), ("qwen3moe-bf16", 1, 2)])
def test_reload_into_fills_each_ranks_experts_and_fp8_slices_in_place(moe, model, tp, ep):
    """``reload_into`` at T x P fills, in place, what a load at T x P gave each rank (its experts,
    TP-sliced, FP8 block scales cut with their weights), bit for bit against slicing a whole read,
    reading only those bytes. A target that holds every expert, reloaded at EP 2, is refused
    naming the experts the rank does not fill, and is left as it was."""
    state = whole(moe[model])
    for rank in range(tp * ep):
        want = reference(state, rank, tp, ep)
        target = {name: torch.zeros_like(t) for name, t in want.items()}
        memory = {name: t.data_ptr() for name, t in target.items()}
        with WorkerGroup(device="cpu") as group:
            report = distload.reload_into(target, moe[model], group=group, tensor_parallel_size=tp,
                                          tensor_parallel_rank=rank % tp, expert_parallel_size=ep,
                                          expert_parallel_rank=(rank // tp) % ep)
        same(target, want)
        assert {name: t.data_ptr() for name, t in target.items()} == memory  # in place
        assert report.num_tensors == len(want) and report.requested_bytes <= 1.05 * kept_bytes(want), report
    if ep == 1:
        return
    every = {name: torch.zeros_like(t) for name, t in reference(state, 0, tp, 1).items()}
    with WorkerGroup(device="cpu") as group, pytest.raises(distload.ReloadError) as err:
        distload.reload_into(every, moe[model], group=group, tensor_parallel_size=tp, tensor_parallel_rank=0,
                             expert_parallel_size=ep, expert_parallel_rank=0)
    assert re.search(r"^the checkpoint does not fit the model \(1 problem\(s\)\); nothing was written:\n  \d+ "
                     r"tensor\(s\) of other expert-parallel ranks' experts, such as model\.layers\.\d+\.mlp\.experts\.[23]\."
                     r".*: this rank fills only its own experts; reload into a target that holds those alone",
                     str(err.value)), str(err.value)
    assert all(not t.any() for t in every.values())


def test_misconfigurations_are_refused_naming_the_setting_and_what_works(moe, tmp_path):
    with pytest.raises(ConfigError) as err:
        load_as(moe["qwen3moe-fp8"], 0, 1, 3)
    assert str(err.value) == ("--expert-parallel-size 3 does not divide the model's 4 routed experts (config.json's "
                              "num_local_experts), so ranks would hold different numbers of experts; expert-parallel sizes "
                              "that divide them: 1, 2, 4")
    dense = str(tmp_path / "dense")
    write_whole(dense, {"model.layers.0.mlp.up_proj.weight": torch.ones(4, 4), "lm_head.weight": torch.ones(4, 4)}, 1)
    with pytest.raises(ConfigError, match=r"^--expert-parallel-size 2: this checkpoint has no routed experts .*: a "
                                          r"dense model. Load it without --expert-parallel-size"):
        load_as(dense, 0, 1, 2)
    assert sorted(load_as(dense, 0, 1, 1).state) == ["lm_head.weight", "model.layers.0.mlp.up_proj.weight"]
    # vLLM's engine saves EP shards (tests/test_vllm_engine.py) only as it places experts: over its TP ranks.
    with pytest.raises(ConfigError, match=r"^reshard --sharding vllm --expert-parallel-size 2 --tensor-parallel-size 1: "
                                          r"vLLM's expert parallelism places experts over its tensor-parallel ranks .* "
                                          r"give --tensor-parallel-size 2 \(or none\)"):
        distload.reshard(moe["qwen3moe-bf16"], str(tmp_path / "vllm-ep"), 1, expert_parallel_size=2, sharding="vllm")
    with pytest.raises(ConfigError, match=r"^reshard --sharding vllm --expert-placement-strategy round_robin: vLLM's "
                                          r"engine applies round_robin only to models with several expert groups"):
        distload.reshard(moe["qwen3moe-bf16"], str(tmp_path / "vllm-ep"), expert_parallel_size=2, sharding="vllm",
                         expert_placement_strategy="round_robin")
    # A dense model: refused as a load is, before an engine would write a plain TP save of it.
    with pytest.raises(ConfigError, match=r"^--expert-parallel-size 2: this checkpoint has no routed experts"):
        distload.reshard(dense, str(tmp_path / "vllm-ep"), expert_parallel_size=2, sharding="vllm")
    # This environment has no vLLM (the project's own): its engine cannot write the save.
    with pytest.raises(ConfigError, match=r"^reshard --sharding vllm --expert-parallel-size 2: vLLM's engine writes "
                                          r"this save and vLLM is not installed here"):
        distload.reshard(moe["qwen3moe-bf16"], str(tmp_path / "vllm-ep"), expert_parallel_size=2, sharding="vllm")
    assert not os.path.exists(tmp_path / "vllm-ep")
    with WorkerGroup(device="cpu") as group, pytest.raises(ConfigError, match=r"^--expert-placement-strategy places "
                                                                               r"experts over --expert-parallel-size"):
        distload.Loader(dense, group=group, expert_placement_strategy="round_robin")


# -- reshard at EP 2, then sharded_state -------------------------------------------------------------

@pytest.mark.parametrize("tp,ep,placement", [(1, 2, "linear"), (2, 2, "round_robin")])
def test_reshard_writes_ep_shards_that_sharded_state_loads_bit_exact(moe, tmp_path, tp, ep, placement):
    folder = moe["deepseek-fp8"]
    state = whole(folder)
    out = str(tmp_path / "ep")
    if tp == 1:  # the command line, whose -tp is 1 by default with -ep
        made = run_distload(["reshard", folder, out, "-ep", str(ep), "--expert-placement-strategy", placement])
        assert made.returncode == 0, made.stderr[-3000:]
        summary = made.stdout
    else:
        report = distload.reshard(folder, out, tp, expert_parallel_size=ep, expert_placement_strategy=placement)
        assert report.world_size == tp * ep
        summary = "\n".join(report.summary_lines())
    assert f"{ep} EP ranks x {tp} TP ranks, {placement} placement of 4 experts" in summary, summary
    inspected = summary_lines(distload.inspect(out), tensors=False)[0]  # what `distload inspect` says first
    assert inspected.endswith(f"tensor-parallel size {tp} x expert-parallel size {ep} ({placement} placement of "
                              f"4 experts)"), inspected
    with open(os.path.join(out, "distload.json")) as f:
        assert json.load(f)["expert_parallel"] == {"size": ep, "tensor_parallel_size": tp, "placement": placement,
                                                  "num_experts": 4}
    for rank in range(tp * ep):
        want = reference(state, rank, tp, ep, placement)
        names = sorted(n for n in os.listdir(out) if n.startswith(f"model-rank-{rank}-part-"))
        same(plain_read([os.path.join(out, n) for n in names]), want)
        same(load_as(out, rank, tp, ep, "sharded_state", placement).state, want)
    with pytest.raises(ConfigError, match=rf"saved per rank at tensor-parallel size {tp} x expert-parallel size {ep} "
                                          rf"\({placement} placement, {tp * ep} ranks; see distload.json\), but the "
                                          rf"load asks for {tp} x 4"):
        load_as(out, 0, tp, 4, "sharded_state")
    if tp == 1:  # shards saved without expert parallelism, loaded with it
        plain = str(tmp_path / "tp2")
        distload.reshard(folder, plain, 2)
        with pytest.raises(ConfigError, match=r"^--expert-parallel-size 2: .* was saved per rank without expert "
                                              r"parallelism \(for 2 ranks, see distload.json\)"):
            load_as(plain, 0, 1, 2, "sharded_state")


# -- under torchrun ----------------------------------------------------------------------------------

@pytest.mark.dist
def test_torchrun_tp2_x_ep2_on_4_ranks(moe, tmp_path):
    """``load --tensor-parallel-size 2 --expert-parallel-size 2`` on 4 ranks, FP8 DeepSeek-V3."""
    folder = moe["deepseek-fp8"]
    report_path = str(tmp_path / "report.json")
    result = run_distload(["load", folder, "--tensor-parallel-size", "2", "--expert-parallel-size", "2",
                           "--report-json", report_path, "--no-progress"], nproc=4, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "TP rank 1 of 2, EP rank 1 of 2" in result.stdout, result.stdout[-2000:]
    state = whole(folder)
    ranks = read_report(report_path)["ranks"]
    assert len(ranks) == 4
    for r in ranks:
        want = reference(state, r["rank"], 2, 2)
        assert (r["tensor_parallel"], r["expert_parallel"]) == ([r["rank"] % 2, 2], [r["rank"] // 2, 2])
        assert r["digest"] == state_digest(want), r["rank"]
        assert r["nbytes"] == kept_bytes(want) and r["requested_bytes"] <= 1.05 * kept_bytes(want), r
        assert r["num_tensors"] == len(want), r


FROM_SERVER = """
import json, sys
import torch
import distload
from distload.errors import ConfigError
from distload.workers.group import WorkerGroup

served, folder, dense, uneven, out = sys.argv[1:6]
results = {}
with WorkerGroup(device="cpu") as group:
    for name, tp, placement in (("tp2xep2", 2, "round_robin"), ("ep2", None, None)):
        got = distload.load_from_server(served, group=group, tensor_parallel_size=tp, expert_parallel_size=2,
                                        expert_placement_strategy=placement, digest=True)
        want = distload.load(folder, group=group, tensor_parallel_size=tp, expert_parallel_size=2,
                             expert_placement_strategy=placement)
        same = sorted(got.state) == sorted(want) and all(
            got.state[n].dtype == t.dtype and got.state[n].shape == t.shape
            and torch.equal(got.state[n].view(torch.uint8), t.view(torch.uint8)) for n, t in want.items())
        r = got.rank_report
        results[name] = {"same": same, "nbytes": r.nbytes, "server_bytes": r.server_bytes, "digest": r.digest,
                         "requested_bytes": r.requested_bytes, "tensor_parallel": r.tensor_parallel,
                         "expert_parallel": r.expert_parallel, "summary": got.report.summary_lines()}
    for name, address in (("dense", dense), ("uneven", uneven)):
        try:
            distload.load_from_server(address, group=group, expert_parallel_size=2, timeout_s=30)
        except ConfigError as exc:
            results[name] = str(exc)
    with open(f"{out}/rank{group.rank}.json", "w") as f:
        json.dump(results, f)
"""


@pytest.mark.dist
def test_torchrun_tp2_x_ep2_from_a_server_equals_the_load_of_the_files(moe, tmp_path):
    """A `distload serve` process serves FP8 DeepSeek-V3; a 4-rank job loads it at TP 2 x EP 2
    (round robin) and at EP 2 (two replicas): every rank holds, tensor for tensor, what a load
    of the files with the same settings gives it, and receives little more than it keeps. EP on
    a dense model and an EP size that does not divide the experts are refused as loads refuse them."""
    from test_serve import start, text, wait_for

    folder = moe["deepseek-fp8"]
    dense = str(tmp_path / "dense")
    write_whole(dense, {"model.layers.0.mlp.up_proj.weight": torch.ones(4, 4), "lm_head.weight": torch.ones(4, 4)}, 1)
    uneven = str(tmp_path / "uneven")  # three experts, config.json says so
    write_whole(uneven, {f"model.layers.0.mlp.experts.{e}.up_proj.weight": torch.ones(4, 4) for e in range(3)}, 1)
    with open(os.path.join(uneven, "config.json"), "w") as f:
        json.dump({"num_experts": 3}, f)
    refusals = {}
    for name in ("dense", "uneven"):  # what a load of the files says
        with pytest.raises(ConfigError) as err:
            load_as(str(tmp_path / name), 0, 1, 2)
        refusals[name] = str(err.value)
    served, log = f"tcp://127.0.0.1:{free_port()}", str(tmp_path / "serve.log")
    server = start(["serve", folder, "--address", served, "--timeout", "60"], log)
    addresses = {name: f"tcp://127.0.0.1:{free_port()}" for name in refusals}
    try:
        with distload.WeightServer(whole(dense), addresses["dense"], timeout_s=60).start(), \
                distload.WeightServer(whole(uneven), addresses["uneven"], model_config={"num_experts": 3},
                                      timeout_s=60).start():
            wait_for(lambda: "serves" in text(log), "the server's start", timeout=120, logs=(log,))
            script = write_script(tmp_path, "from_server.py", FROM_SERVER)
            result = run_script(script, [served, folder, addresses["dense"], addresses["uneven"], str(tmp_path)],
                                nproc=4, timeout=240)
            assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0, text(log)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert "2 load(s) served, 0 failed" in text(log), text(log)
    state = whole(folder)
    for rank in range(4):
        with open(tmp_path / f"rank{rank}.json") as f:
            got = json.load(f)
        for name, tp, placement in (("tp2xep2", 2, "round_robin"), ("ep2", 1, "linear")):
            r = got[name]
            want = reference(state, rank, tp, 2, placement)
            assert r["same"] and r["digest"] == state_digest(want), (name, rank)
            assert (r["tensor_parallel"], r["expert_parallel"]) == ([rank % tp, tp], [(rank // tp) % 2, 2]), r
            assert r["requested_bytes"] == 0 and r["nbytes"] == kept_bytes(want), (name, rank, r)
            assert r["nbytes"] <= r["server_bytes"] <= 1.05 * r["nbytes"], (name, rank, r)  # its experts only
        assert "TP rank 1 of 2, EP rank 1 of 2" in "\n".join(got["tp2xep2"]["summary"])
        assert (got["dense"], got["uneven"]) == (refusals["dense"], refusals["uneven"]), rank


EVERY_LOAD = """
import json, sys
import distload
from distload.workers.group import WorkerGroup

out, stacked, spec, folders = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
results = {}
with WorkerGroup(device="cpu") as group:
    for folder in folders:
        for tp, ep in ((2, 1), (1, 2), (2, 2)):
            r = distload.Loader(folder, group=group, tensor_parallel_size=tp,
                                expert_parallel_size=None if ep == 1 else ep).load(digest=True).rank_report
            results[f"{folder} {tp} {ep}"] = [r.digest, r.nbytes, r.requested_bytes]
    # A shared read: each byte read once per job, each rank receiving the bytes of its experts.
    r = distload.Loader(folders[0], extra_config={"distributed": True}, group=group, tensor_parallel_size=2,
                        expert_parallel_size=2).load(digest=True).rank_report
    results["shared"] = [r.digest, r.nbytes, r.path]
    # Stacked experts a spec splits, round robin: runs of rows of each TP slice, in a shared read.
    r = distload.Loader(stacked, extra_config={"distributed": True}, group=group, tensor_parallel_size=2,
                        sharding=spec, expert_parallel_size=2,
                        expert_placement_strategy="round_robin").load(digest=True).rank_report
    results["stacked"] = [r.digest, r.nbytes, r.path]
    with open(f"{out}/rank{group.rank}.json", "w") as f:
        json.dump(results, f)
"""


@pytest.mark.slow
@pytest.mark.dist
def test_torchrun_every_model_at_tp2_ep2_and_tp2_x_ep2(moe, tmp_path):
    """Both models, BF16 and FP8, at TP 2, EP 2 and TP 2 x EP 2, one 4-rank job (TP 2 and EP 2 as
    two replicas each): every rank equal to slicing a whole read, reading only its bytes; and a
    shared read at TP 2 x EP 2 (distributed: true) gives the same, of stacked experts a spec
    splits too."""
    script = write_script(tmp_path, "every_load.py", EVERY_LOAD)
    folder = stacked_folder(moe, str(tmp_path / "stacked"))
    spec = stacked_spec(str(tmp_path / "spec.json"))
    result = run_script(script, [str(tmp_path), folder, spec, *(moe[m] for m in MODELS)], nproc=4, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    for rank in range(4):
        with open(tmp_path / f"rank{rank}.json") as f:
            got = json.load(f)
        want = reference(whole(moe[MODELS[0]]), rank, 2, 2)
        assert got["shared"] == [state_digest(want), kept_bytes(want), "pread-shared"], rank
        want = stacked_reference(whole(folder), rank, 2, 2, "round_robin")
        assert got["stacked"] == [state_digest(want), kept_bytes(want), "pread-shared"], rank
        for model in MODELS:
            state = whole(moe[model])
            for tp, ep in SIZES:
                want = reference(state, rank, tp, ep)
                digest, nbytes, requested = got[f"{moe[model]} {tp} {ep}"]
                assert digest == state_digest(want), (model, tp, ep, rank)
                assert nbytes == kept_bytes(want) and requested <= 1.05 * nbytes, (model, tp, ep, rank)


@pytest.mark.slow
@pytest.mark.dist
def test_torchrun_ep_on_a_dense_model_is_refused_on_every_rank(tmp_path):
    dense = str(tmp_path / "dense")
    write_whole(dense, {"model.layers.0.mlp.up_proj.weight": torch.ones(4, 4), "lm_head.weight": torch.ones(4, 4)}, 1)
    result = run_distload(["load", dense, "--expert-parallel-size", "2", "--no-progress"], nproc=2, timeout=240)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert "--expert-parallel-size 2: this checkpoint has no routed experts" in out, out[-3000:]
    assert "error on ranks 0, 1 (every rank)" in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.dist
def test_torchrun_sharded_state_of_an_ep_reshard(moe, tmp_path):
    """The EP 2 shards of FP8 Qwen3-MoE, loaded by 2 ranks with sharded_state and no sizes: rank r
    reads shard r, bit for bit its experts."""
    folder = moe["qwen3moe-fp8"]
    out = str(tmp_path / "ep2")
    distload.reshard(folder, out, 1, expert_parallel_size=2)
    report_path = str(tmp_path / "report.json")
    result = run_distload(["load", out, "--load-format", "sharded_state", "--report-json", report_path,
                           "--no-progress"], nproc=2, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    state = whole(folder)
    for r in read_report(report_path)["ranks"]:
        assert r["digest"] == state_digest(reference(state, r["rank"], 1, 2)), r["rank"]
