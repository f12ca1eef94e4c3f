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
from frexporter.model import InflightCollective, NodeSnapshot, PGState
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
