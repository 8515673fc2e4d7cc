"""A real single-node Slurm for tests: munged, slurmctld and slurmd, all in one temporary folder.

Everything the daemons write (config, munge key and socket, state, spool, logs, pid files) lives
under the folder; the daemons listen on free loopback ports and run in the foreground as children
of the test process, so stopping them is a signal to pids we started, and several clusters (two
test runs at once) never share anything. The client commands (``sbatch``, ``srun`` inside a job,
``scontrol``) find the cluster through ``SLURM_CONF``, which :attr:`SlurmCluster.env` carries.

    with SlurmCluster() as cluster:
        job = cluster.sbatch(["launch/slurm/load_srun.sbatch", "/ckpt"], ntasks=2, env=...)
        info = cluster.wait(job, deadline_s=120)   # {"JobState": "COMPLETED", "ExitCode": "0:0", ...}

Debian: ``apt-get install -y slurm-wlm munge`` (``.ci/run`` does it when slurmctld is missing).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Mapping, Sequence

import pytest

SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
INSTALL_HINT = "apt-get update && apt-get install -y slurm-wlm munge (as root; .ci/run does this)"


def which(tool: str) -> str | None:
    """``shutil.which``, also looking in the sbin folders a non-login PATH may lack (the daemons)."""
    return shutil.which(tool) or shutil.which(tool, path="/usr/local/sbin:/usr/sbin:/sbin")


def require_root_tools(what: str, problem: str | None) -> None:
    """Fail (never skip) when ``problem`` is set, except on a developer machine without Slurm.

    CI installs every tool, so a missing one there is a broken setup that must show up red. A
    developer machine (CI unset) that has no slurmctld at all may skip.
    """
    if problem is None:
        return
    message = f"{what}: {problem}"
    if which("slurmctld") is None and not os.environ.get("CI"):
        pytest.skip(f"{message} (skipped: CI is unset and slurmctld is not installed; {INSTALL_HINT})")
    pytest.fail(f"{message}; install with: {INSTALL_HINT}", pytrace=False)


def missing_slurm_tools() -> str | None:
    missing = [tool for tool in SLURM_TOOLS if which(tool) is None]
    return f"missing {', '.join(missing)}" if missing else None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def first_job_id(num_jobs: int = 32) -> int:
    """A random first job id whose derived ports 20000 + id % 20000 are free for ``num_jobs`` jobs."""
    rng = random.Random()
    for _ in range(100):
        first = rng.randrange(1000, 19000)
        if all(port_is_free(20000 + first + i) for i in range(num_jobs)):
            return first
    raise RuntimeError("found no free range of ports in 21000-39000 for the test jobs")


def parse_scontrol(text: str) -> dict[str, str]:
    """``scontrol show job -o`` output -> {field: value}."""
    return dict(re.findall(r"(\w+)=(\S*)", text))


class SlurmCluster:
    """One controller and one compute node (this machine, at 127.0.0.1), with its own munge."""

    def __init__(self, root: str | None = None, cpus: int | None = None):
        # A short path: the munge socket path must fit in a sockaddr_un (108 bytes).
        self.root = root or tempfile.mkdtemp(prefix="dl-slurm-")
        self.cpus = cpus or os.cpu_count() or 1
        # Jobs meet at their first node by name (MASTER_ADDR, torchrun's rendezvous), so the node
        # is this host's name when it resolves, as on a real cluster; else "localhost" (slurmd -N).
        self.node = socket.gethostname().split(".")[0]
        try:
            socket.gethostbyname(self.node)
        except OSError:
            self.node = "localhost"
        self.conf = os.path.join(self.root, "slurm.conf")
        self.munge_socket = os.path.join(self.root, "munge", "munge.socket")
        self._procs: dict[str, subprocess.Popen] = {}
        self._logs: list = []

    @property
    def env(self) -> dict[str, str]:
        """The environment for client commands (and, through sbatch, for the jobs)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        env["SLURM_CONF"] = self.conf
        return env

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    # -- start / stop -------------------------------------------------------------------------
    def _spawn(self, name: str, cmd: Sequence[str]) -> None:
        log = open(self.path(f"{name}.stdout"), "wb")
        self._logs.append(log)
        self._procs[name] = subprocess.Popen(
            [which(cmd[0]) or cmd[0], *cmd[1:]], stdout=log, stderr=subprocess.STDOUT,
            env=self.env, cwd=self.root,
            start_new_session=True,  # a Ctrl-C in the test run reaches the daemons only through stop()
        )

    def _write_config(self) -> None:
        ctld_port, slurmd_port = free_port(), free_port()
        while slurmd_port == ctld_port:
            slurmd_port = free_port()
        for sub in ("state", "spool"):
            os.makedirs(self.path(sub), exist_ok=True)
        lines = [
            "ClusterName=distloadtest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={self.path('state')}",
            f"SlurmdSpoolDir={self.path('spool')}",
            f"SlurmctldPidFile={self.path('slurmctld.pid')}",
            f"SlurmdPidFile={self.path('slurmd.pid')}",
            f"SlurmctldLogFile={self.path('slurmctld.log')}",
            f"SlurmdLogFile={self.path('slurmd.log')}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "MinJobAge=3600",  # finished jobs stay visible to `scontrol show job`
            "KillWait=5",
            "InactiveLimit=0",
            # The launch scripts derive their rendezvous port from the job id (20000 + id % 20000):
            # start the ids where those ports are free, so two test runs at once do not collide.
            f"FirstJobId={first_job_id()}",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1000 State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _start_munge(self) -> None:
        folder = self.path("munge")
        os.makedirs(folder, mode=0o755, exist_ok=True)
        key = os.path.join(folder, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        # --force: munged refuses root otherwise; every file is ours, so that is safe here.
        self._spawn("munged", [
            "munged", "--foreground", "--force", f"--socket={self.munge_socket}",
            f"--key-file={key}", f"--log-file={os.path.join(folder, 'munged.log')}",
            f"--pid-file={os.path.join(folder, 'munged.pid')}",
            f"--seed-file={os.path.join(folder, 'munged.seed')}",
        ])
        self._wait_for(lambda: os.path.exists(self.munge_socket), 20, "munged to create its socket")

    def start(self, deadline_s: float = 60) -> "SlurmCluster":
        try:
            self._write_config()
            self._start_munge()
            self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf])
            self._spawn("slurmd", ["slurmd", "-D", "-f", self.conf, "-N", self.node])
            self._wait_for(self._node_idle, deadline_s, f"node {self.node} to be idle in sinfo")
        except BaseException:
            self.stop()
            raise
        return self

    def _node_idle(self) -> bool:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}\n{self.logs()}")
        out = self._run(["sinfo", "-h", "-N", "-o", "%T"], check=False, timeout=15)
        return out.returncode == 0 and out.stdout.strip().rstrip("*") == "idle"

    def _wait_for(self, predicate, deadline_s: float, what: str) -> None:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if predicate():
                return
            time.sleep(0.3)
        raise RuntimeError(f"timed out after {deadline_s:.0f}s waiting for {what}\n{self.logs()}")

    def stop(self) -> None:
        """Cancel what is still queued or running, stop the daemons we started (by pid: SIGTERM, then
        SIGKILL), then remove the folder."""
        ctld = self._procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            # Job steps run under slurmstepd, which outlives slurmd: end them through Slurm.
            try:
                jobs = self._run(["squeue", "-h", "-o", "%i"], check=False, timeout=15).stdout.split()
                if jobs:
                    self._run(["scancel", *jobs], check=False, timeout=15)
                    end = time.monotonic() + 30
                    while time.monotonic() < end and self._run(
                            ["squeue", "-h", "-o", "%i"], check=False, timeout=15).stdout.split():
                        time.sleep(0.5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self._procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        self._procs.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def logs(self, tail: int = 3000) -> str:
        """The end of every daemon log, for failure messages."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "munge/munged.log", "slurmctld.stdout",
                     "slurmd.stdout", "munged.stdout"):
            try:
                with open(self.path(name), errors="replace") as f:
                    parts.append(f"--- {name}\n{f.read()[-tail:]}")
            except OSError:
                pass
        return "\n".join(parts)

    # -- jobs -----------------------------------------------------------------------------------
    def _run(self, cmd: Sequence[str], check: bool = True, timeout: float = 30,
             env: Mapping[str, str] | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
        out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                             env=dict(env) if env is not None else self.env, cwd=cwd)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited with {out.returncode}: {out.stderr}{out.stdout}")
        return out

    def sbatch(self, script_and_args: Sequence[str], options: Sequence[str] = (),
               env: Mapping[str, str | None] | None = None, cwd: str | None = None) -> int:
        """Submit; returns the job id. ``env`` changes the cluster environment (the job inherits
        it): a value of None removes the variable."""
        full_env = self.env
        for key, value in (env or {}).items():
            if value is None:
                full_env.pop(key, None)
            else:
                full_env[key] = value
        out = self._run(["sbatch", "--parsable", *options, *script_and_args], env=full_env, cwd=cwd)
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        return parse_scontrol(self._run(["scontrol", "show", "job", "-o", str(job_id)]).stdout)

    def wait(self, job_id: int, deadline_s: float) -> dict[str, str]:
        """Poll until the job is in a final state; on the deadline, cancel it and fail."""
        end = time.monotonic() + deadline_s
        info: dict[str, str] = {}
        while time.monotonic() < end:
            info = self.job(job_id)
            if info.get("JobState") in FINAL_STATES:
                return info
            time.sleep(0.5)
        self._run(["scancel", str(job_id)], check=False)
        raise AssertionError(f"job {job_id} did not finish within {deadline_s:.0f}s: {info}\n{self.logs()}")
