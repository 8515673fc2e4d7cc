"""Raw bytes of tensors, without numpy.

A numpy view of a tensor marks its storage non-resizable for good, and a storage that cannot be
resized cannot be released by :class:`distload.live.sleep.WeightSleeper`. Every byte view distload
takes of a tensor a user may hold therefore goes through ctypes instead.
"""

from __future__ import annotations

import ctypes

import torch


def host_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory; the view keeps the tensor alive."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("host_view needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    array = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    array.owner = tensor  # the memoryview holds the array, the array holds the tensor
    return memoryview(array).cast("B")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor (copied to host if it lives on a device)."""
    flat = tensor.detach().reshape(-1).contiguous()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return host_view(flat)
