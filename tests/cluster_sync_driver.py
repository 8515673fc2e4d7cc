"""One member of a cross-host sync (a trainer rank or an inference rank), run inside a cluster host
(tests/cluster) by tests/test_cluster_sync.py and benchmarks/bench_cluster.py::

    python tests/cluster_sync_driver.py '{"out": DIR, "name": "inf", "role": "inference", ...}'

The config (JSON): ``out`` (a folder every host sees: the hosts share this machine's files),
``name``, ``role``, ``rank``, ``size``, ``tp`` (tensor-parallel size of an inference rank),
``channels`` ({"delta": "tcp://HOST:PORT", "full": ...}: a channel with deltas on, one with them
off; any name that starts with "delta" has them on), ``host`` (the side serving the rendezvous), ``timeout``, ``bucket`` (bytes), ``model``
(hidden, inter, layers, vocab, heads, kv_heads, head_dim: a Llama's bf16 shapes), ``change`` (the
fraction of elements a step changes, by one ulp each: what an RL step at lr 1e-6 does to bf16
weights), ``steps``: ``push:CHANNEL:VERSION``, ``recv:CHANNEL``, ``mark:NAME``, ``gate:NAME``,
``sleep:S``, ``close`` (``gate``: comma-separated names, all waited for); ``settle``: after each
push wait for the delta base's commit (outside the push's time, logged as ``settle``).

Every step's outcome is one JSON line in ``OUT/NAME<rank>.jsonl`` with a wall-clock stamp; an
inference rank checks every received tensor bit for bit against the version it says it holds
(the expected slice of this TP rank, cut here by hand: rows or columns in equal parts).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import zlib

import torch

cfg = json.loads(sys.argv[1])
RANK, SIZE, TP = int(cfg["rank"]), int(cfg["size"]), int(cfg.get("tp", 1))
NAME = f"{cfg['name']}{RANK}"
OUT = cfg["out"]
M = cfg["model"]
CHANGE = float(cfg.get("change", 0.04))


def log(event, **fields):
    fields.update(event=event, t=time.time(), pid=os.getpid(), host=os.uname().nodename)
    with open(os.path.join(OUT, f"{NAME}.jsonl"), "a") as f:
        f.write(json.dumps(fields) + "\n")


def shapes() -> dict[str, tuple[int, ...]]:
    hidden, inter, vocab = M["hidden"], M["inter"], M["vocab"]
    q, kv = M["heads"] * M["head_dim"], M["kv_heads"] * M["head_dim"]
    out = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(M["layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                    p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, q),
                    p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                    p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                    p + "post_attention_layernorm.weight": (hidden,)})
    out["model.norm.weight"] = (hidden,)
    out["lm_head.weight"] = (vocab, hidden)
    return out


def cut(name: str, tensor: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's slice, by hand (vocabulary a multiple of 64 * tp: no padding rows)."""
    if tp == 1:
        return tensor
    if "embed_tokens" in name or name == "lm_head.weight" or any(
            p in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
        return tensor.chunk(tp, 0)[rank]
    if "o_proj" in name or "down_proj" in name:
        return tensor.chunk(tp, 1)[rank]
    return tensor


class States:
    """Version 1: random bf16 weights; version k+1: version k with ``CHANGE`` of its elements moved
    by one ulp (a function of the name and the version only, so every process makes the same)."""

    def __init__(self) -> None:
        self.version, self.state = 0, None

    def get(self, version: int) -> dict[str, torch.Tensor]:
        if version < self.version or self.state is None:
            self.version, self.state = 1, {}
            for n, s in shapes().items():
                gen = torch.Generator().manual_seed(zlib.crc32(n.encode()))
                self.state[n] = torch.randn(s, generator=gen).to(torch.bfloat16)
        while self.version < version:
            self.version += 1
            for n, t in self.state.items():
                gen = torch.Generator().manual_seed(zlib.crc32(f"{n}@{self.version}".encode()))
                flat = t.view(-1).view(torch.int16)
                moved = torch.rand(flat.numel(), generator=gen) < CHANGE
                flat[moved] += 1
        return self.state


STATES = States()


def exact(target: dict[str, torch.Tensor], version: int) -> bool:
    want = STATES.get(version)
    return all(target[n].view(torch.uint8).equal(cut(n, want[n], TP, RANK % TP).contiguous().view(torch.uint8))
               for n in want)


def gate(names: str, timeout: float = 600) -> None:
    """Wait for every file of ``names`` (comma-separated) in OUT."""
    deadline = time.monotonic() + timeout
    for name in names.split(","):
        while not os.path.exists(os.path.join(OUT, name)):
            if time.monotonic() > deadline:
                raise SystemExit(f"{NAME}: {name} never appeared")
            time.sleep(0.01)


class Logged(logging.Handler):
    def emit(self, record):
        log("warning", message=record.getMessage())


logging.getLogger("distload").addHandler(Logged())

from distload.errors import SyncError  # noqa: E402
from distload.live.channel import SyncChannel  # noqa: E402

log("start")
channels = {}
model_config = {"num_attention_heads": M["heads"], "num_key_value_heads": M["kv_heads"], "head_dim": M["head_dim"]}
for kind, address in cfg["channels"].items():
    t0 = time.monotonic()
    extra = {} if cfg["role"] == "trainer" or TP == 1 else dict(
        tensor_parallel_size=TP, sharding="decoder", model_config=model_config)
    try:
        channels[kind] = SyncChannel(address, cfg["role"], rank=RANK, size=SIZE, host=cfg.get("host", "trainer"),
                                     device="cpu", timeout_s=cfg["timeout"], bucket_bytes=cfg["bucket"],
                                     delta=kind.startswith("delta"), **extra)
    except SyncError as exc:
        log("open", ok=False, channel=kind, error=str(exc), seconds=time.monotonic() - t0)
        sys.exit(0)
    log("open", ok=True, channel=kind, seconds=time.monotonic() - t0)

targets = {}
if cfg["role"] == "inference":
    for kind in channels:
        targets[kind] = {n: torch.zeros(cut(n, torch.empty(s, dtype=torch.bfloat16, device="meta"), TP, RANK % TP)
                                        .shape, dtype=torch.bfloat16) for n, s in shapes().items()}
for step in cfg["steps"]:
    kind, _, arg = step.partition(":")
    if kind == "push":
        which, version = arg.split(":")
        version = int(version)
        state = STATES.get(version)
        mine = {n: t for i, (n, t) in enumerate(state.items()) if i % SIZE == RANK}
        log("pushing", channel=which, version=version)
        t0 = time.monotonic()
        try:
            stats = channels[which].push(mine, version)
            seconds = time.monotonic() - t0
            # A delta channel commits its base copy on a thread after push returns (delta.py): let
            # it end here, so that it does not run under the next push (as bench_sync.py does).
            base = getattr(channels[which], "_base", None)
            t1 = time.monotonic()
            if cfg.get("settle") and base is not None:
                base.settle()
            log("push", ok=True, channel=which, version=version, seconds=seconds, settle=time.monotonic() - t1,
                stats_seconds=stats.seconds, nbytes=stats.nbytes, wire=stats.wire_bytes, delta=stats.delta,
                verified=stats.verified)
        except SyncError as exc:
            log("push", ok=False, channel=which, version=version, error=str(exc), seconds=time.monotonic() - t0)
    elif kind == "recv":
        which = arg
        ch, target = channels[which], targets[which]
        before_version = ch.version
        log("receiving", channel=which)
        t0 = time.monotonic()
        try:
            stats = ch.receive(target)
            seconds = time.monotonic() - t0
            log("recv", ok=True, channel=which, version=stats.version, seconds=seconds,
                stats_seconds=stats.seconds, exact=exact(target, stats.version), delta=stats.delta,
                verified=stats.verified, wire=stats.wire_bytes, transport=stats.transport,
                pairs=sorted(ch._session.pairs) if ch._session is not None else None)
        except SyncError as exc:
            seconds = time.monotonic() - t0
            log("recv", ok=False, channel=which, error=str(exc), seconds=seconds, version=ch.version,
                before=before_version, consistent=ch.consistent,
                holds_its_version=ch.version is not None and exact(target, ch.version))
    elif kind == "mark":
        open(os.path.join(OUT, arg.replace("{rank}", str(RANK))), "w").close()
    elif kind == "gate":
        gate(arg)
    elif kind == "sleep":
        time.sleep(float(arg))
    elif kind == "sums":  # the bucket checks from here on: "keyed" (the code's) or "unkeyed" (the old sums)
        import distload.live.channel as channel_module
        from distload.live.transfer import checksum

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
        from bench_sync import _unkeyed_sums

        channel_module.checksum = _unkeyed_sums if arg == "unkeyed" else checksum
    elif kind == "close":
        for ch in channels.values():
            ch.close()
        channels = {}
    else:
        raise SystemExit(f"unknown step {step!r}")
for ch in channels.values():
    ch.close()
log("exit")
