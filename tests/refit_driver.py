"""One member of a BF16 -> FP8 refit test (tests/test_sync_refit.py), a process of its own::

    python tests/refit_driver.py ROLE RANK SIZE TRAINERS RECEIVERS tcp://HOST:PORT OUT

The trainer ranks push BF16 weights, version after version (:data:`VERSIONS`); the inference
ranks (TP size = RECEIVERS) receive them into targets that hold FP8 with block scales, or, for
some versions, targets of an FP8 recipe refit does not take, or BF16. Each member writes what it
saw to ``OUT/ROLE<rank>.json`` (a crash under ``"crash"``); a receiver also writes its tensors
after each update that landed to ``OUT/inference<rank>-v<version>.safetensors``. Values come
from seeds: the test recomputes every pushed tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
import weakref
import zlib

import torch
from safetensors.torch import save_file

from distload.errors import SyncError
from distload.live.channel import SyncChannel

TIMEOUT_S = 60.0
LAYERS = 4  # one trainer refits 8 projections: more than a push holds at once
# Shapes that end in ragged blocks (320 = 2.5 blocks of 128): gate_proj is split by rows under TP
# (its scales by rows of blocks), down_proj by columns.
GATE, DOWN, NORM = (256, 320), (320, 512), (320,)
MODEL = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 80}


def names(layer: int) -> tuple[str, str, str]:
    base = f"model.layers.{layer}"
    return f"{base}.mlp.gate_proj.weight", f"{base}.mlp.down_proj.weight", f"{base}.input_layernorm.weight"


def scenario(trainers: int, receivers: int) -> list[tuple[int, str]]:
    """(version, what the receivers hold) in push order: refusals first, then refit, a delta,
    a mixed refusal over the delta's result, and BF16 targets (the wire's baseline)."""
    steps = [(1, "e5m2"), (2, "weight_scale"), (3, "blocks64")]
    if receivers > 1:
        steps.append((4, "misaligned"))  # the trainer pushes a down_proj that TP 2 cuts off its blocks
    steps += [(5, "fp8"), (6, "fp8")]
    if receivers > 1:
        steps.append((7, "mixed"))  # inference rank 1 holds BF16, rank 0 FP8
    steps.append((8, "bf16"))
    return steps


def state_of(version: int, rank: int, trainers: int) -> dict[str, torch.Tensor]:
    """What trainer rank ``rank`` pushes as ``version``: its layers (rank r of T: layers r, r + T, ...).
    Version 6 is version 5 with a few elements of one block changed (a small step: a delta)."""
    out = {}
    for layer in range(rank, LAYERS, trainers):
        gate, down, norm = names(layer)
        shapes = {gate: GATE, down: (DOWN[0], 384) if version == 4 else DOWN, norm: NORM}
        for name, shape in shapes.items():
            gen = torch.Generator().manual_seed(zlib.crc32(f"{name}@{min(version, 5)}".encode()))
            out[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if version == 6:
            out[gate][3, :16] += 0.001
    return out


def target_of(kind: str, rank: int, receivers: int) -> dict[str, torch.Tensor]:
    """What inference rank ``rank`` receives into, filled with a pattern (a refusal must leave
    every byte of it)."""
    tp = receivers
    gate_rows, down_cols = GATE[0] // tp, DOWN[1] // tp
    out = {}
    for layer in range(LAYERS):
        gate, down, norm = names(layer)
        bf16 = kind == "bf16" or (kind == "mixed" and rank == 1)
        if bf16:
            out[gate] = torch.full((gate_rows, GATE[1]), 7.0, dtype=torch.bfloat16)
            out[down] = torch.full((DOWN[0], down_cols), 7.0, dtype=torch.bfloat16)
        else:
            out[gate] = torch.full((gate_rows, GATE[1]), 7.0).to(torch.float8_e4m3fn)
            out[gate + "_scale_inv"] = torch.full((-(-gate_rows // 128), 3), 7.0)
            out[down] = torch.full((DOWN[0], down_cols), 7.0).to(torch.float8_e4m3fn)
            out[down + "_scale_inv"] = torch.full((3, -(-down_cols // 128)), 7.0)
        out[norm] = torch.full(NORM, 7.0, dtype=torch.bfloat16)
    gate, down, _ = names(0)
    if kind == "e5m2":
        out[gate] = out[gate].to(torch.float8_e5m2)
    elif kind == "weight_scale":  # a per-tensor scale, as FP8 checkpoints without blocks name it
        del out[down + "_scale_inv"]
        out[down + "_scale"] = torch.full((), 7.0)
    elif kind == "blocks64":
        out[gate + "_scale_inv"] = torch.full((-(-gate_rows // 64), 5), 7.0)
    return out


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (torch compares no float8 on the CPU)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


class QuantizedAlive:
    """Counts the FP8 copies refit.quantize made that are still alive, and their peak in a push."""

    def __init__(self):
        import distload.live.refit as refit

        self.alive = self.peak = 0
        real = refit.quantize

        def counted(weight):
            q, s = real(weight)
            self.alive += 1
            self.peak = max(self.peak, self.alive)
            weakref.finalize(q, self._gone)
            return q, s

        refit.quantize = counted

    def _gone(self) -> None:
        self.alive -= 1


def _trainer(rank: int, size: int, receivers: int, address: str) -> dict:
    seen = {}
    alive = QuantizedAlive()
    # Buckets of 64 KiB: each projection a bucket of its own, so that what a push holds at once shows.
    with SyncChannel(address, "trainer", rank=rank, size=size, device="cpu", timeout_s=TIMEOUT_S,
                     transport="socket", bucket_bytes=64 << 10) as channel:
        for version, _ in scenario(size, receivers):
            alive.peak = alive.alive
            try:
                seen[version] = {"stats": dataclasses.asdict(channel.push(state_of(version, rank, size), version))}
            except SyncError as exc:
                seen[version] = {"error": str(exc)}
            seen[version]["quantized_peak"] = alive.peak
    return seen


def _receiver(rank: int, size: int, trainers: int, address: str, out: str) -> dict:
    seen = {}
    target: dict[str, torch.Tensor] = {}
    with SyncChannel(address, "inference", rank=rank, size=size, device="cpu", timeout_s=TIMEOUT_S,
                     tensor_parallel_size=size, model_config=MODEL, transport="socket") as channel:
        for version, kind in scenario(trainers, size):
            # The delta (version 6) lands in the tensors version 5 landed in, and the mixed refusal
            # (7) must leave them as they are: both take the last FP8 target again.
            if not (version == 6 or kind == "mixed" and rank == 0):
                target = target_of(kind, rank, size)
            before = {k: bits(v).clone() for k, v in target.items()}
            row: dict = {"version_before": channel.version}
            try:
                row["stats"] = dataclasses.asdict(channel.receive(target))
                save_file({k: v.contiguous() for k, v in target.items()},
                          os.path.join(out, f"inference{rank}-v{version}.safetensors"))
            except SyncError as exc:
                row["error"] = str(exc)
                row["untouched"] = all(torch.equal(before[k], bits(v)) for k, v in target.items())
            row["version_after"] = channel.version
            seen[version] = row
    return seen


def main() -> None:
    role, rank, size, trainers, receivers, address, out = sys.argv[1:8]
    rank, size, trainers = int(rank), int(size), int(trainers)
    try:
        seen = (_trainer(rank, size, int(receivers), address) if role == "trainer"
                else _receiver(rank, size, trainers, address, out))
        result = {"versions": seen}
    except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
        result = {"crash": traceback.format_exc()}
    with open(os.path.join(out, f"{role}{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.exit(1 if "crash" in result else 0)


if __name__ == "__main__":
    main()
