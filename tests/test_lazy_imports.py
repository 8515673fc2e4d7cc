"""``import distload`` imports no feature; a load imports the modules of its own path only.

Each check runs in a fresh interpreter (the test process has imported everything already) and
asserts on ``sys.modules``, not on time: a one-process load of a small checkpoint used to spend
more on importing the package (0.3-0.4 s: every feature, the live-update and checkpoint code
too) than on its read (issue 47)."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import distload

from conftest import every_dtype_state, plain_read, write_whole

# What ``import distload`` may add to an interpreter that has imported torch: the package, and
# the module that quiets torch's C++ warnings in the CLI before torch loads.
AT_IMPORT = {"distload", "distload.runtime", "distload.quiet_exit"}
# Never on a one-process load's path: the features above loading, and what torch leaves out
# until asked (DTensors; psutil, which the report no longer needs on Linux).
NOT_ON_THE_LOAD_PATH = ("distload.live", "distload.checkpoints", "distload.vllm", "distload.verl",
                        "distload.cli", "torch.distributed.tensor", "psutil")


def new_modules(statements: str, *args: str) -> tuple[set[str], dict]:
    """The modules ``statements`` import after torch, in a fresh interpreter, and what they print
    (a JSON object, ``out`` in their namespace)."""
    script = ("import json, sys, torch\nbefore = set(sys.modules)\nout = {}\n" + statements
              + "\nprint(json.dumps({'new': sorted(set(sys.modules) - before), 'out': out}))\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return set(result["new"]), result["out"]


def test_import_distload_imports_no_feature():
    new, _ = new_modules("import distload")
    assert new <= AT_IMPORT, sorted(new - AT_IMPORT)


def test_a_one_process_load_imports_only_its_path_and_is_bit_for_bit(tmp_path):
    paths = write_whole(str(tmp_path / "ck"), every_dtype_state(), num_files=2)
    new, out = new_modules(
        "import distload\n"
        "state = distload.load(sys.argv[1], 'auto', device='cpu')\n"
        "out.update({n: [str(t.dtype), list(t.shape), t.reshape(-1).view(torch.uint8).tolist()]"
        " for n, t in state.items()})", str(tmp_path / "ck"))
    loaded = sorted(m for m in new if m.startswith(NOT_ON_THE_LOAD_PATH))
    assert loaded == []
    assert "distload.loading.loader" in new  # the check above saw a real load
    want = plain_read(paths)
    assert set(out) == set(want)
    for name, tensor in want.items():
        assert out[name] == [str(tensor.dtype), list(tensor.shape), tensor.reshape(-1).view(torch.uint8).tolist()], name


def test_every_public_name_comes_from_the_module_the_docs_name():
    """The names are imported on first use from ``_WHERE``; type checkers and the API docs read
    the same imports under ``if TYPE_CHECKING``: the two must say the same."""
    tree = ast.parse(pathlib.Path(distload.__file__).read_text())
    typed = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom), ast.unparse(stmt)
                typed.update({alias.asname or alias.name: (stmt.module, alias.name) for alias in stmt.names})
    assert typed == distload._WHERE
    assert set(typed) == set(distload.__all__)
    for name, (module, attribute) in typed.items():
        assert getattr(distload, name) is getattr(__import__(module, fromlist=[attribute]), attribute), name
    assert set(distload.__all__) <= set(dir(distload))
    with pytest.raises(AttributeError, match="module 'distload' has no attribute 'no_such_name'"):
        distload.no_such_name
    _, out = new_modules("import distload\nfrom distload import load, ConfigError, WorkerGroup\n"
                         "out['names'] = [load.__module__, ConfigError.__module__, WorkerGroup.__name__,\n"
                         "                distload.errors.SyncError.__name__]")  # a submodule, as before
    assert out["names"] == ["distload.loading.loader", "distload.errors", "WorkerGroup", "SyncError"]
