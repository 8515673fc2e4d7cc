"""The worker group: who this process is, which device it owns, and how ranks agree.

A group comes from what its launcher said (distload/workers/launch.py: torchrun, Slurm's ``srun``, or
nothing: one process, no process group at all).

Every collective that distload issues goes through :meth:`WorkerGroup.agree` or
:meth:`WorkerGroup.exchange`, on a gloo *control* group with a timeout. A step that fails on one
rank is reported to all of them, so no rank waits for a failed one: the failing rank raises its own
error, the others raise :class:`RankFailedError` naming it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

import torch
import torch.distributed as dist

from distload.errors import ConfigError, DistloadError, GroupError, RankFailedError
from distload.runtime import RUNTIME
from distload.workers.heartbeat import INTERVAL_S, SETTLE_S, Heartbeat, PeerWatch, wait_while_beating
from distload.workers.launch import LaunchInfo, detect_launch, resolve_device

DEFAULT_TIMEOUT_S = 300.0
# How long a member's heartbeat may stand still, in a watched NCCL step, before it counts as lost.
PEER_DEAD_S = 5.0
# The longest the process serving the job's store stays, leaving on an error, while other ranks
# still beat (their own look at the store to name the rank that stopped takes about 2 s).
LINGER_S = 5.0
# The NCCL groups distload makes: a failed or timed-out operation is an error of that step, raised
# where distload waits, not the end of the process. Read by ProcessGroupNCCL's constructor; its
# default, 3 (SkipCleanUp; 1 under torchrun, whose agent sets it), makes the watchdog rethrow in
# its own thread ("we are taking the entire process down"), while 2 (CleanUpOnly) only aborts
# the communicator.
NCCL_CLEANUP_ONLY = (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"),)

T = TypeVar("T")
# The tags of an exchange's point-to-point messages (two a step): apart from the untagged (0)
# messages of the shared reads, which may travel on the same gloo group.
EXCHANGE_TAG = 1 << 20
INLINE_BYTES = 256  # of each item, in a step's first message (see WorkerGroup._gather_items)


def bruck_distances(n: int) -> list[int]:
    """The distances of the steps of Bruck's all-gather over ``n`` ranks: 1, 2, 4, ... below n
    (ceil(log2 n) steps; pure, so that the scale harness counts the messages the code sends)."""
    out, distance = [], 1
    while distance < n:
        out.append(distance)
        distance *= 2
    return out


def carries(backend: str | None, device_type: str) -> bool:
    """Whether a process group whose backend torch names ``backend`` (``dist.get_backend``:
    ``nccl``, ``gloo``, or per device type ``cpu:gloo,cuda:nccl``) moves tensors on
    ``device_type`` from their own memory.

    NCCL carries CUDA tensors only: torch registers it for "cuda" alone
    (``Backend.default_device_backend_map``), so a CPU tensor on an NCCL-only group raises "No
    backend type associated with device type cpu". gloo is registered for "cuda" too, but its
    send and recv hand a CUDA tensor's device pointer to a TCP buffer
    (``ProcessGroupGloo::send``: ``tensor.const_data_ptr()`` into ``createUnboundBuffer``, with
    no device check), so only host tensors travel through gloo point to point.
    """
    if not backend:
        return False
    names: dict[str, str] = {}
    for part in backend.lower().split(","):
        kind, _, name = part.rpartition(":")
        if kind:
            names[kind.strip()] = name.strip()
        else:
            names = {"cpu": name.strip(), "cuda": name.strip()}
    return names.get(device_type) == ("nccl" if device_type == "cuda" else "gloo")


def subgroup_backend(device_type: str) -> str:
    """The backend of a subgroup's one process group, data and control together.

    For CUDA both in one group: with the default group bound to a device (``device_id``), torch
    2.13's ``new_group`` makes every rank left out of *any* new group, gloo ones too, take part
    in an ``ncclCommSplit`` of the default communicator, while a gloo group's members take part
    in none (``_new_process_group_helper``: ``split_from.perform_nocolor_split`` for
    non-members; ``split_from`` used only for NCCL). An NCCL group and a gloo group made one
    after the other thus leave the ranks left out in a second split nobody else joins (pytorch
    issue 145376). One ``cpu:gloo,cuda:nccl`` group is one split on every rank, and its object
    collectives run on "cpu", i.e. gloo (``_get_object_coll_device``).
    """
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


# gloo's text around the cause: the source file it was raised in, and advice that points the
# wrong way ("bugs in the application", "GLHF!") where distload names the peer that went away.
_GLOO_NOISE = (
    re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*"),  # where in gloo's source it was raised
    re.compile(r"\.?\s*This is typically caused by .*$", re.DOTALL),  # its advice
    re.compile(r"\s*(?:Exception raised from|frame #0).*$", re.DOTALL),  # a C++ backtrace
)


def collective_cause(exc: BaseException) -> str:
    """What a failed collective says went wrong, without gloo's source location, advice or a
    C++ backtrace: "Connection closed by peer [10.0.0.2]:26543", "Timed out waiting 10000ms ..."."""
    text = str(exc).strip()
    for noise in _GLOO_NOISE:
        text = noise.sub("", text)
    return text or type(exc).__name__


def _describe(exc: BaseException) -> str:
    if isinstance(exc, DistloadError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class WorkerGroup:
    """This rank's place in a group of ranks: rank, device, and the collectives to agree.

    Made from the launcher's environment (``WorkerGroup()``: torchrun, Slurm or one process), it
    stands for the whole job; made from a ``torch.distributed`` group the caller already has
    (``WorkerGroup(process_group=tp_group)``), or by :meth:`subgroup`, it stands for those ranks
    only: ``rank`` and ``world_size`` are then within the group, and its agreements and
    shared reads involve only its members.

    Use as a context manager (or call :meth:`close`): the process groups distload made are always
    torn down, on failing paths too, because a gloo group still alive at interpreter exit can
    abort the process. A default group that existed before (a training job importing distload)
    and a group the caller passed are used and left alone.
    """

    def __init__(self, device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
                 environ: Mapping[str, str] = os.environ, *, process_group: Any = None):
        if not timeout_s or timeout_s <= 0:
            raise ConfigError(f"group timeout must be a positive number of seconds, got {timeout_s!r}")
        self.timeout = timedelta(seconds=timeout_s)
        self._owns_default_group = False
        self._owned: list[Any] = []  # process groups distload made for this object
        self._subgroups: list[WorkerGroup] = []  # made by subgroup(), closed with this one
        self._control: Any = None
        self._data: Any = None
        self._ranks: list[int] | None = None  # global ranks of a group smaller than the job
        self._heartbeat: Heartbeat | None = None
        if process_group is not None and not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("WorkerGroup(process_group=...) needs torch.distributed initialised; "
                              "pass the group after init_process_group")
        if dist.is_available() and dist.is_initialized():
            self.launch = LaunchInfo(
                "existing", dist.get_rank(), dist.get_world_size(),
                int(environ.get("LOCAL_RANK", "0")), int(environ.get("LOCAL_WORLD_SIZE", "1")), None,
            )
        else:
            self.launch = detect_launch(environ)
        self.device = resolve_device(device, self.launch.local_rank)
        if self.device.type == "cuda":
            # The readers work on the current device's streams (InstantTensor synchronizes
            # torch.cuda.current_stream() before handing out each tensor, _impl.py:1006, and
            # clones on it): it must be this group's device, on every path into a group.
            torch.cuda.set_device(self.device)
        self.hostname = socket.gethostname()
        if process_group is not None:
            self._join(process_group)
            self._heartbeat = Heartbeat(dist.get_rank())
            return
        if self.launch.world_size > 1 and not dist.is_initialized():
            self._init_default_group()
        if self.launch.world_size > 1:
            self._heartbeat = Heartbeat(dist.get_rank())
            # Control messages (errors, file lists, reports) always travel over gloo so they work
            # the same next to NCCL, and never touch device memory.
            if carries(dist.get_backend(), "cpu"):
                self._control = dist.group.WORLD
            else:
                self._control = self._new_group(None, "gloo")
            self._data = self._data_group(dist.group.WORLD)

    @classmethod
    @contextlib.contextmanager
    def for_call(cls, group: "WorkerGroup | None", device: str = "auto") -> Iterator["WorkerGroup"]:
        """The group one API call runs over: the caller's (left open), or for None one made from
        the environment (torchrun, Slurm or one process, on ``device``) and closed after the call.

        This is the one convention of every ``group=`` argument in distload's API.
        """
        if group is not None:
            if not isinstance(group, WorkerGroup):
                raise ConfigError(f"group must be a distload.WorkerGroup (wrap a torch.distributed group "
                                  f"with WorkerGroup(process_group=...)), got {type(group).__name__}")
            yield group
            return
        with cls(device=device) as own:
            yield own

    def _init_default_group(self) -> None:
        """Form the job's default group from the launcher's rendezvous, under a key prefix of its
        own: this process's how-manieth group it is (and torchrun's restart count).

        torchrun's store is its agent's and outlives the group: a second group formed in the same
        processes (two ``distload.load`` calls in one script, each making and closing its own)
        would find the first one's keys there, and a rank that came early would dial a peer's
        closed gloo port from them ("Connection refused", or a hang). Every rank forms the same
        groups in the same order, so each names the same prefix."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        kwargs: dict[str, Any] = {"backend": backend, "timeout": self.timeout, "rank": self.launch.rank,
                                  "world_size": self.launch.world_size}
        if backend == "nccl":
            kwargs["device_id"] = self.device
        prefix = f"distload/group/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(RUNTIME.groups_formed)}/"
        try:
            store = self._rendezvous_store()
            with RUNTIME.environment(dict(NCCL_CLEANUP_ONLY), restore_prefix=""):
                dist.init_process_group(store=dist.PrefixStore(prefix, store), **kwargs)
        except Exception as exc:  # a peer that never started, a port in use, a bad address
            raise GroupError(self._rendezvous_failure(exc)) from exc
        self._owns_default_group = True

    def _rendezvous_store(self) -> Any:
        """The job's rendezvous store: made at this process's first group, kept for the next.

        Outside torchrun (srun, or ranks started by hand) rank 0 serves it. Made anew for each
        group, the server of the group before closes as the next one opens on the same port, and a
        rank that came early to the next group may have reached the closing one: its join then
        fails ("Failed to recv, got 0 bytes. Connection was likely closed") while the ranks it left
        wait for it. One store for the process's life has no such moment; each group's keys stay
        apart under their prefix (_init_default_group)."""
        init_method = self.launch.init_method or "env://"
        key = (init_method, os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"), self.launch.rank,
               self.launch.world_size)
        store = RUNTIME.rendezvous_stores.get(key)
        if store is None:
            # Not under RUNTIME.lock: this waits for the job's other ranks (up to the timeout), and
            # a process forms its default groups one at a time anyway.
            store, _, _ = next(dist.rendezvous(init_method, self.launch.rank, self.launch.world_size,
                                               timeout=self.timeout))
            RUNTIME.rendezvous_stores[key] = store
        store.set_timeout(self.timeout)
        return store

    def _join(self, process_group: Any) -> None:
        """Stand for the caller's group (this rank must be in it)."""
        if process_group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(process_group) < 0:
            raise ConfigError(f"rank {self.launch.rank} is not a member of the process group it was given")
        ranks = dist.get_process_group_ranks(process_group)
        self._ranks = None if ranks == list(range(dist.get_world_size())) else list(ranks)
        self._data = process_group
        if carries(dist.get_backend(process_group), "cpu"):
            self._control = process_group
            return
        try:
            # Only the members make it (the caller's group may exist on these ranks only).
            self._control = self._new_group(ranks, "gloo", use_local_synchronization=True)
        except ValueError:
            # A gloo group over exactly these ranks was already made the same way (torch names
            # such groups by their ranks): collectives then use the caller's group itself.
            self._control = process_group
        self._data = self._data_group(process_group)

    def _data_group(self, group: Any) -> Any:
        """The group that carries this rank's tensors: ``group``, or for a CPU device where
        ``group`` is NCCL only (a training job's ``init_process_group("nccl")``), the gloo
        control group. A CUDA device over a gloo group keeps it, its buckets staged through the
        host (:attr:`wire_device`)."""
        if self.device.type == "cpu" and not carries(dist.get_backend(group), "cpu"):
            return self._control
        return group

    def _new_group(self, ranks: list[int] | None, backend: str, **kwargs: Any) -> Any:
        group = dist.new_group(ranks, backend=backend, timeout=self.timeout, **kwargs)
        self._owned.append(group)
        return group

    def subgroup(self, ranks: Sequence[int]) -> "WorkerGroup | None":
        """A group of ``ranks`` (ranks of this group), with its own data and control groups.

        Collective over the whole job, like ``torch.distributed.new_group``: every rank of the
        default group calls it with the same ranks, in the same order. Returns None on ranks
        outside it. Close it when done with it; closing this group closes it too.
        """
        members = sorted(set(ranks))
        if not members or any(not 0 <= r < self.world_size for r in members):
            raise ConfigError(f"subgroup ranks must be non-empty and within [0, {self.world_size}), got {list(ranks)}")
        if not self.is_world:
            # torch numbers the groups it makes by a counter every rank of the job advances: a
            # group made on some ranks only would give later groups different numbers on each.
            raise ConfigError(f"subgroup() is called on the whole job's WorkerGroup (every rank of the job, "
                              f"the same ranks in the same order); this one is a group of ranks {self.ranks}")
        sub = object.__new__(WorkerGroup)
        sub.timeout, sub.launch, sub.device, sub.hostname = self.timeout, self.launch, self.device, self.hostname
        sub._owns_default_group, sub._owned, sub._subgroups = False, [], []
        sub._data = sub._control = None
        sub._heartbeat = None
        if self.launch.world_size == 1:  # one process, no torch.distributed: the group of rank 0
            sub._ranks = None
            return sub
        global_ranks = [self.ranks[r] for r in members]
        with RUNTIME.environment(dict(NCCL_CLEANUP_ONLY), restore_prefix=""):
            data = dist.new_group(global_ranks, backend=subgroup_backend(self.device.type), timeout=self.timeout)
        if self.launch.rank not in global_ranks:
            return None
        sub._owned = [data]
        sub._data = sub._control = data
        sub._heartbeat = Heartbeat(self.launch.rank)
        sub._ranks = None if global_ranks == list(range(self.launch.world_size)) else global_ranks
        self._subgroups = [s for s in self._subgroups if s._owned] + [sub]  # forget the closed ones
        return sub

    def _rendezvous_failure(self, exc: BaseException) -> str:
        where = self.launch.init_method or (
            f"env://{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}")
        reason = str(exc).rstrip(".")
        message = (f"rank {self.rank} of {self.world_size} ({self.launch.launcher}) could not join the "
                   f"process group at {where} within {self.timeout.total_seconds():.0f}s: {reason}")
        if self.launch.launcher == "slurm":
            message += (
                f". Slurm said this job has SLURM_NTASKS={self.world_size} ranks: start them all with "
                f"srun (a batch script or salloc shell outside srun is one process; there, unset "
                f"SLURM_NTASKS and SLURM_PROCID, or use launch/slurm/load_srun.sbatch), and check that "
                f"{where} is reachable from every node (set MASTER_ADDR/MASTER_PORT otherwise)"
            )
        return message

    # -- identity ---------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank within the group."""
        return self.launch.rank if self._ranks is None else self._ranks.index(self.launch.rank)

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return self.launch.world_size if self._ranks is None else len(self._ranks)

    @property
    def ranks(self) -> list[int]:
        """The job-wide (default group) rank of each member, in group-rank order."""
        return list(range(self.launch.world_size)) if self._ranks is None else list(self._ranks)

    @property
    def is_world(self) -> bool:
        """Whether the group is the whole job (libraries that use only the default group need it)."""
        return self._ranks is None

    @property
    def local_rank(self) -> int:
        return self.launch.local_rank

    @property
    def local_world_size(self) -> int:
        """Ranks of the job on this node (the whole world where the launcher does not say)."""
        return self.launch.local_world_size

    @property
    def backend(self) -> str | None:
        return dist.get_backend(self._data) if self.world_size > 1 else None

    @property
    def wire_device(self) -> torch.device:
        """Where this rank's tensors travel between ranks: the device where the data group
        carries it, else the host (a CUDA device over a gloo group: see :func:`carries`)."""
        if self.world_size > 1 and not carries(self.backend, self.device.type):
            return torch.device("cpu")
        return self.device

    @property
    def process_group(self) -> Any:
        """The data group, for backends and transfers that take a handle; None for one process."""
        return self._data if self.world_size > 1 else None

    # -- collectives --------------------------------------------------------------------------
    def exchange(self, value: Any, *, explain: bool = True) -> list[Any]:
        """Every rank's ``value``, in rank order (an all-gather of picklable objects).

        Where a peer is lost, the error names the ranks that stopped answering (``explain``:
        a few seconds spent watching their heartbeats)."""
        if self.world_size == 1:
            return [value]
        try:
            items = self._gather_items(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as exc:  # a peer died or the timeout passed
            raise GroupError(
                f"rank {self.rank}: lost contact with the other ranks while exchanging state "
                f"(timeout {self.timeout.total_seconds():.0f}s): {collective_cause(exc)}"
                f"{self.lost_peers(exc) if explain else ''}"
            ) from exc
        return [pickle.loads(item) for item in items]

    def _gather_items(self, mine: bytes) -> list[bytes]:
        """Every rank's bytes, in rank order, by Bruck's all-gather over point-to-point messages on
        the control group: ceil(log2 N) steps, in step k each rank sends the items it holds (up to
        2^k) to the rank 2^k below it and receives as many from the rank 2^k above. A ring
        (torch's all_gather_object on gloo: twice, sizes then items) takes 2 (N - 1) message
        latencies, which at a thousand ranks costs more than everything else a load plans
        (docs/scale.md). A step's first message has a size both ends know: the items' sizes and
        up to INLINE_BYTES of them each (a "fine?" answer travels whole in it); the rest of larger
        items follows in a second."""
        n, me = self.world_size, self.rank
        held = [mine]  # held[i]: rank (me + i) % n's item
        for step, distance in enumerate(bruck_distances(n)):
            count = min(distance, n - distance)
            to, frm = self.ranks[(me - distance) % n], self.ranks[(me + distance) % n]
            tag = EXCHANGE_TAG + 2 * step
            inline = INLINE_BYTES * count
            payload = b"".join(held[:count])
            first = torch.zeros(8 * count + inline, dtype=torch.uint8)
            first[:8 * count] = torch.tensor([len(item) for item in held[:count]], dtype=torch.int64).view(torch.uint8)
            head = payload[:inline]
            if head:
                first[8 * count:8 * count + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
            incoming = torch.empty_like(first)
            self._swap(incoming, first, frm, to, tag)
            sizes = incoming[:8 * count].view(torch.int64).tolist()
            data = incoming[8 * count:8 * count + min(sum(sizes), inline)].numpy().tobytes()
            if sum(sizes) > inline or len(payload) > inline:
                rest = torch.empty(max(0, sum(sizes) - inline), dtype=torch.uint8)
                out = torch.frombuffer(bytearray(payload[inline:]), dtype=torch.uint8) if len(payload) > inline else None
                self._swap(rest if sum(sizes) > inline else None, out, frm, to, tag + 1)
                data += rest.numpy().tobytes()
            at = 0
            for size in sizes:
                held.append(data[at:at + size])
                at += size
        return [held[(r - me) % n] for r in range(n)]

    def _swap(self, incoming: torch.Tensor | None, outgoing: torch.Tensor | None, frm: int, to: int, tag: int) -> None:
        """Receive ``incoming`` from ``frm`` while sending ``outgoing`` to ``to`` (None: no message)."""
        works = []
        if incoming is not None:
            works.append(dist.irecv(incoming, src=frm, group=self._control, tag=tag))
        if outgoing is not None:
            works.append(dist.isend(outgoing, dst=to, group=self._control, tag=tag))
        for work in works:
            work.wait(self.timeout)

    def lost_peers(self, exc: BaseException | None = None) -> str:
        """After a failed collective (``exc``): a clause naming the members that stopped
        answering (by their heartbeat in the rendezvous store), or saying that it cannot tell.

        Under torchrun a peer whose process ended (a closed connection, not a timeout) is named
        by torchrun's own summary, and its agent ends this process within a second or so: the
        1.5 s watch would only lose that race and leave this rank without any message. A peer on
        this host whose process is gone is named there too (by the process it posted), looked for
        for SETTLE_S at most: its sockets close a moment before its process shows as ended."""
        if self._heartbeat is None or self.world_size == 1:
            return ""
        if os.environ.get("TORCHELASTIC_RUN_ID") and exc is not None and "time" not in str(exc).lower():
            ended = self._heartbeat.describe_ended(self.ranks, self.launch.rank, SETTLE_S)
            return ended or "; a peer's process ended (torchrun's failure summary names its rank)"
        return self._heartbeat.describe_silent(self.ranks, self.launch.rank)

    @contextlib.contextmanager
    def watched(self, step: str) -> Iterator[None]:
        """Around a step that waits on NCCL: a lost member ends it in seconds, naming the member.

        On NCCL a peer that died or stopped leaves kernels waiting on the GPU; no connection
        closes, and torch ends them only at the group's timeout (minutes). Here a thread watches
        the members' heartbeats; when one stands still for PEER_DEAD_S it aborts the data group's
        communicator (``ProcessGroupNCCL.abort``: ncclCommAbort), so the blocked calls return
        with an error, and the step raises GroupError naming the member. On gloo (a closed
        connection fails at once) and for one process it does nothing."""
        store = None if self._heartbeat is None else self._heartbeat.store
        if self.world_size == 1 or store is None or not carries(self.backend, "cuda"):
            yield
            return
        watch = PeerWatch(store, [r for r in self.ranks if r != self.launch.rank], PEER_DEAD_S)
        stop, lost = threading.Event(), []

        def run() -> None:
            while not stop.wait(INTERVAL_S):
                try:
                    silent = watch.silent(time.monotonic())
                except Exception:  # noqa: BLE001 - the store went away with its host: the timeout decides
                    return
                if silent:
                    lost.extend(silent)
                    self._data._get_backend(self.device).abort()
                    return

        thread = threading.Thread(target=run, name="distload-peer-watch", daemon=True)
        thread.start()
        try:
            yield
        except Exception as exc:
            if lost:
                raise GroupError(
                    f"rank {self.rank}: rank(s) {', '.join(map(str, lost))} (job-wide) stopped answering during "
                    f"{step} (no heartbeat for {PEER_DEAD_S:g} s: killed, stopped or hung); the NCCL communicator "
                    f"was aborted: {exc}") from exc
            raise
        finally:
            stop.set()
            thread.join()

    def agree(self, step: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on every rank; if it fails anywhere, raise on every rank.

        The failing rank re-raises its own exception; the others raise RankFailedError naming
        each failing rank and its message.
        """
        try:
            result = fn()
        except BaseException as exc:  # KeyboardInterrupt too: the others must not wait
            self.report_failure(step, exc)
            raise
        self.check_all_ok(step)
        return result

    def gather(self, step: str, fn: Callable[[], T]) -> list[T]:
        """``agree``, returning every rank's result in rank order: one exchange carries the
        results and the verdicts together."""
        try:
            result = fn()
        except BaseException as exc:  # KeyboardInterrupt too: the others must not wait
            self.report_failure(step, exc)
            raise
        return self._verdicts(step, result)

    def report_failure(self, step: str, exc: BaseException) -> None:
        """Tell the other ranks this rank failed ``step`` (they are inside check_all_ok)."""
        if self.world_size == 1:
            return
        try:
            statuses = self.exchange((False, _describe(exc)), explain=False)
        except GroupError:
            return  # the peers are already gone; the local error is what matters now
        # What every rank said, kept on the exception: the command line prints a failure that
        # every rank shares once, not once per rank (distload.cli.main).
        try:
            exc.job_failures = {rank: message for rank, (ok, message) in enumerate(statuses) if not ok}
        except AttributeError:  # an exception type that takes no attributes
            pass

    def broadcast(self, value: Any, src: int) -> Any:
        """Group rank ``src``'s ``value`` on every rank (other ranks pass anything, e.g. None)."""
        if self.world_size == 1:
            return value
        box = [value]
        try:
            dist.broadcast_object_list(box, src=self.ranks[src], group=self._control)
        except Exception as exc:  # a peer died or the timeout passed
            raise GroupError(
                f"rank {self.rank}: lost contact with rank {src} while receiving its state "
                f"(timeout {self.timeout.total_seconds():.0f}s): {exc}{self.lost_peers(exc)}"
            ) from exc
        return box[0]

    def check_all_ok(self, step: str) -> None:
        """The success side of :meth:`report_failure`: raise if any other rank failed."""
        self._verdicts(step, None)

    def _verdicts(self, step: str, value: Any) -> list[Any]:
        """Say this rank is fine (with ``value``); every rank's value, or RankFailedError naming
        those that failed (they are inside report_failure)."""
        statuses = self.exchange((True, value))
        failures = {rank: message for rank, (ok, message) in enumerate(statuses) if not ok}
        if failures:
            raise RankFailedError(step, failures)
        return [result for _, result in statuses]

    def close(self) -> None:
        """Tear down the process groups distload made (idempotent); the group is unusable after."""
        for sub in self._subgroups:
            sub.close()
        self._subgroups = []
        for group in reversed(self._owned):
            if group is dist.GroupMember.NON_GROUP_MEMBER or not dist.is_initialized():
                continue
            try:
                dist.destroy_process_group(group)
            except Exception:  # a group whose peer died may not tear down cleanly
                pass
        self._owned = []
        self._control = self._data = None
        if self._heartbeat is not None:
            self._heartbeat.release()
            self._heartbeat = None
        if self._owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_default_group = False

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if exc_info[0] is not None:
            self._keep_store_for_failing_peers()
        self.close()

    def _keep_store_for_failing_peers(self) -> None:
        """Leaving on an error, in the process that serves the job's store (rank 0 outside
        torchrun, whose agent serves it otherwise): stay while the other ranks still beat, up to
        LINGER_S. A rank whose peer died reads the store to name it (heartbeat.py); a rank 0 that
        found out first and exited took the store along, and the others then blamed rank 0."""
        if (not self._owns_default_group or dist.get_rank() != 0 or self._heartbeat is None
                or os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"):
            return
        others = [r for r in range(dist.get_world_size()) if r != 0]
        wait_while_beating(self._heartbeat.store, others, LINGER_S)

    def __repr__(self) -> str:
        members = "" if self.is_world else f", ranks={self.ranks}"
        return (f"WorkerGroup(rank={self.rank}, world_size={self.world_size}{members}, "
                f"local_rank={self.local_rank}, device={self.device}, launcher={self.launch.launcher})")
