"""Bad input in the spool directory or on a socket: one log line, one counted error, the rest still served.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_bad_input.py."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from frexporter import naming as n
from frexporter import spool
from frexporter.model import RANK_DOWN, RANK_OK
from tests import spoolgen
from tests.shared.spool_exporter import errors_of, healthy_ranks, make_exporter

BAD_FILES = {
    "corrupt": (b"\x00\xffnot json at all", "corrupt"),
    "truncated": (b'{"format": "frexporter.manifest/1", "job_id": "j", "ra', "truncated"),
    "empty": (b"", "truncated"),
    "unknown_version": (json.dumps({"format": "frexporter.manifest/99", "rank": 1}).encode(), "unknown_version"),
    "foreign_json": (json.dumps({"hello": "world"}).encode(), "foreign"),
    "invalid_fields": (json.dumps({**spoolgen.manifest("job", 5), "rank": "five"}).encode(), "invalid"),
    "oversized": (b"{" + b" " * (spool.MAX_MANIFEST_BYTES + 10) + b"}", "oversized"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_manifest_is_reported_once_and_others_served(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                         case: str) -> None:
    content, reason = BAD_FILES[case]
    spoolgen.write_rank(tmp_path, "job", 0)
    bad = tmp_path / f"bad.r9{spool.MANIFEST_SUFFIX}"
    bad.write_bytes(content)
    bad.chmod(0o600)  # as the recorder makes it: a file open to every user would be warned about too
    exporter, _ = make_exporter(tmp_path)
    caplog.set_level(logging.WARNING, logger="frexporter")
    for counter in range(2, 7):
        spoolgen.refresh(tmp_path, "job", 0, counter)
        exporter.poll_once()
    assert healthy_ranks(exporter) == {0}
    assert errors_of(exporter) == {reason: 1}
    lines = [r for r in caplog.records if "bad.r9" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert f"reason={reason}" in lines[0].getMessage()
    source = next(s for s in exporter.snapshot.sources if s.name == n.SOURCE_RANKS)
    assert source.up


def test_bad_file_counted_again_only_when_it_changes(tmp_path: Path) -> None:
    spoolgen.write_rank(tmp_path, "job", 0)
    bad = tmp_path / f"bad.r9{spool.MANIFEST_SUFFIX}"
    bad.write_bytes(b"garbage")
    exporter, _ = make_exporter(tmp_path)
    exporter.poll_once()
    exporter.poll_once()
    bad.write_bytes(b"other garbage!")
    exporter.poll_once()
    exporter.poll_once()
    assert errors_of(exporter) == {"corrupt": 2}


def test_foreign_and_odd_files_are_ignored_once(tmp_path: Path) -> None:
    spoolgen.write_rank(tmp_path, "job", 0)
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / f"dir{spool.MANIFEST_SUFFIX}").mkdir()
    os.symlink("/etc/passwd", tmp_path / f"link{spool.MANIFEST_SUFFIX}")
    exporter, _ = make_exporter(tmp_path)
    for _ in range(3):
        exporter.poll_once()
    assert healthy_ranks(exporter) == {0}
    assert errors_of(exporter) == {"foreign": 3}


def test_corrupt_snapshot_keeps_rank_and_counts(tmp_path: Path) -> None:
    stem = spoolgen.write_rank(tmp_path, "job", 0)
    spoolgen.write_rank(tmp_path, "job", 1)
    exporter, _ = make_exporter(tmp_path)
    exporter.poll_once()
    (tmp_path / (stem + spool.SNAPSHOT_SUFFIX)).write_bytes(b'{"format": "frexporter.snapshot/1", "pid"')
    exporter.poll_once()
    exporter.poll_once()
    assert errors_of(exporter) == {"truncated": 1}
    assert {r.rank for r in exporter.snapshot.ranks} == {0, 1}


def test_manifest_of_unknown_snapshot_format_and_bad_pg_status(tmp_path: Path) -> None:
    stem = spoolgen.write_rank(tmp_path, "job", 0)
    snap = spoolgen.snapshot(100000, status={"fr": {"0": {"last_enqueued_collective": "x"}}})
    spool.write_json_atomic(str(tmp_path / (stem + spool.SNAPSHOT_SUFFIX)), snap)
    exporter, _ = make_exporter(tmp_path)
    exporter.poll_once()
    assert errors_of(exporter) == {"invalid": 1}


def test_dead_rank_without_socket_is_down_not_an_error(tmp_path: Path) -> None:
    spoolgen.write_rank(tmp_path, "job", 0)
    stale = spoolgen.write_rank(tmp_path, "job", 1, socket=spoolgen.own_socket("job", 1))
    spool.write_json_atomic(str(tmp_path / (stale + spool.SNAPSHOT_SUFFIX)), spoolgen.snapshot(100001, when=1.0))
    exporter, _ = make_exporter(tmp_path)
    exporter.poll_once()
    states = {r.rank: r.status for r in exporter.snapshot.ranks}
    assert states == {0: RANK_OK, 1: RANK_DOWN}


def test_missing_spool_directory_is_a_down_source_not_a_crash(tmp_path: Path) -> None:
    exporter, _ = make_exporter(tmp_path / "nope")
    snap = exporter.poll_once()
    source = next(s for s in snap.sources if s.name == n.SOURCE_RANKS)
    assert not source.up and source.errors_total == {"dir_missing": 1}
    (tmp_path / "nope").mkdir()
    spoolgen.write_rank(tmp_path / "nope", "job", 0)
    snap = exporter.poll_once()
    assert next(s for s in snap.sources if s.name == n.SOURCE_RANKS).up
    assert healthy_ranks(exporter) == {0}
