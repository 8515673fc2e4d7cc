"""In-place reload: identity of storage, all-or-nothing on every mismatch, name maps, slicing."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

import distload
from distload.live.reload import Destination, ReloadError, check_fit, reload_into
from distload.errors import ConfigError
from distload.tp.spec import load_spec
from distload.tp.slices import take_shard

from conftest import plain_read, write_whole
from dist_helpers import run_script, write_script


class Tiny(torch.nn.Module):
    """Embedding tied to the head, a linear with bias, a fused qkv, a norm and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.lin = torch.nn.Linear(8, 8)
        self.qkv = torch.nn.Linear(8, 24, bias=False)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def tiny_checkpoint(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(16, 8, generator=g), "lin.weight": torch.randn(8, 8, generator=g),
        "lin.bias": torch.randn(8, generator=g), "q.weight": torch.randn(8, 8, generator=g),
        "k.weight": torch.randn(8, 8, generator=g), "v.weight": torch.randn(8, 8, generator=g),
        "norm.weight": torch.randn(8, generator=g), "norm.bias": torch.randn(8, generator=g),
        "steps": torch.tensor(7 + seed, dtype=torch.int64),
    }


def qkv_map(name: str):
    if name in ("q.weight", "k.weight", "v.weight"):
        return Destination("qkv.weight", dim=0, start="qkv".index(name[0]) * 8)
    return name


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.fixture
def group():
    with distload.WorkerGroup(device="cpu") as g:
        yield g


def test_reload_in_place_keeps_every_storage(tmp_path, group):
    ckpt = tiny_checkpoint()
    write_whole(str(tmp_path / "ck"), ckpt, num_files=2)
    model = Tiny()
    pointers = {n: p.data_ptr() for n, p in model.named_parameters(remove_duplicate=False)}
    versions = {n: p._version for n, p in model.named_parameters(remove_duplicate=False)}
    report = reload_into(model, str(tmp_path / "ck"), "safetensors", group=group, name_map=qkv_map)
    assert {n: p.data_ptr() for n, p in model.named_parameters(remove_duplicate=False)} == pointers
    # Every tensor counts as written (a weight-sync receiver then takes its next update whole,
    # never a delta over the reload): test_reload_other_formats checks those written directly.
    assert all(p._version > versions[n] for n, p in model.named_parameters(remove_duplicate=False))
    assert torch.equal(model.embed.weight, ckpt["embed.weight"])
    assert model.head.weight is model.embed.weight  # still tied
    assert torch.equal(model.qkv.weight, torch.cat([ckpt["q.weight"], ckpt["k.weight"], ckpt["v.weight"]]))
    assert torch.equal(model.lin.bias, ckpt["lin.bias"]) and int(model.steps) == 8
    assert report.num_tensors == len(ckpt) and report.path == "safetensors"
    assert report.nbytes == sum(t.numel() * t.element_size() for t in ckpt.values())


@pytest.mark.parametrize("fmt", ["runai_streamer", "auto"])
def test_reload_other_formats(tmp_path, group, fmt):
    ckpt = tiny_checkpoint(3)
    write_whole(str(tmp_path / "ck"), ckpt, num_files=3)
    model = Tiny()
    versions = {n: p._version for n, p in model.named_parameters(remove_duplicate=False)}
    reload_into(model, str(tmp_path / "ck"), fmt, group=group, name_map=qkv_map)
    assert torch.equal(model.norm.weight, ckpt["norm.weight"])
    # Tensors the reader filled through their memory (auto's pread) count as written too.
    assert all(p._version > versions[n] for n, p in model.named_parameters(remove_duplicate=False))


def _broken(ckpt: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    ckpt = dict(ckpt)
    if kind == "shape":
        ckpt["lin.weight"] = torch.randn(8, 9)
    elif kind == "dtype":
        ckpt["lin.weight"] = ckpt["lin.weight"].to(torch.bfloat16)
    elif kind == "missing":
        del ckpt["norm.bias"]
    elif kind == "unexpected":
        ckpt["extra.weight"] = torch.randn(3)
    return ckpt


@pytest.mark.parametrize("kind,needle", [
    ("shape", "lin.weight: shape [8, 9] in the checkpoint, [8, 8] in the model"),
    ("dtype", "lin.weight: dtype BF16 in the checkpoint, torch.float32 in the model"),
    ("missing", "missing keys (no checkpoint tensor fills them): norm.bias"),
    ("unexpected", "unexpected key extra.weight"),
])
def test_mismatch_changes_nothing(tmp_path, group, kind, needle):
    write_whole(str(tmp_path / "ck"), _broken(tiny_checkpoint(), kind), num_files=2)
    model = Tiny()
    before = snapshot(model)
    with pytest.raises(ReloadError) as info:
        reload_into(model, str(tmp_path / "ck"), "safetensors", group=group, name_map=qkv_map)
    assert needle in str(info.value) and "nothing was written" in str(info.value)
    if kind in ("shape", "dtype"):  # one problem, named once: not also a missing key (issue 30, item 7)
        assert "(1 problem(s))" in str(info.value) and "missing keys" not in str(info.value), info.value
    after = snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_non_strict_reports_skipped_and_missing(tmp_path, group):
    ckpt = _broken(_broken(tiny_checkpoint(), "missing"), "unexpected")
    write_whole(str(tmp_path / "ck"), ckpt, num_files=1)
    model = Tiny()
    report = reload_into(model, str(tmp_path / "ck"), "safetensors", group=group, name_map=qkv_map, strict=False)
    assert report.skipped == ["extra.weight"]
    assert report.missing == ["norm.bias"]
    assert torch.equal(model.lin.weight, ckpt["lin.weight"])


def test_name_map_none_ignores_and_one_to_many(tmp_path, group):
    """A fused checkpoint tensor feeding three model parameters; a tensor ignored on purpose."""
    g = torch.Generator().manual_seed(5)
    fused = torch.randn(24, 8, generator=g)
    save_file({"qkv.weight": fused, "rotary.inv_freq": torch.randn(4)}, str(tmp_path / "m.safetensors"))
    target = {"q": torch.zeros(8, 8), "k": torch.zeros(8, 8), "v": torch.zeros(8, 8)}

    def split(name):
        if name == "rotary.inv_freq":
            return None
        return [Destination(p, src_dim=0, src_start=8 * i, src_length=8) for i, p in enumerate("qkv")]

    report = reload_into(target, str(tmp_path / "m.safetensors"), "safetensors", group=group, name_map=split)
    assert report.ignored == ["rotary.inv_freq"]
    assert torch.equal(torch.cat([target["q"], target["k"], target["v"]]), fused)


def test_fused_destination_must_fill_the_parameter(tmp_path, group):
    ckpt = tiny_checkpoint()
    del ckpt["v.weight"]
    write_whole(str(tmp_path / "ck"), ckpt, num_files=1)
    with pytest.raises(ReloadError, match="missing keys .*qkv.weight"):
        reload_into(Tiny(), str(tmp_path / "ck"), "safetensors", group=group, name_map=qkv_map)


def test_check_fit_slicing_shapes():
    plan = load_spec("decoder", {"num_attention_heads": 2, "head_dim": 4, "hidden_size": 4})
    sources = [("model.layers.0.self_attn.q_proj.weight", "F32", (8, 4)),
               ("model.layers.0.self_attn.o_proj.weight", "F32", (4, 8))]
    targets = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4),
               "model.layers.0.self_attn.o_proj.weight": torch.zeros(4, 4)}
    copies, _ = check_fit(sources, targets, name_map=None, sharding=plan, tp_size=2, strict=True)
    assert set(copies) == {s[0] for s in sources}
    targets["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(4, 8)
    with pytest.raises(ReloadError, match=r"o_proj.weight: the rank's slice \[4, 4\] in the checkpoint, \[4, 8\]"):
        check_fit(sources, targets, name_map=None, sharding=plan, tp_size=2, strict=True)


def test_check_fit_without_model_config_names_the_rule_once():
    """The decoder spec splits between heads; without config.json it refuses, one line per rule."""
    sources = [(f"model.layers.{i}.self_attn.q_proj.weight", "F32", (8, 4)) for i in range(3)]
    targets = {name: torch.zeros(4, 4) for name, _, _ in sources}
    with pytest.raises(ReloadError) as info:
        check_fit(sources, targets, name_map=None, sharding=load_spec("decoder"), tp_size=2, strict=True)
    text = str(info.value)
    assert text.count("config.json beside the weights") == 1 and "'*.q_proj.weight'" in text and "--sharding plain" in text
    assert "model.layers.N.self_attn.q_proj.weight" in text
    # The plain spec splits evenly, heads or not; at TP 1 nothing is split, so nothing is needed.
    check_fit(sources, targets, name_map=None, sharding=load_spec("plain"), tp_size=2, strict=True)
    whole = {name: torch.zeros(8, 4) for name, _, _ in sources}
    check_fit(sources, whole, name_map=None, sharding=load_spec("decoder"), tp_size=1, strict=True)


def test_dummy_then_real_in_place(tmp_path, group):
    ckpt = tiny_checkpoint(9)
    folder = str(tmp_path / "ck")
    write_whole(folder, ckpt, num_files=2)
    state = distload.load(folder, "dummy", group=group)  # a deployment validated on dummy weights
    pointers = {n: t.data_ptr() for n, t in state.items()}
    assert not torch.equal(state["lin.weight"], ckpt["lin.weight"])
    reload_into(state, folder, "runai_streamer", group=group)
    assert {n: t.data_ptr() for n, t in state.items()} == pointers
    expected = plain_read([os.path.join(folder, n) for n in sorted(os.listdir(folder))])
    assert all(torch.equal(state[n], expected[n]) for n in expected)


def test_plan_on_a_sharded_checkpoint_is_refused(tmp_path, group):
    from conftest import write_sharded

    write_sharded(str(tmp_path / "sh"), world_size=1)
    with pytest.raises(ConfigError, match="already sharded per rank .* load it without a sharding spec"):
        reload_into({}, str(tmp_path / "sh"), "sharded_state", group=group, sharding="decoder")


def test_bad_target_type(tmp_path, group):
    # A wrong argument, not a misfit: the same ConfigError as WeightSleeper and WeightSync give.
    with pytest.raises(distload.ConfigError, match="nn.Module or a dict"):
        reload_into([torch.zeros(1)], str(tmp_path), "safetensors", group=group)


@pytest.mark.slow
@pytest.mark.dist
def test_two_ranks_take_their_slice_and_fail_together(tmp_path):
    """Each rank copies its tensor-parallel slice of a whole checkpoint; a mismatch on rank 1 only
    stops both ranks before any write."""
    g = torch.Generator().manual_seed(2)
    whole = {"model.layers.0.mlp.gate_proj.weight": torch.randn(8, 4, generator=g),
             "model.layers.0.mlp.down_proj.weight": torch.randn(4, 8, generator=g),
             "model.norm.weight": torch.randn(4, generator=g)}
    folder = str(tmp_path / "whole")
    write_whole(folder, whole, num_files=1)
    script = write_script(tmp_path, "rl.py", f"""
        import sys, torch, distload
        from distload.live.reload import reload_into, ReloadError
        with distload.WorkerGroup(device="cpu", timeout_s=60) as g:
            bad = sys.argv[1] == "bad" and g.rank == 1
            model = {{"model.layers.0.mlp.gate_proj.weight": torch.zeros(4, 4 if not bad else 5),
                      "model.layers.0.mlp.down_proj.weight": torch.zeros(4, 4),
                      "model.norm.weight": torch.zeros(4)}}
            try:
                reload_into(model, {folder!r}, "safetensors", group=g, sharding="decoder")
            except distload.DistloadError as exc:
                print(f"rank {{g.rank}} refused: {{type(exc).__name__}}: {{exc}}".replace("\\n", " "))
                assert all(float(t.abs().sum()) == 0 for t in model.values()), "written despite a mismatch"
                sys.exit(3)
            torch.save(model, f"{tmp_path}/rank{{g.rank}}.pt")
    """)
    ok = run_script(script, ["good"], nproc=2)
    assert ok.returncode == 0, ok.stderr[-3000:]
    plan = load_spec("decoder")
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, tensor in whole.items():
            assert torch.equal(got[name], take_shard(tensor, plan.action(name, tensor.shape), rank, 2)), name
    bad = run_script(script, ["bad"], nproc=2)
    assert bad.returncode != 0
    assert "rank 1 refused: ReloadError" in bad.stdout
    assert "rank 0 refused: RankFailedError" in bad.stdout and "rank(s) 1" in bad.stdout


def test_a_file_vanishing_mid_reload_is_a_reload_error_naming_it(tmp_path, group, monkeypatch):
    """pread reads ahead straight into the model: a failure after reading began says the model may
    be mixed, and names the file, instead of a raw FileNotFoundError."""
    ckpt = {"a": torch.ones(1000), "b": torch.full((1000,), 2.0)}
    paths = write_whole(str(tmp_path / "ck"), ckpt, num_files=2)
    target = {"a": torch.zeros(1000), "b": torch.zeros(1000)}
    real_plan = distload.Loader.plan

    def plan_then_delete(self):
        plan = real_plan(self)
        os.unlink(paths[1])  # removed after planning, before reading
        return plan

    monkeypatch.setattr(distload.Loader, "plan", plan_then_delete)
    with pytest.raises(ReloadError, match="may now mix old and new weights") as info:
        reload_into(target, str(tmp_path / "ck"), "auto", group=group)
    assert paths[1] in str(info.value) and "moved or deleted after the load was planned" in str(info.value)


def test_tied_destinations_end_whole_not_torn(tmp_path, group):
    """Two checkpoint tensors filling one shared storage are copied in order, never read into it
    by parallel threads (which tore them: half one value, half the other)."""
    n = 6 * 1024 * 1024  # 24 MiB each: several pread chunks
    save_file({"embed": torch.ones(n), "head": torch.full((n,), 2.0)}, str(tmp_path / "m.safetensors"))
    shared = torch.zeros(n)
    for _ in range(3):
        shared.zero_()
        reload_into({"embed": shared, "head": shared}, str(tmp_path / "m.safetensors"), "auto", group=group)
        assert torch.equal(shared, torch.ones(n)) or torch.equal(shared, torch.full((n,), 2.0))


class _WithBuffers(torch.nn.Module):
    """A Llama-like rotary buffer and a BERT-like position buffer, both non-persistent."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.rotary = torch.nn.Module()
        self.rotary.register_buffer("inv_freq", torch.arange(2.0), persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(1, 5, dtype=torch.long), persistent=False)
        self.register_buffer("scale", torch.ones(3))  # persistent: required


def test_strict_reload_skips_non_persistent_buffers_like_torch(tmp_path, group):
    model = _WithBuffers()
    state = {k: v.clone() + 1 for k, v in model.state_dict().items()}  # what torch saves: no inv_freq
    assert "rotary.inv_freq" not in state and "token_type_ids" not in state
    folder = str(tmp_path / "ck")
    write_whole(folder, state, num_files=1)
    model.load_state_dict(state, strict=True)  # torch's own rule, for comparison
    fresh = _WithBuffers()
    report = reload_into(fresh, folder, group=group, strict=True)
    assert torch.equal(fresh.lin.weight, state["lin.weight"]) and torch.equal(fresh.scale, state["scale"])
    assert torch.equal(fresh.rotary.inv_freq, torch.arange(2.0))  # untouched, not an error
    assert report.missing == []
    # A persistent buffer is still required.
    del state["scale"]
    write_whole(str(tmp_path / "ck2"), state, num_files=1)
    with pytest.raises(ReloadError, match="missing keys .*scale"):
        reload_into(_WithBuffers(), str(tmp_path / "ck2"), group=group, strict=True)
    # A checkpoint that has a non-persistent buffer still fills it (older Llama checkpoints do).
    state["scale"] = torch.ones(3)
    state["rotary.inv_freq"] = torch.tensor([5.0, 6.0])
    write_whole(str(tmp_path / "ck3"), state, num_files=1)
    fresh = _WithBuffers()
    reload_into(fresh, str(tmp_path / "ck3"), group=group, strict=True)
    assert torch.equal(fresh.rotary.inv_freq, torch.tensor([5.0, 6.0]))
