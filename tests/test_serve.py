"""Loading from a running job: ``distload serve`` (and WeightServer) holds a checkpoint in memory,
``distload load tcp://HOST:PORT`` (and load_from_server) takes it from there, each rank its slices.

The server and the loading jobs are separately started processes; a loader is killed while its
bytes are arriving (its resident memory has grown by a part of them: /proc/PID/status), and a server too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

import distload
from distload.cli.main import main as cli_main
from distload.workers.group import WorkerGroup

from conftest import read_report, write_whole
from dist_helpers import clean_env, free_port, rank_env
from test_sliced_loads import CONFIG, llama_state

BIG_BYTES = 96 * 2**20  # a tensor big enough that a load is still moving when the test kills a side


def checkpoint(folder: str) -> str:
    """A Llama-shaped checkpoint (fused, GQA, padded vocabulary, int8 split along dim 1) with its
    config.json, and one big tensor in a file of its own."""
    write_whole(folder, llama_state(), num_files=2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    save_file({"extra.big": torch.arange(BIG_BYTES // 4, dtype=torch.int32).view(-1, 1024)},
              os.path.join(folder, "model-big.safetensors"))
    return folder


def reference_digests(folder: str, tp: int) -> list[str]:
    """Each TP rank's digest from a plain load of the files."""
    digests = []
    with WorkerGroup(device="cpu") as group:
        for rank in range(tp or 1):
            result = distload.Loader(folder, "safetensors", group=group, tensor_parallel_size=tp or None,
                                     tensor_parallel_rank=rank if tp else None).load(digest=True)
            digests.append(result.rank_report.digest)
    return digests


def start(args: list[str], log_path: str, env: dict | None = None) -> subprocess.Popen:
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "distload", *args], stdout=log, stderr=subprocess.STDOUT,
                            env=clean_env(env), text=True)


def start_ranks(args: list[str], nproc: int, folder: str, name: str, env: dict | None = None
                ) -> list[subprocess.Popen]:
    """One process per rank with torchrun's environment (no agent: each rank's exit is its own)."""
    port = free_port()
    return [start(args, os.path.join(folder, f"{name}.{rank}.log"), rank_env(env or {}, rank, nproc, port))
            for rank in range(nproc)]


def text(path: str) -> str:
    with open(path) as f:
        return f.read()


def wait_for(condition, what: str, timeout: float = 60.0, logs: tuple[str, ...] = ()) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s\n" +
                                 "\n".join(f"--- {p}\n{text(p)[-3000:]}" for p in logs))
        time.sleep(0.005)


def resident(pid: int) -> int:
    """The process's resident bytes: a loader's grow as its new tensors are written (received into)."""
    with open(f"/proc/{pid}/status") as f:
        lines = [line for line in f if line.startswith("VmRSS:")]
    return int(lines[0].split()[1]) * 1024 if lines else 0  # none: it has just exited


def while_receiving(actions: dict) -> None:
    """For each loader (Popen -> (its log, an action)): run the action once the loader has
    received a part of its bytes (its resident memory grew by 16 MiB since it took its ticket).
    Watched together: a loader waiting for its turn could finish meanwhile."""
    baseline: dict = {}
    pending = dict(actions)
    deadline = time.monotonic() + 200  # seven processes start at once: slow on a shared 2-core machine
    while pending:
        for loader, (log_path, action) in list(pending.items()):
            assert loader.poll() is None, "a load ended before the test could act mid-load\n" + text(log_path)
            if loader not in baseline:
                if "as its loading job" in text(log_path):
                    baseline[loader] = resident(loader.pid)
            elif resident(loader.pid) - baseline[loader] > 16 * 2**20:
                action()
                del pending[loader]
        assert time.monotonic() < deadline, "no load got under way within 200 s"
        time.sleep(0.002)


def serve(ckpt: str, address: str, log_path: str, timeout: int = 30) -> subprocess.Popen:
    # Small buckets and the socket path: a load takes long enough to be killed in the middle.
    return start(["serve", ckpt, "--address", address, "--timeout", str(timeout), "--bucket-mib", "2"], log_path,
                 {"DISTLOAD_SYNC_TRANSPORT": "socket"})


@pytest.mark.slow
@pytest.mark.dist
def test_separate_jobs_load_from_servers_bit_exact_and_failures_stay_on_their_side(tmp_path):
    """Everything at once (each process costs its start-up, so they overlap): server 1 (two ranks)
    serves a loader killed mid-load and a TP 2 job at once, goes on serving after the kill, and
    ends cleanly on SIGTERM; server 2 is killed while its loader's bytes arrive."""
    ckpt = checkpoint(str(tmp_path / "ckpt"))
    one, two = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    log = {name: str(tmp_path / f"{name}.log") for name in ("server1.0", "server1.1", "server2", "doomed", "orphan",
                                                            "tp2.0")}
    socket_path = {"DISTLOAD_SYNC_TRANSPORT": "socket"}
    # Server 1 is a job of two ranks, each serving about half of the tensors.
    two_ranks = start_ranks(["serve", ckpt, "--address", one, "--timeout", "30", "--bucket-mib", "2"], 2,
                            str(tmp_path), "server1", socket_path)
    servers = [*two_ranks, serve(ckpt, two, log["server2"])]
    doomed = start(["load", one], log["doomed"], socket_path)  # killed while its bytes arrive
    orphan = start(["load", two, "--timeout", "60"], log["orphan"], socket_path)  # its server is killed
    tp2 = start_ranks(["load", one, "-tp", "2", "--report-json", str(tmp_path / "tp2.json")], 2, str(tmp_path), "tp2")
    everyone = servers + [doomed, orphan] + tp2
    server1 = log["server1.0"]
    try:
        killed = []

        def kill_server_two() -> None:  # the loader is held still meanwhile: it cannot finish first
            orphan.send_signal(signal.SIGSTOP)
            servers[2].kill()
            servers[2].wait()
            killed.append(time.monotonic())
            orphan.send_signal(signal.SIGCONT)

        while_receiving({doomed: (log["doomed"], doomed.kill), orphan: (log["orphan"], kill_server_two)})
        assert orphan.wait(timeout=30) == 1
        assert time.monotonic() - killed[0] < 15  # named within seconds, not at its 60 s timeout
        for proc in tp2:
            assert proc.wait(timeout=90) == 0, "\n".join(text(str(tmp_path / n)) for n in
                                                        ("tp2.0.log", "tp2.1.log", "server1.0.log"))
        doomed_job = text(log["doomed"]).split("as its loading job ")[1].split()[0]
        wait_for(lambda: f"loading job {doomed_job} failed, still serving" in text(server1),
                 "the killed loader's failure on the server", timeout=30, logs=(server1,))
        assert f"loading job {doomed_job} rank 0" in text(server1).split(f"job {doomed_job} failed")[1]
        for rank in two_ranks:
            assert rank.poll() is None
            rank.send_signal(signal.SIGTERM)
        for rank, path in zip(two_ranks, (server1, log["server1.1"])):
            assert rank.wait(timeout=30) == 0, text(path)
    finally:
        for proc in everyone:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "1 load(s) served, 1 failed" in text(server1)
    held = [int(text(log[f"server1.{r}"]).split(f"rank {r} serves ")[1].split()[0]) for r in (0, 1)]
    assert min(held) > 0 and sum(held) == len(llama_state()) + 1  # each rank a part, together all
    out = text(log["orphan"])
    assert f"loading from the server at {two} failed" in out and "server rank 0" in out, out
    assert "Traceback" not in out, out

    report = read_report(str(tmp_path / "tp2.json"))
    assert report["load_format"] == "server" and report["source"] == one
    assert [r["digest"] for r in report["ranks"]] == reference_digests(ckpt, 2)  # bit for bit
    for r in report["ranks"]:
        assert r["requested_bytes"] == 0 and r["files"] == []  # nothing from storage
        assert r["nbytes"] <= r["server_bytes"] <= 1.05 * r["nbytes"]  # its slices, and little more
    assert "requested 0.000 GiB, from the server" in text(log["tp2.0"])


def test_python_api_a_state_dict_served_in_process(tmp_path):
    """WeightServer (an engine's or a trainer's weights) and load_from_server, whole tensors and
    TP size 1, one after another."""
    state = llama_state()
    write_whole(str(tmp_path / "ckpt"), state, num_files=1)
    with open(tmp_path / "ckpt" / "config.json", "w") as f:
        json.dump(CONFIG, f)
    address = f"tcp://127.0.0.1:{free_port()}"
    with distload.WeightServer(state, address, model_config=CONFIG, version=7, timeout_s=30).start() as server:
        first = distload.load_from_server(address, device="cpu", digest=True)
        again = distload.load_from_server(address, device="cpu")
        tp1 = distload.load_from_server(address, device="cpu", tensor_parallel_size=1, digest=True)
    assert server.served == 3
    # At TP size 1, as a load of the files: vLLM's TP 1 layout (the vocabulary padded to 256 rows).
    assert tp1.state["model.embed_tokens.weight"].shape == (256, CONFIG["hidden_size"])
    assert tp1.rank_report.digest == reference_digests(str(tmp_path / "ckpt"), 1)[0]
    assert tp1.rank_report.tensor_parallel == [0, 1]
    assert first.state.keys() == state.keys() and all(torch.equal(first.state[n], state[n]) for n in state)
    assert all(torch.equal(again.state[n], state[n]) for n in state)
    assert first.rank_report.requested_bytes == 0 and first.report.load_format == "server"


_DTENSOR_CLIENT = """
import sys, torch, distload
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

address, out = sys.argv[1], sys.argv[2]
with distload.WorkerGroup(device="cpu") as group:
    mesh = init_device_mesh("cpu", (group.world_size,))
    result = distload.load_dtensors_from_server(address, mesh, {"rows": [Shard(0)], "cols": [Shard(1)],
                                                                "norm": [Replicate()]}, group=group)
    state = result.state
    torch.save({"local": {n: t.to_local() for n, t in state.items()},
                "server_bytes": result.rank_report.server_bytes, "nbytes": result.rank_report.nbytes,
                "full": {n: t.full_tensor() for n, t in state.items()},
                "placements": {n: str(t.placements) for n, t in state.items()}}, f"{out}.{group.rank}")
"""


def test_dtensor_targets_from_a_server_each_rank_its_local_shards(tmp_path):
    """Two ranks on a 1-D mesh load a served state as DTensors: each receives exactly its local
    shard of each Shard(d) tensor (torch.chunk's), the rest whole; full_tensor() is the served one."""
    from dist_helpers import run_script, write_script

    state = {"rows": torch.arange(1024 * 64, dtype=torch.float32).view(1024, 64), "cols": torch.randn(64, 1024),
             "norm": torch.ones(6, dtype=torch.bfloat16), "other": torch.arange(12, dtype=torch.int64)}
    address = f"tcp://127.0.0.1:{free_port()}"
    script = write_script(tmp_path, "client.py", _DTENSOR_CLIENT)
    out = str(tmp_path / "out")
    with distload.WeightServer(state, address, timeout_s=60).start() as server:
        result = run_script(script, [address, out], nproc=2, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
    assert server.served == 1
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        assert set(got["local"]) == set(state)
        assert torch.equal(got["local"]["rows"], torch.chunk(state["rows"], 2, dim=0)[rank])
        assert torch.equal(got["local"]["cols"], torch.chunk(state["cols"], 2, dim=1)[rank])
        for name in ("norm", "other"):  # replicated: whole on each rank
            assert torch.equal(got["local"][name], state[name]) and "Replicate" in got["placements"][name]
        assert all(torch.equal(got["full"][n], state[n]) for n in state)
        kept = sum(t.numel() * t.element_size() for t in got["local"].values())
        assert got["nbytes"] == kept and kept <= got["server_bytes"] <= 1.05 * kept  # its shards, not the whole


def test_dtensor_placements_a_server_cannot_serve_are_refused_naming_the_tensor():
    from torch.distributed.tensor import Partial, Replicate, Shard

    from distload.errors import ConfigError
    from distload.live.server_dtensors import placements_spec

    with pytest.raises(ConfigError, match="tensor 'a': placement Shard\\(dim=-1\\); give the dimension"):
        placements_spec({"a": [Shard(-1)]})
    with pytest.raises(ConfigError, match="tensor 'a' is placed as Partial.*fills Shard\\(d\\) and Replicate"):
        placements_spec({"a": [Partial()]})
    with pytest.raises(ConfigError, match="tensor 'a': 2 placement\\(s\\).*1-D device mesh"):
        placements_spec({"a": [Shard(0), Replicate()]})
    spec = placements_spec({"w[0]*": [Shard(1)], "n": [Replicate()]})  # a name's wildcards taken literally
    assert spec.action("w[0]*", (4, 4)).dim == 1
    assert spec.action("w0x", (4, 4)).replicated and spec.action("n", (4,)).replicated


def test_a_load_from_a_server_refuses_storage_flags_and_names_a_missing_server(capsys):
    assert cli_main(["load", "tcp://127.0.0.1:9", "--load-format", "safetensors"]) == 1
    assert "--load-format: how to read storage" in capsys.readouterr().err
    with pytest.raises(distload.SyncError, match=r"cannot load from the server at tcp://127.0.0.1:\d+: nobody serves"):
        distload.load_from_server(f"tcp://127.0.0.1:{free_port()}", device="cpu", timeout_s=1)


def test_cli_expert_parallel_from_a_server_lays_out_ranks_as_a_load_of_the_files(tmp_path, capsys):
    """`load tcp://... --expert-parallel-size`: EP 1 (no expert parallelism: any model, vLLM's TP 1
    layout, as a load of the files) loads; EP 2 on one rank is refused as a load of the files
    refuses it, before any server is asked (nobody serves that address)."""
    state = llama_state()
    folder = str(tmp_path / "ckpt")
    write_whole(folder, state, num_files=1)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    address, report_path = f"tcp://127.0.0.1:{free_port()}", str(tmp_path / "report.json")
    with distload.WeightServer(state, address, model_config=CONFIG, timeout_s=30).start():
        assert cli_main(["load", address, "-ep", "1", "--report-json", report_path]) == 0, capsys.readouterr().err
    with WorkerGroup(device="cpu") as group:
        want = distload.Loader(folder, group=group, expert_parallel_size=1).load(digest=True).rank_report
    (got,) = read_report(report_path)["ranks"]
    assert (got["digest"], got["tensor_parallel"], got["expert_parallel"]) == (want.digest, [0, 1], None)
    assert cli_main(["load", f"tcp://127.0.0.1:{free_port()}", "-ep", "2", "--timeout", "5"]) == 1
    assert ("--tensor-parallel-size 1 x --expert-parallel-size 2 (2) does not divide the group's 1 ranks"
            in capsys.readouterr().err)
