"""Where a delta update's CPU time goes: delta.py's stages, in one process, on a real step.

    python benchmarks/profile_delta.py [--scratch DIR] [--step lr1e-06-step1] [--tp 2]

Makes (or reuses, in ``--scratch``) bench_sync.py --deltas' model versions, then runs the
trainer's side (find what changed, build each bucket's messages) and one receiver's (apply each
bucket, with its undo) of the update from v0 to ``--step``, three times, and prints each stage's
CPU seconds of this thread (the least of the three: CPU time, so that a shared machine's waits
are not counted). Runs against older checkouts too (PYTHONPATH=an export of one), whose stages
had other names: what it finds is timed. Figures: docs/delta-sync.md, "Speed".
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

from distload.live.transfer import BucketKey

KEY = BucketKey(None, "profile", 0, 0)  # the buckets' tags (transfer.checksum), as with no job secret

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

STAGES = ("diff", "piece_patch", "encode", "patch_sum", "patch_sums", "checksum", "decode", "apply")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scratch", default="/tmp/distload-bench-sync-deltas")
    parser.add_argument("--step", default="lr1e-06-step1")
    parser.add_argument("--tp", type=int, default=1, help="the receiver keeps TP rank 0's slices of this size")
    args = parser.parse_args()
    # distload first: as PYTHONPATH finds it (bench_sync puts this checkout first on the path)
    from distload.live import delta as deltas
    from distload.live.transfer import SyncTensor, group_entries, layouts
    from distload.loading.index import dtype_code
    from distload.tp.place import TPPlace
    from distload.tp.slices import take_shard
    from distload.tp.spec import load_spec

    import bench_sync

    os.makedirs(args.scratch, exist_ok=True)
    bench_sync._versions(args.scratch)
    old, new = bench_sync._load(args.scratch, "v0"), bench_sync._load(args.scratch, args.step)
    names = list(new)
    entries = [SyncTensor(n, dtype_code(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for n, t in new.items()]
    groups = group_entries(entries, 64 << 20)
    spec = load_spec("decoder", bench_sync.LLAMA) if args.tp > 1 else None
    place = TPPlace(args.tp, 0, spec) if args.tp > 1 else TPPlace()
    plan = layouts(entries, groups, place, False)
    spent: collections.Counter = collections.Counter()
    bench_sync.time_stages(deltas, {stage: stage for stage in STAGES}, spent, time.thread_time)
    scratches = (deltas.PatchScratch(), deltas.PatchScratch(lanes=4)) if hasattr(deltas, "PatchScratch") else None

    def held(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if spec is None:
            return tensor.clone()
        return take_shard(tensor, spec.action(name, tuple(tensor.shape)), 0, args.tp, name).contiguous().clone()

    best: dict[tuple[str, str], float] = {}
    for _ in range(3):
        base = {n: t.clone() for n, t in old.items()}
        targets = {n: held(n, t) for n, t in old.items()}
        if scratches:
            for scratch in scratches:
                scratch.reset()
        spent.clear()
        start = time.thread_time()
        sent, patches = [], {}
        for i, group in enumerate(groups):
            whole = {k: new[names[k]] for k in group}
            made = {k: deltas.diff(whole[k], base[names[k]], *scratches[:1]) if scratches else
                    deltas.diff(whole[k], base[names[k]]) for k in group}
            patches.update(made)
            sent.append(deltas.send_bucket(plan[i], entries, whole, made, place, torch.device("cpu"), KEY))
        trainer = dict(spent, total=time.thread_time() - start)
        spent.clear()
        start = time.thread_time()
        undo = deltas.Undo()
        for i, (messages, row) in enumerate(sent):
            data = messages[1] if len(messages) > 1 else None
            extra = scratches[1:] if scratches else ()
            mine = deltas.receive_bucket(data, messages[0].tolist(), plan[i], entries, targets, undo, KEY, *extra)
            assert torch.equal(mine, row), f"bucket {i}: the receiver's check row is not the trainer's"
        receiver = dict(spent, total=time.thread_time() - start)
        copy = deltas.Base(None)
        copy.tensors = base
        start = time.thread_time()
        copy.commit({names[k]: p for k, p in patches.items()}, {}, "profile")
        trainer["commit"] = time.thread_time() - start
        for side, stages in (("trainer", trainer), ("receiver", receiver)):
            for stage, seconds in stages.items():
                best[(side, stage)] = min(best.get((side, stage), seconds), seconds)
    changed = sum(p.positions.numel() for p in patches.values())
    print(f"{args.step}, TP {args.tp}: {changed} of {sum(t.numel() for t in new.values())} elements changed; "
          f"load average {os.getloadavg()[0]:.2f}")
    for side in ("trainer", "receiver"):
        print(side, {stage: f"{seconds * 1e3:.1f} ms" for (s, stage), seconds in best.items() if s == side})
    return 0


if __name__ == "__main__":
    sys.exit(main())
