"""Routine deep reads are spaced by what they cost: a rank whose ring takes long to read (a slow node, a large
Flight Recorder buffer) is read less often, so that those reads take at most a bounded share of its time."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from frexporter import defaults
from frexporter.sources.ranks import RanksConfig, routine_deep_interval
from tests.test_collectives import Node, raw

# One poll per second of the node's clock; values move at every poll, so only the spacing rule decides.
POLLS = 80
SLOW_READ = 0.05  # seconds the fake worker server takes to answer: 25 s of spacing at the 0.2 % share


def test_the_interval_is_the_configured_one_until_reads_are_slow() -> None:
    config = RanksConfig("", deep_interval=15.0, deep_read_share=0.002)
    assert routine_deep_interval(None, config) == 15.0  # never read yet
    assert routine_deep_interval(0.025, config) == 15.0  # a full 2000-entry ring on a reference node
    assert routine_deep_interval(0.09, config) == pytest.approx(45.0)  # the same ring on a slow VM
    assert routine_deep_interval(0.5, config) == pytest.approx(250.0)  # a 20000-entry ring
    assert routine_deep_interval(0.5, RanksConfig("", deep_interval=0.0)) == 0.0  # "whenever values move"
    assert routine_deep_interval(0.5, RanksConfig("", deep_read_share=0.0)) == RanksConfig.deep_interval
    assert RanksConfig.deep_read_share == defaults.DEEP_READ_SHARE


def _reads_in(node: Node) -> list[int]:
    """Poll POLLS times with the ring moving at every poll; the worker's read count after each poll."""
    counts = []
    for i in range(POLLS):
        node.rings[0].append(raw(i, i + 1))
        node.poll()
        counts.append(node.workers[0].reads)
    return counts


@pytest.mark.e2e
@pytest.mark.parametrize("share", [defaults.DEEP_READ_SHARE, 0.0])
def test_slow_reads_of_a_moving_rank_are_spaced_by_their_cost(tmp_path: Path, share: float) -> None:
    node = Node(tmp_path / "node", 1, deep_interval=1.0, deep_read_share=share)
    try:
        _check_spacing(node, share)
    finally:
        node.close()


def _check_spacing(node: Node, share: float) -> None:
    answer = node.workers[0]
    slow = node.dump

    def slowly(r: int) -> dict[str, Any]:
        time.sleep(SLOW_READ)
        return slow(r)

    node.dump = slowly  # type: ignore[method-assign]
    counts = _reads_in(node)
    reads = counts[-1]
    if share:
        # One read when the rank appears, then one per SLOW_READ / share seconds of the node's clock (or more
        # seconds: the read's measured time includes the exporter's parsing and this machine's load).
        spacing = SLOW_READ / share
        assert 2 <= reads <= 1 + POLLS / spacing + 1, counts
        assert counts.index(2) >= spacing - 1, counts  # the second read waited for the spacing
    else:
        assert reads >= POLLS - 2, counts  # the configured 1 s: a read at (nearly) every poll
    assert answer.reads == reads
