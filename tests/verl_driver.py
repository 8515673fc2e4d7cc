"""Runs inside verl's own environment (.verl-venv), started by tests/test_verl_engine.py: verl's
checkpoint-engine protocol driven step by step as verl's CheckpointEngineManager drives it, over
the ``distload`` engine, in separate processes or inside a local Ray cluster. Prints one line
``RESULT {json}``.

    python tests/verl_driver.py processes ray

``processes``: 1 actor worker -> 2 rollout workers, spawned processes, the driver playing verl's
CheckpointEngineManager (a rollout worker killed mid-update, then replaced); ``ray``: verl's own
manager, worker groups and rollout worker class in a local Ray cluster. One interpreter for both
(importing verl takes several seconds here).

Every worker makes the same versions itself (``version_state``): a random bf16/fp32 state, then
each step moves about 0.5% of its elements, as an optimizer step does; a rollout worker compares
what it received with its own copy bit for bit.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import secrets
import sys
import time
import traceback

SHAPES = {"embed.weight": ((512, 256), "bfloat16"), "layers.0.qkv.weight": ((768, 256), "bfloat16"),
          "layers.0.mlp.weight": ((1024, 256), "bfloat16"), "layers.0.norm.weight": ((256,), "float32"),
          "lm_head.weight": ((512, 256), "bfloat16")}  # about 1.8 MiB in 5 tensors
BUCKET = 128 << 10  # buckets of 128 KiB: several per update, so a kill lands mid-update
TIMEOUT_S = 20.0
KWARGS = {"timeout_s": TIMEOUT_S, "host": "127.0.0.1"}


def version_state(step: int) -> dict:
    """The actor's weights at ``step`` (0: initial): the same in every process. Each step moves
    about 0.5% of the elements from the initial weights (so two steps differ in about 1%: on one
    host a patch goes below about 1.5%, docs/delta-sync.md)."""
    import torch

    state = {}
    for i, (name, (shape, dtype)) in enumerate(SHAPES.items()):
        tensor = torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(getattr(torch, dtype))
        if step:
            gen = torch.Generator().manual_seed(1000 * step + i)
            flat = tensor.view(-1)
            where = torch.randint(0, flat.numel(), (max(1, flat.numel() // 200),), generator=gen)
            flat[where] += (torch.randn(where.numel(), generator=gen) * 0.01).to(flat.dtype) + flat[where] * 0.01
        state[name] = tensor
    return state


def exact(got: dict, step: int) -> list[str]:
    """Names that differ from the actor's step ``step`` (bit for bit), or are missing or extra."""
    import torch

    want = version_state(step)
    bad = sorted(set(want) ^ set(got))
    for name, tensor in want.items():
        if name in got and not (got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
                                and torch.equal(got[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8))):
            bad.append(name)
    return bad


async def consume(weights) -> dict:
    got = {}
    async for name, tensor in weights:
        got[name] = tensor.clone()  # as a server adapter does: the engine rewrites its tensors next update
    return got


def die_in_the_third_bucket() -> None:
    """This process is SIGKILLed while it waits for its third bucket of the next update."""
    from distload.live import session

    real, calls = session.Session.wait, []

    def wait(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *args, **kwargs)

    session.Session.wait = wait


# -- separate processes: the driver plays verl's CheckpointEngineManager ------------------------

def worker(conn, is_master: bool) -> None:
    import distload.verl  # noqa: F401 - what verl's custom_backend_module imports: it registers "distload"
    from verl.checkpoint_engine import CheckpointEngineRegistry

    engine = CheckpointEngineRegistry.new("distload", bucket_size=BUCKET, is_master=is_master, **KWARGS)
    while True:
        command, arg = conn.recv()
        start = time.monotonic()
        try:
            if command == "prepare":
                out = engine.prepare()
            elif command == "init":
                out = engine.init_process_group(**arg)
            elif command == "send":
                out = asyncio.run(engine.send_weights(iter(version_state(arg).items()), global_steps=arg))
            elif command == "receive":
                got = asyncio.run(consume(engine.receive_weights(global_steps=arg)))
                stats = engine.last_stats
                out = {"wrong": exact(got, arg), "version": stats.version, "delta": stats.delta,
                       "verified": stats.verified, "nbytes": stats.nbytes, "transport": stats.transport}
            elif command == "finalize":
                out = engine.finalize()
            elif command == "die":
                out = die_in_the_third_bucket()
            elif command == "exit":
                engine.close()
                conn.send(("ok", None, 0.0))
                return
            conn.send(("ok", out, time.monotonic() - start))
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which asserts on it
            conn.send(("error", f"{type(exc).__name__}: {exc}", time.monotonic() - start))


class Workers:
    """The actor and rollout workers, as verl's worker groups hold them."""

    def __init__(self, context, actors: int, rollouts: int):
        self.context = context
        self.actors = [self._start(i == 0) for i in range(actors)]
        self.rollouts = [self._start(False) for _ in range(rollouts)]

    def _start(self, is_master: bool):
        mine, theirs = self.context.Pipe()
        process = self.context.Process(target=worker, args=(theirs, is_master), daemon=True)
        process.start()
        return process, mine

    def call(self, workers, command, args) -> list:
        for (_, conn), arg in zip(workers, args):
            conn.send((command, arg))
        return self._answers(workers)

    def form(self) -> None:
        """CheckpointEngineManager.build_process_group: prepare, build_topology, init_process_group."""
        from distload.verl import DistloadCheckpointEngine

        everyone = self.actors + self.rollouts
        metadata = [_ok(r) for r in self.call(everyone, "prepare", [None] * len(everyone))]
        actor_kwargs, rollout_kwargs = DistloadCheckpointEngine.build_topology(len(self.actors), len(self.rollouts),
                                                                               metadata)
        for workers, kwargs in ((self.actors, actor_kwargs), (self.rollouts, rollout_kwargs)):
            for (_, conn), i in zip(workers, range(len(workers))):
                conn.send(("init", {k: v[i] for k, v in kwargs.items()}))
        for process, conn in everyone:
            _ok(conn.recv())

    def update(self, step: int) -> dict:
        """One update: the actors send ``step`` while the rollout workers receive it, then finalize."""
        everyone = self.actors + self.rollouts
        for (_, conn) in self.actors:
            conn.send(("send", step))
        for (_, conn) in self.rollouts:
            conn.send(("receive", step))
        answers = self._answers(everyone)
        if all(r[0] == "ok" for r in answers):
            for r in self.call(everyone, "finalize", [None] * len(everyone)):
                _ok(r)
        return {"actors": answers[: len(self.actors)], "rollouts": answers[len(self.actors):]}

    def _answers(self, workers) -> list:
        out = []
        for process, conn in workers:
            try:
                out.append(conn.recv() if conn.poll(TIMEOUT_S + 60) else
                           ("error", f"no answer from pid {process.pid} within {TIMEOUT_S + 60:.0f} s", None))
            except EOFError:
                out.append(("died", f"pid {process.pid} died", None))
        return out


def _ok(answer):
    status, out, _ = answer
    if status != "ok":
        raise RuntimeError(out)
    return out


def run_processes() -> dict:
    context = multiprocessing.get_context("spawn")
    workers = Workers(context, actors=1, rollouts=2)  # the walking actor worker: in the Ray run
    result: dict = {"steps": {}}
    workers.form()
    for step in (10, 20, 30):  # verl's global_steps: not consecutive
        if step != 10:
            workers.form()  # verl forms the group again before every update: the channel stays
        result["steps"][step] = workers.update(step)
    # Rollout worker 1 dies while it waits for its third bucket of step 40.
    _ok(workers.call([workers.rollouts[1]], "die", [None])[0])
    workers.form()
    started = time.monotonic()
    result["killed"] = workers.update(40)
    result["killed"]["seconds"] = time.monotonic() - started
    workers.rollouts[1][0].join(10)
    result["killed"]["exitcode"] = workers.rollouts[1][0].exitcode
    # A new rollout worker takes its place; the group forms again and step 50 reaches both.
    workers.rollouts[1] = workers._start(False)
    workers.form()
    result["rejoined"] = workers.update(50)
    # verl announces step 70 to the rollout workers while the actor pushes step 60: they refuse it.
    for (_, conn) in workers.actors:
        conn.send(("send", 60))
    for (_, conn) in workers.rollouts:
        conn.send(("receive", 70))
    result["mismatch"] = workers._answers(workers.actors + workers.rollouts)
    for answer in workers.call(workers.actors + workers.rollouts, "exit", [None] * 3):
        _ok(answer)
    return result


# -- Ray: verl's own manager, worker groups and rollout worker class ---------------------------------

def run_ray() -> dict:
    import ray

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    # The local cluster's workers inherit this environment (no runtime_env: its agent costs seconds).
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway loopback cluster: no token file in ~/.ray
    # The job secret the engine's channel proves (its rendezvous listens on Ray's node address, not
    # loopback): the workers inherit it, as docs/verl.md says.
    os.environ.setdefault("DISTLOAD_SECRET", secrets.token_hex(32))
    # Logical CPUs for verl's 4 workers and the example's 3 actors, all alive at once.
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        out = asyncio.run(_ray_updates())
        import ray_weight_sync  # examples/: a plain Ray job, in the same cluster

        out["example"] = ray_weight_sync.run(steps=3, inference=2, timeout_s=TIMEOUT_S)
        return out
    finally:
        ray.shutdown()


async def _ray_updates() -> dict:
    import ray
    import torch

    from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineWorker
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.single_controller.ray.base import split_resource_pool
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig
    from verl.workers.rollout import BaseRollout, RolloutReplica

    config = CheckpointEngineConfig(backend="distload", update_weights_bucket_megabytes=1,
                                    custom_backend_module="distload.verl", engine_kwargs={"distload": KWARGS})

    class Trainer(Worker):
        """An actor worker as verl's TrainingWorker holds its checkpoint engine."""

        def __init__(self, config):
            super().__init__()
            import importlib

            from verl.checkpoint_engine import CheckpointEngineRegistry

            importlib.import_module(config.custom_backend_module)
            torch.distributed.init_process_group("gloo")
            self.checkpoint_engine = CheckpointEngineRegistry.new(
                config.backend, is_master=torch.distributed.get_rank() == 0,
                bucket_size=config.update_weights_bucket_megabytes << 20, **config.engine_kwargs[config.backend])

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        async def update_weights(self, global_steps=None, mode="auto"):
            started = time.monotonic()
            try:
                return await self.checkpoint_engine.send_weights(iter(version_state(global_steps).items()),
                                                                 global_steps=global_steps)
            except Exception as exc:
                self.failed = {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started}
                raise

        def failure(self):  # called on one worker's handle: how its last update failed, if it did
            return getattr(self, "failed", None)

        @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
        def execute_checkpoint_engine(self, method, *args, **kwargs):
            return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    class Adapter(BaseRollout):
        """A server adapter that checks what it is given instead of loading it into an engine."""

        def __init__(self, config, model_config):
            self.config, self.model_config, self.checked = config, model_config, []

        async def update_weights(self, weights, global_steps=None, **kwargs):
            started = time.monotonic()
            try:
                got = await consume(weights)
            except Exception as exc:
                self.failed = {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started}
                raise
            self.checked.append({"step": global_steps, "wrong": exact(got, global_steps)})

        async def resume(self, tags):
            pass

        async def release(self):
            pass

    class Rollout(CheckpointEngineWorker):
        def __init__(self, rollout_config, model_config):
            super().__init__(rollout_config, model_config, Adapter(rollout_config, model_config))

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def checked(self):
            stats = self.checkpoint_engine.last_stats
            return self.server_adapter.checked, {"delta": stats.delta, "verified": stats.verified}

        def die_in_the_third_bucket(self):  # called on one worker's handle, not through the group
            die_in_the_third_bucket()

        def failure(self):
            return getattr(self.server_adapter, "failed", None)

    class Replica(RolloutReplica):
        """A rollout replica whose workers are the rollout worker group's (no inference server)."""

        async def init_hybrid(self, worker_group):
            self.workers = worker_group.workers[self.world_size * self.replica_rank:
                                                self.world_size * (self.replica_rank + 1)]

        def get_ray_class_with_init_args(self):
            raise NotImplementedError

        async def launch_servers(self):
            raise NotImplementedError

        async def abort_all_requests(self, reject_request=False):
            pass

        async def resume_generation(self):
            pass

        async def release_kv_cache(self):
            pass

        async def resume_kv_cache(self):
            pass

    rollout_config = RolloutConfig(name="vllm", checkpoint_engine=config, tensor_model_parallel_size=1)
    pool = RayResourcePool(process_on_nodes=[4], use_gpu=False, max_colocate_count=1)
    trainer_pool, rollout_pool = split_resource_pool(pool, [2, 2])
    trainer = RayWorkerGroup(resource_pool=trainer_pool,
                             ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(Trainer), config=config),
                             device_name="cpu")
    rollout = RayWorkerGroup(resource_pool=rollout_pool,
                             ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(Rollout), rollout_config=rollout_config,
                                                                    model_config=None),
                             device_name="cpu")
    replicas = [Replica(replica_rank=r, config=rollout_config, model_config=None) for r in range(2)]
    await asyncio.gather(*[replica.init_hybrid(rollout) for replica in replicas])
    manager = CheckpointEngineManager(config, trainer, replicas)
    metrics = {}
    for step in (1, 2, 3):
        metrics[step] = await manager.update_weights(global_steps=step)
    out = {"checked": rollout.checked(), "metrics": metrics}
    # Rollout worker 1 dies mid-update: verl's manager raises, within the engines' timeout.
    ray.get(rollout.workers[1].die_in_the_third_bucket.remote())
    started = time.monotonic()
    try:
        await manager.update_weights(global_steps=4)
        out["killed"] = {"error": None}
    except Exception as exc:  # noqa: BLE001 - what verl's trainer would see
        out["killed"] = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
    out["killed"]["seconds"] = time.monotonic() - started
    # The survivors' own waits end too, each with its own error (the manager raised at the first).
    for side, worker in (("trainer", trainer.workers[0]), ("survivor", rollout.workers[0])):
        while (failed := ray.get(worker.failure.remote())) is None and time.monotonic() - started < TIMEOUT_S + 10:
            await asyncio.sleep(0.2)
        out["killed"][side] = failed
    return out


def main() -> None:
    import distload.cli.main  # noqa: F401 - distload's face and its sync channel, verl not yet asked for
    import distload.live.channel  # noqa: F401

    imported_verl = "verl" in sys.modules
    modes = {"processes": run_processes, "ray": run_ray}
    try:
        out = {}
        for mode in sys.argv[1:]:
            started = time.monotonic()
            out[mode] = modes[mode]()
            print(f"{mode}: {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
        out["distload_imported_verl"] = imported_verl
    except Exception:  # noqa: BLE001 - printed for the test's message
        traceback.print_exc()
        sys.exit(1)
    print("RESULT " + json.dumps(out, default=str), flush=True)


if __name__ == "__main__":
    main()
