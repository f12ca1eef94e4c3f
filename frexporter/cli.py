"""Command line: the only place in frexporter that exits."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from frexporter import __version__, spool

DEFAULT_LISTEN = ":9477"
DEFAULT_POLL_INTERVAL = 1.0
DEFAULT_STUCK_AFTER = 60.0
DEFAULT_RANK_TIMEOUT = 2.0


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"--listen wants HOST:PORT, got {value!r}")
    host = host.strip("[]") or "0.0.0.0"
    try:
        port_num = int(port)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--listen: port {port!r} is not a number") from e
    if not 0 <= port_num <= 65535:
        raise argparse.ArgumentTypeError(f"--listen: port {port_num} out of range")
    return host, port_num


def _positive(value: str) -> float:
    try:
        number = float(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from e
    if number <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be > 0")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="frexporter",
        description="Live PyTorch Flight Recorder state per rank and process group, for Prometheus.",
    )
    parser.add_argument("--version", action="version", version=f"frexporter {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("FREXPORTER_LOG_LEVEL", "info"),
                        choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the node exporter (reads every local rank)",
                           description="Serve /metrics, /healthz, /api/v1/status and / for the ranks "
                                       "that publish to the spool directory.")
    serve.add_argument("--dir", default=None,
                       help="spool directory the ranks publish to (default: $FREXPORTER_DIR, else "
                            "frexporter-$UID under the system temp dir)")
    serve.add_argument("--listen", type=parse_listen, default=parse_listen(DEFAULT_LISTEN),
                       metavar="HOST:PORT", help=f"address for HTTP (default {DEFAULT_LISTEN})")
    serve.add_argument("--poll-interval", type=_positive, default=DEFAULT_POLL_INTERVAL, metavar="SECONDS",
                       help=f"how often ranks are read, independent of scrapes (default {DEFAULT_POLL_INTERVAL})")
    serve.add_argument("--stuck-after", type=_positive, default=DEFAULT_STUCK_AFTER, metavar="SECONDS",
                       help="how long a collective may wait on missing ranks before it is a verdict "
                            f"(default {DEFAULT_STUCK_AFTER:.0f})")
    serve.add_argument("--rank-timeout", type=_positive, default=DEFAULT_RANK_TIMEOUT, metavar="SECONDS",
                       help=f"longest one rank's socket may take per poll (default {DEFAULT_RANK_TIMEOUT})")
    serve.add_argument("--no-nvml", action="store_true", help="do not read GPU state from NVML")
    serve.add_argument("--evidence-dir", default=None, metavar="DIR",
                       help="where evidence bundles go when a verdict appears (default: <spool>/evidence; "
                            "'' to disable)")
    serve.add_argument("--evidence-stacks", action="store_true",
                       help="also capture py-spy stacks of culprit ranks in evidence (needs py-spy and ptrace)")
    serve.add_argument("--otlp-endpoint", default=None, metavar="URL",
                       help="also push the metrics over OTLP: http://HOST:4318 (HTTP/protobuf) or grpc://HOST:4317")
    serve.add_argument("--otlp-protocol", choices=["http/protobuf", "grpc"], default=None,
                       help="OTLP transport when the URL scheme does not say (default: from the scheme)")
    serve.add_argument("--otlp-interval", type=_positive, default=15.0, metavar="SECONDS",
                       help="seconds between OTLP pushes (default 15)")

    run = sub.add_parser("run", help="run a training command with the recorder in every rank",
                         description="Run COMMAND with the recorder installed in every Python process "
                                     "(no code change), e.g. frexporter run -- torchrun --nproc-per-node 8 "
                                     "train.py")
    run.add_argument("--dir", default=None, help="spool directory (default: $FREXPORTER_DIR)")
    run.add_argument("--job-id", default=None, help="job id label (default: the launcher's run id)")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND...")

    analyze = sub.add_parser(
        "analyze", help="verdicts from FR dump files / evidence bundles, or a whole job in Prometheus",
        description="Print the verdicts for torch Flight Recorder dump files (one per rank, JSON or pickle, any "
                    "<prefix><rank> name; pickles are read with a restricted unpickler), for an evidence bundle "
                    "written by `frexporter serve`, or for a job's series in Prometheus.")
    analyze.add_argument("dir", nargs="?", help="directory of FR dump files or an evidence bundle")
    analyze.add_argument("--prometheus", metavar="URL", help="query this Prometheus instead of reading files")
    analyze.add_argument("--job-id", default=None, help="restrict to one job (Prometheus)")
    analyze.add_argument("--stuck-after", type=float, default=None, metavar="SECONDS",
                         help="wait before a collective counts as stuck (default: 0 for dumps, "
                              f"{DEFAULT_STUCK_AFTER:.0f} for Prometheus)")
    analyze.add_argument("--json", action="store_true", help="print the verdicts as a JSON list")

    demo = sub.add_parser("demo", help="a local 4-rank CPU job with an injected hang, watched by the exporter")
    demo.add_argument("--ranks", type=int, default=4, help="number of gloo ranks (default 4)")
    demo.add_argument("--keep", action="store_true", help="keep the spool directory for inspection")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return _serve(args)
    if args.command == "run":
        return _run(args)
    if args.command == "analyze":
        return _analyze(parser, args)
    if args.command == "demo":
        from frexporter.demo import run_demo

        return run_demo(ranks=args.ranks, keep=args.keep)
    parser.print_help()
    return 2


def _serve(args: argparse.Namespace) -> int:
    from frexporter.app import build_app

    directory = args.dir or spool.default_dir()
    if not os.path.isdir(directory):
        print(f"frexporter: spool directory {directory} does not exist yet; waiting for ranks to create it",
              file=sys.stderr)
    host, port = args.listen
    try:
        app = build_app(directory=directory, host=host, port=port, poll_interval=args.poll_interval,
                        stuck_after=args.stuck_after, rank_timeout=args.rank_timeout, nvml=not args.no_nvml,
                        otlp_endpoint=args.otlp_endpoint, otlp_interval=args.otlp_interval,
                        otlp_protocol=args.otlp_protocol, evidence_dir=args.evidence_dir,
                        evidence_stacks=args.evidence_stacks)
    except OSError as e:
        print(f"frexporter: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return 1
    except ValueError as e:  # OtlpConfigError: a bad --otlp-* value or the exporter package is missing
        print(f"frexporter: {e}", file=sys.stderr)
        return 2
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    app.start()
    logging.getLogger("frexporter").info("serving on http://%s:%d/ (spool %s)", host, app.port, directory)
    done.wait()
    app.stop()
    return 0


def _run(args: argparse.Namespace) -> int:
    from frexporter.launcher import run_with_recorder

    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        print("frexporter run: no command given (usage: frexporter run -- COMMAND...)", file=sys.stderr)
        return 2
    try:
        return run_with_recorder(argv, directory=args.dir, job_id=args.job_id)
    except FileNotFoundError:
        print(f"frexporter run: command not found: {argv[0]}", file=sys.stderr)
        return 127


def _analyze(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from frexporter.analysis import frdump, prom, report

    if bool(args.dir) == bool(args.prometheus):
        parser.error("analyze needs either DIR or --prometheus URL")
    try:
        if args.prometheus:
            stuck = DEFAULT_STUCK_AFTER if args.stuck_after is None else args.stuck_after
            result = report.from_prometheus(args.prometheus, args.job_id, stuck)
        else:
            result = report.from_dir(args.dir, 0.0 if args.stuck_after is None else args.stuck_after)
    except (frdump.DumpError, prom.PrometheusError) as e:
        print(f"frexporter analyze: {e}", file=sys.stderr)
        return 1
    if not result.ranks:
        print(f"frexporter analyze: no rank data in {result.source}", file=sys.stderr)
        for problem in result.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print(report.render_json(result.verdicts) if args.json else report.render_text(result))
    return 0
