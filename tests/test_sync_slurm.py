"""Weight sync between two Slurm jobs: a trainer job and an inference job, each submitted with its
own sbatch and started with srun, meet at a tcp:// address (issue 15: "the same API ... with Slurm").

Each job's ranks come from Slurm's environment (SLURM_PROCID, SLURM_NTASKS), as for loads; each
job has its own world (its rendezvous port derives from its own job id).
"""

from __future__ import annotations

import json
import os

import pytest

from slurm_cluster import free_port
from test_launch_slurm import JOB_DEADLINE_S, assert_completed, job_env, slurm  # noqa: F401 - the fixture

pytestmark = [pytest.mark.dist, pytest.mark.slow]

SCRIPT = """#!/bin/bash
set -euo pipefail
srun --kill-on-bad-exit=1 "$PYTHON" -m distload sync-demo --role "$ROLE" --rendezvous "$RENDEZVOUS" \\
    --tensor-parallel-size "$TP" --versions 2 --verify --size-mib 8 --device cpu --timeout 120 \\
    ${REPORT_JSON:+--report-json "$REPORT_JSON"}
"""


def test_a_trainer_job_and_an_inference_job_sync_under_slurm(slurm, tmp_path):
    script = tmp_path / "sync.sbatch"
    script.write_text(SCRIPT)
    address = f"tcp://127.0.0.1:{free_port()}"
    report = str(tmp_path / "inference.json")
    # One CPU each (--overcommit): both jobs run at once on this 2-CPU node.
    jobs = {}
    for role, tasks, tp, extra in (("inference", 2, "2", {"REPORT_JSON": report}), ("trainer", 1, "1", {})):
        output = str(tmp_path / f"{role}-%j.out")
        jobs[role] = (slurm.sbatch([str(script)], [f"--output={output}", f"--chdir={tmp_path}", f"--ntasks={tasks}",
                                                   "--overcommit", f"--job-name=sync-{role}"],
                                   env=job_env(ROLE=role, RENDEZVOUS=address, TP=tp, **extra)), output)
    for role, (job_id, output) in jobs.items():
        info = slurm.wait(job_id, JOB_DEADLINE_S)
        with open(output.replace("%j", str(job_id)), errors="replace") as f:
            text = f.read()
        assert_completed(info, text)
    assert jobs["trainer"][0] != jobs["inference"][0]
    with open(report) as f:
        ranks = json.load(f)["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert [v["version"] for v in r["versions"]] == [1, 2]
        assert all(v["matches"] and v["verified"] for v in r["versions"]), r
    # Each rank kept (and received) its own TP slices: different tensors, about half the bytes.
    assert ranks[0]["versions"][0]["digest"] != ranks[1]["versions"][0]["digest"]
    assert os.path.exists(report)
