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


# ---- The idle ranks (frexporter_pg_idle_seq): the desync's candidate culprits, only where a rank has stopped in a
# PG, and at most IDLE_CANDIDATES_PER_NODE per node and PG, so that a job whose PGs all run writes none.

DONE_AT = 1700000000.0  # the fakes' last progress: when each PG's completed seq last advanced


def _idle_at(now: float, *ranks: tuple[int, tuple[PGState, ...]], up: bool = True) -> dict[tuple[str, str], float]:
    """(pg, rank) -> the idle seq written, for ranks of the fixed snapshot's first rank's shape."""
    snap = fixed_snapshot()
    states = tuple(replace(snap.ranks[0], rank=r, local_rank=r, pgs=pgs,
                           status=snap.ranks[0].status if up else RANK_DOWN) for r, pgs in ranks)
    registry = CollectorRegistry(auto_describe=False)
    node: NodeSnapshot = replace(snap, ranks=states, time=now)
    registry.register(SnapshotCollector(lambda: node))
    parsed = metrics(generate_latest(registry).decode())
    out = {}
    for labels, value in parsed.get(n.PG_IDLE_SEQ, []):
        assert labels[n.L_HOSTNAME] == "node-a"  # the candidate's host travels with it to the alert
        out[(labels["pg"], labels["rank"])] = value
    return out


def test_a_rank_is_idle_once_its_completed_seq_stood_half_the_stuck_threshold_with_nothing_in_flight() -> None:
    stopped = pg("0", "default_pg", 7, 7)  # threshold 10 s
    assert _idle_at(DONE_AT + 4.9, (0, (stopped,))) == {}
    assert _idle_at(DONE_AT + 5.0, (0, (stopped,))) == {("0", "0"): 7.0}
    # A PG without a learned threshold counts half its ceiling; one without either writes none.
    ceiling_only = replace(stopped, stuck_threshold_seconds=None)
    assert _idle_at(DONE_AT + 29.0, (0, (ceiling_only,))) == {}
    assert _idle_at(DONE_AT + 30.0, (0, (ceiling_only,))) == {("0", "0"): 7.0}
    assert _idle_at(DONE_AT + 1e6, (0, (replace(ceiling_only, stuck_ceiling_seconds=None),))) == {}


def test_a_rank_waiting_in_a_collective_of_the_pg_is_not_idle_in_it_and_one_that_never_progressed_is() -> None:
    assert _idle_at(DONE_AT + 1e6, (0, (pg("0", "default_pg", 8, 7, (ALL_REDUCE,)),))) == {}
    # A p2p op in flight is no collective: the rank is idle in the collective domain.
    p2p = replace(pg("0", "default_pg", 42, 42, (RECV,)), inflight_count=1, has_p2p=True)
    assert _idle_at(DONE_AT + 1e6, (0, (p2p,))) == {("0", "0"): 42.0}
    # Never completed anything: idle from the start (a culprit that never joined the PG's first collective).
    assert _idle_at(DONE_AT, (0, (pg("0", "default_pg", 0, 0, progress=None),))) == {("0", "0"): 0.0}


def test_a_rank_that_is_down_is_idle_where_it_stopped() -> None:
    assert _idle_at(DONE_AT + 100.0, (0, (pg("0", "default_pg", 7, 7),)), up=False) == {("0", "0"): 7.0}


def test_per_node_and_pg_only_the_lowest_seqs_are_written() -> None:
    # Four local ranks of one PG, idle at seqs 9, 7, 7 and 8: the two lowest (ties by rank); a rank of the PG still
    # running (in flight) is no candidate, however low its seq.
    ranks = [(r, (pg("0", "default_pg", seq, seq),)) for r, seq in ((0, 9), (1, 7), (2, 7), (3, 8))]
    running = (4, (pg("0", "default_pg", 6, 5, (ALL_REDUCE,)),))
    assert _idle_at(DONE_AT + 60.0, *ranks, running) == {("0", "1"): 7.0, ("0", "2"): 7.0}
