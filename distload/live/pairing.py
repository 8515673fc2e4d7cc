"""Who pairs with whom in a weight-sync update: pure decisions, no store, no transport.

A trainer rank and an inference rank form a pair (a process group, distload/live/session.py)
only where the trainer rank holds bytes the inference rank keeps: an expert-parallel receiver
that keeps 8 of 256 experts pairs with the trainer ranks that hold those experts (and whatever
else it keeps), not with every trainer rank. Both members of a pair must decide alike, from the
same data, or one would wait for a peer that never comes:

- an inference rank at a *place* (TP size, TP rank, sharding spec, and with expert parallelism
  its EP rank, size, placement and expert count: its hello's info, in the session record) keeps
  what :func:`carries` says of a trainer rank's entries. The leader (trainer rank 0) reads every
  trainer rank's metadata anyway (it checks that they agree) and posts, per place, the trainer
  ranks that carry bytes for it (:func:`senders`); a trainer rank decides for itself with the
  same function over its own entries (:func:`receivers`);
- an inference rank that says what it keeps with each update (``keeps=``, "cuts") reads every
  trainer rank's metadata (its function is given the whole update) and posts its cuts; a trainer
  rank reads them and both apply :func:`carries` to the same cuts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Sequence

from distload.errors import ConfigError, DistloadError
from distload.live.rendezvous import SessionRecord, member_key
from distload.live.transfer import SyncTensor, carried_scales, kept_slice
from distload.tp.experts import EXPERT_COUNT_KEYS, ExpertPlace, config_experts
from distload.tp.place import TPPlace
from distload.tp.spec import spec_from_json


def carries(entries: Sequence[SyncTensor], place: TPPlace) -> bool:
    """Whether a receiver at ``place`` keeps any byte of ``entries`` (a trainer rank's): then,
    and only then, the two form a pair and bytes move between them. A tensor the place's spec
    cannot cut counts as carried: the receiver must see it to refuse the update, naming it."""
    try:
        carried = carried_scales(entries, place)
    except DistloadError:
        return True
    for index, entry in enumerate(entries):
        try:
            if kept_slice(place, index, entry, carried.get(index)).nbytes:
                return True
        except DistloadError:
            return True
    return False


def place_key(info: Mapping[str, Any], rank: int) -> str | None:
    """A short name for inference rank ``rank``'s place, from its hello ``info``; None for a rank
    that posts cuts with each update (its place is known only then)."""
    if info.get("cuts"):
        return None
    spec = json.dumps(info.get("spec"), sort_keys=True)
    key = f"{info['tp_size']}/{rank % info['tp_size']}/{hashlib.sha1(spec.encode()).hexdigest()[:16]}"
    experts = info.get("experts")  # [EP size, EP rank, placement, expert count], or absent: none
    return key if not experts else key + "/ep" + "/".join(map(str, experts))


def expert_info(place: TPPlace) -> list | None:
    """What a receiver's hello says of its experts (SyncChannel's info; read by :func:`info_place`):
    [EP size, EP rank, placement, expert count], or None without expert parallelism."""
    e = place.experts
    return None if e is None else [e.size, e.rank, e.placement, e.num_experts]


def info_place(info: Mapping[str, Any], rank: int) -> TPPlace:
    """Inference rank ``rank``'s place (not a cuts receiver), from its hello ``info``: its TP rank
    by the rank, its EP rank as it announced it (distload/tp/place.py's mapping, made once, there)."""
    spec = None if info["spec"] is None else spec_from_json(info["spec"])
    experts = info.get("experts")
    place = None
    if experts:  # a member's hello: checked as a local setting is, so a bad one is a clear error
        if not isinstance(experts, (list, tuple)) or len(experts) != 4:
            raise ConfigError(f"inference rank {rank} announced expert parallelism as {experts!r}, not "
                              f"[size, rank, placement, experts]: run the same distload version on both jobs")
        place = ExpertPlace(*experts)
        place.check()
    return TPPlace(info["tp_size"], rank % info["tp_size"], spec, place)


def with_experts(place: TPPlace, role: str, rank: int, size: int, ep_size: int | None, placement: str | None,
                 read_config: Callable[[], Mapping[str, Any]] | None) -> TPPlace:
    """A channel member's ``place`` with its experts: inference rank ``rank`` of ``size`` at EP
    size ``ep_size`` is EP rank ``(rank // T) % P``, as loads place it (TPPlace.of), and knows the
    model's expert count from its config.json (``read_config``): a trainer rank's tensors name
    only some experts, and every member must cut alike."""
    if ep_size is None and placement is None:
        return place
    if role != "inference":
        raise ConfigError("expert_parallel_size places the experts an inference rank keeps; a trainer sends "
                          "whole tensors (pass it on the inference side)")
    layout = TPPlace.of(SimpleNamespace(rank=rank, world_size=size), place.size, place.spec,
                        expert_parallel_size=ep_size, expert_placement_strategy=placement)
    if layout is None or layout.experts is None:  # EP size 1: every expert on every rank
        return place
    experts = layout.experts
    given = config_experts(read_config()) if read_config is not None else None
    if given is None:
        raise ConfigError(f"expert_parallel_size={experts.size}: pass model_config= (the model's config.json, as a "
                          f"dict or a path) giving its routed experts ({' or '.join(EXPERT_COUNT_KEYS)}), so every "
                          f"rank places the same experts")
    count, key = given
    if count % experts.size:
        raise ConfigError(f"expert_parallel_size={experts.size} does not divide the model's {count} routed experts "
                          f"(model_config's {key}), so ranks would hold different numbers of experts")
    return replace(layout, experts=replace(experts, num_experts=count))


def places(record: SessionRecord) -> dict[str, tuple[TPPlace, list[int]]]:
    """Each place of the record's inference ranks (cuts receivers left out): the place and the
    session ranks of the inference ranks at it."""
    out: dict[str, tuple[TPPlace, list[int]]] = {}
    for rank in range(record.inference_size):
        info = record.infos[member_key("inference", rank)]
        key = place_key(info, rank)
        if key is None:
            continue
        if key not in out:
            out[key] = (info_place(info, rank), [])
        out[key][1].append(record.channel_rank("inference", rank))
    return out


def kept_entries(entries: Sequence[SyncTensor], record: SessionRecord, member: int,
                 where: Mapping[str, tuple[TPPlace, list[int]]]) -> set[int] | None:
    """The indices of ``entries`` (a trainer rank's) that session rank ``member`` keeps any of,
    by its place (``where``: the record's :func:`places`); None for a cuts receiver (all of them,
    as far as the leader knows)."""
    key = place_key(record.infos[member_key(*record.member(member))], member - record.trainer_size)
    if key is None or key not in where:
        return None
    place = where[key][0]
    try:
        carried = carried_scales(entries, place)
        return {i for i, entry in enumerate(entries) if kept_slice(place, i, entry, carried.get(i)).kept}
    except DistloadError:  # its ready says why it cannot cut them; count it as keeping all
        return None


def cut_receivers(record: SessionRecord) -> list[int]:
    """The session ranks of the inference ranks that post what they keep with each update."""
    return [record.channel_rank("inference", r) for r in range(record.inference_size)
            if record.infos[member_key("inference", r)].get("cuts")]


def senders(entries_of: Mapping[int, Sequence[SyncTensor]], record: SessionRecord) -> dict[str, list[int]]:
    """The leader's: per place, the trainer ranks (of ``entries_of``: rank -> its entries) that
    carry bytes for it, in rank order."""
    return {key: [t for t in sorted(entries_of) if carries(entries_of[t], place)]
            for key, (place, _) in places(record).items()}


def receivers(entries: Sequence[SyncTensor], record: SessionRecord) -> list[int]:
    """A trainer rank's: the session ranks of the inference ranks (cuts receivers left out) it
    carries bytes for, in rank order."""
    return sorted(rank for place, ranks in places(record).values() if carries(entries, place) for rank in ranks)


# -- relays ---------------------------------------------------------------------------------------
# Receivers at one place keep the same bytes of a trainer rank, so a trainer rank need not send
# them to each: it sends to the first of a *chain*, and each receiver passes every message on to the
# next as soon as it has landed (bucket by bucket: pipelined, so the last one waits a bucket per hop,
# not the whole update). A trainer rank's egress is then its bytes once per chain, not once per
# replica, and a process pairs with the trainer ranks whose chains it heads plus its neighbours in
# the chain: at 256 trainer ranks -> 128 inference ranks at most 51 connections a process, not 257
# (benchmarks/bench_scale.py).
# Same-host receivers are not chained: they read the trainer's segment (handoff.py), written once.
# Both sides derive the chain from the same data (the record, the verdict's ``takes``), and every
# member handles its senders in rank order, so each pair's messages match in order on both sides.


# A chain's members at most. A byte reaches a chain's last member a bucket's transfer per member
# after its first (each passes a bucket on once it has landed), and a trainer rank sends a route's
# messages once per chain: longer chains cost latency, more chains cost the trainer's link and a
# receiver's pairs (each heads chains of about trainer ranks x chains / members). At 16 replicas a
# place (256 -> 128 ranks, TP 8), 3 chains of 5-6: the last member waits 5 buckets (0.05 s of 512 MiB
# at 50 GB/s), a trainer rank sends 3 times its bytes, a receiver pairs with 48 trainer ranks
# (benchmarks/bench_scale.py).
CHAIN_MEMBERS = 6


def near(record: SessionRecord, a: int, b: int) -> bool:
    """Whether session ranks ``a`` and ``b`` posted the same host (a same-host pair hands off through
    memory, handoff.py; a member that forces the socket path posts none)."""
    host = record.infos[member_key(*record.member(a))].get("host")
    return host is not None and host == record.infos[member_key(*record.member(b))].get("host")


def relay(record: SessionRecord, sender: int, members: Sequence[int]) -> tuple[list[int], list[list[int]]]:
    """How ``sender`` (a trainer's session rank) reaches ``members`` (session ranks, in order: the
    receivers of one of its routes, which take the same messages): (those it sends to itself, the
    chains the others pass its messages along, each first to last). The far members, in a ring that
    starts at a different member for each trainer rank (so that the heads, and the trainer ranks'
    pairs, spread over them), are cut into chains of at most CHAIN_MEMBERS: a member's predecessor
    in any chain is its predecessor in the ring, so where every sender's ring holds the same members
    it pairs with two neighbours whatever the sender (the far members of a place take one kind of
    update: chained_takes); a member left out of some rings (it shares a sender's host) gives those
    rings other neighbours, and a few pairs more."""
    direct = [m for m in members if near(record, sender, m)]
    far = [m for m in members if m not in direct]
    if len(far) < 2:
        return direct + far, []
    start = sender % len(far)
    ring = far[start:] + far[:start]
    count = -(-len(ring) // CHAIN_MEMBERS)
    cuts = [len(ring) * k // count for k in range(count + 1)]
    return direct, [ring[a:b] for a, b in zip(cuts, cuts[1:])]


def route_members(record: SessionRecord, me: int, sender: int, takes: Mapping[int, Sequence[int]],
                  where: Mapping[str, tuple[TPPlace, list[int]]] | None = None) -> list[int]:
    """An inference rank's (session rank ``me``, not a cuts receiver): the members of ``sender``'s
    route it is in, as the trainer rank groups them: the inference ranks at its place that take a
    delta from ``sender`` where it does, and a full update where it does. ``where``: the record's
    :func:`places`, if made already."""
    info = record.infos[member_key(*record.member(me))]
    ranks = (where if where is not None else places(record))[place_key(info, me - record.trainer_size)][1]
    mine = sender in takes.get(me, ())
    return [r for r in ranks if (sender in takes.get(r, ())) == mine]


def links(record: SessionRecord, me: int, sender: int, takes: Mapping[int, Sequence[int]],
          where: Mapping[str, tuple[TPPlace, list[int]]] | None = None) -> tuple[int, int | None]:
    """An inference rank's (session rank ``me``): where ``sender``'s messages reach it from (the
    sender, or the member before it in the chain) and whom it passes them on to (None: nobody)."""
    info = record.infos[member_key(*record.member(me))]
    if info.get("cuts"):  # its own cuts: its own route, never chained
        return sender, None
    for chain in relay(record, sender, route_members(record, me, sender, takes, where))[1]:
        if me in chain:
            at = chain.index(me)
            return (sender if at == 0 else chain[at - 1]), (chain[at + 1] if at + 1 < len(chain) else None)
    return sender, None


def chained_takes(record: SessionRecord, takes: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
    """What each inference rank takes, as the leader's verdict says it (``takes``: what each said
    it can take: the trainer ranks whose delta it can patch). A relay chain passes one kind of
    message, so the far members of a place (those a trainer rank does not share a host with) take
    that trainer rank's delta only where every one of them can; else all of them take every byte.
    Without this a member that cannot (new, restarted, its tensors moved) would take every byte
    from every trainer rank straight, one pair each: at 256 -> 128 ranks, 257 connections in the
    process that just restarted. It costs its place's others a full update from those trainer
    ranks, once. Cuts receivers (never chained) and same-host members keep what they said."""
    where = places(record)
    out = {rank: list(took) for rank, took in takes.items()}
    for _, members in where.values():
        for t in sorted({t for m in members for t in takes.get(m, ())}):
            far = [m for m in members if not near(record, t, m)]
            if len(far) > 1 and not all(t in takes.get(m, ()) for m in far):
                for m in far:
                    if t in out.get(m, ()):
                        out[m].remove(t)
    return {rank: took for rank, took in out.items() if took}
