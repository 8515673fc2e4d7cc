"""Sleep and wake: memory really released (RSS), values back bit for bit, objects still valid."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import distload
from distload.errors import ConfigError, DistloadError
from distload.live.sleep import WeightSleeper

from conftest import write_whole


def test_level1_restores_values_and_keeps_objects():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    model[1].weight = model[0].weight  # tied: one storage
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    versions = [p._version for p in params]
    sleeper = WeightSleeper(model)
    released = sleeper.sleep(1)
    assert released == sum(p.numel() * p.element_size() for p in params)  # the tied storage once
    assert sleeper.asleep and all(p.untyped_storage().nbytes() == 0 for p in params)
    assert sleeper.wake() == released
    assert list(model.parameters()) == params  # the very same objects
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model[1].weight.data_ptr() == model[0].weight.data_ptr()  # still tied after wake
    # The wake's writes (through the storages) count as writes to the tensors: a weight-sync
    # receiver then takes its next update whole, not a delta over what the wake put back.
    assert all(p._version > v for p, v in zip(params, versions))


def test_level2_drops_then_reload_fills(tmp_path):
    model = torch.nn.Linear(16, 8)
    ckpt = {"weight": torch.randn(8, 16), "bias": torch.randn(8)}
    write_whole(str(tmp_path / "ck"), ckpt, num_files=1)
    sleeper = WeightSleeper(model)
    sleeper.sleep(2)
    sleeper.wake()
    assert float(model.weight.detach().abs().sum()) == 0.0  # zero-filled, not garbage
    with distload.WorkerGroup(device="cpu") as group:
        from distload.live.reload import reload_into

        reload_into(model, str(tmp_path / "ck"), "safetensors", group=group)
    assert torch.equal(model.weight.detach(), ckpt["weight"]) and torch.equal(model.bias.detach(), ckpt["bias"])


def test_misuse_is_refused():
    sleeper = WeightSleeper({"w": torch.ones(4)})
    with pytest.raises(ConfigError, match="sleep level must be 1"):
        sleeper.sleep(3)
    with pytest.raises(DistloadError, match="not asleep"):
        sleeper.wake()
    sleeper.sleep(1)
    with pytest.raises(DistloadError, match="already asleep at level 1"):
        sleeper.sleep(2)
    sleeper.wake()


_RSS_SCRIPT = r"""
import json, sys, torch, psutil
from distload.live.sleep import WeightSleeper
level = int(sys.argv[1])
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(12)])  # ~192 MiB
with torch.no_grad():
    model[0].weight.fill_(1.5)
proc = psutil.Process()
awake = proc.memory_info().rss
sleeper = WeightSleeper(model)
released = sleeper.sleep(level)
asleep = proc.memory_info().rss
sleeper.wake()
woke = proc.memory_info().rss
print(json.dumps({"released": released, "awake": awake, "asleep": asleep, "woke": woke,
                  "value": float(model[0].weight[0, 0])}))
"""


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_resident_memory(level):
    """In a fresh process, so the numbers are this model's alone."""
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(level)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["released"] > 190 * 2**20
    # At least 80% of the weights' bytes leave the resident set while asleep...
    assert r["awake"] - r["asleep"] > 0.8 * r["released"], r
    # ...and come back on wake, with the values (level 1) or zeros (level 2).
    assert r["woke"] - r["asleep"] > 0.8 * r["released"], r
    assert r["value"] == (1.5 if level == 1 else 0.0)


@pytest.mark.parametrize("fmt", ["safetensors", "runai_streamer", "dummy"])
def test_loaded_and_digested_tensors_can_sleep(tmp_path, fmt):
    """Nothing on a load path (digest included) may pin a storage: a numpy view would make it
    non-resizable for good, and sleep could never release it."""
    from distload.loading.report import state_digest

    from conftest import every_dtype_state

    write_whole(str(tmp_path / "ck"), every_dtype_state(), num_files=2)
    with distload.WorkerGroup(device="cpu") as group:
        state = distload.load(str(tmp_path / "ck"), fmt, group=group)
    digest = state_digest(state)
    sleeper = WeightSleeper(state)
    sleeper.sleep(1)
    sleeper.wake()
    assert state_digest(state) == digest
