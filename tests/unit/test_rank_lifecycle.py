"""Ranks appear, start, restart and depart: discovery and state reset on synthetic spool files (fake clock)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from frexporter import spool
from frexporter.model import RANK_DOWN, RANK_OK, RANK_UNRESPONSIVE
from frexporter.sources import worker_handlers
from frexporter.sources.ranks import RanksConfig, RanksSource
from tests import spoolgen
from tests.harness import REPO, wait_for


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def source(tmp_path: Path, clock: Clock, grace: float = 30.0) -> RanksSource:
    return RanksSource(RanksConfig(directory=str(tmp_path), poll_interval=1.0, departed_grace=grace), clock=clock)


def test_new_ranks_appear_on_the_next_poll(tmp_path: Path) -> None:
    clock = Clock(spoolgen.time.time())
    src = source(tmp_path, clock)
    assert src.collect().ranks == ()
    spoolgen.write_rank(tmp_path, "job", 0)
    spoolgen.write_rank(tmp_path, "job", 1)
    assert [r.rank for r in src.collect().ranks] == [0, 1]


def test_restarted_rank_replaces_its_old_state(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock(spoolgen.time.time())
    src = source(tmp_path, clock)
    spoolgen.write_rank(tmp_path, "job", 0, seq=500)
    (first,) = src.collect().ranks
    assert first.pgs[0].last_completed == 500
    caplog.set_level(logging.INFO, logger="frexporter")
    # torchelastic restart: same job and rank, new pid, sequences start over.
    spoolgen.write_rank(tmp_path, "job", 0, seq=3, pid=424242)
    clock.now += 1
    (second,) = src.collect().ranks
    assert (second.pid, second.pgs[0].last_completed, second.status) == (424242, 3, RANK_OK)
    assert any("restarted" in r.getMessage() for r in caplog.records)


def test_departed_rank_is_down_then_dropped_after_grace(tmp_path: Path) -> None:
    clock = Clock(spoolgen.time.time())
    src = source(tmp_path, clock, grace=30.0)
    spoolgen.write_rank(tmp_path, "job", 0)
    spoolgen.write_rank(tmp_path, "job", 1)
    src.collect()
    clock.now += 10  # rank 1 stops refreshing; rank 0 goes on
    spoolgen.refresh(tmp_path, "job", 0, counter=2)
    assert {r.rank: r.status for r in src.collect().ranks} == {0: RANK_OK, 1: RANK_DOWN}
    clock.now += 31
    spoolgen.refresh(tmp_path, "job", 0, counter=3)
    assert [r.rank for r in src.collect().ranks] == [0]


def test_clean_exit_is_not_an_outage(tmp_path: Path) -> None:
    clock = Clock(spoolgen.time.time())
    src = source(tmp_path, clock)
    stem = spoolgen.write_rank(tmp_path, "job", 0)
    src.collect()
    spool.write_json_atomic(str(tmp_path / (stem + spool.SNAPSHOT_SUFFIX)),
                            spoolgen.snapshot(100000, counter=2, state="exiting"))
    assert src.collect().ranks == ()


def test_removed_files_drop_the_rank(tmp_path: Path) -> None:
    clock = Clock(spoolgen.time.time())
    src = source(tmp_path, clock)
    stem = spoolgen.write_rank(tmp_path, "job", 0)
    assert len(src.collect().ranks) == 1
    (tmp_path / (stem + spool.MANIFEST_SUFFIX)).unlink()
    assert src.collect().ranks == ()


@pytest.mark.e2e
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
