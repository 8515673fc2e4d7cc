"""The scale harness (benchmarks/bench_scale.py) at small N, checked against distload's real code:
the exchange plan by distinct need against main's plan per member, the store counts against a
real torch store, the sync's replayed bytes against what each receiver keeps."""

from __future__ import annotations

import os
import sys

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_scale as bench  # noqa: E402
from distload.live import rendezvous  # noqa: E402
from distload.live.transfer import SyncTensor, kept_slice  # noqa: E402
from distload.loading.buckets import run_bytes  # noqa: E402
from distload.loading.shared_reads.plan import ExchangePlan  # noqa: E402
from distload.tp.place import TPPlace  # noqa: E402
from distload.tp.spec import BUILTIN_SPECS, ShardingSpec  # noqa: E402


def tiny_moe() -> bench.Model:
    hidden = 64
    out = [("model.embed_tokens.weight", (256, hidden))]
    for layer in range(2):
        p = f"model.layers.{layer}"
        out += bench._attention(p, hidden, 8, 8, 8) + [(f"{p}.mlp.gate.weight", (64, hidden))]
        for e in range(64):
            out += bench._mlp(f"{p}.mlp.experts.{e}", hidden, 32)
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (256, hidden))]
    return bench.Model("tiny MoE", tuple(out), {"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 8,
                                                "hidden_size": hidden}, 64)


@pytest.fixture(scope="module")
def setup():
    return bench.LoadSetup(tiny_moe())


def test_the_plan_by_distinct_need_is_mains_plan_per_member(setup, monkeypatch):
    """Readers, buckets and every member's received bytes, as the harness counts them from the
    plan by class, equal those of branch main's ExchangePlan given every member's need."""
    import distload.loading.shared_reads.plan as plan_module
    old = bench.old_exchange_plan()
    monkeypatch.setattr(plan_module, "MIN_BUCKET_BYTES", 4096)
    monkeypatch.setattr(sys.modules[old.__module__], "MIN_BUCKET_BYTES", 4096)
    n = 64
    classes = [r % setup.count for r in range(n)]
    new = ExchangePlan(setup.sizes, setup.needs, 1 << 16, classes)
    main = old(setup.sizes, [setup.needs[c] for c in classes], 1 << 16)
    assert new.readers == main.readers and len(new.buckets) == len(main.buckets) > n
    assert new.digest() != "" and new.identical == main.identical
    received = [0] * n
    for b, reader in enumerate(main.readers):
        for m in range(n):
            if m != reader:
                received[m] += run_bytes(run for _, run in main.pieces(b, m))
    row = bench.load_at(setup, n, 50e-6, None)
    assert row["store_data_bytes_once"] and row["store_data_bytes"] == main.union_bytes
    assert row["max_bytes_received_per_rank"] == max(received) > 0


def test_the_counting_store_counts_what_a_real_store_holds():
    """The session's forming and one update over the real rendezvous code, through a store that
    hands every call to a real torch store as well: the keys counted are the keys it holds."""
    real = dist.HashStore()

    class Both(bench.CountingStore):
        def set(self, key, value):
            super().set(key, value)
            real.set(self.prefix + key, value)

        def get(self, key):
            value = super().get(key)
            assert real.get(self.prefix + key) == value
            return value

    created = []
    original = bench.CountingStore

    def make(*args, **kwargs):
        store = Both(*args, **kwargs)
        created.append(store)
        return store

    bench.CountingStore = make  # type: ignore[misc]
    try:
        model = tiny_moe()
        owned = bench.sync_entries(model, 2)
        metas = [{"version": 1, "entries": entries, "gathered": []} for entries in owned]
        counts = bench.store_now(metas, 2, 32, bench.hello_infos(model))
    finally:
        bench.CountingStore = original  # type: ignore[misc]
    assert created[0].counts["keys"] == real.num_keys()
    # hellos (34), the session record and its id; then meta (2), the route and the senders'
    # metadata, each receiver's ready (32), the verdict, done (34), complete, seen (33)
    assert real.num_keys() == 34 + 2 + 2 + 2 + 32 + 1 + 34 + 1 + 33
    # Per member a dozen calls; main's protocol had every member read every member's answers.
    assert counts["update_round_trips"] < 16 * 34
    # Relay chains: the 4 receivers of each of the 8 places are one chain per trainer rank, headed
    # by the first (trainer rank 0) or the second (rank 1) of them: a trainer rank pairs with 8.
    assert counts["peers"][0] == list(range(2, 10)) and counts["peers"][1] == list(range(10, 18))
    assert counts["meta_bytes"] == sum(len(__import__("pickle").dumps(m)) for m in metas)
    assert rendezvous.session_id(created[0]) is not None


def test_the_protocol_reads_grow_with_the_members_not_their_pairs():
    """Main's protocol against the code's, at 8 and 16 trainer ranks to 32 inference ranks: the
    code's update traffic grows with the members and what each one's peers posted."""
    model = tiny_moe()
    infos = bench.hello_infos(model)
    rows = {}
    for trainers in (8, 16):
        metas = [{"version": 1, "entries": e, "gathered": []} for e in bench.sync_entries(model, trainers)]
        rows[trainers] = (bench.store_before(metas, trainers, 32, infos), bench.store_now(metas, trainers, 32, infos))
    for trainers, (before, now) in rows.items():
        world = trainers + 32
        assert before["update_round_trips"] >= world * world  # every member, every member's answers
        assert now["update_round_trips"] < 16 * world + 2 * trainers * 32


def test_todays_sync_replay_gives_each_receiver_exactly_what_it_keeps():
    model = tiny_moe()
    row = bench.sync_at(model, 8, 32, 50e-6)
    spec = ShardingSpec("decoder", BUILTIN_SPECS["decoder"], dict(model.config))
    kept = [sum(kept_slice(TPPlace(bench.TP, slot, spec), i, SyncTensor(name, "BF16", shape, 2 * bench.math.prod(shape))).nbytes
                for i, (name, shape) in enumerate(model.tensors)) for slot in range(bench.TP)]
    assert row["now"]["max_ingress_bytes"] == max(kept)
    # every receiver keeps a TP slice of every tensor: every trainer rank carries bytes for each, and
    # main paired every trainer rank with every receiver; the code sends to one relay chain per place
    # (8 places of 4 receivers: 8 heads per trainer rank) and each place's ring of 4 pairs its neighbours
    assert row["before"]["pairs"] == 8 * 32 and row["now"]["pairs"] == 8 * 8 + 8 * 4
    assert row["now"]["connections_per_process"] < row["before"]["connections_per_process"]
    assert row["now"]["max_egress_bytes"] < row["before"]["max_egress_bytes"]
    assert row["now"]["store_bytes"] < row["before"]["store_bytes"]
    # the redesign: each inference rank keeps its TP slice of the rest and its experts whole
    assert row["redesign"]["max_ingress_bytes"] < row["now"]["max_ingress_bytes"]
    # the code's EP (TP 8 x EP 4, linear): EP rank j keeps experts 16 j .. 16 j + 15 of each layer,
    # each TP-sliced 8 ways (an eighth of its bytes), and its TP slice of the rest; it takes that
    # alone, from the real pairing: the bytes of the redesign's EP 32, experts whole
    per = 64 // bench.EP_SIZE
    experts = [sum(2 * bench.math.prod(shape) for name, shape in model.tensors
                   if bench.expert_of(name) is not None and bench.expert_of(name) // per == j) // bench.TP
               for j in range(bench.EP_SIZE)]
    dense = [k - sum(2 * bench.math.prod(shape) for name, shape in model.tensors if bench.expert_of(name) is not None)
             // bench.TP for k in kept]
    assert row["ep"]["max_ingress_bytes"] == max(d + e for d in dense for e in experts)
    assert row["ep"]["max_ingress_bytes"] == row["redesign"]["max_ingress_bytes"]


def test_headers_are_read_once_per_job_and_every_rank_gets_them_all(setup, monkeypatch):
    """Each object's header read by the one rank it is dealt to (loading/headers.py), and every
    rank's index built from the shares equals one read alone; the harness counts the same."""
    from distload.loading.headers import headers_by_path, read_dealt, read_headers

    monkeypatch.setattr(bench, "FILE_BYTES", 1 << 16)
    index = bench.checkpoint_index(tiny_moe())  # in 10 files
    assert len(index.files) >= 8
    by_path = {f.path: f for f in index.files}
    paths = [f.path for f in index.files] * 2  # a path named twice is still read once
    reads: list[str] = []

    class Store:  # an object store's source, counting the header reads
        remote = True

        def read_headers(self, asked):
            reads.extend(asked)
            return [by_path[p] for p in asked]

    for n in (1, 2, 3, 7):
        reads.clear()
        shares = [read_dealt(Store(), paths, rank, n) for rank in range(n)]  # the planning exchange
        assert sorted(reads) == sorted(by_path)
        for rank in range(n):
            assert read_headers(Store(), list(by_path), headers_by_path(shares)) == list(index.files)
        assert len(reads) == len(by_path)  # nothing read again after the exchange
    row = bench.load_at(setup, 64, 50e-6, None)
    assert row["store_header_reads"] == row["files"] and row["old_store_header_bytes"] == 64 * row["store_header_bytes"]
