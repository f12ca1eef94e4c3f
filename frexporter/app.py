"""Wiring of one exporter process: sources, poll loop, verdicts, HTTP, OTLP. Shared by `serve`, `demo`, tests."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from frexporter import extras, spool
from frexporter.analysis import VerdictConfig, make_analyzer
from frexporter.evidence import EvidenceConfig, EvidenceWriter
from frexporter.exporter import Exporter, Source
from frexporter.server import MetricsServer
from frexporter.sources.ranks import RanksConfig, RanksSource
from frexporter.verdict_events import VerdictEvents
from frexporter.webconfig import WebConfig, check_debug_exposure

if TYPE_CHECKING:
    from frexporter.outputs.otlp import OtlpPusher

log = logging.getLogger("frexporter")

NVML_INTERVAL = 5.0


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
    poll_interval: float = 1.0,
    stuck_after: float = 60.0,
    rank_timeout: float = 2.0,
    nvml: bool = True,
    deep_interval: float = RanksConfig.deep_interval,
    otlp_endpoint: str | None = None,
    otlp_interval: float = 15.0,
    otlp_protocol: str | None = None,
    evidence_dir: str | None = None,
    evidence_stacks: bool = False,
    per_rank_durations: bool = False,
    web_config: WebConfig | None = None,
    debug_endpoints: bool = False,
) -> App:
    """``evidence_dir``: None for ``<spool>/evidence``, "" to capture no evidence. ``per_rank_durations``: label
    collective durations and bytes by rank (one histogram per rank, PG and op) instead of summing the node's.

    ``web_config``: TLS and basic auth for every endpoint. ``debug_endpoints`` adds /api/v1/evidence; it
    raises WebConfigError (a ValueError) on a non-loopback ``host`` unless TLS and authentication are on.
    ``otlp_endpoint`` without the otlp extra installed raises MissingExtraError.
    """
    if debug_endpoints:
        check_debug_exposure(host, web_config)
    if otlp_endpoint:
        extras.require(extras.OTLP, "--otlp-endpoint")
    ranks = RanksSource(
        RanksConfig(
            directory=directory, poll_interval=poll_interval, rank_timeout=rank_timeout, deep_interval=deep_interval,
            per_rank_durations=per_rank_durations,
        )
    )
    sources: list[tuple[Source, float]] = [(ranks, poll_interval)]
    if nvml:
        from frexporter.sources.nvml import NvmlSource

        sources.append((NvmlSource(), max(poll_interval, NVML_INTERVAL)))
    exporter = Exporter(sources, poll_interval=poll_interval,
                        analyzer=make_analyzer(VerdictConfig(stuck_after=stuck_after)))
    evidence = None
    target = ""
    if evidence_dir != "":
        target = evidence_dir or os.path.join(directory, spool.EVIDENCE_DIRNAME)
        evidence = EvidenceWriter(EvidenceConfig(directory=target, stacks=evidence_stacks))
    events = VerdictEvents(directory, evidence)
    exporter.poll_listeners.append(events)
    otlp = None
    if otlp_endpoint:  # before the server binds: a bad endpoint must not leave a listening socket behind
        from frexporter.outputs.otlp import OtlpPusher

        otlp = OtlpPusher(otlp_endpoint, interval=otlp_interval, protocol=otlp_protocol, hostname=exporter.hostname)
        exporter.poll_listeners.append(otlp.observe)
        exporter.extra_sources.append(otlp.status)
    server = MetricsServer(exporter, host, port, web_config=web_config, debug_endpoints=debug_endpoints,
                           evidence_dir=target)
    return App(exporter=exporter, server=server, otlp=otlp, events=events)
