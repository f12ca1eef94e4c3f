"""Bad input in the spool directory or on a socket: one log line, one counted error, the rest still served.

Its unit tests are in tests/unit/test_bad_input.py."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from frexporter import spool
from tests import spoolgen
from tests.harness import REPO, require
from tests.shared.spool_exporter import errors_of, healthy_ranks, make_exporter


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


_AS_NOBODY = """
import json, sys
from frexporter.exporter import Exporter
from frexporter.sources.ranks import RanksConfig, RanksSource
exp = Exporter([(RanksSource(RanksConfig(directory=sys.argv[1])), 0.0)])
snap = exp.poll_once()
print(json.dumps({"ranks": sorted(r.rank for r in snap.ranks),
                  "errors": dict(snap.sources[0].errors_total), "up": snap.sources[0].up}))
"""


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
