"""The weight-map recorder (distload/vllm/weight_map.py) on plain torch modules, no vLLM: loaders written
the way vLLM's are (narrow for a TP rank, fused q/k/v, a transposed Conv1D weight, padded
vocabulary rows zeroed, a cast), recorded against placeholders, then replayed with the real
tensors and compared bit for bit with the loaders run on those tensors."""

from __future__ import annotations

import pytest
import torch

from distload.loading.rank_slices import Rows
from distload.vllm.weight_map import WeightMap, cached_weight_map, cache_weight_map, record_weight_map

TP_SIZE, TP_RANK = 2, 1


class Tiny(torch.nn.Module):
    """What one TP rank of a decoder holds, with loaders in vLLM's style."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.empty(6, 4, dtype=torch.bfloat16))  # 10 rows padded to 12, 6 a rank
        self.qkv = torch.nn.Parameter(torch.empty(8, 4, dtype=torch.bfloat16))  # q 4 + k 2 + v 2 rows
        self.conv = torch.nn.Parameter(torch.empty(3, 4, dtype=torch.bfloat16))  # Conv1D [4, 6] transposed, cut
        self.norm = torch.nn.Parameter(torch.empty(4, dtype=torch.float32))  # cast bf16 -> f32
        self.scaled = torch.nn.Parameter(torch.empty(4, dtype=torch.bfloat16))
        self.fused = torch.nn.Parameter(torch.empty(4, 2, dtype=torch.bfloat16))  # q/k/v fused in the checkpoint too
        self.register_buffer("kept", torch.full((2,), 7.0))  # never loaded: keeps its value

    def load_weights(self, weights):
        for name, w in weights:
            if name == "embed":  # rows of this rank, padding zeroed (VocabParallelEmbedding)
                rows = 6
                mine = w.narrow(0, TP_RANK * rows, min(rows, w.shape[0] - TP_RANK * rows))
                self.embed.data[: mine.shape[0]].copy_(mine)
                self.embed.data[mine.shape[0]:].fill_(0)
            elif name in ("q", "k", "v"):  # QKVParallelLinear: each part's rows of this rank
                start, size = {"q": (0, 4), "k": (4, 2), "v": (6, 2)}[name]
                part = w.shape[0] // TP_SIZE
                self.qkv.data.narrow(0, start, size).copy_(w.narrow(0, TP_RANK * part, part))
            elif name == "conv":  # GPT-2's Conv1D: [in, out] in the checkpoint
                w = w.t()
                self.conv.data.copy_(w.chunk(TP_SIZE, dim=0)[TP_RANK])
            elif name == "norm":
                self.norm.data.copy_(w.to(torch.float32))
            elif name == "scaled":  # arithmetic: no region says this
                self.scaled.data.copy_(w * 2)
            elif name == "fused":  # Phi-3's qkv_proj: this rank's rows of each part, in order
                at = 0
                for start, size in ((0, 4), (4, 2), (6, 2)):
                    part = size // TP_SIZE
                    self.fused.data.narrow(0, at, part).copy_(w.narrow(0, start + TP_RANK * part, part))
                    at += part


def checkpoint():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    return {"embed": r(10, 4), "q": r(8, 4), "k": r(4, 4), "v": r(4, 4), "conv": r(4, 6), "norm": r(4),
            "scaled": r(4), "rotary": r(3), "fused": r(8, 2)}


def loaded_and_blank(ck):
    """Two models that start alike: one loaded by its own loaders, one to fill from a record."""
    expected = Tiny()
    for p in expected.parameters():
        p.data.fill_(3)
    actual = Tiny()
    actual.load_state_dict(expected.state_dict())
    expected.load_weights(iter(ck.items()))
    return expected, actual


def _box_of(tensor, box):
    if isinstance(box, Rows):
        return torch.cat([tensor[a:b] for a, b in box.runs])
    for dim, (offset, size) in enumerate(zip(*box)):
        tensor = tensor.narrow(dim, offset, size)
    return tensor.contiguous()


@pytest.mark.parametrize("boxed", [False, True], ids=["whole", "boxes"])
def test_a_record_replayed_equals_the_loaders_bit_for_bit(boxed):
    ck = checkpoint()
    model = Tiny()
    params = dict(model.state_dict(keep_vars=True))
    record = record_weight_map("k", [(n, t.dtype, tuple(t.shape)) for n, t in ck.items()], params, model.load_weights)
    assert set(record.whole) == {"scaled"} and "mul" in record.whole["scaled"]
    assert record.unused == ["rotary"]
    assert {c.tensor for c in record.copies} == {"embed", "q", "k", "v", "conv", "norm", "fused"}
    assert [c.casts for c in record.copies if c.tensor == "norm"] == [("float32",)]

    expected, actual = loaded_and_blank(ck)
    targets = dict(actual.state_dict(keep_vars=True))
    replayed = WeightMap.from_json(__import__("json").dumps(record.to_dict()))  # through the cache form
    shapes = {n: tuple(t.shape) for n, t in ck.items()}
    boxes = replayed.boxes(shapes) if boxed else {}
    if boxed:  # this rank's rows of q/k/v; of the transposed Conv1D weight its columns
        assert boxes["q"] == ((4, 0), (4, 4)) and boxes["k"] == ((2, 0), (2, 4)) and boxes["embed"] == ((6, 0), (4, 4))
        assert boxes["conv"] == ((0, 3), (4, 3)) and "norm" not in boxes
        assert boxes["fused"] == Rows(((2, 4), (5, 6), (7, 8)))  # its rows of q, of k and of v: 4 of 8
    steps = replayed.by_tensor(boxes, shapes)
    for name, tensor in ck.items():
        if name in replayed.whole:
            actual.load_weights(iter([(name, tensor)]))
        else:
            read = _box_of(tensor, boxes[name]) if name in boxes else tensor
            replayed.replay(name, read, targets, steps.get(name, ([], [])))
    for name, value in expected.state_dict().items():
        got = actual.state_dict()[name]
        assert got.dtype == value.dtype and torch.equal(got.view(torch.uint8), value.view(torch.uint8)), name


def test_reading_straight_into_the_parameters_equals_the_loaders_bit_for_bit():
    """What the plugin reads in place (one uncast copy of the tensor's whole box into contiguous
    parameter memory) plus the replay of the rest ends exactly as the loaders do."""
    from distload.vllm.plugin import in_place_destinations

    ck = checkpoint()
    model = Tiny()
    record = record_weight_map("k", [(n, t.dtype, tuple(t.shape)) for n, t in ck.items()],
                               dict(model.state_dict(keep_vars=True)), model.load_weights)
    expected, actual = loaded_and_blank(ck)
    targets = dict(actual.state_dict(keep_vars=True))
    shapes = {n: tuple(t.shape) for n, t in ck.items()}
    boxes = record.boxes(shapes)
    steps = record.by_tensor(boxes, shapes)
    direct = in_place_destinations(steps, boxes, shapes, targets)
    # embed's rows land contiguously (its own padding fill is made first); q/k/v each in its rows
    # of qkv, the fused one's rows (read as runs) in the fused parameter's rows in order; conv is
    # transposed, norm cast, scaled computed: those are copied by the replay.
    assert sorted(direct) == ["embed", "fused", "k", "q", "v"]
    for name in direct:
        record.fill(name, steps[name][1], targets)
    for name, tensor in ck.items():
        read = _box_of(tensor, boxes[name]) if name in boxes else tensor
        if name in direct:
            direct[name].copy_(read)  # what the reader does: the box's bytes into the view
        elif name in record.whole:
            actual.load_weights(iter([(name, tensor)]))
        else:
            record.replay(name, read, targets, steps.get(name, ([], [])))
    for name, value in expected.state_dict().items():
        got = actual.state_dict()[name]
        assert torch.equal(got.view(torch.uint8), value.view(torch.uint8)), name


def test_a_new_record_is_verified_against_the_loaders_on_random_tensors():
    """The check a new record gets before it is cached: replayed and the loaders run on the same
    random tensors of a sample (outside the layers, and the first layer); a record that is
    wrong anywhere in the sample is caught, naming the parameter."""
    import dataclasses

    from distload.vllm.weight_map import sample_tensors, verify_weight_map

    assert [n for n, _, _ in sample_tensors([("embed", torch.bfloat16, (2,)), ("layers.3.k", torch.bfloat16, (2,)),
                                             ("layers.1.k", torch.bfloat16, (2,)), ("layers.1.mlp.experts.7.w", torch.bfloat16, (2,)),
                                             ("layers.12.k", torch.bfloat16, (2,)), ("norm", torch.bfloat16, (2,))])] == \
        ["embed", "layers.1.k", "layers.1.mlp.experts.7.w", "norm"]
    # DeepSeek-V3: layer 0 a dense MLP, the experts from layer 1 on: the first MoE layer is sampled too.
    deepseek = [(f"model.layers.{i}.{part}", torch.bfloat16, (2,)) for i in range(3)
                for part in (["mlp.gate_proj.weight"] if i == 0 else
                             ["mlp.gate.weight", "mlp.experts.0.up_proj.weight", "mlp.shared_experts.up_proj.weight"])
                + ["self_attn.kv_b_proj.weight"]]
    assert [n for n, _, _ in sample_tensors(deepseek)] == [
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight",
        "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.0.up_proj.weight",
        "model.layers.1.mlp.shared_experts.up_proj.weight"]
    ck = checkpoint()
    listed = [(n, t.dtype, tuple(t.shape)) for n, t in ck.items()]
    model = Tiny()
    params = dict(model.state_dict(keep_vars=True))
    record = record_weight_map("k", listed, params, model.load_weights)
    assert verify_weight_map(record, listed, params, model.load_weights) == []
    wrong = [dataclasses.replace(c, source=dataclasses.replace(c.source, offset=0))  # rank 0's rows of k
             if c.tensor == "k" else c for c in record.copies]
    assert verify_weight_map(dataclasses.replace(record, copies=wrong), listed, params, model.load_weights) == ["qkv"]


def test_a_region_two_tensors_write_is_never_read_in_place():
    """Tied or overlapping writes: the order of the copies decides the result, so neither tensor
    may be read ahead into it."""
    from distload.vllm.plugin import in_place_destinations

    p = torch.nn.Parameter(torch.zeros(4, 2))

    def load(weights):
        for name, w in weights:
            if name == "a":
                p.data.copy_(w)
            else:
                p.data[2:].copy_(w)

    shapes = {"a": (4, 2), "b": (2, 2), "c": (2, 2)}
    record = record_weight_map("k", [(n, torch.float32, s) for n, s in shapes.items()], {"p": p}, load)
    steps = record.by_tensor({}, shapes)
    assert in_place_destinations(steps, {}, shapes, {"p": p}) == {}


def test_a_copy_into_a_temporary_or_a_combination_makes_the_tensor_whole():
    p = torch.nn.Parameter(torch.empty(4, 2))
    store = {}

    def loads(weights):
        for name, w in weights:
            if name == "a":
                tmp = torch.empty(2, 2)
                tmp.copy_(w)  # lands outside the model: unknown afterwards
                store["a"] = tmp
            elif name == "b":
                p.data.copy_(torch.cat([w, w]))

    record = record_weight_map("k", [("a", torch.float32, (2, 2)), ("b", torch.float32, (2, 2))], {"p": p}, loads)
    assert "not a parameter" in record.whole["a"] and "cat" in record.whole["b"] and not record.copies


def test_the_cache_round_trips_and_ignores_a_stale_file(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTLOAD_WEIGHT_MAP_CACHE", str(tmp_path))
    ck = checkpoint()
    model = Tiny()
    record = record_weight_map("abc", [(n, t.dtype, tuple(t.shape)) for n, t in ck.items()],
                           dict(model.state_dict(keep_vars=True)), model.load_weights)
    assert cached_weight_map("abc") is None
    cache_weight_map(record)
    assert cached_weight_map("abc") == record
    (tmp_path / "abc.json").write_text("{not json")
    assert cached_weight_map("abc") is None


def test_a_region_that_is_no_box_leaves_its_tensor_whole():
    from distload.vllm.weight_map import Copy, Region, WeightMap

    across = Region(2, (4,), (1,))  # elements 2..5 of a [2, 4] tensor, flattened: rows 0 and 1, no box
    record = WeightMap("k", copies=[Copy("t", across, "p", Region(0, (4,), (1,)))])
    assert record.boxes({"t": (2, 4)}) == {}
    rows = Region(4, (4,), (1,))  # row 1
    assert WeightMap("k", copies=[Copy("t", rows, "p", rows)]).boxes({"t": (2, 4)}) == {"t": ((1, 0), (1, 4))}


def test_a_loader_that_refuses_a_tensor_is_named():
    from distload.errors import DistloadError

    def loads(weights):
        for name, w in weights:
            assert w.shape == (3,), f"Attempted to load weight ({w.shape}) into parameter (3,)"

    with pytest.raises(DistloadError, match=r"failed on checkpoint tensor b \[2\].*Attempted to load weight"):
        record_weight_map("k", [("b", torch.float32, (2,))], {"p": torch.nn.Parameter(torch.empty(3))}, loads)


def test_a_push_keeps_only_what_the_loaders_take_and_they_load_it_from_the_staging_bit_for_bit():
    """distload/vllm/push.py: the map recorded against meta parameters (a running engine's, as
    vLLM's reload restores them) is the one recorded against real ones; its cuts keep this rank's
    rows, columns or runs of rows only (nothing of an unused tensor); and the model's own
    loaders, given the staging's whole-shaped views, load exactly what they load from the whole
    tensors."""
    from distload.live.transfer import Cuts
    from distload.tp.slices import take_shard
    from distload.vllm.push import Staging, cuts_of

    ck = checkpoint()
    listed = [(n, t.dtype, tuple(t.shape)) for n, t in ck.items()]
    real = Tiny()
    on_meta = Tiny().to("meta")
    record = record_weight_map("k", listed, dict(real.state_dict(keep_vars=True)), real.load_weights)
    from_meta = record_weight_map("k", listed, dict(on_meta.named_parameters()), on_meta.load_weights)
    assert from_meta.copies == record.copies and from_meta.fills == record.fills
    assert from_meta.whole == record.whole and from_meta.unused == record.unused

    shapes = {n: tuple(t.shape) for n, t in ck.items()}
    cuts = cuts_of(from_meta, shapes)
    assert cuts["q"] == (0, ((4, 8),)) and cuts["conv"] == (1, ((3, 6),)) and cuts["rotary"] == (0, ())
    assert cuts["fused"] == (0, ((2, 4), (5, 6), (7, 8))) and "scaled" not in cuts and "norm" not in cuts

    staging = Staging()
    staging.cuts = cuts
    spec = Cuts(cuts)
    pieces = {n: take_shard(t, spec.action(n, shapes[n]), 0, 1, n) for n, t in ck.items()}
    targets = staging.allocate({n: (t.dtype, tuple(t.shape)) for n, t in pieces.items()}, shapes)
    kept = 0
    for name, piece in pieces.items():
        targets[name].copy_(piece)  # what the channel does with the bytes that arrive
        kept += piece.numel()
    assert kept < sum(t.numel() for t in ck.values()) * 0.75
    expected, actual = loaded_and_blank(ck)
    actual.load_weights(staging.weights())
    for name, value in expected.state_dict().items():
        got = actual.state_dict()[name]
        assert torch.equal(got.view(torch.uint8), value.view(torch.uint8)), name


def test_a_workers_expert_placement_is_read_from_vllms_layers():
    """vLLM's expert map (global expert -> local slot, -1 elsewhere) as each MoE layer holds it: one
    entry per layer (the experts and the runner around them share its manager), the experts in
    slot order, for the weight map's key and the log; none without expert parallelism."""
    import types

    from distload.vllm.experts import describe, engine_experts, placement_key

    def manager(expert_map, rank):
        return types.SimpleNamespace(ep_size=2, ep_rank=rank, global_num_experts=4,
                                     expert_map=None if expert_map is None else torch.tensor(expert_map))

    class Layer(torch.nn.Module):
        def __init__(self, shared):
            super().__init__()
            self.experts = torch.nn.Module()
            self.experts.expert_map_manager = self.expert_map_manager = shared

    model = torch.nn.Sequential(Layer(manager([-1, 0, -1, 1], 1)), Layer(manager([-1, 0, -1, 1], 1)))
    layers = engine_experts(model)
    assert [(x.layer, x.local) for x in layers] == [("0", (1, 3)), ("1", (1, 3))]
    assert describe(layers) == "EP rank 1 of 2, keeping experts [1, 3] of 4 in each of its 2 MoE layers"
    swapped = engine_experts(torch.nn.Sequential(Layer(manager([-1, 1, -1, 0], 1))))
    assert swapped[0].local == (3, 1) and placement_key(swapped) != placement_key(layers[:1])
    whole = engine_experts(torch.nn.Sequential(Layer(types.SimpleNamespace(ep_size=1, ep_rank=0, global_num_experts=4,
                                                                           expert_map=None))))
    assert whole[0].local == (0, 1, 2, 3) and describe(whole) is None
    assert engine_experts(torch.nn.Linear(2, 2)) == []
