"""Routine deep reads are spaced by what they cost: a rank whose ring takes long to read (a slow node, a large
Flight Recorder buffer) is read less often, so that those reads take at most a bounded share of its time.

Its unit tests are in tests/unit/test_deep_read_spacing.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from frexporter import defaults
from tests.fakes.node import Node, raw

POLLS = 80
SLOW_READ = 0.05  # seconds the fake worker server takes to answer: 25 s of spacing at the 0.2 % share


def _reads_in(node: Node) -> list[int]:
    """Poll POLLS times with the ring moving at every poll; the worker's read count after each poll."""
    counts = []
    for i in range(POLLS):
        node.rings[0].append(raw(i, i + 1))
        node.poll()
        counts.append(node.workers[0].reads)
    return counts


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
