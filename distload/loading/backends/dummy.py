"""Dummy weights: every tensor's name, dtype and shape from the headers, values from a seed
derived from the name, so every rank agrees without reading a byte of tensor data.

Floats are drawn uniform in [-1e-3, 1e-3] (as vLLM's dummy loader) before rounding to the dtype
(fp8 cannot hold values that small: its dummies are 0 or +-2^-9; E8M0 scales are powers of two
near 2^-10), FP4 pairs are random bytes, integers small, bools random.
Values are drawn by a generator on the rank's device: identical on every rank of the same
device type; CPU and CUDA generators differ from each other.
"""

from __future__ import annotations

import hashlib
from typing import Iterator

import torch

from distload.loading.index import PACKED, TensorInfo
from distload.loading.backends.base import Backend, BackendRun, ReadRequest


def name_seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "little") & (2**63 - 1)


def dummy_tensor(info: TensorInfo, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device=device)
    generator.manual_seed(name_seed(info.name))
    dtype = info.torch_dtype
    if info.dtype in PACKED:
        # Packed values (FP4: two a byte) have no conversion from floats in torch: random bytes,
        # every one of which is a valid pair of values.
        raw = torch.randint(0, 256, info.shape, generator=generator, device=device, dtype=torch.int64)
        return raw.to(torch.uint8).view(dtype)
    if dtype.is_complex:
        real = torch.empty(info.shape + (2,), dtype=torch.float32, device=device)
        return torch.view_as_complex(real.uniform_(-1e-3, 1e-3, generator=generator)).to(dtype)
    if dtype.is_floating_point:
        values = torch.empty(info.shape, dtype=torch.float32, device=device)
        return values.uniform_(-1e-3, 1e-3, generator=generator).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, info.shape, generator=generator, device=device).bool()
    low = 0 if dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64) else -8
    return torch.randint(low, 8, info.shape, generator=generator, device=device, dtype=torch.int64).to(dtype)


class DummyBackend(Backend):
    name = "dummy"

    def read(self, request: ReadRequest) -> BackendRun:
        return BackendRun("dummy", requested_bytes=0).start(_stream(request))  # headers only


def _stream(request: ReadRequest) -> Iterator[tuple[str, torch.Tensor]]:
    for info in request.index.tensors:
        yield info.name, dummy_tensor(info, request.device)
