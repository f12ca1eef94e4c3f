"""Wiring of one exporter process: sources, poll loop, verdicts, HTTP, OTLP. Shared by `serve`, `demo`, tests."""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from frexporter import defaults, extras, spool
from frexporter.analysis import VerdictConfig, make_analyzer
from frexporter.exporter import Exporter
from frexporter.outputs.evidence import EvidenceConfig, EvidenceWriter
from frexporter.outputs.verdict_events import VerdictEvents
from frexporter.sources import DEFAULT_SOURCES, SOURCES
from frexporter.web.server import MetricsServer
from frexporter.web.webconfig import WebConfig, check_debug_exposure

if TYPE_CHECKING:
    from frexporter.outputs.otlp import OtlpPusher

log = logging.getLogger("frexporter")


@dataclass
class App:
    exporter: Exporter
    server: MetricsServer
    otlp: OtlpPusher | None = None
    events: VerdictEvents | None = None

    @property
    def port(self) -> int:
        return self.server.port

    def start(self) -> None:
        self.exporter.poll_once()  # serve a real snapshot from the first scrape on
        if self.otlp is not None:
            self.otlp.start()
        self.exporter.start()
        self.server.start()

    def stop(self) -> None:
        self.server.stop()
        self.exporter.stop()
        if self.otlp is not None:
            self.otlp.shutdown()  # after the poll loop stopped: pushes its last snapshot
        if self.events is not None:
            self.events.close()


@dataclass(frozen=True)
class ServeConfig:
    """One exporter process's settings: what ``frexporter serve``'s flags say, built once from them
    (``cli.serve_config``) and passed whole to ``build_app``. Every default is ``frexporter.defaults``'s, so
    ``ServeConfig(directory=d)`` is ``serve --dir d`` except where it listens: a config built in code (tests, the
    demo, benchmarks) serves on loopback, on a free port, where ``serve`` always passes ``--listen``.

    ``sources``: names from ``frexporter.sources.SOURCES`` to read (kept as a frozenset). ``evidence_dir``: None
    for ``<spool>/evidence``, "" to capture no evidence. ``per_rank_durations``: label collective durations and
    bytes by rank (one histogram per rank, PG and op) instead of summing the node's. ``nvlink_per_link``: NVLink
    error counters per link instead of summed per GPU. ``verdict_confirm_after``: seconds a verdict must persist
    before it is logged and its evidence captured (the verdict is in /metrics and the API at once).
    ``stuck_after`` is the ceiling of each PG's learned stuck threshold (``stuck_floor``, ``stuck_multiple``:
    docs/detection.md). ``evidence_stacks``: py-spy stacks (torch's pyspy_dump) of culprits in evidence bundles
    and of wedged ranks in their activity.

    ``source_timeout``: the longest one source's collection may take, beyond the ``rank_timeout`` the ranks
    source may spend waiting for wedged ranks; past it the source is down (reason ``timeout``), its last reading
    served stale, and it is not called again until that call returns.

    ``web_config``: TLS and basic auth for every endpoint. ``debug_endpoints`` adds /api/v1/evidence.
    ``strict_permissions``: the ranks source stops reading (source down) while the spool is open to others,
    instead of warning. ``max_connections``: open HTTP connections at most; more are closed unserved.
    """

    directory: str
    host: str = "127.0.0.1"
    port: int = 0
    poll_interval: float = defaults.POLL_INTERVAL
    stuck_after: float = defaults.STUCK_AFTER
    stuck_floor: float = defaults.STUCK_FLOOR
    stuck_multiple: float = defaults.STUCK_MULTIPLE
    rank_timeout: float = defaults.RANK_TIMEOUT
    source_timeout: float = defaults.SOURCE_TIMEOUT
    deep_interval: float = defaults.DEEP_INTERVAL
    sources: Collection[str] = DEFAULT_SOURCES
    per_rank_durations: bool = False
    collective_waits: bool = False  # frexporter_rank_collective_wait_seconds: the cross-node straggler signal
    nvlink_per_link: bool = False
    verdict_confirm_after: float = defaults.VERDICT_CONFIRM_AFTER
    evidence_dir: str | None = None
    evidence_stacks: bool = False
    web_config: WebConfig | None = None
    debug_endpoints: bool = False
    strict_permissions: bool = False
    max_connections: int = defaults.WEB_MAX_CONNECTIONS
    otlp_endpoint: str | None = None
    otlp_interval: float = defaults.OTLP_INTERVAL
    otlp_protocol: str | None = None  # None: from the endpoint's scheme

    def __post_init__(self) -> None:
        # A frozenset, so that a config compares equal however its sources were listed (flags give a list).
        sources = frozenset(self.sources)
        object.__setattr__(self, "sources", sources)
        unknown = sources - {s.name for s in SOURCES}
        if unknown:
            raise ValueError(f"unknown sources: {', '.join(sorted(unknown))}")


def build_app(config: ServeConfig) -> App:
    """The exporter ``config`` describes, not started yet (``App.start``).

    ``debug_endpoints`` on a non-loopback ``host`` raises WebConfigError (a ValueError) unless TLS and
    authentication are on; ``otlp_endpoint`` without the otlp extra installed raises MissingExtraError; a port
    that cannot be bound raises OSError.
    """
    if config.debug_endpoints:
        check_debug_exposure(config.host, config.web_config)
    if config.otlp_endpoint:
        extras.require(extras.OTLP, "--otlp-endpoint")
    built = {info.name: info.make(config) for info in SOURCES if info.name in config.sources}
    exporter = Exporter([(b.source, b.interval) for b in built.values()], poll_interval=config.poll_interval,
                        source_timeout=config.source_timeout,
                        timeouts={name: b.deadline for name, b in built.items()},
                        analyzer=make_analyzer(VerdictConfig(stuck_after=config.stuck_after)))
    evidence = None
    target = ""
    if config.evidence_dir != "":
        target = config.evidence_dir or os.path.join(config.directory, spool.EVIDENCE_DIRNAME)
        evidence = EvidenceWriter(EvidenceConfig(directory=target, stacks=config.evidence_stacks))
    events = VerdictEvents(config.directory, evidence, confirm_after=config.verdict_confirm_after)
    exporter.poll_listeners.append(events)
    if evidence is not None:
        exporter.output_statuses.append(events.status)
    otlp = None
    if config.otlp_endpoint:  # before the server binds: a bad endpoint must not leave a listening socket behind
        from frexporter.outputs.otlp import OtlpPusher

        otlp = OtlpPusher(config.otlp_endpoint, interval=config.otlp_interval, protocol=config.otlp_protocol,
                          hostname=exporter.hostname)
        exporter.poll_listeners.append(otlp.observe)
        exporter.output_statuses.append(otlp.status)
    server = MetricsServer(exporter, config.host, config.port, web_config=config.web_config,
                           debug_endpoints=config.debug_endpoints, evidence_dir=target,
                           nvlink_per_link=config.nvlink_per_link, max_connections=config.max_connections)
    return App(exporter=exporter, server=server, otlp=otlp, events=events)
