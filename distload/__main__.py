"""Command line: ``python -m distload load|demo ...`` (under torchrun, srun, or alone).

    torchrun --nproc-per-node 2 -m distload load /ckpt --load-format runai_streamer \
        --model-loader-extra-config '{"distributed": true}' --report-json report.json
    python -m distload demo
"""

from __future__ import annotations

import argparse
import logging
import sys

from .config import LOAD_FORMATS, make_load_config
from .errors import DistloadError
from .group import DEFAULT_TIMEOUT_S, WorkerGroup, detect_launch

log = logging.getLogger("distload")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m distload", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    load = sub.add_parser("load", help="load a checkpoint onto every rank and report")
    load.add_argument("source", help="a safetensors file, a folder, or a pre-sharded folder")
    load.add_argument("--load-format", default="auto", type=str.lower,
                      help=f"one of {', '.join(LOAD_FORMATS)} (default auto)")
    load.add_argument("--model-loader-extra-config", default=None, metavar="JSON",
                      help='a JSON object, e.g. \'{"distributed": true, "concurrency": 16}\'')
    load.add_argument("--device", default="auto", help="auto (cuda:<local_rank> or cpu), cpu, cuda")
    load.add_argument("--report-json", default=None, metavar="PATH",
                      help="rank 0 writes the load report here")
    load.add_argument("--no-progress", action="store_true", help="no progress bar")
    load.add_argument("--no-digest", action="store_true",
                      help="skip the per-rank SHA-256 digest (it costs a pass over the bytes)")
    load.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                      help=f"timeout of every collective (default {DEFAULT_TIMEOUT_S:.0f})")

    demo = sub.add_parser("demo", help="write a small LLM-shaped checkpoint and load it with "
                                       "every format this machine supports")
    demo.add_argument("--nproc-per-node", type=int, default=None,
                      help="ranks to start with torchrun (default: GPUs, or 2 on a CPU)")
    demo.add_argument("--dir", default=None, help="write the checkpoints here (default: a temp folder)")
    demo.add_argument("--size-mib", type=int, default=64, help="approximate checkpoint size")
    return parser


def _setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[distload rank {rank}] %(message)s",
        stream=sys.stderr,
    )


def run_load(args: argparse.Namespace) -> int:
    from .loader import Loader

    # Validate before the process group exists: a bad flag costs no rendezvous.
    make_load_config(args.load_format, args.model_loader_extra_config)
    with WorkerGroup(device=args.device, timeout_s=args.timeout) as group:
        loader = Loader(args.source, args.load_format, args.model_loader_extra_config,
                        group=group, progress=not args.no_progress)
        state, report = loader.load_with_report(digest=not args.no_digest)
        del state
        if group.rank == 0:
            log.info("Loading weights took %.2f seconds", report.total["seconds"])
            for line in report.summary_lines():
                print(line, flush=True)
            if args.report_json:
                report.write(args.report_json)
                log.info("report written to %s", args.report_json)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank: int | str = "?"
    try:
        rank = detect_launch().rank
        _setup_logging(rank)
        if args.command == "load":
            return run_load(args)
        if args.command == "demo":
            from .demo import run_demo

            return run_demo(args)
    except DistloadError as exc:
        print(f"distload: error on rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print(f"distload: interrupted on rank {rank}", file=sys.stderr, flush=True)
        return 130
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
