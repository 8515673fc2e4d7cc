"""Runs inside vLLM's own environment (.vllm-venv), started by tests/test_vllm_engine.py: a list
of cases, one engine each, one after the other in this one process, each case's greedy tokens
(a fingerprint of the weights) printed as JSON.

    python tests/vllm_driver.py TP CASES_JSON

A case: {"name", "model", "format", "extra"?, "reload"?: a checkpoint distload puts into the
running engine after its first generation, "push"?: {"address", "receives"}: the engine's workers
join distload's sync channel there and take ``receives`` versions from a separately launched
trainer job (a failed one recorded, and the tokens generated after it), "expect_error"?: the
engine must fail to start}.
"""

import gc
import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PROMPTS = [{"prompt_token_ids": [1, 2, 3, 4]}, {"prompt_token_ids": [7, 99, 500]}]


def main() -> None:
    tp, cases = int(sys.argv[1]), json.loads(sys.argv[2])
    if tp > 1:  # without it: "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    from vllm import LLM, SamplingParams

    import distload.vllm_plugin as plugin

    params = SamplingParams(max_tokens=8, temperature=0, detokenize=False)
    results = {}
    for case in cases:
        start = time.monotonic()
        kwargs = {"model_loader_extra_config": case["extra"]} if "extra" in case else {}
        if case.get("reload") or case.get("push"):
            kwargs["worker_extension_cls"] = plugin.WORKER_EXTENSION
        try:
            llm = LLM(model=case["model"], skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                      max_model_len=128, max_num_seqs=4, tensor_parallel_size=tp, load_format=case["format"],
                      **kwargs)
        except Exception as exc:  # noqa: BLE001 - the case says whether this was expected
            results[case["name"]] = {"error": f"{type(exc).__name__}: {exc}"}
            print("CASE", case["name"], "failed to start", flush=True)
            continue
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        result = {"tokens": tokens, "start_s": round(time.monotonic() - start, 1)}
        if case.get("reload"):
            began = time.monotonic()
            plugin.reload_engine(llm, case["reload"], {"reader": "auto"})
            result["reload_s"] = round(time.monotonic() - began, 2)
            result["reloaded"] = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        if case.get("push"):
            from distload.errors import SyncError

            plugin.sync_join(llm, case["push"]["address"], timeout_s=60)
            result["pushed"] = []
            for _ in range(case["push"]["receives"]):
                try:
                    got = plugin.sync_receive(llm, timeout_s=600)
                    entry = {"version": got["version"], "bytes": [w["bytes"] for w in got["workers"]]}
                except SyncError as exc:
                    entry = {"error": str(exc)}
                entry["tokens"] = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
                result["pushed"].append(entry)
                print("PUSH", case["name"], json.dumps(entry)[:300], flush=True)
            llm.collective_rpc("distload_sync_close")
        results[case["name"]] = result
        print("CASE", case["name"], json.dumps(result), flush=True)
        del llm
        gc.collect()
    print("RESULT", json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
