"""Several loads in one job (one process group, one torch import), for the object-store tests.

    torchrun --standalone --nproc-per-node 2 tests/store_load_driver.py SPEC.json OUT.json
    python tests/store_load_driver.py SPEC.json OUT.json          # one process

SPEC.json is a list of loads: ``{"source", "format", "extra", "env", "rank_extra"}`` (``env``:
variables set for that load only, e.g. an endpoint through a byte-counting proxy;
``rank_extra``: rank -> extra config merged over ``extra`` on that rank, e.g. a cache folder per
rank, as on two nodes). Rank 0 writes OUT.json: per
load either the job report (``LoadReport.to_json()``, digests included) or ``{"error": message}``.
"""

from __future__ import annotations

import json
import os
import sys

import distload
from distload.errors import DistloadError


def main(spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        loads = json.load(f)
    results = []
    with distload.WorkerGroup(device="cpu", timeout_s=120) as group:
        for load in loads:
            saved = {k: os.environ.get(k) for k in load.get("env", {})}
            os.environ.update(load.get("env", {}))
            try:
                extra = {**load.get("extra", {}), **load.get("rank_extra", {}).get(str(group.rank), {})}
                loader = distload.Loader(load["source"], load["format"], extra or None, group=group)
                results.append(loader.load(gather=True, digest=True).report.to_json())
            except DistloadError as exc:
                results.append({"error": str(exc), "type": type(exc).__name__,
                                "cause": getattr(exc, "cause", None)})
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        if group.rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
