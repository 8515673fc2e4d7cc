"""How long vLLM takes to load one checkpoint: its default loader against distload's.

    python benchmarks/bench_vllm.py                       # a 1 GiB Llama, TP 1, 2 repeats, cold
    python benchmarks/bench_vllm.py --hidden 1024 --layers 4 --repeats 1

Runs in vLLM's environment (``.vllm-venv``, made by ``bash .ci/run``; ``--python`` for another).
A random Llama (bf16) saved by transformers, and its ``distload reshard`` output for the same
TP size. In ONE run, each case an engine start (``LLM(...)``) with the model's files evicted from
the page cache first (posix_fadvise DONTNEED, no root):

- **dummy**: ``load_format="dummy"``: the engine start without reading weights (for scale: it
  fills the weights with random values, which is not free either);
- **vLLM default**: ``load_format="auto"`` on the whole checkpoint;
- **distload**: ``load_format="distload"`` on the whole checkpoint (each TP rank its slices' bytes);
- **vLLM sharded_state** and **distload, pre-sharded**: the reshard output.

Load seconds: what each loader logs as "Loading weights took" in its worker (vLLM's default and
sharded_state loaders, and distload's, the same line); medians of ``--repeats``; ratios against
vLLM default.
Results: benchmarks/results/vllm.json and vllm.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MAKE = r"""
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
out, hidden, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                     num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                     vocab_size=32000, max_position_embeddings=512)
LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
"""

DRIVE = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
def evict(folder):
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
def main():
    tp, cases, repeats = int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    import gc
    from vllm import LLM
    seconds = {}
    for _ in range(repeats):
        for name, model, fmt in cases:
            evict(model)
            start = time.perf_counter()
            llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                      max_model_len=128, max_num_seqs=4, tensor_parallel_size=tp, load_format=fmt)
            seconds.setdefault(name, []).append(time.perf_counter() - start)
            print("CASE", name, flush=True)
            del llm
            gc.collect()
    print("RESULT", json.dumps(seconds))
if __name__ == "__main__":
    main()
"""


def _loading_seconds(output: str) -> dict[str, list[float]]:
    """Each case's "Loading weights took X seconds" (vLLM's loaders and distload's log it from the
    worker, before the driver prints the case's name)."""
    found: dict[str, list[float]] = {}
    pending: list[float] = []
    for line in output.splitlines():
        match = re.search(r"Loading weights took ([0-9.]+) seconds", line)
        if match:
            pending.append(float(match.group(1)))
        elif line.startswith("CASE "):
            name = line[len("CASE "):]
            if name != "dummy":
                if not pending:
                    sys.exit(f"no 'Loading weights took' line for case {name}")
                found.setdefault(name, []).append(max(pending))  # the slowest TP rank
            pending = []
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=os.path.join(ROOT, ".vllm-venv", "bin", "python"))
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    import distload
    from bench_load import machine

    with tempfile.TemporaryDirectory(prefix="distload-vllm-", dir=os.environ.get("DISTLOAD_BENCH_DIR")) as tmp:
        whole, saved = os.path.join(tmp, "whole"), os.path.join(tmp, "saved")
        subprocess.run([args.python, "-c", MAKE, whole, str(args.hidden), str(args.layers)], check=True)
        distload.reshard(whole, saved, args.tp)
        size = sum(os.path.getsize(os.path.join(whole, n)) for n in os.listdir(whole) if n.endswith(".safetensors"))
        cases = [("dummy", whole, "dummy"), ("vLLM default", whole, "auto"), ("distload", whole, "distload"),
                 ("vLLM sharded_state", saved, "sharded_state"), ("distload, pre-sharded", saved, "distload")]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        run = subprocess.run([args.python, "-c", DRIVE, str(args.tp), json.dumps(cases), str(args.repeats)],
                             capture_output=True, text=True, env=env)
        lines = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
        if run.returncode != 0 or not lines:
            sys.exit(run.stdout[-3000:] + run.stderr[-6000:])
        seconds = json.loads(lines[0][len("RESULT "):])
        loading = _loading_seconds(run.stdout + run.stderr)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    load = {name: statistics.median(values) for name, values in loading.items()}
    result = {"machine": machine(), "checkpoint_bytes": size, "tp": args.tp, "repeats": args.repeats,
              "engine_start_s": seconds, "load_s": load}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "vllm.json"), "w") as f:
        json.dump(result, f, indent=2)
    base = load["vLLM default"]
    lines = [f"# vLLM load time, {size / 2**30:.2f} GiB Llama (bf16), TP {args.tp}, cold", "",
             f"Machine: {result['machine']}. Medians of {args.repeats}. Load: the workers' own \"Loading "
             f"weights took\" (the slowest TP rank); engine start: LLM(...) in all (dummy: "
             f"{medians['dummy']:.1f} s, random weights).", "",
             "| loader | engine start s | load s | vs vLLM default |", "|---|---|---|---|"]
    for name in ("vLLM default", "distload", "vLLM sharded_state", "distload, pre-sharded"):
        ratio = base / load[name] if load[name] > 0 else float("inf")
        lines.append(f"| {name} | {medians[name]:.1f} | {load[name]:.2f} | {ratio:.2f}x |")
    with open(os.path.join(args.out, "vllm.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
