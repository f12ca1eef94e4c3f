"""OTLP push view of the latest NodeSnapshot (``frexporter serve --otlp-endpoint URL``).

The points are the Prometheus collector's samples under OpenTelemetry names: both outputs carry the same
values from the same snapshot and nothing is computed twice. Attribute keys are the Prometheus label names;
GPU readings that have an OpenTelemetry hardware convention (``hw.gpu.*``, ``hw.power``, ``hw.energy``,
``hw.errors``) use it and add the attributes it requires.

Why the points are built here instead of by a MeterProvider with observable instruments: the Python SDK
(1.45) never forgets an attribute set an asynchronous instrument once reported. Every job, pid and verdict
seq seen on a node adds one for good, and after 2000 per instrument (about 60 jobs of 8 ranks x 4 process
groups) each new series is folded into ``otel.metric.overflow=true``. Building ``MetricsData`` from the
snapshot keeps exactly the live series, holds no state between pushes, and stamps every point with the poll
time its values were read. The official OTLP exporters still do the encoding, transport and retries.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal
from urllib.parse import urlsplit

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client.core import Metric as PromMetric

from frexporter import __version__, defaults, extras, reasons
from frexporter import naming as n
from frexporter.model import NodeSnapshot, SourceStatus
from frexporter.outputs.snapshot_metrics import SnapshotCollector

log = logging.getLogger("frexporter.otlp")

PROTOCOL_HTTP = "http/protobuf"
PROTOCOL_GRPC = "grpc"
SOURCE_OTLP = "otlp"  # `source` label value of frexporter_source_* for this output
REASON_EXPORT_FAILED = reasons.EXPORT_FAILED
REASON_INTERNAL = reasons.INTERNAL

# Downward-API variables the Helm chart sets -> OpenTelemetry k8s resource attributes.
K8S_ENV = (("POD_NAME", "k8s.pod.name"), ("POD_NAMESPACE", "k8s.namespace.name"), ("NODE_NAME", "k8s.node.name"))

Kind = Literal["gauge", "counter", "updown", "histogram"]


@dataclass(frozen=True)
class OtelMetric:
    """How one Prometheus metric is pushed: OpenTelemetry name, UCUM unit, instrument kind, constant attributes."""

    name: str
    unit: str
    kind: Kind
    attributes: tuple[tuple[str, str], ...] = ()
    gpu: bool = False  # hardware convention: add hw.id (the GPU uuid) and hw.type=gpu
    description: str = ""  # empty: the Prometheus help text


def _hw(name: str, unit: str, kind: Kind, description: str, *attributes: tuple[str, str]) -> OtelMetric:
    return OtelMetric(name, unit, kind, attributes, gpu=True, description=description)


# OpenTelemetry hardware semantic conventions (hardware/gpu, status Development), spelled here rather than
# imported from opentelemetry.semconv._incubating so a dependency bump cannot rename what users query.
_SEMCONV: dict[str, OtelMetric] = {
    n.GPU_UTILIZATION_RATIO: _hw("hw.gpu.utilization", "1", "gauge",
                                 "Fraction of the last sample period a kernel was running (NVML utilization.gpu).",
                                 ("hw.gpu.task", "general")),
    n.GPU_MEMORY_USED_BYTES: _hw("hw.gpu.memory.usage", "By", "updown", "GPU memory used."),
    n.GPU_MEMORY_TOTAL_BYTES: _hw("hw.gpu.memory.limit", "By", "updown", "Size of the GPU memory."),
    n.GPU_POWER_WATTS: _hw("hw.power", "W", "gauge", "Board power draw."),
    n.GPU_ENERGY_JOULES_TOTAL: _hw("hw.energy", "J", "counter", "Energy consumed since the driver loaded."),
}
# One error metric per GPU, told apart by error.type; the Prometheus labels (type, xid) stay as they are.
_HW_ERRORS = "Errors the GPU met, by error.type: ecc (type), pcie_replay, nvlink (type), xid (xid)."
_SEMCONV.update({
    prometheus: _hw("hw.errors", "{error}", "counter", _HW_ERRORS, ("error.type", error_type))
    for prometheus, error_type in ((n.GPU_ECC_ERRORS_TOTAL, "ecc"), (n.GPU_PCIE_REPLAY_TOTAL, "pcie_replay"),
                                   (n.GPU_NVLINK_ERRORS_TOTAL, "nvlink"), (n.GPU_XID_ERRORS_TOTAL, "xid"))
})
# Prometheus unit suffix -> UCUM unit. Dimensionless values that count something carry a {annotation}, the
# rest no unit: translators into Prometheus (collector, Prometheus' OTLP receiver) drop annotations and turn
# a gauge in "1" into *_ratio, so every frexporter.* name translates back to its frexporter_* name.
_UNIT_SUFFIXES = (("_seconds", "s"), ("_bytes", "By"), ("_celsius", "Cel"), ("_watts", "W"), ("_joules", "J"),
                  ("_hertz", "Hz"), ("_ratio", "1"))
_ANNOTATIONS: Mapping[str, str] = {
    n.SOURCE_ERRORS_TOTAL: "{error}",
    n.RANK_RECORDER_ERRORS_TOTAL: "{error}",
    n.PG_LAST_ENQUEUED_SEQ: "{collective}",
    n.PG_LAST_STARTED_SEQ: "{collective}",
    n.PG_LAST_COMPLETED_SEQ: "{collective}",
    n.PG_INFLIGHT_COLLECTIVES: "{collective}",
    n.PG_WAIT_SEQ: "{collective}",
    n.PG_IDLE_SEQ: "{collective}",
    n.PG_WAIT_GROUP_SIZE: "{rank}",
    n.GPU_REMAPPED_ROWS: "{row}",
}
_NOT_PUSHED = frozenset({n.BUILD_INFO})  # the resource's service.version says it
_HISTOGRAMS = frozenset({n.COLLECTIVE_DURATION_SECONDS})
_NAMESPACE = n.PREFIX.rstrip("_")


@cache
def otel_metric(prometheus_name: str) -> OtelMetric | None:
    """The OTLP form of a Prometheus metric (sample name, ``_total`` included); None when it is not pushed.

    ``frexporter_pg_last_completed_seq`` -> ``frexporter.pg.last_completed_seq``,
    ``frexporter_rank_heartbeat_timestamp_seconds`` -> ``frexporter.rank.heartbeat_timestamp`` in ``s``.
    """
    if prometheus_name in _NOT_PUSHED or not prometheus_name.startswith(n.PREFIX):
        return None
    if prometheus_name in _SEMCONV:
        return _SEMCONV[prometheus_name]
    base = prometheus_name[len(n.PREFIX):]
    counter = base.endswith("_total")
    base = base.removesuffix("_total")
    unit = _ANNOTATIONS.get(prometheus_name, "")
    for suffix, symbol in _UNIT_SUFFIXES:
        if base.endswith(suffix):
            unit, stem = symbol, base.removesuffix(suffix)
            base = stem if "_" in stem else base  # collective_bytes keeps its noun: frexporter.collective.bytes
            break
    head, _, rest = base.partition("_")
    name = f"{_NAMESPACE}.{head}.{rest}" if rest else f"{_NAMESPACE}.{head}"
    kind: Kind = "histogram" if prometheus_name in _HISTOGRAMS else "counter" if counter else "gauge"
    return OtelMetric(name, unit, kind)


def build_resource(hostname: str | None = None) -> Resource:
    """service.*, host.name and the downward-API k8s attributes; OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME
    override them, since what an operator sets explicitly should beat what we guess."""
    attributes = {"service.name": "frexporter", "service.version": __version__,
                  "host.name": hostname or socket.gethostname()}
    attributes.update({key: os.environ[env] for env, key in K8S_ENV if os.environ.get(env)})
    return Resource.create(attributes).merge(OTELResourceDetector().detect())


@dataclass(frozen=True)
class HistogramValue:
    """One Prometheus histogram series as OTLP wants it: per-bucket (not cumulative) counts, the last one
    above the highest bound."""

    count: int
    sum: float
    bucket_counts: tuple[int, ...]
    bounds: tuple[float, ...]


def _histogram_series(family: PromMetric) -> Iterator[tuple[dict[str, str], HistogramValue]]:
    series: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for sample in family.samples:
        labels = {k: v for k, v in sample.labels.items() if k != "le"}
        row = series.setdefault(tuple(sorted(labels.items())), {"labels": labels, "buckets": [], "sum": 0.0})
        if sample.name == family.name + "_bucket":
            row["buckets"].append((float(sample.labels["le"]), sample.value))
        elif sample.name == family.name + "_sum":
            row["sum"] = float(sample.value)
    for row in series.values():
        cumulative = sorted(row["buckets"])
        bounds = tuple(le for le, _ in cumulative if le != float("inf"))
        counts, previous = [], 0.0
        for _, value in cumulative:
            counts.append(int(value - previous))
            previous = value
        yield row["labels"], HistogramValue(int(previous), row["sum"], tuple(counts), bounds)


def snapshot_metrics(snapshot: NodeSnapshot) -> Iterator[tuple[OtelMetric, str, dict[str, str],
                                                                float | HistogramValue, float | None]]:
    """(metric, description, attributes, value, the sample's own time or None) for every sample (a whole series
    for a histogram) the Prometheus collector renders. Only gloo's arrivals carry a time of their own (their grid
    instant's, sources/arrivals.py): the rules compare the same instant of every node by it."""
    for family in SnapshotCollector(lambda: snapshot).collect():
        if family.type == "histogram":
            spec = otel_metric(family.name)
            if spec is not None:
                for labels, value in _histogram_series(family):
                    yield spec, spec.description or family.documentation, labels, value, None
            continue
        # A counter's *_created sample is not a value.
        wanted = {"gauge": family.name, "counter": family.name + "_total"}.get(family.type)
        for sample in family.samples:
            spec = otel_metric(sample.name) if sample.name == wanted else None
            if spec is None:
                continue
            attributes = {**sample.labels, **dict(spec.attributes)}
            if spec.gpu:
                attributes["hw.id"] = sample.labels.get(n.L_GPU_UUID, "")
                attributes["hw.type"] = "gpu"
            stamp = None if sample.timestamp is None else float(sample.timestamp)
            yield spec, spec.description or family.documentation, attributes, float(sample.value), stamp


def metrics_data(snapshot: NodeSnapshot, resource: Resource, start_time_ns: int) -> MetricsData:
    """One OTLP request for ``snapshot``; cumulative sums count from ``start_time_ns`` (when pushing began)."""
    time_ns = int(snapshot.time * 1e9)
    grouped: dict[str, tuple[OtelMetric, str, list[Any]]] = {}
    for spec, description, attributes, value, stamp in snapshot_metrics(snapshot):
        start = 0 if spec.kind == "gauge" else start_time_ns
        point: NumberDataPoint | HistogramDataPoint
        if isinstance(value, HistogramValue):
            # min and max are unknown (Prometheus buckets do not keep them): None leaves them unset.
            point = HistogramDataPoint(attributes=attributes, start_time_unix_nano=start, time_unix_nano=time_ns,
                                       count=value.count, sum=value.sum, bucket_counts=value.bucket_counts,
                                       explicit_bounds=value.bounds, min=None, max=None)  # type: ignore[arg-type]
        else:
            point = NumberDataPoint(attributes=attributes, start_time_unix_nano=start,
                                    time_unix_nano=time_ns if stamp is None else int(stamp * 1e9), value=value)
        grouped.setdefault(spec.name, (spec, description, []))[2].append(point)
    metrics = []
    for name, (spec, description, points) in grouped.items():
        data: Gauge | Sum | Histogram
        if spec.kind == "gauge":
            data = Gauge(data_points=points)
        elif spec.kind == "histogram":
            data = Histogram(data_points=points, aggregation_temporality=AggregationTemporality.CUMULATIVE)
        else:
            data = Sum(data_points=points, aggregation_temporality=AggregationTemporality.CUMULATIVE,
                       is_monotonic=spec.kind == "counter")
        metrics.append(Metric(name=name, description=description, unit=spec.unit, data=data))
    scope = InstrumentationScope("frexporter", __version__)
    return MetricsData(resource_metrics=[ResourceMetrics(
        resource=resource, scope_metrics=[ScopeMetrics(scope=scope, metrics=metrics, schema_url="")],
        schema_url=resource.schema_url)])


class OtlpConfigError(ValueError):
    """A bad --otlp-endpoint or a missing exporter package; raised at construction, never while pushing."""


@dataclass(frozen=True)
class Target:
    protocol: str  # PROTOCOL_*
    url: str  # HTTP: the full /v1/metrics URL; gRPC: scheme://host:port
    insecure: bool


def parse_endpoint(endpoint: str, protocol: str | None = None) -> Target:
    """``http(s)://HOST:4318[/path]`` -> OTLP/HTTP protobuf (``/v1/metrics`` when no path is given);
    ``grpc://HOST:4317`` (plaintext) or ``grpcs://`` -> OTLP/gRPC. ``protocol`` forces gRPC over an http(s) URL."""
    parts = urlsplit(endpoint.strip())
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https", "grpc", "grpcs") or not parts.hostname:
        raise OtlpConfigError(f"OTLP endpoint {endpoint!r}: use http://HOST:4318 (OTLP/HTTP) or grpc://HOST:4317")
    if protocol not in (None, PROTOCOL_HTTP, PROTOCOL_GRPC):
        raise OtlpConfigError(f"OTLP protocol {protocol!r}: use {PROTOCOL_HTTP} or {PROTOCOL_GRPC}")
    tls = scheme in ("https", "grpcs")
    if scheme.startswith("grpc") and protocol == PROTOCOL_HTTP:
        raise OtlpConfigError(f"OTLP endpoint {endpoint!r} is gRPC but the protocol asked for is {PROTOCOL_HTTP}")
    if protocol == PROTOCOL_GRPC or scheme.startswith("grpc"):
        netloc = parts.netloc if parts.port else f"{parts.netloc}:4317"
        return Target(PROTOCOL_GRPC, f"{'https' if tls else 'http'}://{netloc}", insecure=not tls)
    path = parts.path if parts.path not in ("", "/") else "/v1/metrics"
    return Target(PROTOCOL_HTTP, f"{scheme}://{parts.netloc}{path}", insecure=not tls)


def _make_exporter(target: Target, timeout: float) -> MetricExporter:
    try:  # only the chosen transport's package has to be installed
        if target.protocol == PROTOCOL_GRPC:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcExporter

            return GrpcExporter(endpoint=target.url, insecure=target.insecure, timeout=timeout)
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpExporter

        return HttpExporter(endpoint=target.url, timeout=timeout)
    except ImportError as e:
        package = "grpc" if target.protocol == PROTOCOL_GRPC else "http"
        raise OtlpConfigError(f"OTLP over {target.protocol} needs opentelemetry-exporter-otlp-proto-{package} "
                              f"({e}): {extras.pip_command(extras.OTLP)}") from e


class _SdkLogCapture(logging.Handler):
    """Keeps the OTLP exporters' own warnings (one per retry) out of the daemon's log: a failure streak gets one
    line from us. Remembers this thread's messages so that line can say why (the first names the cause, e.g.
    connection refused; the last the outcome), and passes all on at DEBUG."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self._seen = threading.local()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        seen: list[str] = self._seen.__dict__.setdefault("messages", [])
        if seen:
            seen[1:] = [message]  # first and last only: a thread that never calls take() stays bounded
        else:
            seen.append(message)
        log.debug("otlp exporter: %s", message)

    def take(self) -> str:
        messages: list[str] = self._seen.__dict__.pop("messages", [])
        return " ... ".join(dict.fromkeys((messages[0], messages[-1]))) if messages else ""


_SDK_LOGS = _SdkLogCapture()


def _capture_sdk_logs() -> None:
    sdk = logging.getLogger("opentelemetry.exporter.otlp")
    if _SDK_LOGS not in sdk.handlers:
        sdk.addHandler(_SDK_LOGS)
        sdk.propagate = False


class OtlpPusher:
    """Pushes the latest snapshot every ``interval`` seconds. ``observe`` is an Exporter poll listener.

    Never raises once built: failures are counted by reason (``errors()``, ``status()``) and logged once per
    streak. ``shutdown()`` pushes the last snapshot, bounded by ``timeout``.
    """

    def __init__(self, endpoint: str, interval: float = defaults.OTLP_INTERVAL, protocol: str | None = None,
                 timeout: float | None = None, hostname: str | None = None) -> None:
        if interval <= 0:
            raise OtlpConfigError(f"OTLP interval must be > 0, got {interval}")
        self.endpoint = endpoint
        self.target = parse_endpoint(endpoint, protocol)
        self.interval = interval
        # A push that outlives its interval would only queue the next one behind it.
        self.timeout = timeout if timeout is not None else min(defaults.OTLP_TIMEOUT, interval)
        self.resource = build_resource(hostname)
        _capture_sdk_logs()
        self._exporter = _make_exporter(self.target, self.timeout)
        self._start_ns = time.time_ns()
        self._snapshot: NodeSnapshot | None = None
        self._lock = threading.Lock()  # one push at a time: the loop and force_flush/shutdown
        # Counters have their own lock so status() never waits behind a push that is stuck on the network.
        self._stats_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._errors: dict[str, int] = {}
        self._failing = 0
        self._duration = 0.0
        self._last_error = ""
        self._last_success: float | None = None

    def observe(self, snapshot: NodeSnapshot) -> None:
        self._snapshot = snapshot  # a reference swap: the poll loop never waits on the network

    def start(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name="frexporter-otlp", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.force_flush()

    def force_flush(self) -> bool:
        """Push the latest snapshot now; True when the collector accepted it (or there was nothing to push)."""
        snapshot = self._snapshot
        if snapshot is None:
            return True
        with self._lock:
            if self._closed:
                return False
            started = time.perf_counter()
            reason, detail = REASON_EXPORT_FAILED, ""
            _SDK_LOGS.take()  # forget what an earlier push left
            try:
                data = metrics_data(snapshot, self.resource, self._start_ns)
                ok = self._exporter.export(data, timeout_millis=self.timeout * 1000) is MetricExportResult.SUCCESS
            except Exception as e:  # whatever the SDK or our mapping throws must not reach the poll loop
                ok, reason, detail = False, REASON_INTERNAL, f"{type(e).__name__}: {e}"
                log.debug("OTLP push raised", exc_info=True)
            duration = time.perf_counter() - started
            self._account(ok, duration, reason, detail or _SDK_LOGS.take() or "the exporter reported a failure")
        return ok

    def _account(self, ok: bool, duration: float, reason: str, detail: str) -> None:
        with self._stats_lock:
            self._duration = duration
            streak = self._failing
            if ok:
                self._failing, self._last_success = 0, time.time()
            else:
                self._errors[reason] = self._errors.get(reason, 0) + 1
                self._failing += 1
                self._last_error = detail
        if ok and streak:
            log.info("OTLP push to %s recovered after %d failed pushes", self.endpoint, streak)
        elif not ok and not streak:
            log.warning("OTLP push to %s failed: %s; retrying every %gs, further failures are only counted "
                        "(frexporter_source_errors_total{source=\"%s\"})", self.endpoint, detail, self.interval,
                        SOURCE_OTLP)

    def shutdown(self) -> None:
        """Stop the loop, push the last snapshot, close the transport. Idempotent."""
        if self._closed:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout + 5)
        self.force_flush()
        with self._lock:
            self._closed = True
            try:
                self._exporter.shutdown()
            except Exception:
                log.debug("OTLP exporter shutdown raised", exc_info=True)

    def errors(self) -> dict[str, int]:
        """Failed pushes since start, by reason (REASON_*)."""
        with self._stats_lock:
            return dict(self._errors)

    def status(self) -> SourceStatus:
        """This output as a source row, for frexporter_source_{up,duration_seconds,errors_total}{source="otlp"}."""
        with self._stats_lock:
            return SourceStatus(name=SOURCE_OTLP, up=self._failing == 0, duration_seconds=self._duration,
                                errors_total=dict(self._errors), last_error=self._last_error,
                                last_success=self._last_success)
