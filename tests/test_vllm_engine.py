"""A real vLLM engine (vLLM's CPU build, 0.32) against distload (issue 17): distload's saves load in
vLLM's own sharded_state loaders, vLLM loads through ``--load-format distload``, and a dummy
engine switches to the real weights in place, each token for token equal to vLLM's own loading
of the original Hugging Face checkpoint, on 1 and 2 tensor-parallel ranks; and (issue 35) any
architecture through the weight map recorded from vLLM's own loaders, bit for bit; and (issue 46)
mixture-of-experts checkpoints under vLLM's expert parallelism and FP8 block-scaled ones.

vLLM runs in its own virtual environment (``.vllm-venv``, which ``bash .ci/run`` makes; or
DISTLOAD_VLLM_PYTHON), with distload installed in it. Every engine of the module starts one after
the other inside one driver process, TP 2, the architectures, the MoE models, then TP 1 (tests/vllm_driver.py;
vLLM imported once); the tests read its results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import distload

from conftest import in_ci

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1600)]  # the first test waits for every engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, "tests", "vllm_driver.py")

# Tiny random models saved by transformers itself, as a user's Hugging Face checkpoint is.
MAKE_MODELS = r"""
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
llama, qwen, root = sys.argv[1:4]
shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16).save_pretrained(llama, safe_serialization=True)
torch.manual_seed(1)  # Qwen2: q/k/v biases and tied embeddings
Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True)).to(torch.bfloat16).save_pretrained(
    qwen, safe_serialization=True)
"""


# First, in the same interpreter (one start of the environment, not two): can it run the tests?
CHECK_ENVIRONMENT = r"""
import sys
try:
    import vllm, distload.vllm.plugin
except Exception as exc:
    print(f"IMPORT FAILED: {type(exc).__name__}: {exc}", flush=True)
    sys.exit(3)
"""


def missing_vllm(problem: str) -> None:
    message = f"{problem}; bash .ci/run installs vLLM's CPU build there (or set DISTLOAD_VLLM_PYTHON)"
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


def vllm_python() -> str:
    path = os.environ.get("DISTLOAD_VLLM_PYTHON") or os.path.join(ROOT, ".vllm-venv", "bin", "python")
    if not os.path.exists(path):
        missing_vllm(f"no vLLM environment at {path}")
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Every model of the module, made by transformers in one start of vLLM's environment: the
    Llama and the Qwen2 of the TP 1 and TP 2 cases, and one per architecture (root/NAME)."""
    python = vllm_python()
    root = tmp_path_factory.mktemp("vllm-models")
    paths = {"llama": str(root / "llama"), "qwen": str(root / "qwen2-tied"), "root": str(root)}
    made = subprocess.run([python, "-c", CHECK_ENVIRONMENT + MAKE_MODELS + MAKE_ARCHITECTURES + MAKE_MOE,
                           paths["llama"], paths["qwen"], str(root), os.path.join(ROOT, "tests")],
                          capture_output=True, text=True, timeout=300)
    if made.returncode == 3 and made.stdout.startswith("IMPORT FAILED: "):
        missing_vllm(f"{python} cannot import vllm and distload: {made.stdout.strip()[len('IMPORT FAILED: '):]}")
    assert made.returncode == 0, made.stderr[-3000:]
    # TP 1: saved by distload.reshard for vLLM, which runs vLLM's engine in a child process (the
    # tp1 "saved" case); TP 2: by distload's table of vLLM's names (vLLM not installed here).
    paths["llama-tp1"] = str(root / "llama-tp1")
    paths["llama-tp2"] = str(root / "llama-tp2")
    assert distload.reshard(paths["llama"], paths["llama-tp2"], 2).spec == "vllm"
    paths["qwen-tp2"] = str(root / "qwen2-tied-tp2")
    distload.reshard(paths["qwen"], paths["qwen-tp2"], 2)
    paths["llama-tp2-engine"] = str(root / "llama-tp2-engine")  # saved by the TP 2 plugin engine (save_sharded)
    paths["llama-b"] = _perturbed_copy(paths["llama"], str(root / "llama-b"))
    paths["phi3-b"] = _perturbed_copy(str(root / "phi3"), str(root / "phi3-b"))
    paths["qwen3moe-b"] = _perturbed_copy(str(root / "moe" / "qwen3moe-bf16"), str(root / "qwen3moe-b"))
    return python, paths


def _perturbed_copy(source: str, dest: str) -> str:
    """The same model with other weights (every tensor moved a little): a trainer's next version."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("*.safetensors"))
    for name in os.listdir(source):
        if name.endswith(".safetensors"):
            tensors = load_file(os.path.join(source, name))
            generator = torch.Generator().manual_seed(7)
            moved = {n: (t.float() + 0.05 * torch.randn(t.shape, generator=generator)).to(t.dtype)
                     for n, t in tensors.items()}
            save_file(moved, os.path.join(dest, name), metadata={"format": "pt"})
    return dest


# The trainer job of a push case: its own torchrun, its own world. It pushes the perturbed model
# as version 1, then the original weights as version 2; with "die" it dies (SIGKILL) a few buckets
# into version 2; with "steps", version 3 is the original with a training step's few changed
# elements (whole where the compare gave up on version 2: delta.py's rests) and version 4 the
# original again, a delta.
TRAINER = r"""
import os, signal, sys
from safetensors.torch import load_file
import distload.live.channel as channel
from distload.live.channel import SyncChannel
address, first, second, mode = sys.argv[1:5]

def state(folder):
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out

with SyncChannel(address, "trainer", rank=0, size=1, device="cpu", timeout_s=1200, bucket_bytes=64 << 10) as sync:
    print("pushed", sync.push(state(first), 1).version, flush=True)
    if mode != "die":
        own = state(second)
        print("pushed", sync.push(own, 2).version, flush=True)
        import torch
        from distload.live.delta import flat_ints
        generator = torch.Generator().manual_seed(5)
        stepped = {}
        # the lowest bit of 1% of the elements: a training step's change (on one host a patch goes
        # below about 1.5%: docs/delta-sync.md)
        for name, t in own.items():
            bits = flat_ints(t.clone())
            bits[torch.rand(bits.numel(), generator=generator) < 0.01] ^= 1
            stepped[name] = bits.view(t.dtype).view(t.shape)
        for version, weights in ((3, stepped), (4, own)):
            stats = sync.push(weights, version)
            print("pushed", version, "delta" if stats.delta else "full", stats.wire_bytes, flush=True)
        sys.exit(0)
    # Version 2 differs in every element: a delta update sends each piece raw, packed by delta.py.
    import distload.live.delta as delta
    packed = []
    def dying(real):
        def packing(*args, **kwargs):
            packed.append(1)
            if len(packed) == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        return packing
    channel.pack, delta.pack = dying(channel.pack), dying(delta.pack)
    sync.push(state(second), 2)
"""


def _drive(python: str, tp: int, cases: list[dict], weight_maps: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env["DISTLOAD_WEIGHT_MAP_CACHE"] = weight_maps  # the plugin's cache, not the user's ~/.cache
    result = subprocess.run([python, DRIVER, str(tp), json.dumps(cases)], capture_output=True, text=True,
                            timeout=1200, env=env)
    lines = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-6000:]
    out = json.loads(lines[0][len("RESULT "):])
    out["_output"] = result.stdout + result.stderr  # vLLM logs its workers' errors to stdout
    return out


def tp1_cases(p: dict) -> list[dict]:
    return [
        {"name": "reference", "model": p["llama"], "format": "auto"},
        {"name": "saved", "model": p["llama-tp1"], "format": "sharded_state", "reshard_from": p["llama"]},
        {"name": "plugin", "model": p["llama"], "format": "distload", "extra": {"reader": "auto"}},
        {"name": "dummy", "model": p["llama"], "format": "dummy", "reload": p["llama"]},
    ]


def tp2_cases(p: dict, address: str) -> list[dict]:
    """No reference engine of vLLM's own loader for the Llama and the Qwen2 (an engine start at TP 2
    is ~25 s here): their plugin cases run with check_weight_map, so their parameters are vLLM's own
    load's, bit for bit (the engine fails to start otherwise), and their tokens are the reference
    (TRUTH). "reference b" stays: the pushed weights have no plugin engine of their own.

    The "push" and "plugin" engines spawn their workers, as vLLM's CPU server does; the others fork
    them (as on GPUs: vllm_driver.py), about 10 s less an engine start here."""
    return [dict(case, fork=case["name"] not in ("push", "plugin")) for case in [
        {"name": "reference b", "model": p["llama-b"], "format": "auto"},
        # One dummy engine for two features (an engine start here is ~30 s): it takes the
        # trainer's pushes, then switches to the real weights in place (the "dummy" case at TP 1).
        {"name": "push", "model": p["llama"], "format": "dummy", "push": {"address": address, "receives": 2},
         "reload": p["llama"]},
        {"name": "saved", "model": p["llama-tp2"], "format": "sharded_state"},
        {"name": "saved runai", "model": p["llama-tp2"], "format": "runai_streamer_sharded"},
        {"name": "plugin", "model": p["llama"], "format": "distload",
         "extra": {"reader": "auto", "check_weight_map": True, "save_sharded": p["llama-tp2-engine"]}},
        {"name": "plugin saved", "model": p["llama-tp2"], "format": "distload"},
        {"name": "qwen saved", "model": p["qwen-tp2"], "format": "sharded_state"},
        {"name": "qwen plugin", "model": p["qwen"], "format": "distload",
         "extra": {"reader": "auto", "check_weight_map": True}},
    ]]


def architecture_cases(p: dict, address: str) -> list[dict]:
    """One TP 2 engine per architecture, loaded by distload with check_weight_map: the load is
    compared with vLLM's own load of the same checkpoint into the same model, every parameter bit
    for bit, before vLLM's post-processing (the engine fails to start on any difference).
    Identical parameters there give identical tokens: the reference engines of --load-format
    safetensors are left out to keep the suite's time (one engine start per architecture, ~25 s
    each here). Phi-3 (no table knows it) is also saved for vLLM by ``distload reshard`` with
    no --sharding, beside vLLM (phi3_resharded), then served from that save by vLLM's own
    sharded_state loader; that engine then takes two pushes by slices from a trainer at
    ``address`` (other weights, then Phi-3's own again)."""
    root = p["root"]
    cases = [{"name": a, "model": f"{root}/{a}", "format": "distload", "extra": {"check_weight_map": True}}
             for a in ARCHITECTURES]
    cases.append({"name": "phi3 saved", "model": p["phi3-tp2"], "format": "sharded_state",
                  "push": {"address": address, "receives": 4}})
    return [dict(case, tp=2, name=f"arch {case['name']}", fork=True) for case in cases]


def reshard_beside_vllm(python: str, source: str, output: str) -> subprocess.CompletedProcess:
    """``python -m distload reshard SOURCE OUTPUT --tensor-parallel-size 2`` in vLLM's environment,
    no --sharding: what a user of vLLM runs."""
    from dist_helpers import clean_env

    return subprocess.run([python, "-m", "distload", "reshard", source, output, "--tensor-parallel-size", "2"],
                          capture_output=True, text=True, timeout=600, env=clean_env())


@pytest.fixture(scope="module")
def phi3_resharded(checkpoints):
    """Phi-3 (no table of distload's knows its names) resharded for TP 2 by reshard's default
    beside vLLM; the ``phi3 saved`` engine serves the output. The command's result."""
    python, p = checkpoints
    p["phi3-tp2"] = os.path.join(p["root"], "phi3-tp2")
    return reshard_beside_vllm(python, os.path.join(p["root"], "phi3"), p["phi3-tp2"])


@pytest.fixture(scope="module")
def engines(checkpoints, phi3_resharded, tmp_path_factory):
    """Every engine of this module, one after the other in one driver process (vLLM imported
    once): TP 2, the architectures and the MoE models at TP 2, then TP 1. tensor-parallel size (or
    "arch", "moe") -> case name -> its result; "_output" is the driver's output (vLLM logs its
    workers' lines there)."""
    python, p = checkpoints
    from dist_helpers import clean_env, free_port, write_script

    script = write_script(tmp_path_factory.mktemp("trainer"), "trainer.py", TRAINER)
    addresses, trainers = [], []
    for first, second, mode in ((p["llama-b"], p["llama"], "die"), (p["phi3-b"], f"{p['root']}/phi3", "steps"),
                                (p["qwen3moe-b"], f"{p['root']}/moe/qwen3moe-bf16", "steps")):
        addresses.append(f"tcp://127.0.0.1:{free_port()}")
        trainers.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                          "--nproc-per-node=1", script, addresses[-1], first, second, mode],
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env()))
    cases = {1: tp1_cases(p), 2: tp2_cases(p, addresses[0])}
    weight_maps = str(tmp_path_factory.mktemp("weight-maps"))
    try:
        # TP 2 first: most fork their workers, which a TP 1 engine's model run in the driver's own
        # process would hang (vllm_driver.py).
        results = _drive(python, 1, [dict(case, tp=2, name=f"tp2 {case['name']}") for case in cases[2]]
                         + architecture_cases(p, addresses[1]) + moe_cases(p, addresses[2])
                         + [dict(case, tp=1, name=f"tp1 {case['name']}") for case in cases[1]], weight_maps)
        trainer_output = [trainer.communicate(timeout=120)[0] for trainer in trainers]
    finally:
        for trainer in trainers:
            if trainer.poll() is None:
                trainer.kill()
    out = {tp: {case["name"]: results[f"tp{tp} {case['name']}"] for case in cases[tp]
                if f"tp{tp} {case['name']}" in results} for tp in (1, 2)}
    out["arch"] = {name[len("arch "):]: value for name, value in results.items() if name.startswith("arch ")}
    out["moe"] = {name[len("moe "):]: value for name, value in results.items() if name.startswith("moe ")}
    for key in out:
        out[key]["_output"] = results["_output"]
    out[2]["_trainer"], out["arch"]["_trainer"], out["moe"]["_trainer"] = trainer_output
    out["arch"]["_cached"] = sorted(os.listdir(weight_maps))
    return out


@pytest.fixture(scope="module")
def tp1(engines):
    return engines[1]


@pytest.fixture(scope="module")
def tp2(engines):
    return engines[2]


# The case whose tokens are those of vLLM's own load: TP 1 starts an engine with vLLM's loader (~3 s
# there); at TP 2 the plugin's, checked bit for bit against vLLM's load (tp2_cases).
TRUTH = {1: "reference", 2: "plugin"}


def _reference(results: dict, tp: int) -> list:
    return _tokens(results, TRUTH[tp])


def _tokens(results: dict, name: str) -> list:
    assert "tokens" in results[name], f"{name}: {results[name]}"
    return results[name]["tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_save_sharded_output_loads_in_vllms_sharded_state_loader(tp, request):
    results = request.getfixturevalue(f"tp{tp}")
    assert _tokens(results, "saved") == _reference(results, tp)


@pytest.mark.slow
def test_save_sharded_output_loads_in_vllms_run_ai_sharded_loader(tp2):
    assert _tokens(tp2, "saved runai") == _reference(tp2, 2)


@pytest.mark.slow
def test_tied_embeddings_and_biases_load_in_vllm(tp2):
    # The plugin's load is vLLM's own, bit for bit (check_weight_map), so its tokens are the reference.
    assert _tokens(tp2, "qwen saved") == _tokens(tp2, "qwen plugin")


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_loads_a_whole_checkpoint_through_distload(tp, request):
    results = request.getfixturevalue(f"tp{tp}")
    if tp == 1:
        assert _tokens(results, "plugin") == _tokens(results, "reference")
    else:  # checked bit for bit against vLLM's own load inside the engine, which would not start otherwise
        output = _case_output(results["_output"], "tp2 plugin")
        assert _tokens(results, "plugin") and all(
            f"TP rank {rank}: the load equals vLLM's own, bit for bit" in output for rank in (0, 1)), output[-3000:]


@pytest.mark.slow
def test_the_engines_own_save_equals_the_table_where_the_table_knows_the_model(tp2, checkpoints):
    """save_sharded (what reshard --sharding vllm runs in vLLM's engine) from the TP 2 plugin engine,
    against distload's table of vLLM's names (vllm_names.py, used where vLLM is not installed):
    the same tensors, names, shapes and bytes on every rank."""
    from safetensors.torch import load_file

    assert "tokens" in tp2["plugin"], tp2["plugin"]
    _, p = checkpoints

    def rank_state(folder, rank):
        out = {}
        for name in sorted(os.listdir(folder)):
            if name.startswith(f"model-rank-{rank}-") and name.endswith(".safetensors"):
                out.update(load_file(os.path.join(folder, name)))
        return out

    for rank in (0, 1):
        engine, table = rank_state(p["llama-tp2-engine"], rank), rank_state(p["llama-tp2"], rank)
        assert engine and sorted(engine) == sorted(table), sorted(set(engine) ^ set(table))
        for name, tensor in table.items():
            got = engine[name]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
            assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


@pytest.mark.slow
def test_vllm_loads_a_pre_sharded_save_through_distload(tp2):
    assert _tokens(tp2, "plugin saved") == _reference(tp2, 2)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_a_dummy_engine_switches_to_the_real_weights_in_place(tp, request):
    results = request.getfixturevalue(f"tp{tp}")
    dummy = results["dummy" if tp == 1 else "push"]  # at TP 2 the push case's engine, after its pushes
    assert dummy["tokens"] != _reference(results, tp)  # random weights generate other tokens
    if tp == 2:  # what it served just before the reload: the pushed version 1, other weights again
        assert dummy["pushed"][-1]["tokens"] != _reference(results, tp)
    assert dummy["reloaded"] == _reference(results, tp)


@pytest.mark.slow  # quick itself, but it needs every engine of the module (about 5 minutes)
def test_the_cpu_servers_own_engines_spawn_their_workers_the_others_fork(tp2, architectures, moe):
    """The plugin's load and the pushes run in workers spawned as vLLM's CPU server spawns them
    (each imports vLLM and distload itself); the other TP 2 engines fork theirs (vllm_driver.py)."""
    workers = {name: case["workers"] for results in (tp2, architectures, moe) for name, case in results.items()
               if isinstance(case, dict) and "workers" in case}
    assert workers.pop("push") == workers.pop("plugin") == "spawn", workers
    assert workers and set(workers.values()) == {"fork"}, workers


def test_the_extra_config_is_checked_as_distload_load_checks_it():
    """What the engine's workers raise at start (seen there: the engine stops, its log naming the
    key); checked here without an engine."""
    from distload.vllm.plugin import reader_config

    assert reader_config(None).load_format == "auto"
    assert reader_config({"reader": "runai_streamer", "concurrency": 8}).extra == {"concurrency": 8}
    with pytest.raises(distload.ConfigError, match="'reader': 'fastest' is not a distload reader"):
        reader_config({"reader": "fastest"})
    with pytest.raises(distload.ConfigError, match="Unexpected extra config keys \\['concurency'\\]"):
        reader_config({"reader": "runai_streamer", "concurency": 8})
    with pytest.raises(distload.ConfigError, match="vLLM's own --load-format dummy"):
        reader_config({"reader": "dummy"})


@pytest.mark.slow
def test_a_trainer_job_pushes_into_a_running_vllm_engine(tp2):
    """A dummy engine's TP 2 workers take version 1 from a separately launched trainer job and
    generate exactly what a fresh load of those weights generates; the trainer then dies a few
    buckets into version 2, and the engine goes on serving version 1, saying so."""
    assert "pushed 1" in tp2["_trainer"], tp2["_trainer"][-3000:]
    push = tp2["push"]
    first, failed = push["pushed"]
    assert first.get("version") == 1, first
    # Each worker received its slices only (what its weight loaders take), not the whole model.
    whole = first["slices"][0] + first["slices"][1]
    for sent, kept in zip(first["bytes"], first["slices"]):
        assert sent <= 1.05 * kept and kept < 0.6 * whole, first
    assert push["tokens"] != _tokens(tp2, "reference b")  # the dummy weights generate other tokens
    assert first["tokens"] == _tokens(tp2, "reference b")
    assert "still serves version 1" in failed.get("error", ""), failed
    assert failed["tokens"] == _tokens(tp2, "reference b")


# -- any architecture: the weight map learned from vLLM's own loaders (issue 35) --------------------

# One tiny model per trait the recorder must get right, each saved by transformers itself.
MAKE_ARCHITECTURES = r"""
import transformers as T
shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)
models = {
    "qwen2moe": (T.Qwen2MoeConfig, dict(shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=64)),  # experts, a shared expert
    "phi3": (T.Phi3Config, dict(shape, pad_token_id=0)),  # q/k/v and gate/up fused in the checkpoint
    "gpt2": (T.GPT2Config, dict(n_embd=128, n_layer=2, n_head=4, vocab_size=1000, n_positions=256)),  # Conv1D
    "qwen3": (T.Qwen3Config, dict(shape, head_dim=32, tie_word_embeddings=True)),  # q/k norms, tied
    "bloom": (T.BloomConfig, dict(hidden_size=128, n_layer=2, n_head=4, vocab_size=1000)),  # a computed q/k/v
}
for seed, (name, (config, kwargs)) in enumerate(sorted(models.items())):
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config(**kwargs)).to(torch.bfloat16)
    model.save_pretrained(f"{root}/{name}", safe_serialization=True)
"""
# With the Llama and the Qwen2 (q/k/v biases, tied embeddings) of the tp1/tp2 fixtures, whose
# plugin cases check the weight map too. Mixtral was checked the same way by hand (one MoE here
# keeps an engine start, ~25-45 s, off the suite).
ARCHITECTURES = ["qwen2moe", "phi3", "gpt2", "qwen3", "bloom"]


@pytest.fixture(scope="module")
def architectures(engines):
    return engines["arch"]


def _case_output(output: str, name: str) -> str:
    """The driver's output of one case: from the end of the case before it to its own CASE line
    (the driver runs the cases one after the other and prints CASE when each ends)."""
    lines = output.splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith(f"CASE {name} "))
    begin = max((i for i, line in enumerate(lines[:end]) if line.startswith("CASE ")), default=-1)
    return "\n".join(lines[begin + 1:end])


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_any_architecture_loads_through_the_recorded_weight_map_bit_for_bit(architectures, architecture):
    assert "tokens" in architectures[architecture], f"{architecture}: {architectures[architecture]}"


@pytest.mark.slow
def test_reshards_default_beside_vllm_is_the_engines_layout_for_an_architecture_no_table_knows(phi3_resharded,
                                                                                              checkpoints):
    """Beside vLLM, ``reshard`` without --sharding saves Phi-3 (not in distload's table) through
    vLLM's engine, and says so: vLLM's names (its attention scales, which no checkpoint holds) in
    every rank's files, the summary naming vLLM's version and its sharded_state loader."""
    from safetensors import safe_open

    result = phi3_resharded
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "sharding spec vllm: vLLM 0.32" in result.stdout and "loads with vLLM's sharded_state" in result.stdout
    assert "without vLLM installed" not in result.stdout + result.stderr
    folder = checkpoints[1]["phi3-tp2"]
    for rank in (0, 1):
        with safe_open(os.path.join(folder, f"model-rank-{rank}-part-0.safetensors"), "pt") as f:
            assert "model.layers.0.self_attn.attn._k_scale" in set(f.keys()), rank


@pytest.mark.slow
def test_the_engine_saves_an_architecture_no_table_knows_for_vllms_sharded_state_loader(architectures):
    """Phi-3's save by reshard's default beside vLLM (its engine's parameters, above): vLLM's own
    sharded_state loader serves it token for token as distload's load of the checkpoint (equal to
    vLLM's own, checked above). main wrote the decoder layout there, which vLLM did not start on."""
    saved = architectures["phi3 saved"]
    assert "tokens" in saved, saved
    assert saved["tokens"] == architectures["phi3"]["tokens"]


@pytest.mark.slow
def test_reshards_default_beside_vllm_falls_back_to_decoder_for_an_architecture_vllm_does_not_build(checkpoints,
                                                                                                  tmp_path):
    """An architecture vLLM's registry does not have (Phi-3's weights under a made-up name): the
    engine's child refuses it before any engine starts, and the save is the decoder layout, its
    summary saying vLLM's sharded_state does not read it and why (not "without vLLM installed")."""
    import shutil

    python, p = checkpoints
    source = str(tmp_path / "made-up")
    shutil.copytree(os.path.join(p["root"], "phi3"), source)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["MadeUpForCausalLM"]
    with open(os.path.join(source, "config.json"), "w") as f:
        json.dump(config, f)
    result = reshard_beside_vllm(python, source, str(tmp_path / "out"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ("sharding spec decoder: the checkpoint's own names: distload's loaders read this save, vLLM's "
            "sharded_state loader does not (not the vllm layout, the default where vLLM is installed, because "
            "vLLM 0.32.0's registry has no MadeUpForCausalLM)") in result.stdout, result.stdout
    assert "without vLLM installed" not in result.stdout + result.stderr


@pytest.mark.slow
def test_a_push_by_slices_into_an_architecture_no_table_knows(architectures):
    """Phi-3 fuses q/k/v and gate/up in its checkpoint: each TP 2 worker of the engine above
    receives its runs of rows of those (its weight map's cuts), at most 1.05x the bytes of its
    slices, and vLLM's own reload puts them in place: other weights generate other tokens, and
    Phi-3's own weights pushed after them generate Phi-3's tokens again. Then a training step's
    change goes whole once (the push before it changed every element, so the trainer's compare
    gave up there and refreshes its copy now: docs/delta-sync.md, "Whole or a patch"), and its
    reverse arrives as a delta into each worker's staging (a fraction of the bytes, checked):
    after both, the engine serves Phi-3's exact weights again, so its tokens."""
    assert "pushed 4 delta" in architectures["_trainer"], architectures["_trainer"][-3000:]
    saved = architectures["phi3 saved"]
    other, own, step, back = saved["pushed"]
    assert [push.get("version") for push in saved["pushed"]] == [1, 2, 3, 4], saved["pushed"]
    for push in (other, own):
        for sent, kept in zip(push["bytes"], push["slices"]):
            assert sent <= 1.05 * kept, push
    assert other["tokens"] != saved["tokens"]
    assert own["tokens"] == saved["tokens"]
    assert step["verified"] == [True, True], step
    for sent, kept in zip(step["bytes"], step["slices"]):  # whole: the copy the compare gave up on, refreshed
        assert sent <= 1.05 * kept, step
    # 1% of the elements changed back: 4 bytes a change of bf16, and the checks (a norm whose few
    # changes do not pay goes whole)
    assert back["delta"] == [True, True] and back["verified"] == [True, True], back
    for sent, kept in zip(back["bytes"], back["slices"]):
        assert sent < 0.08 * kept, back
    assert back["tokens"] == saved["tokens"]


@pytest.mark.slow
def test_reshard_for_vllm_runs_vllms_engine_to_save(tp1):
    """distload.reshard(..., sharding="vllm") where vLLM is installed: vLLM's engine, started in a
    child process at the asked TP size, writes the save; vLLM's sharded_state loader serves it."""
    saved = tp1["saved"]
    assert saved["resharded"]["spec"] == "vllm" and "written by its engine at TP 1" in saved["resharded"]["note"]
    assert _tokens(tp1, "saved") == _tokens(tp1, "reference")


# The class vLLM names each architecture's model with, in its log of the weight map it records.
MODEL_CLASSES = {"qwen2moe": "Qwen2MoeForCausalLM", "phi3": "Phi3ForCausalLM", "gpt2": "GPT2LMHeadModel",
                 "qwen3": "Qwen3ForCausalLM", "bloom": "BloomForCausalLM"}


@pytest.mark.slow
def test_each_tp_rank_reads_its_slices_only(architectures):
    """Recorded afresh on each rank (the cache was empty), and each rank reads only the boxes its
    parameters take: about half of each split tensor (the replicated norms and position
    embeddings, BLOOM's q/k/v read whole, make it more than half)."""
    import re

    for architecture in ARCHITECTURES:
        output = _case_output(architectures["_output"], f"arch {architecture}")
        for rank in (0, 1):
            assert f"weight map of {MODEL_CLASSES[architecture]} on TP rank {rank} of 2" in output, architecture
        reads = [(int(a), int(b)) for a, b in re.findall(r"reads (\d+) of the checkpoint's (\d+) bytes", output)]
        assert len(reads) == 2, (architecture, reads)
        assert all(read < 0.75 * total for read, total in reads), (architecture, reads)


@pytest.mark.slow
def test_a_loader_that_computes_sends_its_tensors_through_vllms_own_loader(architectures):
    """BLOOM's loader interleaves the heads of its fused q/k/v (a reshape of a transposed view, a
    copy): no region says it, so those tensors go whole through vLLM's loader, and the log says so."""
    assert "tokens" in architectures["bloom"], architectures["bloom"]
    assert "query_key_value.weight goes through vLLM's own loader" in _case_output(architectures["_output"],
                                                                                  "arch bloom")


@pytest.mark.slow
def test_each_tp_ranks_weight_map_is_cached(architectures):
    """One cache entry per model and TP rank that loaded a whole checkpoint through distload: each
    architecture's 2 ranks, the Llama's (1 at TP 1, 2 at TP 2) and the Qwen2's (2) plugin cases, and
    the two MoE plugin cases' (2 each); and one per TP rank of an engine that took pushes (the
    Llama's, Phi-3's and the expert-parallel Qwen3-MoE's, 2 each: recorded against the parameters
    as loaded, another key). The reload and the pre-sharded loads record none."""
    assert len(architectures["_cached"]) == 2 * len(ARCHITECTURES) + 1 + 2 + 2 + 2 * len(MOE_PLUGIN_CASES) + 3 * 2, \
        architectures["_cached"]


# -- mixture-of-experts and FP8 block-scaled checkpoints (issue 46) ---------------------------------

# The tiny DeepSeek-V3 and Qwen3-MoE of tests/moe_checkpoints.py (BF16 and FP8 block-scaled).
MAKE_MOE = r"""
sys.path.insert(0, sys.argv[4])
import moe_checkpoints
moe_checkpoints.make(f"{root}/moe")
"""
MOE_PLUGIN_CASES = ("qwen3 ep", "deepseek fp8")


def moe_cases(p: dict, address: str) -> list[dict]:
    """Three TP 2 engines. What vLLM 0.32's CPU build serves of the four MoE checkpoints (checked by
    hand, docs/expert-parallel.md): all four at TP 1 and TP 2; with --enable-expert-parallel every
    one loads, but its first token routed to another worker's expert crashes the CPU MoE kernel.
    So the expert-parallel engines start (their loads, checked bit for bit) and generate nothing:

    - "qwen3 ep": Qwen3-MoE BF16 under expert parallelism through the plugin, compared with vLLM's
      own load on each worker (check_weight_map); each worker saves its parameters (save_sharded:
      what ``reshard --sharding vllm --expert-parallel-size 2`` runs); then it takes four pushes
      from a trainer at ``address`` (other weights, its own, a training step, its own), each
      worker's parameters' digest recorded after each;
    - "qwen3 reloads": vLLM's own loader under expert parallelism, then its own in-place reload
      of the other weights and of the model's own again: the parameters each push must leave;
    - "qwen3 saved": that save, loaded by vLLM's own sharded_state loader under expert
      parallelism (every key and shape of each worker's model, or it does not start);
    - "deepseek fp8": DeepSeek-V3 FP8 block-scaled (MLA, a dense first layer, a shared expert)
      through the plugin at TP 2, checked bit for bit, generating."""
    moe = f"{p['root']}/moe"
    p["qwen3-ep2"] = f"{p['root']}/qwen3moe-ep2"
    return [dict(case, tp=2, fork=True) for case in [
        {"name": "moe qwen3 ep", "model": f"{moe}/qwen3moe-bf16", "format": "distload", "ep": True, "generate": False,
         "extra": {"check_weight_map": True, "save_sharded": p["qwen3-ep2"]}, "digest": True,
         "push": {"address": address, "receives": 4}},
        {"name": "moe qwen3 reloads", "model": f"{moe}/qwen3moe-bf16", "format": "safetensors", "ep": True,
         "generate": False, "digest": True, "reloads": [p["qwen3moe-b"], f"{moe}/qwen3moe-bf16"]},
        {"name": "moe qwen3 saved", "model": p["qwen3-ep2"], "format": "sharded_state", "ep": True,
         "generate": False},
        {"name": "moe deepseek fp8", "model": f"{moe}/deepseek-fp8", "format": "distload",
         "extra": {"check_weight_map": True}},
    ]]


@pytest.fixture(scope="module")
def moe(engines):
    return engines["moe"]


def _reads(output: str) -> list[tuple[int, int, int]]:
    """Each rank's (bytes read, checkpoint bytes, bytes kept), from the plugin's log line."""
    import re

    return [tuple(map(int, m)) for m in re.findall(
        r"reads (\d+) of the checkpoint's (\d+) bytes \(its slices; it keeps (\d+) of them\)", output)]


@pytest.mark.slow
def test_each_expert_parallel_worker_loads_vllms_own_experts_bit_for_bit_reading_only_them(moe):
    """Under --enable-expert-parallel each worker's weight map is recorded from its own loaders,
    which skip the other worker's experts: the worker reads none of their bytes (at most 1.05x
    what it keeps, about half the checkpoint), and its load equals vLLM's own bit for bit. The
    log names the placement vLLM gave it (linear: experts 0-1 and 2-3)."""
    assert {key: moe["qwen3 ep"][key] for key in ("tokens", "resharded", "workers")} == {
        "tokens": None, "resharded": None, "workers": "fork"}, moe["qwen3 ep"]
    output = _case_output(moe["_output"], "moe qwen3 ep")
    for rank, experts in ((0, [0, 1]), (1, [2, 3])):
        assert f"TP rank {rank} (EP rank {rank} of 2, keeping experts {experts} of 4 in each of its 2 MoE layers)" \
            in output, output[-3000:]
        assert f"TP rank {rank}: the load equals vLLM's own, bit for bit" in output, output[-3000:]
    reads = _reads(output)
    assert len(reads) == 2 and all(read <= 1.05 * kept and read < 0.55 * total for read, total, kept in reads), reads


def _differing(got: list[dict], want: list[dict]) -> list[str]:
    """Each worker's parameters whose digests differ, as 'worker: name'."""
    assert len(got) == len(want)
    return [f"{worker}: {name}" for worker, (a, b) in enumerate(zip(got, want))
            for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]


@pytest.mark.slow
def test_pushes_into_an_expert_parallel_engine_send_each_worker_its_experts_and_land_bit_for_bit(moe, checkpoints):
    """A trainer pushes into the engine above (--enable-expert-parallel, TP 2: each worker its
    own two experts). Each worker receives at most 1.05x the bytes of its parameters (its experts
    whole, the rest as vLLM's TP splits it: about half the model), never the other worker's
    experts; vLLM's own reload puts them in place. After each push every worker's parameters,
    after vLLM's post-processing, equal bit for bit those vLLM's own in-place reload of that
    version leaves ("qwen3 reloads"). (A fresh load is not that reference for the routed
    experts: vLLM's CPU build prepacks them, and a reload's prepacked bytes differ from a fresh
    load's while generating the same tokens, checked by hand without EP; every other parameter
    is compared with the fresh load too.) A training step's reverse arrives as a delta, verified.
    The CPU build cannot generate under EP: docs/expert-parallel.md."""
    assert "pushed 4 delta" in moe["_trainer"], moe["_trainer"][-3000:]
    engine, reloads = moe["qwen3 ep"], moe["qwen3 reloads"]
    assert "error" not in reloads, reloads
    other, own, step, back = engine["pushed"]
    assert [push.get("version") for push in engine["pushed"]] == [1, 2, 3, 4], engine["pushed"]
    reloaded_other, reloaded_own = reloads["reloads_digests"]
    stacks = [f"model.layers.{layer}.mlp.experts.routed_experts.{w}" for layer in (0, 1) for w in ("w13_weight", "w2_weight")]
    assert all(reloaded_own[0][n] != reloaded_own[1][n] for n in stacks)  # each worker its own experts
    assert _differing(reloaded_other, reloaded_own)  # the reference tells the two versions apart
    assert _differing(other["digests"], reloaded_other) == []
    assert _differing(own["digests"], reloaded_own) == [] and _differing(back["digests"], reloaded_own) == []
    assert step["digests"] not in (reloaded_own, reloaded_other)
    prepacked = [f"{worker}: {name}" for worker in (0, 1) for name in stacks]
    assert _differing(own["digests"], engine["digests"]) == prepacked  # the plugin's load: vLLM's own, checked
    # What a worker keeps: half of every expert-free tensor (vLLM's TP 2), its 2 experts of 4, the
    # norms and the router whole; all experts would be more than half of the checkpoint.
    _, p = checkpoints
    folder = f"{p['root']}/moe/qwen3moe-bf16"
    total = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if n.endswith(".safetensors"))
    for push in (other, own, step):
        assert push["verified"] == [True, True], push
        for sent, kept in zip(push["bytes"], push["slices"]):
            assert sent <= 1.05 * kept and kept < 0.51 * total, (push, total)
    assert back["delta"] == [True, True] and back["verified"] == [True, True], back
    for sent, kept in zip(back["bytes"], back["slices"]):
        assert sent < 0.08 * kept, back


@pytest.mark.slow
def test_an_expert_parallel_engines_save_holds_each_workers_experts_and_vllm_loads_it(moe, checkpoints):
    """Each worker's save (before vLLM's post-processing) holds its own experts, stacked as vLLM
    stacks them (gate and up in ``routed_experts.w13_weight``, down in ``w2_weight``), equal to the
    checkpoint's tensors; vLLM's own sharded_state loader under expert parallelism takes the save
    (it refuses a missing key or a wrong shape at start)."""
    from safetensors.torch import load_file

    assert "error" not in moe["qwen3 saved"], moe["qwen3 saved"]
    _, p = checkpoints
    source = {}
    folder = f"{p['root']}/moe/qwen3moe-bf16"
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            source.update(load_file(os.path.join(folder, name)))
    for rank, experts in ((0, [0, 1]), (1, [2, 3])):
        saved = {}
        for name in os.listdir(p["qwen3-ep2"]):
            if name.startswith(f"model-rank-{rank}-") and name.endswith(".safetensors"):
                saved.update(load_file(os.path.join(p["qwen3-ep2"], name)))
        for layer in (0, 1):
            expert, stack = f"model.layers.{layer}.mlp.experts", f"model.layers.{layer}.mlp.experts.routed_experts"
            w13 = torch.stack([torch.cat([source[f"{expert}.{e}.gate_proj.weight"],
                                          source[f"{expert}.{e}.up_proj.weight"]]) for e in experts])
            w2 = torch.stack([source[f"{expert}.{e}.down_proj.weight"] for e in experts])
            assert torch.equal(saved[f"{stack}.w13_weight"], w13) and torch.equal(saved[f"{stack}.w2_weight"], w2)


@pytest.mark.slow
def test_fp8_block_scaled_deepseek_loads_through_distload_bit_for_bit(moe):
    """DeepSeek-V3 in FP8 with 128x128 block scales (weight_scale_inv), MLA and a shared expert:
    each TP 2 worker's load equals vLLM's own bit for bit (FP8 weights and their scales alike),
    reading only what it keeps, and the engine generates."""
    assert moe["deepseek fp8"]["tokens"], moe["deepseek fp8"]
    output = _case_output(moe["_output"], "moe deepseek fp8")
    for rank in (0, 1):
        assert f"TP rank {rank}: the load equals vLLM's own, bit for bit" in output, output[-3000:]
    reads = _reads(output)
    assert len(reads) == 2 and all(read <= 1.05 * kept and read < 0.6 * total for read, total, kept in reads), reads
