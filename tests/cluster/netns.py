"""A cluster of hosts on one machine: network namespaces joined by a bridge, links shaped with tbf.

Layout of one cluster (every name starts with ``dlc-<pid>-<seq>-``, so that concurrent pytest-xdist
workers never collide and leftovers of a killed run can be told by their dead pid)::

    namespace dlc-<pid>-<seq>-br:  bridge br0, one port vh<i> per host (tbf: traffic INTO host i)
    namespace dlc-<pid>-<seq>-h<i>: lo, eth0 = 10.77.X.(i+1)/24 (tbf: traffic OUT OF host i)
                                    /etc/hosts from /etc/netns/<namespace>/hosts

Nothing is created in the machine's own network namespace: every link lives inside the cluster's
namespaces, and deleting them deletes the links. A command runs inside a host through
``ip netns exec NS unshare --uts sh -c 'hostname NAME; exec "$@"'``, so it sees the host's
network, its hostname and its /etc/hosts.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Iterable, Mapping, Sequence

PREFIX = "dlc-"  # distload cluster; the pid of the process that made it follows
NETNS_ETC = "/etc/netns"
IFNAME = "eth0"  # a host's interface, named the same in every host: GLOO_SOCKET_IFNAME=eth0
BRIDGE = "br0"
DEBIAN_SELF_ADDRESS = "127.0.1.1"
DEFAULT_RATE_BITS_PER_S = 1_000_000_000
DEFAULT_LATENCY = "50ms"  # tbf's queue: how long a packet may wait before it is dropped
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
               "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GLOO_SOCKET_IFNAME")
_HOSTNAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_THROUGHPUT_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "throughput.py")


# -- small helpers ------------------------------------------------------------------------------

def _ip(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=timeout)


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", *args], capture_output=True, text=True, check=check, timeout=30)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tbf_burst_bytes(rate_bits_per_s: float) -> int:
    """tbf's bucket: at least one timer tick's worth of bytes at HZ=250 (rate/8/250), and at least
    64 KiB so that one GSO packet of a veth always fits (tbf drops a packet bigger than its bucket)."""
    return max(int(rate_bits_per_s / 8 / 250), 64 * 1024)


def netns_list() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(netns: str) -> list[int]:
    out = _ip("netns", "pids", netns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_netns_processes(netns: str, deadline_s: float = 10) -> None:
    """SIGKILL every process inside ``netns`` (a namespace with processes outlives ``ip netns del``)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        pids = [p for p in _netns_pids(netns) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _remove_netns(netns: str) -> None:
    _kill_netns_processes(netns)
    _ip("netns", "delete", netns, check=False)
    etc = os.path.join(NETNS_ETC, netns)
    for name in ("hosts", "hostname", "resolv.conf"):
        try:
            os.unlink(os.path.join(etc, name))
        except FileNotFoundError:
            pass
    try:
        os.rmdir(etc)
    except OSError:
        pass


def clean_stale(prefix: str = PREFIX) -> list[str]:
    """Remove namespaces and /etc/netns folders ``<prefix><pid>-...`` whose pid is dead (a run that
    was killed before it could tear down). Returns the names removed."""
    removed = []
    pattern = re.compile(re.escape(prefix) + r"(\d+)-")
    names = set(netns_list())
    if os.path.isdir(NETNS_ETC):
        names.update(os.listdir(NETNS_ETC))
    for name in sorted(names):
        match = pattern.match(name)
        if match and int(match.group(1)) != os.getpid() and not _pid_alive(int(match.group(1))):
            _remove_netns(name)
            removed.append(name)
    return removed


# -- capability -------------------------------------------------------------------------------

_capability: list[str | None] = []


def cluster_capability() -> str | None:
    """None when this machine can make a cluster (root, ``ip netns``, veth, bridge, ``tc tbf``,
    ``unshare --uts``), else a sentence saying what is missing. Checked once per process."""
    if _capability:
        return _capability[0]
    _capability.append(_check_capability())
    return _capability[0]


def _check_capability() -> str | None:
    if os.geteuid() != 0:
        return "a cluster of network namespaces needs root (ip netns, tc)"
    for tool in ("ip", "tc", "unshare", "hostname"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode != 0:
            return f"{tool} is not installed (iproute2 / util-linux)"
    netns = f"{PREFIX}{os.getpid()}-cap"
    try:
        step = "ip netns add"
        try:
            _ip("netns", "add", netns)
            step = "a veth pair and a bridge"
            _ip("-n", netns, "link", "add", BRIDGE, "type", "bridge")
            _ip("-n", netns, "link", "add", "va", "type", "veth", "peer", "name", "vb")
            _ip("-n", netns, "link", "set", "va", "master", BRIDGE)
            step = "tc qdisc tbf"
            _tc("-n", netns, "qdisc", "replace", "dev", "vb", "root", "tbf", "rate", "1000000bit",
                "burst", "65536", "latency", "50ms")
            step = "ip netns exec + unshare --uts"
            out = subprocess.run(_wrap(netns, "cap-check", ["hostname"]), capture_output=True, text=True,
                                 timeout=30)
            if out.stdout.strip() != "cap-check":
                return f"`ip netns exec NS unshare --uts` did not set a hostname: {out.stderr.strip()}"
        except subprocess.CalledProcessError as err:
            return f"{step} failed: {' '.join(err.cmd)}: {(err.stderr or '').strip()}"
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"{step} failed: {err}"
    finally:
        _ip("netns", "delete", netns, check=False)
    return None


def require_cluster() -> None:
    """In a pytest test or fixture: fail under CI (CI=true: every tool must be there), else skip,
    when this machine cannot make a cluster."""
    import pytest

    problem = cluster_capability()
    if problem is None:
        return
    message = f"a cluster of network namespaces: {problem}"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def cluster_fixture(scope: str = "module", **cluster_kwargs):
    """A pytest fixture that yields one ``Cluster(**cluster_kwargs)`` for ``scope``:
    ``cluster = cluster_fixture(hosts=2, scope="session")`` in a test module or conftest."""
    import pytest

    @pytest.fixture(scope=scope)
    def _cluster():
        require_cluster()
        with Cluster(**cluster_kwargs) as made:
            yield made

    return _cluster


def _wrap(netns: str, hostname: str, cmd: Sequence[str]) -> list[str]:
    # ip netns exec: the network namespace and /etc/netns/NS/* bind-mounted over /etc/*;
    # unshare --uts: a UTS namespace of its own, whose hostname sh sets before it execs the command
    # (ip, unshare and sh each exec the next: a Popen's pid is the command's own).
    return ["ip", "netns", "exec", netns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
            hostname, *cmd]


# -- teardown on exit and signals ---------------------------------------------------------------

_live: set["Cluster"] = set()
_live_lock = threading.Lock()
_handlers_installed = False


def _close_all() -> None:
    for made in list(_live):
        made.close()


def _install_handlers() -> None:
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(_close_all)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit still holds
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(signum)

        def handler(num, frame, previous=previous):
            _close_all()
            if callable(previous):
                previous(num, frame)  # SIGINT's default raises KeyboardInterrupt
            elif previous != signal.SIG_IGN:
                signal.signal(num, signal.SIG_DFL)
                os.kill(os.getpid(), num)

        signal.signal(signum, handler)


# -- hosts and the cluster -----------------------------------------------------------------------

class Host:
    """One simulated machine: a network namespace, a hostname, its own /etc/hosts, one shaped link.

    ``name``: its hostname; ``address``: its IPv4 on the cluster's /24; ``ifname``: ``eth0``;
    ``netns``: its namespace; ``port``: the bridge's end of its veth (in ``cluster.bridge_netns``);
    ``rate_bits_per_s``: its link's rate (None: not shaped).
    """

    def __init__(self, cluster: "Cluster", index: int, name: str, address: str, rate_bits_per_s: float | None):
        self.cluster = cluster
        self.index = index
        self.name = name
        self.address = address
        self.ifname = IFNAME
        self.netns = f"{cluster.prefix}h{index}"
        self.port = f"vh{index}"
        self.rate_bits_per_s = rate_bits_per_s

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address}, netns={self.netns})"

    def command(self, cmd: Sequence[str] | str) -> list[str]:
        """The argv that runs ``cmd`` (a list, or a string for ``sh -c``) inside this host."""
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        return _wrap(self.netns, self.name, argv)

    def run(self, cmd: Sequence[str] | str, env: Mapping[str, str] | None = None,
            **popen_kwargs) -> subprocess.Popen:
        """Start ``cmd`` inside this host. ``env`` is laid over this process's environment (less
        torchrun's launch variables). The process gets a session of its own (killed, with its
        children, when the cluster closes) unless ``start_new_session=False`` is passed."""
        full_env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
        full_env.update(env or {})
        popen_kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(cmd), env=full_env, **popen_kwargs)
        self.cluster._procs.append(proc)
        return proc

    def check(self, cmd: Sequence[str] | str, timeout: float = 60, env: Mapping[str, str] | None = None
              ) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside this host to its end (killed after ``timeout``); text output captured."""
        proc = self.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(proc)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    # the link
    def set_rate(self, rate_bits_per_s: float | None) -> None:
        self.cluster.set_rate(self, rate_bits_per_s)

    def link_down(self) -> None:
        self.cluster.link_down(self)

    def link_up(self) -> None:
        self.cluster.link_up(self)


def _killpg(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                proc.kill()
            except ProcessLookupError:
                pass


_sequence = [0]


class Cluster:
    """N hosts on one machine, joined by one bridge (a switch) in a namespace of its own.

    ``hosts``: a count (hosts named node0, node1, ...) or a list of hostnames.
    ``rate_bits_per_s``: every link's rate (None: unshaped); ``rates``: per hostname, overrides it.
    ``hosts_style``: "resolvable" (every name, the host's own included, on its 10.x address) or
    "debian" (the host's own name on 127.0.1.1 as Debian installs it; the others' on their addresses).
    ``latency``: tbf's latency (how long a packet may queue). ``subnet``: a /24 (default: a free
    10.77.X.0/24). Use it as a context manager; ``close()`` is idempotent, and an exception, SIGINT,
    SIGTERM or the interpreter's exit tears it down too.
    """

    def __init__(self, hosts: int | Sequence[str] = 2, *, rate_bits_per_s: float | None = DEFAULT_RATE_BITS_PER_S,
                 rates: Mapping[str, float | None] | None = None, hosts_style: str = "resolvable",
                 latency: str = DEFAULT_LATENCY, subnet: str | None = None):
        if hosts_style not in ("resolvable", "debian"):
            raise ValueError(f"hosts_style must be 'resolvable' or 'debian', not {hosts_style!r}")
        names = [f"node{i}" for i in range(hosts)] if isinstance(hosts, int) else list(hosts)
        for name in names:
            if not _HOSTNAME.match(name):
                raise ValueError(f"{name!r} is not a hostname (lower-case letters, digits, '-')")
        if len(set(names)) != len(names):
            raise ValueError(f"hostnames must be unique: {names}")
        self.hosts_style = hosts_style
        self.latency = latency
        self.default_rate = rate_bits_per_s
        self._names = names
        self._rates = dict(rates or {})
        self._subnet = subnet
        _sequence[0] += 1
        self.prefix = f"{PREFIX}{os.getpid()}-{_sequence[0]}-"
        self.bridge_netns = f"{self.prefix}br"
        self.hosts: list[Host] = []
        self._procs: list[subprocess.Popen] = []
        self._namespaces: list[str] = []
        self._open = False
        self.network: ipaddress.IPv4Network | None = None

    # lifecycle
    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "Cluster":
        problem = cluster_capability()
        if problem is not None:
            raise RuntimeError(f"cannot make a cluster of network namespaces: {problem}")
        clean_stale()
        _install_handlers()
        with _live_lock:
            _live.add(self)
        self._open = True
        try:
            self.network = ipaddress.IPv4Network(self._subnet) if self._subnet else _free_subnet()
            self._add_netns(self.bridge_netns)
            _ip("-n", self.bridge_netns, "link", "add", BRIDGE, "type", "bridge")
            _ip("-n", self.bridge_netns, "link", "set", BRIDGE, "up")
            _ip("-n", self.bridge_netns, "link", "set", "lo", "up")
            for name in self._names:
                self.add_host(name, self._rates.get(name, self.default_rate))
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Kill every process started in a host, delete the namespaces (their links go with them)
        and the /etc/netns folders. Safe to call twice, and from a signal handler."""
        if not self._open:
            return
        self._open = False
        for proc in self._procs:
            _killpg(proc)
        for netns in reversed(self._namespaces):
            _remove_netns(netns)
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        with _live_lock:
            _live.discard(self)

    def _add_netns(self, netns: str) -> None:
        self._namespaces.append(netns)
        _ip("netns", "add", netns)

    # hosts
    def __getitem__(self, key: int | str) -> Host:
        if isinstance(key, int):
            return self.hosts[key]
        for host in self.hosts:
            if host.name == key:
                return host
        raise KeyError(key)

    def __iter__(self):
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def add_host(self, name: str, rate_bits_per_s: float | None = DEFAULT_RATE_BITS_PER_S) -> Host:
        """One more host (a store, say) on the same bridge; every host's /etc/hosts learns its name."""
        if not self._open:
            raise RuntimeError("the cluster is not started")
        if not _HOSTNAME.match(name) or any(h.name == name for h in self.hosts):
            raise ValueError(f"{name!r} is not a new hostname")
        index = len(self.hosts)
        address = str(self.network.network_address + index + 1)
        host = Host(self, index, name, address, rate_bits_per_s)
        self._add_netns(host.netns)
        os.makedirs(os.path.join(NETNS_ETC, host.netns), exist_ok=True)
        # ip netns exec bind-mounts each file over the machine's own: only where that one exists
        if os.path.exists("/etc/hostname"):
            with open(os.path.join(NETNS_ETC, host.netns, "hostname"), "w") as f:
                f.write(name + "\n")
        if os.path.exists("/etc/resolv.conf"):
            with open(os.path.join(NETNS_ETC, host.netns, "resolv.conf"), "w") as f:
                # no DNS server is reachable from a host: without a nameserver line, glibc asks
                # 127.0.0.1, which refuses at once, so a name or address that /etc/hosts lacks fails
                # fast (a reverse lookup of the host's own address in the debian style, say)
                f.write("# a cluster host: names come from /etc/hosts only\noptions timeout:1 attempts:1\n")
        br, ns = self.bridge_netns, host.netns
        _ip("-n", br, "link", "add", host.port, "type", "veth", "peer", "name", IFNAME, "netns", ns)
        _ip("-n", br, "link", "set", host.port, "master", BRIDGE, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{address}/{self.network.prefixlen}", "dev", IFNAME)
        _ip("-n", ns, "link", "set", IFNAME, "up")
        self.hosts.append(host)
        self.set_rate(host, rate_bits_per_s)
        self._write_hosts_files()
        return host

    def hosts_file(self, host: Host) -> str:
        """The text of ``host``'s /etc/hosts in this cluster's style."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        if self.hosts_style == "debian":
            lines.append(f"{DEBIAN_SELF_ADDRESS}\t{host.name}")
        for other in self.hosts:
            if other is host and self.hosts_style == "debian":
                continue
            lines.append(f"{other.address}\t{other.name}")
        return "\n".join(lines) + "\n"

    def _write_hosts_files(self) -> None:
        for host in self.hosts:
            # written in place: the file keeps its inode, so processes already running in the host
            # (whose /etc/hosts is a bind mount of it) see the new names too
            with open(os.path.join(NETNS_ETC, host.netns, "hosts"), "w") as f:
                f.write(self.hosts_file(host))

    # the links
    def _host(self, host: Host | str | int) -> Host:
        return host if isinstance(host, Host) else self[host]

    def set_rate(self, host: Host | str | int, rate_bits_per_s: float | None) -> None:
        """Shape ``host``'s link to ``rate_bits_per_s`` both ways (tbf on the host's eth0 for what it
        sends, on the bridge's port for what it receives); None takes the shaping off. Can be called
        while traffic flows."""
        host = self._host(host)
        for netns, dev in ((host.netns, host.ifname), (self.bridge_netns, host.port)):
            if rate_bits_per_s is None:
                _tc("-n", netns, "qdisc", "del", "dev", dev, "root", check=False)
            else:
                _tc("-n", netns, "qdisc", "replace", "dev", dev, "root", "tbf",
                    "rate", f"{int(rate_bits_per_s)}bit", "burst", str(tbf_burst_bytes(rate_bits_per_s)),
                    "latency", self.latency)
        host.rate_bits_per_s = rate_bits_per_s

    def link_down(self, host: Host | str | int) -> None:
        """Pull ``host``'s cable: its port on the bridge goes down (its eth0 loses carrier and keeps
        its address and routes, so a peer's connect or send times out rather than fails at once)."""
        host = self._host(host)
        _ip("-n", self.bridge_netns, "link", "set", host.port, "down")

    def link_up(self, host: Host | str | int) -> None:
        host = self._host(host)
        _ip("-n", self.bridge_netns, "link", "set", host.port, "up")

    # jobs
    def torchrun(self, hosts: Sequence[Host | str | int], nproc_per_node: int, args: Sequence[str], *,
                 port: int = 29400, rdzv_id: str | None = None, env: Mapping[str, str] | None = None,
                 rdzv_endpoint: str | None = None, is_host: bool = True, local_addr: bool = False,
                 max_restarts: int = 0, python: str = sys.executable, logs: str | None = None,
                 torchrun_args: Sequence[str] = (), **popen_kwargs) -> list[subprocess.Popen]:
        """Start one torchrun agent per host (``--nnodes len(hosts)``, ``--node-rank i``, c10d
        rendezvous on the first host's ``address:port``) running ``args`` (a script and its
        arguments, or ``-m module ...``). Returns the agents' Popens, in the order of ``hosts``.

        Each agent gets GLOO_SOCKET_IFNAME=eth0 and OMP_NUM_THREADS=1 (``env`` is laid over them).
        ``is_host``: tell the rendezvous which agent serves its store (``--rdzv-conf is_host=``),
        since torch's guess compares the endpoint with the addresses the hostname resolves to,
        which in the debian style is 127.0.1.1. ``local_addr``: pass ``--local-addr`` (the host's
        address) so the agents do not advertise their hostnames. ``logs``: a folder for
        ``<hostname>.log`` (stdout and stderr) unless stdout/stderr are passed.
        """
        hosts = [self._host(h) for h in hosts]
        endpoint = rdzv_endpoint or f"{hosts[0].address}:{port}"
        rdzv_id = rdzv_id or f"{self.prefix}{time.monotonic_ns()}"
        procs = []
        for rank, host in enumerate(hosts):
            cmd = [python, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)), "--node-rank", str(rank),
                   "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                   "--rdzv-id", rdzv_id, "--max-restarts", str(max_restarts)]
            if is_host:
                cmd += ["--rdzv-conf", f"is_host={'true' if rank == 0 else 'false'}"]
            if local_addr:
                cmd += ["--local-addr", host.address]
            cmd += [*torchrun_args, *args]
            full_env = {"GLOO_SOCKET_IFNAME": host.ifname, "OMP_NUM_THREADS": "1", **(env or {})}
            kwargs = dict(popen_kwargs)
            if logs is not None and "stdout" not in kwargs:
                os.makedirs(logs, exist_ok=True)
                log = open(os.path.join(logs, f"{host.name}.log"), "wb")
                kwargs.update(stdout=log, stderr=subprocess.STDOUT)
            procs.append(host.run(cmd, env=full_env, **kwargs))
            if logs is not None and "stdout" not in popen_kwargs:
                log.close()  # the child holds its own copy
        return procs

    def throughput(self, sender: Host | str | int, receiver: Host | str | int, seconds: float = 1.0, *,
                   port: int = 5201, timeout: float = 30, timeline: bool = False) -> dict:
        """Send from ``sender`` to ``receiver`` over one TCP connection for ``seconds`` (plain Python
        sockets) and return the receiver's measure: ``{"bytes", "seconds", "bits_per_s"}`` (from
        the first byte to the end of the stream), plus ``"timeline"``: ``[[monotonic, bytes], ...]``
        every 50 ms when asked."""
        sender, receiver = self._host(sender), self._host(receiver)
        recv = receiver.run([sys.executable, _THROUGHPUT_SCRIPT, "recv", str(port), str(timeout)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ready = recv.stdout.readline()
            if ready.strip() != "ready":
                raise RuntimeError(f"the receiver did not start: {ready!r} {recv.stderr.read()}")
            send = sender.check([sys.executable, _THROUGHPUT_SCRIPT, "send", receiver.address, str(port),
                                 str(seconds), str(timeout)], timeout=timeout + seconds + 10)
            if send.returncode != 0:
                raise RuntimeError(f"the sender failed ({send.returncode}): {send.stderr}")
            out, err = recv.communicate(timeout=timeout)
            if recv.returncode != 0:
                raise RuntimeError(f"the receiver failed ({recv.returncode}): {err}")
        finally:
            _killpg(recv)
            recv.wait()
        result = json.loads(out)
        if not timeline:
            result.pop("timeline", None)
        return result


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.77.X.0/24 that no address of this machine's own namespace falls in (the cluster's
    namespaces are apart from it anyway; this keeps a reader of ``ip addr`` from confusion)."""
    used = []
    for line in _ip("-o", "-4", "addr", check=False).stdout.splitlines():
        match = re.search(r"inet (\S+)", line)
        if match:
            used.append(ipaddress.IPv4Interface(match.group(1)).network)
    candidates = list(range(256))
    random.Random(os.getpid() * 7919 + time.monotonic_ns()).shuffle(candidates)
    for x in candidates:
        net = ipaddress.IPv4Network(f"10.77.{x}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.77.X.0/24 on this machine")
