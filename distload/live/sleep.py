"""Sleep and wake: give a model's weight memory back while its tensor objects stay valid.

- level 1 keeps a copy: device weights go to (pinned) host memory; CPU weights go to a file in
  ``offload_dir`` (on a CPU the only place that frees memory); ``wake()`` restores the values
  bit for bit.
- level 2 keeps nothing: ``wake()`` gives the memory back zero-filled, to be reloaded in place
  (:func:`distload.live.reload.reload_into`) or received (:class:`distload.live.sync.WeightSync`).

The memory is released by resizing each tensor's storage to zero bytes (as FSDP does with its
flat parameters), or, for a storage that cannot be resized (Run:ai hands out numpy-backed
tensors), by swapping it out of each tensor and back in on wake: either way the Parameter objects,
their shapes and dtypes, and every reference an engine holds stay valid. What does not survive is the address: after ``wake()`` a storage may live at a
new ``data_ptr()``, so CUDA graphs captured before sleep must be captured again (keeping the
address needs a custom allocator, like vLLM's CuMemAllocator). Tied weights share one storage
and are handled once.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch.autograd.graph import increment_version

from distload.errors import ConfigError, DistloadError
from distload.live.targets import model_tensors
from distload.tensor_io import host_view


@dataclass
class _Slept:
    storage: torch.UntypedStorage
    nbytes: int
    # The tensors over this storage, with their layout: a storage that cannot be resized (one a
    # library built from a numpy array, as Run:ai does) is swapped out of each of them instead.
    members: list[tuple[torch.Tensor, int, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    host: torch.Tensor | None = None  # level 1 on a device
    file_offset: int | None = None  # level 1 on the CPU

    def release(self) -> None:
        if self.storage.resizable():
            self.storage.resize_(0)
            return
        for tensor, *_ in self.members:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        self.storage = None  # type: ignore[assignment]  # the last reference: the memory goes

    def restore(self) -> torch.Tensor:
        """Give the memory back; returns a byte view of it to fill."""
        if self.storage is not None:
            self.storage.resize_(self.nbytes)
        else:
            device = self.members[0][0].device
            self.storage = torch.empty(self.nbytes, dtype=torch.uint8, device=device).untyped_storage()
            for tensor, offset, size, stride in self.members:
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=device).set_(
                    self.storage, offset, size, stride)
        return _bytes_of(self.storage)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over a whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _write_storage(f, data: torch.Tensor) -> None:
    with host_view(data) as view:  # not numpy: a numpy view would make the storage non-resizable
        f.write(view)


def _read_storage(f, data: torch.Tensor) -> None:
    with host_view(data) as view:
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise DistloadError("the sleep offload file ended early; the weights cannot be restored")
            done += n


class WeightSleeper:
    """``sleep(level)`` / ``wake()`` for one model or dict of tensors; not thread-safe."""

    def __init__(self, target: torch.nn.Module | Mapping[str, torch.Tensor], offload_dir: str | None = None):
        self._tensors = model_tensors(target)
        self._offload_dir = offload_dir
        self._slept: list[_Slept] = []
        self._file = None
        self.level = 0  # 0: awake

    @property
    def asleep(self) -> bool:
        return self.level != 0

    def _storages(self) -> list[_Slept]:
        """One entry per distinct storage (tied weights share one), with the tensors over it."""
        entries: dict[tuple, _Slept] = {}
        for tensor in {id(t): t for t in self._tensors.values()}.values():
            storage = tensor.untyped_storage()
            if storage.nbytes():
                entry = entries.setdefault((storage.device, storage.data_ptr()), _Slept(storage, storage.nbytes()))
                entry.members.append((tensor, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride())))
        return list(entries.values())

    def sleep(self, level: int = 1) -> int:
        """Release the weights' memory; returns the bytes released."""
        if level not in (1, 2):
            raise ConfigError(f"sleep level must be 1 (keep a copy) or 2 (drop the weights), got {level!r}")
        if self.asleep:
            raise DistloadError(f"already asleep at level {self.level}; wake() first")
        slept = self._storages()
        if level == 1 and any(entry.storage.device.type == "cpu" for entry in slept):
            self._file = tempfile.TemporaryFile(dir=self._offload_dir, prefix="distload-sleep-")
        offset = 0
        try:
            for entry in slept:
                storage = entry.storage
                if level == 1:
                    data = _bytes_of(storage)
                    if storage.device.type == "cpu":
                        assert self._file is not None
                        _write_storage(self._file, data)
                        entry.file_offset, offset = offset, offset + entry.nbytes
                    else:
                        entry.host = _pinned(entry.nbytes)
                        entry.host.copy_(data)
        except BaseException:
            self._close_file()
            for entry in slept:
                _unpin(entry)
            raise
        if self._file is not None:
            self._file.flush()
        # Only now, with every copy safe, is any memory released: a failed sleep changes nothing.
        for entry in slept:
            entry.release()
        if any(entry.members[0][0].device.type == "cuda" for entry in slept):
            # resize_(0) gives the memory to PyTorch's caching allocator, not to the driver: a
            # co-located process (the reason to sleep) could not use it.
            torch.cuda.empty_cache()
        self._slept = slept
        self.level = level
        return sum(entry.nbytes for entry in slept)

    def wake(self) -> int:
        """Give the weights their memory back (level 1: their values; level 2: zeros)."""
        if not self.asleep:
            raise DistloadError("not asleep")
        for entry in self._slept:
            data = entry.restore()
            if entry.host is not None:
                data.copy_(entry.host)
                _unpin(entry)
            elif entry.file_offset is not None:
                assert self._file is not None
                self._file.seek(entry.file_offset)
                _read_storage(self._file, data)
            else:
                data.zero_()
        # The bytes went in through the storages, which torch does not count as writes to the
        # tensors: count them, so a weight-sync receiver sees its tensors were rewritten and takes
        # the next update whole, never a delta over what a wake put back (channel.py's _mark).
        increment_version(list({id(t): t for t in self._tensors.values()}.values()))
        nbytes = sum(entry.nbytes for entry in self._slept)
        self._slept = []
        self._close_file()
        self.level = 0
        return nbytes

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __repr__(self) -> str:
        return f"WeightSleeper({len(self._tensors)} tensors, level={self.level})"


def _pinned(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory of exactly that size, unpinned at wake and freed
    with the tensor. ``pin_memory=True`` would take them from the caching host allocator, which
    rounds each block up to a power of two and keeps it after it is freed
    (CachingHostAllocator.h ``allocate``: ``PowerOf2Ceil(size)``): up to twice the weights
    page-locked for the life of the process."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        code = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 0))
        if code != 0:
            raise DistloadError(f"could not page-lock {nbytes} bytes of host memory for a sleeping weight "
                                f"(cudaHostRegister error {code}): raise the locked-memory limit (ulimit -l), "
                                f"or sleep at level 2")
    return host


def _unpin(entry: _Slept) -> None:
    host, entry.host = entry.host, None
    if host is not None and host.numel():
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
