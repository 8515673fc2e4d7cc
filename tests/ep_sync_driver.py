"""One side of an expert-parallel weight-sync test (tests/test_sync_experts.py)::

    python tests/ep_sync_driver.py trainer RANK SIZE CKPT tcp://HOST:PORT OUT
    torchrun --nproc-per-node N tests/ep_sync_driver.py inference TP - CKPT tcp://HOST:PORT OUT

The checkpoint (:func:`write_checkpoint`) is a small mixture-of-experts model in DeepSeek's names:
per-expert projections, a shared expert, a router, one tensor of every expert stacked on dim 0.
A trainer rank pushes its share of :func:`pushed` (rank r of S: the tensors at positions r, r + S,
...) for versions 1 and 2 (2 is 1 with a few elements changed: a delta). Inference rank r loads
the checkpoint with ``distload.load(..., expert_parallel_size=2, tensor_parallel_size=TP)`` and
receives into that dict (TP "-": 1).
The trainer always pushes BF16; a checkpoint written in ``fp8`` form holds every projection as
float8_e4m3fn with 128x128 block scales, so its receivers take a refit.
Each member writes its stats to ``OUT/ROLE<rank>.json``; a receiver also writes its tensors after
each update to ``OUT/inference<rank>-v<version>.safetensors``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
import zlib

import torch
from safetensors.torch import save_file

EXPERTS = 4
EP = 2
HIDDEN, INTER = 256, 128
CONFIG = {"model_type": "deepseek_v3", "n_routed_experts": EXPERTS, "hidden_size": HIDDEN, "num_attention_heads": 4,
          "num_key_value_heads": 4}  # heads: what TP splits o_proj by


def pushed(version: int) -> dict[str, torch.Tensor]:
    """Every tensor the trainer side pushes as ``version`` (BF16): values from seeds."""
    shapes = {"model.embed_tokens.weight": (64, HIDDEN), "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HIDDEN),
              "model.layers.0.mlp.gate.weight": (EXPERTS, HIDDEN), "model.norm.weight": (HIDDEN,),
              "model.layers.1.mlp.experts.w13_weight": (EXPERTS, 2 * INTER, HIDDEN)}
    for what in ("shared_experts", *(f"experts.{e}" for e in range(EXPERTS))):
        base = f"model.layers.0.mlp.{what}"
        shapes.update({f"{base}.gate_proj.weight": (INTER, HIDDEN), f"{base}.up_proj.weight": (INTER, HIDDEN),
                       f"{base}.down_proj.weight": (HIDDEN, INTER)})
    out = {}
    for name, shape in sorted(shapes.items()):
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        out[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if version == 2:  # a small step: a few elements of each tensor
            out[name].view(-1)[:8] += 0.001
    return out


def quantized(name: str) -> bool:
    return name.endswith("_proj.weight")


def write_checkpoint(folder: str, mode: str) -> None:
    """Version 0 of the model (every value 0.5: the receivers' starting point) in two files."""
    os.makedirs(folder, exist_ok=True)
    state = {}
    for name, tensor in pushed(1).items():
        if mode == "fp8" and quantized(name):
            rows, cols = tensor.shape
            state[name] = torch.full((rows, cols), 0.5).to(torch.float8_e4m3fn)
            state[name + "_scale_inv"] = torch.ones(-(-rows // 128), -(-cols // 128))
        else:
            state[name] = torch.full(tensor.shape, 0.5, dtype=torch.bfloat16)
    names = sorted(state)
    save_file({n: state[n] for n in names[::2]}, os.path.join(folder, "model-00001-of-00002.safetensors"))
    save_file({n: state[n] for n in names[1::2]}, os.path.join(folder, "model-00002-of-00002.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CONFIG, f)


def trainer(rank: int, size: int, address: str, out: str) -> dict:
    from distload.live.channel import SyncChannel

    stats = []
    with SyncChannel(address, role="trainer", rank=rank, size=size, timeout_s=60, transport="socket") as channel:
        for version in (1, 2):
            state = pushed(version)
            mine = {name: state[name] for name in sorted(state)[rank::size]}
            stats.append(dataclasses.asdict(channel.push(mine, version)))
    return {"stats": stats}


def inference(tp: int, ckpt: str, address: str, out: str) -> dict:
    import distload
    from distload.live.channel import SyncChannel

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    state = distload.load(ckpt, expert_parallel_size=EP, tensor_parallel_size=tp, device="cpu")
    loaded = sorted(state)
    stats = []
    with SyncChannel(address, role="inference", rank=rank, size=size, timeout_s=60, transport="socket",
                     tensor_parallel_size=tp, expert_parallel_size=EP, model_config=ckpt) as channel:
        for version in (1, 2):
            got = channel.receive(state)
            stats.append(dataclasses.asdict(got))
            save_file({n: t.contiguous() for n, t in state.items()},
                      os.path.join(out, f"inference{rank}-v{version}.safetensors"))
    for version in (1, 2):  # where the test wrote a version whole: what a load of it keeps here
        folder = os.path.join(out, f"v{version}")
        if os.path.isdir(folder):
            loads = distload.load(folder, expert_parallel_size=EP, tensor_parallel_size=tp, device="cpu")
            save_file({n: t.contiguous() for n, t in loads.items()},
                      os.path.join(out, f"inference{rank}-v{version}-load.safetensors"))
    return {"stats": stats, "loaded": loaded}


def main() -> None:
    role, rank, size, ckpt, address, out = sys.argv[1:7]
    me = int(os.environ.get("RANK", "0")) if role == "inference" else int(rank)
    try:
        result = (trainer(int(rank), int(size), address, out) if role == "trainer"
                  else inference(1 if rank == "-" else int(rank), ckpt, address, out))
    except BaseException:  # noqa: BLE001 - the test reads it
        result = {"crash": traceback.format_exc()}
    with open(os.path.join(out, f"{role}{me}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
