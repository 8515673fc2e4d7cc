"""Sharded checkpoints end to end: offline reshard (API and CLI), save from a running job, the
manifest, the load-side checks, verify and inspect.

Round trips are checked bit for bit: a resharded checkpoint loaded by N ranks (torchrun on gloo)
and reassembled with the manifest's plan must give back the source tensors exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

import distload
from distload.cli.main import main as cli_main
from distload.loading.sources import read_local_header
from distload.errors import CheckpointError, ConfigError, ShardLayoutError
from distload.loading.manifest import MANIFEST_NAME, SAVING_MARKER
from distload.checkpoints.reshard import reshard
from distload.checkpoints.save import save_sharded
from distload.tp.spec import load_spec, spec_from_json
from distload.tp.slices import reassemble

from conftest import plain_digest, plain_read, read_report, run_distload, write_sharded
from dist_helpers import rank_error, run_job

PATTERN = "model-rank-{rank}-part-{part}.safetensors"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS",
               "SLURM_LOCALID")

# A small Llama-shaped model: GQA with 4 heads, 2 kv heads, head_dim 8 (every split size divisible by 4).
H, HEADS, KV, HEAD_DIM, INTER, VOCAB = 32, 4, 2, 8, 64, 200  # vocab padded to 256 as vLLM does
CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": H, "num_attention_heads": HEADS,
          "num_key_value_heads": KV, "intermediate_size": INTER, "vocab_size": VOCAB}
LAYER_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int8]
UNMATCHED = ["model.layers.0.mlp.router.weight", "model.vision_tower.patch_scale"]
METADATA_FILES = {
    "config.json": json.dumps(CONFIG),
    "tokenizer.json": json.dumps({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}}),
    "generation_config.json": json.dumps({"bos_token_id": 1, "eos_token_id": 2}),
}


@pytest.fixture(autouse=True)
def single_process_env(monkeypatch):
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)


def _values(shape, dtype, g) -> torch.Tensor:
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
    return (torch.randn(shape, generator=g) * 4).to(dtype)


def llama_state(layers: int = len(LAYER_DTYPES)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    s: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": _values((VOCAB, H), torch.bfloat16, g),
        "lm_head.weight": _values((VOCAB, H), torch.bfloat16, g),
        "model.norm.weight": _values((H,), torch.float32, g),
        UNMATCHED[0]: _values((8, H), torch.float32, g),
        UNMATCHED[1]: _values((3,), torch.int8, g),  # 3: not divisible by 2 or 4, so it must not be split
    }
    for layer in range(layers):
        dt = LAYER_DTYPES[layer % len(LAYER_DTYPES)]
        p = f"model.layers.{layer}"
        s[f"{p}.self_attn.q_proj.weight"] = _values((HEADS * HEAD_DIM, H), dt, g)
        s[f"{p}.self_attn.k_proj.weight"] = _values((KV * HEAD_DIM, H), dt, g)
        s[f"{p}.self_attn.v_proj.weight"] = _values((KV * HEAD_DIM, H), dt, g)
        s[f"{p}.self_attn.q_proj.bias"] = _values((HEADS * HEAD_DIM,), dt, g)
        s[f"{p}.self_attn.o_proj.weight"] = _values((H, HEADS * HEAD_DIM), dt, g)
        s[f"{p}.self_attn.o_proj.bias"] = _values((H,), dt, g)
        s[f"{p}.mlp.gate_proj.weight"] = _values((INTER, H), dt, g)
        s[f"{p}.mlp.up_proj.weight"] = _values((INTER, H), dt, g)
        s[f"{p}.mlp.down_proj.weight"] = _values((H, INTER), dt, g)
        s[f"{p}.input_layernorm.weight"] = _values((H,), dt, g)
        s[f"{p}.post_attention_layernorm.weight"] = _values((H,), dt, g)
        # A fused qkv (as some exporters write it) and a fused gate_up.
        s[f"{p}.self_attn.qkv_proj.weight"] = _values(((HEADS + 2 * KV) * HEAD_DIM, H), dt, g)
        s[f"{p}.mlp.gate_up_proj.weight"] = _values((2 * INTER, H), dt, g)
    return s


def write_hf_source(folder: str, state: dict[str, torch.Tensor]) -> None:
    """Two files plus model.safetensors.index.json, the metadata files, and a stray safetensors
    file the index does not name (it must be ignored: the index is honoured)."""
    os.makedirs(folder, exist_ok=True)
    names = sorted(state)
    weight_map = {}
    for i, chunk in enumerate((names[0::2], names[1::2])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: state[n].contiguous() for n in chunk}, os.path.join(folder, fname))
        weight_map.update({n: fname for n in chunk})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    # q_proj of a layer the model does not have, with 3 rows: splitting it would fail.
    save_file({"model.layers.99.self_attn.q_proj.weight": torch.ones(3, H)},
              os.path.join(folder, "stray-not-in-index.safetensors"))
    for name, text in METADATA_FILES.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)


def raw(t: torch.Tensor) -> bytes:
    flat = t.detach().reshape(-1).contiguous().cpu()
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def read_manifest_json(folder: str) -> dict:
    with open(os.path.join(folder, MANIFEST_NAME)) as f:
        return json.load(f)


def rank_files(folder: str, rank: int) -> list[str]:
    m = read_manifest_json(folder)
    entries = sorted((f for f in m["files"] if f["rank"] == rank), key=lambda f: f["part"])
    return [os.path.join(folder, f["name"]) for f in entries]


def shard_names(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))


def tensor_bytes_of(path: str) -> int:
    return sum(t.nbytes for t in read_local_header(path).tensors)


def clean_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def run_python(code_or_script: list[str], timeout: float = 120, nproc: int | None = None) -> subprocess.CompletedProcess:
    if nproc is None:
        return subprocess.run([sys.executable, *code_or_script], capture_output=True, text=True, timeout=timeout,
                              env=clean_env())
    return run_job(list(code_or_script), nproc, timeout, clean_env())


def write_script(folder, name: str, source: str) -> str:
    path = os.path.join(str(folder), name)
    with open(path, "w") as f:
        f.write(textwrap.dedent(source))
    return path


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("src") / "llama")
    state = llama_state()
    write_hf_source(folder, state)
    return folder, state


@pytest.fixture(scope="module")
def resharded(source, tmp_path_factory):
    """The source resharded for 1, 2 and 4 ranks (small parts, so every rank has several)."""
    folder, _ = source
    root = tmp_path_factory.mktemp("out")
    outs, reports = {}, {}
    for n in (1, 2, 4):
        out = str(root / f"tp{n}")
        reports[n] = reshard(folder, out, n, max_file_size=16 * 1024)
        outs[n] = out
    return outs, reports


def copy_of(folder: str, tmp_path, name: str = "copy") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(folder, dst)
    return dst


# -- offline reshard: contents ------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 4])
def test_reshard_manifest_matches_files_on_disk(resharded, source, n):
    _, state = source
    out = resharded[0][n]
    m = read_manifest_json(out)
    assert list(m)[:2] == ["format", "version"]
    assert m["format"] == "distload-sharded" and m["version"] == 2
    assert m["world_size"] == n and m["pattern"] == PATTERN
    assert m["sharding"] == load_spec("decoder", CONFIG).to_json()
    assert m["sharding"]["config"] == {"num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HEAD_DIM}
    assert m["replicated_unmatched"] == sorted(UNMATCHED)
    assert m["source"] == source[0]
    # every file on disk is in the manifest and vice versa
    assert sorted(f["name"] for f in m["files"]) == shard_names(out)
    parts_per_rank = {}
    for f in m["files"]:
        path = os.path.join(out, f["name"])
        assert f["name"] == PATTERN.format(rank=f["rank"], part=f["part"])
        assert f["size"] == os.path.getsize(path), f["name"]
        assert f["sha256"] == sha256(path), f["name"]
        assert f["tensors"] == [t.name for t in read_local_header(path).tensors], f["name"]
        parts_per_rank.setdefault(f["rank"], []).append(f["part"])
    assert sorted(parts_per_rank) == list(range(n))
    for rank, parts in parts_per_rank.items():
        assert sorted(parts) == list(range(len(parts))), rank  # parts 0..k-1, no gaps
        names = [t for f in m["files"] if f["rank"] == rank for t in f["tensors"]]
        assert sorted(names) == sorted(state), rank  # every tensor, once, on every rank
    assert len(set(map(len, parts_per_rank.values()))) == 1
    assert len(parts_per_rank[0]) >= 3  # 16 KiB parts: the limit really split the files
    # the safetensors library itself reads every file
    for name in shard_names(out):
        load_file(os.path.join(out, name))


def test_reshard_report(resharded, source):
    report = resharded[1][2]
    assert report.world_size == 2
    assert report.replicated_unmatched == sorted(UNMATCHED)
    assert sorted(report.copied) == sorted(METADATA_FILES)
    assert report.nbytes_read == sum(t.numel() * t.element_size() for t in source[1].values())
    assert report.split["model.layers.0.self_attn.o_proj.weight"] == 1
    assert report.split["model.layers.0.self_attn.q_proj.weight"] == 0
    assert "model.layers.0.self_attn.o_proj.bias" not in report.split
    assert "model.norm.weight" not in report.split
    text = "\n".join(report.summary_lines())
    assert "replicated because no rule of the sharding spec matched them" in text
    for name in UNMATCHED:
        assert name in text


@pytest.mark.parametrize("n", [1, 2, 4])
def test_reshard_files_hold_each_ranks_slice(resharded, source, n):
    """Read the rank files with the safetensors library and reassemble with the manifest's plan."""
    _, state = source
    out = resharded[0][n]
    per_rank = [plain_read(rank_files(out, r)) for r in range(n)]
    check_reassembly(out, state, per_rank)


def check_reassembly(out: str, state: dict[str, torch.Tensor], per_rank: list[dict[str, torch.Tensor]]) -> None:
    n = len(per_rank)
    with open(os.path.join(out, "config.json")) as f:
        plan = spec_from_json(read_manifest_json(out)["sharding"], json.load(f))
    for r, got in enumerate(per_rank):
        assert sorted(got) == sorted(state), f"rank {r}"
    for name, want in state.items():
        action = plan.action(name, tuple(want.shape))
        shards = [per_rank[r][name] for r in range(n)]
        assert all(s.dtype == want.dtype for s in shards), name
        if action.replicated:
            for r, s in enumerate(shards):
                assert raw(s) == raw(want), f"{name}: rank {r} replica differs"
        else:
            back = reassemble(shards, action, want.shape)
            assert tuple(back.shape) == tuple(want.shape), name
            assert raw(back) == raw(want), f"{name}: reassembled tensor differs from the source"
    # Independently of distload/tp/slices.py: what rank r must hold, by vLLM's rules written out.
    p = "model.layers.2.self_attn" if "model.layers.2.self_attn.q_proj.weight" in state else "model.layers.0.self_attn"
    for r in range(n):
        q, o = state[f"{p}.q_proj.weight"], state[f"{p}.o_proj.weight"]
        rows, cols = q.shape[0] // n, o.shape[1] // n
        assert torch.equal(per_rank[r][f"{p}.q_proj.weight"], q[r * rows:(r + 1) * rows])
        assert torch.equal(per_rank[r][f"{p}.o_proj.weight"], o[:, r * cols:(r + 1) * cols])
        assert torch.equal(per_rank[r][f"{p}.o_proj.bias"], state[f"{p}.o_proj.bias"])
        qkv = state[f"{p}.qkv_proj.weight"]
        qs = HEADS * HEAD_DIM // n
        k0, k1 = vllm_kv_rows(r, n)
        q_part, k_part, v_part = qkv.split([HEADS * HEAD_DIM, KV * HEAD_DIM, KV * HEAD_DIM])
        want = torch.cat([q_part[r * qs:(r + 1) * qs], k_part[k0:k1], v_part[k0:k1]])
        assert torch.equal(per_rank[r][f"{p}.qkv_proj.weight"], want), f"rank {r}: fused qkv slice"
        k = state[f"{p}.k_proj.weight"] if f"{p}.k_proj.weight" in state else None
        if k is not None:
            assert torch.equal(per_rank[r][f"{p}.k_proj.weight"], k[k0:k1]), f"rank {r}: k_proj"
        emb = state["model.embed_tokens.weight"]
        padded = -(-VOCAB // 64) * 64
        per = padded // n
        got = per_rank[r]["model.embed_tokens.weight"]
        assert got.shape[0] == per, f"rank {r}: vLLM pads {VOCAB} rows to {padded}, {per} per rank"
        real = emb[r * per:(r + 1) * per]
        assert raw(got[:real.shape[0]]) == raw(real)
        assert not got[real.shape[0]:].any(), f"rank {r}: vocabulary padding rows must be zero"


def vllm_kv_rows(r: int, n: int) -> tuple[int, int]:
    """The KV rows vLLM's QKVParallelLinear gives TP rank r of n: whole heads, replicated if n > KV."""
    if n >= KV:
        head = r // (n // KV)
        return head * HEAD_DIM, (head + 1) * HEAD_DIM
    per = KV * HEAD_DIM // n
    return r * per, (r + 1) * per


def test_reshard_copies_metadata_not_index(resharded, source):
    src, _ = source
    for out in resharded[0].values():
        for name, text in METADATA_FILES.items():
            with open(os.path.join(out, name)) as f:
                assert f.read() == text, name
        names = os.listdir(out)
        assert "model.safetensors.index.json" not in names
        assert SAVING_MARKER not in names
        assert not [n for n in names if n.endswith(".distload-tmp") or n.startswith(".")], names
        assert set(names) == set(shard_names(out)) | set(METADATA_FILES) | {MANIFEST_NAME}
    assert os.path.exists(os.path.join(src, "model.safetensors.index.json"))


def test_reshard_honours_the_index(resharded):
    for out in resharded[0].values():
        m = read_manifest_json(out)
        names = {t for f in m["files"] for t in f["tensors"]}
        assert "model.layers.99.self_attn.q_proj.weight" not in names


def test_reshard_single_file_source(tmp_path):
    state = llama_state(layers=1)
    src = tmp_path / "one"
    src.mkdir()
    save_file(state, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(CONFIG))
    out = str(tmp_path / "out")
    reshard(str(src / "model.safetensors"), out, 2)
    per_rank = [plain_read(rank_files(out, r)) for r in range(2)]
    check_reassembly(out, state, per_rank)
    assert shard_names(out) == [PATTERN.format(rank=r, part=0) for r in range(2)]


def test_manifest_is_as_readable_as_the_shards(resharded):
    out = resharded[0][2]
    shard_mode = stat.S_IMODE(os.stat(os.path.join(out, shard_names(out)[0])).st_mode)
    manifest_mode = stat.S_IMODE(os.stat(os.path.join(out, MANIFEST_NAME)).st_mode)
    assert shard_mode & 0o044, "test premise: the umask lets group/others read new files"
    assert manifest_mode == shard_mode


def test_reshard_does_not_copy_other_weight_formats(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    save_file({"model.norm.weight": torch.ones(4)}, str(src / "model.safetensors"))
    torch.save({"model.norm.weight": torch.ones(4)}, str(src / "pytorch_model.bin"))
    (src / "config.json").write_text("{}")
    out = str(tmp_path / "out")
    reshard(str(src), out, 1)
    assert os.path.exists(os.path.join(out, "config.json"))
    assert not os.path.exists(os.path.join(out, "pytorch_model.bin"))


# -- part splitting ---------------------------------------------------------------------------

def test_part_splitting_at_max_file_size(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    f32 = torch.float32
    state = {"t0": torch.arange(250, dtype=f32), "t1": torch.arange(250, dtype=f32) + 1,  # 1000 B each
             "t2_big": torch.arange(1250, dtype=f32),  # 5000 B > limit: a part of its own
             "t3": torch.arange(250, dtype=f32) + 3, "t4": torch.arange(100, dtype=f32),
             "t5": torch.arange(100, dtype=f32)}
    save_file(state, str(src / "model.safetensors"))
    out = str(tmp_path / "out")
    reshard(str(src), out, 2, sharding="replicate", max_file_size=2500)
    m = read_manifest_json(out)
    for rank in range(2):
        parts = [f["tensors"] for f in sorted((f for f in m["files"] if f["rank"] == rank),
                                               key=lambda f: f["part"])]
        assert parts == [["t0", "t1"], ["t2_big"], ["t3", "t4", "t5"]], rank
    assert_parts_respect_limit(out, 2500)
    assert plain_read(rank_files(out, 1)).keys() == state.keys()


def assert_parts_respect_limit(out: str, limit: int) -> None:
    """vLLM's rule: a part's TENSOR bytes are <= limit unless it holds one tensor, and a part is
    never closed while the next tensor would still have fitted (greedy)."""
    m = read_manifest_json(out)
    by_rank = {}
    for f in m["files"]:
        by_rank.setdefault(f["rank"], []).append(f)
    for rank, files in by_rank.items():
        files.sort(key=lambda f: f["part"])
        for i, f in enumerate(files):
            infos = read_local_header(os.path.join(out, f["name"])).tensors
            size = sum(info.nbytes for info in infos)
            assert size <= limit or len(infos) == 1, (f["name"], size, limit)
            if i + 1 < len(files):
                first_next = read_local_header(os.path.join(out, files[i + 1]["name"])).tensors[0]
                assert size + first_next.nbytes > limit, (f["name"], "closed too early")


def test_parts_count_tensor_bytes_as_vllm_does(tmp_path):
    """vLLM's own example: float32 tensors of 1, 2, 3 and 4 KiB with a limit of 3072 bytes."""
    src = tmp_path / "src"
    src.mkdir()
    state = {f"k{i}": torch.zeros(256 * (i + 1)) for i in range(4)}
    save_file(state, str(src / "model.safetensors"))
    out = str(tmp_path / "out")
    reshard(str(src), out, 1, sharding="replicate", max_file_size=3072)
    parts = [f["tensors"] for f in sorted(read_manifest_json(out)["files"], key=lambda f: f["part"])]
    assert parts == [["k0", "k1"], ["k2"], ["k3"]]
    # The same from a running job.
    distload.save_sharded(state, str(tmp_path / "job"), max_file_size=3072)
    parts = [f["tensors"] for f in sorted(read_manifest_json(str(tmp_path / "job"))["files"], key=lambda f: f["part"])]
    assert parts == [["k0", "k1"], ["k2"], ["k3"]]


def test_sparse_and_meta_tensors_are_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match=r"'s' is a torch.sparse_coo tensor: .*to_dense"):
        distload.save_sharded({"s": torch.eye(3).to_sparse(), "w": torch.ones(2)}, str(tmp_path / "a"))
    with pytest.raises(ConfigError, match=r"'m' is on the meta device and has no data"):
        distload.save_sharded({"m": torch.empty(3, device="meta")}, str(tmp_path / "b"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before any write


def test_part_splitting_llama(resharded):
    for out in resharded[0].values():
        assert_parts_respect_limit(out, 16 * 1024)


def test_files_on_disk_respect_max_file_size(resharded):
    """What the limit bounds is a part's tensor bytes (vLLM's rule); the header comes on top."""
    limit = 16 * 1024
    out = resharded[0][4]
    for f in read_manifest_json(out)["files"]:
        if len(f["tensors"]) > 1:
            infos = read_local_header(os.path.join(out, f["name"])).tensors
            assert sum(info.nbytes for info in infos) <= limit, f["name"]


def test_cli_save_sharded(source, resharded, tmp_path):
    src, _ = source
    out = str(tmp_path / "cli-tp2")
    result = run_distload(["reshard", src, out, "--tensor-parallel-size", "2",
                           "--max-file-size", str(16 * 1024)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "replicated because no rule of the sharding spec matched them" in result.stdout
    for name in UNMATCHED:
        assert name in result.stdout
    assert "for 2 rank(s)" in result.stdout
    assert "copied: config.json, generation_config.json, tokenizer.json" in result.stdout
    # the CLI writes the very same files as the API
    api = resharded[0][2]
    assert shard_names(out) == shard_names(api)
    for name in shard_names(out):
        assert sha256(os.path.join(out, name)) == sha256(os.path.join(api, name)), name
    assert read_manifest_json(out)["replicated_unmatched"] == sorted(UNMATCHED)


@pytest.mark.slow
def test_cli_save_sharded_with_plan_file_and_pattern(source, tmp_path):
    src, state = source
    plan_path = tmp_path / "plan.json"
    plan = {"name": "rows-only", "rules": [{"match": "*.q_proj.weight", "split": 0},
                                            {"match": "*", "replicate": True}]}
    plan_path.write_text(json.dumps(plan))
    out = str(tmp_path / "out")
    pattern = "w_{part}_r{rank}.safetensors"
    result = run_distload(["reshard", src, out, "-tp", "2", "--sharding", str(plan_path),
                           "--file-pattern", pattern])
    assert result.returncode == 0, result.stdout + result.stderr
    m = read_manifest_json(out)
    assert m["sharding"] == plan and m["pattern"] == pattern and m["replicated_unmatched"] == []
    assert shard_names(out) == sorted(pattern.format(rank=r, part=0) for r in range(2))
    r1 = load_file(os.path.join(out, pattern.format(rank=1, part=0)))
    q = state["model.layers.2.self_attn.q_proj.weight"]
    assert torch.equal(r1["model.layers.2.self_attn.q_proj.weight"], q[q.shape[0] // 2:])
    assert torch.equal(r1["model.layers.2.self_attn.o_proj.weight"], state["model.layers.2.self_attn.o_proj.weight"])


# -- offline reshard: refusals ---------------------------------------------------------------

def test_output_already_holding_a_checkpoint_is_refused(resharded, source, tmp_path):
    src, _ = source
    out = copy_of(resharded[0][2], tmp_path)
    before = {n: sha256(os.path.join(out, n)) for n in os.listdir(out)}
    with pytest.raises(CheckpointError) as err:
        reshard(src, out, 2)
    assert "already holds a pre-sharded checkpoint" in str(err.value) and out in str(err.value)
    assert {n: sha256(os.path.join(out, n)) for n in os.listdir(out)} == before  # untouched, no marker
    # shard files without a manifest (written by vLLM) are refused too
    vllm = str(tmp_path / "vllm")
    write_sharded(vllm, world_size=2, parts=1)
    with pytest.raises(CheckpointError, match="already holds a pre-sharded checkpoint"):
        reshard(src, vllm, 2)
    assert not os.path.exists(os.path.join(vllm, SAVING_MARKER))
    # and through the CLI
    result = run_distload(["reshard", src, out, "--tensor-parallel-size", "2"])
    assert result.returncode == 1
    assert "already holds a pre-sharded checkpoint" in result.stderr


def test_already_sharded_source_is_refused(resharded, tmp_path):
    out = str(tmp_path / "out")
    with pytest.raises(CheckpointError) as err:
        reshard(resharded[0][2], out, 4)
    assert "already a pre-sharded (per-rank) checkpoint" in str(err.value)
    assert not os.path.exists(out)
    vllm = str(tmp_path / "vllm")
    write_sharded(vllm, world_size=2, parts=1)
    with pytest.raises(CheckpointError, match=r"already a pre-sharded \(per-rank\) checkpoint"):
        reshard(vllm, out, 1)
    assert not os.path.exists(out)


def test_output_equal_to_source_is_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    save_file(llama_state(layers=1), str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(CONFIG))
    before = sorted(os.listdir(src))
    for output in (str(src), str(src) + "/", os.path.join(str(src), ".")):
        with pytest.raises(ConfigError, match="must differ from the source"):
            reshard(str(src), output, 2)
    with pytest.raises(ConfigError, match="must differ from the source"):
        reshard(str(src / "model.safetensors"), str(src), 2)
    assert sorted(os.listdir(src)) == before


@pytest.mark.slow
@pytest.mark.parametrize("pattern", [
    "model-rank-{rank}.safetensors",          # no {part}
    "model-part-{part}.safetensors",          # no {rank}
    "model-{rank}-{part:05d}.safetensors",    # format spec
    "model-{rank}-{part}-{epoch}.safetensors",  # another field
    "sub/model-{rank}-{part}.safetensors",    # a path
    "model-{rank-{part}.safetensors",         # not a valid format string
])
def test_bad_file_pattern_cli(source, tmp_path, pattern):
    src, _ = source
    out = str(tmp_path / "out")
    with pytest.raises(ConfigError, match="--file-pattern"):
        reshard(src, out, 2, pattern=pattern)
    assert not os.path.exists(out)
    if pattern == "model-rank-{rank}.safetensors":  # one CLI run is enough
        result = run_distload(["reshard", src, out, "-tp", "2", "--file-pattern", pattern])
        assert result.returncode == 1
        # An offline command names no rank (it runs in one process).
        assert result.stderr.startswith("distload: error: ") and "--file-pattern" in result.stderr
        assert pattern in result.stderr
        assert not os.path.exists(out)


def test_output_that_is_a_file_is_a_clear_error(source, tmp_path):
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"not a folder")
    with pytest.raises(distload.DistloadError, match="out.safetensors"):
        reshard(source[0], str(out), 2)


@pytest.mark.parametrize("kwargs,needle", [
    ({"tensor_parallel_size": 0}, "--tensor-parallel-size"),
    ({"tensor_parallel_size": True}, "--tensor-parallel-size"),
    ({"tensor_parallel_size": 2, "max_file_size": 0}, "--max-file-size"),
    ({"tensor_parallel_size": 2, "max_file_size": -5}, "--max-file-size"),
    ({}, "tensor_parallel_size .* is required"),
    ({"tensor_parallel_size": 2, "world_size": 2}, "world_size is its old name"),
])
def test_bad_save_arguments(source, tmp_path, kwargs, needle):
    out = str(tmp_path / "out")
    with pytest.raises(ConfigError, match=needle):
        reshard(source[0], out, **kwargs)
    assert not os.path.exists(out)


def test_the_old_names_still_work_and_say_so(source, tmp_path, capsys):
    """reshard(world_size=) and the CLI's save-sharded are the old spellings of one operation."""
    with pytest.warns(DeprecationWarning, match="old name of tensor_parallel_size"):
        old = reshard(source[0], str(tmp_path / "old"), world_size=2)
    new = reshard(source[0], str(tmp_path / "new"), 2)
    assert old.world_size == new.world_size == 2
    for name in sorted(os.listdir(tmp_path / "new")):
        if name.endswith(".safetensors"):
            assert (tmp_path / "old" / name).read_bytes() == (tmp_path / "new" / name).read_bytes()
    capsys.readouterr()
    assert cli_main(["save-sharded", source[0], str(tmp_path / "cli"), "-tp", "2"]) == 0
    assert "'save-sharded' is the old name of 'reshard'" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path / "cli")) == sorted(os.listdir(tmp_path / "new"))


def test_indivisible_dimension_writes_nothing(source, tmp_path):
    src, _ = source
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as err:
        reshard(src, str(out), 3)
    msg = str(err.value)
    assert "cannot be split over 3 ranks" in msg and "not divisible by 3" in msg
    # names the tensor and its shape (the first one in file order that fails)
    assert any(f"'{name}' with shape {list(t.shape)}" in msg for name, t in source[1].items()), msg
    assert not out.exists()
    # an existing empty folder stays empty, through the CLI too
    out.mkdir()
    result = run_distload(["reshard", src, str(out), "--tensor-parallel-size", "6"])
    assert result.returncode == 1
    assert "distload: error: " in result.stderr and "cannot be split over 6 ranks" in result.stderr
    assert "on rank" not in result.stderr
    assert os.listdir(out) == []


def test_indivisible_message_names_tensor_shape_and_n(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    save_file({"model.layers.0.mlp.down_proj.weight": torch.zeros(8, 10)}, str(src / "model.safetensors"))
    with pytest.raises(ConfigError) as err:
        reshard(str(src), str(tmp_path / "out"), 4)
    msg = str(err.value)
    assert "'model.layers.0.mlp.down_proj.weight'" in msg and "[8, 10]" in msg
    assert "4 ranks" in msg and "dim 1 (10)" in msg
    assert not (tmp_path / "out").exists()


def test_missing_qkv_config_is_a_clear_error(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    save_file({"model.layers.0.self_attn.qkv_proj.weight": torch.zeros(16, 8)}, str(src / "model.safetensors"))
    with pytest.raises(ConfigError) as err:
        reshard(str(src), str(tmp_path / "out"), 2)
    assert "config.json" in str(err.value) and "qkv_proj.weight" in str(err.value)
    assert not (tmp_path / "out").exists()


# -- a save that dies midway ------------------------------------------------------------------

KILL_SCRIPT = """
import os, signal, sys
import distload.checkpoints.reshard as reshard_module

calls = [0]
real = reshard_module.take_shard

def take_shard(*args, **kwargs):
    calls[0] += 1
    if calls[0] == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)

reshard_module.take_shard = take_shard
reshard_module.reshard(sys.argv[1], sys.argv[2], 2, max_file_size=4096)
print("finished")
"""


def assert_incomplete(out: str) -> None:
    names = os.listdir(out)
    assert MANIFEST_NAME not in names
    assert SAVING_MARKER in names
    for fmt in ("sharded_state", "runai_streamer_sharded", "auto"):
        with pytest.raises(CheckpointError) as err:
            distload.load(out, fmt)
        assert "incomplete" in str(err.value) and SAVING_MARKER in str(err.value), fmt


@pytest.mark.slow
def test_save_killed_midway_is_incomplete(source, tmp_path):
    src, state = source
    out = str(tmp_path / "out")
    script = write_script(tmp_path, "kill.py", KILL_SCRIPT)
    n_calls = 2 * len(state)  # take_shard runs once per tensor per rank
    result = run_python([script, src, out, str(n_calls * 3 // 4)], timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stdout + result.stderr
    assert "finished" not in result.stdout
    committed = shard_names(out)
    assert committed, "the kill came late enough for some parts to be committed"
    assert len(committed) < len(shard_names(full_reshard(src, tmp_path)))
    # the parts being written were under temporary names; every file under a real name is whole
    assert [n for n in os.listdir(out) if n.endswith(".distload-tmp")]
    for name in committed:
        load_file(os.path.join(out, name))
    assert_incomplete(out)
    # verify and inspect say so too, and a new save into the folder is refused
    verify = run_distload(["verify", out])
    assert verify.returncode == 1 and "incomplete" in verify.stderr
    assert cli_main(["inspect", out]) == 1
    with pytest.raises(CheckpointError, match="already holds"):
        reshard(src, out, 2)


def full_reshard(src: str, tmp_path) -> str:
    full = str(tmp_path / "full")
    reshard(src, full, 2, max_file_size=4096)
    return full


def test_save_failing_midway_in_process(source, tmp_path, monkeypatch):
    import distload.checkpoints.writer as writer_module

    src, _ = source
    out = str(tmp_path / "out")
    real = writer_module.SafetensorsWriter.write
    calls = [0]

    def failing_write(self, name, tensor):
        calls[0] += 1
        if calls[0] == 40:
            raise OSError(28, "No space left on device (injected)")
        return real(self, name, tensor)

    monkeypatch.setattr(writer_module.SafetensorsWriter, "write", failing_write)
    with pytest.raises(OSError, match="injected"):
        reshard(src, out, 2, max_file_size=4096)
    # temporary files are cleaned up, committed parts may stay, but nothing loads as complete
    assert not [n for n in os.listdir(out) if n.endswith(".distload-tmp")]
    assert_incomplete(out)


# -- load side --------------------------------------------------------------------------------

def test_load_world_size_mismatch_single_process(resharded):
    out = resharded[0][2]
    with pytest.raises(ShardLayoutError) as err:
        distload.load(out, "runai_streamer_sharded")
    msg = str(err.value)
    assert "saved for 2 ranks, but this job has 1" in msg
    assert "python -m distload reshard" in msg and "--tensor-parallel-size 1" in msg
    result = run_distload(["load", out, "--load-format", "runai_streamer_sharded", "--no-progress"])
    assert result.returncode == 1
    assert "error on rank 0" in result.stderr and "saved for 2 ranks, but this job has 1" in result.stderr
    assert "--tensor-parallel-size 1" in result.stderr


def vllm_tp1(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What vLLM holds at TP 1: the source, with the vocabulary padded to a multiple of 64 rows."""
    padded = -(-VOCAB // 64) * 64
    out = dict(state)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        t = state[name]
        out[name] = torch.cat([t, torch.zeros((padded - t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype)])
    return out


def test_load_good_checkpoint_single_process(resharded, source):
    out = resharded[0][1]
    for fmt in ("sharded_state", "runai_streamer_sharded", "auto"):
        loaded = distload.load(out, fmt)
        assert sorted(loaded) == sorted(source[1])
        for name, want in vllm_tp1(source[1]).items():
            assert raw(loaded[name]) == raw(want) and loaded[name].dtype == want.dtype, (fmt, name)


@pytest.mark.parametrize("fmt", ["sharded_state", "runai_streamer_sharded"])
def test_load_rank_file_missing(resharded, tmp_path, fmt):
    out = copy_of(resharded[0][1], tmp_path)
    victim = PATTERN.format(rank=0, part=1)
    os.unlink(os.path.join(out, victim))
    with pytest.raises(CheckpointError) as err:
        distload.load(out, fmt)
    msg = str(err.value)
    assert f"{victim} is missing" in msg and "rank 0" in msg and "verify" in msg


@pytest.mark.parametrize("change", ["append", "truncate"])
def test_load_rank_file_wrong_size(resharded, tmp_path, change):
    out = copy_of(resharded[0][1], tmp_path)
    victim = PATTERN.format(rank=0, part=2)
    path = os.path.join(out, victim)
    size = os.path.getsize(path)
    if change == "append":
        with open(path, "ab") as f:
            f.write(b"\0" * 8)
        new = size + 8
    else:
        os.truncate(path, size - 3)
        new = size - 3
    with pytest.raises(CheckpointError) as err:
        distload.load(out, "sharded_state")
    msg = str(err.value)
    assert f"{victim} is {new} bytes, the manifest says {size}" in msg


def test_load_manifest_key_missing_from_files(resharded, tmp_path):
    out = copy_of(resharded[0][1], tmp_path)
    m = read_manifest_json(out)
    m["files"][0]["tensors"].append("model.layers.7.ghost.weight")
    with open(os.path.join(out, MANIFEST_NAME), "w") as f:
        json.dump(m, f)
    for fmt in ("sharded_state", "runai_streamer_sharded"):
        with pytest.raises(CheckpointError) as err:
            distload.load(out, fmt)
        # vLLM's exact words first: a tuple of the keys.
        assert str(err.value).startswith("Missing keys ('model.layers.7.ghost.weight',) in loaded state! ("), str(err.value)


def test_load_without_manifest(resharded, source, tmp_path):
    out = copy_of(resharded[0][1], tmp_path)
    os.unlink(os.path.join(out, MANIFEST_NAME))
    loaded = distload.load(out, "sharded_state")
    assert sorted(loaded) == sorted(source[1])
    for name, want in vllm_tp1(source[1]).items():
        assert raw(loaded[name]) == raw(want), name
    # without a manifest the world size still comes from the file names
    out2 = copy_of(resharded[0][2], tmp_path, "copy2")
    os.unlink(os.path.join(out2, MANIFEST_NAME))
    with pytest.raises(ShardLayoutError, match="saved for 2 ranks"):
        distload.load(out2, "sharded_state")


def test_load_pattern_differs_from_manifest(resharded):
    out = resharded[0][1]
    with pytest.raises(ShardLayoutError) as err:
        distload.load(out, "sharded_state", {"pattern": "shard-{rank}-{part}.safetensors"})
    msg = str(err.value)
    assert PATTERN in msg and "shard-{rank}-{part}.safetensors" in msg and MANIFEST_NAME in msg
    # the saved pattern itself is fine
    assert len(distload.load(out, "sharded_state", {"pattern": PATTERN})) > 0


def test_load_custom_pattern_from_manifest(source, tmp_path):
    out = str(tmp_path / "out")
    pattern = "w_{part}_r{rank}.safetensors"
    reshard(source[0], out, 1, pattern=pattern, max_file_size=8192)
    loaded = distload.load(out, "runai_streamer_sharded")  # no pattern given: the manifest's
    assert sorted(loaded) == sorted(source[1])


# -- verify -----------------------------------------------------------------------------------

def test_verify_ok(resharded):
    out = resharded[0][4]
    result = run_distload(["verify", out])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout and "for 4 rank(s)" in result.stdout


def test_verify_flipped_byte(resharded, tmp_path):
    out = copy_of(resharded[0][2], tmp_path)
    victim = PATTERN.format(rank=1, part=0)
    path = os.path.join(out, victim)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 5)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))
    result = run_distload(["verify", out])
    assert result.returncode == 1
    assert "1 problem(s)" in result.stdout
    line = [ln for ln in result.stdout.splitlines() if victim in ln]
    assert len(line) == 1 and "SHA-256" in line[0] and "rank 1" in line[0], result.stdout
    # the size is unchanged (a load's size check passes): only verify catches this
    sizes = {f["name"]: f["size"] for f in read_manifest_json(out)["files"]}
    assert os.path.getsize(path) == sizes[victim]


def test_verify_missing_and_wrong_size(resharded, tmp_path, capsys):
    out = copy_of(resharded[0][2], tmp_path)
    missing, resized = PATTERN.format(rank=0, part=1), PATTERN.format(rank=1, part=2)
    os.unlink(os.path.join(out, missing))
    with open(os.path.join(out, resized), "ab") as f:
        f.write(b"xx")
    assert cli_main(["verify", out]) == 1
    text = capsys.readouterr().out
    assert "2 problem(s)" in text
    assert f"{missing} (rank 0): missing" in text
    assert f"{resized} (rank 1):" in text and "the manifest says" in text


def test_verify_without_manifest(resharded, tmp_path, capsys):
    out = copy_of(resharded[0][2], tmp_path)
    os.unlink(os.path.join(out, MANIFEST_NAME))
    assert cli_main(["verify", out]) == 1
    assert f"no {MANIFEST_NAME}" in capsys.readouterr().out


# -- inspect ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_inspect_whole_source(source):
    src, state = source
    result = run_distload(["inspect", src, "--json"])
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["layout"] == "whole" and info["manifest"] is False
    assert info["num_tensors"] == len(state)
    assert info["nbytes"] == sum(t.numel() * t.element_size() for t in state.values())
    assert sorted(os.path.basename(f["path"]) for f in info["files"]) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]  # index honoured
    codes = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
             torch.float8_e4m3fn: "F8_E4M3", torch.int8: "I8"}
    want = {}
    for t in state.values():
        d = want.setdefault(codes[t.dtype], {"num_tensors": 0, "nbytes": 0})
        d["num_tensors"] += 1
        d["nbytes"] += t.numel() * t.element_size()
    assert info["dtypes"] == want
    text = run_distload(["inspect", src]).stdout
    assert "whole" in text and f"{len(state)} tensors" in text


def test_inspect_sharded_output(resharded, source, tmp_path, capsys):
    out = resharded[0][4]
    assert cli_main(["inspect", out, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layout"] == "sharded" and info["saved_world_size"] == 4 and info["manifest"] is True
    assert info["ranks_found"] == [0, 1, 2, 3] and info["pattern"] == PATTERN
    assert info["num_tensors"] == 4 * len(source[1])
    assert info["nbytes"] == sum(tensor_bytes_of(os.path.join(out, n)) for n in shard_names(out))
    assert sorted(os.path.basename(f["path"]) for f in info["files"]) == shard_names(out)
    assert cli_main(["inspect", out]) == 0
    text = capsys.readouterr().out
    assert "pre-sharded for 4 rank(s)" in text and "with a distload manifest" in text
    # without the manifest: still sharded, world size from the names
    copy = copy_of(resharded[0][2], tmp_path)
    os.unlink(os.path.join(copy, MANIFEST_NAME))
    assert cli_main(["inspect", copy, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layout"] == "sharded" and info["saved_world_size"] == 2 and info["manifest"] is False


# -- save from a running job: one process -----------------------------------------------------

def job_state(rank: int) -> dict[str, torch.Tensor]:
    """A rank's state: every dtype, tied embeddings, a scale inside a bigger buffer, a
    non-contiguous view, a 0-d and an empty tensor, and a few larger tensors for parts."""
    g = torch.Generator().manual_seed(50 + rank)
    state: dict[str, torch.Tensor] = {}
    for i, dt in enumerate([torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn,
                            torch.float8_e5m2, torch.int8, torch.int64]):
        state[f"layers.{i}.weight"] = _values((6 + rank, 4), dt, g) if dt != torch.int64 else \
            torch.randint(-2**40, 2**40, (5,), generator=g)
    state[f"only_on_rank{rank}.bias"] = torch.full((3,), float(rank))
    state["mask"] = torch.randn(7, generator=g) > 0
    emb = torch.randn(16, 8, generator=g).to(torch.bfloat16)
    state["model.embed_tokens.weight"] = emb
    state["lm_head.weight"] = emb.detach()  # what state_dict() gives for tied weights
    buf = torch.randn(64, generator=g)
    state["quant.buffer"] = buf
    state["quant.scale"] = buf[0:4]     # inside the buffer: saved as a view of it, as vLLM drops it
    state["quant.zero"] = buf[4:8]
    state["transposed"] = torch.randn(4, 6, generator=g).t()
    state["scalar"] = torch.tensor(3.5 + rank)
    state["empty"] = torch.zeros(0, 3)
    for i in range(3):
        state[f"big.{i}"] = torch.randn(1024, generator=g)  # 4 KiB each
    return state


def test_save_sharded_single_process(tmp_path, source):
    state = job_state(0)
    out = str(tmp_path / "out")
    manifest = save_sharded(state, out, max_file_size=5000, metadata_from=source[0])
    assert manifest.world_size == 1
    m = read_manifest_json(out)
    assert m["world_size"] == 1 and m["pattern"] == PATTERN and m["sharding"] is None
    # tied: one of the two names is written, the other is an alias
    written = [t for f in m["files"] for t in f["tensors"]]
    on_disk = [t.name for n in shard_names(out) for t in read_local_header(os.path.join(out, n)).tensors]
    assert sorted(written) == sorted(on_disk)
    tied = {"model.embed_tokens.weight", "lm_head.weight"}
    assert len(tied & set(on_disk)) == 1
    # vLLM's rule: what lies inside another saved tensor is not written, but recorded as a view.
    assert "quant.buffer" in on_disk and not {"quant.scale", "quant.zero"} & set(on_disk)
    assert m["views"]["0"] == {
        "quant.scale": {"of": "quant.buffer", "offset": 0, "shape": [4], "stride": [1], "dtype": "F32"},
        "quant.zero": {"of": "quant.buffer", "offset": 16, "shape": [4], "stride": [1], "dtype": "F32"}}
    assert len(m["aliases"]["0"]) == 1 and set(m["aliases"]["0"].items()) <= {
        ("model.embed_tokens.weight", "lm_head.weight"), ("lm_head.weight", "model.embed_tokens.weight")}
    assert len(m["files"]) >= 3
    assert_parts_respect_limit(out, 5000)
    for f in m["files"]:
        assert f["sha256"] == sha256(os.path.join(out, f["name"])) and f["size"] == os.path.getsize(os.path.join(out, f["name"]))
    for name in METADATA_FILES:
        assert os.path.exists(os.path.join(out, name))
    assert SAVING_MARKER not in os.listdir(out)

    for fmt in ("sharded_state", "runai_streamer_sharded"):
        loaded = distload.load(out, fmt)
        assert sorted(loaded) == sorted(state), fmt
        for name, want in state.items():
            assert loaded[name].dtype == want.dtype and tuple(loaded[name].shape) == tuple(want.shape), name
            assert raw(loaded[name]) == raw(want), (fmt, name)
        assert loaded["lm_head.weight"] is loaded["model.embed_tokens.weight"], fmt
        buffer = loaded["quant.buffer"]  # the views share the buffer's memory, as in the model
        assert loaded["quant.zero"].data_ptr() == buffer.data_ptr() + 16, fmt
        assert loaded["quant.scale"].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr(), fmt

    # a second save into the same folder is refused and changes nothing
    before = {n: sha256(os.path.join(out, n)) for n in os.listdir(out)}
    with pytest.raises(CheckpointError, match="already holds"):
        save_sharded(state, out)
    assert {n: sha256(os.path.join(out, n)) for n in os.listdir(out)} == before


def test_save_sharded_parts_larger_tensor_alone(tmp_path):
    state = {"a": torch.zeros(100), "b": torch.zeros(2000), "c": torch.zeros(100), "d": torch.zeros(100)}
    out = str(tmp_path / "out")
    save_sharded(state, out, max_file_size=1000)  # b is 8000 bytes
    m = read_manifest_json(out)
    assert [f["tensors"] for f in sorted(m["files"], key=lambda f: f["part"])] == [["a"], ["b"], ["c", "d"]]


def test_save_sharded_empty_state(tmp_path):
    out = str(tmp_path / "out")
    save_sharded({}, out)
    assert shard_names(out) == [PATTERN.format(rank=0, part=0)]
    assert distload.load(out, "sharded_state") == {}


def test_save_sharded_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match="--file-pattern"):
        save_sharded({"a": torch.zeros(1)}, str(tmp_path / "o"), pattern="x-{rank}.safetensors")
    with pytest.raises(ConfigError, match="not a tensor"):
        save_sharded({"a": [1, 2]}, str(tmp_path / "o2"))
    assert not os.path.exists(str(tmp_path / "o"))


# -- memory bound of the offline reshard ------------------------------------------------------

GEN_SCRIPT = """
import os, sys, json
import torch
from safetensors.torch import save_file

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
H, I, V, L = 2048, 4096, 8192, 6
bf = torch.bfloat16
s = {"model.embed_tokens.weight": torch.full((V, H), 1.0, dtype=bf),       # 32 MiB
     "lm_head.weight": torch.full((V, H), 2.0, dtype=bf)}                  # 32 MiB
for l in range(L):
    p = f"model.layers.{l}"
    s[f"{p}.self_attn.q_proj.weight"] = torch.full((H, H), l, dtype=bf)
    s[f"{p}.self_attn.k_proj.weight"] = torch.full((512, H), l, dtype=bf)
    s[f"{p}.self_attn.v_proj.weight"] = torch.full((512, H), l, dtype=bf)
    s[f"{p}.self_attn.o_proj.weight"] = torch.full((H, H), l, dtype=bf)     # row-parallel: copies
    s[f"{p}.mlp.gate_up_proj.weight"] = torch.full((2 * I, H), l, dtype=bf)  # 32 MiB, fused
    s[f"{p}.mlp.down_proj.weight"] = torch.full((H, I), l, dtype=bf)        # 16 MiB, row-parallel
    s[f"{p}.input_layernorm.weight"] = torch.ones(H, dtype=bf)
names = sorted(s)
save_file({n: s[n] for n in names[: len(names) // 2]}, os.path.join(out, "model-00001-of-00002.safetensors"))
save_file({n: s[n] for n in names[len(names) // 2:]}, os.path.join(out, "model-00002-of-00002.safetensors"))
with open(os.path.join(out, "config.json"), "w") as f:  # 16 heads of 128, 4 KV heads
    json.dump({"hidden_size": H, "num_attention_heads": 16, "num_key_value_heads": 4}, f)
print(json.dumps({"total": sum(t.numel() * t.element_size() for t in s.values()),
                  "largest": max(t.numel() * t.element_size() for t in s.values())}))
"""

MEASURE_SCRIPT = """
import json, resource, sys, threading, time
import psutil
import torch
import distload.checkpoints.save
from distload.loading.report import peak_rss_bytes

proc = psutil.Process()
baseline = proc.memory_info().rss
peak = [baseline]
done = threading.Event()

def sample():
    while not done.is_set():
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.002)

thread = threading.Thread(target=sample, daemon=True)
thread.start()
report = distload.reshard(sys.argv[1], sys.argv[2], 2)
done.set()
thread.join()
# VmHWM, not getrusage's ru_maxrss: ru_maxrss survives exec and would report the test runner's peak
maxrss = peak_rss_bytes()
print(json.dumps({"baseline": baseline, "sampled_peak": peak[0], "maxrss": maxrss,
                  "nbytes_read": report.nbytes_read}))
"""


@pytest.mark.slow
def test_reshard_memory_stays_near_the_largest_tensor(tmp_path):
    pytest.importorskip("psutil")
    src, out = str(tmp_path / "big"), str(tmp_path / "big-tp2")
    gen = run_python(["-c", GEN_SCRIPT, src], timeout=240)
    assert gen.returncode == 0, gen.stderr
    sizes = json.loads(gen.stdout)
    assert 400 * 2**20 <= sizes["total"] <= 600 * 2**20 and sizes["largest"] == 32 * 2**20
    result = run_python(["-c", MEASURE_SCRIPT, src, out], timeout=240)
    assert result.returncode == 0, result.stderr
    mem = json.loads(result.stdout)
    assert mem["nbytes_read"] == sizes["total"]
    growth = max(mem["sampled_peak"], mem["maxrss"]) - mem["baseline"]
    limit = 4 * sizes["largest"] + 100 * 2**20
    assert growth < limit, f"peak RSS grew by {growth / 2**20:.0f} MiB (limit {limit / 2**20:.0f} MiB)"
    assert growth < sizes["total"] / 2
    # and the output is right: spot-check a row-parallel and a fused tensor on rank 1
    r1 = load_file(os.path.join(out, PATTERN.format(rank=1, part=0)))
    assert tuple(r1["model.layers.5.mlp.down_proj.weight"].shape) == (2048, 2048)
    assert bool((r1["model.layers.5.mlp.down_proj.weight"] == 5).all())
    assert tuple(r1["model.layers.5.mlp.gate_up_proj.weight"].shape) == (4096, 2048)


# -- under torchrun ---------------------------------------------------------------------------

LOAD_SCRIPT = """
import sys
import torch
from safetensors.torch import save_file
import distload

out, dest = sys.argv[1], sys.argv[2]
with distload.WorkerGroup() as group:
    for fmt in ("runai_streamer_sharded", "sharded_state"):
        state = distload.load(out, fmt, group=group)
        save_file({k: v.detach().clone().contiguous() for k, v in state.items()},
                  f"{dest}/{fmt}-rank{group.rank}.safetensors")
"""


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("n", [1, 2, 4])
def test_reshard_load_reassemble_under_torchrun(resharded, source, tmp_path, n):
    out = resharded[0][n]
    script = write_script(tmp_path, "load.py", LOAD_SCRIPT)
    result = run_python([script, out, str(tmp_path)], nproc=n, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr[-6000:]
    for fmt in ("runai_streamer_sharded", "sharded_state"):
        per_rank = [load_file(str(tmp_path / f"{fmt}-rank{r}.safetensors")) for r in range(n)]
        check_reassembly(out, source[1], per_rank)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("n,fmt", [(2, "sharded_state"), (4, "runai_streamer_sharded")])
def test_cli_load_resharded(resharded, tmp_path, n, fmt):
    out = resharded[0][n]
    report_path = str(tmp_path / "report.json")
    result = run_distload(["load", out, "--load-format", fmt, "--report-json", report_path,
                           "--no-progress"], nproc=n, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr[-6000:]
    report = read_report(report_path)
    assert report["world_size"] == n
    for r in report["ranks"]:
        files = rank_files(out, r["rank"])
        assert r["files"] == files
        assert r["digest"] == plain_digest(files), f"rank {r['rank']}"
    assert len({r["digest"] for r in report["ranks"]}) == n


@pytest.mark.slow
@pytest.mark.dist
def test_world_size_mismatch_fails_on_every_rank(resharded):
    out = resharded[0][2]
    result = run_distload(["load", out, "--load-format", "runai_streamer_sharded", "--no-progress"],
                          nproc=4, timeout=240, env={"PET_MONITOR_INTERVAL": "1"})
    assert result.returncode != 0
    output = result.stdout + result.stderr
    for rank in range(4):  # each rank's error, or the one line for every rank where all say the same
        message = rank_error(output, rank).splitlines()[0]
        assert "saved for 2 ranks, but this job has 4" in message, message
        assert "python -m distload reshard" in message and "--tensor-parallel-size 4" in message


JOB_SCRIPT = """
import json, sys
import torch
import distload
from distload.loading.report import state_digest
from distload.checkpoints.save import save_sharded

sys.path.insert(0, sys.argv[3])
from test_save_reshard import job_state

out, dest = sys.argv[1], sys.argv[2]
with distload.WorkerGroup() as group:
    rank = group.rank
    state = job_state(rank)
    save_sharded(state, out, group=group, max_file_size=5000, metadata_from=sys.argv[4])
    result = {}
    for fmt in ("sharded_state", "runai_streamer_sharded"):
        loaded = distload.load(out, fmt, group=group)
        result[fmt] = {
            "keys": sorted(loaded),
            "digest": state_digest(loaded),
            "differ": [n for n in state if n not in loaded or loaded[n].dtype != state[n].dtype
                       or loaded[n].shape != state[n].shape
                       or not torch.equal(loaded[n].reshape(-1).view(torch.uint8),
                                          state[n].contiguous().reshape(-1).view(torch.uint8))],
            "tied_is": loaded["lm_head.weight"] is loaded["model.embed_tokens.weight"],
            "tied_ptr": loaded["lm_head.weight"].data_ptr() == loaded["model.embed_tokens.weight"].data_ptr(),
            "scale": loaded["quant.scale"].tolist(),
        }
    with open(f"{dest}/job-rank{rank}.json", "w") as f:
        json.dump(result, f)
"""


@pytest.mark.slow
@pytest.mark.dist
def test_save_sharded_from_a_running_job(tmp_path, source):
    out = str(tmp_path / "job-out")
    script = write_script(tmp_path, "job.py", JOB_SCRIPT)
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    result = run_python([script, out, str(tmp_path), tests_dir, source[0]], nproc=2, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr[-6000:]
    m = read_manifest_json(out)
    assert m["world_size"] == 2
    for rank in range(2):
        state = job_state(rank)
        with open(tmp_path / f"job-rank{rank}.json") as f:
            got = json.load(f)
        for fmt, res in got.items():
            assert res["keys"] == sorted(state), (rank, fmt)
            assert res["differ"] == [], (rank, fmt)
            assert res["digest"] == distload.state_digest(state), (rank, fmt)
            assert res["tied_is"] and res["tied_ptr"], (rank, fmt)
            assert res["scale"] == state["quant.buffer"][0:4].tolist()
        # the files: each rank's own values, tied written once, the buffer's views not at all
        files = rank_files(out, rank)
        assert len(files) >= 3
        on_disk = plain_read(files)
        assert len({"lm_head.weight", "model.embed_tokens.weight"} & set(on_disk)) == 1
        assert {"quant.buffer", f"only_on_rank{rank}.bias"} <= set(on_disk)
        assert not {"quant.scale", "quant.zero"} & set(on_disk)
        assert set(m["views"][str(rank)]) == {"quant.scale", "quant.zero"}
        for name, t in on_disk.items():
            assert raw(t) == raw(state[name]), (rank, name)
        assert set(m["aliases"][str(rank)]) | set(m["aliases"][str(rank)].values()) == {
            "lm_head.weight", "model.embed_tokens.weight"}
    assert_parts_respect_limit(out, 5000)
    assert os.path.exists(os.path.join(out, "config.json"))
    assert SAVING_MARKER not in os.listdir(out)


def test_sub_tensors_follow_vllms_rule_and_come_back_as_views(tmp_path):
    """As vLLM's _filter_subtensors: inside a larger contiguous tensor -> dropped; the same bytes
    under two names and dtypes -> the smaller name kept; a non-contiguous container covers
    nothing; a non-contiguous tensor on its own is written. Every dropped one loads as a view."""
    from distload.checkpoints.save import find_aliases

    base = torch.arange(24, dtype=torch.float32)
    grid = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"a.base": base, "b.as_bytes": base.view(torch.uint8), "c.rows": base.view(6, 4)[1:3],
             "d.column": base.view(6, 4)[:, 1], "e.grid_t": grid.t(), "f.inside_grid_t": grid.t()[0]}
    unique, aliases, views = find_aliases(state)
    assert aliases == {}
    assert sorted(unique) == ["a.base", "e.grid_t", "f.inside_grid_t"]  # grid.t() covers nothing
    assert views["b.as_bytes"].of == "a.base" and views["b.as_bytes"].dtype == "U8"
    assert (views["c.rows"].offset, views["c.rows"].shape) == (16, (2, 4))
    assert (views["d.column"].offset, views["d.column"].stride) == (4, (4,))
    out = str(tmp_path / "out")
    distload.save_sharded(state, out)
    loaded = distload.load(out, "sharded_state", device="cpu")
    for name, want in state.items():
        assert loaded[name].dtype == want.dtype and loaded[name].shape == want.shape, name
        assert raw(loaded[name]) == raw(want), name
    loaded["a.base"][5] = -1.0  # one memory, as in the model saved
    assert loaded["c.rows"][0, 1].item() == -1.0 and loaded["d.column"][1].item() == -1.0


@pytest.mark.parametrize("damage", [{"shape": [-2]}, {"stride": [1, 1]}, {"dtype": "F2"}, {"offset": True},
                                    {"of": None}])
def test_a_damaged_view_is_a_corrupt_manifest(tmp_path, damage):
    base = torch.arange(8.0)
    out = tmp_path / "out"
    distload.save_sharded({"base": base, "head": base[:2]}, str(out))
    manifest = json.loads((out / "distload.json").read_text())
    manifest["views"]["0"]["head"].update(damage)
    (out / "distload.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"corrupt manifest .*view 'head' is malformed"):
        distload.load(str(out), "sharded_state", device="cpu")
