"""Helpers for the multi-process tests: run a Python script under torchrun, launch ranks by hand,
and read torchrun's per-rank failure summary.

(conftest.run_distload runs ``-m distload``; these run arbitrary scripts and give per-process
exit codes, which torchrun itself folds into one.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from typing import Mapping

# torchrun's agent polls its workers this often (seconds). With the default (0.1 s) the agent
# may SIGTERM a rank that has already handled the failure but is still tearing down, because a
# peer exited a few milliseconds earlier; a slower poll lets every rank exit on its own, so the
# failure summary shows each rank's own exit code.
FAILURE_ENV = {"PET_MONITOR_INTERVAL": "1"}

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def clean_env(extra: Mapping[str, str] | None = None, drop_prefixes: tuple[str, ...] = ()) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCH_VARS and not (drop_prefixes and k.startswith(drop_prefixes))}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def write_script(folder, name: str, source: str) -> str:
    path = os.path.join(str(folder), name)
    with open(path, "w") as f:
        f.write(textwrap.dedent(source))
    return path


def run_script(script: str, args: list[str], nproc: int | None = 2, timeout: float = 120,
               env: Mapping[str, str] | None = None, drop_prefixes: tuple[str, ...] = (),
               torchrun: bool = False) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` alone (nproc None) or as a job of ``nproc`` ranks (:func:`run_job`;
    ``torchrun``: under torchrun's agent); variables starting with one of ``drop_prefixes`` are
    removed from the environment."""
    if nproc is None:
        return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=timeout,
                              env=clean_env(env, drop_prefixes))
    return run_job([script, *args], nproc, timeout, clean_env(env, drop_prefixes), torchrun=torchrun)


def rank_env(env: Mapping[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """``env`` with one rank's launch variables, as srun (or torchrun) gives a rank of a job of
    ``nproc`` ranks on this host, whose store rank 0 serves at 127.0.0.1:``port``."""
    return {**env, "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def run_job(entry: list[str], nproc: int, timeout: float, env: Mapping[str, str], cwd: str | None = None,
            torchrun: bool = False) -> subprocess.CompletedProcess:
    """A job of ``nproc`` ranks on this host, each ``python ENTRY`` (``entry``: a script and its
    arguments, or ``-m``, a module and its arguments), with ``env`` (no launch variables in it).

    By default the ranks are started as Slurm's ``srun`` starts them: one process per rank with
    its rank's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT), rank 0 serving the job's store. That is a launch distload supports, and it
    leaves out torchrun's agent: a Python process that imports torch (about 1.5 s of CPU) and
    waits for its rendezvous, 2-3 s of CPU and 2 s of wall time a job on the 2-core machines the
    suite runs on, where the suite's time is CPU. Without the agent nothing ends the other ranks
    when one fails: each must end on its own, as distload's failure handling says it does, and a
    rank left waiting fails the test at its timeout. ``torchrun``: under ``torchrun --standalone``
    instead (the tests of torchrun's own behaviour: its agent's store, its failure summary).

    The result is torchrun's: stdout and stderr each the ranks' own in rank order, returncode 0
    where every rank exited 0, else 1. A job past ``timeout`` is killed, every rank, and raises
    subprocess.TimeoutExpired."""
    if torchrun:
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={nproc}", *entry], capture_output=True, text=True,
                              timeout=timeout, env=dict(env), cwd=cwd)
    port = free_port()
    procs, outputs = [], []
    try:
        for rank in range(nproc):
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            outputs.append((out, err))
            procs.append(subprocess.Popen([sys.executable, *entry], stdout=out, stderr=err, text=True,
                                          env=rank_env(env, rank, nproc, port), cwd=cwd))
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for other in procs:
                    other.kill()
                raise subprocess.TimeoutExpired([sys.executable, *entry], timeout, *_read(outputs)) from None
        stdout, stderr = _read(outputs)
        codes = [proc.returncode for proc in procs]
        return JobResult([sys.executable, *entry], 0 if codes == [0] * nproc else 1, stdout, stderr, codes)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for out, err in outputs:
            out.close()
            err.close()


class Job:
    """A job's ranks started in the background as :func:`run_job` starts them (one process per
    rank with its rank's variables; ``torchrun``: one torchrun --standalone), in one process
    group of their own: ``kill`` ends every rank. Output goes to ``log`` (an open file), the
    ranks' lines interleaved as they come; stderr to ``err`` where one is given."""

    def __init__(self, entry: list[str], nproc: int, env: Mapping[str, str], log, torchrun: bool = False,
                 err=None):
        self.procs: list[subprocess.Popen] = []
        err = subprocess.STDOUT if err is None else err
        if torchrun:
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *entry],
                stdout=log, stderr=err, text=True, env=dict(env), process_group=0))
            return
        port = free_port()
        for rank in range(nproc):
            self.procs.append(subprocess.Popen([sys.executable, *entry], stdout=log, stderr=err, text=True,
                                               env=rank_env(env, rank, nproc, port),
                                               process_group=self.procs[0].pid if self.procs else 0))

    @property
    def pid(self) -> int:
        """Rank 0's process id (the job's process group's id)."""
        return self.procs[0].pid

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float) -> int:
        """The job's exit code once every rank has ended: 0 where each exited 0, else 1.
        Raises subprocess.TimeoutExpired past ``timeout``."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        return self.returncode

    @property
    def returncode(self) -> int | None:
        codes = [proc.poll() for proc in self.procs]
        return None if None in codes else (0 if set(codes) == {0} else 1)

    def kill(self) -> None:
        try:
            os.killpg(self.procs[0].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for proc in self.procs:
            proc.wait()


class JobResult(subprocess.CompletedProcess):
    """A job started without torchrun: its result as torchrun's, and each rank's own exit code
    (``rank_codes``, a signal negative), which torchrun's summary gives for the ranks it saw fail."""

    def __init__(self, args, returncode: int, stdout: str, stderr: str, rank_codes: list[int]):
        super().__init__(args, returncode, stdout, stderr)
        self.rank_codes = rank_codes


def _read(outputs: list) -> tuple[str, str]:
    texts = []
    for which in (0, 1):
        parts = []
        for files in outputs:
            files[which].seek(0)
            parts.append(files[which].read())
        texts.append("".join(parts))
    return texts[0], texts[1]


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(args: list[str], nproc: int = 2, timeout: float = 120,
                 entry: tuple[str, ...] = ("-m", "distload")) -> list[RankResult]:
    """Start ``python -m distload ARGS`` (or ``python ENTRY ARGS``) once per rank with torchrun's
    environment, but without torchrun's agent, so that each process's own exit code (or signal)
    is seen."""
    port = free_port()
    procs = []
    for rank in range(nproc):
        procs.append(subprocess.Popen([sys.executable, *entry, *args], env=rank_env(clean_env(), rank, nproc, port),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    results = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(RankResult(rank, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


_EXIT_PID_RE = re.compile(
    r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)")


def failed_rank_exitcodes(stderr: str) -> dict[int, tuple[int, int]]:
    """rank -> (exit code, pid), from torchrun's ChildFailedError summary."""
    return {int(rank): (int(code), int(pid)) for rank, code, pid in _EXIT_PID_RE.findall(stderr)}


def assert_ranks_exited_1(result: subprocess.CompletedProcess, nproc: int = 2) -> None:
    """The failed job's ranks exited with code 1 only: each rank's own code (a job run without
    torchrun: every rank 1, or 0 for one that had nothing left to do), or torchrun's summary.

    Under torchrun a rank that had already handled the failure may still be tearing down when the
    agent sees a peer exit and sends it SIGTERM ("Sending process PID closing signal SIGTERM"):
    that -15 is the agent's doing and is accepted. (test_dist_failures also launches ranks
    without the agent, to check each process's own exit code.)
    """
    if isinstance(result, JobResult):
        assert len(result.rank_codes) == nproc and set(result.rank_codes) <= {0, 1} and 1 in result.rank_codes, \
            f"exit codes {result.rank_codes}:\n{result.stderr[-6000:]}"
        return
    summary = failed_rank_exitcodes(result.stderr)
    assert summary, f"no failure summary from torchrun:\n{result.stderr[-4000:]}"
    assert set(summary) <= set(range(nproc)), summary
    assert 1 in {code for code, _ in summary.values()}, summary
    for rank, (code, pid) in summary.items():
        if code == -15 and f"Sending process {pid} closing signal SIGTERM" in result.stderr:
            continue
        assert code == 1, f"rank {rank} exit code {code}:\n{result.stderr[-6000:]}"


ABORT_MARKERS = ("terminate called", "Signal 6", "SIGABRT", "core dumped", "Segmentation fault",
                 "SIGSEGV", "Fatal Python error")


_ERROR_LINE_RE = re.compile(r"distload: error on (?:rank (\d+)|ranks ([\d, -]+) \(every rank\)): ")


def _ranks_named(single: str | None, several: str | None) -> set[int]:
    if single is not None:
        return {int(single)}
    ranks: set[int] = set()
    for part in several.split(", "):
        first, _, last = part.partition("-")
        ranks.update(range(int(first), int(last or first) + 1))
    return ranks


def rank_error(output: str, rank: int) -> str:
    """The ``distload: error on rank R: ...`` message, with its indented continuation lines; or,
    where every rank failed the same way, the one ``distload: error on ranks 0, 1 (every rank): ...``
    line that rank 0 prints for all of them.

    The ranks share torchrun's stderr and distload prints the message and its newline in two
    writes, so one rank's message can run straight into the next rank's on the same line.
    """
    match = next((m for m in _ERROR_LINE_RE.finditer(output) if rank in _ranks_named(m[1], m[2])), None)
    assert match is not None, f"no distload error naming rank {rank} in:\n{output[-6000:]}"
    rest = output[match.end():]
    following = rest.find("distload: error on rank")
    if following >= 0:
        rest = rest[:following]
    lines = rest.split("\n")
    message = [lines[0]]
    for line in lines[1:]:
        if not line.startswith("  "):
            break
        message.append(line)
    return "\n".join(message)


def assert_failed_cleanly(result: subprocess.CompletedProcess, nproc: int = 2) -> dict[int, str]:
    """The job failed, every rank's distload error was printed (by the rank, or once for all of
    them) and each exited with code 1, and nothing aborted. Returns rank -> its error message."""
    output = result.stdout + result.stderr
    assert result.returncode == 1, f"rc {result.returncode}:\n{output[-6000:]}"
    for marker in ABORT_MARKERS:
        assert marker not in output, f"{marker!r} in output:\n{output[-6000:]}"
    # torchrun prints one traceback of its own (ChildFailedError); any other is a rank that died
    # of an exception distload did not turn into an error message.
    own = 0 if isinstance(result, JobResult) else 1
    assert output.count("Traceback (most recent call last)") == own, output[-8000:]
    messages = {rank: rank_error(output, rank) for rank in range(nproc)}
    assert_ranks_exited_1(result, nproc)
    return messages


class CliJob:
    """One job (one process, or torchrun with its ranks) that runs several ``distload load``
    command lines in turn (tests/cli_cases_driver.py: under torchrun over one process group the
    driver forms): one job start for several cases, not one per case. ``cases``: name -> the
    arguments after ``load`` (each case gets its own --report-json, and --no-progress); ``env``:
    the job's variables beyond this process's, ``case_env``: name -> variables for that case
    only. Per case: its report's path, each rank's exit code and stdout."""

    def __init__(self, folder: str, nproc: int, cases: Mapping[str, list[str]], timeout: float = 240,
                 env: Mapping[str, str] | None = None, case_env: Mapping[str, Mapping[str, str]] | None = None):
        self.folder, self.nproc, self.reports, specs = folder, nproc, {}, []
        for i, (name, args) in enumerate(cases.items()):
            self.reports[name] = os.path.join(folder, f"report-{i}.json")
            specs.append({"args": ["load", *args, "--report-json", self.reports[name], "--no-progress"],
                          "env": dict((case_env or {}).get(name, {}))})
        self.index = {name: i for i, name in enumerate(cases)}
        spec = os.path.join(folder, "spec.json")
        with open(spec, "w") as f:
            json.dump(specs, f)
        self.result = run_script(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cli_cases_driver.py"), [spec, folder],
                                 nproc=None if nproc == 1 else nproc, timeout=timeout, env=env)

    def case(self, name: str) -> tuple[list[int], str]:
        """Each rank's exit code for case ``name`` and the ranks' stdout together."""
        codes, stdout = [], ""
        for rank in range(self.nproc):
            path = os.path.join(self.folder, f"case-{self.index[name]}-rank-{rank}.json")
            assert os.path.exists(path), f"rank {rank} did not finish {name}:\n" + \
                self.result.stdout[-3000:] + self.result.stderr[-6000:]
            with open(path) as f:
                ran = json.load(f)
            codes.append(ran["returncode"])
            stdout += ran["stdout"]
        return codes, stdout


__all__ = ["ABORT_MARKERS", "CliJob", "FAILURE_ENV", "RankResult", "assert_failed_cleanly", "assert_ranks_exited_1",
           "Job", "clean_env", "failed_rank_exitcodes", "free_port", "launch_ranks", "rank_error", "run_job", "run_script",
           "write_script"]
