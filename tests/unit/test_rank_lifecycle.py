"""Ranks appear, start, restart and depart: discovery and state reset on synthetic spool files (fake clock).

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_rank_lifecycle.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from frexporter import spool
from frexporter.model import RANK_DOWN, RANK_OK
from frexporter.sources.ranks import RanksConfig, RanksSource
from tests import spoolgen
from tests.fakes.clock import Clock


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
