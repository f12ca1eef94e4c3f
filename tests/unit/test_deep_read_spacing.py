"""Routine deep reads are spaced by what they cost: a rank whose ring takes long to read (a slow node, a large
Flight Recorder buffer) is read less often, so that those reads take at most a bounded share of its time.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_deep_read_spacing.py."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from frexporter import defaults
from frexporter.sources.arrivals import ARRIVAL_GRID, read_point
from frexporter.sources.ranks import RanksConfig, routine_deep_interval
from tests.fakes.node import Node, raw


def test_the_interval_is_the_configured_one_until_reads_are_slow() -> None:
    config = RanksConfig("", deep_interval=15.0, deep_read_share=0.002)
    assert routine_deep_interval(None, config) == 15.0  # never read yet
    assert routine_deep_interval(0.025, config) == 15.0  # a full 2000-entry ring on a reference node
    assert routine_deep_interval(0.09, config) == pytest.approx(45.0)  # the same ring on a slow VM
    assert routine_deep_interval(0.5, config) == pytest.approx(250.0)  # a 20000-entry ring
    assert routine_deep_interval(0.5, RanksConfig("", deep_interval=0.0)) == 0.0  # "whenever values move"
    assert routine_deep_interval(0.5, RanksConfig("", deep_read_share=0.0)) == RanksConfig.deep_interval
    assert RanksConfig.deep_read_share == defaults.DEEP_READ_SHARE


def _count_reads(node: Node) -> list[float]:
    """The fake clock's time of every deep read of rank 0 from now on."""
    reads: list[float] = []
    dump = node.dump

    def counted(r: int) -> dict[str, Any]:
        reads.append(node.now)
        return dump(r)

    node.dump = counted  # type: ignore[method-assign]
    return reads


def _poll_moving(node: Node, polls: int) -> None:
    for seq in range(1, polls + 1):
        node.rings[0].append(raw(seq - 1, seq))
        node.poll()


@pytest.mark.parametrize("waits", [True, False])
def test_with_collective_waits_every_rank_is_read_after_each_grid_instant(
        node_factory: Callable[..., Node], waits: bool) -> None:
    # The gloo arrivals need every node to have read each grid instant's block before reporting it
    # (sources/arrivals.py): with --collective-waits a routine read also comes at each read point, where the
    # interval alone (every 15 s from the first read) reads at whatever phase the rank was first seen.
    node = node_factory(1, deep_interval=15.0, collective_waits=waits)
    reads = _count_reads(node)
    # First seen 8 s after a grid instant (poll() adds a second first), well away from the read points.
    node.now = math.floor(node.now / ARRIVAL_GRID) * ARRIVAL_GRID + 7.0
    _poll_moving(node, 46)  # 46 polls, a second apart, the ring moving each time
    routine = reads[1:]  # the first read is the rank's first sight
    after_point = [t - read_point(t) for t in routine]
    if not waits:
        assert len(routine) == 3 and all(late > 3.0 for late in after_point)  # every 15 s, at the first's phase
        return
    assert len({read_point(t) for t in routine}) == len(routine)  # at most one read per grid period ...
    assert len(routine) == 3 and all(0 <= late < 1.5 for late in after_point)  # ... right after its read point


def test_a_slow_parse_is_the_exporter_s_cost_not_the_rank_s(node_factory: Callable[..., Node],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # A node of many ranks parses several full rings at once: each read then takes long on the exporter's side
    # while every rank answered at once. The read points' budget is the rank's time, so reads keep coming at them.
    import time

    from frexporter.fr import trace

    parse = trace.parse_answer

    def slow_parse(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.2)  # the slow parse is what is under test: over the 120 ms the read points may cost a rank
        return parse(*args, **kwargs)

    monkeypatch.setattr(trace, "parse_answer", slow_parse)
    node = node_factory(1, deep_interval=15.0, collective_waits=True)
    reads = _count_reads(node)
    node.now = math.floor(node.now / ARRIVAL_GRID) * ARRIVAL_GRID + 7.0
    _poll_moving(node, 46)
    track = next(iter(node.source._ranks.values()))  # the scheduler measured both
    assert track.deep_seconds is not None and track.deep_seconds >= 0.2
    assert track.deep_answer_seconds is not None and track.deep_answer_seconds < 0.12
    assert len(reads) == 4 and all(0 <= t - read_point(t) < 1.5 for t in reads[1:])
