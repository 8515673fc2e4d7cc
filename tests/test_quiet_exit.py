"""distload.quiet_exit: at exit, wait for other threads that are still running (a gloo worker
dropping its last collective's tensors), never for threads that wait."""

from __future__ import annotations

import threading
import time

from distload import quiet_exit


def _spin(until: float, stop: threading.Event | None = None) -> None:
    # runnable the whole time (the GIL is passed back and forth)
    while time.monotonic() < until and not (stop and stop.is_set()):
        pass


def test_a_waiting_thread_is_not_waited_for():
    stop = threading.Event()
    idle = threading.Thread(target=stop.wait, daemon=True)
    idle.start()
    try:
        assert quiet_exit._runnable_threads() == 0
        assert quiet_exit.let_workers_finish(limit_s=30.0) < 30.0
    finally:
        stop.set()
        idle.join()


def test_a_running_thread_is_waited_for_until_it_ends():
    busy = threading.Thread(target=_spin, args=(time.monotonic() + 0.5,), daemon=True)
    busy.start()
    assert quiet_exit._runnable_threads() == 1
    quiet_exit.let_workers_finish(limit_s=30.0)
    assert not busy.is_alive()


def test_a_thread_that_never_ends_is_waited_for_at_most_the_limit():
    stop = threading.Event()
    busy = threading.Thread(target=_spin, args=(time.monotonic() + 30.0, stop), daemon=True)
    busy.start()
    try:
        waited = quiet_exit.let_workers_finish(limit_s=0.3)
        assert busy.is_alive() and waited >= 0.3
    finally:
        stop.set()
        busy.join()


def test_the_runtime_lets_workers_finish_at_exit(monkeypatch):
    from distload.runtime import RUNTIME

    calls = []
    monkeypatch.setattr(quiet_exit, "let_workers_finish", lambda: calls.append("let"))
    RUNTIME._at_exit()
    assert calls == ["let"]
