"""Routine deep reads are spaced by what they cost: a rank whose ring takes long to read (a slow node, a large
Flight Recorder buffer) is read less often, so that those reads take at most a bounded share of its time.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_deep_read_spacing.py."""

from __future__ import annotations

import pytest

from frexporter import defaults
from frexporter.sources.ranks import RanksConfig, routine_deep_interval


def test_the_interval_is_the_configured_one_until_reads_are_slow() -> None:
    config = RanksConfig("", deep_interval=15.0, deep_read_share=0.002)
    assert routine_deep_interval(None, config) == 15.0  # never read yet
    assert routine_deep_interval(0.025, config) == 15.0  # a full 2000-entry ring on a reference node
    assert routine_deep_interval(0.09, config) == pytest.approx(45.0)  # the same ring on a slow VM
    assert routine_deep_interval(0.5, config) == pytest.approx(250.0)  # a 20000-entry ring
    assert routine_deep_interval(0.5, RanksConfig("", deep_interval=0.0)) == 0.0  # "whenever values move"
    assert routine_deep_interval(0.5, RanksConfig("", deep_read_share=0.0)) == RanksConfig.deep_interval
    assert RanksConfig.deep_read_share == defaults.DEEP_READ_SHARE
