"""The same-host handoff's parts in one process (distload/live/handoff.py): the order of a
message's keys, a segment that grows, the decision to keep the socket, and /dev/shm left clean.
Real processes handing off are tests/test_sync_jobs.py's and tests/test_sync_failures.py's."""

from __future__ import annotations

import glob
import os

import pytest
import torch
import torch.distributed as dist

from distload.errors import ConfigError, SyncError
from distload.live import handoff


def _files(segment) -> list[str]:
    return glob.glob(os.path.join(handoff.SHM_DIR, f"{handoff.PREFIX}*-{os.getpid()}-{segment.nonce[:8]}"))


def test_a_message_is_read_only_once_posted_and_its_place_reused_only_once_released():
    store = dist.HashStore()
    segment = handoff._HostSegment("t")
    try:
        assert len(_files(segment)) == 1
        mapping = handoff._HostMapping(segment.where())
        segment.unlink()  # what form() does once every receiver answered: the mapping stays
        assert _files(segment) == []
        trainer, receiver = handoff.Lane(store, 0, 1, segment=segment), handoff.Lane(store, 0, 1, mapping=mapping)
        region = segment.region(("send", 0, 0), 1000)
        got = receiver.post(None, 1000)
        region.copy_(torch.arange(1000) % 251)
        assert not got.is_completed()  # written but not posted: the receiver never takes it
        sent = trainer.post(region)
        assert got.is_completed() and not sent.is_completed()
        got.wait()
        assert torch.equal(got.data, torch.arange(1000) % 251)
        assert not sent.is_completed()  # still being read: the trainer may not write there yet
        got.release()
        assert sent.is_completed() and sent.wait()

        # A region bigger than the segment grows it; the receiver maps the rest when it gets there.
        big = segment.region(("send", 0, 1), 3 << 20)
        big.fill_(7)
        into = torch.zeros(3 << 18, dtype=torch.int32)
        copied = receiver.post(into)
        trainer.post(big)
        copied.wait()  # copied into ``into`` and released at once
        assert torch.equal(into.view(torch.uint8), big) and trainer.works[-1].is_completed()

        # A receive that the session gave up (its trainer gone) never lands: it ends as failed.
        late = receiver.post(torch.zeros(8, dtype=torch.uint8))
        receiver.close()
        assert late.is_completed() and late.exception() is not None
        with pytest.raises(SyncError, match="session ended"):
            late.wait()
    finally:
        segment.close()
    assert _files(segment) == []


def test_a_segment_that_is_not_the_offered_one_keeps_the_socket():
    """Another /dev/shm (a file of that name missing, or holding another nonce) is a decision to
    keep the socket, with the reason; no lane is made."""
    segment = handoff._HostSegment("t")
    try:
        lanes: dict = {}
        where = segment.where()
        wrong = handoff._map({**where, "nonce": "0" * 32}, "shm", torch.device("cpu"), lanes, None, 0, 1)
        missing = handoff._map({**where, "path": where["path"] + "-gone"}, "shm", torch.device("cpu"), lanes, None,
                               0, 1)
        assert "another segment" in wrong and "No such file" in missing and not lanes
        assert handoff._map(where, "shm", torch.device("cpu"), lanes, dist.HashStore(), 0, 1) == "ok" and 0 in lanes
        lanes[0].close()
    finally:
        segment.close()


def test_the_socket_path_is_forced_by_the_option_or_the_environment(monkeypatch):
    monkeypatch.delenv(handoff.TRANSPORT_ENV, raising=False)
    assert handoff.transport_choice("auto") == "auto" and handoff.transport_choice("socket") == "socket"
    monkeypatch.setenv(handoff.TRANSPORT_ENV, "socket")
    assert handoff.transport_choice("auto") == "socket"
    monkeypatch.setenv(handoff.TRANSPORT_ENV, "pigeon")
    with pytest.raises(ConfigError, match=handoff.TRANSPORT_ENV):
        handoff.transport_choice("auto")
    with pytest.raises(ConfigError, match="transport must be one of auto, socket"):
        handoff.transport_choice("shm")
