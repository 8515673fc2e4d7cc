"""``--load-format distload`` for vLLM: the engine's weights read by distload.

Registered from the ``vllm.general_plugins`` entry point (setup.cfg), which vLLM runs in every one
of its processes; nothing here is imported unless vLLM is there. In each worker the loader:

1. validates its extra config at engine start: ``reader`` (a distload load format, default
   ``auto``) and that format's own keys, checked as ``distload load`` checks them;
2. loads over vLLM's tensor-parallel group (its gloo ``cpu_group``: distload's agreement runs
   there) with ``tensor_parallel_size`` = vLLM's: a checkpoint pre-sharded for that size gives each
   TP rank its own files, already in the engine's names, each copied into its parameter;
3. a whole checkpoint goes by the weight map learned from the model's own weight loaders
   (``distload.vllm.weight_map``: recorded once per model config, TP size and rank and vLLM version,
   then cached), any architecture: each tensor read once, its recorded regions copied into the
   parameters; a tensor whose loader computes on its values goes through the model's own loader.
"""

from __future__ import annotations

import ctypes
import platform
import time
from typing import Any, Mapping

import psutil
import torch

from distload.errors import ConfigError, DistloadError

LOAD_FORMAT = "distload"


def register() -> None:
    """The entry point: request AMX for this process, then register the load format."""
    _request_amx()
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(_loader_class())


def _request_amx() -> None:
    """On x86 Linux CPUs with AMX, ask the kernel for AMX tile state for this process now.

    The kernel grants AMX per process, on request (arch_prctl ARCH_REQ_XCOMP_PERM); a thread that
    runs an AMX instruction before anyone asked dies of SIGILL. vLLM's CPU workers raced into that
    here (workers "died unexpectedly (exit code: -4)" in about one start of three, TP 1 and 2
    alike; never after this request). Harmless where AMX is absent or already granted.
    """
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return
    try:
        with open("/proc/cpuinfo") as f:
            if " amx_tile" not in f.read():
                return
        ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18)  # arch_prctl(REQ_XCOMP_PERM, XTILEDATA)
    except OSError:
        return


def reader_config(extra: Mapping[str, Any] | None):
    """distload's LoadConfig from vLLM's ``--model-loader-extra-config`` (ConfigError naming the key)."""
    from distload.loading.formats import FORMATS, did_you_mean, make_load_config

    extra = dict(extra or {})
    reader = extra.pop("reader", "auto")
    name = reader.strip().lower() if isinstance(reader, str) else None
    fmt = FORMATS.get(name) if name is not None and reader != LOAD_FORMAT else None
    if fmt is None:
        readers = [f.name for f in FORMATS.values() if f.reads_checkpoint]
        guess = did_you_mean(name, readers) if name is not None else ""
        raise ConfigError(f"--model-loader-extra-config 'reader': {reader!r} is not a distload reader; "
                          f"{guess}choose one of {', '.join(readers)} (default auto)")
    if not fmt.reads_checkpoint:
        raise ConfigError(f"--model-loader-extra-config 'reader': {fmt.name} weights come from vLLM's own "
                          f"--load-format {fmt.name}")
    return make_load_config(reader, extra)


def _loader_class():
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    class DistloadModelLoader(BaseModelLoader):
        """vLLM's model weights, read by distload (see distload/vllm/plugin.py)."""

        def __init__(self, load_config):
            super().__init__(load_config)
            extra = dict(load_config.model_loader_extra_config or {})
            # check_weight_map: also run vLLM's own loader and compare (see load_into_engine).
            self.check_weight_map = extra.pop("check_weight_map", False)
            if not isinstance(self.check_weight_map, bool):
                raise ConfigError(f"--model-loader-extra-config 'check_weight_map' must be true or false, "
                                  f"not {self.check_weight_map!r}")
            # save_sharded: after the load, each worker writes its parameters (distload/vllm/save.py).
            from distload.vllm.save import SAVE_KEY, save_options

            self.save = save_options(extra.pop(SAVE_KEY)) if SAVE_KEY in extra else None
            self.reader = reader_config(extra)

        def download_model(self, model_config) -> None:
            """distload reads local folders and s3://, gs://, az:// itself: nothing to fetch."""

        def load_weights(self, model, model_config) -> None:
            from vllm.logger import init_logger

            source = getattr(model_config, "model_weights", None) or model_config.model
            start = time.perf_counter()
            load_into_engine(model, source, self.reader,
                             check_with=self._vllms_own(model_config) if self.check_weight_map else None)
            # The line vLLM's own loaders log, so that their times compare (vLLM configures its
            # logging for the "vllm" namespace only).
            init_logger("vllm.distload").info("Loading weights took %.2f seconds (distload, reader %s)",
                                       time.perf_counter() - start, self.reader.load_format)
            if self.save is not None:  # before vLLM post-processes the parameters (repacks them)
                from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

                from distload.vllm.save import save_engine_parameters

                save_engine_parameters(ShardedStateLoader._filter_subtensors(model.state_dict()), self.save, source)
                init_logger("vllm.distload").info("distload saved this rank's parameters to %s", self.save["output"])

        def _vllms_own(self, model_config):
            """vLLM's default loader of safetensors, as ``--load-format safetensors`` runs it."""
            import dataclasses

            from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

            own = DefaultModelLoader(dataclasses.replace(self.load_config, load_format="safetensors",
                                                         model_loader_extra_config={}))
            own.counter_before_loading_weights = time.perf_counter()
            return lambda model: own.load_weights(model, model_config)

        def get_all_weights(self, model_config, model):
            """Checkpoint tensors whole, for vLLM's in-place ``reload_weights`` (its weight
            loaders cut each rank's part)."""
            source = getattr(model_config, "model_weights", None) or model_config.model
            return checkpoint_weights(source, self.reader, str(next(model.parameters()).device))

    return DistloadModelLoader


def checkpoint_weights(source: str, reader, device: str):
    """``(name, tensor)`` of a whole checkpoint, every tensor whole, read by distload over vLLM's
    tensor-parallel group: what vLLM's ``model.load_weights`` takes."""
    from vllm.distributed.parallel_state import get_tp_group

    from distload.workers.group import WorkerGroup
    from distload.loading.loader import Loader

    tp = get_tp_group()
    group = WorkerGroup(device=device, process_group=tp.cpu_group) if tp.world_size > 1 else None
    try:
        with WorkerGroup.for_call(group, device=device) as g:
            yield from Loader(source, reader.load_format, reader.extra, group=g).stream()
    finally:
        if group is not None:
            group.close()


WORKER_EXTENSION = "distload.vllm.plugin.WorkerExtension"


class WorkerExtension:
    """What vLLM adds to each of its workers when an engine is started with
    ``worker_extension_cls="distload.vllm.plugin.WorkerExtension"`` (vLLM's way to call code on
    every worker by name, without pickled functions)."""

    def distload_reload(self, source: str, extra: dict) -> None:
        reader = reader_config(extra)
        runner = self.model_runner  # type: ignore[attr-defined]
        device = str(next(runner.get_model().parameters()).device)
        runner.reload_weights(weights_iterator=checkpoint_weights(source, reader, device), is_checkpoint_format=True)

    def distload_sync_join(self, address: str, options: dict) -> None:
        """Make this worker an inference member of the sync channel at ``address`` (its rank in
        vLLM's tensor-parallel group; the channel forms at the first receive). It keeps, of each
        checkpoint tensor the trainer sends, what its own weight loaders take (distload/vllm/push.py)."""
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        from distload.live.channel import SyncChannel
        from distload.vllm.push import Staging

        if get_pp_group().world_size > 1:
            raise ConfigError("distload's weight sync into vLLM: pipeline parallelism is not supported yet")
        tp = get_tp_group()
        old = getattr(self, "_distload_channel", None)
        if old is not None:
            old.close()
        options = dict(options)
        slices = options.pop("slices", True)
        self._distload_staging = Staging()
        self._distload_shapes: dict | None = None if slices else {}
        self._distload_slices = None
        self._distload_channel = SyncChannel(address, "inference", rank=tp.rank_in_group, size=tp.world_size,
                                             device="cpu", keeps=self._distload_keeps if slices else None, **options)

    def _distload_keeps(self, entries) -> dict:
        """What this worker keeps of an update's tensors: the cuts of its weight map (recorded once
        per model, TP rank and set of tensors, then cached)."""
        from vllm.distributed.parallel_state import get_tp_group

        from distload.loading.index import DTYPES
        from distload.vllm.push import cuts_of, engine_weight_map

        shapes = {e.name: tuple(e.shape) for e in entries}
        listed = [(e.name, DTYPES[e.dtype], tuple(e.shape)) for e in entries]
        if getattr(self, "_distload_listed", None) != listed:
            runner = self.model_runner  # type: ignore[attr-defined]
            tp = get_tp_group()
            config = runner.vllm_config.model_config.hf_config.to_json_string()
            record, self._distload_slices = engine_weight_map(runner.get_model(), listed, config, tp.world_size,
                                                              tp.rank_in_group)
            self._distload_listed, self._distload_cuts = listed, cuts_of(record, shapes)
        self._distload_staging.cuts = self._distload_cuts
        self._distload_shapes = shapes
        return self._distload_cuts

    def distload_sync_receive(self, timeout_s: float | None) -> dict:
        """Receive the next version's slices this worker keeps into its staging (kept across
        updates: a delta patches it), then hand them to vLLM's own in-place ``reload_weights`` as
        whole-shaped views (its weight loaders take this worker's part and re-apply its kernel
        formats). The engine's weights change only after the whole update arrived on every
        worker: a failed update leaves them as they were."""
        channel = getattr(self, "_distload_channel", None)
        if channel is None:
            raise ConfigError("distload_sync_receive before distload_sync_join (call sync_join(llm, address) first)")
        staging = self._distload_staging

        from distload.errors import SyncError

        channel_was = channel.version

        def allocate(wanted: dict) -> dict:
            shapes = self._distload_shapes or {name: shape for name, (_dtype, shape) in wanted.items()}
            return staging.allocate(wanted, shapes)

        try:
            stats = channel.receive(allocate, timeout_s)
        except SyncError as exc:
            return {"ok": False, "error": str(exc), "version": channel.version}
        runner = self.model_runner  # type: ignore[attr-defined]
        began = time.perf_counter()
        try:
            runner.reload_weights(weights_iterator=staging.weights(), is_checkpoint_format=True)
        except Exception as exc:  # noqa: BLE001 - vLLM's own reload failed part way: say what that leaves
            return {"ok": False, "mixed": True, "version": stats.version,
                    "error": f"version {stats.version} arrived whole, but vLLM's in-place reload_weights failed on TP "
                             f"rank {channel.rank} ({type(exc).__name__}: {exc}): the layers it reloaded before the "
                             f"failure hold version {stats.version}, the others version {channel_was}; the next "
                             f"update that reloads puts every layer at its version, or restart the engine"}
        return {"ok": True, "version": stats.version, "bytes": stats.wire_bytes, "seconds": round(stats.seconds, 4),
                "reload_seconds": round(time.perf_counter() - began, 4), "verified": stats.verified,
                "delta": stats.delta, "staging_bytes": staging.nbytes, "slice_bytes": self._distload_slices,
                "rss_bytes": psutil.Process().memory_info().rss}

    def distload_sync_close(self) -> None:
        channel = getattr(self, "_distload_channel", None)
        if channel is not None:
            channel.close()
            self._distload_channel = None


def reload_engine(llm, source: str, extra_config: Mapping[str, Any] | None = None) -> None:
    """Replace a running vLLM engine's weights in place with ``source``'s, read by distload on
    every worker (``extra_config``: ``reader`` and its keys, as ``--load-format distload``).

    The engine must have been started with ``worker_extension_cls=WORKER_EXTENSION``. One started
    with ``load_format="dummy"`` thus switches to the real weights without a restart; vLLM's own
    ``reload_weights`` re-applies its kernel formats after the copy."""
    reader_config(extra_config)  # a bad setting fails here, before any worker is asked
    _check_extension(llm, "reload_engine")
    llm.collective_rpc("distload_reload", args=(source, dict(extra_config or {})))


def _check_extension(llm, what: str) -> None:
    configured = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "parallel_config", None)
    extension = getattr(configured, "worker_extension_cls", None)
    if configured is not None and extension != WORKER_EXTENSION:
        raise ConfigError(f"{what}: start the engine with worker_extension_cls={WORKER_EXTENSION!r} "
                          f"(it has {extension!r}): that is how distload reaches every worker")


def sync_join(llm, address: str, **options: Any) -> None:
    """Make every worker of a running vLLM engine an inference member of the weight-sync channel
    at ``address`` (``options``: SyncChannel's ``timeout_s``, ``verify``, ``host``,
    ``bucket_bytes``, ``secret_file``; the workers read ``DISTLOAD_SECRET`` / ``DISTLOAD_SECRET_FILE``
    from the engine's environment otherwise: never pass the secret itself, which would travel in
    vLLM's RPC arguments). The trainer job pushes with ``SyncChannel(address, "trainer")`` and the
    checkpoint's own names, whole tensors; :func:`sync_receive` takes each version. Each worker
    receives only what its own weight loaders take of each tensor (distload/vllm/push.py);
    ``slices=False`` sends each worker every tensor whole instead (for a model whose weight map
    cannot be recorded: vLLM's loaders then cut them, as before distload learned the map)."""
    _check_extension(llm, "sync_join")
    allowed = {"timeout_s", "verify", "host", "bucket_bytes", "slices", "secret_file"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ConfigError(f"sync_join: unknown option(s) {unknown}; it takes {sorted(allowed)}")
    llm.collective_rpc("distload_sync_join", args=(address, dict(options)))


def sync_receive(llm, timeout_s: float | None = None) -> dict:
    """Wait for the trainer's next version and put it into the engine, in place (vLLM's own
    layerwise ``reload_weights``, fed each worker's slices). Returns the version and each
    worker's bytes on the wire, its slices' bytes and its seconds; raises SyncError if the update
    failed, and the engine then serves the version it served before (named in the message). If
    vLLM's reload itself fails part way, the SyncError says so: its layers are then a mix."""
    from distload.errors import SyncError

    results = llm.collective_rpc("distload_sync_receive", args=(timeout_s,))
    failed = [(i, r) for i, r in enumerate(results) if not r["ok"]]
    mixed = [(i, r) for i, r in failed if r.get("mixed")]
    if mixed:
        worker, result = mixed[0]
        raise SyncError(f"the push reached the engine but vLLM could not put it in place (worker {worker}: "
                        f"{result['error']})")
    if failed:
        worker, result = failed[0]
        raise SyncError(f"the push did not reach the engine: it still serves version {result['version']} "
                        f"(worker {worker}: {result['error']})")
    return {"version": results[0]["version"], "workers": results}


def load_into_engine(model: torch.nn.Module, source: str, reader, check_with=None) -> None:
    """Fill ``model`` (a vLLM model on this worker) from ``source`` with distload.

    A pre-sharded save for vLLM already has the engine's names: each tensor is copied into its
    parameter. A whole checkpoint goes by the weight map recorded from the model's own weight loaders
    (distload/vllm/weight_map.py, cached): of each tensor this rank reads, once, the box its regions
    lie in (its slice), then copies the regions into the parameters; the tensors the map marks
    whole are read whole and go through ``model.load_weights``.

    ``check_with``: a function that runs vLLM's own load into ``model``; the load is then compared
    with it bit for bit, every parameter, before vLLM's post-processing (an error names each
    parameter that differs). For tests and for trying a new architecture: it loads twice.
    """
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group
    from vllm.logger import init_logger
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    from distload.workers.group import WorkerGroup
    from distload.loading.layout import detect_layout
    from distload.loading.loader import Loader
    from distload.vllm.experts import describe, engine_experts, placement_key

    if get_pp_group().world_size > 1:
        raise ConfigError("--load-format distload: pipeline parallelism is not supported yet; run with "
                          "--pipeline-parallel-size 1")
    tp = get_tp_group()
    params = ShardedStateLoader._filter_subtensors(model.state_dict())  # one name per storage, as vLLM's
    device = next(iter(params.values())).device
    expected = None
    if check_with is not None:
        initial = {name: t.clone() for name, t in params.items()}
        check_with(model)
        expected = {name: t.clone() for name, t in params.items()}
        for name, t in params.items():
            t.copy_(initial[name])
        del initial
    sharded = detect_layout(source).sharded
    group = WorkerGroup(device=str(device), process_group=tp.cpu_group) if tp.world_size > 1 else None
    try:
        with WorkerGroup.for_call(group, device=str(device)) as g:
            if sharded:  # this TP rank's files, the engine's names
                loader = Loader(source, reader.load_format, reader.extra, group=g,
                                tensor_parallel_size=tp.world_size, tensor_parallel_rank=tp.rank_in_group)
                plan = loader.plan()
                direct = _presharded_destinations(params, plan.index.tensors, source)
                for name, tensor in loader.stream(plan, destinations=direct):
                    _copy_one(params, name, tensor, source, direct.get(name))
            else:
                learned = {}
                experts = engine_experts(model)  # vLLM's own placement under --enable-expert-parallel

                def boxes(index):  # planning: the weight map from the headers, then this rank's reads
                    shapes = {t.name: tuple(t.shape) for t in index.tensors}
                    record = engine_weight_map(model, params, index.tensors, source, tp.world_size,
                                               tp.rank_in_group, placement_key(experts))
                    learned.update(record=record, shapes=shapes, boxes=record.boxes(shapes))
                    # What no loader takes (another EP rank's experts: vLLM's loaders skip them) is
                    # read as nothing; a 0-d tensor cannot be cut and is read, its few bytes.
                    return {**{name: ((0,) * len(shapes[name]), (0,) + shapes[name][1:])
                               for name in record.unused if shapes.get(name)}, **learned["boxes"]}

                loader = Loader(source, reader.load_format, reader.extra, group=g, blocks=boxes)
                plan = loader.plan()
                record = learned["record"]
                steps = record.by_tensor(learned["boxes"], learned["shapes"])
                direct = in_place_destinations(steps, learned["boxes"], learned["shapes"], params)
                placed = describe(experts)
                init_logger("vllm.distload").info(
                    "distload: TP rank %d%s reads %d of the checkpoint's %d bytes (its slices; it keeps %d of them), "
                    "%d of %d tensors straight into the parameters", tp.rank_in_group,
                    f" ({placed})" if placed else "", plan.nbytes, plan.index.nbytes,
                    record.kept_nbytes(plan.index.tensors), len(direct), len(steps))
                for name in direct:  # a direct tensor's fills (padding) first, as its loader made them
                    record.fill(name, steps[name][1], params)
                for name, tensor in loader.stream(plan, destinations=direct):
                    if name in record.whole:
                        model.load_weights(iter([(name, tensor)]))
                    elif name in direct and _same_memory(tensor, direct[name]):
                        continue  # the reader put it in place
                    elif name in steps:
                        record.replay(name, tensor, params, steps[name])
    finally:
        if group is not None:
            group.close()
    if expected is not None:
        differ = [name for name, t in params.items()
                  if t.dtype != expected[name].dtype or not torch.equal(_bits(t), _bits(expected[name]))]
        if differ:
            raise DistloadError(f"{source}: distload's load differs from vLLM's own in {len(differ)} parameter(s) "
                                f"of TP rank {tp.rank_in_group}: {differ[:8]}; the recorded weight map is wrong for "
                                f"this model: report it with the model's config.json")
        init_logger("vllm.distload").info("distload: TP rank %d: the load equals vLLM's own, bit for bit, in all %d "
                                          "parameters", tp.rank_in_group, len(params))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: NaNs compare equal to themselves, -0.0 differs from 0.0."""
    return t.detach().contiguous().view(-1).view(torch.uint8) if t.dim() else t.detach().reshape(1).view(torch.uint8)


def engine_weight_map(model: torch.nn.Module, params: Mapping[str, torch.Tensor], tensors, source: str,
                      tp_size: int, tp_rank: int, experts: list | None = None):
    """The weight map of ``tensors`` (the checkpoint index's) in ``model`` on this TP rank (and
    ``experts``, its expert placement: distload/vllm/experts.py): from the cache, or recorded from
    the model's own loaders now (and cached). Logs the tensors it marks whole and why."""
    import vllm
    from vllm.logger import init_logger

    from distload.loading.sources import model_config
    from distload.vllm.weight_map import (Placeholder, cache_weight_map, cached_weight_map, record_weight_map,
                                          sample_tensors, verify_weight_map, weight_map_key)

    listed = [(t.name, t.torch_dtype, tuple(t.shape)) for t in tensors]
    key = weight_map_key(config=model_config(source), tp_size=tp_size, tp_rank=tp_rank, vllm=vllm.__version__,
                         model=type(model).__qualname__, tensors=[(n, str(d), s) for n, d, s in listed],
                         params=[(n, str(p.dtype), tuple(p.shape)) for n, p in params.items()],
                         **({"experts": experts} if experts else {}))
    record = cached_weight_map(key)
    logger = init_logger("vllm.distload")
    if record is None:
        record = record_weight_map(key, listed, params, model.load_weights)
        # A loader that kept the placeholder itself (``param.data = loaded_weight``) would leave
        # the model without data where the record says nothing: refuse, naming it.
        kept = [name for name, t in model.state_dict().items() if isinstance(t, Placeholder)]
        if kept:
            raise DistloadError(f"{source}: the weight loaders of {type(model).__name__} keep the checkpoint "
                                f"tensor itself in {kept[:5]} instead of copying it; distload cannot load this "
                                f"model yet: use vLLM's --load-format safetensors")
        # Checked before it is cached: replayed and vLLM's loaders run on the same random tensors
        # of a sample (outside the layers, and the first layer), compared bit for bit.
        sample = sample_tensors(listed)
        differ = verify_weight_map(record, sample, params, model.load_weights)
        if differ:
            raise DistloadError(f"{source}: the weight map recorded from {type(model).__name__}'s loaders does not "
                                f"reproduce them on TP rank {tp_rank}: parameter(s) {differ[:5]} differ from vLLM's "
                                f"own load of the same tensors. Use vLLM's --load-format safetensors for this model, "
                                f"and report it with its config.json")
        cache_weight_map(record)
        logger.info("distload recorded the weight map of %s on TP rank %d of %d: %d copies from %d tensors, "
                    "verified on %d of them", type(model).__name__, tp_rank, tp_size, len(record.copies), len(listed),
                    len(sample))
    for name, why in sorted(record.whole.items()):
        logger.info("distload: %s goes through vLLM's own loader (%s)", name, why)
    return record


def _presharded_destinations(params: Mapping[str, torch.Tensor], tensors, source: str) -> dict[str, torch.Tensor]:
    """A pre-sharded save's tensors (the engine's names) as views of their parameters: the part the
    checkpoint fills (vLLM pads vocabulary rows past it). Refuses, before any byte is read, a save
    whose names or shapes are not the engine's. A view that is contiguous is read straight into."""
    shapes = {t.name: tuple(t.shape) for t in tensors}
    unknown = sorted(set(shapes) - set(params))
    missing = sorted(set(params) - set(shapes))
    if unknown or missing:
        raise DistloadError(
            f"{source}: the checkpoint does not match the engine's parameters: "
            + (f"no parameter for {unknown[:5]}{' ...' if len(unknown) > 5 else ''}; " if unknown else "")
            + (f"no tensor for {missing[:5]}{' ...' if len(missing) > 5 else ''}" if missing else "")
            + "; a save for vLLM needs distload reshard --sharding vllm")
    direct = {}
    for name, shape in shapes.items():
        target = _filled_part(params[name].data, shape, name, source)
        if target.is_contiguous() and target.device.type == "cpu":
            direct[name] = target
    return direct


def _filled_part(param: torch.Tensor, shape: tuple[int, ...], name: str, source: str) -> torch.Tensor:
    if len(shape) != param.dim() or any(t > p for t, p in zip(shape, param.shape)):
        raise DistloadError(f"{source}: {name} is {list(shape)} but the engine's parameter is {list(param.shape)}")
    for dim, size in enumerate(shape):
        if size < param.shape[dim]:  # vLLM pads (vocabulary rows): fill what the checkpoint has
            param = param.narrow(dim, 0, size)
    return param


def _copy_one(params: Mapping[str, torch.Tensor], name: str, tensor: torch.Tensor, source: str,
              in_place: torch.Tensor | None) -> None:
    if in_place is not None and _same_memory(tensor, in_place):
        return  # the reader put it there
    _filled_part(params[name].data, tuple(tensor.shape), name, source).copy_(tensor)


def _same_memory(tensor: torch.Tensor, view: torch.Tensor) -> bool:
    return tensor.data_ptr() == view.data_ptr() and tensor.shape == view.shape and tensor.dtype == view.dtype


def in_place_destinations(steps, boxes, shapes, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors the reader can put straight into parameter memory, as views of it.

    A tensor qualifies when its copies (rebased in ``steps`` onto what is read of it: the whole
    tensor, its box or its rows) move every element read, uncast, each a contiguous run, into one
    parameter on the host at one fixed distance, so that what is read lies in the parameter
    exactly as read: a tensor copied whole into its parameter, a vocabulary's rows before its
    padding, or a fused q/k/v read as this rank's rows of q, k and v into the rows of ``qkv_proj``
    they fill in that order. And no other tensor's copy or fill touches that memory: the reader's
    threads write it ahead of the replay order, which must then not matter. The rest are read
    into new memory and replayed.
    """
    from distload.loading.rank_slices import Rows
    from distload.vllm.weight_map import Region, contiguous

    written: dict[str, list[tuple[str, int, int]]] = {}  # param -> (tensor, first, last element)
    for name, (copies, fills) in steps.items():
        for step in list(copies) + list(fills):
            first, last = step.dest.extent()
            written.setdefault(step.param, []).append((name, first, last))
    out = {}
    for name, (copies, _fills) in steps.items():
        box = boxes.get(name)
        read = box.shape(shapes[name]) if isinstance(box, Rows) else tuple(box[1]) if box else tuple(shapes[name])
        numel = 1
        for n in read:
            numel *= n
        if not copies or numel == 0 or len({c.param for c in copies}) != 1 or any(c.casts for c in copies):
            continue
        if not all(contiguous(c.source) and contiguous(c.dest) for c in copies):
            continue
        delta = copies[0].dest.offset - copies[0].source.offset
        runs = sorted((c.source.offset, c.source.offset + _numel(c.source.shape)) for c in copies)
        if any(c.dest.offset - c.source.offset != delta for c in copies) or runs[0][0] != 0 or runs[-1][1] != numel \
                or any(a[1] != b[0] for a, b in zip(runs, runs[1:])):
            continue
        param = params[copies[0].param].data
        if param.device.type != "cpu" or delta < 0:
            continue
        target = Region(delta, read, _contiguous_strides(read))
        first, last = target.extent()
        if any(other != name and a <= last and first <= b for other, a, b in written[copies[0].param]):
            continue
        out[name] = target.on(param)
    return out


def _numel(shape) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def _contiguous_strides(shape) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))