"""An update's agreement over the session's store: who reads what, so that no member but the
leader reads every member's answers (issue 36: at 256 -> 128 ranks, every member reading every
member's was 1.6 GB of store traffic per update).

Every trainer rank posts its metadata (``meta``: version, tensors, buckets). Then:

1. the leader (trainer rank 0) reads all of it and posts the *route* (:func:`post_route`): the
   version, and per receiver place the trainer ranks that carry bytes for it (pairing.py), whose
   metadata it posts again under one key per distinct set of senders (``metas/i``): compressed
   together, the metadata of many trainer ranks takes half the bytes it takes one by one (the
   same names and shapes recur from rank to rank);
2. an inference rank reads the route and the one key of its senders' metadata
   (:func:`read_route`; one that says what it keeps with ``keeps=`` reads every trainer rank's:
   its function is given the whole update, and it posts its ``cuts``), plans, and posts its answer
   (``ready``: what stops it, and the trainer ranks whose delta it takes);
3. the leader reads every inference rank's answer and posts one *verdict* (:func:`post_verdict`):
   why the update is refused (the receivers' problems, trainer ranks that disagree) or None, and
   what every inference rank takes (the trainer ranks route by it, and the members of a relay
   chain derive the chain from it: pairing.py); every other member waits for it
   (:func:`await_verdict`), and a trainer rank then reads the ``cuts`` of its own receivers only.

Each step's store traffic is one key per member plus what the member's peers posted, and the
leader's reads of every member: proportional to the members, not to their pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from distload.live import pairing, rendezvous
from distload.live import refit as refits

SHOWN = 4  # problems listed per rank in a refusal; the rest are counted


@dataclass(frozen=True)
class Verdict:
    """The leader's word on an update, the same on every member."""

    refused: str | None  # why no byte moves, or None
    takes: Mapping[int, Sequence[int]] = field(default_factory=dict)  # inference session rank -> the
    # trainer ranks whose delta it takes (one that takes none is left out): what it said it can
    # take, less what its relay chain cannot (pairing.chained_takes)
    refit: Mapping[int, Sequence[int]] = field(default_factory=dict)  # trainer rank -> the indices of
    # its entries its receivers hold as FP8: it quantizes them before they move (refit.py)


def ready(problems: Sequence[str], takes: Sequence[int], advice: str | None = None,
          refit: Mapping[int, Sequence[int]] | None = None) -> list:
    """An inference rank's answer: what stops it, the trainer ranks whose delta it takes, what
    to do about its problems where one thing explains them all (said once, after them), and per
    trainer rank whose metadata it read the entries its target holds as FP8 (refit.claims)."""
    return [list(problems), list(takes), advice, {t: list(i) for t, i in (refit or {}).items()}]


def post_route(session: Any, meta: Mapping[str, Any], version: int, deadline: float) -> dict[int, Mapping[str, Any]]:
    """The leader's: read every trainer rank's metadata (its own is ``meta``) and post the route.
    Returns the metadata by trainer rank."""
    record = session.record
    trainers = range(1, record.trainer_size)
    metas = {0: meta, **dict(zip(trainers, session.collect("meta", deadline, trainers)))}
    senders = pairing.senders({t: m["entries"] for t, m in metas.items()}, record)
    sets: dict[tuple[int, ...], int] = {}
    for ranks in senders.values():
        sets.setdefault(tuple(ranks), len(sets))
    every = sets.setdefault(tuple(sorted(metas)), len(sets)) if pairing.cut_receivers(record) else None
    for ranks, i in sets.items():
        if ranks:
            session.announce(f"metas/{i}", {t: metas[t] for t in ranks})
    session.announce("route", {"version": version, "every": every,
                               "places": {key: sets[tuple(ranks)] if ranks else None for key, ranks in senders.items()}})
    return metas


def read_route(session: Any, rank: int, every: bool) -> tuple[int, dict[int, Mapping[str, Any]]]:
    """An inference rank's (``rank`` of its side), once the route is posted: the update's version
    and the metadata of the trainer ranks the route names for its place (``every``: of every
    trainer rank), by trainer rank."""
    posted = rendezvous.get(session.store, session.key("route"))
    if every:
        i = posted["every"]
    else:
        info = session.record.infos[rendezvous.member_key("inference", rank)]
        i = posted["places"].get(pairing.place_key(info, rank))
    return posted["version"], {} if i is None else rendezvous.get(session.store, session.key(f"metas/{i}"))


def post_verdict(session: Any, metas: Mapping[int, Mapping[str, Any]], version: int, deadline: float) -> Verdict:
    """The leader's: read every inference rank's answer and post the verdict (returned): why the
    update is refused, the same words on every member, or None, and what each receiver takes. A
    refused update moved no byte: the session stays, and the next update takes the next number."""
    record = session.record
    receivers = range(record.trainer_size, record.world_size)
    refusals = []
    takes = {}
    claimed = {}
    for rank, (problems, took, advice, claims) in zip(receivers, session.collect("ready", deadline, receivers)):
        if took:
            takes[rank] = took
        claimed[rank] = claims
        if problems:
            shown = "; ".join(problems[:SHOWN])
            more = f" (and {len(problems) - SHOWN} more)" if len(problems) > SHOWN else ""
            what = "tensor does not fit" if len(problems) == 1 else "tensors do not fit"
            refusals.append(f"{session.who(rank)}: {len(problems)} {what}: {shown}{more}"
                            + (f"; {advice}" if advice else ""))
    refusals += sender_conflicts([metas[t] for t in sorted(metas)])
    where = pairing.places(record) if any(any(c.values()) for c in claimed.values()) else {}
    refit, mixed = refits.conflicts(claimed, metas, session.who, lambda rank, t: pairing.kept_entries(
        metas[t]["entries"], record, rank, where))
    refusals += mixed
    refused = None
    if refusals:
        refused = (f"update to version {version} refused, nothing was sent (receivers still at their old "
                   f"version): " + " | ".join(refusals))
    takes = pairing.chained_takes(record, takes)  # one kind of message along each relay chain
    session.announce("verdict", [refused, takes, refit])
    if refused is not None:
        session.seq += 1
    return Verdict(refused, takes, refit)


def await_verdict(session: Any, deadline: float) -> Verdict:
    """Every other member's: the leader's verdict (see :func:`post_verdict`)."""
    refused, takes, refit = session.await_posted("verdict", deadline)
    if refused is not None:
        session.seq += 1
    return Verdict(refused, {int(rank): took for rank, took in takes.items()},
                   {int(t): indices for t, indices in refit.items()})


def sender_conflicts(metas: Sequence[Mapping[str, Any]]) -> list[str]:
    """What stops an update on the trainer side (``metas``: every trainer rank's, in rank order)."""
    problems = []
    versions = sorted({m["version"] for m in metas})
    if len(versions) > 1:
        problems.append(f"trainer ranks push different versions ({', '.join(map(str, versions))})")
    owner: dict[str, int] = {}
    twice = []
    for rank, meta in enumerate(metas):
        for entry in meta["entries"]:
            if owner.setdefault(entry.name, rank) != rank:
                twice.append(f"{entry.name} (trainer ranks {owner[entry.name]} and {rank})")
    if twice:
        problems.append(f"{len(twice)} tensor(s) sent by two trainer ranks: {', '.join(twice[:SHOWN])}")
    gathered = {tuple(m["gathered"]) for m in metas}
    if len(gathered) > 1:
        problems.append("trainer ranks hold different DTensors (every trainer rank pushes the same DTensor "
                        "state, in the same order)")
    return problems
