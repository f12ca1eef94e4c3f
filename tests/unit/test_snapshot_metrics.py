"""What the /metrics collector promises the shipped rules about in-flight starts.

The rules take ``frexporter_pg_oldest_inflight_start_timestamp_seconds`` alone as "this rank waits in a collective
of the PG", without joining the enqueued and completed seqs (the join cost a third of the collectives group at
8,192 ranks, docs/scale.md). That holds only while the collector writes an in-flight start exactly where the same
exposition shows the rank's enqueued seq beyond its completed one.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from frexporter import naming as n
from frexporter.model import RANK_DOWN, InflightCollective, NodeSnapshot, PGState
from frexporter.outputs.snapshot_metrics import SnapshotCollector
from tests.fakes.snapshot import fixed_snapshot, pg
from tests.harness import metrics

RECV = InflightCollective(seq=3, op="recv", created=1700000150.0, timeout_seconds=1800.0, input_sizes=((4,),),
                          input_dtypes=("Float",))
ALL_REDUCE = replace(RECV, seq=8, op="all_reduce", created=1700000100.5)


def _exposed(*states: PGState) -> dict[str, list[tuple[dict[str, str], float]]]:
    snap = fixed_snapshot()
    rank = replace(snap.ranks[0], pgs=states)
    registry = CollectorRegistry(auto_describe=False)
    node: NodeSnapshot = replace(snap, ranks=(rank,))
    registry.register(SnapshotCollector(lambda: node))
    return metrics(generate_latest(registry).decode())


def _starts(parsed: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, float]:
    return {labels["pg"]: value for labels, value in parsed.get(n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS, [])}


def test_a_collective_enqueued_and_not_completed_has_its_start() -> None:
    assert _starts(_exposed(pg("0", "default_pg", 8, 7, (ALL_REDUCE,)))) == {"0": ALL_REDUCE.created}


@pytest.mark.parametrize(("enqueued", "completed", "count"), [
    (42, 42, 0),  # a pipeline PG in a long recv: every collective it enqueued has completed
    (42, 42, 1),  # a count that disagrees with the seqs (a stale deep read): the seqs decide
    (41, 42, 0),  # completed ahead of enqueued (read at different instants)
    (43, 42, 0),  # the seqs say in flight, the count (an older read with p2p traffic) says not
])
def test_no_start_unless_the_same_exposition_shows_a_collective_in_flight(enqueued: int, completed: int,
                                                                           count: int) -> None:
    state = replace(pg("3", "pp", enqueued, completed, (RECV,)), inflight_count=count, exact=False, has_p2p=True)
    parsed = _exposed(state)
    assert _starts(parsed) == {}
    assert {labels["pg"] for labels, _ in parsed[n.PG_LAST_ENQUEUED_SEQ]} == {"3"}  # the PG is still exposed


def test_every_start_sits_beside_an_enqueued_seq_beyond_the_completed_one() -> None:
    states = [pg(str(i), "g", enq, done, inflight) for i, (enq, done, inflight) in enumerate([
        (8, 7, (ALL_REDUCE,)), (8, 8, (RECV,)), (9, 7, (ALL_REDUCE, RECV)), (5, 5, ()), (6, 4, ()),
    ])]
    parsed = _exposed(*states)
    enqueued = {labels["pg"]: value for labels, value in parsed[n.PG_LAST_ENQUEUED_SEQ]}
    completed = {labels["pg"]: value for labels, value in parsed[n.PG_LAST_COMPLETED_SEQ]}
    starts = _starts(parsed)
    assert set(starts) == {"0", "2"}
    assert all(enqueued[name] > completed[name] for name in starts)


# ---- The waits (frexporter_pg_wait_*): what the rules read to find stuck collectives, only for the waits that
# could be, so that a healthy job writes none.


def _waits(parsed: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, dict[str, float]]:
    """Per PG, the wait families' values (limits by their `limit`)."""
    out: dict[str, dict[str, float]] = {}
    for name in (n.PG_WAIT_START_TIMESTAMP_SECONDS, n.PG_WAIT_SEQ, n.PG_WAIT_GROUP_SIZE, n.PG_WAIT_LIMIT_SECONDS):
        for labels, value in parsed.get(name, []):
            out.setdefault(labels["pg"], {})[labels.get(n.L_LIMIT, name)] = value
    return out


def _at(now: float, *states: PGState, up: bool = True) -> dict[str, dict[str, float]]:
    snap = fixed_snapshot()
    rank = replace(snap.ranks[0], pgs=states)
    if not up:
        rank = replace(rank, status=RANK_DOWN)
    registry = CollectorRegistry(auto_describe=False)
    node: NodeSnapshot = replace(snap, ranks=(rank,), time=now)
    assert node.ranks[0].up is up
    registry.register(SnapshotCollector(lambda: node))
    return _waits(metrics(generate_latest(registry).decode()))


def test_a_wait_shows_once_it_has_lasted_half_the_stuck_threshold_with_its_seq_limits_and_group() -> None:
    state = pg("0", "default_pg", 8, 7, (ALL_REDUCE,))  # threshold 10 s, ceiling 60 s, timeout 1800 s
    assert _at(ALL_REDUCE.created + 4.9, state) == {}
    assert _at(ALL_REDUCE.created + 5.0, state) == {"0": {
        n.PG_WAIT_START_TIMESTAMP_SECONDS: ALL_REDUCE.created, n.PG_WAIT_SEQ: 8.0, n.PG_WAIT_GROUP_SIZE: 2.0,
        n.WAIT_LIMIT_STUCK: 10.0, n.WAIT_LIMIT_CEILING: 60.0, n.WAIT_LIMIT_TIMEOUT: 1800.0}}


def test_a_pg_without_a_learned_threshold_waits_half_its_ceiling_and_one_without_either_shows_none() -> None:
    state = replace(pg("0", "default_pg", 8, 7, (ALL_REDUCE,)), stuck_threshold_seconds=None)
    assert _at(ALL_REDUCE.created + 29.0, state) == {}
    assert set(_at(ALL_REDUCE.created + 30.0, state)["0"]) == {
        n.PG_WAIT_START_TIMESTAMP_SECONDS, n.PG_WAIT_SEQ, n.PG_WAIT_GROUP_SIZE, n.WAIT_LIMIT_CEILING,
        n.WAIT_LIMIT_TIMEOUT}
    assert _at(ALL_REDUCE.created + 1e6, replace(state, stuck_ceiling_seconds=None)) == {}


@pytest.mark.parametrize(("enqueued", "completed", "count"), [(42, 42, 0), (42, 42, 1), (43, 42, 0)])
def test_no_wait_where_no_collective_is_in_flight(enqueued: int, completed: int, count: int) -> None:
    state = replace(pg("0", "default_pg", enqueued, completed, (RECV,)), inflight_count=count, has_p2p=True)
    assert _at(RECV.created + 1e6, state) == {}


def test_a_rank_that_is_down_waits_in_nothing() -> None:
    # Its frozen in-flight entries prove nothing (FrexporterRankDown pages for it).
    assert _at(ALL_REDUCE.created + 100.0, pg("0", "default_pg", 8, 7, (ALL_REDUCE,)), up=False) == {}
