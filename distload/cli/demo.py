"""``python -m distload demo``: the main job on an embedded default, no checkpoint needed.

Writes a small Llama-shaped checkpoint (bf16, whole as two files with an index, and pre-sharded
for the demo's rank count) into a folder it keeps (``--dir``, else a new temporary folder, named
at the end with how to remove it), then loads it under torchrun with every format this machine
supports and checks each rank's digest against a plain safetensors read. Every load runs in one
torchrun job (``python -m distload.cli.demo``, the worker at the end of this module): starting
torchrun and importing torch once per format took about ten times as long as the loads themselves.

It times nothing: a checkpoint small enough for a first command measures fixed costs (at 64 MiB
every format read 0.05-0.33x as fast as plain safetensors, where benchmarks/results/load.md, at
2 GiB, has distload's ``auto`` ahead of it in every cell), and a machine's speed takes checkpoints
of real sizes, cold caches and repeats: the benchmarks, which the demo names.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file

from distload.errors import DistloadError
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
            if line.startswith(("distload", "  ", "[distload rank 0]", "$ "))
            and (reports_kept or "report written to" not in line)]


def case_label(load_format: str, extra: str | None) -> str:
    return load_format + (" distributed" if extra else "")


def case_command(world_size: int, folder: str, load_format: str, extra: str | None) -> str:
    """The ``distload load`` command that loads one case the same way, for the user to copy."""
    return (f"$ torchrun --nproc-per-node {world_size} -m distload load {folder} --load-format {load_format}"
            + (f" --model-loader-extra-config '{extra}'" if extra else ""))


def run_demo(args: argparse.Namespace) -> int:
    cuda = torch.cuda.is_available()
    world_size = args.nproc_per_node or (torch.cuda.device_count() if cuda else 2)
    root = args.dir or tempfile.mkdtemp(prefix="distload-demo-")
    started = time.monotonic()
    print(f"distload demo: writing a ~{args.size_mib} MiB Llama-shaped checkpoint to {root}"
          + ("" if args.dir else " (--dir DIR writes it there instead)"), flush=True)
    whole, sharded = write_demo_checkpoint(root, world_size, args.size_mib)
    folders = {"whole": whole, "sharded": sharded}
    want = {kind: expected_digests(folder, world_size, kind == "sharded") for kind, folder in folders.items()}
    cases = [(kind, folders[kind], fmt, extra) for kind, fmt, extra in demo_cases(world_size, cuda)]
    plan_path, results_path = os.path.join(root, "demo-cases.json"), os.path.join(root, "demo-results.json")
    with open(plan_path, "w", encoding="utf-8") as f:
        json.dump({"cases": cases, "folders": folders, "timeout": args.case_timeout}, f)
    print(f"loading it with {len(cases)} formats on {world_size} rank(s), in one torchrun job", flush=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
           "-m", "distload.cli.demo", plan_path, results_path]
    output: list[str] = []
    try:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            deadline = time.monotonic() + args.case_timeout * (len(cases) + 1)
            assert proc.stdout is not None
            # Shown as it comes: each load's summary, as distload prints it. A hang inside a
            # collective ends at the job's timeout (--case-timeout); the deadline is the backstop.
            for line in proc.stdout:
                output.append(line)
                if shown_lines(line, reports_kept=True):  # the folder is kept
                    print(line, end="", flush=True)
                if time.monotonic() > deadline:
                    proc.kill()
                    output.append(f"timed out after {args.case_timeout * (len(cases) + 1):.0f} s\n")
            returncode = proc.wait()
    except OSError as exc:
        output.append(str(exc))
        returncode = 1
    if returncode != 0 or not os.path.exists(results_path):
        print("".join(output)[-3000:], flush=True)
        print(f"\nthe demo's torchrun job failed; checkpoints kept in {root}")
        return 1
    with open(results_path, encoding="utf-8") as f:
        results = json.load(f)
    return _print_table(results, cases, want, world_size, root, started=started)


def _folder_mib(root: str) -> float:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(root) for n in names) / 2**20


def _print_table(results: dict, cases: list, want: dict[str, list[str]], world_size: int, root: str,
                 started: float) -> int:
    rows, failed = [], 0
    for (kind, _, load_format, extra), report in zip(cases, results["reports"]):
        label = case_label(load_format, extra)
        if "error" in report:
            failed += 1
            rows.append((label, kind, "-", "FAILED: " + report["error"].splitlines()[0][:80]))
            continue
        digests = [r["digest"] for r in report["ranks"]]
        if load_format == "dummy":
            verdict = "dummy (random)"
        elif digests == want[kind]:
            verdict = "bit-identical"
        else:
            failed += 1
            verdict = "DIGEST MISMATCH"
        paths = ",".join(sorted({r["path"] for r in report["ranks"]}))
        rows.append((label, kind, paths, verdict))
    print(f"\n{'format':34} {'checkpoint':10} {'path':22}  check (every rank's digest against a plain "
          f"safetensors read of its files)")
    for row in rows:
        print(f"{row[0]:34} {row[1]:10} {row[2]:22}  {row[3]}")
    print("\nspeed: not timed here. A checkpoint this small measures fixed costs, not reads; "
          "benchmarks/results/load.md times every format against plain safetensors and its peers on a "
          "2 GiB checkpoint, 1 and 2 ranks, warm and cold (benchmarks/bench_load.py measures this machine).")
    kept = (f"the checkpoints stay in {root} ({_folder_mib(root):.0f} MiB: whole/, sharded/), for the "
            f"commands above; remove them with: rm -rf {root}")
    if failed:
        print(f"\n{failed} case(s) failed; {kept}")
        return 1
    print(f"\nevery format loaded; every real read matched a plain safetensors read bit for bit "
          f"({time.monotonic() - started:.0f} s)\n{kept}")
    return 0


# -- the worker: every case in one torchrun job ----------------------------------------------

def run_worker(plan_path: str, results_path: str) -> int:
    """Under torchrun: every case, each a ``Loader`` as ``distload load`` makes it; rank 0 prints
    each summary and writes every report."""
    import logging

    from distload.loading.loader import Loader
    from distload.workers.group import WorkerGroup

    logging.basicConfig(level=logging.WARNING, format="[distload] %(message)s")
    with open(plan_path, encoding="utf-8") as f:
        plan = json.load(f)
    with WorkerGroup(timeout_s=plan["timeout"]) as group:
        reports = []
        for kind, folder, load_format, extra in plan["cases"]:
            if group.rank == 0:
                print("\n" + case_command(group.world_size, folder, load_format, extra), flush=True)
            try:
                report = Loader(folder, load_format, extra, group=group).load(gather=True, digest=True).report
            except DistloadError as exc:  # every rank hears of it: the next case still runs
                if group.rank == 0:
                    print(f"distload: error: {exc}", flush=True)
                reports.append({"error": str(exc)})
                continue
            assert report is not None
            if group.rank == 0:
                print("\n".join(report.summary_lines()), flush=True)
            reports.append(report.to_json())
        if group.rank == 0:
            with open(results_path, "w", encoding="utf-8") as f:
                json.dump({"reports": reports}, f)
    return 0


if __name__ == "__main__":
    sys.exit(run_worker(sys.argv[1], sys.argv[2]))
