"""Bad input in the spool directory or on a socket: one log line, one counted error, the rest still served."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from frexporter import naming as n
from frexporter import spool
from frexporter.exporter import Exporter
from frexporter.model import RANK_DOWN, RANK_OK
from frexporter.sources.ranks import RanksConfig, RanksSource
from tests import spoolgen
from tests.harness import REPO, require


def make_exporter(directory: Path, **kw: float) -> tuple[Exporter, RanksSource]:
    config = RanksConfig(directory=str(directory), poll_interval=0.2, rank_timeout=kw.pop("rank_timeout", 0.5))
    source = RanksSource(config)
    return Exporter([(source, 0.0)], poll_interval=0.2), source


def errors_of(exporter: Exporter) -> dict[str, int]:
    return dict(next(s for s in exporter.snapshot.sources if s.name == n.SOURCE_RANKS).errors_total)


def healthy_ranks(exporter: Exporter) -> set[int]:
    return {r.rank for r in exporter.snapshot.ranks if r.status == RANK_OK}


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


class SilentSocket:
    """A unix socket that accepts and never answers: a hung worker server."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(64)
        self.conns: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
                self.conns.append(conn)
            except TimeoutError:
                continue

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.mark.e2e
def test_socket_that_never_answers_does_not_hold_the_poll(tmp_path: Path) -> None:
    spoolgen.write_rank(tmp_path, "job", 0)
    stale = spoolgen.write_rank(tmp_path, "job", 1, socket=spoolgen.own_socket("job", 1))
    spool.write_json_atomic(str(tmp_path / (stale + spool.SNAPSHOT_SUFFIX)), spoolgen.snapshot(100001, when=1.0))
    hung = SilentSocket(str(tmp_path / spoolgen.own_socket("job", 1)))
    try:
        exporter, source = make_exporter(tmp_path, rank_timeout=0.5)
        durations = []
        for counter in range(2, 6):
            spoolgen.refresh(tmp_path, "job", 0, counter)
            exporter.poll_once()
            durations.append(next(s for s in exporter.snapshot.sources if s.name == "ranks").duration_seconds)
        source.close()
    finally:
        hung.close()
    # Each poll waits at most the per-rank timeout (plus scheduling slack), never the sum of retries.
    assert max(durations) < 0.5 + 0.4, durations
    assert healthy_ranks(exporter) == {0}
    assert errors_of(exporter).get("socket_timeout", 0) >= 1
    assert set(errors_of(exporter)) == {"socket_timeout"}


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


_AS_NOBODY = """
import json, sys
from frexporter.exporter import Exporter
from frexporter.sources.ranks import RanksConfig, RanksSource
exp = Exporter([(RanksSource(RanksConfig(directory=sys.argv[1])), 0.0)])
snap = exp.poll_once()
print(json.dumps({"ranks": sorted(r.rank for r in snap.ranks),
                  "errors": dict(snap.sources[0].errors_total), "up": snap.sources[0].up}))
"""


@pytest.mark.e2e
def test_permission_denied_file_and_directory() -> None:
    require(os.geteuid() == 0, "needs root to switch to an unprivileged user")
    # pytest's tmp_path lives under a 0700 directory; the unprivileged reader needs a path it can reach.
    # The interpreter must be reachable too: a virtualenv under /root is not, the system one is.
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    base = Path(tempfile.mkdtemp(prefix="frexporter-perm-"))
    directory = base / "spool"
    spoolgen.write_rank(directory, "job", 0)
    stem = spoolgen.write_rank(directory, "job", 1)
    os.chmod(base, 0o755)
    os.chmod(directory, 0o755)
    for path in directory.iterdir():
        os.chmod(path, 0o644)
    os.chmod(directory / (stem + spool.MANIFEST_SUFFIX), 0o600)

    def run_as_nobody() -> dict:
        out = subprocess.run(
            [python, "-c", _AS_NOBODY, str(directory)], capture_output=True, text=True, timeout=60,
            user=65534, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd="/",
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    try:
        result = run_as_nobody()
        assert result == {"ranks": [0], "errors": {"permission": 1}, "up": True}
        os.chmod(directory, 0o700)
        result = run_as_nobody()
        assert result == {"ranks": [], "errors": {"permission": 1}, "up": False}
    finally:
        shutil.rmtree(base)
