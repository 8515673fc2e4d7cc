"""Runs inside vLLM's own environment (.vllm-venv), started by tests/test_vllm_engine.py: a list
of cases, one engine each, one after the other in this one process, each case's greedy tokens
(a fingerprint of the weights) printed as JSON.

    python tests/vllm_driver.py TP CASES_JSON

One process for every case, whatever its tensor-parallel size (importing vLLM here takes about
20 s on 2 cores; an engine at TP 1 starts in 3 s, at TP 2 in about 20 s, its workers' own imports).

A case: {"name", "model", "format", "tp"? (default TP), "extra"?, "push"?: {"address", "receives"}: after its first
generation the engine's workers join distload's sync channel there and take ``receives`` versions
from a separately launched trainer job (a failed one recorded, and the tokens generated after it),
"reload"?: a checkpoint distload then puts into the running engine (after the pushes, if any),
"reshard_from"?: a whole checkpoint that ``distload.reshard(..., sharding="vllm")`` first saves to
"model" at the case's TP (vLLM's engine makes that save, in a child process),
"fork"?: true: vLLM's TP workers are forked from this process, not spawned (below),
"expect_error"?: the engine must fail to start, "ep"?: true starts it with enable_expert_parallel (vLLM's expert
parallelism: its EP size is the TP size here, each worker holding its own experts whole), "generate"?: false: the
engine only starts (its load, and the plugin's checks of it, run) and generates nothing: vLLM 0.32's CPU MoE kernels
crash on a token routed to another worker's expert (docs/expert-parallel.md), "digest"?: true records each worker's
SHA-256 of its parameters (vLLM's, after its post-processing) after the load and after each push, "reloads"?: checkpoints
that vLLM's in-place reload_weights then takes in turn (fed whole tensors by distload's reader), each worker's digests
after each (with "digest")}.
"""

import gc
import json
import os
import sys
import time

# The engine core runs in this process (no EngineCore process to spawn and import vLLM in, about
# 10 s an engine here); the model still loads in vLLM's workers, one spawned process per TP rank
# (at TP 1 vLLM's in-process "uni" executor). The loaders under test run there as in a server.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes below
KV_CACHE_BYTES = 64 << 20  # a few thousand tokens: plenty for 2 prompts of 12 tokens

PROMPTS = [{"prompt_token_ids": [1, 2, 3, 4]}, {"prompt_token_ids": [7, 99, 200]}]  # in every vocabulary here (>= 256)


# vLLM's CPU platform spawns its TP workers (each imports vLLM and torch again: about 10 s of a TP 2
# engine's 20 s start here), where on GPUs vLLM forks them unless CUDA is initialized. A case
# marked "fork" forks them, as a GPU server does: the loads and pushes in the workers run the same
# code, started sooner. The cases that stay spawned are the CPU server's own path. A TP 1 engine
# runs its model in this process, and its OpenMP threads do not survive a fork (the forked
# workers hang): forked cases come before any TP 1 case, or are refused.
FORK = {"on": False, "ran_here": None}


def _fork_where_asked() -> None:
    from vllm.platforms.cpu import CpuPlatform

    spawning = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        spawning(cls, vllm_config)  # sets VLLM_WORKER_MULTIPROC_METHOD=spawn
        if FORK["on"]:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def _digest(worker) -> dict:
    """One worker's parameters: name -> SHA-256 of its bytes (run in each worker by collective_rpc)."""
    import hashlib

    import torch

    return {name: hashlib.sha256(param.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            for name, param in sorted(worker.model_runner.get_model().named_parameters())}


def main() -> None:
    default_tp, cases = int(sys.argv[1]), json.loads(sys.argv[2])
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    import vllm.envs
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    import distload.vllm.plugin as plugin

    _fork_where_asked()

    params = SamplingParams(max_tokens=8, temperature=0, detokenize=False)
    results = {}
    for case in cases:
        tp = case.get("tp", default_tp)
        # without it at TP > 1: "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"
        if tp > 1:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
        elif bind is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
        FORK["on"] = bool(case.get("fork")) and tp > 1
        if FORK["on"] and FORK["ran_here"]:
            raise SystemExit(f"case {case['name']!r} forks vLLM's workers after {FORK['ran_here']!r} ran a model in "
                             f"this process (TP 1): the forked workers would hang; put forked cases first")
        if tp == 1:
            FORK["ran_here"] = case["name"]
        vllm.envs.disable_envs_cache()  # an engine caches vLLM's settings; the next reads them anew
        start = time.monotonic()
        resharded = None
        if case.get("reshard_from"):  # distload.reshard for vLLM: an engine of its own, in a child process
            import distload

            report = distload.reshard(case["reshard_from"], case["model"], tp, sharding="vllm")
            resharded = {"spec": report.spec, "note": report.engine_note, "files": len(report.files)}
        kwargs = {"model_loader_extra_config": case["extra"]} if "extra" in case else {}
        if case.get("ep"):
            kwargs["enable_expert_parallel"] = True
        if case.get("reload") or case.get("reloads") or case.get("push"):
            kwargs["worker_extension_cls"] = plugin.WORKER_EXTENSION
        try:
            llm = LLM(model=case["model"], skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                      max_model_len=128, max_num_seqs=4, tensor_parallel_size=tp, load_format=case["format"],
                      kv_cache_memory_bytes=KV_CACHE_BYTES, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the case says whether this was expected
            results[case["name"]] = {"error": f"{type(exc).__name__}: {exc}"}
            print("CASE", case["name"], "failed to start", flush=True)
            cleanup_dist_env_and_memory()
            continue
        generate = case.get("generate", True)
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)] if generate else None
        result = {"tokens": tokens, "start_s": round(time.monotonic() - start, 1), "resharded": resharded,
                  "workers": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") if tp > 1 else "in this process"}
        if case.get("digest"):
            result["digests"] = llm.collective_rpc(_digest)
        if case.get("push"):
            from distload.errors import SyncError

            plugin.sync_join(llm, case["push"]["address"], timeout_s=60)
            result["pushed"] = []
            for _ in range(case["push"]["receives"]):
                try:
                    got = plugin.sync_receive(llm, timeout_s=600)
                    entry = {"version": got["version"], "bytes": [w["bytes"] for w in got["workers"]],
                             "slices": [w["slice_bytes"] for w in got["workers"]],
                             "reload_s": [w["reload_seconds"] for w in got["workers"]],
                             "delta": [w["delta"] for w in got["workers"]],
                             "verified": [w["verified"] for w in got["workers"]]}
                except SyncError as exc:
                    entry = {"error": str(exc)}
                entry["tokens"] = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)] \
                    if generate else None
                if case.get("digest"):
                    entry["digests"] = llm.collective_rpc(_digest)
                result["pushed"].append(entry)
                print("PUSH", case["name"], json.dumps(entry)[:300], flush=True)
            llm.collective_rpc("distload_sync_close")
        if case.get("reload"):
            began = time.monotonic()
            plugin.reload_engine(llm, case["reload"], {"reader": "auto"})
            result["reload_s"] = round(time.monotonic() - began, 2)
            result["reloaded"] = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        if case.get("reloads"):  # vLLM's own in-place reload of each checkpoint in turn, the digests after each
            result["reloads_digests"] = []
            for source in case["reloads"]:
                plugin.reload_engine(llm, source, {"reader": "auto"})
                result["reloads_digests"].append(llm.collective_rpc(_digest))
        results[case["name"]] = result
        print("CASE", case["name"], json.dumps(result), flush=True)
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()  # the next engine's TP group (uni executor: in this process)
    print("RESULT", json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
