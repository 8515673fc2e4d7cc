"""One exception tree for everything a user can get wrong or a rank can hit.

Every message says what is wrong, where (file, tensor, rank or setting) and, where there is one,
what to do about it. ``assert`` is kept for programmer invariants only.
"""

from __future__ import annotations


class DistloadError(Exception):
    """Base of every error distload raises on purpose."""


class ConfigError(DistloadError, ValueError):
    """A load format, extra-config key or value, device or environment setting is invalid.

    Also a ValueError: vLLM raises ValueError for the same mistakes, and a caller's
    ``except ValueError`` keeps working when it switches to distload.
    """


class CheckpointError(DistloadError):
    """A checkpoint is missing, incomplete or not valid safetensors."""


class ShardLayoutError(CheckpointError):
    """A pre-sharded checkpoint does not match this job's ranks or pattern."""


class ObjectStoreError(CheckpointError):
    """An object store (S3, GCS, Azure Blob) refused or failed a request.

    ``cause`` says which way, for code that wants to branch on it: ``bucket-missing``,
    ``object-missing``, ``access-denied``, ``no-credentials``, ``unreachable`` or ``other``. The
    message names the URI, the cause and the endpoint, never a credential.
    """

    CAUSES = ("bucket-missing", "object-missing", "access-denied", "no-credentials", "unreachable", "other")

    def __init__(self, message: str, cause: str = "other"):
        super().__init__(message)
        self.cause = cause if cause in self.CAUSES else "other"

    def __reduce__(self):  # picklable with its cause (errors travel between ranks)
        return (type(self), (str(self), self.cause))


class ReloadError(DistloadError):
    """An in-place reload was refused (the model and the checkpoint do not fit) or failed."""


class SyncError(DistloadError):
    """A weight-sync update was refused or failed; the receiver's version did not advance."""


class UpdateRefused(SyncError):
    """A weight-sync update every member refused before any byte moved (a receiver's tensors do
    not fit what it keeps, or the trainer ranks disagree): every version is unchanged and the
    channel's session stays, so the next push needs no reconnect. The message names each rank's
    problems and what to do."""


class BackendUnavailableError(DistloadError):
    """A backend cannot run on this machine (missing package, no CUDA, ...)."""


class GroupError(DistloadError):
    """The ranks of a group disagree, or one of them failed."""


class RankFailedError(GroupError):
    """Raised on every rank when one or more ranks failed a step.

    ``failures`` maps each failing rank to the message of its error, so a caller (or the report)
    can show exactly which rank broke and why.
    """

    def __init__(self, step: str, failures: dict[int, str]):
        self.step = step
        self.failures = dict(sorted(failures.items()))
        ranks = ", ".join(str(rank) for rank in self.failures)
        super().__init__(f"{step} failed on rank(s) {ranks}:\n  " + "\n  ".join(failure_lines(self.failures)))


def rank_list(ranks: "list[int]") -> str:
    """``rank 3``, or ``ranks 0-7`` / ``ranks 0, 2, 5`` for several (runs of 3 or more collapsed)."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    parts, start = [], 0
    for i in range(1, len(ranks) + 1):
        if i == len(ranks) or ranks[i] != ranks[i - 1] + 1:
            run = ranks[start:i]
            parts.append(f"{run[0]}-{run[-1]}" if len(run) >= 3 else ", ".join(map(str, run)))
            start = i
    return "ranks " + ", ".join(parts)


def failure_lines(failures: "dict[int, str]") -> list[str]:
    """One line per distinct message, naming the ranks that had it: 64 ranks failing the same way
    make one line, not 64 copies of it."""
    by_message: dict[str, list[int]] = {}
    for rank, message in sorted(failures.items()):
        by_message.setdefault(message, []).append(rank)
    return [f"{rank_list(ranks)}: {message}" for message, ranks in by_message.items()]


# How far an error raised outside any agreement step is known to reach: "job" where every rank
# raises it alike (it depends only on what every rank was given: the command line, the group's
# size), "node" where every rank of one node does (its environment, its devices). The command
# line prints such an error once, by rank 0, where that covers the whole job; an error agreed
# between the ranks (WorkerGroup.agree) carries what each rank said instead (``job_failures``).
EVERY_RANK_ATTRIBUTE = "raised_on_every_rank"


def on_every_rank(exc: BaseException, scope: str = "job") -> BaseException:
    """Mark ``exc`` as raised alike on every rank of the job (``scope`` "job") or of its node
    ("node"); returns it, to be raised."""
    assert scope in ("job", "node"), scope
    setattr(exc, EVERY_RANK_ATTRIBUTE, scope)
    return exc
