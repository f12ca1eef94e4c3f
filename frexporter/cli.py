"""Command line: the only place in frexporter that exits."""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from frexporter import __version__, defaults, extras, safetext, spool
from frexporter import naming as n
from frexporter.sources import SOURCES

if TYPE_CHECKING:
    from frexporter.app import ServeConfig
    from frexporter.web.webconfig import WebConfig

SPOOL_RECHECK_SECONDS = 1.0


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


def _seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from e
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"{value!r} is not a finite number")
    return number


def _positive(value: str) -> float:
    number = _seconds(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be > 0")
    return number


def _non_negative(value: str) -> float:
    number = _seconds(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be >= 0")
    return number


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from e
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} must be >= 1")
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
    serve.add_argument("--listen", type=parse_listen, default=parse_listen(defaults.LISTEN),
                       metavar="HOST:PORT", help=f"address for HTTP (default {defaults.LISTEN})")
    serve.add_argument("--poll-interval", type=_positive, default=defaults.POLL_INTERVAL, metavar="SECONDS",
                       help=f"how often ranks are read, independent of scrapes (default {defaults.POLL_INTERVAL})")
    serve.add_argument("--stuck-after", type=_positive, default=defaults.STUCK_AFTER, metavar="SECONDS",
                       help="how long a collective may wait on missing ranks before it is a verdict: the "
                            "ceiling of each process group's learned threshold, and the threshold until one is "
                            f"learned (default {defaults.STUCK_AFTER:.0f})")
    serve.add_argument("--stuck-floor", type=_non_negative, default=defaults.STUCK_FLOOR, metavar="SECONDS",
                       help="the shortest learned stuck threshold, whatever a process group's history says "
                            f"(default {defaults.STUCK_FLOOR:.0f})")
    serve.add_argument("--stuck-multiple", type=_positive, default=defaults.STUCK_MULTIPLE, metavar="FACTOR",
                       help="learned stuck threshold = this x the process group's high quantile of waits and "
                            f"gaps between completions (default {defaults.STUCK_MULTIPLE:g})")
    serve.add_argument("--rank-timeout", type=_positive, default=defaults.RANK_TIMEOUT, metavar="SECONDS",
                       help=f"longest one rank's socket may take per poll (default {defaults.RANK_TIMEOUT})")
    serve.add_argument("--source-timeout", type=_positive, default=defaults.SOURCE_TIMEOUT, metavar="SECONDS",
                       help="longest one source's collection may take (a hung NVML call, a spool on a hung "
                            "filesystem), the ranks source's on top of --rank-timeout: past it the source is down "
                            "(reason timeout), its last reading is served stale, the poll goes on without it, and it "
                            f"is not called again until that call returns (default {defaults.SOURCE_TIMEOUT:g})")
    serve.add_argument("--deep-interval", type=_non_negative, default=defaults.DEEP_INTERVAL, metavar="SECONDS",
                       help="least time between routine reads of a busy rank's Flight Recorder ring over its "
                            "socket, which feed collective bytes, durations and straggler scores; work that "
                            "stops moving is read at once whatever this says. Each read of a full ring costs "
                            "the rank ~20 ms of CPU in torch's worker server; where reads take longer (a slow "
                            "node, a larger ring) they are spaced so as to take at most "
                            f"{defaults.DEEP_READ_SHARE * 100:g} %% of the rank's time. 0: whenever values move "
                            f"(default {defaults.DEEP_INTERVAL:g})")
    for info in SOURCES:
        serve.add_argument(f"--source.{info.name}", dest=f"source_{info.name}", action=argparse.BooleanOptionalAction,
                           default=info.enabled_by_default,
                           help=f"read {info.help} (default: {'on' if info.enabled_by_default else 'off'})")
    serve.add_argument("--no-nvml", dest="source_nvml", action="store_false",
                       help="the same as --no-source.nvml")
    serve.add_argument("--per-rank-durations", action="store_true",
                       help="label collective durations and bytes by rank (one histogram per rank, PG and op) "
                            "instead of summing the node's ranks; multiplies those series by the ranks per node")
    serve.add_argument("--collective-waits", action="store_true",
                       help="export each rank's mean wait inside each PG's collectives (NCCL only; one series per "
                            "rank and PG), which FrexporterStraggler compares across nodes")
    serve.add_argument("--nvml.nvlink-per-link", dest="nvlink_per_link", action="store_true",
                       help="NVLink error counters per link (18 links x 4 types per GPU) instead of per GPU")
    serve.add_argument("--verdict-confirm-after", type=_non_negative, default=defaults.VERDICT_CONFIRM_AFTER,
                       metavar="SECONDS",
                       help="how long a verdict must persist before it is logged and its evidence captured; it is "
                            f"in /metrics and /api/v1/status at once (default {defaults.VERDICT_CONFIRM_AFTER:g})")
    serve.add_argument("--evidence-dir", default=None, metavar="DIR",
                       help="where evidence bundles go when a verdict appears (default: <spool>/evidence; "
                            "'' to disable)")
    serve.add_argument("--evidence-stacks", action="store_true",
                       help="py-spy stacks, run by torch's worker server in the rank: culprits' in evidence "
                            "bundles, and a wedged rank's main thread in its activity (needs py-spy on the ranks' "
                            "PATH and ptrace permitted in their containers)")
    serve.add_argument("--web-config", default=None, metavar="FILE",
                       help="TLS and basic auth for every endpoint, from a Prometheus exporter-toolkit web config "
                            "file (tls_server_config, basic_auth_users, http_server_config); see SECURITY.md")
    serve.add_argument("--web-max-connections", type=_positive_int, default=defaults.WEB_MAX_CONNECTIONS, metavar="N",
                       help="open HTTP connections at most, kept-alive ones included; more are closed unserved "
                            f"(a 503 over plain HTTP) and counted in {n.HTTP_CONNECTIONS_REJECTED_TOTAL} "
                            f"(default {defaults.WEB_MAX_CONNECTIONS})")
    serve.add_argument("--enable-debug-endpoints", action="store_true",
                       help="serve /api/v1/evidence (the evidence bundles and their verdicts); refused on a "
                            "non-loopback --listen unless --web-config sets up TLS and authentication")
    serve.add_argument("--strict-permissions", action="store_true",
                       help="refuse to run (exit 2) when the spool directory is writable by others or its files "
                            "are open to every user, and stop reading it (source_up 0) while it becomes so, "
                            "instead of logging a warning")
    serve.add_argument("--otlp-endpoint", default=None, metavar="URL",
                       help="also push the metrics over OTLP: http://HOST:4318 (HTTP/protobuf) or grpc://HOST:4317")
    serve.add_argument("--otlp-protocol", choices=["http/protobuf", "grpc"], default=None,
                       help="OTLP transport when the URL scheme does not say (default: from the scheme)")
    serve.add_argument("--otlp-interval", type=_positive, default=defaults.OTLP_INTERVAL, metavar="SECONDS",
                       help=f"seconds between OTLP pushes (default {defaults.OTLP_INTERVAL:g})")

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
                    "written by `frexporter serve`, or for a job's series in Prometheus. From dump files it also "
                    "lists collectives that completed although their ranks disagreed (past_mismatch) and ranks "
                    "still at a collective their peers completed (lagging_rank), after the hangs.")
    analyze.add_argument("dir", nargs="?", help="directory of FR dump files or an evidence bundle")
    analyze.add_argument("--prometheus", metavar="URL", action="append",
                         help="query this Prometheus instead of reading files; repeat it for every shard of a "
                              "tiered layout (each holds some nodes' series): the job is judged over all of them")
    analyze.add_argument("--job-id", default=None, help="restrict to one job (Prometheus)")
    analyze.add_argument("--stuck-after", type=float, default=None, metavar="SECONDS",
                         help="wait before a collective counts as stuck (default: 0 for dumps; for Prometheus "
                              "the thresholds the exporters export, as the alert rules use them, and "
                              f"{defaults.STUCK_AFTER:.0f} where none is exported); a number caps them")
    analyze.add_argument("--json", action="store_true", help="print the verdicts as a JSON list")

    demo = sub.add_parser("demo", help="a local 4-rank CPU job with an injected hang, watched by the exporter")
    demo.add_argument("--ranks", type=int, default=defaults.DEMO_RANKS,
                      help=f"number of gloo ranks (default {defaults.DEMO_RANKS})")
    demo.add_argument("--keep", action="store_true", help="keep the spool directory for inspection")
    return parser


class EscapingFormatter(logging.Formatter):
    """Log lines that text from a rank cannot break or forge.

    A message holds job ids, host names, PG descriptions and paths, all untrusted: a newline in one would start
    a line of its own (a forged ``CRITICAL`` line), an ESC sequence would drive the reader's terminal. The
    message is escaped whole (``safetext.printable``); a traceback keeps its lines but each is indented, so
    that every line starting at the left margin is one this formatter began.
    """

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = safetext.printable(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indented(super().formatStack(stack_info))


def _indented(text: str) -> str:
    return "\n".join("    " + safetext.printable(line) for line in text.split("\n"))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(EscapingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), handlers=[handler])
    if args.command == "serve":
        return _serve(args)
    if args.command == "run":
        return _run(args)
    if args.command == "analyze":
        return _analyze(parser, args)
    if args.command == "demo":
        try:
            extras.require(extras.SERVE, "frexporter demo")
        except extras.MissingExtraError as e:
            print(f"frexporter: {e}", file=sys.stderr)
            return 2
        from frexporter.demo import run_demo

        return run_demo(ranks=args.ranks, keep=args.keep)
    parser.print_help()
    return 2


def _serve(args: argparse.Namespace) -> int:
    try:  # before anything binds or imports the daemon's dependencies
        extras.require(extras.SERVE, "frexporter serve")
        if args.otlp_endpoint:
            extras.require(extras.OTLP, "frexporter serve --otlp-endpoint")
    except extras.MissingExtraError as e:
        print(f"frexporter: {e}", file=sys.stderr)
        return 2
    from frexporter.app import build_app

    log = logging.getLogger("frexporter")
    warning = root_warning(os.geteuid())
    if warning:
        log.warning("%s", warning)
    web_config = None
    if args.web_config:
        from frexporter.web.webconfig import WebConfigError, load_web_config

        try:
            web_config = load_web_config(args.web_config)
        except WebConfigError as e:
            print(f"frexporter: --web-config: {e}", file=sys.stderr)
            return 2
        if web_config.basic_auth_users and web_config.tls is None:
            log.warning("%s has basic_auth_users but no tls_server_config: passwords cross the network in clear "
                        "text", args.web_config)
    config = serve_config(args, web_config)
    if not os.path.isdir(config.directory):
        print(f"frexporter: spool directory {config.directory} does not exist yet; waiting for ranks to create it",
              file=sys.stderr)
    try:
        app = build_app(config)
    except OSError as e:
        print(f"frexporter: cannot listen on {config.host}:{config.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    except ValueError as e:  # OtlpConfigError, or WebConfigError: debug endpoints exposed without TLS and auth
        print(f"frexporter: {e}", file=sys.stderr)
        return 2
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    app.start()
    log.info("serving on %s://%s:%d/ (spool %s)", app.server.scheme, config.host, app.port, config.directory)
    # --strict-permissions: the ranks source judges the spool; one it refuses on its first read (at start, or once
    # a sidecar's trainer created it) is a refusal to run.
    watching = config.strict_permissions
    while True:
        if watching:
            refusal, watching = _first_read_refusal(app)
            if refusal is not None:
                print(f"frexporter: {refusal}", file=sys.stderr)
                app.stop()
                return 2
        if done.wait(SPOOL_RECHECK_SECONDS if watching else None):
            break
    app.stop()
    return 0


def serve_config(args: argparse.Namespace, web_config: WebConfig | None = None) -> ServeConfig:
    """The one ``ServeConfig`` of ``serve``'s parsed flags (``web_config``: the loaded ``--web-config``)."""
    from frexporter.app import ServeConfig

    host, port = args.listen
    return ServeConfig(
        directory=args.dir or spool.default_dir(), host=host, port=port, poll_interval=args.poll_interval,
        stuck_after=args.stuck_after, stuck_floor=args.stuck_floor, stuck_multiple=args.stuck_multiple,
        rank_timeout=args.rank_timeout, source_timeout=args.source_timeout, deep_interval=args.deep_interval,
        sources=[info.name for info in SOURCES if getattr(args, f"source_{info.name}")],
        per_rank_durations=args.per_rank_durations, collective_waits=args.collective_waits,
        nvlink_per_link=args.nvlink_per_link,
        verdict_confirm_after=args.verdict_confirm_after, evidence_dir=args.evidence_dir,
        evidence_stacks=args.evidence_stacks, web_config=web_config, debug_endpoints=args.enable_debug_endpoints,
        strict_permissions=args.strict_permissions, max_connections=args.web_max_connections,
        otlp_endpoint=args.otlp_endpoint, otlp_interval=args.otlp_interval, otlp_protocol=args.otlp_protocol)


def root_warning(euid: int) -> str | None:
    """The one-time note for an exporter started as root, which it never needs."""
    if euid != 0:
        return None
    return ("running as root, which frexporter serve does not need: run it as an unprivileged user (the image "
            f"uses uid 65532); to read ranks of several users share the spool by group ({spool.GROUP_ENV}=1), "
            "and for --evidence-stacks grant CAP_SYS_PTRACE rather than root")


def _first_read_refusal(app: Any) -> tuple[str | None, bool]:
    """(the ranks source's refusal of the spool on its first read, whether to keep watching for that read).

    The policy is the ranks source's (sources/ranks/permissions.py): under --strict-permissions it refuses a
    spool others may change, and is down while it does. This only maps that verdict to the exit status."""
    from frexporter.sources.ranks.permissions import REASON

    status = next((s for s in app.exporter.snapshot.sources if s.name == n.SOURCE_RANKS), None)
    if status is None or status.up:
        return None, False  # no ranks source, or the spool was read
    if status.errors_total.get(REASON):
        return status.last_error, False
    return None, True  # not read yet: the spool does not exist (yet), or could not be opened


def _run(args: argparse.Namespace) -> int:
    from frexporter.recorder.launcher import run_with_recorder

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
    from frexporter.postmortem import dumpfiles, prometheus, report

    if bool(args.dir) == bool(args.prometheus):
        parser.error("analyze needs either DIR or --prometheus URL")
    # What is printed is escaped already (safetext.printable, ASCII JSON); a character the terminal's encoding
    # lacks (a PG description in Chinese under LC_ALL=C) is written as an escape rather than ending the run.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        if args.prometheus:
            result = report.from_prometheus(args.prometheus, args.job_id, args.stuck_after)
        else:
            result = report.from_dir(args.dir, 0.0 if args.stuck_after is None else args.stuck_after)
    except (dumpfiles.DumpError, prometheus.PrometheusError) as e:
        print(f"frexporter analyze: {safetext.printable(e)}", file=sys.stderr)
        return 1
    if not result.ranks:
        print(f"frexporter analyze: no rank data in {safetext.printable(result.source)}", file=sys.stderr)
        for problem in result.problems:
            print(f"  {safetext.printable(problem)}", file=sys.stderr)
        return 1
    print(report.render_json(result.verdicts) if args.json else report.render_text(result))
    return 0
