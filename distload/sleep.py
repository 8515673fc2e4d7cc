"""Sleep and wake: give a model's weight memory back while its tensor objects stay valid.

- level 1 keeps a copy: device weights go to (pinned) host memory; CPU weights go to a file in
  ``offload_dir`` (on a CPU the only place that frees memory); ``wake()`` restores the values
  bit for bit.
- level 2 keeps nothing: ``wake()`` gives the memory back zero-filled, to be reloaded in place
  (:func:`distload.reload.reload_into`) or received (:class:`distload.sync.WeightSync`).

The memory is released by resizing each tensor's storage to zero bytes (as FSDP does with its
flat parameters): the Parameter objects, their shapes and dtypes, and every reference an engine
holds stay valid. What does not survive is the address: after ``wake()`` a storage may live at a
new ``data_ptr()``, so CUDA graphs captured before sleep must be captured again (keeping the
address needs a custom allocator, like vLLM's CuMemAllocator). Tied weights share one storage
and are handled once.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Mapping

import torch

from .errors import ConfigError, DistloadError
from .reload import model_tensors


@dataclass
class _Slept:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None = None  # level 1 on a device
    file_offset: int | None = None  # level 1 on the CPU


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over a whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


# numpy views of a storage make it non-resizable for good, so file I/O goes through a bounce buffer.
_BOUNCE_BYTES = 64 * 1024 * 1024


def _write_through_bounce(f, data: torch.Tensor) -> None:
    bounce = torch.empty(min(_BOUNCE_BYTES, data.numel()), dtype=torch.uint8)
    for start in range(0, data.numel(), _BOUNCE_BYTES):
        chunk = data[start:start + _BOUNCE_BYTES]
        bounce[: chunk.numel()].copy_(chunk)
        f.write(memoryview(bounce[: chunk.numel()].numpy()))


def _read_through_bounce(f, data: torch.Tensor) -> None:
    bounce = torch.empty(min(_BOUNCE_BYTES, data.numel()), dtype=torch.uint8)
    view = memoryview(bounce.numpy())
    for start in range(0, data.numel(), _BOUNCE_BYTES):
        size = min(_BOUNCE_BYTES, data.numel() - start)
        done = 0
        while done < size:
            n = f.readinto(view[done:size])
            if not n:
                raise DistloadError("the sleep offload file ended early; the weights cannot be restored")
            done += n
        data[start:start + size].copy_(bounce[:size])


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

    def _storages(self) -> list[torch.UntypedStorage]:
        seen: dict[tuple, torch.UntypedStorage] = {}
        for tensor in self._tensors.values():
            storage = tensor.untyped_storage()
            if storage.nbytes():
                seen.setdefault((storage.device, storage.data_ptr()), storage)
        return list(seen.values())

    def sleep(self, level: int = 1) -> int:
        """Release the weights' memory; returns the bytes released."""
        if level not in (1, 2):
            raise ConfigError(f"sleep level must be 1 (keep a copy) or 2 (drop the weights), got {level!r}")
        if self.asleep:
            raise DistloadError(f"already asleep at level {self.level}; wake() first")
        storages = self._storages()
        slept = []
        if level == 1 and any(s.device.type == "cpu" for s in storages):
            self._file = tempfile.TemporaryFile(dir=self._offload_dir, prefix="distload-sleep-")
        offset = 0
        try:
            for storage in storages:
                entry = _Slept(storage, storage.nbytes())
                if level == 1:
                    data = _bytes_of(storage)
                    if storage.device.type == "cpu":
                        assert self._file is not None
                        _write_through_bounce(self._file, data)
                        entry.file_offset, offset = offset, offset + entry.nbytes
                    else:
                        entry.host = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=True)
                        entry.host.copy_(data)
                slept.append(entry)
        except BaseException:
            self._close_file()
            raise
        if self._file is not None:
            self._file.flush()
        # Only now, with every copy safe, is any memory released: a failed sleep changes nothing.
        for entry in slept:
            entry.storage.resize_(0)
        self._slept = slept
        self.level = level
        return sum(entry.nbytes for entry in slept)

    def wake(self) -> int:
        """Give the weights their memory back (level 1: their values; level 2: zeros)."""
        if not self.asleep:
            raise DistloadError("not asleep")
        for entry in self._slept:
            entry.storage.resize_(entry.nbytes)
            data = _bytes_of(entry.storage)
            if entry.host is not None:
                data.copy_(entry.host)
            elif entry.file_offset is not None:
                assert self._file is not None
                self._file.seek(entry.file_offset)
                _read_through_bounce(self._file, data)
            else:
                data.zero_()
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
