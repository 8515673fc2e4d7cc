"""Small file-system helpers shared by the writers."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json_atomic(path: str, value: Any, indent: int = 1) -> None:
    """Write JSON under a temporary name, fsync, then rename: a reader never sees half a file.

    The file gets the permissions any new file would (0666 minus the umask), not mkstemp's 0600,
    so a checkpoint's manifest or a job's report is as readable as the files beside it.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".distload-tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as f:
            json.dump(value, f, indent=indent)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
