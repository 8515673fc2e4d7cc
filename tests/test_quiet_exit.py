"""distload.quiet_exit: at exit, wait for other threads that are still running (a gloo worker
dropping its last collective's tensors), never for threads that wait.

Each case runs in a fresh interpreter: threads that earlier tests left in this one (servers,
transports) would be counted too."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

_COMMON = """
import json, threading, time
from distload import quiet_exit

def spin(until, stop):  # runnable the whole time (the GIL is passed back and forth)
    while time.monotonic() < until and not stop.is_set():
        pass
"""


def _run(body: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _COMMON + textwrap.dedent(body)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_waiting_thread_is_not_waited_for():
    out = _run("""
        stop, entered = threading.Event(), threading.Event()
        def idle_wait():
            entered.set()
            stop.wait()
        idle = threading.Thread(target=idle_wait)
        idle.start()
        entered.wait()
        # On a busy machine the thread can still be runnable for a moment on its way into the wait
        # (it was counted then: the test raced it); once it waits, it is not counted.
        runnable, deadline = quiet_exit._runnable_threads(), time.monotonic() + 10
        while runnable and time.monotonic() < deadline:
            time.sleep(0.01)
            runnable = quiet_exit._runnable_threads()
        waited = quiet_exit.let_workers_finish(limit_s=30.0)
        stop.set(); idle.join()
        print(json.dumps({"runnable": runnable, "waited": waited}))
    """)
    assert out["runnable"] == 0 and out["waited"] < 5.0


@pytest.mark.slow
def test_a_running_thread_is_waited_for_until_it_ends():
    out = _run("""
        stop = threading.Event()
        busy = threading.Thread(target=spin, args=(time.monotonic() + 0.5, stop))
        busy.start()
        runnable = quiet_exit._runnable_threads()
        quiet_exit.let_workers_finish(limit_s=30.0)
        print(json.dumps({"runnable": runnable, "alive_after": busy.is_alive()}))
    """)
    assert out == {"runnable": 1, "alive_after": False}


@pytest.mark.slow
def test_a_thread_that_never_ends_is_waited_for_at_most_the_limit():
    out = _run("""
        stop = threading.Event()
        # Busy for far longer than the limit, but bounded: a spinning thread slows everything else
        # in the process on a loaded machine.
        busy = threading.Thread(target=spin, args=(time.monotonic() + 8.0, stop))
        busy.start()
        waited = quiet_exit.let_workers_finish(limit_s=0.3)
        alive = busy.is_alive()
        stop.set(); busy.join()
        print(json.dumps({"waited": waited, "alive": alive}))
    """)
    assert out["alive"] and 0.3 <= out["waited"] < 5.0


def test_the_runtime_lets_workers_finish_at_exit():
    """Importing distload registers the wait: it runs when the interpreter exits."""
    done = subprocess.run([sys.executable, "-c", "from distload import quiet_exit, runtime\n"
                           "quiet_exit.let_workers_finish = lambda: print('let', flush=True)"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["let"], done
