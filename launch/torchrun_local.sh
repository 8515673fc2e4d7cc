#!/usr/bin/env bash
# One-node launch with the rendezvous on a free loopback port, so several jobs can share a node.
#
#   launch/torchrun_local.sh NPROC load /path/to/ckpt --load-format auto --report-json r.json
#
# NPROC: ranks to start (default: the number of visible GPUs, or 2 without GPUs).
# Everything after NPROC is passed to `python -m distload`.
# PYTHON (default: python3) picks the interpreter whose environment has distload installed.
set -euo pipefail
PYTHON=${PYTHON:-python3}
nproc=${1:-}
if [[ -z "$nproc" || ! "$nproc" =~ ^[0-9]+$ ]]; then
  nproc=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 2)')
else
  shift
fi
# The command line is checked once here, before torchrun starts any rank: a misspelt format,
# extra-config key or flag is one message, not one per rank after the ranks' start-up.
"$PYTHON" -c 'import sys; from distload.cli.main import precheck; sys.exit(precheck(sys.argv[1:]))' "$@"
# --standalone: a c10d rendezvous on localhost with a port the OS picks (no collisions).
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m distload "$@"
