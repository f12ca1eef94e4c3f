"""The HTTP server's own counters on /metrics (``frexporter_http_connections_rejected_total``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from frexporter import naming as n


class HttpServerCollector(Collector):
    def __init__(self, rejected: Callable[[], int]) -> None:
        self._rejected = rejected

    def collect(self) -> Iterator[Metric]:
        rejected = CounterMetricFamily(n.HTTP_CONNECTIONS_REJECTED_TOTAL,
                                       "Connections closed unserved because --web-max-connections were open.")
        rejected.add_metric([], self._rejected())
        yield rejected
