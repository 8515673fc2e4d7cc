"""Several ``python -m distload`` command lines in one job (one torch import, one job start).

    torchrun --standalone --nproc-per-node 2 tests/cli_cases_driver.py SPEC.json OUT_DIR
    python tests/cli_cases_driver.py SPEC.json OUT_DIR          # one process, as python -m distload

SPEC.json is a list of cases, each an argument list or ``{"args": [...], "env": {...}}`` (``env``:
variables set for that case only, e.g. an endpoint through a byte-counting proxy). Each rank runs
``distload.cli.main.main(args)`` (what ``python -m distload ARGS`` runs) for each in turn, and
writes OUT_DIR/case-I-rank-R.json: the exit code and what the command printed to stdout on that
rank.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from unittest import mock

import torch.distributed as dist

from distload.cli.main import main as distload_main
from distload.workers.launch import detect_launch


def main(spec_path: str, out_dir: str) -> int:
    with open(spec_path) as f:
        cases = json.load(f)
    launch = detect_launch()
    rank = launch.rank
    if launch.world_size > 1:
        # The job's group, formed once: each command's WorkerGroup runs over it (as in a job that
        # formed its group before calling distload) and leaves it open for the next.
        dist.init_process_group("gloo")
    for i, case in enumerate(cases):
        args, env = (case["args"], case.get("env", {})) if isinstance(case, dict) else (case, {})
        stdout = io.StringIO()
        with mock.patch.dict(os.environ, env), contextlib.redirect_stdout(stdout):  # the case's variables, then back
            code = distload_main(list(args))
        with open(os.path.join(out_dir, f"case-{i}-rank-{rank}.json"), "w") as f:
            json.dump({"returncode": code, "stdout": stdout.getvalue()}, f)
    if launch.world_size > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
