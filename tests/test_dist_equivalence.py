"""Every CPU load format under torchrun (1 and 2 ranks on gloo) gives each rank exactly the
tensors a plain safetensors read of that rank's files gives, bit for bit."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from conftest import every_dtype_state, plain_digest, plain_read, read_report, write_sharded, write_whole
from dist_helpers import CliJob, run_script, write_script
from distload.loading.backends.dummy import dummy_tensor
from distload.loading.sources import read_local_header
from distload.loading.formats import AUTO_CPU_BACKEND
from distload.loading.report import state_digest

pytestmark = pytest.mark.dist

PATTERN = "model-rank-{rank}-part-{part}.safetensors"


def whole_state() -> dict[str, torch.Tensor]:
    """Every dtype, a 0-d and an empty tensor, plus two tensors of a few MiB (several Run:ai chunks
    and a real split of the work between ranks in distributed mode)."""
    state = every_dtype_state(seed=7)
    generator = torch.Generator().manual_seed(7)
    state["big.f32"] = torch.randn(640, 1024, generator=generator)
    state["big.bf16"] = torch.randn(1024, 1536, generator=generator).to(torch.bfloat16)
    return state


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """whole: 4 files; sharded1/sharded2: pre-sharded for 1 and 2 ranks (2 parts per rank)."""
    root = tmp_path_factory.mktemp("ckpts")
    whole = str(root / "whole")
    write_whole(whole, whole_state(), num_files=4)
    sharded = {}
    for world in (1, 2):
        folder = str(root / f"sharded{world}")
        write_sharded(folder, world, parts=2)
        sharded[world] = folder
    return {"whole": whole, "sharded": sharded, "root": root}


def whole_files(folder: str) -> list[str]:
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))


def rank_files(folder: str, rank: int, parts: int = 2) -> list[str]:
    return [os.path.join(folder, PATTERN.format(rank=rank, part=p)) for p in range(parts)]


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def dummy_digest(files: list[str]) -> str:
    """What the dummy format must produce: header names/dtypes/shapes, values seeded by name."""
    state = {t.name: dummy_tensor(t, torch.device("cpu"))
             for path in files for t in read_local_header(path).tensors}
    return state_digest(state)


# (load format, extra config, checkpoint kind, expected path for 1 rank, for 2 ranks)
CASES = [
    ("safetensors", None, "whole", "safetensors", "safetensors"),
    ("runai_streamer", None, "whole", "runai", "runai"),
    ("runai_streamer", '{"distributed": true}', "whole", "runai", "runai-distributed"),
    ("sharded_state", None, "sharded", "safetensors", "safetensors"),
    ("runai_streamer_sharded", None, "sharded", "runai", "runai"),
    ("auto", None, "whole", AUTO_CPU_BACKEND, AUTO_CPU_BACKEND),
    ("auto", None, "sharded", AUTO_CPU_BACKEND, AUTO_CPU_BACKEND),
    ("dummy", None, "whole", "dummy", "dummy"),
]


CASE_IDS = [f"{c[0]}{'-distributed' if c[1] else ''}-{c[2]}" for c in CASES]
INDEX_CASES = [("safetensors", None, "safetensors"), ("runai_streamer", '{"distributed": true}', "runai-distributed")]


@pytest.fixture(scope="module")
def indexed_ckpt(tmp_path_factory):
    """Three files, but model.safetensors.index.json names only the first and the third."""
    folder = str(tmp_path_factory.mktemp("indexed"))
    paths = write_whole(folder, every_dtype_state(seed=3), num_files=3)
    # the unlisted file holds tensors the others also hold: loading it would be an error
    save_file({"scalar": torch.tensor(-1.0)}, os.path.join(folder, "stray.safetensors"))
    listed = [paths[0], paths[2]]
    weight_map = {name: os.path.basename(path) for path in listed for name in plain_read([path])}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return folder, listed


@pytest.fixture(scope="module")
def cli_jobs(ckpts, indexed_ckpt, tmp_path_factory):
    """The cases of test_each_rank_gets_exactly_its_tensors for one rank (one process without
    torchrun, as a user runs python -m distload alone) and for two (torchrun), and those of
    test_index_selects_the_files_it_names (two ranks): (rank count, case) -> the job that ran it,
    one job per rank count."""
    jobs = {}
    for nproc in (1, 2):
        cases = {}
        for case_id, (load_format, extra, kind, _, _) in zip(CASE_IDS, CASES):
            folder = ckpts["whole"] if kind == "whole" else ckpts["sharded"][nproc]
            cases[case_id] = [folder, "--load-format", load_format] + (
                ["--model-loader-extra-config", extra] if extra else [])
        if nproc == 2:
            for load_format, extra, _ in INDEX_CASES:
                cases[f"index {load_format}"] = [indexed_ckpt[0], "--load-format", load_format] + (
                    ["--model-loader-extra-config", extra] if extra else [])
        job = CliJob(str(tmp_path_factory.mktemp(f"cli-{nproc}")), nproc, cases)
        jobs.update({(nproc, name): job for name in cases})
    return jobs


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("load_format,extra,kind,path1,path2", CASES, ids=CASE_IDS)
def test_each_rank_gets_exactly_its_tensors(ckpts, cli_jobs, nproc, load_format, extra, kind, path1, path2):
    folder = ckpts["whole"] if kind == "whole" else ckpts["sharded"][nproc]
    case_id = CASE_IDS[CASES.index((load_format, extra, kind, path1, path2))]
    job = cli_jobs[nproc, case_id]
    codes, stdout = job.case(case_id)
    assert codes == [0] * nproc, stdout + job.result.stderr[-6000:]
    assert job.result.returncode == 0, job.result.stdout + job.result.stderr[-6000:]
    report_path = job.reports[case_id]

    report = read_report(report_path)
    assert report["world_size"] == nproc
    assert report["load_format"] == load_format
    assert report["source"] == folder
    assert [r["rank"] for r in report["ranks"]] == list(range(nproc))
    expected_path = path1 if nproc == 1 else path2
    total = 0
    for r in report["ranks"]:
        rank = r["rank"]
        files = whole_files(folder) if kind == "whole" else rank_files(folder, rank)
        state = plain_read(files)
        assert r["local_rank"] == rank
        assert r["device"] == "cpu"
        assert r["files"] == files, f"rank {rank}"
        assert r["path"] == expected_path, f"rank {rank}: {r['path']}"
        assert r["num_tensors"] == len(state)
        assert r["nbytes"] == nbytes(state)
        if load_format == "dummy":
            assert r["digest"] == dummy_digest(files), f"rank {rank}"
            assert r["digest"] != plain_digest(files)  # values are made up, not read
        else:
            assert r["digest"] == plain_digest(files), f"rank {rank} got other tensors than its files hold"
        total += r["nbytes"]
    assert report["total"]["nbytes"] == total
    digests = [r["digest"] for r in report["ranks"]]
    if kind == "sharded" and nproc == 2:
        assert digests[0] != digests[1]  # the shards differ, and each rank got its own
    else:
        assert len(set(digests)) == 1
    # rank 0 alone prints the summary, one line per rank
    assert stdout.count(f"distload: {load_format} from {folder} on {nproc} rank(s)") == 1
    for rank in range(nproc):
        assert f"  rank {rank} (cpu, {expected_path})" in stdout


@pytest.mark.slow
@pytest.mark.parametrize("load_format,extra,path", INDEX_CASES)
def test_index_selects_the_files_it_names(indexed_ckpt, cli_jobs, load_format, extra, path):
    folder, listed = indexed_ckpt
    job = cli_jobs[2, f"index {load_format}"]
    codes, stdout = job.case(f"index {load_format}")
    assert codes == [0, 0], stdout + job.result.stderr[-6000:]
    assert job.result.returncode == 0, job.result.stdout + job.result.stderr[-6000:]
    report = read_report(job.reports[f"index {load_format}"])
    state = plain_read(listed)
    for r in report["ranks"]:
        assert r["files"] == listed
        assert r["path"] == path
        assert r["num_tensors"] == len(state)
        assert r["nbytes"] == nbytes(state)
        assert r["digest"] == plain_digest(listed)


API_SCRIPT = r'''
import json, os, sys
import torch
import distload
from safetensors.torch import load_file

root, out = sys.argv[1], sys.argv[2]
PATTERN = "model-rank-{rank}-part-{part}.safetensors"


def plain(files):
    state = {}
    for f in files:
        state.update(load_file(f))
    return state


def raw(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def compare(got, want, what, values=True):
    problems = []
    if sorted(got) != sorted(want):
        problems.append(f"{what}: names {sorted(set(got) ^ set(want))}")
    for name in sorted(set(got) & set(want)):
        a, b = got[name], want[name]
        if a.device.type != "cpu":
            problems.append(f"{what}: {name} on {a.device}")
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            problems.append(f"{what}: {name} {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}")
        elif values and raw(a) != raw(b):
            problems.append(f"{what}: {name} bytes differ")
    return problems


problems, checked = [], []
with distload.WorkerGroup() as g:
    world = g.world_size
    whole = os.path.join(root, "whole")
    sharded = os.path.join(root, f"sharded{world}")
    whole_files = sorted(os.path.join(whole, n) for n in os.listdir(whole) if n.endswith(".safetensors"))
    mine = [os.path.join(sharded, PATTERN.format(rank=g.rank, part=p)) for p in range(2)]
    cases = [
        ("safetensors", None, whole_files),
        ("runai_streamer", None, whole_files),
        ("runai_streamer", {"distributed": True}, whole_files),
        ("auto", None, whole_files),
        ("sharded_state", None, mine),
        ("runai_streamer_sharded", None, mine),
        ("auto", None, mine),
    ]
    for fmt, extra, files in cases:
        src = whole if files is whole_files else sharded
        want = plain(files)
        what = f"load {fmt} {extra} {src}"
        state = distload.load(src, fmt, extra, group=g)
        problems += compare(state, want, what)
        what = f"iter_tensors {fmt} {extra} {src}"
        seen = []
        streamed = {}
        for name, tensor in distload.iter_tensors(src, fmt, extra, group=g):
            seen.append(name)
            streamed[name] = tensor.clone()
        if len(seen) != len(set(seen)):
            problems.append(f"{what}: a name came twice")
        problems += compare(streamed, want, what)
        checked.append(what)

    # dummy: names, dtypes and shapes from the headers, made-up values, the same on every rank
    want = plain(whole_files)
    state = distload.load(whole, "dummy", group=g)
    problems += compare(state, want, "dummy", values=False)
    for name, t in state.items():
        if t.dtype.is_floating_point and t.numel():
            # 1e-3 itself rounds up in the coarse dtypes (fp8's smallest step is ~2e-3)
            bound = max(1e-3, torch.tensor(1e-3).to(t.dtype).float().item())
            if t.float().abs().max() > bound:
                problems.append(f"dummy {name}: values outside [-1e-3, 1e-3]")
    digest = distload.state_digest(state)
    if len(set(g.exchange(digest))) != 1:
        problems.append("dummy: ranks got different values")
    if digest == distload.state_digest(want):
        problems.append("dummy: the real values were read")
    checked.append("dummy")

with open(os.path.join(out, f"rank{g.rank}.json"), "w") as f:
    json.dump({"world": world, "problems": problems, "checked": checked}, f)
sys.exit(1 if problems else 0)
'''


@pytest.mark.parametrize("nproc", [None, 2], ids=["single-process", "torchrun-2"])
def test_python_api_matches_plain_read(ckpts, tmp_path, nproc):
    script = write_script(tmp_path, "api.py", API_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    result = run_script(script, [str(ckpts["root"]), str(out)], nproc=nproc)
    world = nproc or 1
    for rank in range(world):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} did not finish:\n{result.stdout}{result.stderr[-6000:]}"
        data = json.loads(path.read_text())
        assert data["world"] == world
        assert data["problems"] == [], f"rank {rank}"
        assert len(data["checked"]) == 8  # 7 formats (load + iter_tensors each) + dummy
    assert result.returncode == 0, result.stdout + result.stderr[-6000:]
