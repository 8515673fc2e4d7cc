"""distload: load safetensors weights onto every rank of a distributed PyTorch job.

    import distload
    with distload.WorkerGroup() as group:            # torchrun, Slurm or one process
        state = distload.load("/ckpt", "auto", group=group)
        for name, tensor in distload.iter_tensors("/ckpt", "sharded_state", group=group):
            ...

Every function that works over ranks takes ``group=``: a :class:`WorkerGroup` (the whole job, a
subgroup, or a wrapped ``torch.distributed`` group), or None for a group made from the
environment for that call.
"""

from typing import TYPE_CHECKING

from distload.runtime import quiet_torch_cpp_warnings as _quiet_torch_cpp_warnings

_quiet_torch_cpp_warnings()  # first: before torch loads, if it has not, it reads its log level only then

# Every public name is imported when it is first used (PEP 562), not here: ``import distload``
# after torch costs a few milliseconds, and a load imports only the modules its path needs. The
# whole package took 0.3-0.4 s, the main cost of a one-process load of a small checkpoint (issue
# 47). Each name's module is in _WHERE; the same imports, for type checkers and the API docs
# (mkdocstrings reads them statically), are below.
if TYPE_CHECKING:
    from distload.config import LoadConfig
    from distload.errors import (
        BackendUnavailableError,
        CheckpointError,
        ConfigError,
        DistloadError,
        GroupError,
        ObjectStoreError,
        RankFailedError,
        ReloadError,
        ShardLayoutError,
        SyncError,
        UpdateRefused,
    )
    from distload.workers.group import WorkerGroup
    from distload.live.reload import Destination, ReloadReport, reload_into
    from distload.live.sleep import WeightSleeper
    from distload.live.channel import SyncChannel
    from distload.live.sync import SyncStats, WeightSync
    from distload.live.server import WeightServer
    from distload.live.from_server import load_from_server
    from distload.live.server_dtensors import load_dtensors_from_server
    from distload.loading.dtensors import load_dtensors
    from distload.loading.formats import LOAD_FORMATS, make_load_config
    from distload.loading.layout import DEFAULT_SHARD_PATTERN, CheckpointLayout, detect_layout
    from distload.loading.loader import Loader, LoadResult, LoadStream, iter_tensors, load
    from distload.loading.report import LoadReport, RankReport, state_digest
    from distload.checkpoints.inspection import inspect_source as inspect
    from distload.checkpoints.reshard import ReshardReport
    from distload.checkpoints.save import save_sharded
    from distload.checkpoints.verify import verify_folder as verify
    from distload.vllm.save import reshard
    from distload.tp.spec import ShardingSpec, load_spec

_WHERE = {  # public name -> (its module, its name there)
    "LoadConfig": ("distload.config", "LoadConfig"),
    "BackendUnavailableError": ("distload.errors", "BackendUnavailableError"),
    "CheckpointError": ("distload.errors", "CheckpointError"),
    "ConfigError": ("distload.errors", "ConfigError"),
    "DistloadError": ("distload.errors", "DistloadError"),
    "GroupError": ("distload.errors", "GroupError"),
    "ObjectStoreError": ("distload.errors", "ObjectStoreError"),
    "RankFailedError": ("distload.errors", "RankFailedError"),
    "ReloadError": ("distload.errors", "ReloadError"),
    "ShardLayoutError": ("distload.errors", "ShardLayoutError"),
    "SyncError": ("distload.errors", "SyncError"),
    "UpdateRefused": ("distload.errors", "UpdateRefused"),
    "WorkerGroup": ("distload.workers.group", "WorkerGroup"),
    "Destination": ("distload.live.reload", "Destination"),
    "ReloadReport": ("distload.live.reload", "ReloadReport"),
    "reload_into": ("distload.live.reload", "reload_into"),
    "WeightSleeper": ("distload.live.sleep", "WeightSleeper"),
    "SyncChannel": ("distload.live.channel", "SyncChannel"),
    "SyncStats": ("distload.live.sync", "SyncStats"),
    "WeightSync": ("distload.live.sync", "WeightSync"),
    "WeightServer": ("distload.live.server", "WeightServer"),
    "load_from_server": ("distload.live.from_server", "load_from_server"),
    "load_dtensors_from_server": ("distload.live.server_dtensors", "load_dtensors_from_server"),
    "load_dtensors": ("distload.loading.dtensors", "load_dtensors"),
    "LOAD_FORMATS": ("distload.loading.formats", "LOAD_FORMATS"),
    "make_load_config": ("distload.loading.formats", "make_load_config"),
    "DEFAULT_SHARD_PATTERN": ("distload.loading.layout", "DEFAULT_SHARD_PATTERN"),
    "CheckpointLayout": ("distload.loading.layout", "CheckpointLayout"),
    "detect_layout": ("distload.loading.layout", "detect_layout"),
    "Loader": ("distload.loading.loader", "Loader"),
    "LoadResult": ("distload.loading.loader", "LoadResult"),
    "LoadStream": ("distload.loading.loader", "LoadStream"),
    "iter_tensors": ("distload.loading.loader", "iter_tensors"),
    "load": ("distload.loading.loader", "load"),
    "LoadReport": ("distload.loading.report", "LoadReport"),
    "RankReport": ("distload.loading.report", "RankReport"),
    "state_digest": ("distload.loading.report", "state_digest"),
    "inspect": ("distload.checkpoints.inspection", "inspect_source"),
    "ReshardReport": ("distload.checkpoints.reshard", "ReshardReport"),
    "save_sharded": ("distload.checkpoints.save", "save_sharded"),
    "verify": ("distload.checkpoints.verify", "verify_folder"),
    "reshard": ("distload.vllm.save", "reshard"),
    "ShardingSpec": ("distload.tp.spec", "ShardingSpec"),
    "load_spec": ("distload.tp.spec", "load_spec"),
}

__version__ = "0.1.0"

__all__ = [
    # loading
    "load", "iter_tensors", "Loader", "LoadResult", "LoadStream", "LoadConfig", "make_load_config",
    "LOAD_FORMATS", "detect_layout", "CheckpointLayout", "DEFAULT_SHARD_PATTERN",
    # groups
    "WorkerGroup",
    # reports
    "LoadReport", "RankReport", "state_digest",
    # pre-sharded checkpoints
    "save_sharded", "reshard", "ReshardReport", "inspect", "verify", "ShardingSpec", "load_spec",
    # live updates
    "reload_into", "load_dtensors", "Destination", "ReloadReport", "WeightSync", "SyncChannel", "SyncStats", "WeightSleeper",
    "WeightServer", "load_from_server", "load_dtensors_from_server",
    # errors
    "DistloadError", "ConfigError", "CheckpointError", "ShardLayoutError", "ObjectStoreError",
    "BackendUnavailableError", "GroupError", "RankFailedError", "ReloadError", "SyncError",
    "UpdateRefused",
]


def __getattr__(name: str):
    """A public name's object, imported on first use and kept as a module attribute after."""
    from importlib import import_module

    if name not in _WHERE:
        # A submodule (distload.errors, distload.live, ...): bound here once imported, as the
        # eager package bound them all; ``distload.errors.ConfigError`` keeps working.
        try:
            return import_module(f"distload.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"distload.{name}":
                raise
            raise AttributeError(f"module 'distload' has no attribute {name!r}") from None
    module, attribute = _WHERE[name]
    value = getattr(import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
