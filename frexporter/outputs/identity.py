"""Where this exporter runs: pod, namespace and node from the downward API, never silently empty.

In Kubernetes (``KUBERNETES_SERVICE_HOST`` set) every identity field the chart passes
(``POD_NAME``, ``POD_NAMESPACE``, ``NODE_NAME``) is exported on ``frexporter_exporter_info``;
one that is missing gets ``frexporter_exporter_identity_missing{label=...} 1``, so a
dashboard or rule can say so instead of showing a blank.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from frexporter import naming as n

FIELDS = ((n.L_POD, "POD_NAME"), (n.L_NAMESPACE, "POD_NAMESPACE"), (n.L_NODE, "NODE_NAME"))


class IdentityCollector(Collector):
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.in_kubernetes = bool(env.get("KUBERNETES_SERVICE_HOST"))
        self.values = {label: env.get(var, "") for label, var in FIELDS}
        self.hostname = socket.gethostname()

    def collect(self) -> Iterator[Metric]:
        if not self.in_kubernetes:
            return
        info = GaugeMetricFamily(n.EXPORTER_INFO, "Where this exporter runs (Kubernetes downward API).",
                                 labels=[n.L_HOSTNAME, *(label for label, _ in FIELDS)])
        info.add_metric([self.hostname, *(self.values[label] for label, _ in FIELDS)], 1)
        yield info
        missing = GaugeMetricFamily(n.EXPORTER_IDENTITY_MISSING,
                                    "1 for each identity label the downward API did not provide.", labels=[n.L_LABEL])
        for label, _ in FIELDS:
            if not self.values[label]:
                missing.add_metric([label], 1)
        yield missing
