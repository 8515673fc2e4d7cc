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

from distload.runtime import quiet_torch_cpp_warnings as _quiet_torch_cpp_warnings

_quiet_torch_cpp_warnings()  # first: before torch loads, if it has not, it reads its log level only then

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
