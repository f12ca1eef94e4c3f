"""OTLP push: real OTLP/HTTP and OTLP/gRPC requests into a real receiver (tests/otlp_receiver.py), decoded with
the official opentelemetry-proto messages, compared value by value with the Prometheus view of the same snapshot."""

from __future__ import annotations

import importlib.util
import json
import logging
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from frexporter import __version__
from frexporter import naming as n
from frexporter.analysis.verdicts import Verdict
from frexporter.exporter import Exporter
from frexporter.model import NodeSnapshot, RemappedRows
from frexporter.outputs.snapshot_metrics import SnapshotCollector
from frexporter.sources.base import Reading
from tests.harness import REPO, free_port, missing, require_module, wait_for
from tests.test_golden_metrics import fixed_snapshot

require_module("opentelemetry.exporter.otlp.proto.http", "opentelemetry-exporter-otlp-proto-http (the otlp extra)")
require_module("opentelemetry.exporter.otlp.proto.grpc", "opentelemetry-exporter-otlp-proto-grpc (the otlp extra)")

from frexporter.outputs import otlp  # noqa: E402 (after the skip: the exporters are optional)
from frexporter.outputs.otlp import OtlpConfigError, OtlpPusher, otel_metric, parse_endpoint  # noqa: E402

GPU_EXTRA_KEYS = {"hw.id", "hw.type"}


# ---------------------------------------------------------------- fixtures


def rich_snapshot() -> NodeSnapshot:
    """The golden snapshot plus a verdict and every GPU reading, so every metric family has samples."""
    snap = fixed_snapshot()
    gpu = replace(snap.gpus.gpus[0], sm_clock_hertz=1.98e9, memory_clock_hertz=2.619e9, throttle_reasons=0x04,
                  remapped_rows=RemappedRows(correctable=1, uncorrectable=0, pending=False, failure=False),
                  pcie_replays=5, nvlink_errors={(0, "replay"): 2, (1, "crc_flit"): 1})
    verdict = Verdict(kind="missing_rank", job_id="llm", pg="0", pg_desc="default_pg", ranks=(1,), waiting_ranks=(0,),
                      seq=8, op="all_reduce", since=1700000100.5, age_seconds=99.5, timeout_seconds=1800.0,
                      budget_used=99.5 / 1800.0, summary="rank 1 never joined all_reduce #8")
    return replace(snap, gpus=replace(snap.gpus, gpus=(gpu,)), verdicts=(verdict,))


class Receiver:
    def __init__(self, proc: subprocess.Popen[str], out: Path, http: int, grpc: int) -> None:
        self.proc, self.out, self.http, self.grpc = proc, out, http, grpc

    def endpoint(self, protocol: str) -> str:
        return f"http://127.0.0.1:{self.http}" if protocol == "http" else f"grpc://127.0.0.1:{self.grpc}"

    def rows(self) -> list[dict[str, Any]]:
        if not self.out.exists():
            return []
        return [json.loads(line) for line in self.out.read_text().splitlines() if line.strip()]

    def mark(self) -> int:
        return max((row["request"] for row in self.rows()), default=0)

    def request_after(self, mark: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Rows of the first request that arrived after ``mark``."""
        def first() -> list[dict[str, Any]]:
            later = [row for row in self.rows() if row["request"] > mark]
            number = min((row["request"] for row in later), default=None)
            return [row for row in later if row["request"] == number]

        return wait_for(first, timeout=timeout, what="an OTLP request at the receiver")


@pytest.fixture(scope="module")
def receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Receiver]:
    out = tmp_path_factory.mktemp("otlp") / "rows.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "tests.otlp_receiver", str(out)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "the OTLP receiver did not report its ports within 30 s"
        ports = json.loads(proc.stdout.readline())
        yield Receiver(proc, out, ports["http"], ports["grpc"])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def pushers() -> Iterator[list[OtlpPusher]]:
    made: list[OtlpPusher] = []
    yield made
    for pusher in made:
        pusher.shutdown()


def push(receiver: Receiver, pushers: list[OtlpPusher], protocol: str, snapshot: NodeSnapshot,
         **kw: Any) -> list[dict[str, Any]]:
    pusher = OtlpPusher(receiver.endpoint(protocol), **kw)
    pushers.append(pusher)
    pusher.observe(snapshot)
    mark = receiver.mark()
    assert pusher.force_flush(), pusher.status()
    return receiver.request_after(mark)


def one(rows: list[dict[str, Any]], metric: str, **attrs: str) -> dict[str, Any]:
    found = [r for r in rows if r["metric"] == metric and all(r["attrs"].get(k) == v for k, v in attrs.items())]
    assert len(found) == 1, f"{metric}{attrs}: {len(found)} rows"
    return found[0]


# ---------------------------------------------------------------- names


EXPECTED_NAMES = {
    n.SOURCE_UP: ("frexporter.source.up", "", "gauge"),
    n.SOURCE_DURATION_SECONDS: ("frexporter.source.duration", "s", "gauge"),
    n.SOURCE_ERRORS_TOTAL: ("frexporter.source.errors", "{error}", "counter"),
    n.SOURCE_LAST_SUCCESS_TIMESTAMP_SECONDS: ("frexporter.source.last_success_timestamp", "s", "gauge"),
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
    n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS: ("frexporter.rank.activity_since_timestamp", "s", "gauge"),
    n.PG_LAST_PROGRESS_TIMESTAMP_SECONDS: ("frexporter.pg.last_progress_timestamp", "s", "gauge"),
    n.COLLECTIVE_BYTES_TOTAL: ("frexporter.collective.bytes", "By", "counter"),
    n.COLLECTIVE_DURATION_SECONDS: ("frexporter.collective.duration", "s", "histogram"),
    n.RANK_STRAGGLER_LATENESS_SECONDS: ("frexporter.rank.straggler_lateness", "s", "gauge"),
    n.RANK_STRAGGLER_SCORE_DEPRECATED: ("frexporter.rank.straggler_score", "", "gauge"),
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


# ---------------------------------------------------------------- over the wire


@pytest.mark.e2e
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_push_carries_snapshot_values(receiver: Receiver, pushers: list[OtlpPusher], protocol: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "frexporter-abcde")
    monkeypatch.setenv("POD_NAMESPACE", "monitoring")
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")
    rows = push(receiver, pushers, protocol, rich_snapshot(), hostname="node-a")
    assert {r["transport"] for r in rows} == {protocol}

    done = one(rows, "frexporter.pg.last_completed_seq", job_id="llm", rank="0", pg="0", pg_desc="default_pg")
    assert (done["value"], done["type"], done["unit"]) == (7, "gauge", "{collective}")
    assert done["description"] == "Last collective completed (collective domain)."  # the Prometheus help text
    assert done["time_unix_nano"] == 1700000200 * 10**9  # when the values were read, not when they were sent
    assert one(rows, "frexporter.pg.last_enqueued_seq", rank="0", pg="0")["value"] == 8
    oldest = one(rows, "frexporter.pg.oldest_inflight_start_timestamp", rank="0", pg="0")
    assert (oldest["value"], oldest["unit"]) == (1700000100.5, "s")
    assert not [r for r in rows if r["metric"] == "frexporter.pg.oldest_inflight_start_timestamp"
                and r["attrs"]["rank"] == "1"], "nothing in flight on rank 1: no series"
    assert one(rows, "frexporter.rank.up", rank="1")["value"] == 1
    assert one(rows, "frexporter.rank.heartbeat_timestamp", rank="1")["value"] == 1700000150.0

    verdict = one(rows, "frexporter.verdict")
    assert verdict["attrs"] == {"job_id": "llm", "pg": "0", "pg_desc": "default_pg", "rank": "1",
                                "kind": "missing_rank", "op": "all_reduce", "seq": "8", "culprit_state": "unknown",
                                "culprit_function": ""}
    assert verdict["value"] == 1

    util = one(rows, "hw.gpu.utilization")
    assert (util["value"], util["unit"], util["type"]) == (0.97, "1", "gauge")
    assert util["attrs"] == {"gpu": "0", "gpu_uuid": "GPU-aaaa", "hw.id": "GPU-aaaa", "hw.type": "gpu",
                             "hw.gpu.task": "general"}
    used = one(rows, "hw.gpu.memory.usage")
    assert (used["value"], used["unit"], used["type"], used["is_monotonic"]) == (1 << 30, "By", "sum", False)
    energy = one(rows, "hw.energy")
    assert (energy["value"], energy["unit"], energy["is_monotonic"], energy["temporality"]) == (
        1.5e6, "J", True, "cumulative")
    assert energy["start_time_unix_nano"] > 0
    assert one(rows, "hw.errors", **{"error.type": "xid", "xid": "79"})["value"] == 1
    assert one(rows, "hw.errors", **{"error.type": "ecc", "type": "corrected"})["value"] == 3
    assert one(rows, "frexporter.gpu.temperature")["unit"] == "Cel"
    errors = one(rows, "frexporter.source.errors", source="ranks", reason="corrupt")
    assert (errors["value"], errors["type"], errors["is_monotonic"]) == (1, "sum", True)

    resource = rows[0]["resource"]
    assert {r["scope"] for r in rows} == {"frexporter"}
    assert resource["service.name"] == "frexporter"
    assert resource["service.version"] == __version__
    assert resource["host.name"] == "node-a"
    assert resource["k8s.pod.name"] == "frexporter-abcde"
    assert resource["k8s.namespace.name"] == "monitoring"
    assert resource["k8s.node.name"] == "gpu-node-7"
    assert all(r["resource"] == resource for r in rows)


def prometheus_samples(snapshot: NodeSnapshot) -> Iterator[tuple[str, dict[str, str], float]]:
    for family in SnapshotCollector(lambda: snapshot).collect():
        if family.type == "histogram":
            continue  # compared series by series in prometheus_histograms
        for sample in family.samples:
            yield sample.name, sample.labels, sample.value


def prometheus_histograms(snapshot: NodeSnapshot) -> dict[tuple[str, frozenset[tuple[str, Any]]], tuple[Any, ...]]:
    """(OTLP name, attributes) -> (sum, count, per-bucket counts, bounds) of every Prometheus histogram series."""
    out: dict[tuple[str, frozenset[tuple[str, Any]]], dict[str, Any]] = {}
    for family in SnapshotCollector(lambda: snapshot).collect():
        if family.type != "histogram":
            continue
        spec = otel_metric(family.name)
        assert spec is not None and spec.kind == "histogram"
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "le"}
            row = out.setdefault((spec.name, frozenset(labels.items())), {"buckets": []})
            if sample.name.endswith("_bucket"):
                row["buckets"].append((float(sample.labels["le"]), sample.value))
            else:
                row[sample.name.rsplit("_", 1)[1]] = sample.value
    result = {}
    for key, row in out.items():
        cumulative = [count for _, count in sorted(row["buckets"])]
        per_bucket = [b - a for a, b in zip([0.0, *cumulative], cumulative, strict=False)]
        bounds = [le for le, _ in sorted(row["buckets"]) if le != float("inf")]
        result[key] = (row["sum"], row["count"], per_bucket, bounds)
    return result


@pytest.mark.e2e
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_prometheus_and_otlp_agree_on_every_value(receiver: Receiver, pushers: list[OtlpPusher],
                                                  protocol: str) -> None:
    snapshot = rich_snapshot()
    rows = push(receiver, pushers, protocol, snapshot)
    got: dict[tuple[str, frozenset[tuple[str, Any]]], float] = {}
    histograms = {(r["metric"], frozenset(r["attrs"].items())): (r["value"], r["count"], r["bucket_counts"],
                                                                 r["explicit_bounds"])
                  for r in rows if r["type"] == "histogram"}
    assert histograms and histograms == prometheus_histograms(snapshot)
    for row in rows:
        if row["type"] == "histogram":
            continue
        attrs = {k: v for k, v in row["attrs"].items() if k not in GPU_EXTRA_KEYS}
        if row["metric"].startswith("hw."):
            assert row["attrs"]["hw.id"] == row["attrs"]["gpu_uuid"] and row["attrs"]["hw.type"] == "gpu"
        key = (row["metric"], frozenset(attrs.items()))
        assert key not in got, f"duplicate series {key}"
        got[key] = row["value"]
    expected: dict[tuple[str, frozenset[tuple[str, Any]]], float] = {}
    for name, labels, value in prometheus_samples(snapshot):
        spec = otel_metric(name)
        if spec is None:
            assert name == n.BUILD_INFO
            continue
        expected[(spec.name, frozenset({**labels, **dict(spec.attributes)}.items()))] = value
    assert len(expected) > 60  # every family of the rich snapshot, not a vacuous comparison
    assert got == expected


@pytest.mark.e2e
def test_series_that_ended_are_not_pushed_again(receiver: Receiver, pushers: list[OtlpPusher]) -> None:
    """A resolved verdict or a finished job leaves OTLP with its last poll, as it leaves /metrics."""
    pusher = OtlpPusher(receiver.endpoint("http"))
    pushers.append(pusher)
    first = rich_snapshot()
    later = replace(fixed_snapshot(), time=first.time + 15,
                    ranks=tuple(replace(r, job_id="next-job") for r in first.ranks),
                    collectives=tuple(replace(c, job_id="next-job") for c in first.collectives))
    for snapshot in (first, later):
        pusher.observe(snapshot)
        mark = receiver.mark()
        assert pusher.force_flush()
        rows = receiver.request_after(mark)
    assert not [r for r in rows if r["metric"] == "frexporter.verdict"]
    assert {r["attrs"]["job_id"] for r in rows if "job_id" in r["attrs"]} == {"next-job"}
    assert not [r for r in rows if "otel.metric.overflow" in r["attrs"]]


@pytest.mark.e2e
def test_exporter_poll_listener_and_background_loop(receiver: Receiver, pushers: list[OtlpPusher]) -> None:
    """Wired like app.py: the poll loop hands each snapshot over; the pusher's own thread sends it; shutdown
    sends the last one."""
    ranks = list(fixed_snapshot().ranks)

    class Ranks:
        name = n.SOURCE_RANKS

        def collect(self) -> Reading:
            return Reading(ranks=tuple(ranks))

        def close(self) -> None:
            pass

    exporter = Exporter([(Ranks(), 0.05)], poll_interval=0.05)
    pusher = OtlpPusher(receiver.endpoint("grpc"), interval=0.2)
    pushers.append(pusher)
    exporter.poll_listeners.append(pusher.observe)
    mark = receiver.mark()
    exporter.poll_once()
    pusher.start()
    rows = receiver.request_after(mark)
    assert one(rows, "frexporter.pg.last_completed_seq", rank="1", pg="0")["value"] == 7
    assert one(rows, "frexporter.source.up", source="ranks")["value"] == 1

    ranks[1] = replace(ranks[1], pgs=(replace(ranks[1].pgs[0], last_completed=9, last_enqueued=9), ranks[1].pgs[1]))
    exporter.poll_once()
    pusher.shutdown()
    last = max(r["request"] for r in receiver.rows())
    final = [r for r in receiver.rows() if r["request"] == last]
    assert one(final, "frexporter.pg.last_completed_seq", rank="1", pg="0")["value"] == 9
    assert pusher.errors() == {}
    assert not pusher.force_flush(), "a pusher that was shut down does not push"


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


# ---------------------------------------------------------------- through a real collector


@pytest.mark.e2e
def test_through_the_rotel_collector(receiver: Receiver, pushers: list[OtlpPusher], tmp_path: Path) -> None:
    """OTLP/gRPC into rotel (a real collector from PyPI), forwarded over OTLP/HTTP to the receiver."""
    spec = importlib.util.find_spec("rotel")
    agent = Path(spec.origin).parent / "rotel-agent" if spec and spec.origin else None
    if agent is None or not agent.exists():
        missing("rotel (the test extra) is not installed")
    grpc_port, http_port = free_port(), free_port()
    log_path = tmp_path / "rotel.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [str(agent), "start", "--otlp-grpc-endpoint", f"127.0.0.1:{grpc_port}",
             "--otlp-http-endpoint", f"127.0.0.1:{http_port}", "--exporter", "otlp",
             "--otlp-exporter-endpoint", f"http://127.0.0.1:{receiver.http}", "--otlp-exporter-protocol", "http",
             "--batch-timeout", "100ms", "--pid-file", str(tmp_path / "rotel.pid")],
            stdout=log_file, stderr=subprocess.STDOUT)
    try:
        def listening() -> bool:
            assert proc.poll() is None, log_path.read_text()
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", grpc_port)) == 0

        wait_for(listening, timeout=20, what="rotel listening")
        pusher = OtlpPusher(f"grpc://127.0.0.1:{grpc_port}")
        pushers.append(pusher)
        pusher.observe(rich_snapshot())
        mark = receiver.mark()
        assert pusher.force_flush()
        rows = receiver.request_after(mark, timeout=20)
        assert one(rows, "frexporter.pg.last_completed_seq", rank="0", pg="0")["value"] == 7
        assert one(rows, "hw.gpu.utilization")["value"] == 0.97
        assert one(rows, "frexporter.verdict")["attrs"]["kind"] == "missing_rank"
        assert rows[0]["resource"]["service.name"] == "frexporter"
        pusher.shutdown()  # its last push while rotel still answers
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.e2e
def test_a_job_id_that_was_not_utf8_is_pushed_repaired(receiver: Receiver, pushers: list[OtlpPusher],
                                                      tmp_path: Path) -> None:
    """A rank whose job id held a byte that was not UTF-8 (a lone surrogate in its manifest): the pushed series
    carry the repaired job id (the SDK silently dropped the attribute, and counted the push a success)."""
    from frexporter.sources.ranks import RanksConfig, RanksSource
    from tests import spoolgen

    spoolgen.write_rank(tmp_path, "job\udc80", 0)
    source = RanksSource(RanksConfig(directory=str(tmp_path)))
    try:
        exporter = Exporter([(source, 0.0)])
        exporter.poll_once()
        rows = push(receiver, pushers, "http", exporter.snapshot)
    finally:
        source.close()
    assert one(rows, "frexporter.rank.up", rank="0")["attrs"]["job_id"] == "job\ufffd"
