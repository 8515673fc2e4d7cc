"""``distload sync-demo``: RLHF-style weight sync, end to end.

Inside one job (``torchrun --nproc-per-node 3 -m distload sync-demo``) rank 0 plays the trainer
and the other ranks the inference workers. Across two jobs, each started by its own command::

    torchrun --nproc-per-node 1 -m distload sync-demo --role trainer --rendezvous tcp://HOST:PORT
    torchrun --nproc-per-node 2 -m distload sync-demo --role inference --rendezvous tcp://HOST:PORT \\
        --tensor-parallel-size 2

The trainer holds a Llama-shaped bf16 state dict and pushes ``--versions`` versions of it (each
version's values come from a seed, so any rank can recompute what it should hold). With
``--change 0.01`` versions change like training steps (1% of the elements each), so every update
after the first is a delta: the lines show its bytes on the wire against the first. (Across hosts
a patch pays up to about 12% of the elements changed; on one host, where a byte costs a memory
copy, below about 1.5%: docs/delta-sync.md.) Each
inference rank holds its tensors (whole, or its tensor-parallel slices), allocated once, and
receives each version in place; it prints and reports version, digest, bytes and seconds, and
checks its digest against the slices of the version it was sent.
"""

from __future__ import annotations

import argparse
import json

import torch

from distload.cli.demo import llama_layers, llama_shapes
from distload.workers.group import WorkerGroup
from distload.live.channel import SyncChannel
from distload.live.sync import WeightSync
from distload.loading.report import gib_per_s, gib_text, rate_means_something, state_digest
from distload.tp.spec import load_spec
from distload.tp.slices import take_shard

HIDDEN, VOCAB, HEAD_DIM = 512, 8192, 64


def demo_config(hidden: int = HIDDEN) -> dict[str, int]:
    """The config.json of the demo's model (what head-aware sharding specs need)."""
    return {"hidden_size": hidden, "num_attention_heads": hidden // HEAD_DIM,
            "num_key_value_heads": hidden // 4 // HEAD_DIM, "head_dim": HEAD_DIM, "vocab_size": VOCAB}


def demo_shapes(size_mib: int, hidden: int = HIDDEN) -> dict[str, tuple[int, ...]]:
    """``hidden`` 512: many small tensors (a quick demo); 2048: the tens-of-MiB tensors of real models."""
    layers = llama_layers(size_mib, hidden, VOCAB, minimum=1)
    return {name: shape for name, (shape, _) in llama_shapes(hidden, layers, VOCAB).items()}


def demo_state(size_mib: int, version: int, device: torch.device, hidden: int = HIDDEN,
               change: float | None = None) -> dict[str, torch.Tensor]:
    """Version ``version`` of the demo's weights (a seeded function of the version, drawn on the
    host so that a trainer and an inference rank on different devices agree on it). With
    ``change``, versions change like training steps: version v is version v - 1 with the lowest
    bit of a seeded ``change`` fraction of its elements flipped (what a bf16 cast of an optimizer
    step does to a few percent of them)."""
    if change is None or version <= 1:
        generator = torch.Generator().manual_seed(version)
        return {name: torch.randn(shape, generator=generator).to(torch.bfloat16).to(device)
                for name, shape in demo_shapes(size_mib, hidden).items()}
    state = demo_state(size_mib, 1, torch.device("cpu"), hidden)
    for step in range(2, version + 1):
        generator = torch.Generator().manual_seed(10_000 + step)
        for tensor in state.values():
            bits = tensor.view(torch.int16).reshape(-1)
            bits[torch.rand(bits.numel(), generator=generator) < change] ^= 1
    return {name: tensor.to(device) for name, tensor in state.items()}


def kept_slices(state: dict[str, torch.Tensor], tp_size: int, tp_rank: int,
                hidden: int = HIDDEN) -> dict[str, torch.Tensor]:
    """What TP rank ``tp_rank`` of ``tp_size`` keeps of ``state`` (the decoder spec's slices)."""
    if tp_size == 1:
        return state
    spec = load_spec("decoder", demo_config(hidden))
    return {name: take_shard(t, spec.action(name, tuple(t.shape)), tp_rank, tp_size, name)
            for name, t in state.items()}


def _delta_note(stats, what: str) -> str:
    """What a line adds about a delta update: ``what``, and the tensors it sent whole (a patch of
    them would not have paid: every element changed, say)."""
    if not stats.delta:
        return ""
    if not stats.sent_whole:
        return f" ({what})"
    return (f" ({what}; {len(stats.sent_whole)} of {stats.num_tensors} tensors, {gib_text(stats.whole_bytes)}, "
            f"sent whole: too many of their elements changed for a patch to pay)")


def _rate(nbytes: int, seconds: float) -> str:
    """`` = X GiB/s`` (the unit of every distload report), where the update was big and long
    enough for a rate to be a speed."""
    return f" = {gib_per_s(nbytes, seconds):.2f} GiB/s" if rate_means_something(nbytes, seconds) else ""


def run_sync_demo(args: argparse.Namespace) -> int:
    if args.role is None:
        return _one_job(args)
    assert args.rendezvous is not None  # main.check_arguments refused --role without it, on every rank alike
    with WorkerGroup(device=args.device, timeout_s=args.timeout) as group:  # this job's own ranks
        tp_size = args.tensor_parallel_size if args.role == "inference" else 1
        channel = SyncChannel(args.rendezvous, args.role, rank=group.rank, size=group.world_size,
                              device=str(group.device), timeout_s=args.timeout,
                              bucket_bytes=args.bucket_mib * 2**20, verify=not args.no_verify,
                              delta=not args.no_delta, tensor_parallel_size=tp_size,
                              sharding="decoder" if tp_size > 1 else None,
                              model_config=demo_config() if tp_size > 1 else None,
                              secret_file=args.secret_file, insecure=args.insecure)
        with channel:
            if args.role == "trainer":
                rows = _train(channel, args, group)
            else:
                rows = _infer(channel, args, group, tp_size)
        reports = group.exchange(rows)
        ok = all(row.get("matches", True) for rank_rows in reports for row in rank_rows)
        if group.rank == 0:
            if args.report_json:
                with open(args.report_json, "w", encoding="utf-8") as f:
                    json.dump({"role": args.role, "ranks": [{"rank": r, "versions": rows_of_rank}
                                                            for r, rows_of_rank in enumerate(reports)]}, f, indent=1)
            if args.role == "inference":
                print(f"every inference rank holds exactly the slices it was sent: {'yes' if ok else 'NO'}",
                      flush=True)
        return 0 if ok else 1


def _train(channel: SyncChannel, args: argparse.Namespace, group: WorkerGroup) -> list[dict]:
    rows = []
    for version in range(1, args.versions + 1):
        # Several trainer ranks split the tensors between them (disjoint names).
        state = demo_state(args.size_mib, version, group.device, change=args.change)
        mine = {n: t for i, (n, t) in enumerate(state.items()) if i % group.world_size == group.rank}
        stats = channel.push(mine, version)
        print(f"trainer rank {group.rank} pushed version {version}: {stats.num_tensors} tensors in "
              f"{stats.num_buckets} bucket(s), {gib_text(stats.wire_bytes)} sent in {stats.seconds:.3f} s"
              f"{_delta_note(stats, 'a delta: what changed since the version the receivers hold')}",
              flush=True)
        rows.append({"version": version, "bytes_sent": stats.wire_bytes, "seconds": round(stats.seconds, 4),
                     "delta": stats.delta})
    return rows


def _infer(channel: SyncChannel, args: argparse.Namespace, group: WorkerGroup, tp_size: int) -> list[dict]:
    tp_rank = group.rank % tp_size
    held = {n: torch.zeros_like(t) for n, t in kept_slices(demo_state(args.size_mib, 0, group.device),
                                                           tp_size, tp_rank).items()}
    rows = []
    for _ in range(args.versions):
        stats = channel.receive(held)
        digest = state_digest(held)
        expected = state_digest(kept_slices(demo_state(args.size_mib, stats.version, group.device, change=args.change),
                                            tp_size, tp_rank))
        print(f"inference rank {group.rank} (TP rank {tp_rank} of {tp_size}) received version {stats.version}: "
              f"{gib_text(stats.wire_bytes)} in {stats.seconds:.3f} s, digest {digest[:16]} "
              f"({'matches' if digest == expected else 'DOES NOT match'} the version sent"
              f"{', a delta' if stats.delta else ''}"
              f"{f' ({len(stats.sent_whole)} tensors of it whole)' if stats.sent_whole else ''}"
              f"{', verified' if stats.verified else ''})", flush=True)
        rows.append({"version": stats.version, "digest": digest, "matches": digest == expected,
                     "bytes_received": stats.wire_bytes, "tensor_bytes": stats.nbytes,
                     "seconds": round(stats.seconds, 4), "verified": stats.verified, "delta": stats.delta})
    return rows


def _one_job(args: argparse.Namespace) -> int:
    with WorkerGroup(device=args.device, timeout_s=args.timeout) as group:
        if group.world_size < 2:
            print("sync-demo needs at least 2 ranks: torchrun --nproc-per-node 3 -m distload sync-demo "
                  "(or --role/--rendezvous for two jobs)")
            return 2
        sync = WeightSync([0], group=group, bucket_bytes=args.bucket_mib * 2**20, verify=not args.no_verify,
                          delta=not args.no_delta)
        state = {n: torch.zeros_like(t) for n, t in demo_state(args.size_mib, 0, group.device).items()}
        try:
            for version in range(1, args.versions + 1):
                if group.rank == 0:
                    state = demo_state(args.size_mib, version, group.device, change=args.change)
                    stats = sync.push(state, version)
                else:
                    stats = sync.receive(state)
                print(f"rank {group.rank} {'pushed' if group.rank == 0 else 'received'} version "
                      f"{stats.version}: {stats.num_tensors} tensors in {stats.num_buckets} bucket(s), "
                      f"{gib_text(stats.nbytes)} in {stats.seconds:.3f} s{_rate(stats.nbytes, stats.seconds)}, "
                      f"{gib_text(stats.wire_bytes)} on the wire{_delta_note(stats, 'a delta')}", flush=True)
            digests = group.exchange(state_digest(state))
        finally:
            sync.close()
        if group.rank == 0:
            same = all(d == digests[0] for d in digests)
            print(f"after {args.versions} versions every receiver's digest "
                  f"{'matches' if same else 'DOES NOT match'} the trainer's ({digests[0][:16]})", flush=True)
            return 0 if same else 1
    return 0
