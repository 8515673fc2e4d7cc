"""A plain Ray job: a trainer actor pushes each version of its model to inference actors over
distload's weight-sync channel; each inference actor receives it in place (delta updates after
the first, every update verified) and checks it against the trainer's digest.

    pip install "distload[verl]"          # Ray comes with verl; or pip install ray distload
    python examples/ray_weight_sync.py                  # 1 trainer -> 2 inference actors, CPU
    python examples/ray_weight_sync.py --vllm MODEL     # the inference actors are vLLM engines

With ``--vllm`` each inference actor starts a vLLM engine on MODEL (a Hugging Face folder) with
distload's worker extension, joins the channel (``sync_join``) and takes each version into the
running engine (``sync_receive``); the trainer pushes MODEL's own tensors, moved a little each
step. Without it the inference actors hold a plain torch module of the same tensors.

Every actor proves the job secret to the channel (docs/security.md): the actors read
``DISTLOAD_SECRET_FILE`` from the environment Ray gives them. Without one set, this script makes
one in a file only this user can read and passes its path (never the secret: Ray shows a job's
environment in its dashboard) through ``runtime_env``; on a cluster of several nodes, put the file
where every node reads it.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile

import ray
import torch

import distload
from distload import SyncChannel


def _free_address() -> str:
    host = ray.util.get_node_ip_address().strip("[]")
    with socket.socket() as probe:
        probe.bind((host, 0))
        return f"tcp://{host}:{probe.getsockname()[1]}"


def initial_state(model: str | None) -> dict[str, torch.Tensor]:
    if model is not None:
        return dict(distload.iter_tensors(model, device="cpu"))
    generator = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(256, 256, generator=generator).to(torch.bfloat16) for i in range(8)}


@ray.remote(num_cpus=1)
class Trainer:
    """Holds the model and pushes a version of it every step (a training step moves about 1% of
    the bf16 weights; here a seeded function of the step does). Every update after the first
    is a delta: on one host a patch goes where under about 1.5% of the elements changed, across
    hosts under about 12% (docs/delta-sync.md)."""

    def __init__(self, model: str | None, timeout_s: float):
        self.state = initial_state(model)
        self.channel = SyncChannel(_free_address(), "trainer", rank=0, size=1, device="cpu", timeout_s=timeout_s)

    def address(self) -> str:
        return self.channel.address

    def step_and_push(self, step: int) -> dict:
        generator = torch.Generator().manual_seed(step)
        for tensor in self.state.values():
            flat = tensor.view(-1)
            where = torch.randint(0, flat.numel(), (max(1, flat.numel() // 128),), generator=generator)
            flat[where] = (flat[where].float() * 1.01).to(flat.dtype)
        stats = self.channel.push(self.state, version=step)
        return {"version": stats.version, "delta": stats.delta, "verified": stats.verified,
                "wire_bytes": stats.wire_bytes, "digest": distload.state_digest(self.state)}

    def close(self) -> None:
        self.channel.close()


@ray.remote(num_cpus=1)
class Inference:
    """An inference member: a torch module of the trainer's tensors, or a vLLM engine."""

    def __init__(self, address: str, rank: int, size: int, model: str | None, vllm: bool, timeout_s: float):
        self.llm = None
        if vllm:
            from vllm import LLM

            from distload.vllm.plugin import sync_join

            self.llm = LLM(model, worker_extension_cls="distload.vllm.plugin.WorkerExtension", enforce_eager=True)
            sync_join(self.llm, address, timeout_s=timeout_s)
        else:
            self.tensors = {name: torch.empty_like(t) for name, t in initial_state(model).items()}
            self.channel = SyncChannel(address, "inference", rank=rank, size=size, device="cpu", timeout_s=timeout_s)

    def receive(self) -> dict:
        if self.llm is not None:
            from distload.vllm.plugin import sync_receive

            return {"version": sync_receive(self.llm)["version"]}
        stats = self.channel.receive(self.tensors)
        return {"version": stats.version, "delta": stats.delta, "verified": stats.verified,
                "digest": distload.state_digest(self.tensors)}

    def close(self) -> None:
        if self.llm is None:
            self.channel.close()


def run(steps: int = 3, inference: int = 2, vllm_model: str | None = None, timeout_s: float = 60.0) -> list[dict]:
    """Start the actors in the Ray cluster already initialised, push ``steps`` versions, and
    return what the trainer and each inference actor saw at each step."""
    trainer = Trainer.remote(vllm_model, timeout_s)
    address = ray.get(trainer.address.remote())
    members = [Inference.remote(address, rank, inference, vllm_model, vllm_model is not None, timeout_s) for rank in range(inference)]
    out = []
    try:
        for step in range(1, steps + 1):
            # Receivers first: each waits for the version while the trainer pushes it.
            receiving = [member.receive.remote() for member in members]
            pushed = ray.get(trainer.step_and_push.remote(step))
            out.append({"trainer": pushed, "inference": ray.get(receiving)})
    finally:
        ray.get([member.close.remote() for member in members])
        ray.get(trainer.close.remote())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--inference", type=int, default=2, help="inference actors")
    parser.add_argument("--vllm", metavar="MODEL", help="inference actors are vLLM engines on this model")
    args = parser.parse_args()
    env = {}
    if not (os.environ.get("DISTLOAD_SECRET") or os.environ.get("DISTLOAD_SECRET_FILE")):
        from distload.live.secret import make_secret

        fd, path = tempfile.mkstemp(prefix="distload-secret-")  # mode 600
        with os.fdopen(fd, "w") as f:
            f.write(make_secret())
        env["DISTLOAD_SECRET_FILE"] = path
    # A local cluster gets a logical CPU for each actor (each asks for one), even on a 2-core
    # machine, where Ray's default would leave an inference actor unplaced and the trainer waiting.
    local = {} if os.environ.get("RAY_ADDRESS") else {"num_cpus": max(os.cpu_count() or 1, 1 + args.inference)}
    ray.init(runtime_env={"env_vars": env} if env else None, **local)
    for row in run(args.steps, args.inference, args.vllm):
        pushed = row["trainer"]
        same = all(r.get("digest", pushed["digest"]) == pushed["digest"] for r in row["inference"])
        print(f"version {pushed['version']}: {'delta' if pushed['delta'] else 'full'}, "
              f"{pushed['wire_bytes'] / 2**20:.2f} MiB sent, verified {pushed['verified']}, "
              f"every inference actor holds it exactly: {same}")


if __name__ == "__main__":
    main()
