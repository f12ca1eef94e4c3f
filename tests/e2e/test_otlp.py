"""OTLP push: real OTLP/HTTP and OTLP/gRPC requests into a real receiver (tests/otlp_receiver.py), decoded with
the official opentelemetry-proto messages, compared value by value with the Prometheus view of the same snapshot.

Its unit tests are in tests/unit/test_otlp.py."""

from __future__ import annotations

import importlib.util
import json
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from frexporter import __version__
from frexporter import naming as n
from frexporter.exporter import Exporter
from frexporter.model import NodeSnapshot
from frexporter.outputs.snapshot_metrics import SnapshotCollector
from frexporter.sources.base import Reading
from tests.fakes.snapshot import fixed_snapshot, rich_snapshot
from tests.harness import REPO, free_port, missing, require_module, wait_for

require_module("opentelemetry.exporter.otlp.proto.http", "opentelemetry-exporter-otlp-proto-http (the otlp extra)")
require_module("opentelemetry.exporter.otlp.proto.grpc", "opentelemetry-exporter-otlp-proto-grpc (the otlp extra)")

from frexporter.outputs.otlp import OtlpPusher, otel_metric  # noqa: E402 (after the skip: the exporters are optional)

GPU_EXTRA_KEYS = {"hw.id", "hw.type"}


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


# ---------------------------------------------------------------- over the wire


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


# ---------------------------------------------------------------- through a real collector


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
