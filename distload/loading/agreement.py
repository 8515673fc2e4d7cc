"""Cross-rank agreement on a read, before any tensor data moves.

Every rank of the group must have taken the same read choice, and ranks that read cooperatively
must hold the identical file list (path, size, and for local files a content fingerprint): Run:ai's
distributed mode silently hands ranks each other's data otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distload.errors import GroupError
from distload.loading.choice import ReadChoice

if TYPE_CHECKING:
    from distload.group import WorkerGroup
    from distload.loading.plan import RankPlan


def agree_on_read(group: "WorkerGroup", plan: "RankPlan") -> None:
    """Collective over ``group``: the same choice everywhere, identical lists if cooperative."""
    everyone = group.exchange((plan.choice, plan.signature()))
    choices = {rank: choice for rank, (choice, _) in enumerate(everyone)}
    if len(set(choices.values())) > 1:
        raise GroupError(
            "ranks chose different readers for the same load: "
            + "; ".join(f"rank {r}: {_describe(c)}" for r, c in choices.items())
            + ". Every rank must run the same command with the same extra config."
        )
    if not plan.choice.cooperative:
        return
    differing = mismatched_ranks([signature for _, signature in everyone])
    if differing:
        details = "; ".join(f"rank {r} {what}" for r, what in differing.items())
        raise GroupError(
            f"cooperative read refused: every rank must read the identical file list, but {details}. "
            f"Make the checkpoint visible at the same path with the same files on every node, or "
            f"read without cooperation (extra config distributed=false)."
        )


def _describe(choice: ReadChoice) -> str:
    return (f"{choice.backend} ({'per-rank shards' if choice.sharded else 'whole checkpoint'}"
            f"{', cooperative' if choice.cooperative else ''})")


def mismatched_ranks(signatures: list[list[tuple]]) -> dict[int, str]:
    """Ranks whose file list differs from rank 0's, with what differs (for a clear error).

    A signature lists ``(path, size)`` or ``(path, size, content fingerprint)`` per file.
    """
    def as_map(signature: list[tuple]) -> dict[str, tuple[int, str]]:
        return {item[0]: (item[1], item[2] if len(item) > 2 else "") for item in signature}

    reference = signatures[0]
    differing: dict[int, str] = {}
    for rank, signature in enumerate(signatures[1:], start=1):
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
            what.append(f"has {only_here} that rank 0 lacks")
        if only_ref:
            what.append(f"lacks {only_ref} that rank 0 has")
        if sizes:
            what.append(f"sees other sizes for {sizes}")
        if contents:
            what.append(f"sees other contents (same size, different bytes) for {contents}")
        if not what:
            what.append("lists the same files in another order")
        differing[rank] = "; ".join(what)
    return differing


