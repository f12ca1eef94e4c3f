"""Ranks appear, start, restart and depart: discovery and state reset on synthetic spool files (fake clock).

Its unit tests are in tests/unit/test_rank_lifecycle.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from frexporter import spool
from frexporter.model import RANK_OK, RANK_UNRESPONSIVE
from frexporter.sources import worker_handlers
from frexporter.sources.ranks import RanksConfig, RanksSource
from tests import spoolgen
from tests.fakes.clock import Clock
from tests.harness import REPO, wait_for


def test_rank_between_its_manifest_and_first_snapshot_is_starting_not_wedged(tmp_path: Path) -> None:
    # The recorder writes a rank's manifest, then its first snapshot, in one tick; an exporter that polls in
    # between finds a live worker socket and no heartbeat. That is a rank starting, not a wedged Python.
    tmp_path.chmod(0o700)
    sock = tmp_path / spool.socket_name("job-r0")
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys; from frexporter.recorder import torch_fr; s = torch_fr.start_worker_server("
         "sys.argv[1]); print('up', flush=True); sys.stdin.read()", str(sock)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        assert worker_handlers.ping(str(sock), 5.0)  # the socket answers at once: a ping would settle the status
        spool.write_json_atomic(str(tmp_path / ("job-r0" + spool.MANIFEST_SUFFIX)),
                                spoolgen.manifest("job", 0, socket=sock.name, pid=server.pid))
        clock = Clock(spoolgen.time.time())
        src = RanksSource(RanksConfig(directory=str(tmp_path), poll_interval=0.2, rank_timeout=2.0), clock=clock)
        try:
            deadline = time.monotonic() + 1.0  # many times a ping's round trip on this socket
            while time.monotonic() < deadline:
                (state,) = src.collect().ranks
                assert (state.status, state.heartbeat) == (RANK_OK, None)
            # No snapshot for longer than three default intervals: now the live socket means a wedged Python.
            clock.now += 3 * spool.DEFAULT_SNAPSHOT_INTERVAL + 1.0
            wait_for(lambda: src.collect().ranks[0].status == RANK_UNRESPONSIVE, timeout=10, what="rank unresponsive")
        finally:
            src.close()
    finally:
        server.kill()
        server.wait()
