"""Each rank's sign of life in the job's rendezvous store, to name the rank that stopped.

When a collective fails because a peer died or froze (killed, SIGSTOP, a hung device), gloo
only says "Connection closed by peer" or "timed out", and NCCL less. So every process of a
multi-rank job counts up a key of its own in the store torch.distributed rendezvoused with, once a
second, from a daemon thread. A rank whose collective failed reads every counter twice, a few
beats apart: the ranks whose counters stood still are the ones that stopped, and the error says so.

Counters, not clocks: the nodes' clocks need not agree. A rank busy in a long call that holds the
GIL could look silent; the messages therefore say "stopped answering", with the evidence.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from distload.runtime import RUNTIME

INTERVAL_S = 0.5
# How long a checker watches the counters: beats missed over this span mean the rank stopped.
WATCH_S = 1.5
# A store that does not answer within this is reported as such (it may be the dead rank's).
STORE_DEADLINE_S = 8.0


def _key(rank: int) -> str:
    return f"distload/heartbeat/{rank}"


def _default_store() -> Any:
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()  # the store init_process_group used
    except Exception:  # noqa: BLE001 - no default group, or a torch without it: no heartbeat
        return None


class Beat:
    """Counts ``rank``'s key up in ``store`` every INTERVAL_S from a daemon thread, until stop()."""

    def __init__(self, store: Any, rank: int, until: Callable[[], bool] | None = None):
        self.store = store
        self.rank = rank
        self.users = 0
        self._until = until  # checked every beat: True stops it (the store is about to go away)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distload-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._until is not None and self._until():
                    return
                self.store.add(_key(self.rank), 1)
            except Exception:  # noqa: BLE001 - the store went away with its group: stop beating
                return
            self._stop.wait(INTERVAL_S)

    def stop(self, join_s: float = 0.0) -> None:
        """Stop beating; with ``join_s``, wait that long for the thread (a store call may be in
        progress)."""
        self._stop.set()
        if join_s > 0 and self._thread is not threading.current_thread():
            self._thread.join(join_s)


class Heartbeat:
    """This process's beat while a group uses it (``release()`` when the group closes)."""

    def __init__(self, rank: int):
        self.store = _default_store()
        self._released = self.store is None
        if self.store is None:
            return
        with RUNTIME.lock:
            beat = RUNTIME.heartbeats.get(id(self.store))
            if beat is None or beat.store is not self.store:
                beat = RUNTIME.heartbeats[id(self.store)] = Beat(self.store, rank)
            beat.users += 1

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        with RUNTIME.lock:
            beat = RUNTIME.heartbeats.get(id(self.store))
            if beat is not None and beat.store is self.store:
                beat.users -= 1
                if beat.users <= 0:
                    beat.stop()
                    del RUNTIME.heartbeats[id(self.store)]

    def silent_ranks(self, ranks: Sequence[int], watch_s: float = WATCH_S) -> list[int] | None:
        """Of the global ``ranks``, those whose beat stood still for ``watch_s``; None where the
        store does not answer (then it cannot tell)."""
        if self.store is None:
            return None
        found: list[list[int] | None] = [None]

        def watch() -> None:
            keys = [_key(r) for r in ranks]
            first = [self.store.add(k, 0) for k in keys]
            threading.Event().wait(watch_s)
            second = [self.store.add(k, 0) for k in keys]
            found[0] = [r for r, a, b in zip(ranks, first, second) if a == b]

        thread = threading.Thread(target=_quietly(watch), name="distload-heartbeat-watch", daemon=True)
        thread.start()
        thread.join(watch_s + STORE_DEADLINE_S)
        return found[0]

    def describe_silent(self, ranks: Sequence[int], me: int) -> str:
        """A clause for an error message: which of ``ranks`` (global, without ``me``) stopped."""
        others = [r for r in ranks if r != me]
        if not others:
            return ""
        silent = self.silent_ranks(others)
        if silent is None:
            return ("; the job's rendezvous store does not answer either, so the rank that hosts it "
                    "(rank 0 outside torchrun) is likely the one that stopped")
        if not silent:
            return f"; every other rank ({_ranks_text(others)}) still shows signs of life"
        word = "rank" if len(silent) == 1 else "ranks"
        return (f"; {word} {_ranks_text(silent)} stopped answering (no heartbeat for {WATCH_S:g} s: "
                f"killed, stopped or hung)")


class PeerWatch:
    """Continuous watch over peers' beats in one store, for a caller that polls anyway: each
    :meth:`silent` call reads the counters it has not read for INTERVAL_S, and names the peers
    whose counter has not moved for ``dead_after_s``."""

    def __init__(self, store: Any, ranks: Sequence[int], dead_after_s: float):
        self.store = store
        self.dead_after_s = dead_after_s
        self._seen: dict[int, tuple[int, float]] = {}
        self._ranks = list(ranks)
        self._last_read = 0.0

    def silent(self, now: float) -> list[int]:
        """The watched ranks silent for ``dead_after_s`` at monotonic time ``now``."""
        if now - self._last_read < INTERVAL_S:
            return []
        if now - self._last_read >= self.dead_after_s:
            # This watcher did not look for that long (between updates, or it was stopped itself,
            # and a stopped store server skipped the peers' beats meanwhile): a counter that has
            # not moved since says nothing yet. Watch afresh from now.
            self._seen = {}
        self._last_read = now
        silent = []
        for rank in self._ranks:
            count = self.store.add(_key(rank), 0)
            seen = self._seen.get(rank)
            if seen is None or seen[0] != count:
                self._seen[rank] = (count, now)
            elif now - seen[1] >= self.dead_after_s:
                silent.append(rank)
        return silent


def _quietly(fn):
    def run() -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - an unreachable store leaves the answer None
            pass
    return run


def _ranks_text(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)
