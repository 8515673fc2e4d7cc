"""Same-host handoff: a pair whose members share a host moves its bytes through memory both map.

A *pair* (one trainer rank, one inference rank) normally moves bytes over a two-member process
group (gloo's sockets, or NCCL). When both members are on one host, each bucket instead goes
through a *segment*: memory the trainer rank writes and the receiver maps. On host memory
(gloo sessions) the segment is a file in /dev/shm; on CUDA (NCCL sessions, every member on a GPU)
it is device memory shared by CUDA IPC handles. The trainer packs a bucket straight into its
segment, once for every same-host receiver of that bucket, and a receiver unpacks from it into its
tensors: one copy on each side, no socket.

The decision is per pair, when the session forms (:func:`form`), and needs no configuration:

1. every member posts a host identity in its hello (:func:`host_identity`: hostname and boot id;
   None where the socket path is forced: ``transport="socket"`` or ``DISTLOAD_SYNC_TRANSPORT=socket``);
2. a trainer rank with a same-host peer makes its segment and posts where it is and a nonce it
   wrote there; each same-host receiver opens it, checks the nonce (another container's /dev/shm,
   another user, a GPU it cannot map would not show it) and answers: ok, or why not;
3. a pair that answered ok hands off through the segment; any other keeps the socket path. That is
   a decision, not an error: it is logged at debug level.

The host segment's name leaves /dev/shm as soon as every same-host receiver answered (they keep
it open): a process killed at any later point leaks nothing, and the memory goes with the last
process that maps it. It holds the buckets in flight (two per receiver place, as the socket path's
buffers), not the model.

Control goes through the session's store, one key per message each way: the trainer posts where a
message lies once all of it is written, the receiver posts that it is done with it once it has
copied (or unpacked) it, and only then may the trainer write there again. A key is posted after
the bytes and read before them (a store round trip orders them), so a receiver never takes a
half-written bucket, and a trainer that dies mid-bucket never posts its key: the receiver waits
until the session's supervisor names the dead trainer, as on the socket path. The works returned
behave as torch's (``is_completed``, ``wait``, ``exception``), so Session.post/wait/supervise and
every failure path are the same for both transports.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import time
import uuid
from typing import Any, Mapping

import torch

from distload.errors import ConfigError, SyncError
from distload.live import rendezvous
from distload.loading.buckets import flat_bytes

log = logging.getLogger("distload")

TRANSPORTS = ("auto", "socket")
TRANSPORT_ENV = "DISTLOAD_SYNC_TRANSPORT"
SHM_DIR = "/dev/shm"
PREFIX = "distload-sync-"  # every host segment's file name starts with it
_HEADER = 4096  # the host segment's first page: the nonce; regions start after it
_ALIGN = 4096  # regions start on a page


def transport_choice(transport: str) -> str:
    """The channel's ``transport`` option, the environment's word winning when it forces the socket."""
    if transport not in TRANSPORTS:
        raise ConfigError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    forced = os.environ.get(TRANSPORT_ENV, "").strip().lower()
    if forced and forced not in TRANSPORTS:
        raise ConfigError(f"{TRANSPORT_ENV} must be one of {', '.join(TRANSPORTS)}, got {forced!r}")
    return "socket" if forced == "socket" else transport


def host_identity() -> str:
    """This host as a same-host pair needs it: its name and this boot's id (two machines that
    share a hostname, or one host rebooted, never match)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


def kind_for(backend: str) -> str:
    """What a same-host pair's segment is: device memory where the session's buffers are on the
    GPU (NCCL), else host memory."""
    return "cuda-ipc" if backend == "nccl" else "shm"


# -- segments: the trainer's ------------------------------------------------------------------

class _HostSegment:
    """A trainer rank's host segment: a /dev/shm file it grows as regions are asked for."""

    kind = "shm"

    def __init__(self, tag: str):
        self.nonce = uuid.uuid4().hex
        self.path = os.path.join(SHM_DIR, f"{PREFIX}{tag}-{os.getpid()}-{self.nonce[:8]}")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.size = 0
        self.maps: list[mmap.mmap] = []  # older maps stay while a view of them may live
        self.view: torch.Tensor | None = None
        self.regions: dict[Any, tuple[int, int]] = {}  # key -> (offset, capacity)
        self.end = _HEADER
        try:
            self._grow(_HEADER)
            self.view[:len(self.nonce)] = torch.frombuffer(bytearray(self.nonce.encode()), dtype=torch.uint8)
        except BaseException:
            self.close()
            raise

    def where(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "nonce": self.nonce}

    def _grow(self, size: int) -> None:
        try:
            os.ftruncate(self.fd, size)
            # Reserve the pages now: a tmpfs that is full fails here (ENOSPC), not with a SIGBUS
            # at the first write into the mapping.
            os.posix_fallocate(self.fd, 0, size)
        except OSError as exc:
            raise SyncError(f"the shared-memory segment for same-host receivers could not grow to "
                            f"{size / 2**20:.0f} MiB in {SHM_DIR} ({exc.strerror}): free room there, use "
                            f"smaller buckets, or force the socket path ({TRANSPORT_ENV}=socket)") from None
        self.view = _remap(self.maps, self.fd, size)
        self.size = size

    def reserve(self, wanted: Mapping[Any, int]) -> None:
        """Make each key's region (a slot of buckets in flight, kept from update to update) hold
        at least its bytes, growing the segment once for all of them. A region too small is
        replaced by a bigger one at the end (the last one grows where it is)."""
        for key, nbytes in wanted.items():
            offset, capacity = self.regions.get(key, (0, -1))
            if capacity < nbytes:
                if -(-(offset + capacity) // _ALIGN) * _ALIGN == self.end:
                    self.end = offset
                self.regions[key] = (self.end, nbytes)
                self.end = -(-(self.end + nbytes) // _ALIGN) * _ALIGN
        if self.end > self.size:
            self._grow(self.end)

    def region(self, key: Any, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the segment kept for ``key``."""
        self.reserve({key: nbytes})
        offset = self.regions[key][0]
        return self.view[offset:offset + nbytes]

    def locate(self, tensor: torch.Tensor) -> tuple[int, int]:
        """Where ``tensor`` lies in the segment, for a receiver. The channel posts a message right
        after writing it into a region, no region asked for between: it lies in the latest map."""
        offset = tensor.data_ptr() - self.view.data_ptr()
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or not 0 <= offset <= self.size - nbytes:
            raise SyncError("internal error: a message for a same-host receiver is not in the trainer's segment")
        return offset, nbytes

    def ready(self, tensor: torch.Tensor) -> None:
        """The bytes written into ``tensor`` are there for a receiver to read (host: at once)."""

    def unlink(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None

    def close(self) -> None:
        self.unlink()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        # The maps go with the last view of them (an export holds an mmap open).
        self.maps, self.view, self.regions = [], None, {}


def _remap(maps: list[mmap.mmap], fd: int, size: int) -> torch.Tensor:
    """Map ``size`` bytes of ``fd`` (appended to ``maps``) and return them as a tensor. Earlier
    maps are closed where no view of them is left (each holds a descriptor); the others stay
    until their last view goes (the same pages: what one shows, every map of the file shows)."""
    maps.append(mmap.mmap(fd, size))
    view = torch.frombuffer(maps[-1], dtype=torch.uint8)
    for old in maps[:-1]:
        try:
            old.close()
            maps.remove(old)
        except BufferError:
            pass
    return view


class _CudaSegment:
    """A trainer rank's CUDA segment: device tensors, one a region, each shared by its IPC handle."""

    kind = "cuda-ipc"

    def __init__(self, device: torch.device):
        self.device = device
        self.nonce = uuid.uuid4().hex
        self.regions: dict[Any, tuple[int, torch.Tensor, list]] = {}  # key -> (id, memory, its handle)
        # What a receiver opens first, to confirm it maps this GPU memory: the nonce.
        self.hello = torch.frombuffer(bytearray(self.nonce.encode()), dtype=torch.uint8).to(device)
        torch.cuda.synchronize(device)

    def where(self) -> dict[str, Any]:
        return {"kind": self.kind, "handle": ipc_handle(self.hello), "nonce": self.nonce,
                "gpu": str(torch.cuda.get_device_properties(self.device).uuid)}

    def reserve(self, wanted: Mapping[Any, int]) -> None:
        for key, nbytes in wanted.items():
            self.region(key, nbytes)

    def region(self, key: Any, nbytes: int) -> torch.Tensor:
        held = self.regions.get(key)
        if held is None or held[1].numel() < nbytes:
            memory = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.regions[key] = (uuid.uuid4().int, memory, ipc_handle(memory))
            held = self.regions[key]
        return held[1][:nbytes]

    def locate(self, tensor: torch.Tensor) -> tuple[int, bytes, int, int]:
        nbytes = tensor.numel() * tensor.element_size()
        for ident, memory, handle in self.regions.values():
            offset = tensor.data_ptr() - memory.data_ptr()
            if tensor.device == memory.device and tensor.is_contiguous() and 0 <= offset <= memory.numel() - nbytes:
                return ident, handle, offset, nbytes
        raise SyncError("internal error: a message for a same-host receiver is not in the trainer's CUDA segment")

    def ready(self, tensor: torch.Tensor) -> None:
        # The receiver reads on its own stream, in its own process: what this process's stream
        # wrote must have finished before the key that says "it is there" is posted.
        torch.cuda.current_stream(self.device).synchronize()

    def unlink(self) -> None:
        pass

    def close(self) -> None:
        self.regions = {}
        self.hello = None


# -- segments: a receiver's mapping of a trainer's ------------------------------------------------

class _HostMapping:
    kind = "shm"

    def __init__(self, where: Mapping[str, Any]):
        self.fd = os.open(where["path"], os.O_RDWR)
        self.maps: list[mmap.mmap] = []
        self.view: torch.Tensor | None = None
        try:
            self._map()
            if bytes(self.view[:len(where["nonce"])].numpy()) != where["nonce"].encode():
                raise OSError("a file of that name holds another segment (not the same /dev/shm)")
        except BaseException:
            self.close()
            raise

    def _map(self) -> None:
        self.view = _remap(self.maps, self.fd, os.fstat(self.fd).st_size)

    def read(self, where: tuple, nbytes: int) -> torch.Tensor:
        offset, sent = where
        if offset + sent > self.view.numel():  # the trainer grew its segment since: map all of it
            self._map()
        if sent != nbytes or offset + sent > self.view.numel():
            raise SyncError(f"a message of {sent} bytes at {offset} where {nbytes} were expected (the two sides "
                            f"disagree on the update's layout)")
        return self.view[offset:offset + nbytes]

    def done(self) -> None:
        pass

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.maps, self.view = [], None


_STORAGE_DEVICE = 6  # in torch.multiprocessing.reductions.rebuild_cuda_tensor's arguments
# The other arguments that are types, by name: a handle names one of these or is refused.
_TENSOR_TYPES = (("Tensor", torch.Tensor),)
_STORAGE_TYPES = (("TypedStorage", torch.storage.TypedStorage), ("UntypedStorage", torch.UntypedStorage))


def ipc_handle(tensor: torch.Tensor) -> list:
    """A CUDA tensor's IPC handle as plain values (torch's reduce_tensor's, less the function and
    the types, which are named): a receiver rebuilds it without unpickling anything a peer wrote."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    rebuild, args = reduce_tensor(tensor)
    if rebuild is not rebuild_cuda_tensor:
        raise SyncError(f"internal error: a CUDA IPC handle for {tensor.device} is rebuilt by {rebuild.__name__}")
    (tensor_cls, size, stride, offset, storage_cls, dtype, device, *rest) = args
    return [tensor_cls.__name__, list(size), list(stride), offset, storage_cls.__name__, str(dtype).split(".")[-1],
            device, *rest]


def ipc_arguments(handle: list) -> tuple:
    """:func:`ipc_handle`'s values as rebuild_cuda_tensor's arguments; SyncError if they name a
    type or dtype that is not a plain tensor's."""
    try:
        tensor_cls, size, stride, offset, storage_cls, dtype, device, *rest = handle
        types = (dict(_TENSOR_TYPES)[tensor_cls], dict(_STORAGE_TYPES)[storage_cls], getattr(torch, dtype))
        if not isinstance(types[2], torch.dtype) or len(rest) != 8:
            raise KeyError(dtype)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise SyncError(f"a CUDA IPC handle in the store is not one distload wrote ({exc!r})") from None
    return (types[0], torch.Size(size), tuple(stride), int(offset), types[1], types[2], int(device), *rest)


class _CudaMapping:
    kind = "cuda-ipc"

    def __init__(self, where: Mapping[str, Any], device: torch.device):
        self.device = device
        self.opened: dict[int, torch.Tensor] = {}
        # A handle names the trainer's GPU by its index in the trainer's process; this process
        # may number its GPUs otherwise (CUDA_VISIBLE_DEVICES): find that GPU here by its UUID.
        here = [i for i in range(torch.cuda.device_count())
                if str(torch.cuda.get_device_properties(i).uuid) == where["gpu"]]
        if not here:
            raise OSError(f"the trainer's GPU {where['gpu']} is not visible to this process (CUDA_VISIBLE_DEVICES)")
        self.index = here[0]
        hello = self._open(where["handle"])
        if bytes(hello.cpu().numpy()) != where["nonce"].encode():
            raise OSError("the CUDA IPC handle opened memory that does not hold the trainer's nonce")

    def _open(self, handle: list) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args = ipc_arguments(handle)
        args = args[:_STORAGE_DEVICE] + (self.index,) + args[_STORAGE_DEVICE + 1:]
        try:
            return rebuild_cuda_tensor(*args)
        except Exception as exc:  # noqa: BLE001 - named for the user
            raise SyncError(f"CUDA IPC: cannot open the trainer's GPU memory on {self.device} ({exc}); "
                            f"force the socket path ({TRANSPORT_ENV}=socket)") from None

    def read(self, where: tuple, nbytes: int) -> torch.Tensor:
        ident, handle, offset, sent = where
        if ident not in self.opened:
            self.opened[ident] = self._open(handle)
        memory = self.opened[ident]
        if sent != nbytes or offset + sent > memory.numel():
            raise SyncError(f"a message of {sent} bytes at {offset} where {nbytes} were expected (the two sides "
                            f"disagree on the update's layout)")
        return memory[offset:offset + nbytes]

    def done(self) -> None:
        # This process's reads (copies from the trainer's GPU, queued on a stream of either
        # device) have finished before the trainer may overwrite what they read.
        torch.cuda.synchronize()

    def close(self) -> None:
        self.opened = {}


# -- the pair's works -----------------------------------------------------------------------------

class _Work:
    """One message of a pair, as torch's Work: ``is_completed`` polls its key in the store."""

    def __init__(self, lane: "Lane", number: int):
        self.lane, self.number = lane, number
        self.ended = False
        self.failure: BaseException | None = None

    def exception(self) -> BaseException | None:
        return self.failure

    def _given_up(self) -> None:
        self.ended = True
        self.failure = SyncError(f"the session ended before message {self.number} of this pair moved")


class _Sent(_Work):
    def is_completed(self) -> bool:
        if not self.ended and self.lane.store.check([self.lane.key(self.number, "done")]):
            self.ended = True
        return self.ended

    def wait(self) -> bool:
        if self.failure is not None:
            raise self.failure
        return True


class _Received(_Work):
    """A message to receive: copied into ``into``, or (``into`` None) read where it lies, as
    ``data``, until :meth:`release`."""

    def __init__(self, lane: "Lane", number: int, into: torch.Tensor | None, nbytes: int):
        super().__init__(lane, number)
        self.into, self.nbytes = into, nbytes
        self.data: torch.Tensor | None = None
        self.posted = False

    def is_completed(self) -> bool:
        if not self.ended and not self.posted:
            self.posted = self.lane.store.check([self.lane.key(self.number)])
        return self.ended or self.posted

    def wait(self) -> bool:
        if self.failure is not None:
            raise self.failure
        if self.ended:
            return True
        lane = self.lane
        data = lane.mapping.read(rendezvous.get(lane.store, lane.key(self.number)), self.nbytes)
        if self.into is None:
            self.data = data
        else:
            flat_bytes(self.into).copy_(data)  # the channel's into tensors are contiguous
            self.release()
        self.ended = True
        return True

    def release(self) -> None:
        """The receiver is done with the message's bytes: the trainer may write there again."""
        self.lane.mapping.done()
        self.data = None
        self.lane.store.set(self.lane.key(self.number, "done"), b"1")


class Lane:
    """One same-host pair as one of its members sees it: the trainer's segment (trainer side) or
    its mapping (receiver side), and the count of messages so far (both sides count alike, as
    a process group's broadcasts match in order)."""

    def __init__(self, store: Any, trainer: int, receiver: int, segment: Any = None, mapping: Any = None):
        self.store, self.pair = store, f"h/{trainer}-{receiver}"
        self.segment, self.mapping = segment, mapping
        self.kind = (segment if segment is not None else mapping).kind
        self.count = 0
        self.works: list[_Work] = []

    def key(self, number: int, what: str = "at") -> str:
        return f"{self.pair}/{number}/{what}"

    def post(self, tensor: torch.Tensor | None, nbytes: int | None = None) -> _Work:
        """Trainer: send ``tensor`` (it must lie in the segment: written there already). Receiver:
        receive ``nbytes`` into ``tensor``, or where they lie when ``tensor`` is None."""
        number, self.count = self.count, self.count + 1
        if self.segment is not None:
            self.segment.ready(tensor)
            rendezvous.put(self.store, self.key(number), self.segment.locate(tensor))
            work: _Work = _Sent(self, number)
        else:
            size = nbytes if tensor is None else tensor.numel() * tensor.element_size()
            work = _Received(self, number, tensor, size)
        self.works = [w for w in self.works if not w.ended] + [work]
        return work

    def close(self) -> None:
        """The session ended: every message not moved never will (nothing of it lands after)."""
        for work in self.works:
            if not work.ended:
                work._given_up()
        self.works = []
        if self.mapping is not None:
            self.mapping.close()


# -- forming: which pairs hand off -------------------------------------------------------------------

def form(store: Any, record: Any, me: int, peers: range, backend: str, device: torch.device, deadline: float,
         who: Any) -> tuple[dict[int, Lane], Any]:
    """This member's lanes (peer -> Lane) for the same-host peers that confirmed they map its
    segment (a trainer's) or that it maps theirs (a receiver's), and the trainer's segment (None
    otherwise). Every other pair keeps the socket path. ``who(rank)`` names a member."""
    infos = [record.infos[rendezvous.member_key(*record.member(r))] for r in range(record.world_size)]
    host = infos[me].get("host")
    same = [p for p in peers if host is not None and infos[p].get("host") == host]
    if not same:
        return {}, None
    kind = kind_for(backend)
    trainer = me < record.trainer_size
    if trainer:
        return _offer(store, me, same, kind, device, deadline, who)
    return _accept(store, me, same, kind, device, deadline, who), None


def _wait_key(store: Any, key: str, deadline: float, what: str) -> Any:
    backoff = rendezvous.Backoff()
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise SyncError(f"{what} did not answer the same-host handoff within the session's timeout")
        backoff.pause()
    return rendezvous.get(store, key)


def _offer(store: Any, me: int, same: list[int], kind: str, device: torch.device, deadline: float,
           who: Any) -> tuple[dict[int, Lane], Any]:
    segment = None
    try:
        segment = _HostSegment(f"{me}") if kind == "shm" else _CudaSegment(device)
        rendezvous.put(store, f"h/{me}", segment.where())
    except (OSError, SyncError, RuntimeError) as exc:
        log.debug("%s: no %s segment for same-host receivers (%s): they take the socket path", who(me), kind, exc)
        rendezvous.put(store, f"h/{me}", {"kind": kind, "why": str(exc)})
        if segment is not None:
            segment.close()
        return {}, None
    lanes = {}
    try:
        for peer in same:
            answer = _wait_key(store, f"h/{me}-{peer}", deadline, who(peer))
            if answer == "ok":
                lanes[peer] = Lane(store, me, peer, segment=segment)
            else:
                log.debug("%s and %s share a host but take the socket path: %s", who(me), who(peer), answer)
    except BaseException:
        segment.close()
        raise
    finally:
        # Every receiver that maps it has it open: from here on nothing is left in /dev/shm
        # whichever process dies.
        segment.unlink()
    if not lanes:
        segment.close()
        return {}, None
    return lanes, segment


def _accept(store: Any, me: int, same: list[int], kind: str, device: torch.device, deadline: float,
            who: Any) -> dict[int, Lane]:
    lanes = {}
    try:
        for peer in same:
            where = _wait_key(store, f"h/{peer}", deadline, who(peer))
            answer = where.get("why") or _map(where, kind, device, lanes, store, peer, me)
            rendezvous.put(store, f"h/{peer}-{me}", answer)
            if answer != "ok":
                log.debug("%s and %s share a host but take the socket path: %s", who(me), who(peer), answer)
    except BaseException:
        for lane in lanes.values():
            lane.close()
        raise
    return lanes


def _map(where: Mapping[str, Any], kind: str, device: torch.device, lanes: dict[int, Lane], store: Any,
         peer: int, me: int) -> str:
    """Map ``peer``'s segment into ``lanes``; "ok", or why not (this pair then takes the socket)."""
    if where.get("kind") != kind:
        return f"the trainer offers a {where.get('kind')} segment, this rank's buffers need {kind}"
    try:
        mapping = _HostMapping(where) if kind == "shm" else _CudaMapping(where, device)
    except (OSError, SyncError, RuntimeError, ValueError) as exc:
        if kind == "cuda-ipc":  # the same host and GPUs on both sides: this should not fail
            log.warning("CUDA IPC between %s and this rank failed, the pair takes the socket path: %s", peer, exc)
        return f"cannot map the trainer's segment ({exc})"
    lanes[peer] = Lane(store, peer, me, mapping=mapping)
    return "ok"
