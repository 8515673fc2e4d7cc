"""The GPU check's multi-process cases (benchmarks/gpu_check.sh, step 6): each one path of
design/GPU_REVIEW.md run for real, under torchrun (``--nproc-per-node`` = the GPUs it needs) or
alone. Every rank prints ``CASE <name> ok: ...`` or raises; the exit status says which.

    torchrun --nproc-per-node N benchmarks/gpu_paths.py load CKPT FORMAT EXTRA TP EXPECTED_PATH
    RANK=r WORLD_SIZE=N ... python benchmarks/gpu_paths.py load-kill CKPT FORMAT EXTRA TP  # by hand
    torchrun --nproc-per-node N benchmarks/gpu_paths.py gloo-data CKPT
    torchrun --nproc-per-node N benchmarks/gpu_paths.py subgroup CKPT
    python benchmarks/gpu_paths.py reload-sleep CKPT
    python benchmarks/gpu_paths.py sync-peer ROLE ADDRESS MIB [KILL]   # one side of a two-job sync
"""

from __future__ import annotations

import glob
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import distload
from distload.errors import BackendUnavailableError, SyncError
from distload.loading.report import state_digest


def say(case: str, rank: int, text: str) -> None:
    print(f"CASE {case} rank {rank} ok: {text}", flush=True)


def reference(ckpt: str) -> tuple[str, int]:
    """The checkpoint's digest and bytes, read with safetensors on the host."""
    from safetensors.torch import load_file
    state: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(ckpt, "*.safetensors"))):
        state.update(load_file(path))
    return state_digest(state), sum(t.numel() * t.element_size() for t in state.values())


def case_load(ckpt: str, fmt: str, extra: str, tp: str, expected: str) -> None:
    """A load over the job's NCCL group: the path it took on every rank, the device, the digest
    (whole loads) or the GPU memory it kept (TP loads: a cut slice must not keep its whole tensor,
    finding 9)."""
    tp_size = int(tp) or None
    on_gpu = torch.cuda.is_available()  # without one (a dry run of this driver) the same on the host
    with distload.WorkerGroup() as group:
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(group.device)
        result = distload.Loader(ckpt, fmt, json.loads(extra) if extra else None, group=group,
                                 tensor_parallel_size=tp_size).load(gather=True, digest=True)
        paths = {r.path for r in result.report.ranks}
        assert paths == {expected}, f"paths {paths}, expected {expected}"
        assert all(r.device.startswith("cuda" if on_gpu else "cpu") for r in result.report.ranks), result.report.ranks
        digest, nbytes = reference(ckpt)
        if tp_size is None:
            assert {r.digest for r in result.report.ranks} == {digest}, "digest differs from safetensors'"
        elif on_gpu:
            peak = torch.cuda.max_memory_allocated(group.device)
            bound = nbytes / tp_size * 1.25 + 64 * 2**20  # slices, replicated norms, allocator rounding
            assert peak <= bound, f"peak GPU memory {peak / 2**20:.0f} MiB > {bound / 2**20:.0f} MiB for TP {tp_size}"
        say("load", group.rank, f"{fmt} {extra or '{}'} tp={tp} path={expected} on {group.device}")


def case_load_kill(ckpt: str, fmt: str, extra: str, tp: str) -> None:
    """A shared read whose last rank SIGKILLs itself after its first tensor, ranks started by hand
    (torchrun's agent would end the others first). The others must raise GroupError naming it
    within seconds, not wait for the group's timeout nor die of torch's watchdog (findings 8, 14)."""
    from distload.errors import GroupError
    with distload.WorkerGroup(timeout_s=120) as group:
        start = time.monotonic()
        stream = distload.Loader(ckpt, fmt, json.loads(extra) if extra else None, group=group,
                                 tensor_parallel_size=int(tp) or None).stream()
        try:
            for _ in stream:
                if group.rank == group.world_size - 1:
                    os.kill(os.getpid(), signal.SIGKILL)
        except GroupError as exc:
            took = time.monotonic() - start
            assert took < 60, f"the lost rank was noticed after {took:.0f} s"
            say("load-kill", group.rank, f"{fmt}: GroupError after {took:.1f} s: {str(exc)[:200]}")
            os._exit(0)  # the group's teardown would wait on the dead rank
        raise AssertionError("the load finished although a rank was killed")


def case_gloo_data(ckpt: str) -> None:
    """CUDA tensors over a gloo data group (vLLM's cpu_group, findings 3 and 4): distload's shared
    read stages its buckets through the host; InstantTensor refuses before reading."""
    with distload.WorkerGroup() as job:
        gloo = dist.new_group(backend="gloo")
        group = distload.WorkerGroup(process_group=gloo)
        assert group.wire_device.type == "cpu"
        result = distload.Loader(ckpt, "auto", {"distributed": "job"}, group=group).load(gather=True, digest=True)
        assert {r.path for r in result.report.ranks} == {"pread-shared"}, result.report.ranks
        assert {r.digest for r in result.report.ranks} == {reference(ckpt)[0]}
        try:
            distload.Loader(ckpt, "instanttensor", group=group).load()
        except BackendUnavailableError as exc:
            assert "NCCL process group only" in str(exc), exc
        else:
            raise AssertionError("InstantTensor read over a gloo group")
        group.close()
        dist.destroy_process_group(gloo)
        say("gloo-data", job.rank, "shared read staged through the host; instanttensor refused")


def case_subgroup(ckpt: str) -> None:
    """An uneven subgroup on NCCL (finding 5): the ranks left out must not hang in a split."""
    with distload.WorkerGroup() as job:
        members = list(range(max(1, job.world_size // 2)))
        sub = job.subgroup(members)
        if sub is not None:
            result = distload.Loader(ckpt, "auto", {"distributed": "job"}, group=sub).load(gather=True, digest=True)
            assert {r.digest for r in result.report.ranks} == {reference(ckpt)[0]}
            sub.close()
        job.exchange("after")  # every rank, members or not, reaches this
        say("subgroup", job.rank, f"subgroup {members} of {job.world_size} loaded; the others went on")


def case_reload_sleep(ckpt: str) -> None:
    """reload_into and WeightSleeper on CUDA: the memory a sleep releases is free for other
    processes (cudaMemGetInfo), and the values come back (finding 13)."""
    with distload.WorkerGroup(device="cuda:0") as group:
        state = distload.load(ckpt, "safetensors", group=group)
        digest = state_digest(state)
        for t in state.values():
            t.zero_()
        distload.reload_into(state, ckpt, "safetensors", group=group)
        assert state_digest(state) == digest, "reload_into wrote other values"
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        sleeper = distload.WeightSleeper(state)
        for level in (1, 2):
            torch.cuda.synchronize()
            free0 = torch.cuda.mem_get_info()[0]
            sleeper.sleep(level)
            freed = torch.cuda.mem_get_info()[0] - free0
            assert freed >= 0.9 * nbytes, f"level {level}: sleep freed {freed} of {nbytes} bytes for other processes"
            sleeper.wake()
            if level == 1:
                assert state_digest(state) == digest, "level 1 woke with other values"
        say("reload-sleep", 0, f"reloaded; sleep released {nbytes / 2**20:.0f} MiB to the driver at levels 1 and 2")


def case_sync_peer(role: str, address: str, mib: str, kill: str = "") -> None:
    """One job of a two-job weight sync on the device (NCCL where the jobs have GPUs of their
    own, gloo where they share one, finding 7). With ``kill``, the trainer SIGKILLs itself in
    its second push; the receiver must raise SyncError and live (findings 1, 2, 16)."""
    with distload.WorkerGroup() as group:
        numel = int(mib) * 2**20 // 2
        state = {f"w{i}": torch.full((numel // 8,), float(i), dtype=torch.bfloat16, device=group.device)
                 for i in range(8)}
        # The inference job serves the rendezvous: the store outlives a killed trainer.
        channel = distload.SyncChannel(address, role, rank=0, size=1, host="inference", device=str(group.device),
                                       timeout_s=60)
        with channel:
            if role == "trainer":
                channel.push(state, 1)
                if kill:
                    # Dies right after its first send of version 2 is posted: the receiver's later
                    # receives wait on a peer that is gone (on NCCL, kernels spinning on its GPU).
                    from distload.live.session import Session
                    post = Session.post
                    Session.post = lambda self, peer, tensor: (post(self, peer, tensor),
                                                               os.kill(os.getpid(), signal.SIGKILL))[0]
                for t in state.values():
                    t.add_(1)
                full = channel.push(state, 2)
                _step(state)  # a training step's few changed elements: compared on the device
                delta = channel.push(state, 3)
                assert delta.delta, "version 3 went whole: the trainer's delta base was not used"
                say("sync-peer", 0, f"trainer pushed 3 versions; the delta (version 3) sent "
                                    f"{delta.wire_bytes / full.wire_bytes:.4f}x the bytes and {delta.seconds / full.seconds:.3f}x "
                                    f"the time ({delta.seconds:.3f} s) of version 2, whose every element changed")
                return
            target = {name: torch.empty_like(t) for name, t in state.items()}
            channel.receive(target)
            assert all(torch.equal(target[n], state[n]) for n in state), "version 1 arrived wrong"
            start = time.monotonic()
            try:
                channel.receive(target, timeout_s=120)
            except SyncError as exc:
                assert kill, f"version 2 failed: {exc}"
                say("sync-peer", 0, f"receiver raised SyncError after {time.monotonic() - start:.1f} s and lives: "
                                    f"{str(exc)[:160]}")
                if group.device.type == "cuda":  # a given-up transfer must not hang the device (finding 1)
                    torch.cuda.synchronize(group.device)
                return
            assert not kill, "version 2 arrived from a killed trainer"
            assert all(torch.equal(target[n], state[n] + 1) for n in state), "version 2 arrived wrong"
            stats = channel.receive(target)
            for t in state.values():
                t.add_(1)
            _step(state)
            assert stats.delta and all(torch.equal(target[n], state[n]) for n in state), "version 3 arrived wrong"
            say("sync-peer", 0, "receiver got 3 versions, the third a delta, bit for bit")


def _step(state: dict[str, torch.Tensor]) -> None:
    """Flip the lowest bit of a seeded 2% of every tensor's elements (a bf16 optimizer step's
    size of change), the same on both jobs."""
    generator = torch.Generator().manual_seed(3)
    for t in state.values():
        bits = t.view(torch.int16)
        hit = (torch.rand(bits.numel(), generator=generator) < 0.02).to(bits.device)
        bits[hit] ^= 1


CASES = {"load": case_load, "load-kill": case_load_kill, "gloo-data": case_gloo_data, "subgroup": case_subgroup,
         "reload-sleep": case_reload_sleep, "sync-peer": case_sync_peer}

if __name__ == "__main__":
    CASES[sys.argv[1]](*sys.argv[2:])
