"""Command line: ``python -m distload COMMAND ...`` (under torchrun, srun, or alone).

    torchrun --nproc-per-node 2 -m distload load /ckpt --load-format runai_streamer \
        --model-loader-extra-config '{"distributed": true}' --report-json report.json
    python -m distload reshard /ckpt /ckpt-tp2 --tensor-parallel-size 2
    python -m distload verify /ckpt-tp2
    python -m distload inspect /ckpt [--pattern P] [--json]
    torchrun --nproc-per-node 8 -m distload pull s3://models/llama /local/llama
    python -m distload demo
    torchrun --nproc-per-node 3 -m distload sync-demo
"""

from __future__ import annotations

import argparse
import logging
import sys

from distload.errors import ConfigError, DistloadError
from distload.workers.group import DEFAULT_TIMEOUT_S, WorkerGroup
from distload.workers.launch import detect_launch
from distload.loading.formats import LOAD_FORMATS, make_load_config
from distload.loading.layout import DEFAULT_SHARD_PATTERN, check_pattern
from distload.checkpoints.output import DEFAULT_MAX_FILE_SIZE

log = logging.getLogger("distload")

OLD_RESHARD = "save-sharded"  # the first name of the reshard command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m distload",
        description="Load safetensors weights onto every rank of a distributed job (under torchrun, srun, "
                    "or alone), and write, check and inspect per-rank checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)

    load = sub.add_parser("load", help="load a checkpoint onto every rank and report")
    load.add_argument("source", help="a safetensors file, a folder, or a pre-sharded folder")
    load.add_argument("--load-format", default="auto", type=str.lower,
                      help=f"one of {', '.join(LOAD_FORMATS)} (default auto)")
    load.add_argument("--model-loader-extra-config", default=None, metavar="JSON",
                      help='a JSON object, e.g. \'{"distributed": true, "concurrency": 16}\'')
    load.add_argument("--device", default="auto", help="auto (cuda:<local_rank> or cpu), cpu, cuda")
    load.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="T",
                      help="each rank r keeps the slices of tensor-parallel rank r %% T of a whole "
                           "checkpoint, reading only their bytes (auto); the job's ranks are a multiple "
                           "of T (data-parallel replicas). A checkpoint pre-sharded for T: each replica "
                           "reads its TP rank's files")
    load.add_argument("--sharding", default=None, metavar="SPEC",
                      help="the sharding spec for --tensor-parallel-size: decoder (vLLM's layout, default; "
                           "alias llama/mistral/qwen2/qwen3), plain, replicate, or a JSON spec file")
    load.add_argument("--report-json", default=None, metavar="PATH",
                      help="rank 0 writes the load report here")
    load.add_argument("--no-progress", action="store_true", help="no progress bar")
    load.add_argument("--no-digest", action="store_true",
                      help="skip the per-rank SHA-256 digest (it costs a pass over the bytes)")
    load.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                      help=f"timeout of every collective (default {DEFAULT_TIMEOUT_S:.0f})")

    # Python's reshard() does the same; "save-sharded" was its first name (Python's save_sharded()
    # saves from a running job), kept as an alias that says so.
    save = sub.add_parser("reshard", aliases=[OLD_RESHARD], help="reshard a whole checkpoint into per-rank files, "
                          f"offline (Python: distload.reshard; '{OLD_RESHARD}' is its old name)")
    save.add_argument("source", help="a whole safetensors checkpoint: a file or a folder (index.json honoured)")
    save.add_argument("output", help="a new or empty folder")
    save.add_argument("--tensor-parallel-size", "-tp", type=int, required=True, metavar="N",
                      help="the number of tensor-parallel ranks to write shards for (required)")
    save.add_argument("--file-pattern", default=DEFAULT_SHARD_PATTERN, metavar="P",
                      help=f"the shard file names, with {{rank}} and {{part}} (default {DEFAULT_SHARD_PATTERN!r})")
    save.add_argument("--max-file-size", type=int, default=DEFAULT_MAX_FILE_SIZE, metavar="BYTES",
                      help="start a new part past this many bytes (default 5 GiB)")
    save.add_argument("--sharding", "--plan", dest="sharding", default=None, metavar="SPEC",
                      help="the sharding spec: a built-in one (vllm: vLLM's engine names, which its "
                           "sharded_state loaders read; decoder, alias llama/mistral/qwen2/qwen3: the same slices "
                           "under the checkpoint's names; plain; replicate) or a JSON spec file (default vllm "
                           "where the engine's names are known, else decoder); --plan is its old name")

    verify = sub.add_parser("verify", help="check a pre-sharded checkpoint's files against its manifest")
    verify.add_argument("folder", help="a pre-sharded checkpoint saved by distload (a folder or an object-store prefix)")

    inspect = sub.add_parser("inspect", help="files, tensors, bytes, dtypes and layout of a checkpoint")
    inspect.add_argument("source", help="a safetensors file, a folder, or an object-store URI")
    inspect.add_argument("--pattern", default=None, metavar="P",
                         help=f"the shard file-name pattern to look for (default: the manifest's, "
                              f"else {DEFAULT_SHARD_PATTERN!r})")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a summary")

    sync_demo = sub.add_parser("sync-demo", help="a trainer pushes weight versions, inference ranks "
                                                 "receive them in place (one job, or two with --role)")
    sync_demo.add_argument("--role", choices=("trainer", "inference"), default=None,
                           help="this job's side when trainer and inference are separate jobs "
                                "(default: one job, rank 0 the trainer)")
    sync_demo.add_argument("--rendezvous", default=None, metavar="tcp://HOST:PORT",
                           help="where the two jobs meet (the trainer's rank 0 serves it)")
    sync_demo.add_argument("--tensor-parallel-size", type=int, default=1, metavar="T",
                           help="inference side: each rank keeps and receives only its TP slices (default 1)")
    sync_demo.add_argument("--versions", "--steps", dest="versions", type=int, default=3,
                           help="weight versions to push (default 3)")
    sync_demo.add_argument("--verify", action="store_true", help="check every update (the default)")
    sync_demo.add_argument("--no-verify", action="store_true", help="do not check full updates (deltas always are)")
    sync_demo.add_argument("--no-delta", action="store_true", help="send every byte of every version")
    sync_demo.add_argument("--change", type=float, default=None, metavar="FRACTION",
                           help="versions change like training steps: each changes this fraction of the "
                                "previous one's elements (e.g. 0.04), so every update after the first is a delta "
                                "(default: every version all new)")
    sync_demo.add_argument("--report-json", default=None, metavar="PATH",
                           help="write each rank's versions, digests, bytes and seconds here")
    sync_demo.add_argument("--size-mib", type=int, default=256, help="approximate model size (default 256)")
    sync_demo.add_argument("--bucket-mib", type=int, default=64,
                           help="the size of one transfer bucket (default 64)")
    sync_demo.add_argument("--device", default="auto", help="auto (cuda:<local_rank> or cpu), cpu, cuda")
    sync_demo.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                           help=f"timeout of every collective (default {DEFAULT_TIMEOUT_S:.0f})")

    pull = sub.add_parser("pull", help="copy a checkpoint folder to a local folder on every node, each "
                                       "byte read from the source once per job")
    pull.add_argument("source", help="a folder or an object-store prefix (s3://, gs://, az://)")
    pull.add_argument("dest", help="a local folder on each node (created; complete files already "
                                   "there are kept)")
    pull.add_argument("--chunk-mib", type=float, default=64,
                      help="bytes one rank reads and sends at a time, in MiB (default 64)")
    pull.add_argument("--report-json", default=None, metavar="PATH",
                      help="rank 0 writes every rank's report here")
    pull.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                      help=f"timeout of every collective (default {DEFAULT_TIMEOUT_S:.0f})")

    demo = sub.add_parser("demo", help="write a small LLM-shaped checkpoint and load it with "
                                       "every format this machine supports")
    demo.add_argument("--nproc-per-node", type=int, default=None,
                      help="ranks to start with torchrun (default: GPUs, or 2 on a CPU)")
    demo.add_argument("--dir", default=None, help="write the checkpoints here (default: a temp folder)")
    demo.add_argument("--size-mib", type=int, default=64, help="approximate checkpoint size")
    demo.add_argument("--case-timeout", type=float, default=600, metavar="SECONDS",
                      help="give up on one format's load after this long (default 600)")
    return parser


def _setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[distload rank {rank}] %(message)s",
        stream=sys.stderr,
    )


def run_load(args: argparse.Namespace) -> int:
    from distload.loading.loader import Loader

    # Validate before the process group exists: a bad flag costs no rendezvous.
    make_load_config(args.load_format, args.model_loader_extra_config)
    with WorkerGroup(device=args.device, timeout_s=args.timeout) as group:
        loader = Loader(args.source, args.load_format, args.model_loader_extra_config,
                        group=group, progress=not args.no_progress,
                        tensor_parallel_size=args.tensor_parallel_size, sharding=args.sharding)
        report = loader.load(gather=True, digest=not args.no_digest).report
        assert report is not None
        if group.rank == 0:
            log.info("Loading weights took %.2f seconds", report.total["seconds"])
            for line in report.summary_lines():
                print(line, flush=True)
            if args.report_json:
                report.write(args.report_json)
                log.info("report written to %s", args.report_json)
    return 0


def run_reshard(args: argparse.Namespace) -> int:
    from distload.checkpoints.reshard import reshard

    if args.command == OLD_RESHARD:
        sys.stderr.write(f"distload: '{OLD_RESHARD}' is the old name of 'reshard' (the same command); "
                         f"use 'distload reshard'\n")

    report = reshard(args.source, args.output, args.tensor_parallel_size, pattern=args.file_pattern,
                     max_file_size=args.max_file_size, sharding=args.sharding)
    for line in report.summary_lines():
        print(line, flush=True)
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from distload.checkpoints.verify import verify_folder

    manifest, problems = verify_folder(args.folder)
    if problems:
        print(f"{args.folder}: {len(problems)} problem(s):", flush=True)
        for problem in problems:
            print(f"  {problem}", flush=True)
        return 1
    assert manifest is not None
    print(f"{args.folder}: OK: {len(manifest.files)} file(s) for {manifest.world_size} rank(s) match "
          f"the manifest (sizes and SHA-256)", flush=True)
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    import json

    from distload.checkpoints.inspection import inspect_source, summary_lines

    if args.pattern is not None:
        check_pattern("--pattern", args.pattern)
    info = inspect_source(args.source, args.pattern)
    print(json.dumps(info, indent=1) if args.json else "\n".join(summary_lines(info)), flush=True)
    return 0


def run_pull(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from distload.fileio import write_json_atomic
    from distload.checkpoints.pull import pull

    chunk_bytes = int(args.chunk_mib * 1024 * 1024)
    if chunk_bytes <= 0:
        raise ConfigError(f"--chunk-mib must be positive, got {args.chunk_mib}")
    with WorkerGroup(device="cpu", timeout_s=args.timeout) as group:
        report = pull(args.source, args.dest, group=group, chunk_bytes=chunk_bytes)
        reports = group.exchange(asdict(report))
        if group.rank == 0:
            gib = 1024**3
            print(f"distload: pulled {args.source} to {args.dest} on {len(reports)} rank(s)", flush=True)
            for r in reports:
                role = f"wrote {len(r['fetched'])} file(s), {r['written_bytes'] / gib:.3f} GiB, kept " \
                       f"{len(r['kept'])}" if r["writes"] else "sent only"
                print(f"  rank {r['rank']} ({r['hostname']}): read {r['requested_bytes'] / gib:.3f} GiB "
                      f"from the source; {role}; {r['seconds']:.2f} s", flush=True)
            total = sum(r["requested_bytes"] for r in reports)
            print(f"  read from the source, whole job: {total / gib:.3f} GiB", flush=True)
            if args.report_json:
                write_json_atomic(args.report_json, {"source": args.source, "ranks": reports}, indent=2)
    return 0


# Commands that run in one process, outside any group.
OFFLINE_COMMANDS = ("reshard", OLD_RESHARD, "verify", "inspect")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank: int | str = "?"
    try:
        rank = detect_launch().rank
        _setup_logging(rank)
        if args.command == "load":
            return run_load(args)
        if args.command in ("reshard", OLD_RESHARD):
            return run_reshard(args)
        if args.command == "verify":
            return run_verify(args)
        if args.command == "inspect":
            return run_inspect(args)
        if args.command == "sync-demo":
            from distload.cli.sync_demo import run_sync_demo

            return run_sync_demo(args)
        if args.command == "pull":
            return run_pull(args)
        if args.command == "demo":
            from distload.cli.demo import run_demo

            return run_demo(args)
    except DistloadError as exc:
        # One write per message: under torchrun the ranks share stderr, and print() writes the
        # newline separately, so two ranks' lines would run together. The offline commands run in
        # one process: no rank to name.
        where = "" if args.command in OFFLINE_COMMANDS else f" on rank {rank}"
        sys.stderr.write(f"distload: error{where}: {exc}\n")
        sys.stderr.flush()
        return 1
    except KeyboardInterrupt:
        print(f"distload: interrupted on rank {rank}", file=sys.stderr, flush=True)
        return 130
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
