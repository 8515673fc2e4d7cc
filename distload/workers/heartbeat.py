"""Each rank's sign of life in the job's rendezvous store, to name the rank that stopped.

When a collective fails because a peer died or froze (killed, SIGSTOP, a hung device), gloo
only says "Connection closed by peer" or "timed out", and NCCL less. So every process of a
multi-rank job counts up a key of its own in the store torch.distributed rendezvoused with, once a
second, from a daemon thread. A rank whose collective failed reads every counter twice, a few
beats apart: the ranks whose counters stood still are the ones that stopped, and the error says so.

Counters, not clocks: the nodes' clocks need not agree. A rank busy in a long call that holds the
GIL could look silent; the messages therefore say "stopped answering", with the evidence.

A process whose counter stands still may also be gone for certain: each rank posts once which
process it is (host, PID namespace, PID, start time) under its host's key, so a rank whose
collective lost a peer names at once the peers on its own host whose process no longer runs.
That takes no watching, so it is done first, and it is the one answer that still arrives under
torchrun, whose agent ends the surviving ranks within a second of one dying.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any, Callable, Sequence

from distload.runtime import RUNTIME

INTERVAL_S = 0.5
# How long a checker watches the counters: beats missed over this span mean the rank stopped.
WATCH_S = 1.5
# A SIGKILLed process closes its sockets (exit_files) a moment before it shows as ended
# (exit_notify: a zombie), so a survivor that looks at once can miss it: looks repeat this long.
SETTLE_S = 0.3
# A store that does not answer within this is reported as such (it may be the dead rank's).
STORE_DEADLINE_S = 8.0


def _key(rank: int) -> str:
    return f"distload/heartbeat/{rank}"


def _host_key(host: str) -> str:
    return f"distload/processes/{host}"


def _process_start(pid: int | str) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat): with the
    PID it names one process, not a later one given the same PID. None where it is not running
    (or this is not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after the command name, which may hold spaces
    if len(fields) < 20 or fields[0] in ("Z", "X"):  # a zombie has ended, only its exit status remains
        return None
    return fields[19]


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def process_identity(rank: int) -> str:
    """What this process posts under its host's key: ``rank namespace pid start;``."""
    return f"{rank} {_pid_namespace() or '-'} {os.getpid()} {_process_start('self') or '-'};"


def ended_processes(posted: str, ranks: Sequence[int]) -> list[int]:
    """Of ``ranks``, those whose process, as posted on this host (``process_identity`` entries),
    is no longer running: gone, a zombie, or its PID now another process's. A rank posted from
    another PID namespace (a container) or without a start time is never counted."""
    here = _pid_namespace()
    wanted = set(ranks)
    ended = []
    for entry in posted.split(";"):
        parts = entry.split()
        if len(parts) != 4 or not parts[0].isdigit() or int(parts[0]) not in wanted:
            continue
        rank, namespace, pid, start = int(parts[0]), parts[1], parts[2], parts[3]
        if namespace == "-" or namespace != here or start == "-" or not pid.isdigit():
            continue
        if _process_start(pid) != start and rank not in ended:
            ended.append(rank)
    return sorted(ended)


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
        try:
            self.store.append(_host_key(socket.gethostname()), process_identity(self.rank))
        except Exception:  # noqa: BLE001 - a store without append: the heartbeat alone names peers
            pass
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

    def ended_ranks(self, ranks: Sequence[int], settle_s: float = 0.0) -> list[int]:
        """Of the global ``ranks``, those on this host whose process has ended (no heartbeat
        watching; where none has, /proc is looked at again for up to ``settle_s``); [] where none
        has, or the store does not answer."""
        if self.store is None:
            return []
        found: list[list[int]] = [[]]
        key = _host_key(socket.gethostname())

        def look() -> None:
            if not self.store.check([key]):
                return
            posted = self.store.get(key).decode(errors="replace")
            end = time.monotonic() + settle_s
            while True:
                found[0] = ended_processes(posted, ranks)
                if found[0] or time.monotonic() >= end:
                    return
                time.sleep(0.02)

        thread = threading.Thread(target=_quietly(look), name="distload-heartbeat-look", daemon=True)
        thread.start()
        thread.join(STORE_DEADLINE_S + settle_s)
        return found[0]

    def describe_ended(self, ranks: Sequence[int], me: int, settle_s: float = 0.0) -> str:
        """A clause naming the ranks of ``ranks`` (global, without ``me``) whose process on this
        host has ended (looked for up to ``settle_s``); "" where none has (or they run elsewhere)."""
        ended = self.ended_ranks([r for r in ranks if r != me], settle_s)
        if not ended:
            return ""
        which = (f"rank {ended[0]} ended: its process" if len(ended) == 1
                 else f"ranks {_ranks_text(ended)} ended: their processes")
        return (f"; {which} on {socket.gethostname()} {'is' if len(ended) == 1 else 'are'} gone (killed, "
                f"crashed or exited; its own output, or the kernel log for the OOM killer, says why)")

    def describe_silent(self, ranks: Sequence[int], me: int) -> str:
        """A clause for an error message: which of ``ranks`` (global, without ``me``) ended or
        stopped."""
        others = [r for r in ranks if r != me]
        if not others:
            return ""
        ended = self.describe_ended(others, me)
        if ended:
            return ended
        silent = self.silent_ranks(others)
        # Looked for again after the watch: a SIGKILLed peer's sockets close before its process has
        # ended, so the first look can miss it; by now it has. Naming the process that ended beats
        # naming every rank that went quiet meanwhile (a survivor failing and exiting goes quiet too).
        ended = self.describe_ended(others, me) if silent else ""
        if ended:
            return ended
        if silent is None:
            return ("; the job's rendezvous store does not answer either, so the rank that hosts it "
                    "(rank 0 outside torchrun) is likely the one that stopped")
        if not silent:
            return f"; every other rank ({_ranks_text(others)}) still shows signs of life"
        word = "rank" if len(silent) == 1 else "ranks"
        return (f"; {word} {_ranks_text(silent)} stopped answering (no heartbeat for {WATCH_S:g} s: "
                f"its host cut off the network, or killed, stopped or hung)")


def wait_while_beating(store: Any, ranks: Sequence[int], limit_s: float) -> None:
    """Return once none of ``ranks``' counters moved over a beat (each exited or froze), or after
    ``limit_s``: the process that serves the store keeps it while failing peers still read it to
    name the rank that stopped (WorkerGroup's exit on an error)."""
    deadline = time.monotonic() + limit_s
    last = None
    try:
        while time.monotonic() < deadline:
            now = [store.add(_key(r), 0) for r in ranks]
            if now == last:
                return
            last = now
            time.sleep(INTERVAL_S * 1.2)
    except Exception:  # noqa: BLE001 - a store that stopped answering: nothing to keep
        return


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
