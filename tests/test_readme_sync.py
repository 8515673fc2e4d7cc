"""The README's "Weight sync between jobs" code block, run as written across two hosts.

The block is taken from README.md itself; the cluster's hosts are named as the README names the
trainer's (``trainer-host``), its checkpoint path is this test's small Llama-shaped one, and
``model``/``step`` are the trainer's. Every inference rank must end holding exactly its TP slices
of what the trainer pushed. A target that holds whole tensors is refused before any byte moves,
with the public UpdateRefused and one line that says what the target must hold.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cluster import Cluster, require_cluster

ROOT = Path(__file__).resolve().parents[1]
SECRET = "readme-test-secret-" + "z" * 30


def _readme_block() -> tuple[str, str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Weight sync between jobs"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    header, jobs = block.split("# trainer job")  # the imports and the note, for both jobs
    trainer, inference = jobs.split("# inference job")
    return header + "# trainer job" + trainer, header + "# inference job" + inference


_TRAINER = '''
import sys, torch
from safetensors.torch import load_file
ckpt = sys.argv[1]

class Model:  # the trainer's model: the checkpoint, one step moved
    def __init__(self):
        self.weights = {n: (t.float() * 1.5 + 0.25).to(t.dtype) for n, t in load_file(ckpt + "/model.safetensors").items()}
    def state_dict(self):
        return self.weights

model, step = Model(), 1
from safetensors.torch import save_file
save_file(model.state_dict(), sys.argv[2] + ".tmp")  # what it pushes, for the check: there before the push
__import__("os").replace(sys.argv[2] + ".tmp", sys.argv[2])
{code}
channel.close()
'''

_INFERENCE = '''
import json, sys, torch
{code}
import distload as _d
from distload.cli.sync_demo import kept_slices
from safetensors.torch import load_file
import torch.distributed as dist
rank = int(__import__("os").environ["RANK"])
pushed = load_file(sys.argv[2])
want = kept_slices(pushed, 2, rank % 2, hidden=int(sys.argv[3]))
exact = sorted(want) == sorted(state) and all(torch.equal(state[n], want[n]) for n in want)
print(json.dumps({{"rank": rank, "exact": exact, "version": channel.version}}), flush=True)
channel.close()
'''


def _checkpoint(folder: Path, hidden: int) -> None:
    from distload.cli.sync_demo import demo_config, demo_state

    folder.mkdir()
    save_file(demo_state(8, 0, torch.device("cpu"), hidden), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(demo_config(hidden)))


@pytest.mark.dist
@pytest.mark.slow
def test_the_readme_sync_example_runs_as_written_across_two_hosts(tmp_path):
    require_cluster()
    hidden = 256
    ckpt = tmp_path / "Llama-3-8B"
    _checkpoint(ckpt, hidden)
    trainer_code, inference_code = (c.replace("/models/Llama-3-8B", str(ckpt)) for c in _readme_block())
    trainer_script = tmp_path / "trainer.py"
    trainer_script.write_text(_TRAINER.replace("{code}", textwrap.dedent(trainer_code)))
    inference_script = tmp_path / "inference.py"
    inference_script.write_text(_INFERENCE.format(code=textwrap.dedent(inference_code)))
    pushed = tmp_path / "pushed.safetensors"
    env = {"DISTLOAD_SECRET": SECRET, "OMP_NUM_THREADS": "1"}
    with Cluster(["trainer-host", "inference-host"], rate_bits_per_s=1e9) as cluster:
        trainer = cluster["trainer-host"].run([sys.executable, str(trainer_script), str(ckpt), str(pushed)], env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        inference = cluster["inference-host"].run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             str(inference_script), str(ckpt), str(pushed), str(hidden)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        trainer_out, _ = trainer.communicate(timeout=180)
        inference_out, _ = inference.communicate(timeout=180)
    assert trainer.returncode == 0, trainer_out
    assert inference.returncode == 0, inference_out
    ranks = [json.loads(line) for line in inference_out.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in ranks) == [0, 1], inference_out
    assert all(r["exact"] and r["version"] == 1 for r in ranks), inference_out


@pytest.mark.dist
def test_a_whole_model_at_tp_2_is_refused_before_any_byte_moves_saying_what_to_hold():
    """receive(model) of whole tensors with tensor_parallel_size=2 (the mistake the README used
    to show): refused on both sides with the public UpdateRefused, one line, nothing moved; the
    same channel then takes the update into its slices."""
    import threading

    import distload
    from distload.cli.sync_demo import demo_config, demo_state, kept_slices
    from dist_helpers import free_port

    hidden = 256
    address = f"tcp://127.0.0.1:{free_port()}"
    state = demo_state(4, 1, torch.device("cpu"), hidden)
    outcome = {}

    def trainer() -> None:
        with distload.SyncChannel(address, "trainer", rank=0, size=1, device="cpu", timeout_s=30) as ch:
            try:
                ch.push(state, 1)
            except distload.UpdateRefused as exc:
                outcome["trainer"] = str(exc)
            ch.push(state, 1)

    def receiver(rank: int) -> None:
        with distload.SyncChannel(address, "inference", rank=rank, size=2, device="cpu", timeout_s=30,
                                  tensor_parallel_size=2, sharding="decoder", model_config=demo_config(hidden)) as ch:
            whole = {n: torch.zeros_like(t) for n, t in state.items()}
            try:
                ch.receive(whole)
            except distload.UpdateRefused as exc:
                outcome[rank] = str(exc)
            outcome[f"{rank} untouched"] = all(not t.any() for t in whole.values())  # nothing landed
            slices = {n: torch.zeros_like(t) for n, t in kept_slices(state, 2, rank, hidden).items()}
            outcome[f"{rank} version"] = ch.receive(slices).version
            want = kept_slices(state, 2, rank, hidden)
            outcome[f"{rank} exact"] = all(torch.equal(slices[n], want[n]) for n in want)

    threads = [threading.Thread(target=trainer)] + [threading.Thread(target=receiver, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    for rank in (0, 1):
        message = outcome[rank]
        assert "\n" not in message and "nothing was sent" in message, message
        assert "holds whole tensors" in message and "distload.load(CHECKPOINT, tensor_parallel_size=2)" in message
        assert outcome[f"{rank} untouched"] and outcome[f"{rank} version"] == 1 and outcome[f"{rank} exact"], outcome
    assert "holds whole tensors" in outcome["trainer"]
