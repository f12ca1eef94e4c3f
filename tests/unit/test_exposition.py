"""The fast text encoder produces exactly what prometheus_client's generate_latest produces."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from frexporter.exporter import Exporter
from frexporter.outputs import exposition
from frexporter.outputs.snapshot_metrics import SnapshotCollector
from frexporter.sources.ranks import RanksConfig, RanksSource
from tests import spoolgen
from tests.fakes.snapshot import fixed_snapshot


def both(registry: CollectorRegistry) -> tuple[bytes, bytes]:
    return exposition.encode(registry), generate_latest(registry)


def test_identical_on_golden_snapshot() -> None:
    registry = CollectorRegistry(auto_describe=False)
    snap = fixed_snapshot()
    registry.register(SnapshotCollector(lambda: snap))
    ours, reference = both(registry)
    assert ours == reference


def test_identical_on_many_ranks(tmp_path: Path) -> None:
    for rank in range(16):
        spoolgen.write_rank(tmp_path, "job", rank, pgs=4, world=16)
    exporter = Exporter([(RanksSource(RanksConfig(str(tmp_path))), 1.0)])
    exporter.poll_once()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: exporter.snapshot))
    ours, reference = both(registry)
    assert ours == reference and ours.count(b"\n") > 16 * 4 * 3  # at least the seqs of every rank and PG


class Odd:
    """Escaping, histograms, counters with created timestamps, unlabelled samples."""

    def collect(self):
        g = GaugeMetricFamily("odd_gauge", 'help with \\ and\nnewline', labels=["a", "b"])
        g.add_metric(['quote " back \\ nl \n', "ü"], float("inf"))
        g.add_metric(["x", "y"], -0.0)
        yield g
        c = CounterMetricFamily("odd_events", "counter", labels=["k"], created=123.0)
        c.add_metric(["v"], 3, created=1700000000.5)
        yield c
        h = HistogramMetricFamily("odd_seconds", "hist", labels=["op"])
        h.add_metric(["all_reduce"], buckets=[("0.1", 1), ("+Inf", 3)], sum_value=0.7)
        yield h
        yield GaugeMetricFamily("odd_plain", "no labels", value=1e-9)


def test_identical_on_edge_cases() -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Odd())
    ours, reference = both(registry)
    assert ours == reference
