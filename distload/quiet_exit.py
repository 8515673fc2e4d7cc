"""Let torch's collective worker threads finish their last work before the interpreter finalizes.

A gloo process group runs each collective on a C++ worker thread. After the collective completes
(and the caller's ``wait`` returns), that thread drops its reference to the work, which holds the
collective's tensors; dropping a tensor that Python also knows takes the GIL. When the process
exits right after a collective and the worker is descheduled in that moment (two busy cores are
enough), it asks for the GIL after the interpreter has started to finalize: CPython ends such a
thread with ``pthread_exit``, whose unwind crosses a ``noexcept`` destructor, and the process
aborts with "terminate called without an active exception" (pytorch/pytorch#190489, seen in a
2-rank load into DTensors about one exit in seven). ``destroy_process_group`` does not prevent it:
a device mesh keeps its groups alive in C++.

:func:`let_workers_finish` runs at exit (``distload.runtime`` registers it): while any other
thread of the process is runnable, it sleeps in short steps, which releases the GIL so that such a
thread can finish. Threads that wait (a worker idle on its queue, a transport polling its sockets,
a collective stuck on a dead peer) are not runnable and cost nothing; a thread that keeps
computing is waited for at most ``limit_s``.
"""

from __future__ import annotations

import os
import threading
import time

_STEP_S = 0.002
_QUIET_SAMPLES = 2  # all others asleep twice in a row, with a GIL-free sleep between


def _runnable_threads() -> int:
    """How many threads of this process other than the calling one are running or runnable."""
    own = threading.get_native_id()
    count = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for task in tasks:
        if int(task) == own:
            continue
        try:
            with open(f"/proc/self/task/{task}/stat", "rb") as stat:
                fields = stat.read()
        except OSError:  # the thread ended between the listing and the read
            continue
        # The state follows the command name, which is in parentheses and may hold spaces.
        end = fields.rfind(b")")
        state = fields[end + 2:end + 3] if end >= 0 else b""
        if state == b"R":
            count += 1
    return count


def let_workers_finish(limit_s: float = 0.5) -> float:
    """Sleep while another thread is runnable, at most ``limit_s``; return the seconds waited."""
    if not os.path.isdir("/proc/self/task"):
        return 0.0
    start = time.monotonic()
    quiet = 0
    while quiet < _QUIET_SAMPLES and time.monotonic() - start < limit_s:
        time.sleep(_STEP_S)
        quiet = quiet + 1 if _runnable_threads() == 0 else 0
    return time.monotonic() - start
