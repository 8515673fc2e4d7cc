"""Buckets: pieces of tensors packed into one buffer (one message) at offsets, and back out.

Shared reads (distload/loading/shared_reads) and weight sync (distload/live/transfer.py) both move
tensors in buckets. What they share is here:

- which pieces share a bucket: in order, up to a bucket's size, a big piece alone
  (``group_in_order``);
- where each piece sits in its bucket (``offsets``): one after the other, each start rounded up to
  ``align`` bytes where the receiver views a piece as its dtype (``ALIGN``);
- copying *runs* of bytes between a bucket's buffer, a message and tensors (``pack_runs``,
  ``unpack_runs``, ``copy_runs``). A run ``(src, dst, length, count, src_step, dst_step)`` is
  ``count`` ranges of ``length`` bytes, the j-th from ``src + j * src_step`` to
  ``dst + j * dst_step``: a slice along dim 1 (one range per row) is one run, packed or placed
  with one strided copy.

What a piece *is* stays with its user: for shared reads, byte runs of a tensor's data in its file
(distload/loading/shared_reads/plan.py); for weight sync, a whole tensor or its tensor-parallel
slice, copied as typed tensors (distload/live/transfer.py).
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch

Run = tuple[int, int, int, int, int, int]  # (src, dst, length, count, src_step, dst_step)
TensorRun = tuple[int, Run]  # (tensor, run from a bucket's buffer into that tensor)

ALIGN = 64  # a piece that starts on this many bytes can be viewed as any dtype


def aligned(size: int, align: int = ALIGN) -> int:
    """``size`` rounded up to a multiple of ``align``."""
    return -(-size // align) * align


def group_in_order(sizes: Sequence[int], limit: int, *, align: int = 1,
                   alone: Callable[[int], bool] = lambda n: False) -> list[tuple[int, ...]]:
    """Indices of ``sizes``, in order, grouped into buckets of at most ``limit`` bytes (each piece
    placed at ``align``-ed offsets, as ``offsets`` places them; a bigger one by itself); a piece
    for which ``alone(size)`` holds gets a bucket of its own."""
    groups: list[tuple[int, ...]] = []
    current: list[int] = []
    end = 0
    for index, n in enumerate(sizes):
        at = aligned(end, align)
        if current and (at + n > limit or alone(n)):
            groups.append(tuple(current))
            current, at = [], 0
        current.append(index)
        end = at + n
        if alone(n):
            groups.append(tuple(current))
            current, end = [], 0
    if current:
        groups.append(tuple(current))
    return groups


def offsets(sizes: Iterable[int], align: int = 1) -> tuple[list[int], int]:
    """Where pieces of ``sizes`` bytes sit in one bucket, in order, each start rounded up to
    ``align``; and the bucket's size (up to the end of the last piece)."""
    out: list[int] = []
    end = 0
    for n in sizes:
        at = aligned(end, align)
        out.append(at)
        end = at + n
    return out, end


def run_bytes(runs: Iterable[Run]) -> int:
    return sum(n * count for _, _, n, count, _, _ in runs)


def contiguous(runs: Sequence[Run], dst: bool) -> bool:
    """Whether ``runs`` cover one unbroken range, on their destination side (``dst``) or source."""
    at = None
    for src, d, n, count, ss, ds in runs:
        start, step = (d, ds) if dst else (src, ss)
        if count > 1 and step != n:
            return False
        if at is not None and start != at:
            return False
        at = start + n * count
    return True


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as one 1-d uint8 tensor (a view where it is contiguous)."""
    return tensor.reshape(-1).view(torch.uint8)


def rows(flat: torch.Tensor, start: int, n: int, count: int, step: int) -> torch.Tensor:
    """``count`` rows of ``n`` bytes from ``start``, ``step`` apart, as a (count, n) view."""
    if count == 1 or step == n:
        return flat[start:start + n * count].view(count, n)
    return flat[start:start + (count - 1) * step + n].as_strided((count, n), (step, 1))


def pack_runs(buffer: torch.Tensor, pieces: Sequence[TensorRun]) -> torch.Tensor:
    """The source sides of ``pieces`` in a bucket's ``buffer`` as one message, in order (a view
    where they are one range)."""
    runs = [r for _, r in pieces]
    if contiguous(runs, dst=False):
        return buffer[runs[0][0]:runs[0][0] + run_bytes(runs)]
    message = torch.empty(run_bytes(runs), dtype=torch.uint8, device=buffer.device)
    at = 0
    for _, (src, _, n, count, ss, _) in pieces:
        message[at:at + n * count].view(count, n).copy_(rows(buffer, src, n, count, ss))
        at += n * count
    return message


def unpack_runs(message: torch.Tensor, pieces: Sequence[TensorRun], flat: Callable[[int], torch.Tensor]) -> None:
    """A message ``pack_runs`` packed into the tensors its pieces belong to (``flat(i)``: tensor
    i's bytes)."""
    at = 0
    for i, (_, dst, n, count, _, ds) in pieces:
        rows(flat(i), dst, n, count, ds).copy_(message[at:at + n * count].view(count, n))
        at += n * count


def copy_runs(buffer: torch.Tensor, pieces: Sequence[TensorRun], flat: Callable[[int], torch.Tensor]) -> None:
    """``pieces`` straight from a bucket's ``buffer`` into their tensors (no message between)."""
    for i, (src, dst, n, count, ss, ds) in pieces:
        rows(flat(i), dst, n, count, ds).copy_(rows(buffer, src, n, count, ss))
