"""Concurrent scrapes of one poll's snapshot share a single rendering of /metrics."""

from __future__ import annotations

import threading
import urllib.request
from pathlib import Path

import pytest

from frexporter import naming as n
from frexporter.app import ServeConfig, build_app
from frexporter.outputs import exposition
from tests import spoolgen


def test_concurrent_scrapes_render_once_per_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for rank in range(8):
        spoolgen.write_rank(tmp_path, "job", rank, pgs=4)
    renders: list[int] = []
    real = exposition.encode
    monkeypatch.setattr(exposition, "encode", lambda registry: renders.append(1) or real(registry))
    # A poll interval far longer than the test: every scrape sees the snapshot taken at start.
    app = build_app(ServeConfig(directory=str(tmp_path), port=0, poll_interval=3600, sources=(n.SOURCE_RANKS,),
                                evidence_dir=""))
    app.start()
    bodies: list[bytes] = []
    try:
        def scrape() -> None:
            with urllib.request.urlopen(f"http://127.0.0.1:{app.port}/metrics", timeout=30) as resp:
                bodies.append(resp.read())

        threads = [threading.Thread(target=scrape) for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        app.stop()
    assert len(bodies) == 20 and len(set(bodies)) == 1
    assert len(renders) == 1
