"""Local file I/O every area shares: exact positional reads, and writes that appear whole or not
at all (a temporary name in the same folder, then a rename)."""

from __future__ import annotations

import errno
import json
import os
import stat
import shutil
import tempfile
from typing import Any

from distload.errors import CheckpointError

# Every file distload writes first exists under a name ending so; loaders and the metadata copy
# skip such names, so a half-written file is never mistaken for a finished one.
TEMPORARY_SUFFIX = ".distload-tmp"


def temporary_name(path: str) -> str:
    """Where ``path`` is written before it is renamed into place: ``.NAME.distload-tmp`` beside it."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}{TEMPORARY_SUFFIX}")


def open_for_reading(path: str) -> int:
    """A read-only descriptor of a checkpoint file the load already planned to read."""
    try:
        # O_NONBLOCK: a FIFO put in the file's place since planning must not block the open.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot open it to read its tensors ({exc.strerror}): was it "
                              f"moved or deleted after the load was planned?") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: is no longer a regular file (it was replaced after the load was planned)")
    return fd


def read_exactly(fd: int, view: memoryview, offset: int, path: str, name: str) -> None:
    """Fill ``view`` from ``fd`` at ``offset`` (tensor ``name`` of ``path``); short reads retried,
    a file that ends early or fails is a CheckpointError naming both."""
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            raise CheckpointError(f"{path}: reading tensor {name!r} failed: {exc}") from None
        if n == 0:
            raise CheckpointError(f"{path}: ended while reading tensor {name!r}: the file is shorter "
                                  f"than its header says (truncated while loading?)")
        done += n


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# The errors of a write that found no room: a full device, or a quota reached.
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def write_failed(path: str, exc: OSError, still_to_write: int | None = None) -> CheckpointError:
    """A write of an output file failed: say which file, and for a full disk how much is needed
    and how much is free, so the user can act (the save's marker keeps the folder refused)."""
    if exc.errno in NO_SPACE:
        try:
            free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
        except OSError:
            free = None
        needed = f"{still_to_write} more bytes to write" if still_to_write is not None else "more space needed"
        free_text = f"{free} bytes free there" if free is not None else "free space unknown"
        what = "no space left on the device" if exc.errno == errno.ENOSPC else "the disk quota is exceeded"
        return CheckpointError(f"{path}: {what} ({needed}, {free_text}); free space or write to another "
                               f"folder, then run the save again (the unfinished folder is refused until then)")
    return CheckpointError(f"{path}: writing it failed: {exc.strerror or exc}")


def write_json_atomic(path: str, value: Any, indent: int = 1) -> None:
    """Write JSON under a temporary name, fsync, then rename: a reader never sees half a file.

    The file gets the permissions any new file would (0666 minus the umask), not mkstemp's 0600,
    so a checkpoint's manifest or a job's report is as readable as the files beside it. mkstemp
    (not :func:`temporary_name`) because several ranks may write reports to one folder at once.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=TEMPORARY_SUFFIX)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as f:
            json.dump(value, f, indent=indent)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise write_failed(path, exc) from None
        raise


def copy_file_atomic(source: str, path: str) -> None:
    """Copy ``source`` to ``path`` under its temporary name, then rename it into place."""
    tmp = temporary_name(path)
    try:
        shutil.copyfile(source, tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise write_failed(path, exc, os.path.getsize(source)) from None
        raise
