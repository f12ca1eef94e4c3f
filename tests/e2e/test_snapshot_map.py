"""The mapped snapshot file: what the recorder updates in place once a second and the exporter reads every poll.

Its unit tests are in tests/unit/test_snapshot_map.py."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

from frexporter import spool
from tests.shared.snapshot_map import doc, write


def _writer(path: str, stop: float) -> None:
    writer = spool.SnapshotMap(path)
    counter = 0
    while time.time() < stop:
        counter += 1
        writer.write(json.dumps(doc(counter=counter, message="p" * (counter % 5000))).encode())


def test_a_reader_never_sees_a_half_written_snapshot(tmp_path: Path) -> None:
    """A writer process updating as fast as it can; every read is whole and counters never go back."""
    path = tmp_path / ("j.r0" + spool.SNAPSHOT_MAP_SUFFIX)
    write(path, doc(counter=0)).close()
    proc = multiprocessing.get_context("fork").Process(target=_writer, args=(str(path), time.time() + 3))
    proc.start()
    try:
        last, reads, torn = -1, 0, 0
        while proc.is_alive() and reads < 3000:
            try:
                obj = spool.read_snapshot_map(str(path))
            except spool.SpoolError as e:
                assert e.reason == "torn", e  # five torn reads in a row: possible under this load, never garbage
                torn += 1
                continue
            assert obj["counter"] >= last and obj["message"] == "p" * (obj["counter"] % 5000)
            last, reads = obj["counter"], reads + 1
        assert reads > 100 and last > 0
    finally:
        proc.join(timeout=10)
