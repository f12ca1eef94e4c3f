"""OTLP push: real OTLP/HTTP and OTLP/gRPC requests into a real receiver (tests/otlp_receiver.py), decoded with
the official opentelemetry-proto messages, compared value by value with the Prometheus view of the same snapshot.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_otlp.py."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from frexporter import __version__
from frexporter import naming as n
from tests.fakes.snapshot import rich_snapshot
from tests.harness import free_port, require_module

require_module("opentelemetry.exporter.otlp.proto.http", "opentelemetry-exporter-otlp-proto-http (the otlp extra)")
require_module("opentelemetry.exporter.otlp.proto.grpc", "opentelemetry-exporter-otlp-proto-grpc (the otlp extra)")

from frexporter.outputs import otlp  # noqa: E402 (after the skip: the exporters are optional)
from frexporter.outputs.otlp import OtlpConfigError, OtlpPusher, otel_metric, parse_endpoint  # noqa: E402

# ---------------------------------------------------------------- names


EXPECTED_NAMES = {
    n.SOURCE_UP: ("frexporter.source.up", "", "gauge"),
    n.SOURCE_DURATION_SECONDS: ("frexporter.source.duration", "s", "gauge"),
    n.SOURCE_ERRORS_TOTAL: ("frexporter.source.errors", "{error}", "counter"),
    n.SOURCE_LAST_SUCCESS_TIMESTAMP_SECONDS: ("frexporter.source.last_success_timestamp", "s", "gauge"),
    n.POLL_TIMESTAMP_SECONDS: ("frexporter.poll.timestamp", "s", "gauge"),
    n.RANK_INFO: ("frexporter.rank.info", "", "gauge"),
    n.RANK_UP: ("frexporter.rank.up", "", "gauge"),
    n.JOB_WORLD_SIZE: ("frexporter.job.world_size", "", "gauge"),
    n.RANK_HEARTBEAT_TIMESTAMP_SECONDS: ("frexporter.rank.heartbeat_timestamp", "s", "gauge"),
    n.RANK_RECORDER_ERRORS_TOTAL: ("frexporter.rank.recorder_errors", "{error}", "counter"),
    n.PG_INFO: ("frexporter.pg.info", "", "gauge"),
    n.PG_LAST_ENQUEUED_SEQ: ("frexporter.pg.last_enqueued_seq", "{collective}", "gauge"),
    n.PG_LAST_STARTED_SEQ: ("frexporter.pg.last_started_seq", "{collective}", "gauge"),
    n.PG_LAST_COMPLETED_SEQ: ("frexporter.pg.last_completed_seq", "{collective}", "gauge"),
    n.PG_INFLIGHT_COLLECTIVES: ("frexporter.pg.inflight_collectives", "{collective}", "gauge"),
    n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS: ("frexporter.pg.oldest_inflight_start_timestamp", "s", "gauge"),
    n.PG_TIMEOUT_SECONDS: ("frexporter.pg.timeout", "s", "gauge"),
    n.PG_STUCK_THRESHOLD_SECONDS: ("frexporter.pg.stuck_threshold", "s", "gauge"),
    n.PG_STUCK_CEILING_SECONDS: ("frexporter.pg.stuck_ceiling", "s", "gauge"),
    n.PG_WAIT_START_TIMESTAMP_SECONDS: ("frexporter.pg.wait_start_timestamp", "s", "gauge"),
    n.PG_WAIT_SEQ: ("frexporter.pg.wait_seq", "{collective}", "gauge"),
    n.PG_IDLE_SEQ: ("frexporter.pg.idle_seq", "{collective}", "gauge"),
    n.PG_WAIT_LIMIT_SECONDS: ("frexporter.pg.wait_limit", "s", "gauge"),
    n.PG_WAIT_GROUP_SIZE: ("frexporter.pg.wait_group_size", "{rank}", "gauge"),
    n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS: ("frexporter.rank.activity_since_timestamp", "s", "gauge"),
    n.PG_LAST_PROGRESS_TIMESTAMP_SECONDS: ("frexporter.pg.last_progress_timestamp", "s", "gauge"),
    n.COLLECTIVE_BYTES_TOTAL: ("frexporter.collective.bytes", "By", "counter"),
    n.COLLECTIVE_DURATION_SECONDS: ("frexporter.collective.duration", "s", "histogram"),
    n.RANK_STRAGGLER_LATENESS_SECONDS: ("frexporter.rank.straggler_lateness", "s", "gauge"),
    n.RANK_STRAGGLER_SCORE_DEPRECATED: ("frexporter.rank.straggler_score", "", "gauge"),
    n.RANK_COLLECTIVE_WAIT_SECONDS: ("frexporter.rank.collective_wait", "s", "gauge"),
    n.RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS: ("frexporter.rank.collective_arrival_timestamp", "s", "gauge"),
    n.VERDICT: ("frexporter.verdict", "", "gauge"),
    n.GPU_INFO: ("frexporter.gpu.info", "", "gauge"),
    n.GPU_LOST: ("frexporter.gpu.lost", "", "gauge"),
    n.GPU_UTILIZATION_RATIO: ("hw.gpu.utilization", "1", "gauge"),
    n.GPU_MEMORY_USED_BYTES: ("hw.gpu.memory.usage", "By", "updown"),
    n.GPU_MEMORY_TOTAL_BYTES: ("hw.gpu.memory.limit", "By", "updown"),
    n.GPU_TEMPERATURE_CELSIUS: ("frexporter.gpu.temperature", "Cel", "gauge"),
    n.GPU_POWER_WATTS: ("hw.power", "W", "gauge"),
    n.GPU_ENERGY_JOULES_TOTAL: ("hw.energy", "J", "counter"),
    n.GPU_SM_CLOCK_HERTZ: ("frexporter.gpu.sm_clock", "Hz", "gauge"),
    n.GPU_MEMORY_CLOCK_HERTZ: ("frexporter.gpu.memory_clock", "Hz", "gauge"),
    n.GPU_THROTTLE_REASONS: ("frexporter.gpu.throttle_reasons", "", "gauge"),
    n.GPU_ECC_ERRORS_TOTAL: ("hw.errors", "{error}", "counter"),
    n.GPU_REMAPPED_ROWS: ("frexporter.gpu.remapped_rows", "{row}", "gauge"),
    n.GPU_REMAPPED_ROWS_PENDING: ("frexporter.gpu.remapped_rows_pending", "", "gauge"),
    n.GPU_REMAPPED_ROWS_FAILED: ("frexporter.gpu.remapped_rows_failed", "", "gauge"),
    n.GPU_PCIE_REPLAY_TOTAL: ("hw.errors", "{error}", "counter"),
    n.GPU_NVLINK_ERRORS_TOTAL: ("hw.errors", "{error}", "counter"),
    n.GPU_XID_ERRORS_TOTAL: ("hw.errors", "{error}", "counter"),
    n.GPU_RECOVERY_ACTION: ("frexporter.gpu.recovery_action", "", "gauge"),
}


def test_every_metric_name_has_its_documented_otlp_name() -> None:
    # build_info travels as the resource's service.version.
    # The exporter's own Kubernetes identity is a /metrics-only view; OTLP carries it as resource attributes.
    # The HTTP server's own counters describe /metrics itself.
    not_pushed = {n.BUILD_INFO, n.EXPORTER_INFO, n.EXPORTER_IDENTITY_MISSING, n.HTTP_CONNECTIONS_REJECTED_TOTAL}
    names = {v for k, v in vars(n).items() if isinstance(v, str) and v.startswith(n.PREFIX) and k != "PREFIX"}
    assert names - not_pushed == set(EXPECTED_NAMES), "a metric was added to naming.py: document its OTLP name"
    for prometheus_name, (name, unit, kind) in EXPECTED_NAMES.items():
        spec = otel_metric(prometheus_name)
        assert spec is not None and (spec.name, spec.unit, spec.kind) == (name, unit, kind), prometheus_name
    assert otel_metric(n.BUILD_INFO) is None


def test_semantic_convention_names_match_the_opentelemetry_registry() -> None:
    hw = require_module("opentelemetry.semconv._incubating.metrics.hw_metrics", "opentelemetry-semantic-conventions")
    assert {hw.HW_GPU_UTILIZATION, hw.HW_GPU_MEMORY_USAGE, hw.HW_GPU_MEMORY_LIMIT, hw.HW_POWER, hw.HW_ENERGY,
            hw.HW_ERRORS} == {name for name, _, _ in EXPECTED_NAMES.values() if name.startswith("hw.")}


# Unit words Prometheus' OTLP translation appends (prometheus/otlptranslator); annotations like {error} are dropped.
_PROMETHEUS_UNIT_WORDS = {"s": "seconds", "By": "bytes", "Cel": "celsius", "W": "watts", "J": "joules", "Hz": "hertz"}


def test_frexporter_names_translate_back_to_the_prometheus_names() -> None:
    """Behind a collector's prometheus exporter or Prometheus' OTLP receiver (suffixes on), the shipped alert
    rules and dashboards still find their series."""
    for prometheus_name, (name, unit, kind) in EXPECTED_NAMES.items():
        if not name.startswith("frexporter."):
            continue
        translated = name.replace(".", "_")
        word = "ratio" if unit == "1" and kind == "gauge" else _PROMETHEUS_UNIT_WORDS.get(unit, "")
        if word and not translated.endswith("_" + word):
            translated += "_" + word
        if kind == "counter":
            translated += "_total"
        assert translated == prometheus_name


@pytest.mark.parametrize(("endpoint", "protocol", "expected"), [
    ("http://collector:4318", None, ("http/protobuf", "http://collector:4318/v1/metrics", True)),
    ("http://collector:4318/", None, ("http/protobuf", "http://collector:4318/v1/metrics", True)),
    ("https://otlp.example.com/otlp/v1/metrics", None,
     ("http/protobuf", "https://otlp.example.com/otlp/v1/metrics", False)),
    ("grpc://collector:4317", None, ("grpc", "http://collector:4317", True)),
    ("grpc://collector", None, ("grpc", "http://collector:4317", True)),
    ("grpcs://collector:4317", None, ("grpc", "https://collector:4317", False)),
    ("http://collector:4317", "grpc", ("grpc", "http://collector:4317", True)),
    ("https://collector:4317", "grpc", ("grpc", "https://collector:4317", False)),
])
def test_endpoint_selects_transport(endpoint: str, protocol: str | None, expected: tuple[str, str, bool]) -> None:
    target = parse_endpoint(endpoint, protocol)
    assert (target.protocol, target.url, target.insecure) == expected


@pytest.mark.parametrize(("endpoint", "protocol"), [
    ("collector:4317", None), ("ftp://collector", None), ("http://", None), ("grpc://collector:4317", "http/protobuf"),
    ("http://collector:4318", "thrift"),
])
def test_bad_endpoint_is_a_config_error(endpoint: str, protocol: str | None) -> None:
    with pytest.raises(OtlpConfigError):
        OtlpPusher(endpoint, protocol=protocol)


def test_resource_attributes_honour_otel_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "from-downward-api")
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    monkeypatch.delenv("NODE_NAME", raising=False)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "k8s.pod.name=set-by-operator,deployment.environment.name=prod")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "frexporter-gpu-pool")
    attrs = dict(otlp.build_resource("node-b").attributes)
    assert attrs["k8s.pod.name"] == "set-by-operator"
    assert attrs["deployment.environment.name"] == "prod"
    assert attrs["service.name"] == "frexporter-gpu-pool"
    assert attrs["service.version"] == __version__
    assert attrs["host.name"] == "node-b"
    assert "k8s.namespace.name" not in attrs and "k8s.node.name" not in attrs


# ---------------------------------------------------------------- failures


def closed_port() -> int:
    return free_port()  # bound and released: nothing listens there


@contextmanager
def root_records(level: int) -> Iterator[list[logging.LogRecord]]:
    """What reaches the root logger's handlers, i.e. the daemon's log (caplog also listens on loggers that do not
    propagate, which is the point here)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level)
    handler.emit = records.append  # type: ignore[method-assign]
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(level)
    try:
        yield records
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_unreachable_endpoint_is_counted_and_logged_once(protocol: str, pushers: list[OtlpPusher]) -> None:
    port = closed_port()
    endpoint = f"http://127.0.0.1:{port}" if protocol == "http" else f"grpc://127.0.0.1:{port}"
    pusher = OtlpPusher(endpoint, interval=60, timeout=0.5)
    pushers.append(pusher)
    pusher.observe(rich_snapshot())
    with root_records(logging.INFO) as records:
        assert pusher.force_flush() is False
        assert pusher.force_flush() is False
    assert pusher.errors() == {otlp.REASON_EXPORT_FAILED: 2}
    status = pusher.status()
    assert (status.name, status.up, status.last_success) == ("otlp", False, None)
    assert status.errors_total == {otlp.REASON_EXPORT_FAILED: 2}
    warnings = [r for r in records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].name == "frexporter.otlp", [r.getMessage() for r in warnings]
    assert str(port) in warnings[0].getMessage()


class _Flaky(BaseHTTPRequestHandler):
    """Refuses the first ``failures`` requests with 400 (not retried by the SDK), then accepts."""

    failures = 2
    seen = 0
    lock = threading.Lock()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.lock:
            type(self).seen += 1
            refuse = self.seen <= self.failures
        self.send_response(400 if refuse else 200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_failure_streak_logs_once_and_recovery_is_reported(pushers: list[OtlpPusher]) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        pusher = OtlpPusher(f"http://127.0.0.1:{server.server_address[1]}", timeout=2)
        pushers.append(pusher)
        pusher.observe(rich_snapshot())
        with root_records(logging.INFO) as records:
            results = [pusher.force_flush() for _ in range(3)]
        assert results == [False, False, True]
        assert pusher.errors() == {otlp.REASON_EXPORT_FAILED: 2}
        assert pusher.status().up and pusher.status().last_success is not None
        ours = [(r.levelname, r.getMessage()) for r in records if r.levelno >= logging.INFO]
        assert [level for level, _ in ours] == ["WARNING", "INFO"], ours
        assert "400" in ours[0][1], "the warning carries the collector's answer"
        assert "recovered after 2" in ours[1][1]
        pusher.shutdown()  # its last push while the server still answers
    finally:
        server.shutdown()
        server.server_close()


def test_internal_error_never_reaches_the_caller(pushers: list[OtlpPusher]) -> None:
    pusher = OtlpPusher(f"http://127.0.0.1:{closed_port()}")
    pushers.append(pusher)
    pusher.observe(replace(rich_snapshot(), verdicts=(object(),)))  # not a Verdict: the collector raises
    assert pusher.force_flush() is False
    assert pusher.errors() == {otlp.REASON_INTERNAL: 1}
    assert "AttributeError" in pusher.status().last_error


def test_a_sample_with_its_own_time_keeps_it_over_otlp() -> None:
    # Gloo's arrivals are stamped with their grid instant's time (sources/arrivals.py); every other point carries
    # the poll's. A receiver that writes to Prometheus then holds the same instant of every node, as a scrape does.
    from opentelemetry.sdk.resources import Resource

    from tests.fakes.snapshot import fixed_snapshot

    snap = fixed_snapshot()
    data = otlp.metrics_data(snap, Resource.create({}), start_time_ns=0)
    points = {m.name: m.data.data_points for rm in data.resource_metrics for sm in rm.scope_metrics
              for m in sm.metrics}
    (arrival,) = points["frexporter.rank.collective_arrival_timestamp"]
    assert arrival.time_unix_nano == 1_700_000_181 * 10**9  # the stamp the fixture gives it
    assert {p.time_unix_nano for p in points["frexporter.rank.up"]} == {int(snap.time * 1e9)}
