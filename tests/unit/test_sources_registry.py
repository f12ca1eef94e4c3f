"""The source table: every registered source gets --[no-]source.NAME, and the options behind flags reach the
code they configure (per-rank durations, NVLink per link, verdict confirmation)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from frexporter import cli, defaults
from frexporter import naming as n
from frexporter.app import ServeConfig, build_app
from frexporter.exporter import Exporter
from frexporter.outputs.snapshot_metrics import SnapshotCollector
from frexporter.sources import DEFAULT_SOURCES, SOURCES
from frexporter.sources.nvml import NvmlSource
from frexporter.sources.ranks import RanksSource
from tests.fakes.gpu import FakeGpu, FakeGpuBackend, full_nvlinks


def _serve_args(*flags: str):
    return cli.build_parser().parse_args(["serve", *flags])


def test_every_registered_source_has_an_on_and_off_flag() -> None:
    on = _serve_args()
    assert {info.name for info in SOURCES if getattr(on, f"source_{info.name}")} == DEFAULT_SOURCES
    for info in SOURCES:
        off = _serve_args(f"--no-source.{info.name}")
        assert getattr(off, f"source_{info.name}") is False
        assert getattr(_serve_args(f"--no-source.{info.name}", f"--source.{info.name}"), f"source_{info.name}")
    assert _serve_args("--no-nvml").source_nvml is False  # the older spelling stays


def test_serve_defaults_come_from_one_place(tmp_path: Path) -> None:
    args = _serve_args("--dir", str(tmp_path))
    assert (args.poll_interval, args.stuck_after, args.rank_timeout, args.deep_interval, args.otlp_interval) == (
        defaults.POLL_INTERVAL, defaults.STUCK_AFTER, defaults.RANK_TIMEOUT, defaults.DEEP_INTERVAL,
        defaults.OTLP_INTERVAL)
    # The flags' defaults and ServeConfig's are the same, field for field: only where it listens differs (a
    # config built in code serves on a free loopback port).
    host, port = cli.parse_listen(defaults.LISTEN)
    assert cli.serve_config(args) == ServeConfig(directory=str(tmp_path), host=host, port=port)
    assert cli.serve_config(_serve_args("--dir", str(tmp_path), "--no-source.nvml")).sources == {n.SOURCE_RANKS}
    assert cli.serve_config(_serve_args("--dir", str(tmp_path), "--collective-waits")).collective_waits


def _sources(exporter: Exporter) -> dict[str, object]:
    return {track.source.name: track.source for track in exporter._tracks}


def test_build_app_creates_only_the_enabled_sources_and_wires_their_options(tmp_path: Path) -> None:
    app = build_app(ServeConfig(str(tmp_path), sources=(n.SOURCE_RANKS,), per_rank_durations=True, evidence_dir="",
                                verdict_confirm_after=7.0, collective_waits=True))
    try:
        sources = _sources(app.exporter)
        assert set(sources) == {n.SOURCE_RANKS}
        ranks = sources[n.SOURCE_RANKS]
        assert isinstance(ranks, RanksSource) and ranks.config.per_rank_durations and ranks.config.collective_waits
        assert app.events is not None and app.events.tracker.confirm_after == 7.0
    finally:
        app.stop()
    app = build_app(ServeConfig(str(tmp_path), sources=(n.SOURCE_RANKS, n.SOURCE_NVML), evidence_dir=""))
    try:
        assert isinstance(_sources(app.exporter)[n.SOURCE_NVML], NvmlSource)
    finally:
        app.stop()
    with pytest.raises(ValueError, match="unknown sources: gpu"):
        build_app(ServeConfig(str(tmp_path), sources=("gpu",), evidence_dir=""))


@pytest.mark.parametrize("per_link", [False, True])
def test_nvlink_per_link_changes_the_nvlink_series(tmp_path: Path, per_link: bool) -> None:
    backend = FakeGpuBackend([FakeGpu("GPU-a", nvlink_errors=full_nvlinks(links=2, count=1))])
    exporter = Exporter([(NvmlSource(backend), 0.0)], hostname="node")
    exporter.poll_once()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: exporter.snapshot, nvlink_per_link=per_link))
    lines = [line for line in generate_latest(registry).decode().splitlines()
             if line.startswith(n.GPU_NVLINK_ERRORS_TOTAL)]
    has_link_label = any(f'{n.L_LINK}="1"' in line for line in lines)
    assert has_link_label is per_link
    assert lines


def test_a_new_source_is_one_row(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """node_exporter's registerCollector: a row in SOURCES is the flag and the constructor; build_app names no
    source."""
    from frexporter import app as app_module
    from frexporter.sources import BuiltSource, SourceInfo
    from frexporter.sources.base import Reading

    class Quiet:
        name = "quiet"

        def collect(self) -> Reading:
            return Reading()

        def close(self) -> None:
            pass

    row = SourceInfo("quiet", "a source that reads nothing", lambda s: BuiltSource(Quiet(), s.poll_interval, 1.5))
    monkeypatch.setattr(app_module, "SOURCES", (*SOURCES, row))
    app = build_app(ServeConfig(str(tmp_path), sources=(n.SOURCE_RANKS, "quiet"), evidence_dir=""))
    try:
        assert set(_sources(app.exporter)) == {n.SOURCE_RANKS, "quiet"}
    finally:
        app.exporter.stop()
