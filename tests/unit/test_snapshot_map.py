"""The mapped snapshot file: what the recorder updates in place once a second and the exporter reads every poll.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_snapshot_map.py."""

from __future__ import annotations

import json
import logging
import os
import stat
import struct
from pathlib import Path

import pytest

from frexporter import spool
from tests import spoolgen
from tests.shared.snapshot_map import doc, write
from tests.shared.spool_exporter import errors_of, healthy_ranks, make_exporter


def test_round_trip_private_file_and_no_temporary_left(tmp_path: Path) -> None:
    path = tmp_path / ("j.r0" + spool.SNAPSHOT_MAP_SUFFIX)
    writer = write(path, doc(counter=1))
    try:
        assert spool.read_snapshot_map(str(path))["counter"] == 1
        writer.write(json.dumps(doc(counter=2)).encode())
        snap = spool.parse_snapshot(spool.read_snapshot_map(str(path)))
        assert snap.counter == 2 and snap.status["fr"][0].completed == 10
        assert stat.S_IMODE(path.stat().st_mode) == spool.FILE_MODE
        assert [p.name for p in tmp_path.iterdir()] == [path.name]
    finally:
        writer.close()


def test_a_bound_updater_writes_in_place_until_its_mapping_is_replaced_or_closed(tmp_path: Path) -> None:
    # The recorder binds the in-place update once and calls it every snapshot; it must refuse (and write
    # nothing) once the file it was bound to has grown into a new mapping or been closed.
    path = tmp_path / ("j.r0" + spool.SNAPSHOT_MAP_SUFFIX)
    writer = write(path, doc(counter=1))
    try:
        update = writer.updater()
        assert update(json.dumps(doc(counter=2)).encode())
        assert spool.read_snapshot_map(str(path))["counter"] == 2
        too_big = json.dumps(doc(counter=3, message="m" * spool.MAP_INITIAL_CAPACITY)).encode()
        assert not update(too_big)
        assert spool.read_snapshot_map(str(path))["counter"] == 2
        writer.write(too_big)  # grows: a new file and mapping
        assert not update(json.dumps(doc(counter=4)).encode())
        assert spool.read_snapshot_map(str(path))["counter"] == 3
        update = writer.updater()
        assert update(json.dumps(doc(counter=5)).encode())
        assert spool.read_snapshot_map(str(path))["counter"] == 5
        writer.close()
        assert not update(json.dumps(doc(counter=6)).encode())
        assert not writer.updater()(json.dumps(doc(counter=6)).encode())
        assert spool.read_snapshot_map(str(path))["counter"] == 5
    finally:
        writer.close()


def test_a_snapshot_larger_than_the_file_grows_it(tmp_path: Path) -> None:
    path = tmp_path / ("j.r0" + spool.SNAPSHOT_MAP_SUFFIX)
    writer = write(path, doc())
    try:
        assert path.stat().st_size == spool.MAP_INITIAL_CAPACITY
        big = doc(counter=2, message="m" * (3 * spool.MAP_INITIAL_CAPACITY))
        writer.write(json.dumps(big).encode())
        assert path.stat().st_size >= 3 * spool.MAP_INITIAL_CAPACITY
        assert spool.read_snapshot_map(str(path))["message"] == big["message"]
        with pytest.raises(spool.SpoolError) as err:
            writer.write(b"x" * (spool.MAX_SNAPSHOT_BYTES + 1))
        assert err.value.reason == "oversized"
    finally:
        writer.close()


def test_unchanged_file_is_not_parsed_again(tmp_path: Path) -> None:
    path = tmp_path / ("j.r0" + spool.SNAPSHOT_MAP_SUFFIX)
    writer = write(path, doc())
    try:
        key, obj = spool.read_snapshot_map_if_new(str(path), None)
        assert obj["counter"] == 1
        assert spool.read_snapshot_map_if_new(str(path), key) == (key, None)
        writer.write(json.dumps(doc(counter=2)).encode())
        key2, obj = spool.read_snapshot_map_if_new(str(path), key)
        assert key2 != key and obj["counter"] == 2
    finally:
        writer.close()


def test_gone_after_removal_or_replacement(tmp_path: Path) -> None:
    path = tmp_path / ("j.r0" + spool.SNAPSHOT_MAP_SUFFIX)
    writer = write(path, doc())
    try:
        assert not writer.gone()
        path.unlink()
        assert writer.gone()
        write(path, doc()).close()  # someone else's file under our name
        assert writer.gone()
    finally:
        writer.close()


def _valid_bytes(tmp_path: Path) -> bytes:
    path = tmp_path / "seed.map"
    write(path, doc()).close()
    return path.read_bytes()


def _patched(data: bytes, offset: int, fmt: str, value: int | bytes) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


BAD = {
    "odd sequence (writer died mid-update)": (lambda d: _patched(d, 8, "<Q", 3), "torn"),
    "CRC mismatch": (lambda d: _patched(d, 20, "<I", 12345), "torn"),
    # struct.pack_into zeroes a field before it fills it in: a read racing an update can catch sequence,
    # length and checksum all at zero, which would otherwise pass as an even sequence with a valid empty payload.
    "header fields caught zeroed": (lambda d: d[:8] + bytes(16) + d[24:], "torn"),
    "not ours": (lambda d: b"GIF89a" + d[6:], "foreign"),
    "a later version": (lambda d: b"FRXSNAP\x03" + d[8:], "unknown_version"),
    "shorter than the header": (lambda d: d[:10], "truncated"),
    "payload past the end": (lambda d: d[:100], "truncated"),
    "oversized": (lambda d: d + b"\0" * (spool.MAX_SNAPSHOT_BYTES + 1), "oversized"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_mapped_files_are_refused_with_a_reason(tmp_path: Path, case: str) -> None:
    make, reason = BAD[case]
    path = tmp_path / ("j.r0" + spool.SNAPSHOT_MAP_SUFFIX)
    path.write_bytes(make(_valid_bytes(tmp_path)))
    with pytest.raises(spool.SpoolError) as err:
        spool.read_snapshot_map(str(path))
    assert err.value.reason == reason


def test_exporter_reads_mapped_snapshots_and_reports_a_bad_one_once(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    for rank in (0, 1):
        spoolgen.write_rank(tmp_path, "job", rank, mapped=True)
    exporter, _ = make_exporter(tmp_path)
    exporter.poll_once()
    assert healthy_ranks(exporter) == {0, 1}
    for counter in range(2, 5):  # in-place updates are seen although the file's mtime may not move
        spoolgen.refresh(tmp_path, "job", 1, counter=counter, seq=10 + counter, mapped=True)
        exporter.poll_once()
        pg = next(r for r in exporter.snapshot.ranks if r.rank == 1).pgs[0]
        assert pg.last_enqueued == 10 + counter
    bad = tmp_path / (spool.rank_stem("job", 0) + spool.SNAPSHOT_MAP_SUFFIX)
    data = bytearray(bad.read_bytes())
    data[:8] = b"GARBAGE!"
    os.unlink(bad)  # the writer's mapping stays with the old file
    bad.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, logger="frexporter")
    for _ in range(3):
        exporter.poll_once()
    assert errors_of(exporter) == {"foreign": 1}
    assert sum("not a frexporter snapshot" in r.getMessage() for r in caplog.records) == 1
    assert {r.rank for r in exporter.snapshot.ranks} == {0, 1}
