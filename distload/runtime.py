"""What distload remembers for the life of a process, in one object, with a reset.

Every piece of process-wide state lives here and nowhere else, each with the reason it must
outlive one load:

- ``stores``: object-store clients, one per store type and configuration (building a boto3 or
  Azure client costs tens of milliseconds and a credential lookup);
- ``reachable_until``: endpoints that answered a TCP connect, for a short while (one probe per
  endpoint, not one per request);
- ``huge_page_slots``: how many more tensors this process may mark for huge pages (each mark
  splits a mapping, and the process's map count is capped by ``vm.max_map_count``, over all its
  loads);
- ``runai_store_scheme``: the object-store type Run:ai's reader served first (it serves only one
  per process);
- ``heartbeats``: the thread that counts this process's heartbeat up in a rendezvous store,
  one per store (``distload.workers.heartbeat``), shared by every group on it;
- ``rendezvous_stores``: the job's rendezvous store, made at this process's first group and kept
  for the next (rank 0 serves it outside torchrun: a server made anew for each group, on the
  same port, races the ranks that come early to the next group);
- ``weight_syncs``: how many WeightSyncs this process has made: every rank of a job makes them
  in the same order, so the n-th of each rank meets the others' n-th in the job's store;
- the environment: Run:ai reads its settings from ``os.environ``; :meth:`Runtime.environment` is
  the only place distload writes it, for the length of one read.

Tests call :func:`reset` (or set a field) instead of patching module globals.
"""

from __future__ import annotations

import atexit
import ctypes
import contextlib
import os
import itertools
import threading
from typing import Any, Iterator, Mapping

from distload import quiet_exit


CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"
_C10_ERROR = 2  # c10's levels: 0 info, 1 warning, 2 error, 3 fatal


def quiet_torch_cpp_warnings() -> None:
    """From the moment distload is imported, torch's C++ warnings stay off the screen, as
    TORCH_CPP_LOG_LEVEL=ERROR would keep them: when the process serving a torch store dies (a
    job's TCPStore under WeightSync, torchrun's), every store call in flight prints one with a C++
    backtrace (TCPStore.cpp "recvValue failed", ~20 lines), and then distload names what was lost
    in one line. A level the user set (TORCH_CPP_LOG_LEVEL, or TORCH_DISTRIBUTED_DEBUG) is kept.

    torch reads the variable only as it loads: before that, setting it is enough (and the
    processes this one starts inherit it); once torch is loaded, c10's level itself
    (``FLAGS_caffe2_log_level`` in libc10, which torch's Python API does not expose) is raised to
    error, the value the variable would have given it."""
    import sys

    if CPP_LOG_LEVEL in os.environ or os.environ.get("TORCH_DISTRIBUTED_DEBUG"):
        return
    torch = sys.modules.get("torch")
    if torch is None:
        os.environ[CPP_LOG_LEVEL] = "ERROR"
        return
    names = {"linux": "libc10.so", "darwin": "libc10.dylib", "win32": "c10.dll"}
    try:
        library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib",
                                           names.get(sys.platform, "libc10.so")))
        level = ctypes.c_int.in_dll(library, "FLAGS_caffe2_log_level")
    except (OSError, ValueError, AttributeError, TypeError):
        return  # another build of torch: docs/troubleshooting.md names the variable to set
    level.value = max(level.value, _C10_ERROR)


class Runtime:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._environment_lock = threading.Lock()
        # Default groups this process has formed (workers/group.py names each one's store keys by
        # its number): kept across reset(), since the launcher's store keeps the keys.
        self.groups_formed = itertools.count()
        # The job's rendezvous store, by launch (workers/group.py): made at this process's first
        # group and kept for the next ones, across reset() too (on rank 0 outside torchrun it is
        # the server the other ranks are connected to).
        self.rendezvous_stores: dict[tuple, Any] = {}
        self.reset()
        atexit.register(self._at_exit)

    def reset(self) -> None:
        """Forget everything (a new process's state); for tests and long-lived hosts."""
        with self.lock:
            self.stores: dict[tuple, Any] = {}
            self.reachable_until: dict[tuple[str, int], float] = {}
            self.huge_page_slots: int | None = None
            self.runai_store_scheme: str | None = None
            self.stop_heartbeats()
            self.heartbeats: dict[int, Any] = {}
            self.weight_syncs = 0
            self.warned_insecure: set[str] = set()  # addresses served without a secret (warned once each)
            self.patch_weights: Any = None  # delta.py's patch-sum weights (a numpy table), grown as needed
            # session.py's gloo pairs whose given-up transfers still wait in them: (pair, works)
            self.given_up_pairs: list[tuple[Any, list[Any]]] = []

    def _at_exit(self) -> None:
        # A thread that wants the GIL once the interpreter finalizes makes the process abort
        # ("terminate called without an active exception"): a heartbeat still inside a store call
        # (a group never closed, the job's default group destroyed under it), or a gloo worker
        # dropping its last collective's tensors. Stop the first, let the second finish.
        self.stop_heartbeats()
        quiet_exit.let_workers_finish()
        # A pair whose given-up transfer still waits: destroying it now would hold the exit up
        # to the pair's timeout. It is left to the process's end instead.
        with self.lock:
            for pair, _ in self.given_up_pairs:
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(pair))
            self.given_up_pairs = []

    def stop_heartbeats(self) -> None:
        """Stop every heartbeat thread, waiting for a store call in progress."""
        with self.lock:
            beats = list(getattr(self, "heartbeats", {}).values())
            self.heartbeats = {}
        for beat in beats:
            beat.stop(join_s=2.0)  # a beat is a store call every half second: done well within this

    @contextlib.contextmanager
    def environment(self, changes: Mapping[str, str], restore_prefix: str = "RUNAI_STREAMER_") -> Iterator[None]:
        """``changes`` in os.environ for the duration of the block, then what was there before.

        Every variable starting with ``restore_prefix`` is restored too: Run:ai sets some itself
        (RUNAI_STREAMER_PROCESS_GROUP_SIZE in distributed mode) and never removes them, and a
        later read with another group would inherit them. The writes and the restore each happen
        under a lock, but the block itself holds none (it may be a generator's, suspended across
        yields and closed from another thread): reads in several threads of one process share one
        environment, as the library that reads it does.
        """
        def touched() -> set[str]:
            return {key for key in os.environ if restore_prefix and key.startswith(restore_prefix)}

        with self._environment_lock:
            keys = set(changes) | touched()
            saved = {key: os.environ.get(key) for key in keys}
            os.environ.update(changes)
        try:
            yield
        finally:
            with self._environment_lock:
                for key in keys | touched():
                    old = saved.get(key)
                    if old is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = old


RUNTIME = Runtime()


def reset() -> None:
    RUNTIME.reset()
