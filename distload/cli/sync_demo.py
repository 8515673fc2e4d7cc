"""``torchrun --nproc-per-node 3 -m distload sync-demo``: RLHF-style weight sync, end to end.

Rank 0 plays the trainer: it holds a Llama-shaped bf16 state dict, changes it a little each step
and pushes every version. Every other rank plays an inference worker: it holds the same tensors
(allocated once) and receives each version in place. Each update prints version, bytes and GB/s;
at the end every receiver's digest must equal the trainer's.
"""

from __future__ import annotations

import argparse

import torch

from distload.cli.demo import llama_layers, llama_shapes
from distload.group import WorkerGroup
from distload.live.sync import WeightSync
from distload.loading.report import state_digest


def _state(size_mib: int, device: torch.device) -> dict[str, torch.Tensor]:
    hidden, vocab = 512, 8192
    layers = llama_layers(size_mib, hidden, vocab, minimum=1)
    return {name: torch.zeros(shape, dtype=torch.bfloat16, device=device)
            for name, (shape, _) in llama_shapes(hidden, layers, vocab).items()}


def run_sync_demo(args: argparse.Namespace) -> int:
    with WorkerGroup(device=args.device, timeout_s=args.timeout) as group:
        if group.world_size < 2:
            print("sync-demo needs at least 2 ranks: torchrun --nproc-per-node 3 -m distload sync-demo")
            return 2
        sync = WeightSync([0], group=group, bucket_bytes=args.bucket_mib * 2**20)
        state = _state(args.size_mib, group.device)
        try:
            for version in range(1, args.steps + 1):
                if group.rank == 0:
                    generator = torch.Generator(device=group.device).manual_seed(version)
                    for tensor in state.values():  # "a training step"
                        tensor.add_(torch.randn(tensor.shape, generator=generator, device=group.device,
                                                dtype=torch.float32).to(tensor.dtype), alpha=0.01)
                    stats = sync.push(state, version)
                else:
                    stats = sync.receive(state)
                line = (f"rank {group.rank} {'pushed' if group.rank == 0 else 'received'} version "
                        f"{stats.version}: {stats.num_tensors} tensors in {stats.num_buckets} bucket(s), "
                        f"{stats.nbytes / 1e9:.3f} GB in {stats.seconds:.3f} s = {stats.gb_per_s:.2f} GB/s")
                print(line, flush=True)
            digests = group.exchange(state_digest(state))
        finally:
            sync.close()
        if group.rank == 0:
            same = all(d == digests[0] for d in digests)
            print(f"after {args.steps} versions every receiver's digest "
                  f"{'matches' if same else 'DOES NOT match'} the trainer's ({digests[0][:16]})", flush=True)
            return 0 if same else 1
    return 0
