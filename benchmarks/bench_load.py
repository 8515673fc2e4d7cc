"""Load throughput of every CPU format against the limit of this machine and the naive way.

    python benchmarks/bench_load.py                      # 2 GiB, 1 and 2 ranks, warm and cold, first call, 3 repeats
    python benchmarks/bench_load.py --size-mib 512 --repeats 1 --ranks 2 --cases warm
    python benchmarks/bench_load.py --cases first-call --repeats 5 --first-call-baseline /tmp/main  # the first call only

Writes a Llama-shaped bf16 checkpoint (whole, and pre-sharded for each rank count) with
``distload.cli.demo``, then, in ONE run, for 1 and 2 ranks, warm page cache and cold (every file
evicted with posix_fadvise(DONTNEED) before each repetition; no root needed):

- every CPU format through ``torchrun -m distload load`` (the report gives seconds, bytes, the
  path that ran, and per rank the bytes read from storage (psutil ``read_bytes``) and peak RSS);
- **limit**: each rank reads exactly the bytes it needs with parallel ``pread``s (8 threads, 8 MiB,
  in file order) into a few preallocated buffers reused across reads: storage/page-cache
  throughput with no allocation;
- **naive**: each rank reads the whole checkpoint with plain ``safetensors.torch.load_file`` and
  keeps (copies out) its part: what a user gets without distload (torch on one thread per rank
  when there are several ranks, as torchrun sets OMP_NUM_THREADS=1 for the distload runs);
- **in place**: ``reload_into`` of the rank's shard into tensors it already holds (hot reload);
- the **peers**, each with its own best settings: plain safetensors (``load_file`` of the layout's
  files and a copy out of the map: the naive row for the whole layout, ``safetensors library``
  for the per-rank shards), **fastsafetensors** (``SafeTensorsFileLoader``, ``nogds=True`` as a
  CPU needs, its default 16 threads and 16 MiB bounce buffer: 2, 4 and 16 threads and 1-64 MiB
  buffers measured no faster here; one loader built before the clock starts, since its first
  construction imports its framework layer for seconds), and Run:ai (``runai_streamer`` and
  ``runai_streamer_sharded``; its defaults, and its distributed mode where there are 2 ranks).
  ``vs best peer`` is the fastest peer's seconds over the row's, in the same cell (ranks, cache,
  layout): above 1.0 the row is ahead of every peer.

**First call** (``--cases first-call``, results in load_first_call.json and .md): what a user's
one-process script pays, from ``import distload`` to the state dict, against ``load_file`` of
each file plus a ``clone`` of every tensor (safetensors' import inside its timing too): a fresh
process per run (torch imported before the clock, as a user's script has it), warm page cache,
the two interleaved, median of ``--repeats``; a 2 GiB checkpoint in 4 files and a 64 MiB one in
one file (``--first-call-sizes``). Bytecode is cached (an installed package has it: the children
drop PYTHONDONTWRITEBYTECODE and write theirs under the run's folder), one untimed run of each
first. Printed beside it: the kernel's transparent-huge-page mode and defrag setting, whether a
balloon reports free pages to the host (distload's host memory decides on both), and the load
average (the machine may be shared).

Also the cost of asking the kernel what is cached (``distload/loading/residency.py``): mincore
over a map of each file against one ``preadv2(RWF_NOWAIT)`` probe per page, warm and cold.

Medians of ``--repeats``; the slowest rank's seconds count. Results: benchmarks/results/
load.json, load.md and load.png (needs matplotlib: ``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from distload.loading.sources import read_local_header  # noqa: E402
from distload.cli.demo import llama_shapes, write_demo_checkpoint  # noqa: E402
from distload.loading.layout import detect_layout  # noqa: E402
from distload.loading.report import peak_rss_bytes  # noqa: E402

GIB = 2**30
FORMATS = [  # (label, layout, --load-format, extra config)
    ("safetensors", "whole", "safetensors", None),
    ("runai_streamer", "whole", "runai_streamer", None),
    ("runai_streamer distributed", "whole", "runai_streamer", '{"distributed": true}'),
    ("auto (whole)", "whole", "auto", None),
    ("sharded_state", "sharded", "sharded_state", None),
    ("runai_streamer_sharded", "sharded", "runai_streamer_sharded", None),
    ("auto (sharded)", "sharded", "auto", None),
    # The same reader with transparent huge pages forced on (auto decides per machine; see
    # distload/loading/host_memory.py): shows what 4 KiB page faults cost, and what huge pages cost here.
    ("auto (sharded), huge pages forced", "sharded", "auto", '{"huge_pages": true}'),
]


def safetensors_files(folder: str, rank: int | None = None, world_size: int = 1) -> list[str]:
    """A whole checkpoint's files, or (``rank`` given) that rank's shards, by distload's one rule."""
    if rank is not None:
        return detect_layout(folder).rank_paths(rank, world_size)
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))


def evict(folder: str) -> None:
    """Drop the folder's files from the page cache (no root needed)."""
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- baselines, one process per rank --------------------------------------------------------------


def _limit(files: list[str]) -> int:
    """Every tensor byte of ``files``, in file order, by 8 threads issuing 8 MiB preads into 16
    reused buffers: the same I/O pattern as the best reader, without allocation or page faults."""
    chunk = 8 * 2**20
    chunks = []
    for path in files:
        info = read_local_header(path)
        start, end = min(t.begin for t in info.tensors), max(t.end for t in info.tensors)
        chunks += [(path, off, min(chunk, end - off)) for off in range(start, end, chunk)]
    fds = {p: os.open(p, os.O_RDONLY) for p in files}
    buffers = [bytearray(chunk) for _ in range(16)]

    def read(k: int) -> int:
        path, off, size = chunks[k]
        return os.preadv(fds[path], [memoryview(buffers[k % 16])[:size]], off)

    with ThreadPoolExecutor(8) as pool:
        nbytes = sum(pool.map(read, range(len(chunks))))
    for fd in fds.values():
        os.close(fd)
    return nbytes


def _naive(whole_files: list[str], rank: int, world_size: int, sharded: bool, splits: dict) -> int:
    from safetensors.torch import load_file

    kept = {}
    for path in whole_files:
        for name, tensor in load_file(path).items():
            split = splits.get(name) if sharded else None
            part = tensor.chunk(world_size, dim=split)[rank] if split is not None else tensor
            kept[name] = part.clone()  # keep it: a copy out of the memory map, as a model would
    return sum(t.numel() * t.element_size() for t in kept.values())


def _library(files: list[str]) -> int:
    """The safetensors library on the layout's own files, each tensor copied out of the map."""
    from safetensors.torch import load_file

    kept = {name: t.clone() for path in files for name, t in load_file(path).items()}
    return sum(t.numel() * t.element_size() for t in kept.values())


def _fastsafetensors(files: list[str]) -> int:
    import warnings

    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    warnings.filterwarnings("ignore")
    loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
    loader.add_filenames({0: files})
    buffers = loader.copy_files_to_device()
    kept = {name: buffers.get_tensor(name) for name in loader.get_keys()}
    nbytes = sum(t.numel() * t.element_size() for t in kept.values())
    buffers.close()
    loader.close()
    return nbytes


def _warm_up(kind: str) -> None:
    """What a peer costs once per process, before any load (imports), outside the clock."""
    if kind == "fastsafetensors":
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True).close()


BASELINES = {"limit": _limit, "naive": _naive, "safetensors library": _library, "fastsafetensors": _fastsafetensors}
PEERS = {"naive": "whole", "safetensors library": "sharded", "fastsafetensors": None, "runai_streamer": "whole",
         "runai_streamer distributed": "whole", "runai_streamer_sharded": "sharded"}  # peer -> layout (None: both)


def _baseline_rank(kind: str, args: tuple, nproc: int, barrier, queue) -> None:
    if nproc > 1:
        torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1 for the distload runs
    proc = psutil.Process()
    _warm_up(kind)
    barrier.wait()
    read0 = proc.io_counters().read_bytes
    start = time.perf_counter()
    nbytes = BASELINES[kind](*args)
    seconds = time.perf_counter() - start
    queue.put({"seconds": seconds, "nbytes": nbytes, "read_bytes": proc.io_counters().read_bytes - read0,
               "peak_rss": peak_rss_bytes()})


def run_baseline(kind: str, per_rank_args: list[tuple]) -> list[dict]:
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(len(per_rank_args)), ctx.Queue()
    procs = [ctx.Process(target=_baseline_rank, args=(kind, a, len(per_rank_args), barrier, queue))
             for a in per_rank_args]
    for p in procs:
        p.start()
    results = [queue.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    return results


# -- distload runs ---------------------------------------------------------------------------------


def run_load(folder: str, load_format: str, extra: str | None, nproc: int, report: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "distload", "load", folder, "--load-format", load_format, "--report-json", report,
           "--no-progress", "--no-digest"]
    if extra:
        cmd += ["--model-loader-extra-config", extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    with open(report) as f:
        data = json.load(f)
    return [{"seconds": r["seconds"], "nbytes": r["nbytes"], "read_bytes": r.get("read_bytes", 0),
             "peak_rss": r.get("peak_rss_bytes", 0), "path": r["path"],
             "huge_page_marked_bytes": r.get("huge_page_marked_bytes", 0)} for r in data["ranks"]]


_IN_PLACE = r"""
import json, sys, time, torch, distload
from distload.live.reload import reload_into
from distload.loading.report import peak_rss_bytes, storage_read_bytes
folder, out = sys.argv[1], sys.argv[2]
with distload.WorkerGroup(device="cpu") as g:
    plan = distload.Loader(folder, "auto", group=g).plan()
    state = {t.name: torch.ones(t.shape, dtype=t.torch_dtype) for t in plan.index.tensors}  # touched
    read0 = storage_read_bytes()
    start = time.perf_counter()
    report = reload_into(state, folder, "auto", group=g)
    seconds = time.perf_counter() - start
    results = g.exchange({"seconds": seconds, "nbytes": report.nbytes, "path": report.path,
                          "read_bytes": storage_read_bytes() - read0, "peak_rss": peak_rss_bytes()})
    if g.rank == 0:
        json.dump(results, open(out, "w"))
"""


def run_in_place(folder: str, nproc: int, case: str, out: str, script: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           script, folder, out, case]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"in-place run failed:\n{result.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def summarize(label: str, layout: str, nproc: int, case: str, repeats: list[list[dict]]) -> dict:
    seconds = statistics.median(max(r["seconds"] for r in rep) for rep in repeats)
    first = repeats[0]
    nbytes = sum(r["nbytes"] for r in first)
    return {
        "method": label, "layout": layout, "ranks": nproc, "cache": case,
        "path": ",".join(sorted({r.get("path", label) for r in first})),
        "seconds": round(seconds, 4),
        "gib_per_s_total": round(nbytes / GIB / seconds, 3),
        "gib_per_s_per_rank": round(nbytes / nproc / GIB / seconds, 3),
        "read_gib_from_storage": round(statistics.median(sum(r["read_bytes"] for r in rep) for rep in repeats) / GIB, 3),
        "peak_rss_gib_max_rank": round(max(r["peak_rss"] for r in first) / GIB, 3),
        "huge_page_gib": round(sum(r.get("huge_page_marked_bytes", 0) for r in first) / GIB, 3),
    }


def measure_probe(folder: str) -> dict:
    """Seconds per GiB to learn which pages of a checkpoint are cached: one mincore per file
    (distload's probe) against one preadv2(RWF_NOWAIT) per page, cold then warm."""
    from distload.loading.residency import PAGE, probe

    files = safetensors_files(folder)
    size = sum(os.path.getsize(p) for p in files)
    result = {"checkpoint_gib": round(size / GIB, 3)}
    one = bytearray(1)
    for case in ("cold", "warm"):
        if case == "cold":
            evict(folder)
        else:
            for path in files:
                with open(path, "rb") as f:
                    while f.read(64 * 2**20):
                        pass
        fds = [os.open(p, os.O_RDONLY) for p in files]
        start = time.perf_counter()
        cached = sum(probe(fd).resident_bytes() for fd in fds)
        mincore_s = time.perf_counter() - start
        start = time.perf_counter()
        for fd, path in zip(fds, files):
            for offset in range(0, os.path.getsize(path), PAGE):
                try:
                    os.preadv(fd, [one], offset, os.RWF_NOWAIT)
                except BlockingIOError:
                    pass
        nowait_s = time.perf_counter() - start
        for fd in fds:
            os.close(fd)
        result[case] = {"cached_fraction": round(cached / size, 3),
                        "mincore_ms_per_gib": round(mincore_s * 1000 * GIB / size, 2),
                        "rwf_nowait_per_page_ms_per_gib": round(nowait_s * 1000 * GIB / size, 1)}
    return result


def machine() -> dict:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    def version(name: str) -> str:  # a peer not installed here is said so, not a failed run
        try:
            return installed(name)
        except PackageNotFoundError:
            return "not installed"

    disk = psutil.disk_usage(tempfile.gettempdir())
    return {"cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / GIB, 1),
            "disk_total_gib": round(disk.total / GIB), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "runai_model_streamer": version("runai-model-streamer"), "safetensors": version("safetensors"),
            "fastsafetensors": version("fastsafetensors")}


def write_outputs(out_dir: str, result: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "load.json"), "w") as f:
        json.dump(result, f, indent=2)
    m = result["machine"]
    lines = [f"{result['size_mib']} MiB bf16 Llama-shaped checkpoint (hidden {result['hidden']}), median of "
             f"{result['repeats']}; "
             f"{m['cpus']} CPUs, {m['memory_gib']} GiB, {m['platform']}, torch {m['torch']}, "
             f"Run:ai {m['runai_model_streamer']}, safetensors {m['safetensors']}, "
             f"fastsafetensors {m['fastsafetensors']}.", "",
             "| ranks | cache | layout | method | path | s (slowest rank) | GiB/s per rank | GiB/s total "
             "| vs limit | vs naive | vs best peer (which) | read from storage GiB | peak RSS GiB (largest rank) "
             "| marked for huge pages GiB (all ranks) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['ranks']} | {row['cache']} | {row['layout']} | {row['method']} | {row['path']} "
                     f"| {row['seconds']} | {row['gib_per_s_per_rank']} | {row['gib_per_s_total']} "
                     f"| {row.get('vs_limit', '')} | {row.get('vs_naive', '')} "
                     f"| {row.get('vs_best_peer', '')} ({row.get('best_peer', '')}) "
                     f"| {row['read_gib_from_storage']} | {row['peak_rss_gib_max_rank']} "
                     f"| {row.get('huge_page_gib', 0)} |")
    probe = result.get("residency_probe")
    if probe:
        lines += ["", f"Asking the kernel which pages of the {probe['checkpoint_gib']} GiB whole checkpoint are "
                  f"cached, ms per GiB: " + "; ".join(
                      f"{case} (cached {probe[case]['cached_fraction']:.0%}): mincore "
                      f"{probe[case]['mincore_ms_per_gib']}, preadv2(RWF_NOWAIT) per page "
                      f"{probe[case]['rwf_nowait_per_page_ms_per_gib']}" for case in ("cold", "warm"))]
    with open(os.path.join(out_dir, "load.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install -e '.[bench]')")
        return
    groups = sorted({(r["ranks"], r["cache"]) for r in result["rows"]})
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 6), squeeze=False)
    for ax, (nproc, case) in zip(axes[0], groups):
        rows = [r for r in result["rows"] if (r["ranks"], r["cache"]) == (nproc, case)]
        ax.barh([f"{r['method']} [{r['layout']}]" for r in rows], [r["gib_per_s_per_rank"] for r in rows])
        ax.set_title(f"{nproc} rank(s), {case} cache")
        ax.set_xlabel("GiB/s per rank")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "load.png"), dpi=80)


def run_cases(args: argparse.Namespace, root: str) -> list[dict]:
    """Every case in the order the docstring gives; the rows of the table, before ratios."""
    rows: list[dict] = []
    script = os.path.join(root, "in_place.py")
    with open(script, "w") as f:
        f.write(_IN_PLACE)
    for nproc in args.ranks:
        whole, sharded = write_demo_checkpoint(os.path.join(root, f"ws{nproc}"), nproc, args.size_mib, args.hidden)
        folders = {"whole": whole, "sharded": sharded}
        layers = json.load(open(os.path.join(whole, "config.json")))["num_hidden_layers"]
        splits = {n: s for n, (_, s) in llama_shapes(args.hidden, layers, 8192).items()}
        for case in args.cases:
            def prepare() -> None:
                if case == "cold":
                    for folder in folders.values():
                        evict(folder)
                else:  # warm: make sure everything is cached
                    for folder in folders.values():
                        for path in safetensors_files(folder):
                            with open(path, "rb") as f:
                                while f.read(64 * 2**20):
                                    pass

            for layout in ("whole", "sharded"):
                per_rank = [(safetensors_files(whole),) if layout == "whole" else (safetensors_files(sharded, r, nproc),)
                            for r in range(nproc)]
                reps = []
                for _ in range(args.repeats):
                    prepare()
                    reps.append(run_baseline("limit", per_rank))
                rows.append(summarize("limit", layout, nproc, case, reps))
                naive_args = [(safetensors_files(whole), r, nproc, layout == "sharded", splits) for r in range(nproc)]
                reps = []
                for _ in range(args.repeats):
                    prepare()
                    reps.append(run_baseline("naive", naive_args))
                rows.append(summarize("naive", layout, nproc, case, reps))
                peers = ["fastsafetensors"] + (["safetensors library"] if layout == "sharded" else [])
                for peer in peers:
                    reps = []
                    for _ in range(args.repeats):
                        prepare()
                        reps.append(run_baseline(peer, per_rank))
                    rows.append(summarize(peer, layout, nproc, case, reps))
                    print(json.dumps(rows[-1]), flush=True)
            for label, layout, load_format, extra in FORMATS:
                if "distributed" in (extra or "") and nproc == 1:
                    continue
                reps = []
                for _ in range(args.repeats):
                    prepare()
                    reps.append(run_load(folders[layout], load_format, extra, nproc, os.path.join(root, "r.json")))
                rows.append(summarize(label, layout, nproc, case, reps))
                print(json.dumps(rows[-1]), flush=True)
            reps = []
            for _ in range(args.repeats):
                prepare()
                reps.append(run_in_place(sharded, nproc, case, os.path.join(root, "ip.json"), script))
            rows.append(summarize("in place (reload_into)", "sharded", nproc, case, reps))
    return rows


# -- the first call: a fresh process, the import inside the timing -----------------------------

_FIRST_CALL = r"""
import glob, json, os, resource, sys, time
import torch  # a user's script has it already
case, folder = sys.argv[1], sys.argv[2]
before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
if case != "plain":  # distload, or the baseline's distload (another PYTHONPATH)
    import distload
    state = distload.load(folder, "auto", device="cpu")
else:
    from safetensors.torch import load_file
    state = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        state.update({name: tensor.clone() for name, tensor in load_file(path).items()})
seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"seconds": seconds, "cpu_seconds": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
                  "nbytes": sum(t.numel() * t.element_size() for t in state.values())}))
"""
FIRST_CALL_CASES = {"distload": "distload.load (auto)", "plain": "load_file + clone"}


def write_first_call_checkpoint(folder: str, size_mib: int, hidden: int) -> int:
    """A Llama-shaped bf16 checkpoint of about ``size_mib`` in 4 files (1 from under 1 GiB)."""
    from safetensors.torch import save_file

    from distload.cli.demo import llama_layers, llama_shapes

    vocab = 8192
    if size_mib < 256:
        hidden = min(hidden, 1024)  # a 64 MiB Llama at hidden 2048 would be 230 MiB (two layers at least)
    shapes = llama_shapes(hidden, llama_layers(size_mib, hidden, vocab), vocab)
    names, files = list(shapes), 4 if size_mib >= 1024 else 1
    generator = torch.Generator().manual_seed(0)
    os.makedirs(folder, exist_ok=True)
    for i in range(files):
        part = names[i * len(names) // files:(i + 1) * len(names) // files]
        save_file({n: (torch.randn(shapes[n][0], generator=generator) * 0.02).to(torch.bfloat16) for n in part},
                  os.path.join(folder, f"model-{i + 1:05d}-of-{files:05d}.safetensors"))
    return files


def host_memory_state() -> dict:
    """What distload's host memory decides on, as this machine says it (distload/loading/host_memory.py)."""
    from distload.loading.host_memory import free_huge_page_bytes, free_page_reporting, thp_mode

    defrag = thp_mode("/sys/kernel/mm/transparent_hugepage/defrag")
    return {"thp_enabled": thp_mode(), "thp_defrag": defrag, "free_page_reporting": free_page_reporting() or "none",
            "free_huge_page_gib": round(free_huge_page_bytes() / GIB, 1)}


def run_first_call(args: argparse.Namespace, root: str) -> dict:
    script = os.path.join(root, "first_call.py")
    with open(script, "w") as f:
        f.write(_FIRST_CALL)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "RANK", "WORLD_SIZE",
                                                           "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["PYTHONPYCACHEPREFIX"] = os.path.join(root, "pycache")  # bytecode cached, as installed
    env["PYTHONPATH"] = os.path.dirname(HERE)  # this checkout's distload
    rows, load = [], [os.getloadavg()[0]]
    cases = dict(FIRST_CALL_CASES)
    if args.first_call_baseline:
        cases["baseline"] = "distload.load (auto), baseline"
    for size in args.first_call_sizes:
        folder = os.path.join(root, f"first{size}")
        files = write_first_call_checkpoint(folder, size, args.hidden)

        def once(case: str) -> dict:
            for path in safetensors_files(folder):  # warm: every byte cached
                with open(path, "rb") as f:
                    while f.read(64 * 2**20):
                        pass
            out = subprocess.run([sys.executable, script, case, folder], capture_output=True, text=True, timeout=600,
                                 env={**env, "PYTHONPATH": args.first_call_baseline} if case == "baseline" else env)
            if out.returncode != 0:
                raise SystemExit(f"first-call {case} failed:\n{out.stderr[-3000:]}")
            return json.loads(out.stdout.strip().splitlines()[-1])

        for case in cases:
            once(case)  # untimed: bytecode written, the same memory state for each
        runs = {case: [] for case in cases}
        for _ in range(args.repeats):
            for case in cases:  # interleaved: the same load on the machine for each
                runs[case].append(once(case))
        plain = statistics.median(r["seconds"] for r in runs["plain"])
        for case, label in cases.items():
            seconds = statistics.median(r["seconds"] for r in runs[case])
            rows.append({"size_mib": size, "files": files, "method": label, "seconds": round(seconds, 4),
                         "seconds_all": [round(r["seconds"], 4) for r in runs[case]],
                         "cpu_seconds": round(statistics.median(r["cpu_seconds"] for r in runs[case]), 4),
                         "gib_per_s": round(runs[case][0]["nbytes"] / GIB / seconds, 3),
                         "vs_plain": round(plain / seconds, 2)})
            print(json.dumps(rows[-1]), flush=True)
        shutil.rmtree(folder, ignore_errors=True)
    load.append(os.getloadavg()[0])
    return {"machine": machine(), "host_memory": host_memory_state(), "load_average": load,
            "baseline": args.first_call_baseline,
            "repeats": args.repeats, "hidden": args.hidden, "rows": rows}


def write_first_call(out_dir: str, result: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "load_first_call.json"), "w") as f:
        json.dump(result, f, indent=2)
    m, h = result["machine"], result["host_memory"]
    lines = [f"A user's first call, one process: `import distload` + `distload.load(folder, \"auto\")` against "
             f"`load_file` + `clone` of every tensor (the import inside the timing for both, torch before it), "
             f"fresh process per run, warm page cache, interleaved, median of {result['repeats']}; "
             f"{m['cpus']} CPUs, {m['memory_gib']} GiB, {m['platform']}, torch {m['torch']}, "
             f"safetensors {m['safetensors']}.", "",
             f"Host memory: transparent huge pages `{h['thp_enabled']}`, defrag `{h['thp_defrag']}`, free page "
             f"reporting `{h['free_page_reporting']}`, {h['free_huge_page_gib']} GiB in free 2 MiB blocks. "
             f"Load average {result['load_average'][0]:.1f} at the start, {result['load_average'][1]:.1f} at the "
             f"end (a shared machine: seconds vary with it; CPU seconds less)."
             + (f" The baseline rows run the distload in `{result['baseline']}`." if result.get("baseline") else ""), "",
             "| checkpoint | method | s (median) | each run s | CPU s (median) | GiB/s | vs load_file + clone |",
             "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['size_mib']} MiB, {row['files']} file(s) | {row['method']} | {row['seconds']} "
                     f"| {', '.join(str(s) for s in row['seconds_all'])} | {row['cpu_seconds']} | {row['gib_per_s']} "
                     f"| {row['vs_plain']} |")
    with open(os.path.join(out_dir, "load_first_call.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=2048,
                        help="hidden size of the synthetic model: 2048 gives 8-32 MiB tensors, as real models have")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cases", nargs="+", default=["warm", "cold", "first-call"],
                        choices=["warm", "cold", "first-call"])
    parser.add_argument("--first-call-sizes", type=int, nargs="+", default=[2048, 64],
                        help="MiB of each first-call checkpoint (4 files from 1 GiB up, else 1)")
    parser.add_argument("--first-call-baseline", default=None,
                        help="a folder holding another distload (e.g. `git archive main distload`): its "
                             "first call runs as a third case, interleaved with the others")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp folder on disk)")
    args = parser.parse_args()

    root = args.dir or tempfile.mkdtemp(prefix="distload-bench-", dir="/var/tmp")
    table_cases = [case for case in args.cases if case != "first-call"]
    try:
        if "first-call" in args.cases:
            write_first_call(args.out, run_first_call(args, root))
        if not table_cases:
            return 0
        args.cases = table_cases
        rows = run_cases(args, root)
        probe_cost = measure_probe(os.path.join(root, f"ws{args.ranks[0]}", "whole"))
    finally:
        if not args.dir:  # also when a run fails: the checkpoints take several GiB
            shutil.rmtree(root, ignore_errors=True)
    for row in rows:
        same = [r for r in rows if (r["ranks"], r["cache"], r["layout"]) == (row["ranks"], row["cache"], row["layout"])]
        limit = next(r for r in same if r["method"] == "limit")
        naive = next(r for r in same if r["method"] == "naive")
        row["vs_limit"] = round(row["gib_per_s_per_rank"] / limit["gib_per_s_per_rank"], 2)
        row["vs_naive"] = round(row["gib_per_s_per_rank"] / naive["gib_per_s_per_rank"], 2)
        peers = [r for r in same if r["method"] in PEERS and PEERS[r["method"]] in (None, r["layout"])]
        best = min(peers, key=lambda r: r["seconds"])
        row["vs_best_peer"] = round(best["seconds"] / row["seconds"], 2)
        row["best_peer"] = best["method"]
    write_outputs(args.out, {"machine": machine(), "size_mib": args.size_mib, "hidden": args.hidden,
                             "repeats": args.repeats, "rows": rows, "residency_probe": probe_cost})
    return 0


if __name__ == "__main__":
    sys.exit(main())
