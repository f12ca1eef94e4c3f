"""Wiring of one exporter process: sources, poll loop, HTTP. Shared by `serve`, `demo` and tests."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from frexporter.exporter import Exporter, Source
from frexporter.server import MetricsServer
from frexporter.sources.ranks import RanksConfig, RanksSource

log = logging.getLogger("frexporter")

NVML_INTERVAL = 5.0


@dataclass
class App:
    exporter: Exporter
    server: MetricsServer

    @property
    def port(self) -> int:
        return self.server.port

    def start(self) -> None:
        self.exporter.poll_once()  # serve a real snapshot from the first scrape on
        self.exporter.start()
        self.server.start()

    def stop(self) -> None:
        self.server.stop()
        self.exporter.stop()


def build_app(
    directory: str,
    host: str = "127.0.0.1",
    port: int = 0,
    poll_interval: float = 1.0,
    stuck_after: float = 60.0,
    rank_timeout: float = 2.0,
    nvml: bool = True,
    deep_interval: float = RanksConfig.deep_interval,
) -> App:
    ranks = RanksSource(
        RanksConfig(
            directory=directory, poll_interval=poll_interval, rank_timeout=rank_timeout, deep_interval=deep_interval
        )
    )
    sources: list[tuple[Source, float]] = [(ranks, poll_interval)]
    if nvml:
        from frexporter.sources.nvml import NvmlSource

        sources.append((NvmlSource(), max(poll_interval, NVML_INTERVAL)))
    exporter = Exporter(sources, poll_interval=poll_interval)
    exporter.stuck_after = stuck_after  # type: ignore[attr-defined]
    server = MetricsServer(exporter, host, port)
    return App(exporter=exporter, server=server)
