"""Gloo's cross-node straggler signal on a real job over two exporters: every rank's arrival, the same grid
instant's block on both nodes, the slow rank late by its delay.

The rule over these series is promtool-tested (tests/rules/straggler_test.yml); benchmarks/straggler.py runs the
whole chain with Prometheus at the shipped settings (the grid instant is 15 s, too long to scale down here)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from frexporter import naming as n
from frexporter.sources.arrivals import ARRIVAL_BLOCK, ARRIVAL_DELAY, ARRIVAL_GRID
from tests.harness import Job, metrics, wait_for

WORLD = 6
SLOW = 4  # on node-b
STEP_S = 0.3
SLOW_FRACTION = 0.5  # rank 4 computes 0.15 s longer every step
SEEN_TIMEOUT_S = 6 * ARRIVAL_GRID  # up to four grid instants, the report, polls
# A block of the slow rank's collectives, in seconds: a rank whose calls straddle the grid instant reports the
# neighbouring block, this far from its peers' (about one instant in ten here); the rule keeps only ranks within
# half a block of the median, and so does this test.
SLOW_BLOCK_S = ARRIVAL_BLOCK * STEP_S * (1 + SLOW_FRACTION)


def _arrivals(exporters: list[Any]) -> dict[int, tuple[float, float]]:
    """rank -> (arrival, stamp in seconds) of WORLD, from both exporters' /metrics as Prometheus reads them."""
    out = {}
    for exp in exporters:
        for line in exp.get("/metrics").splitlines():
            if line.startswith(n.RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS + "{"):
                labels, value, stamp = line.rsplit(" ", 2)
                parsed = metrics(f"{labels} {value}\n")
                (sample_labels, number), = parsed[n.RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS]
                if sample_labels[n.L_PG_DESC] == "default_pg":
                    out[int(sample_labels[n.L_RANK])] = (number, int(stamp) / 1000.0)
    return out


def test_a_slow_rank_arrives_late_by_its_delay_on_both_nodes_alike(
    job_factory: Callable[..., Job], exporter_factory: Callable[..., Any], tmp_path: Path,
) -> None:
    spools = (tmp_path / "node-a", tmp_path / "node-b")
    job = job_factory("dp_straggler", WORLD, job_id="arrivals", env={
        "JOB_STEP_SECONDS": f"{STEP_S:g}", "JOB_SLOW_FRACTION": f"{SLOW_FRACTION:g}", "JOB_VICTIM": str(SLOW)},
        rank_env={rank: {"FREXPORTER_DIR": str(spools[rank * 2 // WORLD])} for rank in range(WORLD)})
    job.wait_ready()
    job.touch("slow")
    job.wait_ready("slow", ranks=[SLOW], timeout=10)
    # A block starts up to 3 collectives before its grid instant: only one whose instant is that far past the
    # slowdown is slow throughout.
    slow_since = job.marker(SLOW, "slow").stat().st_mtime + 4 * STEP_S * (1 + SLOW_FRACTION) + 0.5
    exporters = [exporter_factory(spool, collective_waits=True) for spool in spools]

    def same_instant_everywhere() -> dict[int, tuple[float, float]] | None:
        seen = _arrivals(exporters)
        stamps = {stamp for _, stamp in seen.values()}
        if len(seen) < WORLD or len(stamps) != 1 or stamps.pop() - ARRIVAL_DELAY < slow_since:
            return None
        peers = sorted(arrival for rank, (arrival, _) in seen.items() if rank != SLOW)
        return seen if abs(seen[SLOW][0] - peers[len(peers) // 2]) < SLOW_BLOCK_S / 2 else None

    seen = wait_for(same_instant_everywhere, timeout=SEEN_TIMEOUT_S, interval=0.5,
                    what="every rank's arrival, of one grid instant on both nodes")
    peers = sorted(arrival for rank, (arrival, _) in seen.items() if rank != SLOW)
    # Every peer calls within milliseconds of the others (they leave the all_reduce together); the slow rank
    # calls its delay later.
    assert peers[-1] - peers[0] < 0.05, seen
    assert seen[SLOW][0] - peers[len(peers) // 2] == pytest.approx(SLOW_FRACTION * STEP_S, abs=0.05), seen
    # The stamp is the grid instant's time (plus the report's delay), not the scrape's.
    stamp = next(iter(seen.values()))[1]
    assert (stamp - ARRIVAL_DELAY) % ARRIVAL_GRID == pytest.approx(0.0, abs=1e-6)
