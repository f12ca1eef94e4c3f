"""Wiring of one exporter process: sources, poll loop, verdicts, HTTP, OTLP. Shared by `serve`, `demo`, tests."""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from frexporter import defaults, extras, naming, spool
from frexporter.analysis import VerdictConfig, make_analyzer
from frexporter.exporter import Exporter
from frexporter.outputs.evidence import EvidenceConfig, EvidenceWriter
from frexporter.outputs.verdict_events import VerdictEvents
from frexporter.sources import DEFAULT_SOURCES, SOURCES
from frexporter.sources.base import Source
from frexporter.sources.ranks import RanksConfig, RanksSource
from frexporter.sources.thresholds import ThresholdConfig
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


def build_app(
    directory: str,
    host: str = "127.0.0.1",
    port: int = 0,
    poll_interval: float = defaults.POLL_INTERVAL,
    stuck_after: float = defaults.STUCK_AFTER,
    stuck_floor: float = defaults.STUCK_FLOOR,
    stuck_multiple: float = defaults.STUCK_MULTIPLE,
    rank_timeout: float = defaults.RANK_TIMEOUT,
    sources: Collection[str] = DEFAULT_SOURCES,
    deep_interval: float = defaults.DEEP_INTERVAL,
    otlp_endpoint: str | None = None,
    otlp_interval: float = defaults.OTLP_INTERVAL,
    otlp_protocol: str | None = None,
    evidence_dir: str | None = None,
    evidence_stacks: bool = False,
    per_rank_durations: bool = False,
    nvlink_per_link: bool = False,
    verdict_confirm_after: float = 0.0,
    web_config: WebConfig | None = None,
    debug_endpoints: bool = False,
    strict_permissions: bool = False,
    max_connections: int = defaults.WEB_MAX_CONNECTIONS,
) -> App:
    """``sources``: names from ``frexporter.sources.SOURCES`` to read. ``evidence_dir``: None for
    ``<spool>/evidence``, "" to capture no evidence. ``per_rank_durations``: label collective durations and
    bytes by rank (one histogram per rank, PG and op) instead of summing the node's. ``nvlink_per_link``: NVLink
    error counters per link instead of summed per GPU. ``verdict_confirm_after``: seconds a verdict must persist
    before it is logged and its evidence captured (the verdict is in /metrics and the API at once).

    ``web_config``: TLS and basic auth for every endpoint. ``debug_endpoints`` adds /api/v1/evidence; it
    raises WebConfigError (a ValueError) on a non-loopback ``host`` unless TLS and authentication are on.
    ``strict_permissions``: the ranks source stops reading (source down) while the spool is open to others,
    instead of warning.
    ``stuck_after`` is the ceiling of each PG's learned stuck threshold (``stuck_floor``, ``stuck_multiple``:
    docs/detection.md).
    ``max_connections``: open HTTP connections at most; more are closed unserved.
    ``evidence_stacks``: py-spy stacks (torch's pyspy_dump) of culprits in evidence bundles and of wedged ranks
    in their activity.
    ``otlp_endpoint`` without the otlp extra installed raises MissingExtraError.
    """
    if debug_endpoints:
        check_debug_exposure(host, web_config)
    if otlp_endpoint:
        extras.require(extras.OTLP, "--otlp-endpoint")
    ranks = RanksSource(
        RanksConfig(
            directory=directory, poll_interval=poll_interval, rank_timeout=rank_timeout, deep_interval=deep_interval,
            per_rank_durations=per_rank_durations, strict_permissions=strict_permissions,
            wedged_stacks=evidence_stacks,
            thresholds=ThresholdConfig(ceiling=stuck_after, floor=stuck_floor, multiple=stuck_multiple),
        )
    )
    unknown = set(sources) - {s.name for s in SOURCES}
    if unknown:
        raise ValueError(f"unknown sources: {', '.join(sorted(unknown))}")
    polled: list[tuple[Source, float]] = []
    if naming.SOURCE_RANKS in sources:
        polled.append((ranks, poll_interval))
    if naming.SOURCE_NVML in sources:
        from frexporter.sources.nvml import NvmlSource

        polled.append((NvmlSource(), max(poll_interval, defaults.NVML_INTERVAL)))
    exporter = Exporter(polled, poll_interval=poll_interval,
                        analyzer=make_analyzer(VerdictConfig(stuck_after=stuck_after)))
    evidence = None
    target = ""
    if evidence_dir != "":
        target = evidence_dir or os.path.join(directory, spool.EVIDENCE_DIRNAME)
        evidence = EvidenceWriter(EvidenceConfig(directory=target, stacks=evidence_stacks))
    events = VerdictEvents(directory, evidence, confirm_after=verdict_confirm_after)
    exporter.poll_listeners.append(events)
    if evidence is not None:
        exporter.output_statuses.append(events.status)
    otlp = None
    if otlp_endpoint:  # before the server binds: a bad endpoint must not leave a listening socket behind
        from frexporter.outputs.otlp import OtlpPusher

        otlp = OtlpPusher(otlp_endpoint, interval=otlp_interval, protocol=otlp_protocol, hostname=exporter.hostname)
        exporter.poll_listeners.append(otlp.observe)
        exporter.output_statuses.append(otlp.status)
    server = MetricsServer(exporter, host, port, web_config=web_config, debug_endpoints=debug_endpoints,
                           evidence_dir=target, nvlink_per_link=nvlink_per_link, max_connections=max_connections)
    return App(exporter=exporter, server=server, otlp=otlp, events=events)
