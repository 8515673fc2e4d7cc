"""RLHF pushes into a running vLLM engine by slices (issue 35): each worker receives only what its
own weight loaders take of each checkpoint tensor, and vLLM's layerwise reload puts it in place.

The trainer sends checkpoint tensors by their own names, whole on its side. A worker learns what
its loaders take of each (the weight map, distload/vllm/weight_map.py), recorded against the
engine's parameters *as they are loaded* (vLLM keeps their shapes from before its kernels
repacked them: the same metadata its own in-place reload restores) and cached. From the map it
says, with each update, which ranges of which dimension it keeps (:func:`cuts_of`, the channel's
``keeps=``); the trainer sends only those bytes.

They land in the worker's :class:`Staging`: one tensor per checkpoint tensor holding only the
ranges kept, kept from update to update so that a delta patches it in place. vLLM's own loaders
then take each tensor as a whole-shaped view of that staging (:meth:`Staging.whole`), so its
kernel formats are re-applied as a fresh load applies them: the view's strides and offset are
those of the kept block, and its storage starts early enough that the loader's ``narrow`` to this
rank's part lands exactly on the block. Elements outside the block are never read by a loader
that the map says takes only the block (the map saw every access); a tensor the map marks whole
is received whole. A tensor kept as several runs of rows (a checkpoint's fused q/k/v) is placed
into a whole-shaped tensor for the moment its loader runs: its untouched rows are never written,
so the host pages behind them are not used.

Memory: the staging holds this worker's slices (about 1/TP of the model, plus what every rank
keeps whole: norms, and the embeddings where vLLM replicates them) for the life of the channel;
during the reload vLLM materializes one layer's loading-format tensors at a time.
"""

from __future__ import annotations

import logging
from typing import Iterator, Mapping, Sequence

import torch

from distload.errors import DistloadError
from distload.loading.rank_slices import Rows

log = logging.getLogger("distload.vllm")

Cut = tuple[int, tuple[tuple[int, int], ...]]  # (dim, ranges of it kept)


def cuts_of(record, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Cut]:
    """What a worker keeps of each checkpoint tensor by the weight map ``record``: its runs of
    rows, or the ranges of the one dimension its box cuts (where a box cuts several, the one
    that keeps the least; the others travel whole), or nothing for a tensor no loader takes.
    A tensor it leaves out is kept whole (no cut, or a loader that computes with it)."""
    boxes = record.boxes(shapes)
    out: dict[str, Cut] = {}
    for name in record.unused:
        if name in shapes and len(shapes[name]) >= 1:
            out[name] = (0, ())
    for name, box in boxes.items():
        if name in record.whole:
            continue
        shape = shapes[name]
        if isinstance(box, Rows):
            out[name] = (0, tuple(box.runs))
            continue
        offsets, sizes = box
        cut = [d for d in range(len(shape)) if sizes[d] != shape[d]]
        if not cut:
            continue
        dim = min(cut, key=lambda d: sizes[d] / shape[d])
        if len(cut) > 1:
            log.info("distload: %s %s is cut along dims %s; the push cuts dim %d alone", name, list(shape), cut, dim)
        out[name] = (dim, ((offsets[dim], offsets[dim] + sizes[dim]),))
    return out


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= int(n)
    return tuple(reversed(out))


class _Held:
    """One checkpoint tensor's staging: ``piece`` (what the channel receives into) and how to
    show it to vLLM's loader whole-shaped."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], cut: Cut | None, piece_shape: tuple[int, ...]):
        self.key = (dtype, shape, cut, piece_shape)
        self.shape, self.cut = shape, cut
        numel = 1
        for n in piece_shape:
            numel *= int(n)
        if cut is None or len(cut[1]) != 1:  # whole, nothing, or runs: the piece alone
            self.storage = None
            self.piece = torch.empty(piece_shape, dtype=dtype)
            return
        # One block of ``dim``: a storage with room before the block, so that a view of the whole
        # shape with the block's strides starts there and its ``narrow`` to the block is the block.
        dim, ((start, _stop),) = cut
        strides = _strides(piece_shape)
        before = start * strides[dim]
        last = sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else -1
        self.storage = torch.empty(max(before + numel, last + 1), dtype=dtype)
        self.piece = self.storage[before:before + numel].view(piece_shape)
        self.strides = strides

    def whole(self) -> torch.Tensor | None:
        """The tensor vLLM's loader is given: whole-shaped, holding the piece where it lies in
        the whole tensor (None: nothing of it is kept here)."""
        if self.cut is None:
            return self.piece
        dim, ranges = self.cut
        if not ranges:
            return None
        if self.storage is not None:
            return self.storage.as_strided(self.shape, self.strides, 0)
        out = torch.empty(self.shape, dtype=self.piece.dtype)  # runs: only their rows are written
        at = 0
        for start, stop in ranges:
            out.narrow(dim, start, stop - start).copy_(self.piece.narrow(dim, at, stop - start))
            at += stop - start
        return out


class Staging:
    """A worker's received slices, by checkpoint name, kept from update to update (a tensor is
    made again only when its dtype, shape or cut changes, which the channel then sees as moved
    and sends whole)."""

    def __init__(self) -> None:
        self.held: dict[str, _Held] = {}
        self.order: list[str] = []
        self.cuts: dict[str, Cut] = {}

    def allocate(self, wanted: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                 shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """The channel's targets for an update bringing ``wanted`` (name -> dtype, shape kept) of
        tensors whose whole shapes are ``shapes``, under ``self.cuts``."""
        for name in set(self.held) - set(wanted):
            del self.held[name]
        for name, (dtype, piece_shape) in wanted.items():
            whole, cut = tuple(shapes[name]), self.cuts.get(name)
            key = (dtype, whole, cut, tuple(piece_shape))
            if name not in self.held or self.held[name].key != key:
                self.held[name] = _Held(dtype, whole, cut, tuple(piece_shape))
        self.order = [name for name in shapes if name in wanted]
        return {name: held.piece for name, held in self.held.items()}

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, whole-shaped tensor) in the update's order, for vLLM's loaders."""
        for name in self.order:
            tensor = self.held[name].whole()
            if tensor is not None:
                yield name, tensor

    @property
    def nbytes(self) -> int:
        return sum(h.piece.numel() * h.piece.element_size() for h in self.held.values())


# -- inside a vLLM worker --------------------------------------------------------------------------

def _distinct(tensors) -> list[torch.Tensor]:
    return list({id(t): t for t in tensors}.values())


def engine_weight_map(model: torch.nn.Module, tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
                      config_json: str, tp_size: int, tp_rank: int):
    """The weight map of checkpoint ``tensors`` (name, dtype, shape) in a running engine's
    ``model`` on this TP rank: from the cache, or recorded now against the parameters as they
    are loaded. vLLM keeps, per layer, meta tensors of those (what its in-place reload restores
    before it loads); they stand in for the layer's tensors while the model's own ``load_weights``
    runs on placeholders, and the engine's tensors are put back before this returns. Returns the
    record and the bytes of the parameters as loaded (this rank's slices of the model)."""
    import vllm
    from vllm.model_executor.model_loader.reload.layerwise import _place_kernel_tensors, get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

    from distload.vllm.experts import engine_experts, placement_key
    from distload.vllm.weight_map import cache_weight_map, cached_weight_map, record_weight_map, weight_map_key

    experts = placement_key(engine_experts(model))  # under EP, the record is of this worker's experts
    swapped = []
    try:
        for layer in model.modules():
            info = get_layerwise_info(layer)
            if info.can_load():
                raise DistloadError("a push arrived while the engine's weights are being reloaded")
            info.kernel_tensors = get_layer_params_buffers(layer)
            info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
            swapped.append((layer, info))
            restore_layer_on_meta(layer, info)
        params = dict(model.named_parameters(remove_duplicate=False))
        key = weight_map_key(config=config_json, tp_size=tp_size, tp_rank=tp_rank, vllm=vllm.__version__,
                             model=type(model).__qualname__, loaded_as="meta",
                             tensors=[(n, str(d), tuple(s)) for n, d, s in tensors],
                             params=[(n, str(p.dtype), tuple(p.shape)) for n, p in params.items()],
                             **({"experts": experts} if experts else {}))
        record = cached_weight_map(key)
        if record is None:
            record = record_weight_map(key, tensors, params, model.load_weights)
            cache_weight_map(record)
            log.info("distload recorded the weight map of %s for pushes on TP rank %d of %d: %d copies from %d "
                     "tensors", type(model).__name__, tp_rank, tp_size, len(record.copies), len(tensors))
        return record, sum(p.numel() * p.element_size() for p in _distinct(params.values()))
    finally:
        for layer, info in reversed(swapped):
            _place_kernel_tensors(layer, info)
            info.reset()
