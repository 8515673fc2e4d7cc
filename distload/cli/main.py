"""Command line: ``python -m distload COMMAND ...`` (under torchrun, srun, or alone).

    torchrun --nproc-per-node 2 -m distload load /ckpt --load-format runai_streamer \
        --model-loader-extra-config '{"distributed": true}' --report-json report.json
    python -m distload reshard /ckpt /ckpt-tp2 --tensor-parallel-size 2
    python -m distload verify /ckpt-tp2
    python -m distload inspect /ckpt [--pattern P] [--json]
    torchrun --nproc-per-node 8 -m distload pull s3://models/llama /local/llama
    python -m distload serve /ckpt --address tcp://0.0.0.0:29700     # then, from another job:
    torchrun --nproc-per-node 2 -m distload load tcp://HOST:29700 --tensor-parallel-size 2
    python -m distload demo
    torchrun --nproc-per-node 3 -m distload sync-demo
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from typing import Iterator

from distload.errors import EVERY_RANK_ATTRIBUTE, ConfigError, DistloadError, on_every_rank, rank_list
from distload.workers.group import DEFAULT_TIMEOUT_S, WorkerGroup
from distload.workers.launch import LaunchInfo, check_device, detect_launch
from distload.loading.formats import LOAD_FORMATS, make_load_config
from distload.loading.layout import DEFAULT_SHARD_PATTERN, check_pattern
from distload.checkpoints.output import DEFAULT_MAX_FILE_SIZE
from distload.loading.report import gib_text

log = logging.getLogger("distload")

OLD_RESHARD = "save-sharded"  # the first name of the reshard command


def installed_version() -> str:
    """distload's version as installed (pip takes it from distload.__version__, which this floor
    may not import: the package's __init__ sits above the command line)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("distload")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_LEVEL_ENV = "DISTLOAD_LOG_LEVEL"


def _log_level_options(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default=default,
                        help=f"how much rank 0 logs (default info, or ${LOG_LEVEL_ENV}); the other ranks "
                             "log warnings and errors, and everything at debug")


def _secret_options(command: argparse.ArgumentParser, listens: bool) -> None:
    command.add_argument("--secret-file", default=None, metavar="FILE",
                         help="a file holding the job secret (mode 600), the same on every member and loader; "
                              "default: DISTLOAD_SECRET_FILE, else DISTLOAD_SECRET (docs/security.md)")
    if listens:
        command.add_argument("--insecure", action="store_true",
                             help="listen on a non-loopback address without a job secret (anyone who reaches it "
                                  "can push or take weights)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m distload",
        description="Load safetensors weights onto every rank of a distributed job (under torchrun, srun, "
                    "or alone), and write, check and inspect per-rank checkpoints.")
    parser.add_argument("--version", action="version", version=f"distload {installed_version()}")
    _log_level_options(parser, None)
    # --log-level after the command too (where people put it); SUPPRESS there keeps a value given
    # before the command: a subparser's default would overwrite it.
    common = argparse.ArgumentParser(add_help=False)
    _log_level_options(common, argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser = sub.add_parser

    def with_common(*args, **kwargs):
        return add_parser(*args, parents=[common], **kwargs)

    sub.add_parser = with_common  # every command takes the common options

    load = sub.add_parser("load", help="load a checkpoint onto every rank and report")
    load.add_argument("source", help="a safetensors file, a folder, a pre-sharded folder, an object-store URI, "
                                     "or tcp://HOST:PORT: a running `distload serve` (nothing read from storage)")
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
    _expert_options(load, "each rank r holds the routed experts of EP rank (r // T) %% P (of a mixture-of-experts "
                          "checkpoint), reading only their bytes; the job's ranks are T x P x k. A checkpoint "
                          "resharded at T x P: each rank reads its shard. From tcp://HOST:PORT: each rank "
                          "receives only its experts, the same tensors")
    load.add_argument("--report-json", default=None, metavar="PATH",
                      help="rank 0 writes the load report here")
    load.add_argument("--no-progress", action="store_true", help="no progress bar")
    load.add_argument("--no-digest", action="store_true",
                      help="skip the per-rank SHA-256 digest (it costs a pass over the bytes)")
    load.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                      help=f"timeout of every collective (default {DEFAULT_TIMEOUT_S:.0f})")
    load.add_argument("--cache-dir", default=None, metavar="DIR",
                      help="object stores: keep the bytes read in this node cache and take them from there "
                           "next time, whatever job, format or TP size (also DISTLOAD_CACHE_DIR; extra config "
                           "cache_dir; docs/cache.md)")
    load.add_argument("--cache-max-gib", type=float, default=None, metavar="GIB",
                      help="the node cache's size bound: the least recently used entries go beyond it (also "
                           "DISTLOAD_CACHE_MAX_GIB; extra config cache_max_gib; default: no bound)")
    _secret_options(load, listens=False)

    serve = sub.add_parser("serve", help="load a checkpoint and serve it from memory to jobs that load from "
                                         "tcp://HOST:PORT, until stopped (Ctrl-C, SIGTERM)")
    serve.add_argument("source", help="any checkpoint `load` reads: a file, a folder, an object-store URI")
    serve.add_argument("--address", required=True, metavar="tcp://HOST:PORT",
                       help="where loading jobs reach this server (rank 0 serves it; HOST: an address of "
                            "this node the loading jobs can reach, or 0.0.0.0)")
    serve.add_argument("--load-format", default="auto", type=str.lower,
                       help=f"how the server reads SOURCE: one of {', '.join(LOAD_FORMATS)} (default auto)")
    serve.add_argument("--model-loader-extra-config", default=None, metavar="JSON",
                       help="the load format's extra config, for the server's read of SOURCE")
    serve.add_argument("--device", default="auto",
                       help="where the served weights live: auto (cuda:<local_rank> or cpu), cpu, cuda")
    serve.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                       help=f"the longest one load (its joining, its transfer) may take, and the timeout of the "
                            f"server's own read (default {DEFAULT_TIMEOUT_S:.0f})")
    serve.add_argument("--bucket-mib", type=float, default=512,
                       help="the size of one transfer bucket, in MiB (default 512)")
    serve.add_argument("--cache-dir", default=None, metavar="DIR", help="as for load")
    serve.add_argument("--cache-max-gib", type=float, default=None, metavar="GIB", help="as for load")
    serve.add_argument("--no-progress", action="store_true", help="no progress bar for the server's read")
    _secret_options(serve, listens=True)

    # Python's reshard() does the same; "save-sharded" was its first name (Python's save_sharded()
    # saves from a running job), kept as an alias that says so.
    save = sub.add_parser("reshard", aliases=[OLD_RESHARD], help="reshard a whole checkpoint into per-rank files, "
                          f"offline (Python: distload.reshard; '{OLD_RESHARD}' is its old name)")
    save.add_argument("source", help="a whole safetensors checkpoint: a file or a folder (index.json honoured)")
    save.add_argument("output", help="a new or empty folder")
    save.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N",
                      help="the number of tensor-parallel ranks to write shards for (required, unless "
                           "--expert-parallel-size is given: then 1 by default)")
    save.add_argument("--file-pattern", default=DEFAULT_SHARD_PATTERN, metavar="P",
                      help=f"the shard file names, with {{rank}} and {{part}} (default {DEFAULT_SHARD_PATTERN!r})")
    save.add_argument("--max-file-size", type=int, default=DEFAULT_MAX_FILE_SIZE, metavar="BYTES",
                      help="start a new part past this many bytes (default 5 GiB)")
    save.add_argument("--sharding", "--plan", dest="sharding", default=None, metavar="SPEC",
                      help="the sharding spec: a built-in one (vllm: vLLM's engine names, which its "
                           "sharded_state loaders read; decoder, alias llama/mistral/qwen2/qwen3: the same slices "
                           "under the checkpoint's names; plain; replicate) or a JSON spec file (default: vllm "
                           "where vLLM is installed and builds the model, by its engine, or where distload's table "
                           "knows the model; else decoder, which vLLM's sharded_state does not read, as the summary "
                           "says); --plan is its old name")

    _expert_options(save, "write T x P shards: shard ep_rank * T + tp_rank holds its EP rank's experts (each "
                          "TP-sliced) and the TP slices of everything else; the manifest records P and the placement")

    verify = sub.add_parser("verify", help="check a pre-sharded checkpoint's files against its manifest")
    verify.add_argument("folder", help="a pre-sharded checkpoint saved by distload (a folder or an object-store prefix)")

    inspect = sub.add_parser("inspect", help="files, tensors, bytes, dtypes and layout of a checkpoint")
    inspect.add_argument("source", help="a safetensors file, a folder, or an object-store URI")
    inspect.add_argument("--pattern", default=None, metavar="P",
                         help=f"the shard file-name pattern to look for (default: the manifest's, "
                              f"else {DEFAULT_SHARD_PATTERN!r})")
    inspect.add_argument("--summary", action="store_true",
                         help="files, dtypes and totals only, not every tensor's name, dtype and shape")
    inspect.add_argument("--json", action="store_true", help="print JSON (every tensor included)")

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
                                "previous one's elements (e.g. 0.01), so every update after the first is a delta "
                                "(on one host only below about 0.015: there a byte costs a memory copy, and a "
                                "patch must save 31/32 of the bytes; default: every version all new)")
    sync_demo.add_argument("--report-json", default=None, metavar="PATH",
                           help="write each rank's versions, digests, bytes and seconds here")
    sync_demo.add_argument("--size-mib", type=int, default=256, help="approximate model size (default 256)")
    sync_demo.add_argument("--bucket-mib", type=int, default=64,
                           help="the size of one transfer bucket (default 64)")
    sync_demo.add_argument("--device", default="auto", help="auto (cuda:<local_rank> or cpu), cpu, cuda")
    sync_demo.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                           help=f"timeout of every collective (default {DEFAULT_TIMEOUT_S:.0f})")

    _secret_options(sync_demo, listens=True)

    sub.add_parser("secret", help="print a new job secret (64 hex digits) for DISTLOAD_SECRET or a secret file")

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
                      help="the timeout of every collective in the demo's job; the job gives up after "
                           "this many seconds times the number of formats (default 600)")
    return parser


def log_level(given: str | None, environ: "os._Environ[str] | dict[str, str]" = os.environ) -> int:
    """The level rank 0 logs at: --log-level, else $DISTLOAD_LOG_LEVEL, else info."""
    if given is None:
        value = environ.get(LOG_LEVEL_ENV, "").strip().lower()
        if not value:
            return logging.INFO
        if value not in LOG_LEVELS:
            raise ConfigError(f"{LOG_LEVEL_ENV}={environ[LOG_LEVEL_ENV]!r} is not a log level; "
                              f"use one of {', '.join(LOG_LEVELS)} (or unset it for info)")
        given = value
    return getattr(logging, given.upper())


def _expert_options(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--expert-parallel-size", "-ep", type=int, default=None, metavar="P", help=what)
    parser.add_argument("--expert-placement-strategy", default=None, choices=("linear", "round_robin"),
                        help="vLLM's expert placement: linear (default: EP rank r holds a contiguous run of "
                             "experts) or round_robin (experts r, r + P, r + 2P, ...)")


def _setup_logging(rank: int | str, level: int) -> None:
    # Rank 0 speaks for the job; the other ranks say only what went wrong on them, unless debug
    # was asked for: then every rank's steps matter.
    logging.basicConfig(
        level=level if rank == 0 or level <= logging.DEBUG else max(level, logging.WARNING),
        format=f"[distload rank {rank}] %(message)s",
        stream=sys.stderr,
    )


def run_load(args: argparse.Namespace) -> int:
    from distload.loading.loader import Loader
    from distload.live.from_server import is_server_address, load_from_server

    check_arguments(args)
    extra = _with_cache_flags(args)
    with WorkerGroup(device=args.device, timeout_s=args.timeout) as group, reported_here(args, group):
        if is_server_address(args.source):
            report = load_from_server(args.source, group=group, tensor_parallel_size=args.tensor_parallel_size,
                                      sharding=args.sharding, expert_parallel_size=args.expert_parallel_size,
                                      expert_placement_strategy=args.expert_placement_strategy,
                                      digest=not args.no_digest, secret_file=args.secret_file).report
        else:
            loader = Loader(args.source, args.load_format, extra,
                            group=group, progress=not args.no_progress,
                            tensor_parallel_size=args.tensor_parallel_size, sharding=args.sharding,
                            expert_parallel_size=args.expert_parallel_size,
                            expert_placement_strategy=args.expert_placement_strategy)
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


class _Stopped(Exception):
    """SIGTERM, as the serve command's main thread sees it."""


def run_serve(args: argparse.Namespace) -> int:
    import signal

    from distload.live.server import serve_checkpoint

    check_arguments(args)
    with WorkerGroup(device=args.device, timeout_s=args.timeout) as group, reported_here(args, group):
        start = time.perf_counter()
        server = serve_checkpoint(args.source, args.address, group, load_format=args.load_format,
                                  extra_config=_with_cache_flags(args), progress=not args.no_progress,
                                  timeout_s=args.timeout, bucket_bytes=int(args.bucket_mib * 2**20),
                                  secret_file=args.secret_file, insecure=args.insecure)

        def stop(signum, frame):
            raise _Stopped()

        signal.signal(signal.SIGTERM, stop)
        try:
            held = sum(t.numel() * t.element_size() for t in server.state.values())
            print(f"distload: rank {group.rank} serves {len(server.state)} tensors ({gib_text(held)}) of "
                  f"{args.source} at {args.address}, read in {time.perf_counter() - start:.2f} s; stop with "
                  f"Ctrl-C or SIGTERM", flush=True)
            server.serve_forever()
        except (KeyboardInterrupt, _Stopped):
            pass
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            server.close()
        print(f"distload: rank {group.rank} stopped serving {args.address}: {server.served} load(s) served, "
              f"{server.failed} failed", flush=True)
    return 0


def _with_cache_flags(args: argparse.Namespace):
    """The extra config with --cache-dir and --cache-max-gib as its keys (the same setting given
    two different ways is an error, not a silent pick)."""
    from distload.config import parse_extra_config

    flags = {"cache_dir": args.cache_dir, "cache_max_gib": args.cache_max_gib}
    if all(value is None for value in flags.values()):
        return args.model_loader_extra_config
    extra = parse_extra_config(args.model_loader_extra_config)
    for key, value in flags.items():
        if value is None:
            continue
        if key in extra and extra[key] != value:
            raise ConfigError(f"--{key.replace('_', '-')} {value} and the extra config's '{key}': "
                              f"{extra[key]!r} disagree; give it once")
        extra[key] = value
    return extra


def run_reshard(args: argparse.Namespace) -> int:
    from distload.vllm.save import reshard

    if args.command == OLD_RESHARD:
        sys.stderr.write(f"distload: '{OLD_RESHARD}' is the old name of 'reshard' (the same command); "
                         f"use 'distload reshard'\n")

    report = reshard(args.source, args.output, args.tensor_parallel_size, pattern=args.file_pattern,
                     max_file_size=args.max_file_size, sharding=args.sharding,
                     expert_parallel_size=args.expert_parallel_size,
                     expert_placement_strategy=args.expert_placement_strategy)
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
    from distload.checkpoints.inspection import inspect_source, summary_lines

    info = inspect_source(args.source, args.pattern)
    print(json.dumps(info, indent=1) if args.json else "\n".join(summary_lines(info, tensors=not args.summary)),
          flush=True)
    return 0


def run_pull(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from distload.fileio import write_json_atomic
    from distload.checkpoints.pull import pull

    chunk_bytes = int(args.chunk_mib * 1024 * 1024)
    if chunk_bytes <= 0:
        raise ConfigError(f"--chunk-mib must be positive, got {args.chunk_mib}")
    with WorkerGroup(device="cpu", timeout_s=args.timeout) as group, reported_here(args, group):
        report = pull(args.source, args.dest, group=group, chunk_bytes=chunk_bytes)
        reports = group.exchange(asdict(report))
        if group.rank == 0:
            print(f"distload: pulled {args.source} to {args.dest} on {len(reports)} rank(s)", flush=True)
            for r in reports:
                # The same fields on every rank's line; a rank that is not its node's writer only
                # reads and sends, and says so after the (zero) numbers.
                sends_only = "" if r["writes"] else " (sends only: another rank writes its node's copy)"
                print(f"  rank {r['rank']} ({r['hostname']}): read {gib_text(r['requested_bytes'])} from the "
                      f"source; wrote {len(r['fetched'])} file(s), {gib_text(r['written_bytes'])}, kept "
                      f"{len(r['kept'])}{sends_only}; {r['seconds']:.2f} s", flush=True)
            total = sum(r["requested_bytes"] for r in reports)
            print(f"  read from the source, whole job: {gib_text(total)}", flush=True)
            if args.report_json:
                write_json_atomic(args.report_json, {"source": args.source, "ranks": reports}, indent=2)
    return 0


# Commands that run in one process, outside any group.
OFFLINE_COMMANDS = ("reshard", OLD_RESHARD, "verify", "inspect")


def check_arguments(args: argparse.Namespace) -> None:
    """What can be checked from the arguments alone (load format names, extra-config JSON and
    keys, sizes, patterns), before any process group: a bad flag costs no rendezvous. The
    launchers run it once before they start any rank (:func:`precheck`)."""
    if args.command in ("load", "serve"):
        make_load_config(args.load_format, _with_cache_flags(args))
    if args.command in ("load", "serve", "sync-demo"):
        check_device(args.device)
    if args.command == "serve":
        from distload.live.rendezvous import check_listen, parse_address
        from distload.live.secret import job_secret

        # Before the checkpoint is read: a server that may not listen there fails in a second.
        check_listen(parse_address(args.address)[0], args.address, job_secret(args.secret_file), args.insecure)
        if args.bucket_mib <= 0:
            raise ConfigError(f"--bucket-mib must be positive, got {args.bucket_mib}")
    if args.command == "load" and args.source.startswith("tcp://"):
        from distload.live.rendezvous import parse_address

        parse_address(args.source)
        given = [flag for flag, value in (("--load-format", args.load_format != "auto"),
                                          ("--model-loader-extra-config", args.model_loader_extra_config),
                                          ("--cache-dir", args.cache_dir), ("--cache-max-gib", args.cache_max_gib))
                 if value]
        if given:
            raise ConfigError(f"{', '.join(given)}: how to read storage, and a load from a server "
                              f"({args.source}) reads none; the server was given them (`distload serve`)")
    if args.command == "load" and args.tensor_parallel_size is not None and args.tensor_parallel_size < 1:
        raise ConfigError(f"--tensor-parallel-size must be a whole number >= 1, got {args.tensor_parallel_size}")
    if args.command in ("reshard", OLD_RESHARD) and args.tensor_parallel_size is None \
            and args.expert_parallel_size is None:
        raise ConfigError("reshard: --tensor-parallel-size N (the number of tensor-parallel ranks to write shards "
                          "for) is required, or --expert-parallel-size P")
    if args.command in ("load", "reshard", OLD_RESHARD):
        if args.expert_parallel_size is not None and args.expert_parallel_size < 1:
            raise ConfigError(f"--expert-parallel-size must be a whole number >= 1, got {args.expert_parallel_size}")
        if args.expert_placement_strategy is not None and args.expert_parallel_size is None:
            raise ConfigError("--expert-placement-strategy places experts over --expert-parallel-size ranks; "
                              "give --expert-parallel-size too")
    if args.command == "sync-demo":
        if args.role is not None and args.rendezvous is None:
            raise ConfigError(f"sync-demo --role {args.role} needs --rendezvous tcp://HOST:PORT (the same on both "
                              f"jobs; without --role, one job's rank 0 is the trainer)")
        for flag, value in (("--versions", args.versions), ("--bucket-mib", args.bucket_mib),
                            ("--size-mib", args.size_mib), ("--tensor-parallel-size", args.tensor_parallel_size)):
            if value < 1:
                raise ConfigError(f"sync-demo {flag} must be a whole number >= 1, got {value}")
    if args.command == "pull" and args.chunk_mib <= 0:
        raise ConfigError(f"--chunk-mib must be positive, got {args.chunk_mib}")
    if args.command == "inspect" and args.pattern is not None:
        check_pattern("--pattern", args.pattern)


def precheck(argv: list[str]) -> int:
    """Check a command line before a launcher starts ranks with it (launch/torchrun_local.sh, the
    Slurm load scripts): a misspelt flag, format or extra-config key is one message here, not one
    per rank after the ranks' start-up. 0 when it would run; argparse's usage error (2) or 1 with
    the message."""
    args = build_parser().parse_args(argv)
    try:
        check_arguments(args)
    except ConfigError as exc:
        sys.stderr.write(f"distload: error: {exc}\n")
        return 1
    return 0


# Before the group forms nothing tells the ranks that rank 0 has printed a failure they all share.
# The silent ones linger this long before they exit: torchrun's agent stops the ranks still
# running as soon as one has exited, so a silent rank that ends first could take rank 0's line
# with it. Rank 0 exits the moment it has printed, and the agent then ends the lingering ranks:
# the wait costs nothing unless rank 0 is slow to get there.
LINGER_S = 5.0


def _silent_rank_lingers(rank: int | str, world_size: int, failures: dict[int, str] | None) -> None:
    if failures is not None and world_size > 1 and rank != 0:
        time.sleep(LINGER_S)


class _Reported(Exception):
    """An error already printed (inside a group, before it closed); main only sets the exit code."""


def report_error(exc: BaseException, command: str, rank: int | str, world_size: int,
                 job_failures: dict[int, str] | None = None) -> None:
    """Print a rank's failure, once for the job where every rank failed the same way, and hand it
    to torchrun's agent as this rank's root cause.

    Every rank writes torch's error file (``TORCHELASTIC_ERROR_FILE``, set by torchrun) with the
    message and no Python traceback, so torchrun's failure summary shows distload's message where
    it would say "To enable traceback see ...". On stderr, a failure that every rank shares (the
    same message on every rank of the job, as the agreement step tells each of them, or an
    argument error, which only depends on the command line every rank was given) is printed by
    rank 0 alone: the other ranks' copies would only bury it.
    """
    message = str(exc)
    if command in OFFLINE_COMMANDS:  # one process: no rank to name
        line = f"distload: error: {message}"
    elif job_failures is not None and world_size > 1:
        line = f"distload: error on {rank_list(list(job_failures))} (every rank): {message}"
    else:
        line = f"distload: error on rank {rank}: {message}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        # torch's format (torch.distributed.elastic.multiprocessing.errors.ErrorHandler) without
        # "py_callstack": the summary then shows the message itself.
        payload = {"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}
        try:
            with open(error_file, "w", encoding="utf-8") as f:
                json.dump(payload, f)
        except OSError:
            pass  # the summary loses the message; stderr still has it
    if job_failures is not None and world_size > 1 and rank != 0:
        return
    # One write per message: under torchrun the ranks share stderr, and print() writes the
    # newline separately, so two ranks' lines would run together.
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def shared_failure(exc: BaseException, launch: LaunchInfo) -> dict[int, str] | None:
    """Every rank's failure where all ranks of the job failed with this exception's message (the
    agreement step leaves what each rank said on the exception, and an error that every rank
    raises alike says so: errors.on_every_rank), else None."""
    world_size = launch.world_size
    scope = getattr(exc, EVERY_RANK_ATTRIBUTE, None)
    if scope == "job" or (scope == "node" and launch.local_world_size == world_size):
        return {rank: str(exc) for rank in range(world_size)}
    failures = getattr(exc, "job_failures", None)
    if not failures or len(failures) != world_size or set(failures.values()) != {str(exc)}:
        return None
    return failures


@contextlib.contextmanager
def reported_here(args: argparse.Namespace, group: WorkerGroup) -> Iterator[None]:
    """Report a failure inside the group, before it closes: the ranks fail within moments of
    each other, and torchrun's agent stops the ranks still running once one has exited, so a
    message printed after the group's teardown could be cut off."""
    try:
        yield
    except DistloadError as exc:
        shared = shared_failure(exc, group.launch)
        if shared is not None and getattr(exc, "job_failures", None) is None:
            # Raised alike on every rank, outside any agreement step: agree on it now (every rank
            # is here), so that rank 0 prints it while the others wait for it, not after torchrun
            # stopped it because another rank had already exited.
            group.report_failure(args.command, exc)
        report_error(exc, args.command, group.rank, group.world_size, shared)
        raise _Reported() from exc


def _run(args: argparse.Namespace) -> int:
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
    if args.command == "serve":
        return run_serve(args)
    if args.command == "secret":
        from distload.live.secret import make_secret

        print(make_secret())
        return 0
    if args.command == "demo":
        from distload.cli.demo import run_demo

        return run_demo(args)
    raise AssertionError(args.command)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank: int | str = "?"
    world_size = 1
    launch = LaunchInfo("single", 0, 1, 0, 1, None)
    try:
        try:
            launch = detect_launch()
            rank, world_size = launch.rank, launch.world_size
            try:
                level = log_level(args.log_level)
            except ConfigError as exc:
                raise on_every_rank(exc, "node")  # the node's environment, which its ranks share
            _setup_logging(rank, level)
            try:
                check_arguments(args)
            except ConfigError as exc:
                # The same command line on every rank: every rank fails the same way.
                failures = {r: str(exc) for r in range(world_size)}
                report_error(exc, args.command, rank, world_size, failures)
                _silent_rank_lingers(rank, world_size, failures)
                return 1
            return _run(args)
        except _Reported:
            return 1
        except DistloadError as exc:  # outside the group: before it formed, or a one-process command
            failures = shared_failure(exc, launch)
            report_error(exc, args.command, rank, world_size, failures)
            _silent_rank_lingers(rank, world_size, failures)
            return 1
        except KeyboardInterrupt:
            print(f"distload: interrupted on rank {rank}", file=sys.stderr, flush=True)
            return 130
    except BrokenPipeError:
        # The reader went away (`distload inspect ... | head`): what it wanted it has, so no
        # traceback. Python would try to flush stdout again at exit and fail the same way: point it
        # at /dev/null first. 141 is what a shell reports for a command ended by SIGPIPE.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
