"""/metrics for a fixed snapshot equals the committed golden file, and promtool accepts it.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_golden_metrics.py."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, generate_latest

from frexporter import __version__
from frexporter.outputs.snapshot_metrics import SnapshotCollector
from tests.fakes.snapshot import GOLDEN, fixed_snapshot


def render() -> str:
    registry = CollectorRegistry(auto_describe=False)
    snap = fixed_snapshot()
    registry.register(SnapshotCollector(lambda: snap))
    return generate_latest(registry).decode().replace(f'version="{__version__}"', 'version="VERSION"')


def test_metrics_match_golden_file() -> None:
    text = render()
    if os.environ.get("FREXPORTER_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "run with FREXPORTER_UPDATE_GOLDEN=1 and review the diff"
