"""distload: load safetensors weights onto every rank of a distributed PyTorch job.

    import distload
    with distload.WorkerGroup() as group:            # torchrun, Slurm or one process
        state = distload.load("/ckpt", "auto", group=group)
        for name, tensor in distload.iter_tensors("/ckpt", "sharded_state", group=group):
            ...
"""

from distload.config import DEFAULT_SHARD_PATTERN, LOAD_FORMATS, LoadConfig, make_load_config
from distload.errors import (
    BackendUnavailableError,
    CheckpointError,
    ConfigError,
    DistloadError,
    GroupError,
    ObjectStoreError,
    RankFailedError,
    ShardLayoutError,
)
from distload.group import WorkerGroup
from distload.loading.loader import Loader, iter_tensors, load
from distload.loading.report import LoadReport, RankReport, state_digest

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_SHARD_PATTERN",
    "LOAD_FORMATS",
    "BackendUnavailableError",
    "CheckpointError",
    "ConfigError",
    "DistloadError",
    "GroupError",
    "LoadConfig",
    "LoadReport",
    "Loader",
    "ObjectStoreError",
    "RankFailedError",
    "RankReport",
    "ShardLayoutError",
    "WorkerGroup",
    "iter_tensors",
    "load",
    "make_load_config",
    "state_digest",
]
