"""SyncChannel between two separately launched jobs, when something goes wrong.

Trainer and inference are separate jobs here: separate processes (or separate multi-rank jobs),
each its own world, meeting at ``tcp://127.0.0.1:PORT``. Where torchrun's agent would kill a
job's other ranks as soon as one dies, ranks are started by hand as plain processes with an
explicit ``rank``/``size``, so that each one's own behaviour is seen.

Every process runs ``_DRIVER`` with a JSON plan: a list of steps (push a version, receive, wait
for a file, arm a SIGKILL/SIGSTOP inside the next update, close). Each step's outcome is one JSON
line in the process's log, with a wall-clock stamp, so that the test can follow the processes
while they run, measure how long each failure took to surface, and start the next process (a
restarted trainer) at the right moment.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import threading
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distload.errors import SyncError
from distload.live import handoff
from distload.live.channel import SyncChannel
from distload.live.rendezvous import ANSWER_S
from distload.live.session import DEAD_AFTER_S

from dist_helpers import ABORT_MARKERS, Job, clean_env, free_port, write_script

TIMEOUT_S = 30.0  # the channels' timeout: every failure below must surface well before it
BOUND_S = 20.0  # "well under the timeout"

_DRIVER = r'''
import json, logging, os, signal, sys, time, torch
import distload.live.channel as channel
from distload.errors import SyncError
from distload.live.channel import SyncChannel

cfg = json.loads(sys.argv[1])
rank = cfg["rank"] if cfg.get("rank") is not None else int(os.environ["RANK"])
size = cfg["size"] if cfg.get("size") is not None else int(os.environ["WORLD_SIZE"])
NAME = f"{cfg['name']}{rank}"
OUT = cfg["out"]


def log(event, **fields):
    fields.update(event=event, t=time.time(), pid=os.getpid())
    with open(os.path.join(OUT, f"{NAME}.jsonl"), "a") as f:
        f.write(json.dumps(fields) + "\n")


def state(version):
    if cfg.get("delta") and version > 1:  # a training step after version 1: 1 element in 50 moves
        s = state(version - 1)
        for t in s.values():
            t.view(-1)[version::50] += 1
        return s
    gen = torch.Generator().manual_seed(1000 + version)
    s = {f"w{i}": torch.randn(64, 64, generator=gen) for i in range(48)}  # 16 KiB each: 4 a bucket
    s["emb"] = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
    return s


def exact(target, version):
    want = state(version)
    return all(target[n].view(torch.uint8).equal(want[n].view(torch.uint8)) for n in want)


def gate(names):
    deadline = time.monotonic() + 120
    for name in names.split(","):
        while not os.path.exists(os.path.join(OUT, name)):
            if time.monotonic() > deadline:
                raise SystemExit(f"{NAME}: {name} never appeared")
            time.sleep(0.02)


def arm(fn_name, after, sig, pause=0.0):
    """The ``after``-th call of channel.<fn_name> (pack: one a bucket sent, unpack: one a bucket
    received) sends this process ``sig`` first: SIGKILL like an OOM kill, SIGSTOP like a hang;
    or (``sig`` 0) sleeps ``pause`` seconds there, like a slow copy."""
    module = channel
    if fn_name.startswith("delta."):  # a delta update's packing (distload/live/delta.py)
        import distload.live.delta as module
        fn_name = fn_name[len("delta."):]
    real = getattr(module, fn_name)
    calls = []

    def sabotaged(*args, **kwargs):
        calls.append(1)
        if len(calls) == after and sig:
            log("dying", signal=sig, fn=fn_name, call=after)
            os.kill(os.getpid(), sig)
        elif len(calls) == after:
            log("pausing", fn=fn_name, call=after, seconds=pause)
            time.sleep(pause)
            log("paused")
        return real(*args, **kwargs)

    setattr(module, fn_name, sabotaged)


class Logged(logging.Handler):
    def emit(self, record):  # distload's warnings, stamped: how soon a stopped peer was named
        log("warning", message=record.getMessage())


logging.getLogger("distload").addHandler(Logged())
def seen(buffers):
    """Whether every one of these buffers was here at the last look (tagged then), and tag them."""
    buffers = list(buffers)
    kept = bool(buffers) and all(getattr(b, "seen_before", False) for b in buffers)
    for b in buffers:
        b.seen_before = True
    return kept


log("start")
t0 = time.monotonic()
try:
    # Full updates (their packing and unpacking are what ``arm`` sabotages) unless cfg says delta.
    ch = SyncChannel(cfg["addr"], cfg["role"], rank=rank, size=size, host=cfg["host"], device="cpu",
                     timeout_s=cfg["timeout"], bucket_bytes=1 << 16, delta=bool(cfg.get("delta")),
                     transport=cfg.get("transport") or "auto")
except SyncError as exc:
    log("open", ok=False, error=str(exc), seconds=time.monotonic() - t0)
    sys.exit(0)
log("open", ok=True, seconds=time.monotonic() - t0)
target = {n: torch.zeros_like(t) for n, t in state(0).items()}
pointers = {n: t.data_ptr() for n, t in target.items()}
closed = False
for step in cfg["steps"]:
    kind, _, arg = step.partition(":")
    t0 = time.monotonic()
    if kind == "push":
        version = int(arg)
        try:
            # several trainer ranks split the names between them
            mine = {n: t for i, (n, t) in enumerate(state(version).items()) if i % size == rank}
            stats = ch.push(mine, version)
            log("push", ok=True, version=version, seconds=time.monotonic() - t0, nbytes=stats.nbytes,
                wire=stats.wire_bytes, delta=stats.delta, verified=stats.verified)
        except SyncError as exc:
            log("push", ok=False, version=version, error=str(exc), seconds=time.monotonic() - t0)
    elif kind == "recv":
        before = {n: t.clone() for n, t in target.items()}
        try:
            stats = ch.receive(target, timeout_s=float(arg) if arg else None)
            log("recv", ok=True, version=stats.version, channel_version=ch.version, exact=exact(target, stats.version),
                in_place=all(target[n].data_ptr() == p for n, p in pointers.items()), consistent=ch.consistent,
                last_error=ch.last_error, seconds=time.monotonic() - t0, buffers_kept=seen(ch._buffers.values()),
                transport=stats.transport, delta=stats.delta, verified=stats.verified,
                pairs=sorted(ch._session.pairs) if ch._session is not None else None)
        except SyncError as exc:
            log("recv", ok=False, error=str(exc), version=ch.version, consistent=ch.consistent,
                last_error=ch.last_error, unchanged=all(before[n].equal(target[n]) for n in target),
                holds_its_version=ch.version is not None and exact(target, ch.version),
                seconds=time.monotonic() - t0)
    elif kind == "arm":
        fn_name, after, sig, *pause = arg.split(",")
        arm(fn_name, int(after), int(sig), *map(float, pause))
    elif kind == "gate":
        gate(arg)
    elif kind == "mark":
        open(os.path.join(OUT, arg.replace("{rank}", str(rank))), "w").close()
    elif kind == "sleep":
        time.sleep(float(arg))
    elif kind == "die":  # SIGKILL (9) or SIGSTOP (19) now: right after the step before it returned
        log("dying", signal=int(arg))
        os.kill(os.getpid(), int(arg))
    elif kind == "close":
        log("closing")
        ch.close()
        closed = True
        log("closed", seconds=time.monotonic() - t0)
    else:
        raise SystemExit(f"unknown step {step!r}")
if not closed:
    ch.close()
log("exit")
'''


class Jobs:
    """The processes one test started: plain ranks and multi-rank jobs, their logs, and their end."""

    def __init__(self, tmp_path: Path):
        self.dir = tmp_path
        self.script = write_script(tmp_path, "sync_driver.py", _DRIVER)
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, role: str, steps: list[str], *, host: str = "trainer", rank: int | None = 0,
              size: int | None = 1, nproc: int | None = None, timeout: float = TIMEOUT_S,
              delta: bool = False, transport: str | None = None) -> subprocess.Popen:
        """A plain process (``nproc`` None) with an explicit rank and size, or a job of ``nproc``
        ranks (dist_helpers.Job: started as srun starts them; rank and size from their
        environment). Its log lines are ``NAME<rank>.jsonl``."""
        cfg = {"out": str(self.dir), "addr": self.address, "host": host, "role": role, "name": name,
               "steps": steps, "timeout": timeout, "delta": delta, "transport": transport}
        if nproc is not None:
            cfg.update(rank=None, size=None)
            with open(self.dir / f"{name}.stdout", "w") as out, open(self.dir / f"{name}.stderr", "w") as err:
                self.procs[name] = Job([self.script, json.dumps(cfg)], nproc, clean_env(), out, err=err)
            return self.procs[name]
        cfg.update(rank=rank, size=size)
        with open(self.dir / f"{name}.stdout", "w") as out, open(self.dir / f"{name}.stderr", "w") as err:
            proc = subprocess.Popen([sys.executable, self.script, json.dumps(cfg)], stdout=out, stderr=err,
                                    env=clean_env(), start_new_session=True)
        self.procs[name] = proc
        return proc

    def events(self, member: str, event: str | None = None) -> list[dict]:
        path = self.dir / f"{member}.jsonl"
        if not path.exists():
            return []
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [e for e in lines if event is None or e["event"] == event]

    def wait(self, member: str, event: str, count: int = 1, timeout: float = 60) -> list[dict]:
        """The first ``count`` ``event`` lines of ``member``, once there are that many."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.events(member, event)
            if len(found) >= count:
                return found[:count]
            if time.monotonic() > deadline:
                pytest.fail(f"{member} logged {len(found)} {event!r} event(s), not {count}, within {timeout} s\n"
                            f"{self.report()}")
            time.sleep(0.05)

    def exit_code(self, name: str, timeout: float = 30) -> int:
        try:
            return self.procs[name].wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} did not exit within {timeout} s\n{self.report()}")

    def exit_codes(self, *names: str, timeout: float = 30) -> dict[str, int | None]:
        """Each process's exit code, None for one still running after ``timeout`` in all."""
        deadline = time.monotonic() + timeout
        codes = {}
        for name in names:
            try:
                codes[name] = self.procs[name].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
        return codes

    def stderr(self, name: str) -> str:
        return (self.dir / f"{name}.stderr").read_text(errors="replace")

    def stdout(self, name: str) -> str:
        return (self.dir / f"{name}.stdout").read_text(errors="replace")

    def report(self) -> str:
        parts = []
        for path in sorted(self.dir.glob("*.jsonl")):
            parts.append(f"--- {path.name}\n{path.read_text()[-3000:]}")
        for name in self.procs:
            parts.append(f"--- {name} stderr\n{self.stderr(name)[-3000:]}")
        return "\n".join(parts)

    def ours(self) -> list[int]:
        """Live processes running this test's driver (a job's ranks included), by their ids;
        zombies excluded."""
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if self.script in cmdline and stat.rsplit(")", 1)[1].split()[0] != "Z":
                pids.append(int(entry))
        return pids

    def cleanup(self) -> list[int]:
        """Kill whatever is left (SIGCONT first, for a stopped one); return the ids found alive."""
        stray = [p.pid for p in self.procs.values() if p.poll() is None] + self.ours()
        for pid in set(stray):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        return sorted(set(stray))


@pytest.fixture
def jobs(tmp_path, request):
    """The test's processes. At the end any still running is killed (by id), and a test that
    passed otherwise fails for having left it behind."""
    started = Jobs(tmp_path)
    failed_before = request.session.testsfailed
    try:
        yield started
    finally:
        stray = started.cleanup()
        time.sleep(0.2)
        left = started.ours()
    assert not left, f"processes survived SIGKILL: {left}"
    if request.session.testsfailed == failed_before:  # the test's own failure says more
        assert not stray, f"processes still running at the end of the test: {stray}\n{started.report()}"


def _segments_left(pid: int) -> list[str]:
    """Same-host segment files of process ``pid`` still named in /dev/shm (handoff.py names them by pid)."""
    return glob.glob(os.path.join(handoff.SHM_DIR, f"{handoff.PREFIX}*-{pid}-*"))


def _no_abort(text: str) -> None:
    for marker in ABORT_MARKERS:
        assert marker not in text, f"{marker!r} in output:\n{text[-4000:]}"


def _assert_received(event: dict, version: int) -> None:
    assert event["ok"], event
    assert event["version"] == version and event["channel_version"] == version, event
    assert event["exact"] and event["in_place"], event
    assert event["consistent"] is True and event["last_error"] is None, event


# -- 1. the trainer killed mid-update, then restarted at the same address ------------------------------

@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("host, transport", [("trainer", "shm"), ("inference", "socket")])
def test_trainer_killed_mid_update_then_a_restarted_trainer_pushes(jobs, host, transport):
    """Two jobs: the trainer (1 rank) is SIGKILLed while version 2's buckets are out.
    Every inference rank raises within BOUND_S, holds exactly version 1 again (rolled back),
    and, in the same process, receives version 3 from a new trainer job at the same address
    bit-exact. With host="trainer" the store died with the trainer and the receivers reach the
    restarted trainer's store; with host="inference" inference rank 0's store lives on. The
    first case's pairs hand off through shared memory (one host), the second's are forced onto
    the socket; the killed trainer leaves no segment in /dev/shm."""
    forced = "socket" if transport == "socket" else None
    inference = jobs.start("inf", "inference", ["recv", "recv", "recv:60"], host=host, nproc=2, transport=forced)
    jobs.start("trainA", "trainer", ["push:1", f"arm:pack,6,{int(signal.SIGKILL)}", "push:2"],
               host=host, nproc=1)
    firsts, failures = zip(*[jobs.wait(f"inf{r}", "recv", 2) for r in (0, 1)])
    (dying,) = jobs.wait("trainA0", "dying")
    assert jobs.exit_code("trainA") != 0  # the job reports its rank's death
    assert [first["transport"] for first in firsts] == [transport] * 2, firsts
    assert not _segments_left(dying["pid"])
    assert not jobs.events("trainA0", "push")[1:], "the killed trainer finished version 2?"
    for r, failure in enumerate(failures):
        assert not failure["ok"], failure
        assert "version 2 did not arrive whole; still at version 1" in failure["error"], failure
        # Who was lost, whichever call saw it first: the trainer, or (host="trainer") the store it
        # served; never a bare gloo exception that names neither.
        # (whether it saw the trainer go or the store it served go).
        assert "trainer rank 0" in failure["error"] and "pair.cc" not in failure["error"], failure
        assert failure["version"] == 1 and failure["consistent"] is True and failure["holds_its_version"], failure
        assert failure["last_error"] == failure["error"], failure
        assert failure["seconds"] < BOUND_S, failure
        assert failure["t"] - dying["t"] < BOUND_S, (failure, dying)
    assert inference.poll() is None, "the inference job must outlive the trainer"

    jobs.start("trainB", "trainer", ["push:3"], host=host, nproc=1)
    (restarted,) = jobs.wait("trainB0", "start", timeout=60)
    for r in (0, 1):
        arrived = jobs.wait(f"inf{r}", "recv", 3, timeout=90)[2]
        _assert_received(arrived, 3)
        assert arrived["t"] - restarted["t"] < BOUND_S, (arrived, restarted)
    (pushed,) = jobs.wait("trainB0", "push")
    assert pushed["ok"] and pushed["version"] == 3, pushed
    assert jobs.exit_codes("trainB", "inf") == {"trainB": 0, "inf": 0}, jobs.report()
    _no_abort(jobs.stderr("inf") + jobs.stderr("trainB"))


@pytest.mark.slow
@pytest.mark.dist
def test_trainer_killed_mid_delta_update_leaves_every_receiver_exactly_at_its_version(jobs):
    """A delta update (version 2: a step after version 1) whose trainer is SIGKILLed after a few
    buckets landed: every inference rank undoes what they wrote, so it holds version 1 exactly
    (consistent True, its tensors unchanged), and a restarted trainer's first update (it holds
    no base: every byte) arrives exact."""
    inference = jobs.start("inf", "inference", ["recv", "recv", "recv:60"], host="inference", nproc=2, delta=True)
    jobs.start("trainA", "trainer", ["push:1", f"arm:delta.plan_bucket,6,{int(signal.SIGKILL)}", "push:2"],
               host="inference", nproc=1, delta=True)
    failures = [jobs.wait(f"inf{r}", "recv", 2)[1] for r in (0, 1)]
    jobs.wait("trainA0", "dying")
    for failure in failures:
        assert not failure["ok"], failure
        assert "version 2 did not arrive whole; still at version 1 (every change undone)" in failure["error"], failure
        assert failure["version"] == 1 and failure["consistent"] is True and failure["unchanged"], failure
        assert failure["seconds"] < BOUND_S, failure
    assert inference.poll() is None
    jobs.start("trainB", "trainer", ["push:3"], host="inference", nproc=1, delta=True)
    for r in (0, 1):
        _assert_received(jobs.wait(f"inf{r}", "recv", 3, timeout=90)[2], 3)
    assert jobs.exit_codes("trainB", "inf") == {"trainB": 0, "inf": 0}, jobs.report()


@pytest.mark.slow
@pytest.mark.dist
def test_trainer_killed_while_the_receiver_is_between_buckets_names_the_trainer(jobs):
    """The same death, timed so that the receiver's next gloo call is posting a receive (not
    waiting on one): it copies bucket 0 slowly while the trainer dies packing bucket 2. The error
    still says what was lost, in distload's words, within BOUND_S."""
    jobs.start("train", "trainer", ["push:1", f"arm:pack,3,{int(signal.SIGKILL)}", "push:2"], host="inference")
    jobs.start("inf", "inference", ["recv", "arm:unpack,1,0,2.0", "recv"], host="inference")
    (dying,) = jobs.wait("train0", "dying")
    failure = jobs.wait("inf0", "recv", 2)[1]
    assert jobs.events("inf0", "pausing") and jobs.exit_code("train") == -signal.SIGKILL
    assert not failure["ok"] and failure["version"] == 1 and failure["consistent"] is True, failure
    assert failure["holds_its_version"], failure  # what had landed was rolled back
    assert "version 2 did not arrive whole; still at version 1" in failure["error"], failure
    assert "trainer rank 0" in failure["error"] and "pair.cc" not in failure["error"], failure
    assert failure["t"] - dying["t"] < BOUND_S, (failure, dying)
    assert jobs.exit_codes("inf") == {"inf": 0}, jobs.report()


# -- 2. an inference rank killed mid-update -----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.dist
def test_inference_rank_killed_mid_update_names_it_and_its_replacement_receives(jobs):
    """Inference rank 1 (of 2, plain processes) is SIGKILLed while receiving version 2: the
    trainer's push names it within BOUND_S; inference rank 0 raises too, without waiting for the
    timeout, at version 1. A replacement rank 1 joins, and version 3 reaches both."""
    jobs.start("train", "trainer", ["push:1", "push:2", "push:3"])
    jobs.start("inf", "inference", ["recv", "recv", "recv"], rank=0, size=2, timeout=TIMEOUT_S)
    jobs.start("dead", "inference", ["recv", f"arm:unpack,3,{int(signal.SIGKILL)}", "recv"], rank=1, size=2)
    (dying,) = jobs.wait("dead1", "dying")
    assert jobs.exit_code("dead") == -signal.SIGKILL
    failed = jobs.wait("train0", "push", 2)[1]
    assert not failed["ok"] and "inference rank 1" in failed["error"], failed
    assert failed["seconds"] < BOUND_S and failed["t"] - dying["t"] < BOUND_S, (failed, dying)
    survivor = jobs.wait("inf0", "recv", 2)[1]
    assert not survivor["ok"] and "still at version 1" in survivor["error"], survivor
    assert survivor["version"] == 1 and survivor["last_error"] == survivor["error"], survivor
    assert survivor["seconds"] < BOUND_S and survivor["t"] - dying["t"] < BOUND_S, (survivor, dying)

    jobs.start("new", "inference", ["recv"], rank=1, size=2)
    _assert_received(jobs.wait("new1", "recv", timeout=60)[0], 3)
    _assert_received(jobs.wait("inf0", "recv", 3, timeout=60)[2], 3)
    pushed = jobs.wait("train0", "push", 3)[2]
    assert pushed["ok"], pushed
    assert jobs.exit_codes("train", "inf", "new") == {"train": 0, "inf": 0, "new": 0}, jobs.report()
    _no_abort(jobs.stderr("train") + jobs.stderr("inf") + jobs.stderr("new"))


@pytest.mark.slow
@pytest.mark.dist
def test_inference_rank_killed_while_the_trainer_is_between_buckets_is_named(jobs):
    """The same death, timed so that the trainer's next gloo call is posting a send (not waiting
    on one): it packs bucket 2 slowly while inference rank 1 dies copying bucket 0. The push
    still names the rank it lost, in distload's words, well before DEAD_AFTER_S could. On the
    socket: a send ends once its bytes are in the socket, so the trainer reaches bucket 2 (a
    same-host trainer instead waits for the dead rank to release bucket 0's place in its segment,
    and names it by its heartbeat: test_inference_rank_killed_mid_update_names_it... covers that)."""
    jobs.start("train", "trainer", ["push:1", "arm:pack,3,0,2.0", "push:2"], transport="socket")
    jobs.start("inf", "inference", ["recv", "recv"], rank=0, size=2)
    jobs.start("dead", "inference", ["recv", f"arm:unpack,1,{int(signal.SIGKILL)}", "recv"], rank=1, size=2)
    (dying,) = jobs.wait("dead1", "dying")
    failed = jobs.wait("train0", "push", 2)[1]
    assert jobs.events("train0", "pausing") and jobs.exit_code("dead") == -signal.SIGKILL
    assert not failed["ok"], failed
    assert "inference rank 1" in failed["error"] and "pair.cc" not in failed["error"], failed
    assert failed["t"] - dying["t"] < BOUND_S, (failed, dying)
    other = jobs.wait("inf0", "recv", 2)[1]
    assert not other["ok"] and other["version"] == 1 and "still at version 1" in other["error"], other
    assert jobs.exit_codes("train", "inf") == {"train": 0, "inf": 0}, jobs.report()


# -- 3. an inference rank stopped (SIGSTOP) mid-update --------------------------------------------------

@pytest.mark.slow
@pytest.mark.dist
def test_inference_rank_stopped_mid_update_is_named_within_dead_after(jobs):
    """Inference rank 1 stops itself (SIGSTOP) while receiving version 2: its sockets stay open,
    only its silent heartbeat tells. The trainer's push fails naming it ("stopped answering")
    within DEAD_AFTER_S plus slack. Resumed (SIGCONT), rank 1 must not take version 2 either."""
    jobs.start("train", "trainer", ["push:1", "push:2", "gate:resumed-done"])
    jobs.start("inf", "inference", ["recv", "recv"], rank=0, size=2)
    stopped = jobs.start("stop", "inference", ["recv", f"arm:unpack,3,{int(signal.SIGSTOP)}", "recv",
                                                 "mark:resumed-done"], rank=1, size=2)
    (dying,) = jobs.wait("stop1", "dying")
    failed = jobs.wait("train0", "push", 2, timeout=DEAD_AFTER_S + 30)[1]
    assert not failed["ok"], failed
    # named with its host (all members share this one), which a pulled cable would have cut off
    assert f"inference rank 1 on host {socket.gethostname()} stopped answering" in failed["error"], failed
    assert failed["t"] - dying["t"] < DEAD_AFTER_S + 5, (failed, dying)
    other = jobs.wait("inf0", "recv", 2)[1]
    assert not other["ok"] and other["version"] == 1 and "still at version 1" in other["error"], other
    assert other["t"] - dying["t"] < DEAD_AFTER_S + 5, (other, dying)

    os.kill(stopped.pid, signal.SIGCONT)
    resumed = jobs.wait("stop1", "recv", 2, timeout=20)[1]
    assert not resumed["ok"] and resumed["version"] == 1 and resumed["consistent"] is True, resumed
    assert resumed["holds_its_version"], resumed
    assert "version 2 did not arrive whole" in resumed["error"], resumed
    # A receive that gave up leaves nothing behind that crashes the process at exit.
    assert jobs.exit_codes("train", "inf", "stop") == {"train": 0, "inf": 0, "stop": 0}, jobs.report()
    _no_abort(jobs.stderr("train") + jobs.stderr("inf") + jobs.stderr("stop"))


# -- 4. nobody at the other end -------------------------------------------------------------------------

def test_inference_at_an_address_nobody_serves_says_so_within_its_timeout():
    address = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(SyncError) as caught:
        channel = SyncChannel(address, "inference", rank=0, size=1, host="trainer", device="cpu", timeout_s=5)
        try:
            channel.receive({"w": torch.zeros(4)})
        finally:
            channel.close()
    seconds = time.monotonic() - start
    assert f"nobody serves the sync rendezvous at {address} (waited 5 s)" in str(caught.value)
    assert seconds < 5 + 2, f"waited {seconds:.1f} s with timeout_s=5"


@pytest.mark.slow
def test_trainer_whose_inference_job_never_comes_says_which_rank_did_not_join():
    address = f"tcp://127.0.0.1:{free_port()}"
    channel = SyncChannel(address, "trainer", rank=0, size=1, device="cpu", timeout_s=5)
    try:
        start = time.monotonic()
        with pytest.raises(SyncError) as caught:
            channel.push({"w": torch.ones(4)}, 1)
        seconds = time.monotonic() - start
    finally:
        channel.close()
    message = str(caught.value)
    assert "inference rank 0 did not join the sync channel at " + address in message, message
    assert 4 < seconds < 5 + 2, seconds


# -- 5. no update within the receive's own timeout ------------------------------------------------------

@pytest.mark.slow
@pytest.mark.dist
def test_receive_without_an_update_times_out_and_the_next_push_still_arrives(jobs):
    jobs.start("train", "trainer", ["push:1", "gate:go", "push:2"])
    jobs.start("inf", "inference", ["recv", "recv:3", "mark:go", "recv"])
    first, waited = jobs.wait("inf0", "recv", 2)
    _assert_received(first, 1)
    assert not waited["ok"], waited
    assert "no update arrived within 3 s; still at version 1" in waited["error"], waited
    assert waited["version"] == 1 and waited["consistent"] is True and waited["unchanged"], waited
    assert waited["last_error"] == waited["error"], waited
    assert 2.9 < waited["seconds"] < 3 + 2, waited
    _assert_received(jobs.wait("inf0", "recv", 3)[2], 2)
    assert jobs.wait("train0", "push", 2)[1]["ok"]
    assert jobs.exit_codes("train", "inf") == {"train": 0, "inf": 0}, jobs.report()


# -- 6. the trainer leaves normally while a receiver waits ------------------------------------------------

@pytest.mark.slow
@pytest.mark.dist
def test_trainer_closing_between_updates_ends_a_waiting_receive_cleanly(jobs):
    """Two jobs. The trainer (serving the store) pushes version 1 and closes while both
    inference ranks wait for version 2: each receive raises promptly that the channel was closed,
    the trainer's close does not wait out CLOSE_WAIT_S (the receivers left), and every process
    exits 0 without a C++ abort."""
    jobs.start("inf", "inference", ["recv", "mark:waiting{rank}", "recv"], nproc=2)
    # the trainer closes a moment after both ranks went into their second receive
    jobs.start("train", "trainer", ["push:1", "gate:waiting0,waiting1", "sleep:1", "close"], nproc=1)
    (closing,) = jobs.wait("train0", "closing")
    for r in (0, 1):
        first, ended = jobs.wait(f"inf{r}", "recv", 2)
        _assert_received(first, 1)
        assert not ended["ok"], ended
        assert "was closed by the process serving it; still at version 1" in ended["error"], ended
        assert ended["version"] == 1 and ended["consistent"] is True, ended
        assert ended["t"] - closing["t"] < 3, (ended, closing)
    (closed,) = jobs.wait("train0", "closed")
    assert closed["seconds"] < 4, closed  # CLOSE_WAIT_S is 5: the receivers said they left
    assert jobs.exit_codes("inf", "train") == {"inf": 0, "train": 0}, jobs.report()
    for r in (0, 1):
        assert jobs.events(f"inf{r}", "exit"), jobs.report()
    _no_abort(jobs.stderr("inf") + jobs.stdout("inf") + jobs.stderr("train"))


# -- 7. a trainer that stops (SIGSTOP) while it serves the store ----------------------------------------

@pytest.mark.dist
def test_trainer_stopped_between_updates_is_named_at_once_and_pushes_when_it_resumes(jobs):
    """The trainer serves the store and stops itself (SIGSTOP) right after version 1: a store call
    to it would block for good. The waiting receiver says within ANSWER_S plus slack that trainer
    rank 0 is stopped, keeps waiting, and when the trainer resumes (SIGCONT) version 2 arrives in
    that same receive."""
    train = jobs.start("train", "trainer", ["push:1", f"die:{int(signal.SIGSTOP)}", "push:2"])
    jobs.start("inf", "inference", ["recv", "recv:40"])
    (stopped,) = jobs.wait("train0", "dying")
    (warning,) = jobs.wait("inf0", "warning")
    assert f"trainer rank 0 on host {socket.gethostname()}, which serves it, is unreachable" in warning["message"], \
        warning
    assert "stopped (SIGSTOP) or hung" in warning["message"], warning
    assert warning["t"] - stopped["t"] < ANSWER_S + 4, (warning, stopped)
    first = jobs.wait("inf0", "recv")[0]
    _assert_received(first, 1)
    assert first["t"] < stopped["t"] + 1, (first, stopped)  # push 1 returned only once the receiver had it
    os.kill(train.pid, signal.SIGCONT)
    _assert_received(jobs.wait("inf0", "recv", 2)[1], 2)
    assert jobs.exit_codes("train", "inf") == {"train": 0, "inf": 0}, jobs.report()
    _no_abort(jobs.stderr("train") + jobs.stderr("inf"))


@pytest.mark.dist
def test_trainer_stopped_in_the_data_step_is_named_and_the_receiver_rolls_back(jobs):
    """The trainer stops (SIGSTOP) while version 2's buckets are out: the receiver fails the
    update within ANSWER_S plus slack naming trainer rank 0 as stopped, holds exactly version 1
    (what had landed was rolled back), and exits on its own while the trainer stays stopped."""
    train = jobs.start("train", "trainer", ["push:1", f"arm:pack,4,{int(signal.SIGSTOP)}", "push:2"])
    jobs.start("inf", "inference", ["recv", "recv"])
    (stopped,) = jobs.wait("train0", "dying")
    failure = jobs.wait("inf0", "recv", 2)[1]
    assert not failure["ok"], failure
    assert "version 2 did not arrive whole; still at version 1 (what had landed was rolled back)" in \
        failure["error"], failure
    assert "trainer rank 0" in failure["error"] and "stop" in failure["error"], failure
    assert failure["consistent"] is True and failure["holds_its_version"], failure
    assert failure["t"] - stopped["t"] < ANSWER_S + 5, (failure, stopped)
    assert jobs.exit_codes("inf") == {"inf": 0}, jobs.report()
    _no_abort(jobs.stderr("inf"))  # its store calls to the stopped trainer are still pending at exit
    os.kill(train.pid, signal.SIGKILL)
    assert jobs.exit_code("train") == -signal.SIGKILL


# -- 8. something that is not distload at the address ----------------------------------------------------

@pytest.mark.parametrize("answer", [None, b"HTTP/1.0 400 Bad Request\r\n\r\n"], ids=["silent", "http"])
def test_a_foreign_program_at_the_address_is_named_within_the_timeout(answer):
    """A listener that accepts and never answers (a stopped server looks the same), or one that
    answers something else (an HTTP server): the receiver says so within its timeout instead of
    sitting in torch's store handshake."""
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    held = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            if answer is not None:
                conn.recv(64)
                conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    start = time.monotonic()
    try:
        with pytest.raises(SyncError) as caught:
            SyncChannel(address, "inference", rank=0, size=1, device="cpu", timeout_s=3).close()
    finally:
        listener.close()
        for conn in held:
            conn.close()
    seconds = time.monotonic() - start
    message = str(caught.value)
    if answer is None:
        assert f"something accepts connections at {address} but does not answer as a sync rendezvous" in message
    else:
        assert f"the program at {address} is not a distload sync rendezvous" in message, message
    assert seconds < 3 + 3, seconds


# -- 9. a trainer that dies the instant push() returns ---------------------------------------------------

@pytest.mark.slow
@pytest.mark.dist
def test_trainer_killed_right_after_push_returns_leaves_every_receiver_at_that_version(jobs):
    """"Done" is done on both sides: each trainer SIGKILLs itself the moment push() returned (its
    store goes with it). Both inference ranks hold that version, reported as received, and wait
    on: the next trainer's version arrives too. When no trainer comes back, the wait ends at the
    receive's timeout, saying that the store's server is gone."""
    for r in (0, 1):
        # Forced onto the socket: the buffers checked below are the socket path's (a same-host
        # receiver reads from the trainer's segment and holds none).
        jobs.start(f"inf{r}-", "inference", ["recv", "recv", "recv:4"], rank=r, size=2, transport="socket")
    jobs.start("trainA", "trainer", ["push:1", f"die:{int(signal.SIGKILL)}"])
    assert jobs.exit_code("trainA") == -signal.SIGKILL
    jobs.start("trainB", "trainer", ["push:2", f"die:{int(signal.SIGKILL)}"])
    assert jobs.exit_code("trainB") == -signal.SIGKILL
    for r in (0, 1):
        first, second, third = jobs.wait(f"inf{r}-{r}", "recv", 3)
        _assert_received(first, 1)
        _assert_received(second, 2)
        # a new session after a completed update reuses the buffers: no new memory per reconnect
        assert second["buffers_kept"], second
        assert not third["ok"] and third["version"] == 2 and third["holds_its_version"], third
        assert ("no update arrived within 4 s: lost the rendezvous store at " + jobs.address) in third["error"], third
        assert "trainer rank 0, which served it, died" in third["error"], third
        assert third["seconds"] < 4 + 3, third
    assert jobs.exit_codes("inf0-", "inf1-") == {"inf0-": 0, "inf1-": 0}, jobs.report()


# -- 10. one of two trainer ranks killed inside the data step ---------------------------------------------

@pytest.mark.dist
def test_one_of_two_trainer_ranks_killed_mid_data_leaves_the_receiver_at_its_old_version(jobs):
    """Trainer rank 1 (of 2, each sending half the names) is SIGKILLed while version 2's buckets
    are out: trainer rank 0's push and the receiver fail naming it, and the receiver holds
    exactly version 1 (rolled back), never a mix."""
    jobs.start("train", "trainer", ["push:1", "push:2"], rank=0, size=2)
    jobs.start("dead", "trainer", ["push:1", f"arm:pack,3,{int(signal.SIGKILL)}", "push:2"], rank=1, size=2)
    jobs.start("inf", "inference", ["recv", "recv"])
    first = jobs.wait("inf0", "recv")[0]
    _assert_received(first, 1)
    assert first["transport"] == "shm", first  # one host: both pairs hand off through shared memory
    failure = jobs.wait("inf0", "recv", 2)[1]
    assert not failure["ok"] and "still at version 1 (what had landed was rolled back)" in failure["error"], failure
    assert "trainer rank 1" in failure["error"], failure
    assert failure["consistent"] is True and failure["holds_its_version"], failure
    pushed = jobs.wait("train0", "push", 2)[1]
    assert not pushed["ok"] and "trainer rank 1" in pushed["error"], pushed
    assert jobs.exit_codes("train", "inf", "dead") == {"train": 0, "inf": 0, "dead": -signal.SIGKILL}, jobs.report()
    assert not _segments_left(jobs.wait("dead1", "dying")[0]["pid"])  # killed mid-update: nothing left in /dev/shm


# -- 11. a member that left is not said to have stopped -----------------------------------------------------

def test_a_member_that_left_the_channel_is_not_said_to_have_stopped_answering():
    """A member's heartbeat also stops when it closes the channel: the supervisor says it left,
    not that it was killed, stopped or hung. One process: a store served here, the session's
    record written by hand, the other member's beat never started."""
    from datetime import timedelta

    import torch.distributed as dist

    from distload.live import rendezvous
    from distload.live.session import Session
    from distload.workers.heartbeat import Beat, PeerWatch

    raw = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=5), wait_for_workers=False)
    root = rendezvous.BoundedStore(raw, "tcp://127.0.0.1:0", "trainer rank 0")
    record = rendezvous.SessionRecord("s1", 1, 1, {}, {})
    store = root.prefixed("s/s1/")
    beat = Beat(store.raw, 0)
    session = Session(record, store, {}, "gloo", 0, beat, PeerWatch(store, [1], 0.6), root.address, 5.0,
                      rendezvous.describe)
    try:
        store.set("left/1", b"1")
        deadline = time.monotonic() + 10
        reason = None
        while reason is None and time.monotonic() < deadline:
            reason = session._interruption()
            time.sleep(0.1)
        assert reason == "inference rank 0 left the channel (closed it) during the update", reason
    finally:
        beat.stop()
        root.close()


def test_a_silent_member_is_named_with_its_host():
    """A member whose heartbeat stops is named with the host its hello posted (its hostname and
    the address it reaches the rendezvous from), so that a host cut off the network is told from
    a process stopped: one line. A loopback address is left out; a hello without a hostname (an
    older member) names the member alone. One process, the record written by hand."""
    from datetime import timedelta

    import torch.distributed as dist

    from distload.live import rendezvous
    from distload.live.session import Session, host_words
    from distload.workers.heartbeat import Beat, PeerWatch

    assert host_words({"hostname": "infer-b", "address": "127.0.0.1"}) == " on host infer-b"
    assert host_words({"hostname": "infer-b", "address": None}) == " on host infer-b"
    assert host_words({"pid": 1}) == ""
    raw = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=5), wait_for_workers=False)
    root = rendezvous.BoundedStore(raw, "tcp://127.0.0.1:0", "trainer rank 0")
    infos = {"trainer/0": {"hostname": "train", "address": "10.77.3.1"},
             "inference/0": {"hostname": "infer-b", "address": "10.77.3.2"}}
    store = root.prefixed("s/s1/")
    beat = Beat(store.raw, 0)
    session = Session(rendezvous.SessionRecord("s1", 1, 1, {}, infos), store, {}, "gloo", 0, beat,
                      PeerWatch(store, [1], 0.6), root.address, 5.0, rendezvous.describe)
    try:
        deadline = time.monotonic() + 10
        reason = None
        while reason is None and time.monotonic() < deadline:
            reason = session._interruption()
            time.sleep(0.1)
        assert reason == (f"inference rank 0 on host infer-b (10.77.3.2) stopped answering (no heartbeat for "
                          f"{DEAD_AFTER_S:g} s: its host unreachable, or it was killed, stopped or hung)"), reason
        assert session.named(0) == "trainer rank 0 on host train (10.77.3.1)"
    finally:
        beat.stop()
        root.close()


def test_the_serving_trainer_reports_an_update_only_once_every_member_saw_it_complete():
    """Done means done on both sides, also after the narrow window: a receiver that posted its
    part done but never said it saw the update complete (it gave the update up and rolled back
    while the store's server was stopped, or it died) makes the serving trainer's push fail,
    naming it, instead of reporting a version that receiver may not hold. One process: a store
    served here, the session's record written by hand, the receiver's beat running."""
    from datetime import timedelta

    import torch.distributed as dist

    from distload.live import rendezvous
    from distload.live.session import Session
    from distload.workers.heartbeat import Beat, PeerWatch

    raw = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=5), wait_for_workers=False)
    root = rendezvous.BoundedStore(raw, "tcp://127.0.0.1:0", "trainer rank 0")
    store = root.prefixed("s/s1/")
    beat, theirs = Beat(store.raw, 0), Beat(store.raw, 1)
    session = Session(rendezvous.SessionRecord("s1", 1, 1, {}, {}), store, {}, "gloo", 0, beat,
                      PeerWatch(store, [1], 5.0), root.address, 1.0, rendezvous.describe)
    try:
        rendezvous.put(store, session.key("done", 1), None)  # its part is done; "seen" never comes
        start = time.monotonic()
        with pytest.raises(SyncError) as err:
            session.finish(time.monotonic() + 1.0, serving=True)
        assert time.monotonic() - start < 3
        assert "inference rank 0 did not say within 1 s that it saw the update complete" in str(err.value), err.value
        assert store.check([session.key("abort")])  # told to every member still in the update
        session.seq += 1
        rendezvous.put(store, session.key("done", 1), None)
        rendezvous.put(store, session.key("seen", 1), None)
        session.finish(time.monotonic() + 1.0, serving=True)  # it saw it: the push returns
    finally:
        theirs.stop()
        beat.stop()
        root.close()


# -- 12. a second inference job at a channel that has one ------------------------------------------------

@pytest.mark.dist
def test_a_second_inference_job_at_a_taken_channel_is_told_so(jobs):
    """A channel takes one job per side: a second inference job at it is told that the channel
    is taken (naming the process that has its place), not that nobody serves it."""
    jobs.start("train", "trainer", ["push:1", "gate:second-done"])
    jobs.start("inf", "inference", ["recv", "gate:second-done"])
    _assert_received(jobs.wait("inf0", "recv")[0], 1)
    jobs.start("second", "inference", ["recv:3", "mark:second-done"])
    (refused,) = jobs.wait("second0", "recv")
    (first,) = jobs.wait("inf0", "start")
    assert not refused["ok"], refused
    assert (f"the sync channel at {jobs.address} is taken: its current session already has an inference rank 0 "
            f"(process {first['pid']})") in refused["error"], refused
    assert jobs.exit_codes("train", "inf", "second") == {"train": 0, "inf": 0, "second": 0}, jobs.report()


# -- 13. the screen when the trainer that serves the store dies -----------------------------------------

@pytest.mark.dist
def test_sync_demo_inference_prints_one_line_not_torch_backtraces_when_the_trainer_dies(tmp_path):
    """Two sync-demo jobs (the CLI, one rank each); the trainer, which serves the store, is
    SIGKILLed once it pushed version 1. The inference job ends within its timeout with distload's
    one line naming the trainer, and none of torch's C++ warnings ("TCPStore.cpp ... recvValue
    failed", a backtrace each) on the screen."""
    address = f"tcp://127.0.0.1:{free_port()}"
    common = [sys.executable, "-m", "distload", "sync-demo", "--rendezvous", address, "--versions", "40",
              "--size-mib", "2", "--bucket-mib", "1", "--device", "cpu", "--timeout", "5"]
    env = clean_env(drop_prefixes=("TORCH_CPP_LOG_LEVEL", "TORCH_DISTRIBUTED_DEBUG"))
    trainer = subprocess.Popen(common + ["--role", "trainer"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, start_new_session=True)
    inference = subprocess.Popen(common + ["--role", "inference"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        for line in trainer.stdout:
            if "pushed version 1" in line:
                break
        os.kill(trainer.pid, signal.SIGKILL)
        out, err = inference.communicate(timeout=60)
    finally:
        for proc in (trainer, inference):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert inference.returncode == 1, (out, err)
    assert "received version 1" in out, out
    assert "distload: error on rank 0: " in err and "trainer rank 0" in err, err
    for noise in ("TCPStore.cpp", "frame #0", "c10::Error"):
        assert noise not in err and noise not in out, err


# A user's own process: torch and torch.distributed imported before distload, a torch store (a
# job's, as WeightSync uses) reached through distload's bounded wrapper.
STORE_USER = """
import datetime, sys
import torch, torch.distributed as dist
import distload
from distload.live.rendezvous import BoundedStore
port = int(sys.argv[1])
raw = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))
store = BoundedStore(raw, f"tcp://127.0.0.1:{port}", "trainer rank 0")
store.set("ready", b"1")
print("connected", flush=True)
sys.stdin.readline()  # the test kills the server meanwhile
try:
    store.get("never-set")
except distload.DistloadError as exc:
    print(f"error: {exc}", file=sys.stderr, flush=True)
    sys.exit(1)
"""


def test_a_users_process_that_loaded_torch_first_shows_no_torch_backtrace_when_the_store_dies(tmp_path):
    """In a user's process (torch imported before distload), the server of a torch store goes
    away under a store call: distload's one line naming it, and none of torch's C++ warning with
    its backtrace ("TCPStore.cpp ... recvValue failed"; main printed it)."""
    import gc
    from datetime import timedelta

    import torch.distributed as dist

    user_py = write_script(tmp_path, "user.py", STORE_USER)
    env = clean_env(drop_prefixes=(CPP_LEVEL, "TORCH_DISTRIBUTED_DEBUG"))
    # The store is served here; dropping it closes the server and its connections, as a death would.
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    user = subprocess.Popen([sys.executable, user_py, str(server.port)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert user.stdout.readline().strip() == "connected"
        del server
        gc.collect()
        out, err = user.communicate("go\n", timeout=60)
    finally:
        if user.poll() is None:
            user.kill()
            user.wait()
    assert user.returncode == 1, err
    assert "error: lost the rendezvous store at tcp://127.0.0.1:" in err and "trainer rank 0" in err, err
    for noise in ("TCPStore.cpp", "frame #0", "c10::Error"):
        assert noise not in err, err
    assert len(err.strip().splitlines()) == 1, err


CPP_LEVEL = "TORCH_CPP_LOG_LEVEL"


def test_torchs_cpp_level_is_raised_once_torch_is_loaded_unless_the_user_set_one(monkeypatch):
    """torch is loaded in this process: distload raises c10's level itself (what
    TORCH_CPP_LOG_LEVEL=ERROR gives), and leaves it alone where the user set the variable."""
    import ctypes

    from distload.runtime import quiet_torch_cpp_warnings

    level = ctypes.c_int.in_dll(ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")),
                                "FLAGS_caffe2_log_level")
    before = level.value
    try:
        level.value = 1  # warning, torch's default
        monkeypatch.setenv(CPP_LEVEL, "WARNING")
        quiet_torch_cpp_warnings()
        assert level.value == 1
        monkeypatch.delenv(CPP_LEVEL)
        monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
        quiet_torch_cpp_warnings()
        assert level.value == 2 and CPP_LEVEL not in os.environ  # torch was loaded: its flag, not the variable
    finally:
        level.value = before


# -- 14. relays: receivers at one place pass the trainer's messages on down a chain ---------------------

@pytest.mark.dist
def test_a_relay_chain_delivers_every_version_exactly_and_the_trainer_sends_it_once(jobs):
    """Three inference processes at one place, on the socket (no same-host handoff): the trainer
    sends each version to the head of its chain only, and each receiver passes the messages on to
    the next (pairing.relay). Full and delta versions arrive exactly and verified on all three,
    and the trainer's bytes on the wire are one receiver's, not three."""
    for r in range(3):
        jobs.start(f"inf{r}-", "inference", ["recv", "recv", "recv"], rank=r, size=3, delta=True, transport="socket")
    jobs.start("train", "trainer", ["push:1", "push:2", "push:3"], delta=True, transport="socket")
    pushes = jobs.wait("train0", "push", 3)
    assert all(p["ok"] for p in pushes), jobs.report()
    for r in range(3):
        got = jobs.wait(f"inf{r}-{r}", "recv", 3)
        for version, event in zip((1, 2, 3), got):
            _assert_received(event, version)
            assert event["transport"] == "socket" and event["verified"], event
            assert event["delta"] == (version > 1), event
        # the head pairs with the trainer (session rank 0) and its successor; the others with their
        # neighbours only (session ranks: the trainer 0, inference ranks 1, 2, 3)
        assert got[-1]["pairs"] == [[0, 2], [1, 3], [2]][r], got[-1]
    full, *deltas = pushes
    # one receiver's bytes (and its checksums), not three receivers'
    assert full["nbytes"] <= full["wire"] < 1.1 * full["nbytes"], full
    assert all(d["delta"] and d["verified"] and d["wire"] < 0.2 * full["nbytes"] for d in deltas), deltas
    assert jobs.exit_codes("train", "inf0-", "inf1-", "inf2-") == {"train": 0, "inf0-": 0, "inf1-": 0, "inf2-": 0}


@pytest.mark.dist
def test_a_relay_killed_mid_update_fails_it_on_every_member_and_leaves_the_others_at_their_old_version(jobs):
    """The middle of a chain of three receivers is SIGKILLed while version 2's buckets pass
    through it: the trainer's push and both other receivers fail within their bound, naming a
    member that went away, and the two hold exactly version 1 (rolled back), not a mix."""
    for r in (0, 2):
        jobs.start(f"inf{r}-", "inference", ["recv", "recv"], rank=r, size=3, transport="socket")
    jobs.start("inf1-", "inference", ["recv", f"arm:unpack,3,{int(signal.SIGKILL)}", "recv"], rank=1, size=3,
               transport="socket")
    jobs.start("train", "trainer", ["push:1", "push:2"], transport="socket")
    pushed, failed = jobs.wait("train0", "push", 2)
    assert pushed["ok"] and not failed["ok"], jobs.report()
    assert "inference rank 1" in failed["error"] and failed["seconds"] < BOUND_S, failed
    for r in (0, 2):
        first, second = jobs.wait(f"inf{r}-{r}", "recv", 2)
        _assert_received(first, 1)
        assert not second["ok"] and second["version"] == 1 and second["holds_its_version"], second
        assert "still at version 1 (what had landed was rolled back)" in second["error"], second
        assert second["seconds"] < BOUND_S, second
    assert jobs.exit_code("inf1-") == -signal.SIGKILL
    assert jobs.exit_codes("train", "inf0-", "inf2-") == {"train": 0, "inf0-": 0, "inf2-": 0}, jobs.report()
