"""Cross-rank agreement on a read, before any tensor data moves.

Every rank of the group must have taken the same read choice, and ranks that share a read
must hold the identical file list (path, size, and for local files a content fingerprint): Run:ai's
distributed mode silently hands ranks each other's data otherwise.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from distload.errors import GroupError
from distload.loading.backends import BACKENDS
from distload.loading.choice import ReadChoice

if TYPE_CHECKING:
    from distload.workers.group import WorkerGroup
    from distload.loading.plan import RankPlan


def agree_on_read(group: "WorkerGroup", plan: "RankPlan") -> tuple[tuple[int, ...], tuple[dict, ...]]:
    """Collective over ``group``: the same choice everywhere, identical lists where ranks read
    in a shared read. Returns, for a backend that shares reads, the ranks that read this rank's files
    with it (this one included; on its node only for the ``node`` scope) and what each of them
    keeps (``RankPlan.slice_runs``, in the same order; members that keep the same slices share
    one mapping); else ((), ()).

    By digest: every rank sends every other one its choice, host and the digests of its file
    list, share key and slices (a few hundred bytes, whatever the checkpoint), not the lists and
    slices themselves (a 1T checkpoint's slices, to a thousand ranks, were megabytes each). A
    second exchange, only for a shared read, carries each distinct set of slices once (from the
    first rank that keeps it: a TP-8 load keeps 8, however many ranks); the file lists travel
    whole only where some digests differ, for the error that names what differs."""
    shares = plan.choice.shared and BACKENDS[plan.choice.backend].shares_reads
    runs = plan.slice_runs() if shares else None  # only a shared read needs the others' slices
    signature = plan.signature()
    everyone = group.exchange(read_facts(plan.choice, signature, plan.share_key(), group.hostname, runs))
    choices = {rank: choice for rank, (choice, _, _, _, _) in enumerate(everyone)}
    if len(set(choices.values())) > 1:
        raise GroupError(
            "ranks chose different readers for the same load: "
            + "; ".join(f"rank {r}: {_describe(c)}" for r, c in choices.items())
            + ". Every rank must run the same command with the same extra config."
        )
    if not plan.choice.shared:
        return (), ()
    keys = [(key, host) for _, _, key, host, _ in everyone]
    # Who compares file lists with whom: a shared read's members, else the whole group.
    scope = plan.choice.scope if shares else "job"
    circles = keys if shares else [((), "")] * len(everyone)
    differ_somewhere = _differ_somewhere([facts[1] for facts in everyone], circles, scope)
    members = member_ranks(keys, group.rank, scope) if shares else tuple(range(group.world_size))
    first = {}  # runs digest -> the first rank that keeps those slices: it sends them
    for r, facts in enumerate(everyone):
        first.setdefault(facts[4], r)
    extra: list = [None] * group.world_size
    if shares or differ_somewhere:
        extra = group.exchange((signature if differ_somewhere else None,
                                runs if shares and first[everyone[group.rank][4]] == group.rank else None))
    if differ_somewhere:
        compared = list(members)
        differing = mismatched_ranks([extra[r][0] for r in compared], compared)
        if differing:
            details = "; ".join(f"rank {r} {what}" for r, what in differing.items())
            raise GroupError(
                f"shared read refused: every rank must read the identical file list, but {details}. Make the checkpoint visible at the same path with the "
                f"same files on every node, or let each rank read alone (extra config distributed=false)."
            )
    if not shares:
        return (), ()
    return members, tuple(extra[first[everyone[r][4]]][1] for r in members)


def read_facts(choice: ReadChoice, signature: list[tuple], share_key: tuple, host: str,
               runs: dict | None) -> tuple:
    """What one rank sends every other in the agreement: its choice and host, and digests of its
    file list, share key and slices (None: no slices travel)."""
    return (choice, _digest(signature), _digest(share_key), host, None if runs is None else _digest(runs))


def _digest(value: object) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()


def _differ_somewhere(signatures: list[str], circles: list[tuple], scope: str) -> bool:
    """Whether any two ranks of one circle (equal share key, and host for the ``node`` scope)
    hold file lists of different digests: every rank sees the same, so all of them exchange the
    lists whole together."""
    seen: dict[tuple, str] = {}
    for signature, (key, host) in zip(signatures, circles):
        circle = (key, host if scope == "node" else "")
        if seen.setdefault(circle, signature) != signature:
            return True
    return False


def member_ranks(needs: list[tuple[tuple, str]], rank: int, scope: str) -> tuple[int, ...]:
    """The ranks that read ``rank``'s files with it: ``needs`` holds every rank's share key (equal
    where ranks read the same files) and host; the ``node`` scope keeps those on ``rank``'s host."""
    key, host = needs[rank]
    return tuple(r for r, (other_key, other_host) in enumerate(needs)
                 if other_key == key and (scope == "job" or other_host == host))


def _describe(choice: ReadChoice) -> str:
    return (f"{choice.backend} ({'per-rank shards' if choice.sharded else 'whole checkpoint'}"
            f"{f', shared per {choice.scope}' if choice.shared else ''})")


def mismatched_ranks(signatures: list[list[tuple]], ranks: list[int] | None = None) -> dict[int, str]:
    """Ranks whose file list differs from the first one's, with what differs (for a clear error).

    A signature lists ``(path, size)`` or ``(path, size, content fingerprint)`` per file;
    ``ranks``: the rank of each signature (default 0, 1, ...).
    """
    ranks = list(range(len(signatures))) if ranks is None else ranks
    first = ranks[0]
    def as_map(signature: list[tuple]) -> dict[str, tuple[int, str]]:
        return {item[0]: (item[1], item[2] if len(item) > 2 else "") for item in signature}

    reference = signatures[0]
    differing: dict[int, str] = {}
    for rank, signature in zip(ranks[1:], signatures[1:]):
        if signature == reference:
            continue
        ref, own = as_map(reference), as_map(signature)
        only_here = sorted(set(own) - set(ref))
        only_ref = sorted(set(ref) - set(own))
        common = set(own) & set(ref)
        sizes = sorted(p for p in common if own[p][0] != ref[p][0])
        contents = sorted(p for p in common if own[p][0] == ref[p][0] and own[p][1] != ref[p][1])
        what = []
        if only_here:
            what.append(f"has {only_here} that rank {first} lacks")
        if only_ref:
            what.append(f"lacks {only_ref} that rank {first} has")
        if sizes:
            what.append(f"sees other sizes for {sizes}")
        if contents:
            what.append(f"sees other contents (same size, different bytes) for {contents}")
        if not what:
            what.append("lists the same files in another order")
        differing[rank] = "; ".join(what)
    return differing


