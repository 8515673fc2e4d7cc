"""Who pairs with whom in a weight-sync update: pure decisions, no store, no transport.

A trainer rank and an inference rank form a pair (a process group, distload/live/session.py)
only where the trainer rank holds bytes the inference rank keeps: an expert-parallel receiver
that keeps 8 of 256 experts pairs with the trainer ranks that hold those experts (and whatever
else it keeps), not with every trainer rank. Both members of a pair must decide alike, from the
same data, or one would wait for a peer that never comes:

- an inference rank at a *place* (TP size, TP rank, sharding spec: its hello's info, in the
  session record) keeps what :func:`carries` says of a trainer rank's entries. The leader
  (trainer rank 0) reads every trainer rank's metadata anyway (it checks that they agree) and
  posts, per place, the trainer ranks that carry bytes for it (:func:`senders`); a trainer rank
  decides for itself with the same function over its own entries (:func:`receivers`);
- an inference rank that says what it keeps with each update (``keeps=``, "cuts") reads every
  trainer rank's metadata (its function is given the whole update) and posts its cuts; a trainer
  rank reads them and both apply :func:`carries` to the same cuts.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, Sequence

from distload.errors import DistloadError
from distload.live.rendezvous import SessionRecord, member_key
from distload.live.transfer import SyncTensor, kept_slice
from distload.tp.place import TPPlace
from distload.tp.spec import spec_from_json


def carries(entries: Sequence[SyncTensor], place: TPPlace) -> bool:
    """Whether a receiver at ``place`` keeps any byte of ``entries`` (a trainer rank's): then,
    and only then, the two form a pair and bytes move between them. A tensor the place's spec
    cannot cut counts as carried: the receiver must see it to refuse the update, naming it."""
    for index, entry in enumerate(entries):
        try:
            if kept_slice(place, index, entry).nbytes:
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
    return f"{info['tp_size']}/{rank % info['tp_size']}/{hashlib.sha1(spec.encode()).hexdigest()[:16]}"


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
            spec = None if info["spec"] is None else spec_from_json(info["spec"])
            out[key] = (TPPlace(info["tp_size"], rank % info["tp_size"], spec), [])
        out[key][1].append(record.channel_rank("inference", rank))
    return out


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
