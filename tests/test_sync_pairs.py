"""The sync channel's pairs and store traffic (issue 36): pairs only where bytes flow, and no
member reads every member's answers. Real channels and real gloo pairs, as threads of one
process over one in-process store whose every call is recorded by member."""

from __future__ import annotations

import threading
from collections import defaultdict

import torch
import torch.distributed as dist

from distload.live import pairing, rendezvous
from distload.live.channel import SyncChannel
from distload.live.rendezvous import SessionRecord
from distload.live.transfer import SyncTensor
from distload.tp.place import TPPlace


def _entries(*names):
    return [SyncTensor(n, "F32", (4, 8), 128) for n in names]


def test_a_trainer_rank_pairs_only_with_the_places_it_carries_bytes_for():
    record = SessionRecord("s", 2, 3, {}, {
        "inference/0": {"tp_size": 1, "spec": None}, "inference/1": {"tp_size": 1, "spec": None},
        "inference/2": {"tp_size": 1, "spec": None, "cuts": True}})
    everything, nothing = _entries("a", "b"), []
    assert pairing.carries(everything, TPPlace()) and not pairing.carries(nothing, TPPlace())
    assert pairing.receivers(everything, record) == [2, 3] and pairing.receivers(nothing, record) == []
    (key,) = pairing.places(record)  # two ranks at one place; the cuts receiver at none
    assert pairing.senders({0: everything, 1: nothing}, record) == {key: [0]}
    assert pairing.cut_receivers(record) == [4]


def test_a_chain_takes_a_trainer_ranks_delta_only_where_every_far_member_can():
    """The verdict's takes (pairing.chained_takes): a relay chain passes one kind of message, so a
    place's far members take a trainer rank's delta only where all of them can; a same-host member
    (read from the trainer's segment, not chained) and a cuts receiver keep what they said."""
    info = {"tp_size": 1, "spec": None, "host": None}
    record = SessionRecord("s", 2, 4, {}, {
        "trainer/0": {"host": "a"}, "trainer/1": {"host": "b"},
        "inference/0": {**info, "host": "a"}, "inference/1": info, "inference/2": info,
        "inference/3": {**info, "cuts": True}})
    # session ranks: trainers 0, 1; inference ranks 2 (on trainer rank 0's host), 3, 4; 5 (cuts)
    said = {2: [0, 1], 3: [0, 1], 4: [1], 5: [0]}  # inference rank 2 (session 4) lacks trainer rank 0's base
    # trainer rank 0's far members are 3 and 4, and 4 cannot: both take every byte from it; 2 (same
    # host) keeps its delta; every member can take trainer rank 1's
    assert pairing.chained_takes(record, said) == {2: [0, 1], 3: [1], 4: [1], 5: [0]}
    assert pairing.chained_takes(record, {2: [0, 1], 3: [0, 1], 4: [0, 1]}) == {2: [0, 1], 3: [0, 1], 4: [0, 1]}
    # trainer rank 0's chain is the far members 3 and 4; trainer rank 1's all three (none on its host)
    assert pairing.relay(record, 0, [2, 3, 4]) == ([2], [[3, 4]])
    assert pairing.relay(record, 1, [2, 3, 4]) == ([], [[3, 4, 2]])


def _run_members(member, trainers: int, receivers: int, results: dict) -> None:
    """Run ``member(role, rank)`` for every member, each on a thread of its own, to the end; none
    may have raised (``results`` holds what each reported, an exception for one that raised)."""
    threads = [threading.Thread(target=member, args=(role, r)) for role, n in (("trainer", trainers),
                                                                                ("inference", receivers))
               for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(isinstance(v, BaseException) for v in results.values()), results


class _Recorder:
    """Every get and set of the channels' stores, by the member that made it."""

    def __init__(self, monkeypatch):
        self.calls: dict[str, list[tuple[str, str]]] = defaultdict(list)
        self.owner: dict[int, str] = {}
        original = rendezvous.BoundedStore._call
        recorder = self

        def call(store, name, *args):
            if name in ("get", "set"):
                who = recorder.owner.get(id(store._caller), "?")
                recorder.calls[who].append((name, args[0]))  # the key within the session's part
            return original(store, name, *args)

        monkeypatch.setattr(rendezvous.BoundedStore, "_call", call)


def test_members_read_only_their_peers_relays_pass_on_and_a_trainer_with_nothing_pairs_with_none(monkeypatch):
    recorder = _Recorder(monkeypatch)
    store = dist.HashStore()
    trainers, receivers = 3, 3
    states = {0: {"a": torch.arange(32.0).reshape(4, 8)}, 1: {"b": torch.arange(32.0).reshape(4, 8) * -1},
              2: {}}  # trainer rank 2 holds nothing: it carries bytes for no receiver
    results: dict[str, object] = {}

    def member(role, rank):
        name = f"{role} {rank}"
        try:
            ch = SyncChannel(role=role, rank=rank, size=trainers if role == "trainer" else receivers,
                             store=store, device="cpu", timeout_s=60, transport="socket")
            recorder.owner[id(ch._store._caller)] = name
            if role == "trainer":
                for version in (1, 2):
                    ch.push({k: v + version for k, v in states[rank].items()}, version)
            else:
                target = {"a": torch.zeros(4, 8), "b": torch.zeros(4, 8)}
                for version in (1, 2):
                    ch.receive(target)
                    results[f"{name} v{version}"] = all(
                        torch.equal(target[k], states[t][k] + version) for t in (0, 1) for k in states[t])
            results[name] = sorted(ch._session.pairs)
            if role == "inference":  # the trainer ranks whose metadata it read (and whose base it holds)
                results[f"{name} senders"] = sorted(ch._held)
            ch.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            results[name] = exc

    _run_members(member, trainers, receivers, results)
    assert all(results[f"inference {r} v{v}"] for r in range(receivers) for v in (1, 2)), results  # bit-exact
    # Pairs: the receivers are one place, so each trainer rank that holds bytes sends to the head
    # of its relay chain only (trainer rank 0's chain: session ranks 3, 4, 5; rank 1's: 4, 5, 3);
    # trainer rank 2 pairs with none. A receiver pairs with the heads' trainers and its neighbours.
    assert (results["trainer 0"], results["trainer 1"], results["trainer 2"]) == ([3], [4], [])
    assert [results[f"inference {r}"] for r in range(receivers)] == [[0, 4, 5], [1, 3, 5], [3, 4]]
    for who, calls in recorder.calls.items():
        reads = [key for op, key in calls if op == "get" and key.startswith("u/")]
        if who == "trainer 0":  # the leader reads every member's answers, once per update
            assert sum(k.startswith("u/0/ready/") for k in reads) == receivers, reads
            continue
        # Nobody else reads another member's answer to a step: only the leader's posts, and an
        # inference rank its senders' metadata, in one key (the leader's; not trainer rank 2's).
        assert not any("/ready/" in k or "/done/" in k or "/meta/" in k for k in reads), (who, reads)
        if who.startswith("inference"):
            assert sorted(k for k in reads if "/metas/" in k) == ["u/0/metas/0", "u/1/metas/0"], (who, reads)
            assert results[f"{who} senders"] == [0, 1], results


def test_a_receiver_that_cannot_take_a_delta_has_its_chain_take_every_byte_and_every_version_arrives_exact():
    """Two trainer ranks, six receivers at TP 2 (three replicas of each TP rank), on the socket:
    each place's receivers are a relay chain. Before version 3, inference rank 2 reallocates its
    tensors, so it cannot take a delta while its place's others can: a chain passes one kind of
    message, so the verdict has its whole place take every byte (the other place a delta), the
    chains stay as they were, and every receiver ends with exactly its slices of every version."""
    store = dist.HashStore()
    trainers, receivers = 2, 6
    q, o, norm = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight", \
        "model.layers.0.input_layernorm.weight"

    def state(version):
        gen = torch.Generator().manual_seed(7)
        s = {q: torch.randn(8, 4, generator=gen), o: torch.randn(4, 8, generator=gen), norm: torch.randn(4, generator=gen)}
        for t in s.values():  # a training step: a few elements move each version (few enough that
            t.view(-1)[version::31] += version  # q's and o's patches pay: a push that compares nothing goes full)
        return s

    def mine(rank, version):  # a receiver's slices (the plain spec: q split by rows, o by columns)
        s, tp = state(version), rank % 2
        return {q: s[q][4 * tp:4 * tp + 4], o: s[o][:, 4 * tp:4 * tp + 4], norm: s[norm]}

    results: dict[str, object] = {}

    def member(role, rank):
        name = f"{role} {rank}"
        try:
            options = {} if role == "trainer" else {"tensor_parallel_size": 2, "sharding": "plain", "model_config": {
                "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_size": 8, "head_dim": 2}}
            ch = SyncChannel(role=role, rank=rank, size=trainers if role == "trainer" else receivers,
                             store=store, device="cpu", timeout_s=60, transport="socket", **options)
            if role == "trainer":
                owned = (q, norm) if rank == 0 else (o,)
                for version in (1, 2, 3):
                    ch.push({k: v for k, v in state(version).items() if k in owned}, version)
            else:
                target = {k: torch.zeros_like(v) for k, v in mine(rank, 0).items()}
                for version in (1, 2, 3):
                    if version == 3 and rank == 2:  # its tensors moved: its base is unknown
                        target = {k: v.clone() for k, v in target.items()}
                    stats = ch.receive(target)
                    exact = all(torch.equal(target[k], v) for k, v in mine(rank, version).items())
                    results[f"{name} v{version}"] = (exact, stats.delta)
                results[f"{name} pairs"] = sorted(ch._session.pairs)
            ch.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            results[name] = exc

    _run_members(member, trainers, receivers, results)
    for r in range(receivers):
        assert [results[f"inference {r} v{v}"] for v in (1, 2, 3)] == [
            (True, False), (True, True), (True, r % 2 == 1)], (r, results)
    # Session ranks: trainers 0-1, inference ranks 2-7; TP rank 0 is inference 0, 2, 4 (session 2, 4, 6).
    # Every version: trainer rank 0's chain 2 -> 4 -> 6, rank 1's 4 -> 6 -> 2; no other pairs.
    assert results["inference 0 pairs"] == [0, 4, 6], results
    assert results["inference 2 pairs"] == [1, 2, 6], results
    assert results["inference 4 pairs"] == [2, 4], results
