"""``python -m distload demo``: the main job on an embedded default, no checkpoint needed.

Writes a small Llama-shaped checkpoint (bf16, whole as two files with an index, and pre-sharded
for the demo's rank count), then loads it under torchrun with every format this machine supports
and checks each rank's digest against a plain safetensors read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

from distload.loading.layout import DEFAULT_SHARD_PATTERN, detect_layout
from distload.loading.report import state_digest

# (name suffix, split dim for tensor parallelism or None for replicated)
_LAYER_TENSORS = [
    ("self_attn.q_proj.weight", 0), ("self_attn.k_proj.weight", 0), ("self_attn.v_proj.weight", 0),
    ("self_attn.o_proj.weight", 1), ("mlp.gate_proj.weight", 0), ("mlp.up_proj.weight", 0),
    ("mlp.down_proj.weight", 1), ("input_layernorm.weight", None),
    ("post_attention_layernorm.weight", None),
]


def llama_shapes(hidden: int, layers: int, vocab: int) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """name -> (shape, split dim) of a small Llama-style decoder."""
    inter = hidden * 8 // 3 // 64 * 64 or 64
    kv = hidden // 4
    dims = {
        "self_attn.q_proj.weight": (hidden, hidden), "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, hidden),
        "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter), "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    shapes = {"model.embed_tokens.weight": ((vocab, hidden), 0)}
    for i in range(layers):
        for suffix, split in _LAYER_TENSORS:
            shapes[f"model.layers.{i}.{suffix}"] = (dims[suffix], split)
    shapes["model.norm.weight"] = ((hidden,), None)
    shapes["lm_head.weight"] = ((vocab, hidden), 0)
    return shapes


def llama_layers(size_mib: int, hidden: int, vocab: int, minimum: int = 2) -> int:
    """How many decoder layers of :func:`llama_shapes` make about ``size_mib`` MiB in bf16."""
    inter = hidden * 8 // 3 // 64 * 64
    per_layer = 2 * (4 * hidden * hidden // 2 + 3 * hidden * inter)
    return max(minimum, (size_mib * 2**20 - 2 * 2 * vocab * hidden) // per_layer)


def write_demo_checkpoint(root: str, world_size: int, size_mib: int = 64,
                          hidden: int = 512) -> tuple[str, str]:
    """Write ``root/whole`` (2 files + index + config) and ``root/sharded`` (per rank, 2 parts).

    ``hidden`` sets the tensor sizes: 512 gives many small tensors (a quick demo), 2048 and up
    gives the tens-of-MiB tensors of real models (what benchmarks should see).
    """
    vocab = 8192
    layers = llama_layers(size_mib, hidden, vocab)
    shapes = llama_shapes(hidden, layers, vocab)
    generator = torch.Generator().manual_seed(0)
    state = {name: (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
             for name, (shape, _) in shapes.items()}
    heads = hidden // 64  # heads of 64; k_proj/v_proj hold hidden // 4 rows: a quarter as many KV heads
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "num_attention_heads": heads,
              "num_key_value_heads": heads // 4, "head_dim": 64, "num_hidden_layers": layers,
              "vocab_size": vocab, "torch_dtype": "bfloat16"}

    whole = os.path.join(root, "whole")
    os.makedirs(whole, exist_ok=True)
    names = list(state)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, half in enumerate(halves):
        file_name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: state[n] for n in half}, os.path.join(whole, file_name), metadata={"format": "pt"})
        weight_map.update({n: file_name for n in half})
    with open(os.path.join(whole, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(whole, "config.json"), "w") as f:
        json.dump(config, f, indent=1)

    sharded = os.path.join(root, "sharded")
    os.makedirs(sharded, exist_ok=True)
    for rank in range(world_size):
        shard = {}
        for name, (_, split) in shapes.items():
            tensor = state[name]
            if split is not None:
                tensor = tensor.chunk(world_size, dim=split)[rank]
            shard[name] = tensor.contiguous()
        shard_names = list(shard)
        for part, chunk in enumerate([shard_names[: len(shard_names) // 2], shard_names[len(shard_names) // 2:]]):
            file_name = DEFAULT_SHARD_PATTERN.format(rank=rank, part=part)
            save_file({n: shard[n] for n in chunk}, os.path.join(sharded, file_name))
    shutil.copy(os.path.join(whole, "config.json"), sharded)
    return whole, sharded


def expected_digests(folder: str, world_size: int, sharded: bool) -> list[str]:
    """What each rank's digest must be: a plain safetensors read of its files."""
    def read(files: list[str]) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for path in files:
            state.update(load_file(path))
        return state

    if not sharded:
        files = sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))
        return [state_digest(read(files))] * world_size
    layout = detect_layout(folder)
    return [state_digest(read(layout.rank_paths(rank, world_size))) for rank in range(world_size)]


def demo_cases(world_size: int, cuda: bool) -> list[tuple[str, str, str | None]]:
    """(folder kind, load format, extra config) for every format this machine supports."""
    cases = [
        ("whole", "safetensors", None),
        ("whole", "runai_streamer", None),
        ("whole", "runai_streamer", '{"distributed": true}'),
        ("sharded", "sharded_state", None),
        ("sharded", "runai_streamer_sharded", None),
        ("whole", "auto", None),
        ("whole", "auto", '{"distributed": "job"}'),  # shared reads: each byte read by one rank
        ("sharded", "auto", None),
        ("whole", "dummy", None),
    ]
    if cuda:
        cases.insert(3, ("whole", "instanttensor", None))
    if world_size == 1:
        cases = [c for c in cases if c[2] is None]
    return cases


def shown_lines(output: str, reports_kept: bool) -> list[str]:
    """The lines of one load's output the demo shows: distload's summary. The reports live in a
    temporary folder removed at the end unless --dir keeps them: only then say where each one is."""
    return [line for line in output.splitlines()
            if line.startswith(("distload", "  ", "[distload rank 0]"))
            and (reports_kept or "report written to" not in line)]


def run_demo(args: argparse.Namespace) -> int:
    cuda = torch.cuda.is_available()
    world_size = args.nproc_per_node or (torch.cuda.device_count() if cuda else 2)
    root = args.dir or tempfile.mkdtemp(prefix="distload-demo-")
    print(f"distload demo: writing a ~{args.size_mib} MiB Llama-shaped checkpoint to {root}", flush=True)
    whole, sharded = write_demo_checkpoint(root, world_size, args.size_mib)
    folders = {"whole": whole, "sharded": sharded}
    want = {kind: expected_digests(folder, world_size, kind == "sharded") for kind, folder in folders.items()}
    rows, failed = [], 0
    for kind, load_format, extra in demo_cases(world_size, cuda):
        report_path = os.path.join(root, f"report-{kind}-{load_format}{'-dist' if extra else ''}.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={world_size}", "-m", "distload", "load", folders[kind],
               "--load-format", load_format, "--report-json", report_path, "--no-progress"]
        if extra:
            cmd += ["--model-loader-extra-config", extra]
        print(f"\n$ torchrun --nproc-per-node {world_size} -m distload load {folders[kind]} "
              f"--load-format {load_format}" + (f" --model-loader-extra-config '{extra}'" if extra else ""),
              flush=True)
        try:
            result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    timeout=args.case_timeout)
        except subprocess.TimeoutExpired as exc:
            result = subprocess.CompletedProcess(cmd, 124, f"{exc.output or ''}\ntimed out after "
                                                           f"{args.case_timeout}s", None)
        print("\n".join(shown_lines(result.stdout, reports_kept=bool(args.dir))), flush=True)
        if result.returncode != 0:
            failed += 1
            print(result.stdout[-3000:], flush=True)
            rows.append((load_format + (" distributed" if extra else ""), kind, "-", "-", "FAILED"))
            continue
        with open(report_path) as f:
            report = json.load(f)
        digests = [r["digest"] for r in report["ranks"]]
        if load_format == "dummy":
            verdict = "dummy (random)"
        elif digests == want[kind]:
            verdict = "bit-identical"
        else:
            failed += 1
            verdict = "DIGEST MISMATCH"
        paths = ",".join(sorted({r["path"] for r in report["ranks"]}))
        rows.append((load_format + (" distributed" if extra else ""), kind, paths,
                     f"{report['total']['gib_per_s']:.2f}", verdict))
    print(f"\n{'format':34} {'checkpoint':10} {'path':22} {'GiB/s':>7}  check")
    for row in rows:
        print(f"{row[0]:34} {row[1]:10} {row[2]:22} {row[3]:>7}  {row[4]}")
    if failed:
        print(f"\n{failed} case(s) failed; checkpoints and reports kept in {root}")
        return 1
    if not args.dir:
        shutil.rmtree(root)
    print("\nevery format loaded; every real read matched a plain safetensors read bit for bit")
    return 0
