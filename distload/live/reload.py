"""In-place reload: copy a checkpoint into an existing model without reallocating anything.

Every parameter keeps its storage (``data_ptr()`` unchanged), so CUDA graphs and an engine's
references stay valid. Host memory stays bounded: tensors stream one at a time from the loader
and are copied and dropped.

Order of calls (every rank of the group makes them):

1. ``Loader.plan()``: the rank plan (list, headers of this rank's files; collective, see loader.py).
2. ``agree("checking the model against the checkpoint")``: every checkpoint tensor, after the
   name map and the sharding spec, is matched to its destination and its shape and dtype compared;
   every model tensor must be covered. Any mismatch on any rank stops every rank here, before a
   single byte is written, and says what differs.
3. Stream and copy. An I/O failure here is reported with how many tensors were already written.

Name mapping (engine layouts): ``name_map(checkpoint_name)`` returns the model name, a
:class:`Destination` (copy into a slice of a fused parameter, and/or take a slice of the
checkpoint tensor), a list of them (one checkpoint tensor feeding several parameters), or None
to ignore the tensor on purpose. Slicing: ``sharding`` (a sharding spec name, file or object) gives
each rank its part of a whole checkpoint's tensors, as ``save-sharded`` would.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence, Union

import torch
from torch.autograd.graph import increment_version

from distload.errors import DistloadError, ReloadError
from distload.workers.group import WorkerGroup
from distload.live.targets import local_tensor, model_tensors, non_persistent_buffers
from distload.loading.dtensors import dtensor_blocks
from distload.loading.index import DTYPES, PACKED
from distload.loading.loader import Loader
from distload.tp.spec import ShardingSpec
from distload.tp.slices import Action, shard_shape


@dataclass(frozen=True)
class Destination:
    """Where (part of) a checkpoint tensor goes.

    ``name``: the model's parameter or buffer. ``dim``/``start``: copy into
    ``param.narrow(dim, start, n)`` (a fused parameter) instead of the whole parameter.
    ``src_dim``/``src_start``/``src_length``: copy only ``tensor.narrow(src_dim, src_start,
    src_length)`` of the checkpoint tensor (one fused checkpoint tensor feeding several parameters).
    """

    name: str
    dim: int | None = None
    start: int = 0
    src_dim: int | None = None
    src_start: int = 0
    src_length: int | None = None

    def source_length(self, shape: Sequence[int]) -> int:
        """How much of the checkpoint tensor's ``src_dim`` (of ``shape``) is copied."""
        assert self.src_dim is not None
        return self.src_length if self.src_length is not None else shape[self.src_dim] - self.src_start


NameMap = Callable[[str], Union[str, Destination, Sequence[Destination], None]]


@dataclass
class ReloadReport:
    num_tensors: int = 0  # checkpoint tensors copied
    nbytes: int = 0  # bytes written into the model
    seconds: float = 0.0
    path: str = ""
    requested_bytes: int | None = None  # bytes asked of the source (a rank's slices or shards only)
    skipped: list[str] = field(default_factory=list)  # unexpected checkpoint keys (strict=False)
    missing: list[str] = field(default_factory=list)  # model keys left untouched (strict=False)
    ignored: list[str] = field(default_factory=list)  # mapped to None by the name map


def _destinations(name: str, name_map: NameMap | None) -> list[Destination]:
    mapped: Any = name if name_map is None else name_map(name)
    if mapped is None:
        return []
    if isinstance(mapped, str):
        return [Destination(mapped)]
    if isinstance(mapped, Destination):
        return [mapped]
    out = [Destination(m) if isinstance(m, str) else m for m in mapped]
    if not all(isinstance(d, Destination) for d in out):
        raise ReloadError(f"name_map({name!r}) must return a name, a Destination, a list of them, or None")
    return out


@dataclass(frozen=True)
class _Copy:
    dest: Destination
    action: Action | None  # the sharding spec's action for the source tensor, None without one


def check_fit(sources: Sequence[tuple[str, str, tuple[int, ...]]], targets: Mapping[str, torch.Tensor], *,
              name_map: NameMap | None, sharding: ShardingSpec | None, tp_size: int,
              strict: bool, optional: frozenset[str] = frozenset(),
              actions: Mapping[str, Action | None] | None = None,
              others: frozenset[str] = frozenset()) -> tuple[dict[str, list[_Copy]], ReloadReport]:
    """Match every checkpoint tensor (name, dtype code, shape) to the model; pure, no copies.

    ``actions``: the load's own plan for the checkpoint's tensors, by name (None: whole), where
    it has one: FP8 block scales carried with their split weight and, with expert parallelism,
    the rank's experts' rows of a stack are there, not in the spec's rules. Another name (an
    alias, a view) takes the spec's action. ``others``: other EP ranks' experts' tensors, which
    this rank does not fill (a target holding them is told so by name).

    Raises ReloadError listing every problem at once; returns the copies to make otherwise.
    """
    report = ReloadReport()
    copies: dict[str, list[_Copy]] = {}
    problems: list[str] = []
    covered: dict[int, int] = {}  # id(target tensor) -> elements written
    # Targets already named in a problem (a dtype or shape that differs): not "missing" as well.
    named: set[int] = set()

    def refuse(dst: torch.Tensor, problem: str) -> None:
        named.add(id(dst))
        problems.append(problem)

    for name, dtype, shape in sources:
        if actions is not None and name in actions:
            action = actions[name]
        else:
            action = sharding.action(name, shape, PACKED.get(dtype, 1)) if sharding is not None else None
        try:
            if action is not None:
                shape = shard_shape(name, shape, action, tp_size)
            dests = _destinations(name, name_map)
        except DistloadError as exc:
            problems.append(str(exc))
            continue
        if not dests:
            report.ignored.append(name)
            continue
        for dest in dests:
            where = name if dest.name == name else f"{name} -> {dest.name}"
            if dest.name not in targets:
                if strict:
                    problems.append(f"unexpected key {where}: the model has no such parameter or buffer")
                else:
                    report.skipped.append(where)
                continue
            dst = targets[dest.name]
            if DTYPES[dtype] != dst.dtype:
                refuse(dst, f"{where}: dtype {dtype} in the checkpoint, {dst.dtype} in the model")
                continue
            src_shape = list(shape)
            if dest.src_dim is not None:
                if dest.src_dim >= len(shape):
                    refuse(dst, f"{where}: source slice dim {dest.src_dim} is outside the checkpoint "
                                f"shape {list(shape)}")
                    continue
                length = dest.source_length(shape)
                if dest.src_start + length > shape[dest.src_dim] or length < 0:
                    refuse(dst, f"{where}: source slice dim {dest.src_dim} [{dest.src_start}, "
                                f"{dest.src_start + length}) is outside the checkpoint shape {list(shape)}")
                    continue
                src_shape[dest.src_dim] = length
            dst_shape = list(dst.shape)
            if dest.dim is not None:
                if dest.dim >= dst.dim() or dest.dim >= len(src_shape):
                    refuse(dst, f"{where}: no dim {dest.dim} to copy into (model shape {list(dst.shape)})")
                    continue
                if dest.start + src_shape[dest.dim] > dst.shape[dest.dim]:
                    refuse(dst, f"{where}: rows [{dest.start}, {dest.start + src_shape[dest.dim]}) of dim "
                                f"{dest.dim} do not fit the model shape {list(dst.shape)}")
                    continue
                dst_shape[dest.dim] = src_shape[dest.dim]
            if src_shape != dst_shape:
                what = "the rank's slice" if action is not None and not action.replicated else "shape"
                refuse(dst, f"{where}: {what} {src_shape} in the checkpoint, {dst_shape} in the model")
                continue
            copies.setdefault(name, []).append(_Copy(dest, action))
            covered[id(dst)] = covered.get(id(dst), 0) + math.prod(src_shape)
    untouched: dict[int, list[str]] = {}
    for model_name, tensor in targets.items():
        if model_name in optional:  # a non-persistent buffer: never required
            continue
        if id(tensor) in named:
            continue
        if covered.get(id(tensor), 0) < tensor.numel() or (tensor.numel() == 0 and id(tensor) not in covered):
            untouched.setdefault(id(tensor), []).append(model_name)
    missing = sorted(" = ".join(names) for names in untouched.values())
    # Other EP ranks' experts under the model's names (a name map renames them; tied names are joined).
    others_here = {d.name for name in others for d in _destinations(name, name_map)} if name_map and missing \
        else others
    theirs = [entry for entry in missing if any(n in others_here for n in entry.split(" = "))]
    if theirs and strict:
        problems.append(
            f"{len(theirs)} tensor(s) of other expert-parallel ranks' experts, such as {theirs[0]}: this rank "
            f"fills only its own experts; reload into a target that holds those alone (the dict "
            f"distload.load(..., expert_parallel_size=...) returns, or a model built with its local experts), or "
            f"pass strict=False to leave the others as they are")
        missing = [entry for entry in missing if entry not in theirs]
    if missing and strict:
        problems.append(f"missing keys (no checkpoint tensor fills them): {', '.join(missing[:20])}"
                        + (f" and {len(missing) - 20} more" if len(missing) > 20 else ""))
    else:
        report.missing = missing
    problems = list(dict.fromkeys(problems))  # one sharding-spec message covers many tensors
    if problems:
        raise ReloadError(
            f"the checkpoint does not fit the model ({len(problems)} problem(s)); nothing was written:\n  "
            + "\n  ".join(problems[:50]) + ("\n  ..." if len(problems) > 50 else "")
        )
    return copies, report


def _is_whole_copy(copy: _Copy) -> bool:
    # A split tensor arrives as this rank's slice (the loader reads or cuts it), so only the name
    # map's narrowing decides whether a copy fills its destination whole.
    dest = copy.dest
    return dest.dim is None and dest.src_dim is None


def reload_into(target: torch.nn.Module | Mapping[str, torch.Tensor], source: str,
                load_format: str = "auto", extra_config: str | Mapping[str, Any] | None = None, *,
                group: WorkerGroup | None = None, strict: bool = True, name_map: NameMap | None = None,
                sharding: str | ShardingSpec | None = None, tensor_parallel_size: int | None = None,
                tensor_parallel_rank: int | None = None, progress: bool = False,
                tp_rank: int | None = None, tp_size: int | None = None,
                expert_parallel_size: int | None = None, expert_placement_strategy: str | None = None,
                expert_parallel_rank: int | None = None) -> ReloadReport:
    """Load ``source`` into ``target``'s existing tensors, in place, all-or-nothing on mismatch.

    Call on every rank of ``group`` (None: a group from the environment, for this call).
    ``tensor_parallel_size`` T (or ``sharding``, a sharding spec: built-in name, JSON file or
    object; default ``decoder``): each rank fills TP rank ``r % T``'s slices of a whole
    checkpoint, reading only their bytes where the reader can (T defaults to the group's size
    when only a spec is given). ``tensor_parallel_rank`` places the rank explicitly (a
    tensor-parallel group that is not consecutive ranks). A checkpoint pre-sharded for T fills
    every data-parallel replica with its TP rank's files. ``tp_size`` and ``tp_rank`` are the old
    names of ``tensor_parallel_size`` and ``tensor_parallel_rank``.

    ``expert_parallel_size`` P (with ``expert_placement_strategy`` and ``expert_parallel_rank``,
    as :class:`Loader` takes them): the rank fills its EP rank's experts only, as
    ``distload.load(..., expert_parallel_size=P)`` placed them; ``target`` holds those and no
    other routed expert (a dict that load returned, or a model built with its local experts).
    """
    tensor_parallel_size = _renamed("tp_size", tp_size, "tensor_parallel_size", tensor_parallel_size)
    tensor_parallel_rank = _renamed("tp_rank", tp_rank, "tensor_parallel_rank", tensor_parallel_rank)
    with WorkerGroup.for_call(group) as g:
        start = time.perf_counter()
        targets = model_tensors(target)
        blocks = dtensor_blocks(targets)  # each rank reads its DTensors' local shards only
        loader = Loader(source, load_format, extra_config, group=g, progress=progress,
                        tensor_parallel_size=tensor_parallel_size, sharding=sharding,
                        tensor_parallel_rank=tensor_parallel_rank, blocks=blocks,
                        expert_parallel_size=expert_parallel_size,
                        expert_placement_strategy=expert_placement_strategy,
                        expert_parallel_rank=expert_parallel_rank)
        if blocks:
            if name_map is not None:
                raise ReloadError("a name map onto DTensor parameters is not supported: load with the model's own names")
            if loader.tensor_parallel is not None:
                raise ReloadError("the model's parameters are DTensors: their placements already say which shard "
                                  "each rank holds; drop tensor_parallel_size/sharding/expert_parallel_size")
        return _reload(target, targets, loader, strict=strict, name_map=name_map, start=start)


def _renamed(old: str, old_value: Any, new: str, value: Any) -> Any:
    """``new``'s value, taking ``old`` (its first name) with a DeprecationWarning."""
    if old_value is None:
        return value
    if value is not None and value != old_value:
        raise ReloadError(f"{new}={value} and {old}={old_value} disagree; pass {new} only ({old} is its old name)")
    warnings.warn(f"reload_into({old}=...) is the old name of {new}", DeprecationWarning, stacklevel=3)
    return old_value


@contextlib.contextmanager
def _counted(tensors) -> Iterator[None]:
    """Count the reader's writes into ``tensors`` (direct destinations, written through their
    memory) as torch writes, however the reload ends: a weight-sync receiver then sees them
    rewritten and takes its next update whole (channel.py's _mark), never a delta over them."""
    try:
        yield
    finally:
        if tensors:
            increment_version(list(tensors))


def _reload(target: torch.nn.Module | Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor],
            loader: Loader, *, strict: bool, name_map: NameMap | None, start: float) -> ReloadReport:
    group = loader.group
    local = {name: local_tensor(t) for name, t in targets.items()}  # what this rank writes
    rank_plan = loader.plan()
    slices = rank_plan.slices
    # Another EP rank's experts: read as nothing and not this rank's, so not the model's either.
    dropped = slices.dropped if slices is not None else frozenset()
    sources = [(t.name, t.dtype, t.shape) for t in rank_plan.index.tensors if t.name not in dropped]
    by_name = {t.name: t for t in rank_plan.index.tensors}
    sources += [(alias, by_name[tgt].dtype, by_name[tgt].shape) for alias, tgt in rank_plan.aliases.items()
                if tgt in by_name]
    sources += [(name, view.dtype, view.shape) for name, view in rank_plan.views.items()]
    tp = rank_plan.tensor_parallel
    spec = slices.spec if slices is not None else None
    actions = None if spec is None else {t.name: slices.actions.get(t.name) for t in rank_plan.index.tensors}

    def check() -> tuple[dict[str, list[_Copy]], ReloadReport]:
        return check_fit(sources, targets, name_map=name_map, sharding=spec,
                         tp_size=tp.size if tp is not None else 1, strict=strict,
                         optional=non_persistent_buffers(target), actions=actions, others=dropped)

    copies, report = group.agree("checking the model against the checkpoint", check)
    # A checkpoint tensor that lands whole in one model tensor may be read straight into it, unless
    # that memory is also written for another tensor (tied weights): the reader's threads would
    # write both at once, where copying in checkpoint order lets the last one win, as always.
    writes_per_storage = Counter(local[c.dest.name].untyped_storage().data_ptr()
                                 for cs in copies.values() for c in cs)
    direct = {name: local[c[0].dest.name].detach() for name, c in copies.items()
              if len(c) == 1 and _is_whole_copy(c[0])
              and writes_per_storage[local[c[0].dest.name].untyped_storage().data_ptr()] == 1}
    written = 0
    stream = loader.stream(rank_plan, destinations=direct)
    with _counted(direct.values()), torch.no_grad(), contextlib.closing(stream):
        try:  # (a failed copy tells the other ranks at once: the stream's close)
            for name, tensor in stream:
                for copy in copies.get(name, ()):
                    src = tensor  # already this rank's slice of a split tensor
                    dest = copy.dest
                    if dest.src_dim is not None:
                        src = src.narrow(dest.src_dim, dest.src_start, dest.source_length(src.shape))
                    dst = local[dest.name].detach()
                    if dest.dim is not None:
                        dst = dst.narrow(dest.dim, dest.start, src.shape[dest.dim])
                    if not (src.data_ptr() == dst.data_ptr() and src.shape == dst.shape):
                        dst.copy_(src)  # else the reader already put the bytes in place
                    report.nbytes += src.numel() * src.element_size()
                if name in copies:
                    written += 1
        except Exception as exc:
            # With direct destinations the reader writes into the model ahead of what it has
            # handed out, so any failure after reading began may have changed it.
            if written == 0 and not direct:
                raise
            raise ReloadError(
                f"the reload failed after {written} of {len(copies)} tensors were handed out"
                f"{' (and others read ahead into the model)' if direct else ''}, so the model may now "
                f"mix old and new weights; reload again before using it. Cause: {exc}"
            ) from exc
    report.num_tensors = written
    report.seconds = time.perf_counter() - start
    report.path = stream.rank_report.path
    report.requested_bytes = stream.rank_report.requested_bytes
    return report
