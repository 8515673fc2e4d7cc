"""The weight map: where a model's own weight loaders put each checkpoint tensor (issue 35).

vLLM's models say where each checkpoint tensor lands only in code: each ``load_weights`` maps
names, and each layer's ``weight_loader`` narrows, chunks, transposes and copies. Rather than
table that code per architecture, :func:`record_weight_map` runs it once against placeholder tensors
(the checkpoint's dtype and shape from its headers, no data) and records what every copy into a
parameter takes of which checkpoint tensor; :meth:`WeightMap.replay` then does exactly those
copies with the real tensors, and any architecture whose loaders only move data loads without a
table.

How it sees the copies: a placeholder is a tensor subclass whose only content is a meta tensor of
the checkpoint tensor's geometry; a view op on the placeholder is applied to that meta tensor, so
its ``(storage_offset, shape, stride)`` is always the region of checkpoint elements the view
covers. A ``TorchDispatchMode`` around the loaders sees every op: a ``copy_`` from a placeholder
into a parameter's memory records (source region, parameter, destination region, dtype chain);
``fill_``/``zero_`` on a parameter (vLLM zeroes the padded rows of a vocabulary) records the
fill. Any other op on a placeholder (arithmetic, ``cat``, ``.item()``, a write into a temporary)
cannot be expressed as a region: that tensor is marked *whole*, with the op that made it so, and
is handed to vLLM's own loader at load time.

Plain torch: nothing of vLLM is imported here (the plugin passes the model and its loader in), so
the recorder is tested on plain modules.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterable, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distload.errors import DistloadError
from distload.fileio import write_json_atomic
from distload.loading.rank_slices import Rows

FORMAT_VERSION = 1  # of the cached JSON; a change of the record's meaning bumps it

_aten = torch.ops.aten
# View ops whose meaning depends on the storage behind the tensor, not just its elements: after a
# clone the placeholder's meta tensor keeps the source's strides, so these would read the wrong
# elements. They are rare in weight loaders; a tensor that meets one is read whole.
_STORAGE_DEPENDENT_VIEWS = (_aten.as_strided.default, _aten.view.dtype)
# Ops that make a new tensor with the same elements (only the dtype may change): the placeholder
# goes on with the same region and notes the cast, so the replay rounds exactly as vLLM's did.
_SAME_ELEMENTS = (_aten.clone.default, _aten._to_copy.default)
_FILLS = (_aten.fill_.Scalar, _aten.zero_.default)


@dataclass(frozen=True)
class Region:
    """Elements of a tensor's storage: ``as_strided(shape, stride, offset)`` from its first element."""

    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @staticmethod
    def of(view: torch.Tensor, base_offset: int = 0) -> "Region":
        return Region(view.storage_offset() - base_offset, tuple(view.shape), tuple(view.stride()))

    def on(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.as_strided(self.shape, self.stride, tensor.storage_offset() + self.offset)

    def extent(self) -> tuple[int, int]:
        """The first and last element (from the tensor's first) the region can touch; (0, -1) if
        it is empty."""
        if 0 in self.shape:
            return 0, -1
        low = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride) if s < 0)
        high = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride) if s > 0)
        return low, high


@dataclass(frozen=True)
class Copy:
    """One copy a weight loader made: ``tensor``'s ``source`` region, cast through ``casts`` (dtype
    names, in order), into ``param``'s ``dest`` region."""

    tensor: str
    source: Region
    param: str
    dest: Region
    casts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Fill:
    """A constant a loader wrote into ``param``'s ``dest`` region while loading ``tensor``."""

    tensor: str
    param: str
    dest: Region
    value: float


@dataclass
class WeightMap:
    """Per checkpoint tensor, what the model's loaders take of it and where it lands (see the
    module docstring). ``whole``: tensor -> why it must go through the model's own loader;
    ``unused``: tensors no loader took anything of (vLLM skips them too, e.g. rotary caches)."""

    key: str
    copies: list[Copy] = field(default_factory=list)
    fills: list[Fill] = field(default_factory=list)
    whole: dict[str, str] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)

    def by_tensor(self, boxes: Mapping[str, Box] | None = None,
                  shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, tuple[list[Copy], list[Fill]]]:
        """Each tensor's copies and fills; with ``boxes`` (from :meth:`boxes`) and the tensors'
        ``shapes``, the copies of a boxed tensor read from the box alone (its regions rebased)."""
        out: dict[str, tuple[list[Copy], list[Fill]]] = {}
        for c in self.copies:
            box = boxes.get(c.tensor) if boxes else None
            if box is not None:
                c = replace(c, source=_rebase(c.source, shapes[c.tensor], box))
            out.setdefault(c.tensor, ([], []))[0].append(c)
        for f in self.fills:
            out.setdefault(f.tensor, ([], []))[1].append(f)
        return out

    def boxes(self, shapes: Mapping[str, tuple[int, ...]]) -> "dict[str, Box | Rows]":
        """Per tensor, what a TP rank needs to read of it, where that is less than the whole
        tensor: the smallest box (offsets, sizes along each dimension) holding every element its
        copies take; or, where the copies take whole rows in runs with other ranks' rows between
        them (a checkpoint's fused q/k/v: this rank's rows of each part), those runs of rows. A
        tensor taken through a region that is no box of it (a view that merges dimensions across
        a narrowed one) is left whole."""
        spans: dict[str, list[tuple[list[int], list[int]]] | None] = {}
        for c in self.copies:
            if c.tensor in spans and spans[c.tensor] is None:
                continue
            span = _span(c.source, shapes[c.tensor])
            spans[c.tensor] = None if span is None else spans.get(c.tensor, []) + [span]
        out: dict[str, Box | Rows] = {}
        for name, taken in spans.items():
            if taken is None:
                continue
            shape = tuple(shapes[name])
            rows = _row_runs(taken, shape)
            if rows is not None and len(rows.runs) > 1:
                out[name] = rows
                continue
            first = [min(span[0][d] for span in taken) for d in range(len(shape))]
            last = [max(span[1][d] for span in taken) for d in range(len(shape))]
            sizes = tuple(e - s + 1 for s, e in zip(first, last))
            if sizes != shape:
                out[name] = (tuple(first), sizes)
        return out

    def kept_nbytes(self, tensors) -> int:
        """The checkpoint bytes this rank keeps of ``tensors`` (index entries: ``name``, ``shape``,
        ``torch_dtype``): the elements its copies take (at most the tensor), and the tensors
        it hands whole to the model's own loader. What a read is measured against."""
        taken: dict[str, int] = {}
        for c in self.copies:
            taken[c.tensor] = taken.get(c.tensor, 0) + _numel(c.source.shape)
        out = 0
        for t in tensors:
            numel = _numel(t.shape)
            if t.name in self.whole:
                taken[t.name] = numel
            out += min(taken.get(t.name, 0), numel) * t.torch_dtype.itemsize
        return out

    def replay(self, name: str, tensor: torch.Tensor, params: Mapping[str, torch.Tensor],
               steps: "tuple[list[Copy], list[Fill]] | None" = None) -> None:
        """Do the record's copies and fills of checkpoint tensor ``name`` with its real ``tensor``
        (whole, as the checkpoint holds it) into ``params`` (name -> the engine's tensors)."""
        copies, fills = steps if steps is not None else self.by_tensor().get(name, ([], []))
        if tensor.dim() and not tensor.is_contiguous():
            raise DistloadError(f"{name}: the weight map's source regions are of the checkpoint's contiguous "
                                f"tensor; this one has strides {tensor.stride()}")
        self.fill(name, fills, params)
        for c in copies:
            value = c.source.on(tensor)
            for dtype in c.casts:
                value = value.to(getattr(torch, dtype))
            c.dest.on(_param(params, c.param, name).data).copy_(value)

    @staticmethod
    def fill(name: str, fills: Iterable[Fill], params: Mapping[str, torch.Tensor]) -> None:
        """Make the fills that checkpoint tensor ``name``'s loader made (padding it zeroes)."""
        for f in fills:
            f.dest.on(_param(params, f.param, name).data).fill_(f.value)

    # -- the cache ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": FORMAT_VERSION, **asdict(self)}

    @staticmethod
    def from_json(text: str) -> "WeightMap":
        raw = json.loads(text)
        if raw.pop("format", None) != FORMAT_VERSION:
            raise ValueError("another format version")

        def region(r):
            return Region(r["offset"], tuple(r["shape"]), tuple(r["stride"]))

        return WeightMap(
            key=raw["key"],
            copies=[Copy(c["tensor"], region(c["source"]), c["param"], region(c["dest"]), tuple(c["casts"]))
                    for c in raw["copies"]],
            fills=[Fill(f["tensor"], f["param"], region(f["dest"]), f["value"]) for f in raw["fills"]],
            whole=dict(raw["whole"]), unused=list(raw["unused"]))


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes), distload's block of a tensor


def _row_runs(spans: list[tuple[list[int], list[int]]], shape: tuple[int, ...]) -> Rows | None:
    """The merged runs of rows the spans take, when each span covers whole rows (every dimension
    after the first entirely); None otherwise."""
    if len(shape) < 1 or any(span[0][d] != 0 or span[1][d] != shape[d] - 1
                             for span in spans for d in range(1, len(shape))):
        return None
    runs: list[list[int]] = []
    for start, stop in sorted((span[0][0], span[1][0] + 1) for span in spans):
        if runs and start <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], stop)
        else:
            runs.append([start, stop])
    return Rows(tuple((a, b) for a, b in runs))


def contiguous(region: Region) -> bool:
    """Whether ``region``'s elements are one run of storage, in order (strides of dimensions of
    size 1 do not matter)."""
    return all(n == 1 or a == b for n, a, b in zip(region.shape, region.stride, _strides(tuple(region.shape))))


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return out[::-1]


def _index(offset: int, strides: list[int]) -> list[int]:
    """An element offset in a contiguous tensor as its index along each dimension."""
    out = []
    for s in strides:
        i, offset = divmod(offset, s)
        out.append(i)
    return out


def _span(region: Region, shape: tuple[int, ...]):
    """(first, last) index along each dimension of ``shape`` of the elements ``region`` takes, or
    None when the region is not a box of the tensor. Each of the region's strides is split into
    steps along the tensor's dimensions; when no index then runs past its dimension, every element
    of the region is start + sum(i_k * step_k), exactly, so the region lies in that box."""
    if not shape or 0 in region.shape:
        return None
    strides = _strides(shape)
    start = _index(region.offset, strides)
    steps = [_index(s, strides) for s in region.stride]
    end = [start[d] + sum((n - 1) * step[d] for n, step in zip(region.shape, steps)) for d in range(len(shape))]
    if any(e >= n for e, n in zip(end, shape)):
        return None
    return start, end


def _rebase(region: Region, shape: tuple[int, ...], box: "Box | Rows") -> Region:
    """``region`` of a tensor of ``shape`` as a region of its ``box`` (read alone, contiguous), or
    of its rows read one run after the other (the region lies in one run: its rows move up by the
    rows of the runs skipped before it; its strides stay, the rows being whole)."""
    if isinstance(box, Rows):
        row = _strides(shape)[0]
        first = region.offset // row
        skipped = 0
        for start, stop in box.runs:
            if start <= first < stop:
                return replace(region, offset=region.offset - (start - skipped) * row)
            skipped += stop - start
        raise AssertionError(f"row {first} lies in none of the runs {box.runs}")
    strides, inner = _strides(shape), _strides(box[1])
    start = _index(region.offset, strides)
    offset = sum((i - o) * s for i, o, s in zip(start, box[0], inner))
    return Region(offset, region.shape,
                  tuple(sum(a * b for a, b in zip(_index(s, strides), inner)) for s in region.stride))


def _param(params: Mapping[str, torch.Tensor], name: str, tensor: str) -> torch.Tensor:
    try:
        return params[name]
    except KeyError:
        raise DistloadError(f"{tensor}: the weight map writes into parameter {name!r}, which this model "
                            f"does not have; the map is stale: delete it from the weight-map cache "
                            f"({cache_dir()})") from None


def weight_map_key(**parts) -> str:
    """The cache key: a digest of everything the record depends on (the model config, the TP size
    and rank, the vLLM version, the checkpoint's tensors and the engine's parameters)."""
    text = json.dumps({"format": FORMAT_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cache_dir() -> str:
    return os.environ.get("DISTLOAD_WEIGHT_MAP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "distload", "vllm-weight-maps")


def cached_weight_map(key: str) -> WeightMap | None:
    """The record cached under ``key``, or None (none yet, or one written by another version)."""
    path = os.path.join(cache_dir(), key + ".json")
    try:
        with open(path) as f:
            record = WeightMap.from_json(f.read())
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or unreadable: record afresh and overwrite it
    return record if record.key == key else None


def cache_weight_map(record: WeightMap) -> None:
    os.makedirs(cache_dir(), exist_ok=True)
    write_json_atomic(os.path.join(cache_dir(), record.key + ".json"), record.to_dict(), indent=0)


# -- recording --------------------------------------------------------------------------------

class _NotARegion(Exception):
    """A loader did something to a placeholder that no region of the checkpoint tensor describes."""

    def __init__(self, tensor: str, why: str):
        super().__init__(why)
        self.tensor = tensor
        self.why = why


class Placeholder(torch.Tensor):
    """A checkpoint tensor without data: ``_meta`` is a meta tensor viewing the checkpoint tensor's
    elements (its region), ``_casts`` the dtypes it was converted through. Only the recorder's
    dispatch mode handles its ops."""

    _name: str
    _meta: torch.Tensor
    _casts: tuple[str, ...]

    __torch_function__ = torch._C._disabled_torch_function_impl  # ops reach the mode as aten ops

    @staticmethod
    def __new__(cls, name: str, meta: torch.Tensor, dtype: torch.dtype, device: torch.device,
                casts: tuple[str, ...] = ()):
        t = torch.Tensor._make_wrapper_subclass(cls, meta.shape, strides=meta.stride(),
                                                storage_offset=meta.storage_offset(), dtype=dtype,
                                                device=device, requires_grad=False)
        t._name, t._meta, t._casts = name, meta, casts
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise _NotARegion(next(a._name for a in _flat(args) if isinstance(a, Placeholder)),
                          f"{func} outside the recorder")

    def __repr__(self) -> str:
        return f"<checkpoint tensor {self._name} {list(self.shape)} {self.dtype}>"


def _storage_key(tensor: torch.Tensor) -> int:
    """Which storage ``tensor`` views: its address, or on the meta device (no addresses) the
    storage object itself, which every view of one tensor shares."""
    storage = tensor.untyped_storage()
    return storage._cdata if tensor.is_meta else storage.data_ptr()


def _flat(args) -> Iterable:
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


class _Recorder(TorchDispatchMode):
    def __init__(self, params: Mapping[str, torch.Tensor], record: WeightMap):
        super().__init__()
        self.record = record
        # Which parameter a write lands in, by its storage (tied parameters: the first name, as
        # vLLM's _filter_subtensors keeps it).
        self.storages: dict[int, tuple[str, torch.Tensor]] = {}
        for name, p in params.items():
            self.storages.setdefault(_storage_key(p), (name, p))
        # Parameters on the meta device (a running engine's, as it loads them: distload/vllm/sync.py):
        # a loader's move of a tensor onto its parameter's device is then a move to meta.
        self.on_meta = any(p.is_meta for p in params.values())
        self.current = ""  # the checkpoint tensor whose loader runs now
        self.taken: set[str] = set()

    def _param_of(self, dest: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if isinstance(dest, Placeholder):
            return None
        return self.storages.get(_storage_key(dest))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        holders = [a for a in _flat(list(args) + list(kwargs.values())) if isinstance(a, Placeholder)]
        if not holders:
            if func in _FILLS or (func._schema.is_mutable and func is not _aten.copy_.default):
                self._write(func, args, kwargs)
            elif func is _aten.copy_.default and self._param_of(args[0]) is not None:
                raise _NotARegion(self.current, f"{func} into parameter "
                                  f"{self._param_of(args[0])[0]} from a computed value")
            return func(*args, **kwargs)
        src = holders[0]
        if func is _aten.copy_.default and isinstance(args[1], Placeholder) and not isinstance(args[0], Placeholder):
            return self._copy(args[0], args[1])
        if len(holders) > 1 or args[0] is not src:
            raise _NotARegion(src._name, f"{func} combines it with other tensors")
        if func in _SAME_ELEMENTS:
            if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta" \
                    and not self.on_meta:
                raise _NotARegion(src._name, f"{func} to meta")
            dtype = kwargs.get("dtype") or src.dtype
            casts = src._casts + ((str(dtype).removeprefix("torch."),) if dtype != src.dtype else ())
            return Placeholder(src._name, src._meta, dtype, src.device, casts)
        if func.is_view and func not in _STORAGE_DEPENDENT_VIEWS or func is _aten._unsafe_view.default:
            op = _aten.view.default if func is _aten._unsafe_view.default else func
            try:
                out = op(src._meta, *args[1:], **kwargs)
            except RuntimeError as exc:  # a reshape that copies, e.g. of a transposed view
                raise _NotARegion(src._name, f"{func}: {str(exc).split(';')[0].split('(')[0].strip()}") from None
            if isinstance(out, torch.Tensor):
                return Placeholder(src._name, out, src.dtype, src.device, src._casts)
            return type(out)(Placeholder(src._name, o, src.dtype, src.device, src._casts) for o in out)
        raise _NotARegion(src._name, f"{func} on its values")

    def _copy(self, dest: torch.Tensor, src: Placeholder) -> torch.Tensor:
        owner = self._param_of(dest)
        if owner is None:
            raise _NotARegion(src._name, "copied into a tensor that is not a parameter of the model")
        if tuple(dest.shape) != tuple(src.shape):
            raise _NotARegion(src._name, f"broadcast from {list(src.shape)} into {list(dest.shape)} of {owner[0]}")
        casts = src._casts + ((str(dest.dtype).removeprefix("torch."),) if dest.dtype != src.dtype else ())
        self.record.copies.append(Copy(src._name, Region.of(src._meta), owner[0],
                                       Region.of(dest, owner[1].storage_offset()), casts))
        self.taken.add(src._name)
        return dest

    def _write(self, func, args, kwargs) -> None:
        owner = self._param_of(args[0]) if args and isinstance(args[0], torch.Tensor) else None
        if owner is None:
            return
        if func is _aten.fill_.Scalar or func is _aten.zero_.default:
            value = float(args[1]) if func is _aten.fill_.Scalar else 0.0
            self.record.fills.append(Fill(self.current, owner[0], Region.of(args[0], owner[1].storage_offset()),
                                          value))
            return
        raise _NotARegion(self.current, f"{func} writes into parameter {owner[0]}")


def record_weight_map(key: str, tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                  params: Mapping[str, torch.Tensor],
                  load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object]) -> WeightMap:
    """Run ``load_weights`` (the model's own) once per checkpoint tensor, given as (name, dtype,
    shape), with a placeholder of it, and record where each one lands in ``params`` (the model's
    tensors by name). The loaders really run: fills they make are made (the replay makes them
    again); copies from placeholders move nothing."""
    tensors = list(tensors)
    record = WeightMap(key)
    recorder = _Recorder(params, record)
    device = next(iter(params.values())).device if params else torch.device("cpu")
    if device.type == "meta":
        device = torch.device("cpu")
    for name, dtype, shape in tensors:
        meta = torch.empty(shape, dtype=dtype, device="meta")
        recorder.current = name
        try:
            with recorder:
                load_weights(iter([(name, Placeholder(name, meta, dtype, device))]))
        except _NotARegion as exc:
            whole = exc.tensor or name
            record.whole[whole] = exc.why
            record.copies = [c for c in record.copies if c.tensor != whole]
            record.fills = [f for f in record.fills if f.tensor != whole]
            recorder.taken.discard(whole)
        except Exception as exc:  # the model's own loader refused the tensor: say which one
            raise DistloadError(f"recording the weight map: the model's load_weights failed on checkpoint tensor "
                                f"{name} {list(shape)} {dtype}: {type(exc).__name__}: {exc}; does vLLM's own "
                                f"--load-format safetensors load this checkpoint?") from exc
    record.unused = sorted({n for n, _, _ in tensors} - recorder.taken - set(record.whole)
                           - {f.tensor for f in record.fills})
    return record


# -- verifying a new record -------------------------------------------------------------------

def sample_tensors(tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The tensors a new record is verified on: every tensor outside the repeated layers (names
    without a number: embeddings, final norm, output layer) and, of each kind of layer tensor
    (its name with the layer number taken out), the one in the first layer that has it: the
    first layer whole (its experts included), and the first mixture-of-experts layer of a model
    whose first layers are dense (DeepSeek-V3's ``first_k_dense_replace``). The other layers
    repeat those loaders."""
    import re

    first: dict[str, int] = {}
    kinds = {}
    for name, _, _ in tensors:
        if (m := re.search(r"\.(\d+)(\.|$)", name)):
            kinds[name] = kind = name[:m.start(1)] + "#" + name[m.end(1):]
            first[kind] = min(first.get(kind, int(m.group(1))), int(m.group(1)))
    return [(n, d, s) for n, d, s in tensors
            if n not in kinds or first[kinds[n]] == int(re.search(r"\.(\d+)(\.|$)", n).group(1))]


def verify_weight_map(record: WeightMap, sample: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                      params: Mapping[str, torch.Tensor],
                      load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object]) -> list[str]:
    """Replay ``record`` on random tensors of ``sample`` (name, dtype, shape) and run the model's
    own ``load_weights`` on the same tensors: the parameters they land in, named where the two
    differ in any bit (empty: the record holds). A pure data movement does not depend on the
    values, so random bytes check it as well as the checkpoint's would, without reading any.
    The parameters it writes hold what they held before, afterwards."""
    generator = torch.Generator().manual_seed(0)
    sample = [(n, d, s) for n, d, s in sample if n not in record.whole]
    data = {}
    for name, dtype, shape in sample:
        nbytes = torch.empty((), dtype=dtype).element_size()
        for n in shape:
            nbytes *= n
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
        data[name] = raw.view(dtype).reshape(shape)
    steps = record.by_tensor()
    touched = sorted({c.param for n, _, _ in sample for c in steps.get(n, ([], []))[0]}
                     | {f.param for n, _, _ in sample for f in steps.get(n, ([], []))[1]})
    before = {name: params[name].data.clone() for name in touched}
    try:
        for name in touched:
            params[name].data.zero_()
        load_weights(iter(list(data.items())))
        expected = {name: params[name].data.clone() for name in touched}
        for name in touched:
            params[name].data.zero_()
        for name, tensor in data.items():
            record.replay(name, tensor, params, steps.get(name, ([], [])))
        return [name for name in touched if not torch.equal(_bytes(params[name].data), _bytes(expected[name]))]
    finally:  # what the parameters held (a load compared with vLLM's own expects it there)
        for name, held in before.items():
            params[name].data.copy_(held)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _numel(shape) -> int:
    count = 1
    for n in shape:
        count *= int(n)
    return count
