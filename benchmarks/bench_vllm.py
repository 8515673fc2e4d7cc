"""How long vLLM takes to load one checkpoint: its own loaders against distload's.

    python benchmarks/bench_vllm.py                        # a 1 GiB Llama, TP 1 and 2, 2 repeats
    python benchmarks/bench_vllm.py --hidden 1024 --layers 4 --tp 1 --repeats 1

Runs in vLLM's environment (``.vllm-venv``, made by ``bash .ci/run``; ``--python`` for another).
A random Llama (bf16) saved by transformers, and its ``distload reshard`` output for each TP size.
In ONE run per TP size (one driver process, engines one after the other; every other repeat in
reverse order), each case twice in a row: **cold**, the model's files evicted from the page cache
first (posix_fadvise DONTNEED, no root), then **warm**, straight after (its files now cached):

- **vLLM default**: ``load_format="auto"`` on the whole checkpoint;
- **vLLM runai_streamer**: Run:ai's streamer, as vLLM ships it;
- **distload**: ``load_format="distload"`` on the whole checkpoint (each TP rank reads the boxes its
  weight map needs, into the parameters where the map allows);
- **vLLM sharded_state** and **distload, pre-sharded**: the reshard output.

Before them, once: **dummy** (the engine without reading weights, for scale) and **distload,
recording the map** (the first load of a model: it records the weight map from vLLM's loaders,
then caches it; every later load in the run uses the cache).

Load seconds: each loader's ``load_weights`` in vLLM's workers, timed alike for every loader (a
``sitecustomize`` the run puts on the path wraps them; the slowest TP rank); medians of ``--repeats``; ratios: vLLM default's time over the loader's (above 1: faster).
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
# The engine core in this process (as tests/vllm_driver.py): starts are shorter; the weights
# still load in vLLM's workers (at TP 1 its in-process executor), which is what is timed.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
def evict(folder):
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
def main():
    tp, once, cases, repeats = int(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    import gc
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    def start(name, model, fmt, cold):
        if cold:
            evict(model)
        llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                  max_model_len=128, max_num_seqs=4, tensor_parallel_size=tp, load_format=fmt)
        print("CASE", name, flush=True)
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    for name, model, fmt in once:
        start(name, model, fmt, True)
    for i in range(repeats):
        # Every other repeat in reverse: no loader always runs after the same neighbour.
        for name, model, fmt in (cases if i % 2 == 0 else cases[::-1]):
            start(name + ", cold", model, fmt, True)
            start(name + ", warm", model, fmt, False)
    print("DONE", flush=True)
if __name__ == "__main__":
    main()
"""

# Put on PYTHONPATH as sitecustomize.py for the driver and vLLM's workers: every model loader's
# load_weights, timed the same way and printed (vLLM's own "Loading weights took" line is logged by
# two of its loaders, not Run:ai's, and only once a process).
TIMING = r"""
import importlib.abc, importlib.machinery, sys, threading, time
TARGET = "vllm.model_executor.model_loader.base_loader"
_depth = threading.local()
def _timed(load_weights):
    def load(self, *args, **kwargs):
        outer = not getattr(_depth, "n", 0)
        _depth.n = getattr(_depth, "n", 0) + 1
        start = time.perf_counter()
        try:
            return load_weights(self, *args, **kwargs)
        finally:
            _depth.n -= 1
            if outer:
                print(f"BENCH load_weights {time.perf_counter() - start:.4f} {type(self).__name__}", flush=True)
    load._timed = True
    return load
class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            base = module.BaseModelLoader
            def init_subclass(cls, **kwargs):
                if "load_weights" in cls.__dict__ and not getattr(cls.load_weights, "_timed", False):
                    cls.load_weights = _timed(cls.load_weights)
            base.__init_subclass__ = classmethod(init_subclass)
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, _Finder())
"""

# The RLHF push (--push): a dummy engine at TP 2 takes versions from a trainer job, first by
# slices (each worker what its weight loaders take), then whole (every tensor to every worker, what
# sync_join(slices=False) does and every push did before), over two channels.
PUSH_ENGINE = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
tp, model, addresses, receives = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(","), int(sys.argv[4])
if tp > 1:
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
from vllm import LLM
import distload.vllm.plugin as plugin
llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=128,
          max_num_seqs=4, tensor_parallel_size=tp, load_format="dummy", worker_extension_cls=plugin.WORKER_EXTENSION)
for mode, address in zip(("slices", "whole"), addresses):
    plugin.sync_join(llm, address, timeout_s=900, slices=mode == "slices")
    for _ in range(receives):
        start = time.perf_counter()
        got = plugin.sync_receive(llm, timeout_s=900)
        print("PUSH", json.dumps({"mode": mode, "wall_s": time.perf_counter() - start, "workers": got["workers"]}),
              flush=True)
    llm.collective_rpc("distload_sync_close")
print("DONE", flush=True)
"""

PUSH_TRAINER = r"""
import os, sys
from safetensors.torch import load_file
from distload.live.channel import SyncChannel
folder, addresses, receives = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
state = {}
for name in sorted(os.listdir(folder)):
    if name.endswith(".safetensors"):
        state.update(load_file(os.path.join(folder, name)))
for address in addresses:  # full pushes every time (delta off): the bytes a new version costs at most
    with SyncChannel(address, "trainer", rank=0, size=1, device="cpu", timeout_s=900, delta=False) as sync:
        for version in range(1, receives + 1):
            sync.push(state, version)
"""


def push_benchmark(args, whole: str, tmp: str) -> dict:
    """Per mode (slices, whole): each worker's bytes on the wire, its slices' bytes, the engine's
    seconds per update (sync_receive: receive and vLLM's reload; median), and the workers' RSS."""
    from bench_sync import _free_port

    addresses = [f"tcp://127.0.0.1:{_free_port()}" for _ in range(2)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["DISTLOAD_WEIGHT_MAP_CACHE"] = os.path.join(tmp, "maps-push")
    trainer = subprocess.Popen([sys.executable, "-c", PUSH_TRAINER, whole, ",".join(addresses), str(args.receives)],
                               env=env)
    run = subprocess.run([args.python, "-c", PUSH_ENGINE, "2", whole, ",".join(addresses), str(args.receives)],
                         capture_output=True, text=True, env=env)
    trainer.wait(timeout=120)
    if run.returncode != 0 or "DONE" not in run.stdout:
        sys.exit(run.stdout[-3000:] + run.stderr[-6000:])
    rows: dict[str, list[dict]] = {}
    for line in run.stdout.splitlines():
        if line.startswith("PUSH "):
            row = json.loads(line[len("PUSH "):])
            rows.setdefault(row["mode"], []).append(row)
    out = {}
    for mode, pushes in rows.items():
        workers = pushes[-1]["workers"]
        out[mode] = {"wall_s": statistics.median(p["wall_s"] for p in pushes[1:] or pushes),
                     "first_s": pushes[0]["wall_s"],
                     "reload_s": statistics.median(w["reload_seconds"] for p in pushes for w in p["workers"]),
                     "wire_bytes": [w["bytes"] for w in workers], "staging_bytes": [w["staging_bytes"] for w in workers],
                     "rss_bytes": [w["rss_bytes"] for w in workers]}
    out["slice_bytes"] = [w["slice_bytes"] for w in rows["slices"][-1]["workers"]]
    return out


LOADERS = ("vLLM default", "vLLM runai_streamer", "distload", "vLLM sharded_state", "distload, pre-sharded")


def _loading_seconds(output: str) -> dict[str, list[float]]:
    """Each case's load_weights seconds (TIMING prints them in the workers, before the driver
    prints the case's name)."""
    found: dict[str, list[float]] = {}
    pending: list[float] = []
    for line in output.splitlines():
        match = re.search(r"BENCH load_weights ([0-9.]+) ", line)  # a worker's line has a prefix
        if match:
            pending.append(float(match.group(1)))
        elif line.startswith("CASE "):
            name = line[len("CASE "):]
            if name != "dummy":
                if not pending:
                    sys.exit(f"no load_weights time for case {name}")
                found.setdefault(name, []).append(max(pending))  # the slowest TP rank
            pending = []
    return found


def _loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=os.path.join(ROOT, ".vllm-venv", "bin", "python"))
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--push", action="store_true",
                        help="the RLHF push into a TP 2 engine instead: by slices against whole (vllm_push.md)")
    parser.add_argument("--receives", type=int, default=3, help="versions pushed in each mode (--push)")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    import distload
    from bench_load import machine

    if args.push:
        with tempfile.TemporaryDirectory(prefix="distload-vllm-", dir=os.environ.get("DISTLOAD_BENCH_DIR")) as tmp:
            whole = os.path.join(tmp, "whole")
            subprocess.run([args.python, "-c", MAKE, whole, str(args.hidden), str(args.layers)], check=True)
            size = sum(os.path.getsize(os.path.join(whole, n)) for n in os.listdir(whole)
                       if n.endswith(".safetensors"))
            push = push_benchmark(args, whole, tmp)
        write_push(args, machine(), size, push)
        return

    load: dict[str, dict[str, float]] = {}
    loads: dict[str, list[float]] = {}
    runs: dict[str, dict[str, list[float]]] = {}  # every repeat's seconds, for the spread
    with tempfile.TemporaryDirectory(prefix="distload-vllm-", dir=os.environ.get("DISTLOAD_BENCH_DIR")) as tmp:
        whole = os.path.join(tmp, "whole")
        subprocess.run([args.python, "-c", MAKE, whole, str(args.hidden), str(args.layers)], check=True)
        size = sum(os.path.getsize(os.path.join(whole, n)) for n in os.listdir(whole) if n.endswith(".safetensors"))
        for tp in args.tp:
            saved = os.path.join(tmp, f"saved-tp{tp}")
            distload.reshard(whole, saved, tp)
            once = [("dummy", whole, "dummy"), ("distload, recording the map", whole, "distload")]
            cases = [("vLLM default", whole, "auto"), ("vLLM runai_streamer", whole, "runai_streamer"),
                     ("distload", whole, "distload"), ("vLLM sharded_state", saved, "sharded_state"),
                     ("distload, pre-sharded", saved, "distload")]
            env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
            with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
                f.write(TIMING)
            env["PYTHONPATH"] = os.pathsep.join(x for x in (tmp, env.get("PYTHONPATH")) if x)
            env["DISTLOAD_WEIGHT_MAP_CACHE"] = os.path.join(tmp, f"maps-tp{tp}")  # empty: the first load records
            loadavg = [_loadavg()]  # the machine is shared: say how busy it was around the run
            run = subprocess.run([args.python, "-c", DRIVE, str(tp), json.dumps(once), json.dumps(cases),
                                  str(args.repeats)], capture_output=True, text=True, env=env)
            loadavg.append(_loadavg())
            loads[str(tp)] = loadavg
            if run.returncode != 0 or "DONE" not in run.stdout:
                sys.exit(run.stdout[-3000:] + run.stderr[-6000:])
            found = _loading_seconds(run.stdout + run.stderr)
            load[str(tp)] = {name: statistics.median(values) for name, values in found.items()}
            runs[str(tp)] = found
    result = {"machine": machine(), "checkpoint_bytes": size, "repeats": args.repeats, "load_s": load,
              "load_s_each_repeat": runs, "loadavg_1min_before_after": loads}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "vllm.json"), "w") as f:
        json.dump(result, f, indent=2)
    lines = [f"# vLLM load time, {size / 2**30:.2f} GiB Llama (bf16)", "",
             f"Machine: {result['machine']}. Medians of {args.repeats}. Load: each loader's load_weights in vLLM's "
             f"workers (the slowest TP rank). Cold: the files evicted from the page cache first; warm: "
             f"the same case again straight after. Ratio: vLLM default's time over the loader's (above 1: faster).", ""]
    for tp, times in load.items():
        before, after = loads[tp]
        lines += [f"## TP {tp}", "", f"Load average (1 min) before the run: {before:.2f}, after: {after:.2f}.", "",
                  f"First distload load of the model, recording the weight map: "
                  f"{times['distload, recording the map']:.2f} s (cold; every later load uses the cache).", "",
                  "| loader | cold s | vs default | warm s | vs default |", "|---|---|---|---|---|"]
        for name in LOADERS:
            cold, warm = times[name + ", cold"], times[name + ", warm"]
            lines.append(f"| {name} | {cold:.2f} | {times['vLLM default, cold'] / cold:.2f}x | {warm:.2f} | "
                         f"{times['vLLM default, warm'] / warm:.2f}x |")
        lines.append("")
    with open(os.path.join(args.out, "vllm.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


def write_push(args, machine: str, size: int, push: dict) -> None:
    result = {"machine": machine, "checkpoint_bytes": size, "receives": args.receives, "push": push}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "vllm_push.json"), "w") as f:
        json.dump(result, f, indent=2)
    gib = 2**30
    lines = [f"# RLHF push into a running vLLM engine (TP 2), {size / gib:.2f} GiB Llama (bf16)", "",
             f"Machine: {machine}. A trainer job pushes {args.receives} full versions (delta off) in each mode "
             f"to a dummy engine's 2 workers; seconds: the engine's sync_receive (receive, then vLLM's layerwise "
             f"reload), median of the versions after the first; slices: what each worker's parameters hold as "
             f"loaded. RSS: each worker's resident memory after the mode's last update (the slices mode runs "
             f"first).", "",
             "| mode | bytes to worker 0 / 1 (GiB) | x its slices | staging per worker (GiB) | s per update | "
             "first update s | vLLM reload s | worker RSS (GiB) |", "|---|---|---|---|---|---|---|---|"]
    slices = push["slice_bytes"]
    for mode in ("slices", "whole"):
        row = push[mode]
        ratio = max(w / s for w, s in zip(row["wire_bytes"], slices))
        lines.append(f"| {mode} | {' / '.join(f'{b / gib:.3f}' for b in row['wire_bytes'])} | {ratio:.3f}x | "
                     f"{max(row['staging_bytes']) / gib:.3f} | {row['wall_s']:.2f} | {row['first_s']:.2f} | "
                     f"{row['reload_s']:.2f} | {' / '.join(f'{b / gib:.2f}' for b in row['rss_bytes'])} |")
    ratio = push["whole"]["wall_s"] / push["slices"]["wall_s"]
    lines += ["", f"By slices: {ratio:.2f}x as fast as whole per update, each worker receiving "
              f"{max(push['slices']['wire_bytes']) / max(push['whole']['wire_bytes']):.2f}x the bytes."]
    with open(os.path.join(args.out, "vllm_push.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
