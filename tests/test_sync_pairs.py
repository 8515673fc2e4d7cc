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

    threads = [threading.Thread(target=member, args=(role, r)) for role, n in (("trainer", trainers),
                                                                                ("inference", receivers))
               for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(isinstance(v, BaseException) for v in results.values()), results
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
