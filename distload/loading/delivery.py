"""What a backend delivers, checked against the rank plan on its way to the consumer.

Each tensor must arrive once and be named by a header of this rank's files; at the end every
indexed tensor must have arrived, the manifest's aliases (tied weights) are handed out as the
very tensor they share storage with, its views (tensors saved inside another) as views of it, and every key the manifest lists for the rank must be there.
A backend that breaks any of these is a bug or a changed file, never a silent partial load.
"""

from __future__ import annotations

from typing import Iterator

import torch

from distload.errors import CheckpointError
from distload.loading.index import DTYPES
from distload.loading.manifest import Subtensor
from distload.loading.plan import RankPlan
from distload.loading.report import Progress


def missing_keys_error(missing: set[str], why: str) -> CheckpointError:
    # vLLM's own words first (``Missing keys ('b2',) in loaded state!``, a tuple of every key), so
    # that what users grep for and match on stays true; then why.
    return CheckpointError(f"Missing keys {tuple(sorted(missing))} in loaded state! ({why})")


def view_of(base: torch.Tensor, view: Subtensor, name: str) -> torch.Tensor:
    """``view`` of the loaded ``base``: the same memory, as in the model it was saved from."""
    dtype = DTYPES[view.dtype]
    start = base.storage_offset() * base.element_size() + view.offset
    extent = sum((size - 1) * stride for size, stride in zip(view.shape, view.stride)) + 1 if all(view.shape) else 0
    if start % dtype.itemsize or view.offset + extent * dtype.itemsize > base.numel() * base.element_size():
        raise CheckpointError(f"tensor {name!r} does not lie inside {view.of!r} as the manifest says "
                              f"(offset {view.offset}, shape {list(view.shape)}): the manifest is damaged")
    return torch.empty(0, dtype=dtype, device=base.device).set_(
        base.untyped_storage(), start // dtype.itemsize, view.shape, view.stride)


class Delivery:
    """Counts and checks one rank's tensors; ``nbytes`` and ``num_tensors`` for the report."""

    def __init__(self, plan: RankPlan, backend: str, progress: Progress):
        self.plan = plan
        self.backend = backend
        self.progress = progress
        self.expected = {t.name for t in plan.index.tensors}
        # A split tensor arrives in its slice's shape: a reader that delivered the whole tensor
        # (or another rank's slice shape) would be a silently wrong load.
        self.sliced_shapes = {name: piece.shape for name, piece in plan.slices.slices.items()} if plan.slices else {}
        # Other EP ranks' experts: checked as arriving (empty), not counted, not handed out.
        self.dropped = plan.slices.dropped if plan.slices else frozenset()
        self.received: set[str] = set()
        self.nbytes = 0
        self._alias_targets: dict[str, torch.Tensor | None] = {target: None for target in plan.aliases.values()}
        self._alias_targets.update({view.of: None for view in plan.views.values()})

    @property
    def num_tensors(self) -> int:
        return len(self.received - self.dropped)

    def accept(self, name: str, tensor: torch.Tensor) -> None:
        """One tensor from the backend: named by a header, and the first time."""
        if name in self.received or name not in self.expected:
            raise CheckpointError(
                f"{self.backend} returned tensor {name!r} "
                f"{'twice' if name in self.received else 'that no header of this rank names'}"
            )
        want = self.sliced_shapes.get(name)
        if want is not None and tuple(tensor.shape) != want:
            raise CheckpointError(f"{self.backend} returned tensor {name!r} with shape {list(tensor.shape)}, "
                                  f"but this rank's slice is {list(want)}")
        self.received.add(name)
        if name in self.dropped:
            return
        size = tensor.numel() * tensor.element_size()
        self.nbytes += size
        self.progress.update(size)
        if name in self._alias_targets:
            self._alias_targets[name] = tensor

    def finish(self) -> Iterator[tuple[str, torch.Tensor]]:
        """After the backend's last tensor: check it delivered everything, then hand out the aliases."""
        if self.received != self.expected:
            raise missing_keys_error(self.expected - self.received, f"the {self.backend} reader delivered "
                                     f"{len(self.received)} of {len(self.expected)} tensors")
        for alias, target in self.plan.aliases.items():
            tensor = self._alias_targets.get(target)
            if tensor is None:
                raise missing_keys_error({alias}, f"it shares storage with {target!r}, which is not in "
                                         f"this rank's files")
            self.received.add(alias)
            yield alias, tensor  # the same tensor: tied weights stay tied
        for name, view in self.plan.views.items():
            base = self._alias_targets.get(view.of)
            if base is None:
                raise missing_keys_error({name}, f"it lies inside {view.of!r}, which is not in this rank's files")
            self.received.add(name)
            yield name, view_of(base, view, name)
        expected_keys = self.plan.expected_keys
        if expected_keys is not None and not expected_keys <= self.received:
            raise missing_keys_error(expected_keys - self.received,
                                     "the manifest lists them for this rank but its files lack them")
