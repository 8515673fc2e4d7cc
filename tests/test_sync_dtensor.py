"""A trainer job whose weights are DTensors (a gloo DeviceMesh of its own 2 ranks) pushes to a
separately launched inference job: every trainer rank takes part in gathering, rank 0 sends, and
a plain tensor one trainer rank owns travels from that rank."""

from __future__ import annotations

import concurrent.futures
import json
import sys

import pytest

from dist_helpers import clean_env, free_port, run_job, write_script

_JOB = """
import json, sys, torch
from distload.workers.group import WorkerGroup
from distload.live.channel import SyncChannel
role, address, out = sys.argv[1], sys.argv[2], sys.argv[3]

def whole(version):
    if version >= 2:  # the version before after a step that changed 1% of the elements: a delta
        out = whole(version - 1)  # (on one host a patch goes below about 1.5%: docs/delta-sync.md)
        for t in out.values():
            t.view(-1)[version::100] += 1
        return out
    g = torch.Generator().manual_seed(version)  # version 0 (the receivers' start) and 1
    return {"layers.0.w": torch.randn(64, 48, generator=g),                      # Shard(0)
            "layers.0.v": torch.randn(40, 24, generator=g).to(torch.bfloat16),   # Shard(1)
            "norm.weight": torch.randn(48, generator=g),                         # Replicate()
            "head.bias": torch.randn(4096, generator=g)}                         # plain, trainer rank 1's

with WorkerGroup(device="cpu", timeout_s=60) as group:
    result = {"rank": group.rank}
    if role == "trainer":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        mesh = init_device_mesh("cpu", (group.world_size,))
        with SyncChannel(address, "trainer", rank=group.rank, size=group.world_size, device="cpu",
                         timeout_s=60, bucket_bytes=8192) as channel:
            result["sent"], result["delta"] = [], []
            for version in (1, 2, 3):
                full = whole(version)
                state = {"layers.0.w": distribute_tensor(full["layers.0.w"], mesh, [Shard(0)]),
                         "layers.0.v": distribute_tensor(full["layers.0.v"], mesh, [Shard(1)]),
                         "norm.weight": distribute_tensor(full["norm.weight"], mesh, [Replicate()])}
                if group.rank == 1:
                    state["head.bias"] = full["head.bias"]
                stats = channel.push(state, version)
                result["sent"].append(stats.num_tensors)
                result["delta"].append(stats.delta)
    else:
        held = {n: torch.zeros_like(t) for n, t in whole(0).items()}
        with SyncChannel(address, "inference", rank=group.rank, size=group.world_size, device="cpu",
                         timeout_s=60) as channel:
            result["versions"], result["exact"], result["delta"] = [], [], []
            for _ in (1, 2, 3):
                stats = channel.receive(held)
                result["versions"].append(stats.version)
                result["delta"].append(stats.delta)
                result["exact"].append(all(torch.equal(held[n], t) for n, t in whole(stats.version).items()))
    with open(f"{out}/{role}{group.rank}.json", "w") as f:
        json.dump(result, f)
"""


def _torchrun(script, nproc, *args):
    import subprocess

    return run_job([script, *args], nproc, 180, clean_env(), torchrun=True)


@pytest.mark.slow
@pytest.mark.dist
def test_dtensor_trainer_ranks_gather_and_rank_0_sends(tmp_path):
    script = write_script(tmp_path, "job.py", _JOB)
    address = f"tcp://127.0.0.1:{free_port()}"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        trainer = pool.submit(_torchrun, script, 2, "trainer", address, str(tmp_path))
        inference = pool.submit(_torchrun, script, 1, "inference", address, str(tmp_path))
        runs = [trainer.result(), inference.result()]
    for run in runs:
        assert run.returncode == 0, run.stderr[-4000:]
    t0, t1 = (json.loads((tmp_path / f"trainer{r}.json").read_text()) for r in (0, 1))
    assert t0["sent"] == [3] * 3 and t1["sent"] == [1] * 3  # DTensors from rank 0, its own plain tensor from 1
    # After the first update each trainer rank sends a delta against its own base (rank 0's of the
    # gathered DTensors).
    assert t0["delta"] == t1["delta"] == [False, True, True], (t0, t1)
    received = json.loads((tmp_path / "inference0.json").read_text())
    assert received["versions"] == [1, 2, 3] and received["exact"] == [True] * 3, received
    assert received["delta"] == [False, True, True], received
