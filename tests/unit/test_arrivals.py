"""The gloo cross-node straggler signal: each rank's arrival at a PG's block of collectives
(``sources/arrivals.py``), through the ranks source, and the rule's number that depends on it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from frexporter import naming as n
from frexporter.fr.trace import FrEntry
from frexporter.sources.arrivals import (
    ARRIVAL_BLOCK,
    ARRIVAL_DELAY,
    ARRIVAL_GRID,
    ARRIVAL_HOLD,
    ARRIVAL_READ_AFTER,
    ArrivalTracker,
    grid_instant,
    read_point,
    sample_time,
)
from tests.fakes.node import Node, raw, render
from tests.harness import sample
from tests.shared.rules import shipped_rules

KEY = ("job", "0", 123, "fr")
START = 1_700_000_010.0  # a grid instant (a multiple of ARRIVAL_GRID)
PERIOD = 0.5  # seconds between a PG's collectives


def call(seq: int, at: float, *, p2p: bool = False) -> FrEntry:
    return FrEntry(record_id=seq, pg_id=0, pg_name="0", pg_desc="default_pg", collective_seq_id=0 if p2p else seq,
                   p2p_seq_id=seq if p2p else 0, op_id=seq, profiling_name="gloo:all_reduce",
                   time_created_ns=round(at * 1e9), state="scheduled", retired=True, timeout_ms=600_000, is_p2p=p2p,
                   duration_ms=None, input_sizes=((4,),), output_sizes=((4,),), input_dtypes=("Float",),
                   output_dtypes=("Float",), time_discovered_completed_ns=0)


def calls(late: float = 0.0, count: int = 200, first: int = 1) -> list[FrEntry]:
    return [call(seq, START + (seq - 1) * PERIOD + late) for seq in range(first, first + count)]


def arrive(tracker: ArrivalTracker, rank: int, now: float) -> float | None:
    """The arrival's value alone."""
    answer = tracker.arrival(KEY, rank, now)
    return None if answer is None else answer[0]


def due(instant: float) -> float:
    """A ``now`` at which ``instant``'s block is the one reported."""
    return instant + ARRIVAL_DELAY + 1.0


def test_grid_instants_are_shared_and_delayed() -> None:
    assert grid_instant(START + ARRIVAL_DELAY) == START
    assert grid_instant(START + ARRIVAL_DELAY + ARRIVAL_GRID - 0.001) == START
    assert grid_instant(START + ARRIVAL_DELAY + ARRIVAL_GRID) == START + ARRIVAL_GRID
    # Every rank is read after the instant and before its block is reported.
    assert START < read_point(START + ARRIVAL_DELAY) == START + ARRIVAL_READ_AFTER < START + ARRIVAL_DELAY
    assert read_point(START + ARRIVAL_READ_AFTER - 0.001) == START - ARRIVAL_GRID + ARRIVAL_READ_AFTER


def test_samples_are_stamped_with_their_instant_not_the_poll() -> None:
    tracker = ArrivalTracker()
    tracker.observe(KEY, 0, 100, calls())
    first = tracker.arrival(KEY, 0, due(START + 30.0))
    later = tracker.arrival(KEY, 0, due(START + 30.0) + ARRIVAL_GRID - 2.0)
    assert first is not None and first == later
    assert first[1] == sample_time(START + 30.0) == START + 30.0 + ARRIVAL_DELAY


def test_a_late_rank_reads_late_by_its_lateness() -> None:
    tracker = ArrivalTracker()
    tracker.observe(KEY, 0, 100, calls())
    tracker.observe(KEY, 1, 101, calls(late=0.15))
    now = due(START + 30.0)
    a0, a1 = arrive(tracker, 0, now), arrive(tracker, 1, now)
    assert a0 is not None and a1 is not None
    assert a1 - a0 == pytest.approx(0.15)
    # The block of the instant: the ARRIVAL_BLOCK collectives (seq-aligned) around the first call at or after it.
    first = int(30.0 / PERIOD) + 1
    start = first - first % ARRIVAL_BLOCK
    expected = sum(START + (s - 1) * PERIOD for s in range(start, start + ARRIVAL_BLOCK)) / ARRIVAL_BLOCK
    assert a0 == pytest.approx(expected)


def test_ranks_on_different_nodes_pick_the_same_block_at_different_instants() -> None:
    # Node b reads 7 s after node a within the same grid period: the same block, the same value.
    tracker = ArrivalTracker()
    tracker.observe(KEY, 0, 100, calls())
    now = due(START + 30.0)
    assert arrive(tracker, 0, now) == arrive(tracker, 0, now + 7.0)
    assert arrive(tracker, 0, now + ARRIVAL_GRID) != arrive(tracker, 0, now)


def test_no_block_without_every_call_of_it() -> None:
    tracker = ArrivalTracker()
    entries = calls()
    first = int(30.0 / PERIOD) + 1
    tracker.observe(KEY, 0, 100, [e for e in entries if e.collective_seq_id != first])  # lost to the ring
    assert arrive(tracker, 0, due(START + 30.0)) is None
    tracker.observe(KEY, 1, 101, calls(count=first - 1))  # the block is not over yet
    assert arrive(tracker, 1, due(START + 30.0)) is None
    tracker.observe(KEY, 1, 101, calls(first=first, count=ARRIVAL_BLOCK * 2))  # now it is: the cache forgets
    assert arrive(tracker, 1, due(START + 30.0)) is not None


def test_an_idle_pg_has_no_arrival() -> None:
    tracker = ArrivalTracker()
    tracker.observe(KEY, 0, 100, calls(count=20))  # the last call 9.5 s after START
    held = tracker.arrival(KEY, 0, due(START))
    assert held is not None
    # The last block, with its own stamp, stands in for ARRIVAL_HOLD grid periods (a late read must leave no
    # hole), then nothing.
    for k in range(1, ARRIVAL_HOLD + 1):
        assert tracker.arrival(KEY, 0, due(START + k * ARRIVAL_GRID)) == held
    assert tracker.arrival(KEY, 0, due(START + (ARRIVAL_HOLD + 1) * ARRIVAL_GRID)) is None


def _paused(late_rank: bool, at_seq: int, pause: float = 5.0) -> list[FrEntry]:
    """A job whose rank 1 pauses ``pause`` s before calling ``at_seq``: it calls that one late; its peers called
    it on time and wait it out, so every later call of every rank is ``pause`` late."""
    out = []
    for seq in range(1, 200):
        at = START + (seq - 1) * PERIOD + (pause if seq > at_seq else 0.0)
        if seq == at_seq and late_rank:
            at += pause
        out.append(call(seq, at))
    return out


@pytest.mark.parametrize("at_seq", [60, 61, 62, 63, 64, 65])
def test_a_pause_on_one_rank_is_skipped_alike_by_every_rank(at_seq: int) -> None:
    # Wherever the pause falls against the block boundaries, the block that holds the paused call is skipped by
    # every rank. Next to it one rank may skip a block its peers take (the long gap is before the paused rank's
    # late call, after its peers'): it then holds an earlier block, which the rule leaves out (more than half a
    # block away). No lateness is ever reported for the pause.
    tracker = ArrivalTracker()
    tracker.observe(KEY, 0, 100, _paused(False, at_seq))
    tracker.observe(KEY, 1, 101, _paused(True, at_seq))
    for offset in range(0, 60, 1):
        now = due(START + offset)
        a0, a1 = arrive(tracker, 0, now), arrive(tracker, 1, now)
        assert (a0 is None) == (a1 is None), offset
        if a0 is not None and a1 is not None:
            assert abs(a1 - a0) < 1e-6 or abs(a1 - a0) > ARRIVAL_BLOCK * PERIOD / 2, (offset, a1 - a0)


def test_a_straggler_s_steady_gaps_are_no_pause() -> None:
    tracker = ArrivalTracker()
    slow = [call(seq, START + (seq - 1) * PERIOD * (1.3 if seq > 60 else 1.0) + (0.15 if seq > 60 else 0.0)
                 + (60 * PERIOD * -0.3 if seq > 60 else 0.0)) for seq in range(1, 200)]
    tracker.observe(KEY, 1, 101, slow)
    assert all(arrive(tracker, 1, due(START + offset)) is not None for offset in range(0, 60, 5))


def test_p2p_and_coalesced_calls() -> None:
    tracker = ArrivalTracker()
    entries = calls()
    p2p = [call(1000 + i, START + 31.0 + i, p2p=True) for i in range(5)]
    coalesced = [replace(e, record_id=e.record_id + 10_000, time_created_ns=e.time_created_ns + 10**8)
                 for e in entries]  # a second entry of each seq, later: the first is when the rank called
    tracker.observe(KEY, 0, 100, entries + p2p + coalesced)
    other = ArrivalTracker()
    other.observe(KEY, 0, 100, entries)
    assert tracker.arrival(KEY, 0, due(START + 30.0)) == other.arrival(KEY, 0, due(START + 30.0))


def test_a_restart_starts_over() -> None:
    tracker = ArrivalTracker()
    tracker.observe(KEY, 0, 100, calls())
    tracker.observe(KEY, 0, 200, calls(count=5))  # a new incarnation: seqs from 1 again
    assert arrive(tracker, 0, due(START + 30.0)) is None


def test_memory_is_bounded() -> None:
    tracker = ArrivalTracker(keep=64)
    tracker.observe(KEY, 0, 100, calls(count=1000))
    assert arrive(tracker, 0, due(START + 490.0)) is not None
    assert len(tracker._ranks[(KEY, 0)].seqs) == 64
    # The calls around that instant are gone: the first one kept after it need not be the first one made.
    assert arrive(tracker, 0, due(START + 10.0)) is None


def test_a_clock_step_back_does_not_raise_or_mix_blocks() -> None:
    tracker = ArrivalTracker()
    entries = calls(count=60) + [call(seq, START + (seq - 1) * PERIOD - 5.0) for seq in range(61, 200)]
    tracker.observe(KEY, 0, 100, entries)
    for offset in range(0, 120, 5):
        value = arrive(tracker, 0, due(START + offset))
        assert value is None or START - 10 < value < START + 120


def test_the_rule_aligns_on_half_a_block_and_reads_one_grid_period_back() -> None:
    name = n.RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS
    rules = {r.get("record"): " ".join(r["expr"].split()) for r in shipped_rules()}
    lag = rules[f"job_id_pg_rank:{name}:lag"]
    assert f"{ARRIVAL_BLOCK / 2:g} / rate(job_id_pg_shard:frexporter_pg_last_enqueued_seq:min[5m])" in lag
    # Every read of the raw series is one grid period back: by then every node's sample of the instant is in.
    for expr in (lag, rules[f"job_id_pg_shard:{name}:median"]):
        reads = expr.count(name + " ") + expr.count(name + ")")
        assert expr.count(f"{name} offset {ARRIVAL_GRID:g}s") == reads > 0, expr


# ------------------------------------------------------------------ through the ranks source (fake ranks)

def _ring(late: float, now: float) -> list[dict[str, Any]]:
    ring = []
    for i in range(200):
        e = raw(i, i + 1)  # gloo: retired, never completed
        e["time_created_ns"] = round((now - 100.0 + i * PERIOD + late) * 1e9)
        ring.append(e)
    return ring


@pytest.mark.parametrize("on", [True, False])
def test_ranks_source_exports_gloo_arrivals_when_asked(node_factory: Callable[..., Node], on: bool) -> None:
    node = node_factory(2, collective_waits=on)
    now = node.now + 1.0  # poll() moves the clock one second on
    node.rings[0] = _ring(0.0, now)
    node.rings[1] = _ring(0.2, now)
    parsed = render(node.poll())
    a0 = sample(parsed, n.RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS, job_id="job", rank="0", pg="0")
    a1 = sample(parsed, n.RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS, job_id="job", rank="1", pg="0")
    if not on:
        assert a0 is None and a1 is None
        return
    assert a0 is not None and a1 is not None
    assert a1 - a0 == pytest.approx(0.2, abs=1e-6)
    assert sample(parsed, n.RANK_COLLECTIVE_WAIT_SECONDS, job_id="job", rank="0", pg="0") is None
