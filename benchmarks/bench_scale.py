"""distload at the scale users run (issue 36): 8 ... 4,096 ranks, in one process, by simulation.

    python benchmarks/bench_scale.py --ranks 1024 --json benchmarks/results/scale.json

What is **measured by running distload's own code** here (one process, one CPU):

- planning: the headers dealt to a rank parsed (``index.parse_header``: each rank reads and parses
  its share, ``loading.headers``) and every share unpickled, the sharding rules (``distload.loading.rank_slices.plan_slices``: a
  rank's TP slices of a checkpoint's index), the load's agreement payload
  (``agreement.read_facts``, the digests), the distinct needs unpickled and laid out per tensor
  (``stream.member_needs``) and the job-wide exchange plan (``shared_reads.plan.ExchangePlan``)
  of a shared read, for every rank count; the sync's bucket grouping and per-place layouts
  (``live.transfer.group_entries``, ``layouts``);
- the old load design: the exchange plan as ``main`` had it before (its module, loaded from git at BEFORE),
  at small N only (it grows as N; larger N are that line extended, and say so);
- the sync channel's store protocol as the code runs it: ``rendezvous.post_hello``,
  ``form_session`` and ``await_session``; then one update's steps, each member's calls in the
  order it makes them (``verdicts.post_route`` / ``read_route`` / ``post_verdict`` /
  ``await_verdict``, ``Session.put`` / ``collect`` / ``announce`` / ``await_posted``), against
  an in-process store that counts keys, bytes and round trips (``CountingStore``), with the real
  metadata (compressed as ``rendezvous.put`` stores it). Ranks at one place read the same keys:
  the first reads them through ``read_route``, the others read the same keys' bytes (counted
  alike) without unpickling them again. Main's protocol before (every member reading every
  member's answers) is replayed call for call as its ``Session`` made them;
- the pairs of the code: each trainer rank's receivers (``pairing.receivers``) and each inference
  rank's senders (the leader's route), which must agree, give the pairs and connections "now";
- the per-message cost of a gloo point-to-point message between two processes on this machine.

What is **modelled** (from reading the code; no process per rank):

- the pairs' store traffic (torch's gloo rendezvous: one address posted and one read per member
  and pair), the heartbeats (main: every member read every other member's counter every
  INTERVAL_S while data moves; now the leader every member's, the others the leader's and their
  peers'), threads per process (2 per gloo pair);
- the exchanges of the load's planning, agreement and rounds (``WorkerGroup.exchange``: Bruck's
  all-gather, ceil(log2 N) steps of one message, two where items pass INLINE_BYTES), and the old
  design's all-gathers (torch's ring: 2 (N - 1) messages);
- the transport: per-link bandwidth and the measured per-message cost, replaying the sends the
  plans make (each exchange-plan bucket's reader to each member that keeps some of it; each
  trainer rank's bucket layouts to each inference rank), against the link-bandwidth bound (the
  bytes a rank must move at least, over its link);
- the rest of the sync redesign (expert parallelism on the inference side, relays in chains for
  what every replica keeps, so that a trainer rank sends to one replica): not in the code; its
  column is the model's (its store traffic runs the code's protocol with the model's pairs).
  The bytes each trainer rank sends each place are its layouts' sizes (``KeptSizes``: each
  tensor's kept bytes computed once per name pattern and shape, checked against the real
  ``layouts`` of the 16 ranks whose planning is timed).

Shapes: a Llama-70B-like dense model (80 layers, hidden 8192, GQA 64/8 heads, bf16) and a
1T-parameter MoE like Kimi-K2 (61 layers, 60 of them with 256 experts of intermediate 3072, hidden
7168, bf16: 2.06 TB). Inference and load layout: replicas of 32 ranks (4 nodes), attention and
dense layers TP 8 (replicated 4 times in a replica), experts spread over the replica's 32 ranks
(EP 32: rank r keeps the experts e with e % 32 == r % 32 whole, 8 of each layer).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import pickle
import platform
import re
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from distload.live import pairing, rendezvous, verdicts  # noqa: E402
from distload.live.channel import DEFAULT_BUCKET_BYTES  # noqa: E402
from distload.live.rendezvous import SessionRecord  # noqa: E402
from distload.live.session import Session  # noqa: E402
from distload.live.transfer import SyncTensor, group_entries, kept_slice, layouts  # noqa: E402
from distload.loading.buckets import ALIGN, offsets, run_bytes  # noqa: E402
from distload.loading.agreement import read_facts  # noqa: E402
from distload.loading.choice import ReadChoice  # noqa: E402
from distload.loading.index import CheckpointIndex, FileInfo, TensorInfo, parse_header  # noqa: E402
from distload.loading.headers import dealt  # noqa: E402
from distload.loading.sources import HEADER_READ_THREADS  # noqa: E402
from distload.loading.shared_reads.stream import member_needs  # noqa: E402
from distload.workers.group import INLINE_BYTES, bruck_distances  # noqa: E402
from distload.loading.plan import RankPlan  # noqa: E402
from distload.loading.rank_slices import plan_slices  # noqa: E402
from distload.loading.shared_reads.plan import BUCKET_BYTES, ExchangePlan, whole_need  # noqa: E402
from distload.tp.place import TPPlace  # noqa: E402
from distload.tp.spec import BUILTIN_SPECS, Rule, ShardingSpec  # noqa: E402
from distload.workers.heartbeat import INTERVAL_S  # noqa: E402

GB = 1e9
TP = 8
EP_SIZE = 4  # the code's expert parallelism at TP 8: 32 ranks, each EP group's 8 ranks TP-slice its 64 experts
EP = 32  # an inference replica (and a load's rank class): 32 ranks, experts e % EP each, TP 8 for the rest
# The model's links and store (assumed; say so in the results): one 400 Gb/s NIC per GPU, an object
# store serving each 8-GPU node at 10 GB/s with 30 ms a request.
LINK_BYTES_S = 50 * GB
LINK_LATENCY_S = 5e-6
STORE_BYTES_S_PER_RANK = 10 * GB / 8
STORE_REQUEST_S = 0.030
FILE_BYTES = 5 * 1024**3  # checkpoint files of about 5 GiB, as Hugging Face saves them
HEADER_BYTES_PER_TENSOR = 180  # a safetensors header's JSON per tensor (name, dtype, shape, offsets)
RELAY_BYTES = 64 * 1024**2  # the redesign's relay chunk
GLOO_THREADS_PER_GROUP = 2  # ProcessGroupGloo's default worker threads (Options.threads)


# -- shapes ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Model:
    name: str
    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    config: dict
    experts: int  # 0: dense

    @property
    def nbytes(self) -> int:
        return sum(2 * math.prod(shape) for _, shape in self.tensors)


def _attention(prefix: str, hidden: int, heads: int, kv: int, head_dim: int) -> list:
    return [(f"{prefix}.self_attn.q_proj.weight", (heads * head_dim, hidden)),
            (f"{prefix}.self_attn.k_proj.weight", (kv * head_dim, hidden)),
            (f"{prefix}.self_attn.v_proj.weight", (kv * head_dim, hidden)),
            (f"{prefix}.self_attn.o_proj.weight", (hidden, heads * head_dim)),
            (f"{prefix}.input_layernorm.weight", (hidden,)),
            (f"{prefix}.post_attention_layernorm.weight", (hidden,))]


def _mlp(prefix: str, hidden: int, inter: int) -> list:
    return [(f"{prefix}.gate_proj.weight", (inter, hidden)), (f"{prefix}.up_proj.weight", (inter, hidden)),
            (f"{prefix}.down_proj.weight", (hidden, inter))]


def llama70b() -> Model:
    hidden, vocab = 8192, 128256
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for layer in range(80):
        out += _attention(f"model.layers.{layer}", hidden, 64, 8, 128) + _mlp(f"model.layers.{layer}.mlp", hidden, 28672)
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return Model("Llama-70B-like", tuple(out), {"num_attention_heads": 64, "num_key_value_heads": 8,
                                                "head_dim": 128, "hidden_size": hidden}, 0)


def moe1t(experts: int = 256) -> Model:
    hidden, vocab = 7168, 163840
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for layer in range(61):
        p = f"model.layers.{layer}"
        out += _attention(p, hidden, 64, 8, 128)
        if layer == 0:
            out += _mlp(f"{p}.mlp", hidden, 18432)
            continue
        out += [(f"{p}.mlp.gate.weight", (experts, hidden))] + _mlp(f"{p}.mlp.shared_experts", hidden, 3072)
        for e in range(experts):
            out += _mlp(f"{p}.mlp.experts.{e}", hidden, 3072)
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return Model("1T MoE, Kimi-K2-like", tuple(out), {"num_attention_heads": 64, "num_key_value_heads": 8,
                                                       "head_dim": 128, "hidden_size": hidden}, experts)


def expert_of(name: str) -> int | None:
    if ".experts." not in name:
        return None
    return int(name.split(".experts.")[1].split(".")[0])


def spec_for(model: Model) -> ShardingSpec:
    """The decoder rules; with experts, those kept whole (expert parallelism places them)."""
    rules = BUILTIN_SPECS["decoder"]
    if model.experts:
        rules = (Rule("*.mlp.experts.*", None), Rule("*.mlp.gate.weight", None)) + rules
    return ShardingSpec("decoder" + ("+ep" if model.experts else ""), rules, dict(model.config))


def checkpoint_index(model: Model) -> CheckpointIndex:
    """The model as a whole checkpoint on an object store: files of about FILE_BYTES."""
    files, tensors, offset, number = [], [], 0, 0

    def close() -> None:
        nonlocal tensors, offset, number
        if tensors:
            files.append(FileInfo(f"s3://models/{model.name}/model-{number:05d}.safetensors", offset, tuple(tensors),
                                  None, version=f"etag-{number}"))
            tensors, offset, number = [], 0, number + 1

    for name, shape in model.tensors:
        nbytes = 2 * math.prod(shape)
        if offset and offset + nbytes > FILE_BYTES:
            close()
        tensors.append(TensorInfo(name, "BF16", shape, f"model-{number:05d}", offset, offset + nbytes))
        offset += nbytes
    close()
    return CheckpointIndex(tuple(files))


# -- timing ----------------------------------------------------------------------------------------

def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def ring_allgather_s(n: int, item_bytes: float, message_s: float) -> float:
    """gloo's all-gather of n items (all_gather_object: sizes, then the items): a ring, n - 1 steps
    each, every rank receiving the n - 1 others' items."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * message_s + (n - 1) * item_bytes / LINK_BYTES_S


def moving_s(nbytes: float, messages: int, message_s: float) -> float:
    """A rank moving ``nbytes`` in ``messages`` over its link: the channel keeps two buckets in
    flight and a shared read reads two rounds ahead, so each message's own cost overlaps the wire
    time of another; the slower of the two, plus one message's cost to start."""
    return max(nbytes / LINK_BYTES_S, messages * message_s) + message_s


def measure_message_s(count: int = 300) -> float:
    """One small gloo message between two processes on this machine, one way (half a round trip)."""
    code = r"""
import os, sys, time, torch, torch.distributed as dist
rank = int(sys.argv[1]); dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank, world_size=2)
t = torch.zeros(16, dtype=torch.uint8); n = int(sys.argv[3])
for i in range(20 + n):
    if i == 20: start = time.perf_counter()
    if rank == 0: dist.send(t, 1); dist.recv(t, 1)
    else: dist.recv(t, 0); dist.send(t, 0)
if rank == 0: print((time.perf_counter() - start) / n / 2)
dist.destroy_process_group()
"""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), port, str(count)], stdout=subprocess.PIPE,
                              text=True, env=env) for r in range(2)]
    out = procs[0].communicate(timeout=120)[0]
    procs[1].wait(timeout=120)
    return float(out.strip().splitlines()[-1])


# -- the load --------------------------------------------------------------------------------------

CHOICE = ReadChoice(sharded=False, backend="ranged", shared=True, scope="job")


class LoadSetup:
    """One model's checkpoint, and each distinct rank class's plan (class c = rank % EP keeps TP
    rank c % TP's slices and the experts e with e % EP == c; a dense model: c = rank % TP): the
    real plan_slices and RankPlan.slice_runs per class."""

    def __init__(self, model: Model):
        self.model = model
        self.index = checkpoint_index(model)
        self.infos = self.index.tensors
        self.sizes = [t.nbytes for t in self.infos]
        spec = spec_for(model)
        self.plans, self.runs, self.slice_s = [], [], []
        self.count = EP if model.experts else TP
        by_slot: dict[int, tuple[RankPlan, dict]] = {}
        for c in range(self.count):
            slot = c % TP
            if slot not in by_slot:  # a class's rank plans its slot's slices once (the same for its EP peers)
                (by_slot[slot]), seconds = timed(lambda slot=slot: self._plan(spec, slot))
                self.slice_s.append(seconds)
            plan, runs = by_slot[slot]
            self.plans.append(plan)
            self.runs.append(self._experts(dict(runs), c))
        self.needs = [[runs.get(i, whole_need(info.nbytes)) for i, info in enumerate(self.infos)] for runs in self.runs]
        self.raw_headers = [raw_header(f) for f in self.index.files]
        self.shares = pickle.dumps(self.index.files)  # every rank's share of the headers, as exchanged

    def _plan(self, spec: ShardingSpec, slot: int) -> tuple[RankPlan, dict]:
        place = TPPlace(TP, slot, spec)
        plan = RankPlan("s3://models/x", CHOICE, self.index, tensor_parallel=place,
                        slices=plan_slices(self.index, place, lambda: self.model.config))
        return plan, plan.slice_runs()

    def _experts(self, runs: dict, c: int) -> dict:
        """Expert parallelism: the experts of the other classes are not kept (an empty need)."""
        if self.model.experts:
            for i, info in enumerate(self.infos):
                e = expert_of(info.name)
                if e is not None and e % EP != c:
                    runs[i] = ()
        return runs


def raw_header(info: FileInfo) -> bytes:
    """A file's header as the store holds it (a safetensors header's JSON, as safetensors writes
    it): what a rank reads and parses."""
    header = {t.name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.begin, t.end]} for t in info.tensors}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def exchange_s(n: int, item_bytes: float, message_s: float) -> float:
    """``WorkerGroup.exchange`` of n items of ``item_bytes``: Bruck's all-gather, one message a
    step (two where items pass INLINE_BYTES), every rank receiving the n - 1 others' items."""
    messages = sum(1 + (item_bytes > INLINE_BYTES) for _ in bruck_distances(n))
    return messages * message_s + (n - 1) * item_bytes / LINK_BYTES_S


BEFORE = "bcd7d01"  # the last commit before the load's redesign (issue 36)


def old_exchange_plan() -> Any:
    """ExchangePlan as main had it before the redesign (its module, from git at BEFORE)."""
    text = subprocess.run(["git", "-C", os.path.dirname(HERE), "show", f"{BEFORE}:distload/loading/shared_reads/plan.py"],
                          capture_output=True, text=True, check=True).stdout
    spec = importlib.util.spec_from_loader("distload_main_exchange_plan", loader=None)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]  (dataclasses look their module up)
    exec(compile(text, f"{BEFORE}:distload/loading/shared_reads/plan.py", "exec"), module.__dict__)
    return module.ExchangePlan


def load_at(setup: LoadSetup, n: int, message_s: float, old: Any | None) -> dict:
    """A job of n ranks loading the whole checkpoint, shared job-wide (each byte from the store once)."""
    count = min(n, setup.count)
    classes = [r % setup.count for r in range(n)]
    t0 = classes[0]
    plan0 = setup.plans[t0]
    facts, digest_s = timed(lambda: read_facts(CHOICE, plan0.signature(), plan0.share_key(), "node-0", setup.runs[t0]))
    facts_bytes = len(pickle.dumps(facts))
    # Every TP slot's rank does the same work: the median of the slots' times, against the noise
    # of a shared machine.
    slice_s = statistics.median(setup.slice_s)
    pickled_runs = [pickle.dumps(runs) for runs in setup.runs[:count]]
    runs_bytes = [len(p) for p in pickled_runs]
    # The old agreement: every rank's file list and slices (by tensor name), to every rank.
    by_name = {setup.infos[i].name: r for i, r in setup.runs[t0].items()}
    old_payload = pickle.dumps((CHOICE, plan0.signature(), plan0.share_key(), "node-0", by_name))
    old_item = len(old_payload)
    # An exchange unpickles every item it receives: measured here, one item of each kind.
    _, old_unpickle_s = timed(lambda: pickle.loads(old_payload))
    facts_pickled = pickle.dumps(facts)
    _, facts_unpickle_s = timed(lambda: pickle.loads(facts_pickled))
    received, runs_unpickle_s = timed(lambda: [pickle.loads(p) for p in pickled_runs])
    # The headers: each rank reads and parses those dealt to it (headers.dealt), and unpickles
    # every rank's share from the exchange.
    paths = [f.path for f in setup.index.files]
    header_bytes = [len(head) for head in setup.raw_headers]
    mine = max(len(dealt(paths, r, n)) for r in range(min(n, len(paths))))
    own = [i for i, p in enumerate(paths) if p in set(dealt(paths, 0, n))]
    _, parse_s = timed(lambda: [parse_header(paths[i], setup.raw_headers[i], len(setup.raw_headers[i]) + setup.index.files[i].size)
                                for i in own])
    _, shares_s = timed(lambda: pickle.loads(setup.shares))
    parse_s += shares_s
    header_read_s = math.ceil(mine / HEADER_READ_THREADS) * STORE_REQUEST_S + mine * max(header_bytes) / STORE_BYTES_S_PER_RANK
    # The shared read's planning on a member: its agreement's needs (by class, as the agreement
    # hands them) per tensor, then the exchange plan.
    request = SimpleNamespace(options_as=lambda _: SimpleNamespace(needs=tuple(received[c] for c in classes)))
    (needs, member_classes), needs_s = timed(lambda: member_needs(request, setup.infos))
    exchange, plan_s = timed(lambda: ExchangePlan(setup.sizes, needs, BUCKET_BYTES, member_classes))
    # What each rank reads, sends and receives: the plan's own sends, replayed.
    k = n
    # The bytes each class keeps of each bucket (the plan's own count: class c is distinct need c).
    assert member_classes[:count] == list(range(count))
    keeps = [exchange.kept_bytes(b) for b in range(len(exchange.buckets))]
    members_of = [classes.count(c) for c in range(count)]
    read = [0] * n
    sent = [0] * n
    messages = [0] * n
    received = [0] * n
    peers: list[set] = [set() for _ in range(min(n, 64))]  # connections, for the first ranks
    for b, reader in enumerate(exchange.readers):
        read[reader] += exchange.read_bytes(b)
        for c, kept in enumerate(keeps[b]):
            if not kept:
                continue
            others = members_of[c] - (1 if classes[reader] == c else 0)
            sent[reader] += kept * others
            messages[reader] += others
            for m in range(c, n, setup.count):
                if m != reader:
                    received[m] += kept
                    if m < len(peers):
                        peers[m].add(reader)
                    if reader < len(peers):
                        peers[reader].add(m)
    rounds = math.ceil(len(exchange.buckets) / k)
    kept_bytes = [sum(run_bytes(n_) for n_ in setup.needs[c]) for c in range(count)]
    headers = sum(header_bytes)
    # The exchanges of planning and agreement (loader.Loader.plan, agreement.agree_on_read,
    # stream.shared_stream): the headers' shares, planning's verdicts, the digests, the distinct
    # needs, the shared read's plan digests.
    exchanges_s = (exchange_s(n, len(setup.shares) / n, message_s) + exchange_s(n, 16, message_s)
                   + exchange_s(n, facts_bytes, message_s) + exchange_s(n, sum(runs_bytes) / n, message_s)
                   + exchange_s(n, 100, message_s))
    agreement_s = exchanges_s + (n - 1) * facts_unpickle_s + runs_unpickle_s
    planning_s = parse_s + slice_s + digest_s + needs_s + plan_s
    old_agreement_s = ring_allgather_s(n, old_item, message_s) + (n - 1) * old_unpickle_s
    round_s = exchange_s(n, 64, message_s)  # each round's "fine?" exchange
    data_s = max(max(r / STORE_BYTES_S_PER_RANK, moving_s(sent[i], messages[i], message_s),
                     received[i] / LINK_BYTES_S) for i, r in enumerate(read))
    bound_s = max(exchange.union_bytes / n / STORE_BYTES_S_PER_RANK, max(kept_bytes) / LINK_BYTES_S)
    out = {
        "ranks": n, "checkpoint_bytes": setup.model.nbytes, "tensors": len(setup.infos), "files": len(setup.index.files),
        "buckets": len(exchange.buckets), "bucket_bytes": exchange.bucket_bytes, "rounds": rounds,
        "headers_s": parse_s, "plan_slices_s": slice_s, "digest_s": digest_s,
        "member_needs_s": needs_s, "exchange_plan_s": plan_s,
        "planning_s_per_rank": planning_s,
        "agreement_bytes_per_rank": (n - 1) * facts_bytes + sum(runs_bytes),
        "old_agreement_bytes_per_rank": (n - 1) * old_item,
        "header_read_s_model": header_read_s, "exchanges_s_model": exchanges_s,
        "agreement_s_model": agreement_s, "old_agreement_s_model": old_agreement_s,
        "plan_and_agreement_s": header_read_s + planning_s + agreement_s,
        "old_plan_and_agreement_s_at_least": slice_s + old_agreement_s,
        "store_data_bytes": sum(read), "store_data_bytes_once": sum(read) == exchange.union_bytes,
        "store_header_bytes": headers, "store_header_reads": sum(len(dealt(paths, r, n)) for r in range(n)),
        "old_store_header_bytes": headers * n, "store_requests": len(exchange.buckets) + len(setup.index.files),
        "max_bytes_sent_per_rank": max(sent), "max_bytes_received_per_rank": max(received),
        "connections_per_process": max(len(p) for p in peers), "rounds_exchange_s_model": rounds * round_s,
        "load_s_model": header_read_s + planning_s + agreement_s + data_s + rounds * round_s, "load_bound_s": bound_s,
    }
    if old is not None:
        per_member = [setup.needs[c] for c in classes]
        _, out["old_exchange_plan_s"] = timed(lambda: old(setup.sizes, per_member, BUCKET_BYTES))
        out["old_planning_s_per_rank"] = slice_s + out["old_exchange_plan_s"]
    return out


# -- the sync --------------------------------------------------------------------------------------

class CountingStore:
    """An in-process store (the calls distload's BoundedStore offers) that counts what crosses it:
    every call one round trip, the bytes of keys and values both ways."""

    def __init__(self, prefix: str = "", data: dict | None = None, counts: dict | None = None):
        self.prefix = prefix
        self.data: dict[str, bytes] = {} if data is None else data
        self.counts = {"round_trips": 0, "bytes": 0, "keys": 0} if counts is None else counts

    def _count(self, keys: Sequence[str], value: bytes = b"") -> None:
        self.counts["round_trips"] += 1
        self.counts["bytes"] += sum(len(self.prefix) + len(k) for k in keys) + len(value)

    def prefixed(self, prefix: str) -> "CountingStore":
        return CountingStore(self.prefix + prefix, self.data, self.counts)

    def set(self, key: str, value: bytes) -> None:
        self._count([key], value)
        if self.prefix + key not in self.data:
            self.counts["keys"] += 1
        self.data[self.prefix + key] = value

    def get(self, key: str) -> bytes:
        value = self.data[self.prefix + key]
        self._count([key], value)
        return value

    def check(self, keys: list[str]) -> bool:
        self._count(keys)
        return all(self.prefix + k in self.data for k in keys)

    def add(self, key: str, amount: int) -> int:
        self._count([key], b"12345678")
        value = int(self.data.get(self.prefix + key, b"0")) + amount
        self.data[self.prefix + key] = str(value).encode()
        return value


def sync_entries(model: Model, trainers: int) -> list[list[SyncTensor]]:
    """Each trainer rank's tensors: experts by expert parallelism (expert e to rank e % trainers),
    the rest whole, spread in turn (the disjoint names each trainer rank sends)."""
    out: list[list[SyncTensor]] = [[] for _ in range(trainers)]
    turn = 0
    for name, shape in model.tensors:
        e = expert_of(name)
        if e is None:
            owner, turn = turn % trainers, turn + 1
        else:
            owner = e % trainers
        out[owner].append(SyncTensor(name, "BF16", shape, 2 * math.prod(shape)))
    return out


def hello_infos(model: Model) -> dict[tuple[str, int], dict]:
    """What each member posts in its hello, as SyncChannel._info() makes it: an inference rank its
    TP size and its sharding spec's JSON (decoder rules, sized by the model's config)."""
    spec = ShardingSpec("decoder", BUILTIN_SPECS["decoder"], dict(model.config)).to_json()

    def info(role: str, rank: int) -> dict:
        return {"tp_size": TP if role == "inference" else 1, "spec": spec if role == "inference" else None,
                "device": "cuda", "gpu": f"GPU-{role}-{rank:04d}-0000-0000-000000000000", "verify": True,
                "pid": 100000 + rank, "cuts": False, "host": f"node-{role}-{rank // 8:03d}"}
    return {(role, rank): info(role, rank) for role in ("trainer", "inference") for rank in range(4096)}


def _form(infos: dict, trainers: int, inference: int) -> tuple[CountingStore, SessionRecord, dict]:
    """A session formed on the real rendezvous code (hellos, the leader's record, every member's
    wait for it), against a counting store."""
    root = CountingStore()
    hellos = {}
    for role, size in (("trainer", trainers), ("inference", inference)):
        for rank in range(size):
            if (role, rank) != ("trainer", 0):
                hellos[(role, rank)] = rendezvous.post_hello(root, role, rank, size, infos[(role, rank)])
    leader_nonce = rendezvous.post_hello(root, "trainer", 0, trainers, infos[("trainer", 0)])
    record = rendezvous.form_session(root, trainers, rendezvous.Hello(leader_nonce, trainers, infos[("trainer", 0)]),
                                     time.monotonic() + 60, "x")
    for (role, rank), nonce in hellos.items():
        rendezvous.await_session(root, role, rank, nonce, time.monotonic() + 60, "x")
    return root, record, dict(root.counts)


def _sessions(root: CountingStore, record: SessionRecord) -> list[Session]:
    store = root.prefixed(f"s/{record.id}/")
    return [Session(record, store, {}, "gloo", me, None, None, "x", 60.0, lambda role, rank: f"{role} {rank}")  # type: ignore[arg-type]
            for me in range(record.world_size)]


def store_before(metas: list[dict], trainers: int, inference: int, infos: dict) -> dict:
    """main's protocol before this redesign, replayed call for call as main's Session made them:
    every member reads every trainer rank's metadata (pickled, uncompressed, as main stored it) and
    every member's answers; its pairs and heartbeats by the model. The values are read, not
    unpickled (the counts are the same; 1.6 GB of unpickling at 256 -> 128 is minutes here)."""
    root, record, joined = _form(infos, trainers, inference)
    sessions = _sessions(root, record)
    world = trainers + inference
    for me in range(trainers):
        sessions[me].store.set(sessions[me].key("meta", me), pickle.dumps(metas[me]))
    for s in sessions:
        s.put("ready", [])
    before = dict(root.counts)

    def collect(s: Session, what: str, ranks: Sequence[int]) -> None:  # main's Session.collect
        keys = [s.key(what, r) for r in ranks]
        s.store.check(keys)
        for k in keys:
            s.store.get(k)
    for s in sessions:  # trainer ranks and inference ranks alike read every trainer rank's metadata
        collect(s, "meta", range(trainers))
    for s in sessions:
        collect(s, "ready", range(world))
    for s in sessions:
        s.put("done", None)
    for s in sessions:
        collect(s, "done", range(world))
    for s in sessions[1:]:
        s.put("seen", None)
    sessions[0].store.check([sessions[0].key("seen", r) for r in range(1, world)])
    update = {k: root.counts[k] - before[k] for k in before}
    return {"join_round_trips": joined["round_trips"], "join_bytes": joined["bytes"],
            "update_round_trips": update["round_trips"], "update_bytes": update["bytes"],
            "meta_bytes": sum(len(pickle.dumps(m)) for m in metas)}


def _metadata(metas: list[dict], trainers: int, inference: int, infos: dict) -> tuple:
    """A session formed, then an update's first step: every trainer rank posts its metadata and
    the leader posts the route (verdicts.post_route). Returns what the steps after it need, and the
    counts before the update."""
    root, record, joined = _form(infos, trainers, inference)
    sessions = _sessions(root, record)
    deadline = time.monotonic() + 60
    before = dict(root.counts)
    for t in range(trainers):
        sessions[t].put("meta", metas[t])
    by_trainer = verdicts.post_route(sessions[0], metas[0], 1, deadline)
    return root, record, joined, sessions, deadline, before, by_trainer


def store_now(metas: list[dict], trainers: int, inference: int, infos: dict) -> dict:
    """The channel's protocol as the code runs it (distload/live/verdicts.py, session.py), each
    member's calls in the order it makes them, against a counting store; and each member's peers
    as the real pairing decides them (pairing.receivers, the leader's route)."""
    root, record, joined, sessions, deadline, before, by_trainer = _metadata(metas, trainers, inference, infos)
    leader = sessions[0]
    posted = rendezvous.get(leader.store, leader.key("route"))
    if not any(record.infos[rendezvous.member_key("inference", i)].get("experts") for i in range(inference)):
        # Every place has the same senders here (each keeps a slice of every tensor): one key, metas/0.
        assert set(posted["places"].values()) == {0}
    senders: dict[int, list[int]] = {}
    by_place: dict[str, list[int]] = {}
    for i in range(inference):
        s = sessions[trainers + i]
        s.store.check([s.key("route")])  # its wait for the route: the look that finds it
        place = pairing.place_key(record.infos[rendezvous.member_key("inference", i)], i)
        if place not in by_place:
            _, mine = verdicts.read_route(s, i, every=False)
            by_place[place] = sorted(mine)
        else:
            # The ranks at one place read the same keys (the route, the same senders' metadata):
            # read here as bytes, counted alike, not unpickled again (minutes at 256 -> 128).
            for key in [s.key("route"), s.key(f"metas/{posted['places'][place]}")]:  # its place's senders
                s.store.get(key)
        senders[trainers + i] = by_place[place]
        s.put("ready", verdicts.ready([], []))  # a first update: nobody takes a delta
    takes = verdicts.post_verdict(leader, by_trainer, 1, deadline).takes
    for s in sessions[1:]:
        verdicts.await_verdict(s, deadline)
    _finish(sessions, deadline)
    update = {k: root.counts[k] - before[k] for k in before}
    peers = _code_peers(record, metas, senders, takes)
    # After one receiver per place restarted: the others can take a delta from every trainer rank,
    # it cannot, and the leader's verdict has its whole chain take every byte (chained_takes). A
    # session keeps the pairs it made, so a member may hold both updates' pairs.
    first = {ranks[0] for _, ranks in pairing.places(record).values()}
    restarted = {r: list(senders[r]) for r in senders if r not in first}
    mixed = _code_peers(record, metas, senders, pairing.chained_takes(record, restarted))
    return {"join_round_trips": joined["round_trips"], "join_bytes": joined["bytes"],
            "update_round_trips": update["round_trips"], "update_bytes": update["bytes"],
            "meta_bytes": sum(len(pickle.dumps(m)) for m in metas), "record_bytes": len(pickle.dumps(record)),
            "peers": {m: sorted(p) for m, p in peers.items()},
            "peers_with_a_restart": {m: sorted(p | mixed[m]) for m, p in peers.items()}}


def _code_peers(record: SessionRecord, metas: list[dict], senders: dict[int, list[int]],
                takes: Mapping[int, Sequence[int]]) -> dict[int, set[int]]:
    """The pairs of an update, as each side decides them in the code (channel.py), for the
    verdict's ``takes``: a trainer rank's routes (the receivers it carries bytes for, by place and
    kind of update) reached directly or through their relay chains' heads; an inference rank's
    sources and onward members, per sender (pairing.links). Checks that both sides agree."""
    trainers = record.trainer_size
    where = pairing.places(record)
    peers: dict[int, set[int]] = {}
    for t in range(trainers):
        routes: dict[tuple, list[int]] = {}
        for r in pairing.receivers(metas[t]["entries"], record):
            place = pairing.place_key(record.infos[rendezvous.member_key("inference", r - trainers)], r - trainers)
            routes.setdefault((place, t in takes.get(r, ())), []).append(r)
        peers[t] = set()
        for members in routes.values():
            direct, chains = pairing.relay(record, t, members)
            peers[t] |= set(direct + [chain[0] for chain in chains])
    heads: dict[int, set[int]] = {}  # inference rank -> the senders it takes from the trainer itself
    for r, its in senders.items():
        peers[r] = set()
        for t in its:
            source, onward = pairing.links(record, r, t, takes, where)
            peers[r] |= {source} | ({onward} if onward is not None else set())
            if source == t:
                heads.setdefault(r, set()).add(t)
    # Both sides must agree on every trainer-receiver pair, or a connect would wait for good.
    assert {(t, r) for t in range(trainers) for r in peers[t]} == {(t, r) for r, ts in heads.items() for t in ts}
    return peers


def _finish(sessions: list[Session], deadline: float) -> None:
    """Session.finish's calls, every member's in turn: "done", the leader's "complete", "seen"."""
    leader = sessions[0]
    for s in sessions:
        s.put("done", None)
    leader.collect("done", deadline)
    leader.announce("complete", True)
    for s in sessions[1:]:
        s.await_posted("complete", deadline)
        s.put("seen", None)
    leader.store.check([leader.key("seen", r) for r in range(1, len(sessions))])


def store_redesign(metas: list[dict], trainers: int, inference: int, infos: dict, pairs_of: list[set]) -> dict:
    """The modelled redesign's store traffic (relays and expert parallelism on the inference side
    are not in the code): the protocol of the code, an inference rank reading the metadata of the
    trainer ranks it pairs with in the model (``pairs_of``)."""
    root, record, joined, sessions, deadline, before, by_trainer = _metadata(metas, trainers, inference, infos)
    leader = sessions[0]
    for i in range(inference):
        s = sessions[trainers + i]
        for t in pairs_of[i]:
            rendezvous.get(s.store, s.key("meta", t))
        s.put("ready", verdicts.ready([], []))
    verdicts.post_verdict(leader, by_trainer, 1, deadline)
    for s in sessions[1:]:
        verdicts.await_verdict(s, deadline)
    _finish(sessions, deadline)
    update = {k: root.counts[k] - before[k] for k in before}
    return {"join_round_trips": joined["round_trips"], "join_bytes": joined["bytes"],
            "update_round_trips": update["round_trips"], "update_bytes": update["bytes"]}


def _redesign_pairs(model: Model, trainers: int, inference: int) -> tuple[list[set], list[set], int]:
    """The redesign's pairs, and the ranks of an inference replica. A replica is EP ranks (a dense
    model: TP ranks); rank j of a replica keeps TP slot j % TP of the dense tensors and the experts
    e % EP == j. Trainer rank t sends to replica t % replicas only: its experts to the rank that
    keeps them, its dense tensors to the TP ranks of one group of that replica ((t // replicas) %
    groups); the replica's other groups and the other replicas get them passed on, in chains
    (relays). Returns (per trainer rank, per inference rank) the peers, and the replica size."""
    size = EP if model.experts else TP
    replicas = max(1, inference // size)
    groups = size // TP
    of_trainer: list[set] = [set() for _ in range(trainers)]
    of_inference: list[set] = [set() for _ in range(inference)]
    for t in range(trainers):
        replica = t % replicas
        group = (t // replicas) % groups
        dests = {replica * size + group * TP + slot for slot in range(TP)}
        if model.experts:
            dests |= {replica * size + e % size for e in range(t, model.experts, trainers)}
        for i in dests:
            of_trainer[t].add(i)
            of_inference[i].add(t)
    return of_trainer, of_inference, size


def sync_at(model: Model, trainers: int, inference: int, message_s: float, meta_cap: int | None = None) -> dict:
    """One update from ``trainers`` trainer ranks to ``inference`` ranks (TP 8 replicas)."""
    owned = sync_entries(model, trainers)
    spec = BUILTIN_SPECS["decoder"]
    # Today's channel: every inference rank keeps its TP slice of every tensor (decoder rules).
    places = [TPPlace(TP, t, ShardingSpec("decoder", spec, dict(model.config))) for t in range(TP)]
    plan_s, groups_of, layout_bytes, layout_msgs = [], [], [], []
    for entries in owned:
        (groups, per_place), seconds = timed(lambda entries=entries: _trainer_plan(entries, places))
        plan_s.append(seconds)
        groups_of.append(groups)
        layout_bytes.append([sum(layout.size for layout in lays) for lays in per_place])
        layout_msgs.append([sum(1 for layout in lays if layout.size) for lays in per_place])
        if len(plan_s) >= 16 and trainers > 32:
            break  # trainer ranks are alike: the first 16 give the time; bytes come per rank below
    # Bytes per (trainer, TP slot), for every trainer rank: the layouts' sizes, each tensor's kept
    # bytes computed once per name pattern and shape (KeptSizes), checked against the real
    # layouts of the ranks planned above.
    sizes = KeptSizes(places)
    for t, entries in enumerate(owned[:len(layout_bytes)]):
        assert sizes.of(entries, groups_of[t]) == (layout_bytes[t], layout_msgs[t]), t
    for entries in owned[len(layout_bytes):]:
        kept, msgs = sizes.of(entries, group_entries(entries, DEFAULT_BUCKET_BYTES))
        layout_bytes.append(kept)
        layout_msgs.append(msgs)
    replicas = inference // TP
    verify_msgs = 1  # the checksums after the last bucket
    # Main and now: each trainer rank sends each inference rank its slices (every pair carries bytes).
    egress = [replicas * sum(b) for b in layout_bytes]
    egress_msgs = [replicas * (sum(m) + verify_msgs * TP) for m in layout_msgs]
    ingress = [sum(layout_bytes[t][i % TP] for t in range(trainers)) for i in range(inference)]
    ingress_msgs = [sum(layout_msgs[t][i % TP] + verify_msgs for t in range(trainers)) for i in range(inference)]
    direct_s = max(max(moving_s(e, m, message_s) for e, m in zip(egress, egress_msgs)),
                  max(moving_s(g, m, message_s) for g, m in zip(ingress, ingress_msgs)))
    # Now (the code): relay chains (pairing.relay). A trainer rank sends each place's bytes once per
    # chain; each receiver takes its slices once and passes them on while it takes the next (a link
    # sends and receives at once); the last member of a chain gets a bucket one bucket's transfer
    # per member before it later than the first.
    chains = -(-replicas // pairing.CHAIN_MEMBERS)
    longest = -(-replicas // chains)
    now_egress = [chains * sum(b) for b in layout_bytes]
    now_egress_msgs = [chains * (sum(m) + verify_msgs * TP) for m in layout_msgs]
    hop_s = DEFAULT_BUCKET_BYTES / LINK_BYTES_S + message_s
    now_s = max(max(moving_s(e, m, message_s) for e, m in zip(now_egress, now_egress_msgs)),
                max(moving_s(g, m, message_s) for g, m in zip(ingress, ingress_msgs))) + (longest - 1) * hop_s
    # The redesign (model only): pairs where a trainer rank holds bytes an inference rank keeps, with
    # expert parallelism on the inference side, relays in chains (see _redesign_pairs).
    owned_bytes = [sum(e.nbytes for e in entries) for entries in owned]
    kept_inf, dense_slot = _redesign_kept(model)
    pairs_t, pairs_i, size = _redesign_pairs(model, trainers, inference)
    r_replicas = max(1, inference // size)
    chain = r_replicas - 1 + size // TP - 1  # buckets a relayed byte waits, at most
    # A relay passes buckets on in chunks of RELAY_BYTES as they land (pipelined: a byte waits a
    # chunk per hop, not a bucket).
    bucket_s = RELAY_BYTES / LINK_BYTES_S
    # A trainer rank: one message per bucket to the rank that keeps it, the checksums after.
    r_egress_msgs = [len(group_entries(entries, DEFAULT_BUCKET_BYTES)) + TP + 1 for entries in owned[:16]]
    # passed on to the next replica (a chain; the last keeps it), and within a replica of several
    # TP groups, the dense slices to the next group
    relay_out = (max(kept_inf) if r_replicas > 1 else 0) + (dense_slot if size > TP else 0)
    relay_msgs = math.ceil(relay_out / RELAY_BYTES) + math.ceil(max(kept_inf) / RELAY_BYTES) + max(len(p) for p in pairs_i)
    redesign_s = max(moving_s(max(owned_bytes), max(r_egress_msgs), message_s),
                     moving_s(relay_out, relay_msgs, message_s) + chain * bucket_s,
                     moving_s(max(kept_inf), relay_msgs, message_s) + chain * bucket_s)
    bound_s = max(max(owned_bytes), max(kept_inf)) / LINK_BYTES_S
    # The bound of the code's layout (every receiver keeps its TP slice of every expert as well):
    # what a receiver must take at least is its slices of everything.
    layout_bound_s = max(max(owned_bytes), max(ingress)) / LINK_BYTES_S
    metas = [{"version": 1, "entries": entries, "groups": groups_of[t] if t < len(groups_of)
              else group_entries(entries, DEFAULT_BUCKET_BYTES), "verify": True, "gathered": [], "delta": False,
              "base": None, "next": None, "audit": 0} for t, entries in enumerate(owned)]
    infos = hello_infos(model)
    ep = sync_ep(model, owned, metas, trainers, inference, message_s, bound_s) if model.experts else None
    before_store = store_before(metas, trainers, inference, infos)
    now_store = store_now(metas, trainers, inference, infos)
    redesign_store = store_redesign(metas, trainers, inference, infos, pairs_i)
    world = trainers + inference
    # Heartbeats: every member counts its key up every INTERVAL_S; main's: every member read every
    # other's; now the leader reads every member's, any other member the leader's and its peers'.
    heartbeat_per_s = world * (world - 1) / INTERVAL_S + world / INTERVAL_S
    now_peers = now_store["peers"]
    now_heartbeat_per_s = ((world - 1) + sum(1 + len(p) for m, p in now_peers.items() if m) + world) / INTERVAL_S
    r_heartbeat_per_s = (sum(len(p) for p in pairs_t) * 2 + world) / INTERVAL_S
    # torch's gloo rendezvous of a two-member group: each member posts its address (about 300 bytes)
    # and reads the other's (a wait and a get): 3 round trips, about 700 bytes, per member and pair.
    all_pairs = trainers * inference
    now_pairs = len({(min(a, b), max(a, b)) for a, peers in now_peers.items() for b in peers})
    now_conn = max(len(p) for p in now_peers.values())
    restart_conn = max(len(p) for p in now_store["peers_with_a_restart"].values())
    redesign_pairs = sum(len(p) for p in pairs_t) + 2 * inference  # + the relays' chains
    pair_rt, pair_bytes = 3 * 2, 700 * 2

    def totals(store: dict, pairs: int) -> dict:
        return {"store_bytes": store["join_bytes"] + pairs * pair_bytes + store["update_bytes"],
                "store_round_trips": store["join_round_trips"] + pairs * pair_rt + store["update_round_trips"],
                "store_update_bytes": store["update_bytes"], "store_join_bytes": store["join_bytes"]}
    return {
        "trainer_ranks": trainers, "inference_ranks": inference, "state_bytes": model.nbytes,
        "planning_s_per_rank": max(plan_s),
        "before": {
            "pairs": all_pairs, "connections_per_process": max(trainers, inference) + 1,
            "threads_per_process": GLOO_THREADS_PER_GROUP * max(trainers, inference) + 3,
            **totals(before_store, all_pairs), "heartbeat_reads_per_s": heartbeat_per_s,
            "max_bytes_per_link": max(max(b) for b in layout_bytes),
            "max_egress_bytes": max(egress), "max_ingress_bytes": max(ingress),
            "update_s_model": direct_s, "vs_bound": direct_s / bound_s,
        },
        # The code as it is now: its protocol, its pairs and its relay chains (counted above); every
        # receiver keeps its TP slice of every tensor (experts too: no expert-parallel place yet).
        "now": {
            "pairs": now_pairs, "connections_per_process": now_conn + 1,
            "connections_per_process_after_a_restart": restart_conn + 1,
            "threads_per_process": GLOO_THREADS_PER_GROUP * now_conn + 3,
            **totals(now_store, now_pairs), "heartbeat_reads_per_s": now_heartbeat_per_s,
            "record_bytes": now_store["record_bytes"],
            "max_bytes_per_link": max(max(b) for b in layout_bytes),
            "max_egress_bytes": max(max(now_egress), max(ingress)), "max_ingress_bytes": max(ingress),
            "chains_per_route": chains, "chain_members": longest,
            "update_s_model": now_s, "vs_bound": now_s / bound_s,
            "layout_bound_s": layout_bound_s, "vs_layout_bound": now_s / layout_bound_s,
        },
        "redesign": {
            "pairs": redesign_pairs,
            "connections_per_process": max(max(len(p) for p in pairs_t), max(len(p) for p in pairs_i) + 4) + 1,
            "threads_per_process": GLOO_THREADS_PER_GROUP * max(max(len(p) for p in pairs_t), max(len(p) for p in pairs_i) + 4) + 3,
            **totals(redesign_store, redesign_pairs), "heartbeat_reads_per_s": r_heartbeat_per_s,
            "max_bytes_per_link": max(owned_bytes),
            "max_egress_bytes": max(max(owned_bytes), relay_out), "max_ingress_bytes": max(kept_inf),
            "update_s_model": redesign_s, "vs_bound": redesign_s / bound_s,
        },
        **({"ep": ep} if ep is not None else {}),
        "bound_s": bound_s, "meta_bytes": now_store["meta_bytes"],
    }


def ep_infos(model: Model, inference: int) -> tuple[dict, list[TPPlace]]:
    """The hellos of receivers at TP 8 x EP_SIZE (the code's expert parallelism), as SyncChannel
    makes them: each rank's place by pairing.with_experts (loads' rank mapping: rank r is TP rank
    r % 8, EP rank (r // 8) % EP_SIZE), announced with pairing.expert_info. Returns the infos and
    the TP 8 x EP_SIZE distinct places, in rank order."""
    spec = ShardingSpec("decoder", BUILTIN_SPECS["decoder"], dict(model.config))
    infos = hello_infos(model)
    places = []
    for r in range(inference):
        place = pairing.with_experts(TPPlace(TP, r % TP, spec), "inference", r, inference, EP_SIZE, "linear",
                                     lambda: {"n_routed_experts": model.experts})
        infos[("inference", r)] = {**infos[("inference", r)], "experts": pairing.expert_info(place)}
        if r < TP * EP_SIZE:
            places.append(place)
    return infos, places


def sync_ep(model: Model, owned: list[list[SyncTensor]], metas: list[dict], trainers: int, inference: int,
            message_s: float, bound_s: float) -> dict:
    """One update to receivers at TP 8 x EP_SIZE, on the code's real EP placement: the hellos
    (ep_infos), the leader's route and every trainer rank's receivers (pairing.senders /
    receivers over the record), the relay chains (pairing.relay, links) and each place's bytes
    (transfer.layouts, checked against KeptSizes for the ranks planned). Transfer modelled as for
    "now": a trainer rank sends each route's bytes once per chain head (and same-host member); a
    receiver takes its bytes once and passes them on while it takes the next; the last member of a
    chain waits a bucket per member before it."""
    infos, places = ep_infos(model, inference)
    plan_s, layout_bytes, layout_msgs = [], [], []
    sizes = KeptSizes(places)
    for t, entries in enumerate(owned):
        groups = metas[t]["groups"]
        if t < 16:  # timed: the trainer rank's layouts for every place, and its receivers
            (_, per_place), seconds = timed(lambda entries=entries: _trainer_plan(entries, places))
            plan_s.append(seconds)
            kept = ([sum(layout.size for layout in lays) for lays in per_place],
                    [sum(1 for layout in lays if layout.size) for lays in per_place])
            assert sizes.of(entries, groups) == kept, t
        else:
            kept = sizes.of(entries, groups)
        layout_bytes.append(kept[0])
        layout_msgs.append(kept[1])
    store = store_now(metas, trainers, inference, infos)
    root, record, _ = _form(infos, trainers, inference)
    where = pairing.places(record)
    slot = {key: place.experts.rank * TP + place.rank for key, (place, _) in where.items()}
    senders, seconds = timed(lambda: pairing.senders({t: e for t, e in enumerate(owned)}, record))
    egress = [0] * trainers
    egress_msgs = [0] * trainers
    ingress: dict[int, int] = {}
    ingress_msgs: dict[int, int] = {}
    relay_out: dict[int, int] = {}
    longest = 1
    for key, ranks in senders.items():
        p, members = slot[key], where[key][1]
        for t in ranks:
            direct, chains = pairing.relay(record, t, members)
            egress[t] += (len(direct) + len(chains)) * layout_bytes[t][p]
            egress_msgs[t] += (len(direct) + len(chains)) * (layout_msgs[t][p] + 1)  # + the checksums
            longest = max([longest] + [len(c) for c in chains])
            for m in members:
                ingress[m] = ingress.get(m, 0) + layout_bytes[t][p]
                ingress_msgs[m] = ingress_msgs.get(m, 0) + layout_msgs[t][p] + 1
                if pairing.links(record, m, t, {}, where)[1] is not None:
                    relay_out[m] = relay_out.get(m, 0) + layout_bytes[t][p]
    # the code's own pairs agree with the leader's route (store_now checks both sides)
    assert {m for m in store["peers"] if m >= trainers} == set(ingress)
    hop_s = DEFAULT_BUCKET_BYTES / LINK_BYTES_S + message_s
    update_s = max(max(moving_s(e, n, message_s) for e, n in zip(egress, egress_msgs)),
                   max(moving_s(ingress[m], ingress_msgs[m], message_s) for m in ingress),
                   max(moving_s(relay_out.get(m, 0), ingress_msgs[m], message_s) for m in ingress)) + (longest - 1) * hop_s
    own_bound_s = max(max(sum(e.nbytes for e in entries) for entries in owned), max(ingress.values())) / LINK_BYTES_S
    peers = store["peers"]
    conn = max(len(p) for p in peers.values())
    pairs = len({(min(a, b), max(a, b)) for a, ps in peers.items() for b in ps})
    return {"tp": TP, "ep": EP_SIZE, "planning_s_per_rank": max(plan_s), "senders_s": seconds,
            "pairs": pairs, "connections_per_process": conn + 1,
            "store_bytes": store["join_bytes"] + pairs * 700 * 2 + store["update_bytes"],
            "max_ingress_bytes": max(ingress.values()), "max_egress_bytes": max(max(egress), max(relay_out.values(), default=0)),
            "max_senders_per_place": max(len(r) for r in senders.values()), "chain_members": longest,
            "update_s_model": update_s, "vs_bound": update_s / bound_s,
            "own_bound_s": own_bound_s, "vs_own_bound": update_s / own_bound_s}


class KeptSizes:
    """The sizes of a trainer rank's bucket layouts per place (``layouts``'s, summed) without
    making them: what a place keeps of a tensor depends on its name's pattern (digits aside: the
    layer and expert numbers) and its shape, so each is cut once (kept_slice) and reused; the
    buckets' aligned offsets are the layouts' own (``offsets``). sync_at checks it against the
    real layouts of the ranks it plans."""

    def __init__(self, places: Sequence[TPPlace]):
        self.places = places
        self.kept: dict[tuple, int] = {}

    def _kept(self, p: int, entry: SyncTensor) -> int:
        # an EP place keeps an expert or not by its number: that number stays in the key
        key = (p, re.sub(r"[0-9]+", "#", entry.name), entry.shape, entry.dtype,
               expert_of(entry.name) if self.places[p].experts is not None else None)
        if key not in self.kept:
            self.kept[key] = kept_slice(self.places[p], 0, entry).nbytes
        return self.kept[key]

    def of(self, entries: Sequence[SyncTensor], groups: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
        kept, messages = [], []
        for p in range(len(self.places)):
            sizes = [offsets([self._kept(p, entries[i]) for i in group], ALIGN)[1] for group in groups]
            kept.append(sum(sizes))
            messages.append(sum(1 for size in sizes if size))
        return kept, messages


def _trainer_plan(entries: list[SyncTensor], places: list[TPPlace]) -> tuple[list, list]:
    groups = group_entries(entries, DEFAULT_BUCKET_BYTES)
    return groups, [layouts(entries, groups, place, False) for place in places]


def _redesign_kept(model: Model) -> tuple[list[int], int]:
    """Bytes each rank of a replica keeps in the redesign (experts e % EP whole, the rest its
    decoder TP slice: real kept sizes from transfer.kept_slice), and the largest TP slot's share
    of the tensors that are not experts."""
    from distload.live.transfer import kept_slice
    spec = ShardingSpec("decoder", BUILTIN_SPECS["decoder"], dict(model.config))
    size = EP if model.experts else TP
    dense = [0] * TP
    for slot in range(TP):
        place = TPPlace(TP, slot, spec)
        for i, (name, shape) in enumerate(model.tensors):
            if expert_of(name) is None:
                dense[slot] += kept_slice(place, i, SyncTensor(name, "BF16", shape, 2 * math.prod(shape))).nbytes
    experts = [0] * size
    for name, shape in model.tensors:
        e = expert_of(name)
        if e is not None:
            experts[e % size] += 2 * math.prod(shape)
    return [dense[j % TP] + experts[j] for j in range(size)], max(dense)


# -- the run ---------------------------------------------------------------------------------------

def sizes_up_to(limit: int) -> list[int]:
    return [n for n in (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if n <= limit]


def run(ranks: int, old_up_to: int = 32, message_s: float | None = None, models: Sequence[Model] | None = None) -> dict:
    measured = measure_message_s()
    message_s = measured if message_s is None else message_s
    models = list(models) if models is not None else [llama70b(), moe1t()]
    old = old_exchange_plan()
    out: dict = {"message_s": message_s, "message_s_measured_now": measured, "link_bytes_s": LINK_BYTES_S, "store_bytes_s_per_rank": STORE_BYTES_S_PER_RANK,
                 "load": {}, "sync": {}}
    for model in models:
        setup = LoadSetup(model)
        rows = []
        for n in sizes_up_to(ranks):
            if n < setup.count:
                continue  # fewer ranks than an EP group: the job does not hold every expert
            row = load_at(setup, n, message_s, old if n <= old_up_to else None)
            rows.append(row)
            print(f"load {model.name} N={n}: plan {row['planning_s_per_rank']:.2f} s, "
                  f"agreement {row['agreement_bytes_per_rank'] / 1e6:.2f} MB/rank, model {row['load_s_model']:.1f} s", flush=True)
        out["load"][model.name] = rows
        rows = []
        for n in sizes_up_to(ranks):
            trainers, inference = max(TP, n // 4), max(EP, n // 8)  # 1,024: 256 -> 128, as the issue's shape
            if rows and (rows[-1]["trainer_ranks"], rows[-1]["inference_ranks"]) == (trainers, inference):
                continue
            row = sync_at(model, trainers, inference, message_s)
            rows.append(row)
            if "ep" in row:
                print(f"sync {model.name} {trainers}->{inference} at EP (the code): {row['ep']['connections_per_process']} "
                      f"conn, {row['ep']['vs_bound']:.2f}x bound", flush=True)
            print(f"sync {model.name} {trainers}->{inference}: before {row['before']['store_bytes'] / 1e6:.0f} MB store; now "
                  f"{row['now']['connections_per_process']} conn, {row['now']['store_bytes'] / 1e6:.0f} MB store, "
                  f"{row['now']['vs_bound']:.1f}x bound; redesign "
                  f"{row['redesign']['connections_per_process']} conn, {row['redesign']['store_bytes'] / 1e6:.0f} MB, "
                  f"{row['redesign']['vs_bound']:.2f}x", flush=True)
        out["sync"][model.name] = rows
    return out


DESIGNS = {"before": "main (before)", "now": "now (the code)", "redesign": "redesign (model)"}


def goals(result: dict) -> list[tuple[str, str, bool]]:
    """The issue's goals against the figures (at the largest N run: 256 -> 128 needs 1,024)."""
    moe = "1T MoE, Kimi-K2-like"
    out = []
    sync = next((r for r in result["sync"].get(moe, []) if r["trainer_ranks"] == 256 and r["inference_ranks"] == 128), None)
    if sync is not None:
        for design in ("before", "now", "redesign"):
            d = sync[design]
            design = DESIGNS[design]
            out += [(f"sync {design}: connections per process <= 64", f"{d['connections_per_process']}", d["connections_per_process"] <= 64),
                    (f"sync {design}: store traffic <= 100 MB", f"{d['store_bytes'] / 1e6:.1f} MB", d["store_bytes"] <= 100e6),
                    (f"sync {design}: update within 1.2x of the link bound", f"{d['vs_bound']:.2f}x ({d['update_s_model']:.2f} s vs {sync['bound_s']:.2f} s)",
                     d["vs_bound"] <= 1.2)]
        now = sync["now"]
        out.append(("sync now (the code): connections per process <= 64, after one receiver per place restarted "
                    "(its pairs as well as the ones it had)", f"{now['connections_per_process_after_a_restart']}",
                    now["connections_per_process_after_a_restart"] <= 64))
        out.append(("sync now (the code): update within 1.2x of its own layout's link bound (every receiver keeps a "
                    "TP slice of every expert: 4x the bytes of the redesign's EP 32)",
                    f"{now['vs_layout_bound']:.2f}x ({now['update_s_model']:.2f} s vs {now['layout_bound_s']:.2f} s)",
                    now["vs_layout_bound"] <= 1.2))
        ep = sync.get("ep")
        if ep is not None:
            what = f"sync EP (the code: TP {ep['tp']} x EP {ep['ep']} receivers, its real placement and pairing)"
            out += [(f"{what}: update within 1.2x of the link bound",
                     f"{ep['vs_bound']:.2f}x ({ep['update_s_model']:.2f} s vs {sync['bound_s']:.2f} s)", ep["vs_bound"] <= 1.2),
                    (f"{what}: connections per process <= 64", f"{ep['connections_per_process']}",
                     ep["connections_per_process"] <= 64),
                    (f"{what}: store traffic <= 100 MB", f"{ep['store_bytes'] / 1e6:.1f} MB", ep["store_bytes"] <= 100e6)]
        out.append(("sync: planning <= 1 s per rank", f"{sync['planning_s_per_rank']:.3f} s", sync["planning_s_per_rank"] <= 1))
    load = next((r for r in result["load"].get(moe, []) if r["ranks"] == 1024), None)
    if load is not None:
        out += [("load 1,024 ranks: plan and agreement <= 2 s per rank", f"{load['plan_and_agreement_s']:.2f} s",
                 load["plan_and_agreement_s"] <= 2),
                ("load 1,024 ranks: each data byte from the store once", str(load["store_data_bytes_once"]), load["store_data_bytes_once"]),
                ("load 1,024 ranks: each header from the store once",
                 f"{load['store_header_reads']} reads of {load['files']} files, {load['store_header_bytes'] / 1e6:.1f} MB "
                 f"(every rank reading every header: {load['old_store_header_bytes'] / 1e9:.2f} GB)",
                 load["store_header_reads"] == load["files"])]
    return out


def write_report(result: dict, json_path: str) -> None:
    """scale.md and, with matplotlib, scale.png beside ``json_path``."""
    base = os.path.splitext(json_path)[0]
    m = result["machine"]
    lines = [f"Scale harness (benchmarks/bench_scale.py, issue 36), N = 8 ... {max(r['ranks'] for rows in result['load'].values() for r in rows)} ranks "
             f"in one process, {result['seconds']:.0f} s; {m['cpus']} CPUs, torch {m['torch']}, {m['platform']}. "
             f"Model: links {LINK_BYTES_S / GB:.0f} GB/s, object store {STORE_BYTES_S_PER_RANK / GB:.2f} GB/s per rank, "
             f"gloo message {result['message_s'] * 1e6:.0f} us ({_message_source(result)}). Planning times are measured "
             f"(distload's code, one process; load average {result.get('load_average', '?')} while it ran); bytes and round "
             f"trips are counted; transfer times are modelled.", ""]
    lines += ["## Goals", "", "| goal | figure | met |", "|---|---|---|"]
    lines += [f"| {g} | {v} | {'yes' if ok else 'no'} |" for g, v, ok in goals(result)]
    for name, rows in result["load"].items():
        lines += ["", f"## Load: {name}, whole checkpoint on an object store, shared job-wide", "",
                  "| ranks | planning s/rank (old: main's code) | agreement MB/rank (old) | plan+agreement s | rounds | "
                  "GB sent / received per rank (max) | connections | modelled load s | bound s |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            old = f" ({r['old_planning_s_per_rank']:.2f})" if "old_planning_s_per_rank" in r else ""
            lines.append(f"| {r['ranks']} | {r['planning_s_per_rank']:.2f}{old} | {r['agreement_bytes_per_rank'] / 1e6:.2f} "
                         f"({r['old_agreement_bytes_per_rank'] / 1e6:.1f}) | {r['plan_and_agreement_s']:.2f} | {r['rounds']} | "
                         f"{r['max_bytes_sent_per_rank'] / 1e9:.1f} / {r['max_bytes_received_per_rank'] / 1e9:.1f} | {r['connections_per_process']} | {r['load_s_model']:.1f} | {r['load_bound_s']:.1f} |")
    for name, rows in result["sync"].items():
        lines += ["", f"## Sync: {name}, main before / now (the code) / the redesign (model: relays, experts by EP rank)", "",
                  "| trainer -> inference | planning s/rank | pairs | connections/process | threads/process | store MB | "
                  "store round trips | heartbeat reads/s | modelled update s | bound s | vs bound | now: chains x members, "
                  "vs its layout's bound |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            ds = [r[k] for k in DESIGNS]

            def cells(key: str, fmt: str, scale: float = 1.0) -> str:
                return " / ".join(format(d[key] / scale if scale != 1.0 else d[key], fmt) for d in ds)
            lines.append(f"| {r['trainer_ranks']} -> {r['inference_ranks']} | {r['planning_s_per_rank']:.3f} | {cells('pairs', 'd')} | "
                         f"{cells('connections_per_process', 'd')} | {cells('threads_per_process', 'd')} | "
                         f"{cells('store_bytes', '.1f', 1e6)} | {cells('store_round_trips', 'd')} | "
                         f"{cells('heartbeat_reads_per_s', '.0f')} | {cells('update_s_model', '.2f')} | "
                         f"{r['bound_s']:.2f} | {cells('vs_bound', '.2f')} | {r['now']['chains_per_route']} x "
                         f"{r['now']['chain_members']}, {r['now']['vs_layout_bound']:.2f} |")
    for name, rows in result["sync"].items():
        rows = [r for r in rows if "ep" in r]
        if not rows:
            continue
        lines += ["", f"## Sync: {name}, the code's expert parallelism (receivers at TP {rows[0]['ep']['tp']} x EP "
                  f"{rows[0]['ep']['ep']}, linear placement: the real hellos, route, pairing and relay chains; "
                  f"transfer modelled as for \"now\")", ""] + ([result["ep_note"], ""] if result.get("ep_note") else []) + [
                  "| trainer -> inference | planning s/rank | pairs | connections/process | store MB | GB in per receiver "
                  "(max) | GB out per process (max) | senders per place (max) | chain members | modelled update s | "
                  "bound s | vs bound | vs its own bound |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            e = r["ep"]
            lines.append(f"| {r['trainer_ranks']} -> {r['inference_ranks']} | {e['planning_s_per_rank']:.3f} | {e['pairs']} | "
                         f"{e['connections_per_process']} | {e['store_bytes'] / 1e6:.1f} | {e['max_ingress_bytes'] / 1e9:.1f} | "
                         f"{e['max_egress_bytes'] / 1e9:.1f} | {e['max_senders_per_place']} | {e['chain_members']} | "
                         f"{e['update_s_model']:.2f} | {r['bound_s']:.2f} | {e['vs_bound']:.2f} | {e['vs_own_bound']:.2f} |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib
    except ImportError:  # the figures are in the .md; the plot needs matplotlib
        print("no matplotlib here: scale.png not written", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for name, rows in result["load"].items():
        n = [r["ranks"] for r in rows]
        axes[0][0].plot(n, [r["planning_s_per_rank"] for r in rows], "o-", label=f"{name}")
        old = [(r["ranks"], r["old_planning_s_per_rank"]) for r in rows if "old_planning_s_per_rank" in r]
        if old:
            axes[0][0].plot(*zip(*old), "x--", label=f"{name}, main's code")
        axes[0][1].plot(n, [r["agreement_bytes_per_rank"] / 1e6 for r in rows], "o-", label=name)
        axes[0][1].plot(n, [r["old_agreement_bytes_per_rank"] / 1e6 for r in rows], "x--", label=f"{name}, main's")
        axes[0][2].plot(n, [r["load_s_model"] / r["load_bound_s"] for r in rows], "o-", label=name)
    for name, rows in result["sync"].items():
        n = [r["trainer_ranks"] + r["inference_ranks"] for r in rows]
        for design, style in (("before", "x--"), ("now", "s-"), ("redesign", "o:")):
            label = f"{name}, {DESIGNS[design]}"
            axes[1][0].plot(n, [r[design]["connections_per_process"] for r in rows], style, label=label)
            axes[1][1].plot(n, [r[design]["store_bytes"] / 1e6 for r in rows], style, label=label)
            axes[1][2].plot(n, [r[design]["vs_bound"] for r in rows], style, label=label)
    titles = [("load: planning s per rank", True), ("load: agreement MB received per rank", True),
              ("load: modelled time / bound", False), ("sync: connections per process", True),
              ("sync: store MB per session + update", True), ("sync: modelled update / link bound", True)]
    for ax, (title, log) in zip([a for row in axes for a in row], titles):
        ax.set_title(title)
        ax.set_xscale("log", base=2)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("ranks (sync: trainer + inference)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    axes[1][0].axhline(64, color="grey", lw=0.8)
    axes[1][1].axhline(100, color="grey", lw=0.8)
    axes[1][2].axhline(1.2, color="grey", lw=0.8)
    fig.tight_layout()
    fig.savefig(base + ".png", dpi=90)


def _message_source(result: dict) -> str:
    now = result.get("message_s_measured_now")
    if now is None or abs(now - result["message_s"]) < 1e-9:
        return "measured here"
    return f"measured here earlier, on a quieter machine; {now * 1e6:.0f} us during this run"


def add_ep(json_path: str) -> None:
    """The code's EP rows (sync_ep) for each MoE sync row of an earlier run, at that run's message
    cost and bound; the report says when and under what load they ran."""
    with open(json_path) as f:
        result = json.load(f)
    start = time.perf_counter()
    model = moe1t()
    for row in result["sync"][model.name]:
        trainers, inference = row["trainer_ranks"], row["inference_ranks"]
        owned = sync_entries(model, trainers)
        metas = [{"version": 1, "entries": entries, "groups": group_entries(entries, DEFAULT_BUCKET_BYTES),
                  "verify": True, "gathered": [], "delta": False, "base": None, "next": None, "audit": 0}
                 for entries in owned]
        row["ep"] = sync_ep(model, owned, metas, trainers, inference, result["message_s"], row["bound_s"])
        print(f"sync {model.name} {trainers}->{inference} at EP (the code): {row['ep']['connections_per_process']} "
              f"conn, {row['ep']['vs_bound']:.2f}x bound", flush=True)
    loads = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    result["ep_note"] = (f"These rows were added to the run above by `bench_scale.py --ep-into` ({time.perf_counter() - start:.0f} s; "
                         f"{machine()['cpus']} CPUs, {machine()['platform']}; load average {loads} at its end, the machine "
                         f"shared with other jobs): the same model, message cost and bound; planning (a trainer rank's "
                         f"layouts for all {TP * EP_SIZE} places) measured then.")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    write_report(result, json_path)


def machine() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=1024, help="the largest rank count (8, 16, ... up to it)")
    parser.add_argument("--json", help="write the figures here (and a .md and, with matplotlib, a .png beside it)")
    parser.add_argument("--old-up-to", type=int, default=64, help="run main's exchange plan up to this N")
    parser.add_argument("--report-only", action="store_true", help="write the .md and .png from --json's figures")
    parser.add_argument("--ep-into", action="store_true", help="add the code's expert-parallel sync rows (sync_ep) "
                        "to --json's earlier run of the MoE, at its message cost, and rewrite its report")
    parser.add_argument("--message-us", type=float, help="model with this cost of one gloo message (us) instead of "
                        "the one measured now (which a busy machine inflates; it is recorded either way)")
    args = parser.parse_args()
    if args.report_only:
        with open(args.json) as f:
            write_report(json.load(f), args.json)
        return 0
    if args.ep_into:
        add_ep(args.json)
        return 0
    start = time.perf_counter()
    result = run(args.ranks, args.old_up_to, None if args.message_us is None else args.message_us * 1e-6)
    result["machine"] = machine()
    result["seconds"] = time.perf_counter() - start
    result["load_average"] = " / ".join(f"{x:.1f}" for x in os.getloadavg())  # 1, 5, 15 minutes, at the end
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        write_report(result, args.json)
    print(f"done in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
