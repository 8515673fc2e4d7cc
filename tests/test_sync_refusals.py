"""Channel members as threads of one process (each its own channel, store client and groups): what
stops an update must end it on every member at once, never leave one waiting its timeout."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch

from distload.errors import SyncError
from distload.live.channel import SyncChannel

from dist_helpers import free_port

TIMEOUT_S = 30.0


def _run(calls):
    """Run each (name, fn) in its own thread; name -> (seconds, result or exception)."""
    def timed(fn):
        start = time.monotonic()
        try:
            return time.monotonic() - start, fn()
        except Exception as exc:  # noqa: BLE001 - what the test looks at
            return time.monotonic() - start, exc
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        futures = {name: pool.submit(timed, fn) for name, fn in calls}
        return {name: f.result(timeout=2 * TIMEOUT_S) for name, f in futures.items()}


def test_a_tensor_the_receivers_spec_cannot_cut_is_refused_everywhere():
    """TP 2 'plain' cannot split 3 rows in two: the receivers refuse (their own words), the
    trainer's push says so, and nobody waits for the timeout."""
    address = f"tcp://127.0.0.1:{free_port()}"
    trainer = SyncChannel(address, "trainer", rank=0, size=1, device="cpu", timeout_s=TIMEOUT_S)
    receivers = [SyncChannel(address, "inference", rank=r, size=2, device="cpu", timeout_s=TIMEOUT_S,
                             tensor_parallel_size=2, sharding="plain",
                             model_config={"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 1})
                 for r in range(2)]
    state = {"model.layers.0.mlp.up_proj.weight": torch.ones(3, 4)}
    held = {"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 4)}
    try:
        out = _run([("trainer", lambda: trainer.push(state, 1))]
                   + [(f"inference{r}", lambda ch=ch: ch.receive(dict(held))) for r, ch in enumerate(receivers)])
    finally:
        for channel in receivers + [trainer]:
            channel.close()
    for name, (seconds, result) in out.items():
        assert isinstance(result, SyncError), (name, result)
        assert "refused, nothing was sent" in str(result) and "up_proj" in str(result), (name, result)
        assert seconds < TIMEOUT_S / 3, (name, seconds)
    assert all(ch.version is None and ch.consistent for ch in receivers)


def test_a_session_the_leader_cannot_form_fails_its_members_at_once():
    """Inference ranks started with different world sizes: the leader refuses to form the session,
    and the member whose hello it read hears why at once instead of waiting its timeout."""
    address = f"tcp://127.0.0.1:{free_port()}"
    trainer = SyncChannel(address, "trainer", rank=0, size=1, device="cpu", timeout_s=TIMEOUT_S)
    first = SyncChannel(address, "inference", rank=0, size=2, device="cpu", timeout_s=TIMEOUT_S)
    odd = SyncChannel(address, "inference", rank=1, size=3, device="cpu", timeout_s=TIMEOUT_S)
    held = {"w": torch.zeros(4)}
    try:
        out = _run([("inference0", lambda: first.receive(dict(held))),
                    ("inference1", lambda: odd.receive(dict(held), timeout_s=8)),
                    ("trainer", lambda: (time.sleep(0.5), trainer.push({"w": torch.ones(4)}, 1)))])
    finally:
        for channel in (first, odd, trainer):
            channel.close()
    seconds, error = out["trainer"]
    assert isinstance(error, SyncError) and "inference rank 1 says its job has 3 ranks" in str(error), error
    seconds, error = out["inference0"]
    assert isinstance(error, SyncError) and "trainer rank 0 could not form the sync session" in str(error), error
    assert seconds < TIMEOUT_S / 3, seconds


@pytest.mark.parametrize("bad", [[1, 2], {"w": "not a tensor"}])
def test_push_of_something_that_is_not_a_state_dict_says_so(bad):
    address = f"tcp://127.0.0.1:{free_port()}"
    with SyncChannel(address, "trainer", rank=0, size=1, device="cpu", timeout_s=5) as trainer:
        trainer._join = lambda deadline: None  # the check comes before any member is needed
        with pytest.raises(Exception) as caught:
            trainer.push(bad, 1)
    assert "state dict" in str(caught.value) or "not a tensor" in str(caught.value)
