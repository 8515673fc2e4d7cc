"""BF16 -> FP8 refit (distload/live/refit.py) against the same BF16 push into BF16 tensors.

    python benchmarks/bench_refit.py                     # 64 MiB of BF16 weights, 5 repeats
    python benchmarks/bench_refit.py --size-mib 256 --repeats 3

One trainer process, one inference process (its own channel member each, the socket path: the
path across hosts), full pushes (``delta=False``), verified. The trainer pushes the same BF16
weights (square ``--hidden`` matrices) each time; the receiver takes them alternately into BF16
tensors (``bf16``) and into float8_e4m3fn tensors with their float32 ``weight_scale_inv``
(``refit``: the trainer quantizes before the bytes move). Cases interleave, ``--repeats`` of each
after one warm-up of each; the figures are medians. Also the quantizer alone on the trainer's
weights (``quantize s``), in the trainer process between pushes. Results:
benchmarks/results/refit.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from distload.live import refit  # noqa: E402
from distload.live.channel import SyncChannel  # noqa: E402

CASES = ("bf16", "refit")


def _state(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    count = max(1, args.size_mib * 1024**2 // (args.hidden * args.hidden * 2))
    gen = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.mlp.down_proj.weight":
            (torch.randn(args.hidden, args.hidden, generator=gen) * 0.02).to(torch.bfloat16) for i in range(count)}


def _schedule(args: argparse.Namespace) -> list[str]:
    return list(CASES) + list(CASES) * args.repeats  # one warm-up of each, then alternating


def trainer(args: argparse.Namespace) -> None:
    state = _state(args)
    rows = []
    with SyncChannel(args.rendezvous, "trainer", rank=0, size=1, device="cpu", timeout_s=300, delta=False,
                     transport="socket") as channel:
        for version, case in enumerate(_schedule(args), 1):
            stats = channel.push(state, version)
            start = time.perf_counter()
            for weight in state.values():
                refit.quantize(weight)
            rows.append({"case": case, "push_s": stats.seconds, "wire_bytes": stats.wire_bytes,
                         "quantize_s": time.perf_counter() - start})
    with open(args.result, "w") as f:
        json.dump(rows, f)


def inference(args: argparse.Namespace) -> None:
    state = _state(args)
    targets = {"bf16": {k: torch.empty_like(v) for k, v in state.items()}, "refit": {}}
    for name, weight in state.items():
        targets["refit"][name] = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
        targets["refit"][name + "_scale_inv"] = torch.empty(refit.scale_shape(weight.shape))
    want = {name: refit.quantize(weight) for name, weight in state.items()}
    with SyncChannel(args.rendezvous, "inference", rank=0, size=1, device="cpu", timeout_s=300,
                     transport="socket") as channel:
        for case in _schedule(args):
            channel.receive(targets[case])
            got = targets[case]
            for name, weight in state.items():  # every receive checked against a plain read
                if case == "bf16":
                    assert torch.equal(got[name], weight), name
                else:
                    q, s = want[name]
                    assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)), name
                    assert torch.equal(got[name + "_scale_inv"], s), name


def orchestrate(args: argparse.Namespace) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scratch = f"/tmp/distload-bench-refit-{os.getpid()}.json"
    common = ["--rendezvous", f"tcp://127.0.0.1:{port}", "--size-mib", str(args.size_mib), "--hidden",
              str(args.hidden), "--repeats", str(args.repeats), "--result", scratch]
    load_before = os.getloadavg()[0]
    procs = [subprocess.Popen([sys.executable, __file__, "--part", part, *common]) for part in ("trainer", "inference")]
    for proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"a part of the benchmark failed (exit {proc.returncode})")
    load_after = os.getloadavg()[0]
    with open(scratch) as f:
        rows = json.load(f)[len(CASES):]  # the warm-ups left out
    os.unlink(scratch)
    summary = {case: {key: statistics.median(r[key] for r in rows if r["case"] == case)
                      for key in ("push_s", "wire_bytes", "quantize_s")} for case in CASES}
    nbytes = sum(v.numel() * 2 for v in _state(args).values())
    machine = (f"{os.cpu_count()} CPUs (`nproc` {os.sched_getaffinity(0).__len__()}), shared with other work, "
               f"`uname -r` {platform.release()}, torch {torch.__version__}; load average {load_before:.2f} before, "
               f"{load_after:.2f} after")
    out = {"machine": machine, "bf16_bytes": nbytes, "repeats": args.repeats, "summary": summary, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "refit.json"), "w") as f:
        json.dump(out, f, indent=1)
    bf16, fp8 = summary["bf16"], summary["refit"]
    lines = [
        f"BF16 -> FP8 refit against the same BF16 push into BF16 tensors (benchmarks/bench_refit.py): 1 trainer "
        f"process -> 1 inference process, socket path, {nbytes / 1024**2:.0f} MiB of BF16 "
        f"({len(_state(args))} x [{args.hidden}, {args.hidden}]), full pushes, verified; cases alternating, "
        f"{args.repeats} of each after one warm-up each, medians. Every receive checked bit for bit. "
        f"Machine: {machine}.",
        "",
        "| case | push s (median) | wire bytes | trainer's quantize s (median) |",
        "|---|---|---|---|",
        f"| bf16 | {bf16['push_s']:.3f} | {bf16['wire_bytes']:,.0f} | - |",
        f"| refit | {fp8['push_s']:.3f} | {fp8['wire_bytes']:,.0f} | {fp8['quantize_s']:.3f} |",
        "",
        f"Refit / bf16: push time {fp8['push_s'] / bf16['push_s']:.2f}x, wire bytes "
        f"{fp8['wire_bytes'] / bf16['wire_bytes']:.3f}x. The quantizer runs on the trainer's CPU here (a GPU "
        f"trainer quantizes on its GPU); on this loopback link the bytes saved are cheap, so the push time "
        f"mostly shows the quantizer's cost.",
    ]
    with open(os.path.join(args.out, "refit.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--part", choices=("trainer", "inference"), help=argparse.SUPPRESS)
    parser.add_argument("--rendezvous", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part == "trainer":
        trainer(args)
    elif args.part == "inference":
        inference(args)
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
