"""BF16 -> FP8 refit: a trainer that holds BF16 weights updates an engine that serves FP8.

Why here, in the sync path: users project their BF16 weights to the engine's FP8 by hand after
each step, often wrongly and with no check (vllm 28425, 14266; verl 7136). A receiver whose
target holds ``X.weight`` as float8_e4m3fn with ``X.weight_scale_inv`` (float32, one per 128x128
block, DeepSeek-V3's and Qwen3-FP8's recipe) beside it says so in its answer to an update
(verdicts.ready); the trainer then quantizes ``X.weight`` before the bytes move, so the wire
carries FP8 plus scales (about half of BF16's bytes), and everything after that (TP slices and
their block scales, deltas of the FP8 bytes, the buckets' checks) treats the two tensors as if
the trainer had pushed them. Only that recipe is taken: any other FP8 target (e5m2, per-tensor
``weight_scale``, other block sizes) is refused by name, never quantized some other way.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from distload.errors import ConfigError
from distload.live.transfer import BucketLayout, SyncTensor, group_entries, layouts
from distload.tp.place import TPPlace

BLOCK = 128  # rows and columns of weight per scale: DeepSeek-V3's and Qwen3-FP8's weight_block_size
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
RECIPE = "float8_e4m3fn weights with a float32 weight_scale_inv per 128x128 block"
_SOURCES = ("BF16", "F16", "F32")  # what the trainer may push into an FP8 target
_ROWS_AT_ONCE = 16  # rows of blocks quantized at once: the float32 copy stays a bounded slab


def scale_name(weight: str) -> str:
    return weight + SCALE_SUFFIX


def scale_shape(shape: Sequence[int]) -> tuple[int, int]:
    """One scale per 128x128 block, the edge blocks ragged (ceil-div, as DeepSeek's)."""
    return -(-int(shape[0]) // BLOCK), -(-int(shape[1]) // BLOCK)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (2-d, any float dtype) as float8_e4m3fn and its float32 scales, block by block:
    ``s = |B|.amax().clamp(min=1e-12) / 448``, ``q = (B / s).clamp(-448, 448)``; ``q.float() * s``
    dequantizes. Where the weight lives (a GPU's never comes down whole)."""
    rows, cols = weight.shape
    brows, bcols = scale_shape(weight.shape)
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=weight.device)
    s = torch.empty((brows, bcols), dtype=torch.float32, device=weight.device)
    source = weight.detach()
    for first in range(0, brows, _ROWS_AT_ONCE):
        last = min(brows, first + _ROWS_AT_ONCE)
        top, bottom = first * BLOCK, min(rows, last * BLOCK)
        if bottom - top == (last - first) * BLOCK and cols == bcols * BLOCK:  # whole blocks: one copy
            slab = source[top:bottom].to(torch.float32, copy=True)
        else:
            # Zero padding to whole blocks: |0| never raises a block's amax, so the ragged edge
            # blocks get the scale of their own elements.
            slab = torch.zeros(((last - first) * BLOCK, bcols * BLOCK), dtype=torch.float32, device=weight.device)
            slab[:bottom - top, :cols] = source[top:bottom]
        blocks = slab.view(last - first, BLOCK, bcols, BLOCK)
        # max |x| as max(max x, -min x): the same value (negation is exact), without a copy for abs
        # (about 30% of the quantizer's time on a CPU)
        amax = torch.maximum(blocks.amax(dim=(1, 3)), blocks.amin(dim=(1, 3)).neg())
        scale = amax.clamp(min=1e-12) / FP8_MAX
        s[first:last] = scale
        blocks.div_(scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
        q[top:bottom] = slab[:bottom - top, :cols].to(torch.float8_e4m3fn)
    return q, s


# -- the receiver's side ----------------------------------------------------------------------------

def claims(metas: Mapping[int, Mapping[str, Any]], targets: Mapping[str, torch.Tensor], cuts: bool
           ) -> tuple[dict[int, list[int]], dict[str, str]]:
    """What this receiver's ``targets`` ask of the update (``metas``: by trainer rank): per trainer
    rank, the indices of the entries it pushes in a float dtype into a target that holds FP8 (to
    be quantized by it, every trainer rank listed), and what stops that, one line per tensor name:
    a recipe other than RECIPE, named. ``cuts``: a receiver that says what it keeps (``keeps=``),
    whose cuts name the entries as sent, before the scales exist: refit is refused there."""
    out: dict[int, list[int]] = {}
    problems: dict[str, str] = {}
    for trainer, meta in metas.items():
        out[trainer] = []
        entries = meta["entries"]
        sent = {entry.name for entry in entries}
        for index, entry in enumerate(entries):
            dst = targets.get(entry.name)
            if dst is None or not _fp8(dst) or entry.dtype not in _SOURCES:
                continue  # not a refit (check_pieces says what else does not fit)
            problem = _unsupported(entry, dst, targets, sent, meta.get("gathered", ()), cuts)
            if problem is None:
                out[trainer].append(index)
            else:
                problems[entry.name] = (f"{entry.name}: pushed {entry.dtype}, here {_dtype(dst)} "
                                        f"{list(dst.shape)}: {problem}")
    return out, problems


def _unsupported(entry: SyncTensor, dst: torch.Tensor, targets: Mapping[str, torch.Tensor], sent: set[str],
                 gathered: Sequence[str], cuts: bool) -> str | None:
    """Why ``entry`` cannot be refit into ``dst`` (None: it can), naming the recipe found."""
    supported = f"BF16 -> FP8 refit takes {RECIPE} only"
    if dst.dtype != torch.float8_e4m3fn:
        return f"{_dtype(dst)} is not supported ({supported})"
    if not entry.name.endswith(".weight") or len(entry.shape) != 2:
        return f"refit quantizes 2-d X.weight matrices ({supported})"
    scale = scale_name(entry.name)
    if scale not in targets:
        if entry.name + "_scale" in targets:
            held = targets[entry.name + "_scale"]
            return (f"its scales here are {entry.name}_scale {list(held.shape)} (a per-tensor or per-channel "
                    f"weight_scale recipe), which is not supported ({supported})")
        return f"no {scale} beside it here ({supported})"
    held = targets[scale]
    if held.dtype != torch.float32:
        return f"{scale} is {_dtype(held)} here, not float32 ({supported})"
    want = scale_shape(dst.shape)
    if len(held.shape) != 2 or tuple(held.shape) != want:
        blocks = ("x".join(str(-(-n // max(1, b))) for n, b in zip(dst.shape, held.shape))
                  if len(held.shape) == 2 else f"{held.dim()}-d scales")
        return (f"{scale} here is {list(held.shape)}, blocks of {blocks} (128x128 blocks would be "
                f"{list(want)}), which is not supported ({supported})")
    if scale in sent:
        return f"the trainer pushes {scale} as well: push the BF16 weight alone, and the trainer quantizes it"
    if entry.name in gathered:
        return "a DTensor, which refit does not quantize: push its full_tensor() from the rank that holds it"
    if cuts:
        return ("a receiver that says what it keeps (keeps=) takes FP8 as sent, not refit: quantize on the "
                "trainer, or receive with tensor_parallel_size/sharding")
    return None


def _fp8(tensor: torch.Tensor) -> bool:
    """An 8-bit float of any kind (e4m3fn, e5m2, the fnuz ones, e8m0)."""
    return tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def conflicts(claimed: Mapping[int, Mapping[int, Sequence[int]]], metas: Mapping[int, Mapping[str, Any]],
              who: Any, kept: Callable[[int, int], "set[int] | None"] | None = None
              ) -> tuple[dict[int, list[int]], list[str]]:
    """The leader's: every receiver's claims (session rank -> trainer rank -> indices) as one refit
    per trainer rank (what any of its receivers claimed), and a line for each tensor that a
    receiver of that trainer rank keeps as sent while another wants it as FP8 (a trainer rank
    sends each tensor once, in one dtype). ``who``: names a session rank. ``kept(rank, trainer)``:
    the indices of the trainer rank's entries that receiver keeps (None, or no ``kept``: all of
    them); an expert-parallel receiver neither claims nor keeps other ranks' experts, and is no
    conflict for them."""
    refit: dict[int, list[int]] = {}
    problems = []
    by_trainer: dict[int, dict[int, set[int]]] = {}
    for rank, per in sorted(claimed.items()):
        for trainer, indices in per.items():
            by_trainer.setdefault(int(trainer), {})[rank] = set(indices)
    for trainer, ranks in sorted(by_trainer.items()):
        union = set().union(*ranks.values())
        if not union:
            continue
        missing = []
        for rank, indices in ranks.items():
            keeps = kept(rank, trainer) if kept is not None else None
            left = (union if keeps is None else union & keeps) - indices
            if left:
                missing.append((min(left), rank))
        if not missing:
            refit[trainer] = sorted(union)
            continue
        index, plain = min(missing)
        fp8 = next(rank for rank, indices in ranks.items() if index in indices)
        entry = metas[trainer]["entries"][index]
        problems.append(f"{entry.name}: {who(fp8)} holds it as float8_e4m3fn (BF16 -> FP8 refit), {who(plain)} "
                        f"as sent ({entry.dtype}); a trainer rank sends a tensor in one dtype to all its receivers")
    return refit, problems


def replanned(sent: Mapping[int, Mapping[str, Any]], claimed: Mapping[int, Sequence[int]],
              refit: Mapping[int, Sequence[int]], metas: dict[int, Mapping[str, Any]],
              plans_of: dict[int, list[BucketLayout]], place: TPPlace
              ) -> tuple[dict[int, Mapping[str, Any]], dict[int, list[BucketLayout]]]:
    """A receiver's metadata and layouts once the verdict says what each trainer rank quantizes
    (``refit``): where that is more than this receiver claimed (other EP ranks' experts, which it
    does not keep), the update travels as every claim together makes it. ``sent``: the metadata
    as the trainer ranks posted it; ``metas``/``plans_of``: as this receiver planned them."""
    wanted = {t: sorted(refit.get(t, ())) for t in sent}
    if all(sorted(claimed.get(t, ())) == wanted[t] for t in sent):
        return metas, plans_of
    problems: list[str] = []
    out = plans(sent, wanted, place, problems)
    if problems:  # it planned the pieces it keeps already; they do not change with others' claims
        raise ConfigError(problems[0])
    return out


# -- both sides -------------------------------------------------------------------------------------

def converted(meta: Mapping[str, Any], indices: Sequence[int]) -> dict[str, Any]:
    """A trainer rank's metadata as its update travels once ``indices`` are refit: each of those
    entries as float8_e4m3fn with its scales right after it, regrouped into buckets as the trainer
    groups them. Sender and receivers compute it alike from the same data (no layout travels)."""
    refit = set(indices)
    entries: list[SyncTensor] = []
    for index, entry in enumerate(meta["entries"]):
        if index not in refit:
            entries.append(entry)
            continue
        numel = int(entry.shape[0]) * int(entry.shape[1])
        shape = scale_shape(entry.shape)
        entries.append(SyncTensor(entry.name, "F8_E4M3", tuple(entry.shape), numel))
        entries.append(SyncTensor(scale_name(entry.name), "F32", shape, shape[0] * shape[1] * 4))
    return {**meta, "entries": entries, "groups": group_entries(entries, meta["bucket_bytes"])}


def for_push(entries: Sequence[SyncTensor], tensors: Mapping[int, torch.Tensor], meta: Mapping[str, Any],
             indices: Sequence[int]) -> tuple[list[SyncTensor], list[tuple[int, ...]], "Quantizing", dict]:
    """A trainer rank's update once ``indices`` are refit: its entries, groups, tensors (each refit
    one quantized when its bucket is sent: :class:`Quantizing`) and metadata, as its receivers
    derive them (:func:`plans`)."""
    meta = converted(meta, indices)
    return meta["entries"], meta["groups"], Quantizing(tensors, entries, indices), meta


def plans(metas: Mapping[int, Mapping[str, Any]], claimed: Mapping[int, Sequence[int]], place: TPPlace,
          problems: list[str]) -> tuple[dict[int, Mapping[str, Any]], dict[int, list[BucketLayout]]]:
    """A receiver's metadata and bucket layouts as the update will travel once its trainer ranks
    quantize what it claimed; a TP slice whose block scales cannot be cut on the blocks goes into
    ``problems`` (its refusal, naming the tensor, the block size and the TP sizes that work)."""
    metas = {t: converted(m, claimed[t]) if claimed.get(t) else m for t, m in metas.items()}
    out = {}
    for t, m in metas.items():
        try:
            out[t] = layouts(m["entries"], m["groups"], place, m["verify"])
        except ConfigError as exc:
            problems.append(str(exc))
            out[t] = []
    return metas, out


class Quantizing(Mapping[int, torch.Tensor]):
    """The trainer's tensors by index of :func:`converted`'s entries: each refit one quantized (its
    FP8 bytes, then its scales), the others as they are.

    A refit tensor is quantized when its bucket asks for it, and only the last ``KEPT`` of them
    are held here (a weight's scales, right after it, may open the next bucket): a push holds the
    FP8 copies of the buckets under way (the two in flight may still be sending from them), not
    half the bytes of everything it refits, for which a trainer rank of a large model has no room
    beside its BF16 weights."""

    KEPT = 1

    def __init__(self, tensors: Mapping[int, torch.Tensor], entries: Sequence[SyncTensor], indices: Sequence[int]):
        refit = set(indices)
        self._tensors = tensors
        self._where: dict[int, tuple[int, int | None]] = {}  # converted index -> (source index, FP8/scale part)
        at = 0
        for index in range(len(entries)):
            if index in refit:
                self._where[at], self._where[at + 1] = (index, 0), (index, 1)
                at += 2
            else:
                if index in tensors:
                    self._where[at] = (index, None)
                at += 1
        self._held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # source index -> (q, s), oldest first

    def __getitem__(self, index: int) -> torch.Tensor:
        source, part = self._where[index]
        if part is None:
            return self._tensors[source]
        pair = self._held.pop(source, None)
        if pair is None:
            pair = quantize(self._tensors[source])
        self._held[source] = pair  # the newest last
        while len(self._held) > self.KEPT:
            del self._held[next(iter(self._held))]
        return pair[part]

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def source(self, index: int) -> tuple[torch.Tensor, int | None]:
        """The pushed tensor that entry ``index`` is made from, and which part of it (0: the FP8
        bytes, 1: the scales; None: it is that tensor): what names one tensor pushed under two
        names (tied weights), whose quantized copies are new memory each time."""
        source, part = self._where[index]
        return self._tensors[source], part
