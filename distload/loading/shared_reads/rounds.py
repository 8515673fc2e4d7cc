"""The round engine of shared reads: every byte read once, in rounds, and every failure on any rank
heard by every rank before data moves.

Shared reads of a load (``stream.py``) and ``distload pull`` (distload/checkpoints/pull.py) run
the same rounds; in each, every rank reads its share and sends it to the ranks that need it:

1. each rank starts the reads of its share ``ahead`` rounds before the round it belongs to;
2. ``prepare(r)``: each rank waits for this round's reads and does everything else that can fail
   before a message travels (packing its messages, making room for those it receives);
3. every rank of the group says whether it is fine (one exchange on the control group, with the
   payloads of ``WorkerGroup.check_all_ok`` and ``report_failure``): a failure on one rank, or a
   rank that failed elsewhere and reported it, ends every rank at this point, naming it; nobody
   waits for a message that never comes (after this point only a lost rank can fail a round);
4. the round is handed to the caller, which moves its data and consumes it.

Every rank of the group runs the same number of rounds, so the exchanges pair up.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Iterator, TypeVar

from distload.errors import DistloadError, GroupError, RankFailedError

if TYPE_CHECKING:
    from distload.workers.group import WorkerGroup

READ_AHEAD_ROUNDS = 2  # a load's members read this many rounds of their buckets ahead of the sends

T = TypeVar("T")


def describe_failure(exc: BaseException) -> str:
    """A failure as the other ranks hear it (as ``WorkerGroup.report_failure`` words it)."""
    return str(exc) if isinstance(exc, DistloadError) else f"{type(exc).__name__}: {exc}"


def agree(group: "WorkerGroup", step: Callable[[], T], what: str,
          describe: Callable[[BaseException], str] = describe_failure) -> list[T]:
    """``step()`` on this rank, then every rank's result; a failure anywhere ends every rank here.

    The payloads are those of check_all_ok and report_failure, so a rank that failed outside the
    read and reported it is heard here too. An exception raised here has been reported to every
    rank already: it carries ``reported = True``, and the loader does not report it again.
    ``describe``: the words the other ranks get for this rank's failure."""
    try:
        value = step()
    except BaseException as exc:
        if group.world_size > 1:
            try:
                group.exchange((False, describe(exc)), explain=False)
            except GroupError:
                pass  # the others are gone; this rank's own error is what matters
        _mark_reported(exc)
        raise
    statuses = group.exchange((True, value))
    failures = {rank: message for rank, (ok, message) in enumerate(statuses) if not ok}
    if failures:
        error = RankFailedError(what, failures)
        _mark_reported(error)
        raise error
    return [value for _, value in statuses]


def _mark_reported(exc: BaseException) -> None:
    try:
        exc.reported = True  # type: ignore[attr-defined]
    except AttributeError:  # an exception type without a __dict__: the loader reports it again
        pass


def run_rounds(group: "WorkerGroup", rounds: int, what: str, start: Callable[[int], None],
               prepare: Callable[[int], T], ahead: int = READ_AHEAD_ROUNDS,
               describe: Callable[[BaseException], str] = describe_failure,
               source: str | None = None) -> Iterator[T]:
    """Rounds ``0 .. rounds - 1`` (the same count on every rank of ``group``): ``start(r)``
    starts this rank's reads of round r (once each, ``ahead`` rounds early), ``prepare(r)`` makes
    round r ready to move, and every rank agrees on it (``what`` names the step in the error)
    before it is yielded: the caller then moves the round's data and consumes it.

    ``source``: where the reads go (an object store's endpoint, say). A rank whose reads there
    are slow or stalled, though its connection stays alive, holds up every other rank at the
    round's agreement until the group's timeout; the error that ends them then names the source
    and how long this rank's own reads of the round took, so that a slow link to the store is
    told from a lost rank."""
    started = 0
    for r in range(rounds):
        prepared: list[T] = []

        def step() -> None:
            # All that can fail on this rank comes before any message travels, so that every rank
            # hears of it here instead of waiting for a message that never comes.
            nonlocal started
            while started < min(rounds, r + ahead + 1):
                start(started)
                started += 1
            prepared.append(prepare(r))
            took.append(time.monotonic() - began)

        began, took = time.monotonic(), []
        try:
            agree(group, step, what, describe)
        except GroupError as exc:
            if source is None or not took or isinstance(exc, RankFailedError):
                raise  # this rank's own step failed, or a rank said why it failed: nothing to add
            raise GroupError(f"{exc}; round {r + 1} of {rounds} waited for every rank's reads from {source} "
                             f"(this rank's took {took[0]:.1f} s): a rank whose reads from there "
                             f"are slow or stalled holds up the others until the timeout") from exc
        yield prepared[0]
