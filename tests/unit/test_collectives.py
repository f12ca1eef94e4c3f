"""Collective durations and bytes: each FR entry counted once across deep reads, ring wrap and restarts."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from frexporter import naming as n
from frexporter import spool
from frexporter.fr.trace import FrEntry
from frexporter.model import DURATION_BUCKETS
from frexporter.sources.collectives import (
    MAX_OPS_PER_PG,
    OTHER_OP,
    CollectiveAccumulator,
    EntryCursor,
    entry_bytes,
    op_label,
)
from tests.fakes.node import T0, Node, entry, raw, render
from tests.harness import sample

# ---------------------------------------------------------------- bytes and labels


@pytest.mark.parametrize(("sizes", "dtypes", "expected"), [
    ([[4, 3]], ["Float"], 48),
    ([[1024]], ["BFloat16"], 2048),
    ([[1024]], ["Half"], 2048),
    ([[8]], ["Double"], 64),
    ([[8]], ["Long"], 64),
    ([[8]], ["Int"], 32),
    ([[8]], ["Byte"], 8),
    ([[8]], ["Char"], 8),
    ([[8]], ["Bool"], 8),
    ([[8]], ["Float8_e4m3fn"], 8),
    ([[2, 2], [3]], ["Float", "Half"], 16 + 6),
    ([[2], [3]], ["Float"], 20),  # one dtype listed for several inputs: it stands for all
    ([], ["Float"], 0),  # barrier: nothing moved
    ([[0, 5]], ["Float"], 0),
])
def test_input_bytes_from_sizes_and_dtypes(sizes: list[list[int]], dtypes: list[str], expected: int) -> None:
    assert entry_bytes(entry(0, 1, sizes=sizes, dtypes=dtypes)) == expected


def test_unknown_dtype_gives_no_bytes_rather_than_a_wrong_count() -> None:
    assert entry_bytes(entry(0, 1, dtypes=["QUInt4x2"])) is None
    assert entry_bytes(entry(0, 1, dtypes=["Float4_e2m1fn_x2"])) is None


def test_p2p_op_label_drops_the_peers() -> None:
    assert op_label(entry(0, 1, op="nccl:send 1->0", p2p=True)) == "send"
    assert op_label(entry(0, 1, op="nccl:recv 0<-1", p2p=True)) == "recv"
    assert op_label(entry(0, 1, op="nccl:_broadcast_oop")) == "_broadcast_oop"
    assert op_label(entry(0, 1, op="gloo:all_reduce")) == "all_reduce"


# ---------------------------------------------------------------- cursor


def ids(entries: list[FrEntry]) -> list[int]:
    return [e.record_id for e in entries]


def test_gloo_entries_count_once_across_reads_and_in_flight_ones_when_they_retire() -> None:
    cursor = EntryCursor(nccl=False)
    first = [entry(0, 1), entry(1, 2), entry(2, 3, retired=False)]
    settled, fresh, missed = cursor.take(first)
    assert (ids(settled), ids(fresh), missed) == ([0, 1], [0, 1, 2], 0)
    # The same ring again, the in-flight one now retired, one more behind it.
    settled, fresh, missed = cursor.take([entry(0, 1), entry(1, 2), entry(2, 3), entry(3, 4)])
    assert (ids(settled), ids(fresh), missed) == ([2, 3], [3], 0)
    assert cursor.take([entry(0, 1), entry(1, 2), entry(2, 3), entry(3, 4)])[:2] == ([], [])


def test_ring_wrap_between_reads_is_counted_as_missed_not_double_counted() -> None:
    cursor = EntryCursor(nccl=False)
    # The first read starts mid-history: what wrapped out before we watched is not "missed".
    assert cursor.take([entry(i, i + 1) for i in range(100, 110)])[2] == 0
    settled, _, missed = cursor.take([entry(i, i + 1) for i in range(115, 125)])  # 110..114 never seen
    assert (ids(settled), missed) == (list(range(115, 125)), 5)


def test_out_of_order_completion_across_pgs_counts_each_entry_once() -> None:
    cursor = EntryCursor(nccl=True)
    done = {"retired": True, "state": "completed"}
    ring = [entry(0, 1, pg=("0", "a"), retired=False), entry(1, 1, pg=("1", "b"), **done)]
    assert ids(cursor.take(ring)[0]) == [1]
    ring = [entry(0, 1, pg=("0", "a"), **done), entry(1, 1, pg=("1", "b"), **done), entry(2, 2, pg=("1", "b"), **done)]
    assert ids(cursor.take(ring)[0]) == [0, 2]
    assert cursor.take(ring)[0] == []
    assert cursor.upto == 2 and not cursor.above


NCCL_OP = "nccl:all_reduce"  # stock ProcessGroupNCCL's entries, as it names them


def test_nccl_waits_for_retirement_and_skips_timed_out_entries() -> None:
    cursor = EntryCursor(nccl=True)
    # Completed but not retired: the watchdog has not written the duration yet.
    assert cursor.take([entry(0, 1, op=NCCL_OP, retired=False, state="completed")])[0] == []
    # Retired without completing: timed out or aborted, it moved no bytes.
    settled, _, _ = cursor.take([entry(0, 1, op=NCCL_OP, state="completed", duration=2.5),
                                 entry(1, 2, op=NCCL_OP, state="scheduled")])
    assert ids(settled) == [0] and settled[0].duration_ms == 2.5
    assert cursor.upto == 1


def test_nccl_with_timing_gives_the_duration_one_more_read() -> None:
    cursor = EntryCursor(nccl=True)
    timed = {"state": "completed", "started_ns": int(T0 * 1e9)}
    assert cursor.take([entry(0, 1, op=NCCL_OP, **timed)])[0] == []  # retired, duration not written yet
    settled = cursor.take([entry(0, 1, op=NCCL_OP, duration=1.25, **timed)])[0]
    assert [e.duration_ms for e in settled] == [1.25]
    # A duration that never comes (overwritten, or cudaEventElapsedTime failed): counted without one.
    assert cursor.take([entry(0, 1, op=NCCL_OP, duration=1.25, **timed), entry(1, 2, op=NCCL_OP, **timed)])[0] == []
    assert [e.duration_ms for e in cursor.take([entry(1, 2, op=NCCL_OP, **timed)])[0]] == [None]


def test_recorder_reset_starts_counting_again() -> None:
    cursor = EntryCursor(nccl=False)
    cursor.take([entry(i, i + 1) for i in range(50)])
    settled, _, missed = cursor.take([entry(0, 1), entry(1, 2)])  # ids went backwards: reset_all()
    assert (ids(settled), missed) == ([0, 1], 0)


# ---------------------------------------------------------------- accumulator


def test_durations_land_in_their_buckets_and_ranks_sum_per_node() -> None:
    acc = CollectiveAccumulator()
    for rank, ms in ((0, 0.05), (1, 0.3), (0, 3.0), (1, 700_000.0)):
        acc.add("job", rank, "default_pg", entry(0, 1, op="nccl:all_reduce", duration=ms, dtypes=["BFloat16"],
                                                sizes=[[1024]]))
    acc.add("job", 0, "default_pg", entry(0, 1))  # gloo: bytes only
    stats = {s.op: s for s in acc.snapshot()}
    ar = stats["all_reduce"]
    assert ar.rank is None and ar.duration_count == 4 and ar.bytes == 4 * 2048 + 48
    assert ar.duration_sum == pytest.approx((0.05 + 0.3 + 3.0 + 700_000.0) / 1000)
    le = dict(zip(DURATION_BUCKETS, ar.bucket_counts, strict=True))
    assert (le[0.0001], le[0.0005], le[0.001], le[0.005], le[600.0]) == (1, 2, 2, 3, 3)  # 700 s is only in +Inf


def test_per_rank_mode_keys_by_rank() -> None:
    acc = CollectiveAccumulator(per_rank=True)
    acc.add("job", 0, "d", entry(0, 1))
    acc.add("job", 1, "d", entry(0, 1))
    assert [(s.rank, s.bytes) for s in acc.snapshot()] == [(0, 48), (1, 48)]


def test_op_labels_are_capped_per_pg() -> None:
    acc = CollectiveAccumulator()
    for i in range(MAX_OPS_PER_PG + 5):
        acc.add("job", 0, "d", entry(0, 1, op=f"nccl:op{i}"))
    ops = {s.op for s in acc.snapshot()}
    assert len(ops) == MAX_OPS_PER_PG + 1 and OTHER_OP in ops


def test_finished_jobs_are_forgotten() -> None:
    acc = CollectiveAccumulator()
    acc.add("old", 0, "d", entry(0, 1))
    acc.add("new", 0, "d", entry(0, 1))
    acc.forget_jobs({"new"})
    assert {s.job_id for s in acc.snapshot()} == {"new"}


# ---------------------------------------------------------------- through the ranks source


def test_ranks_source_counts_each_entry_once_per_node(node_factory: Callable[..., Node]) -> None:
    node = node_factory(2)
    for r in (0, 1):
        node.rings[r] = [raw(i, i + 1) for i in range(3)]
    snap = node.poll()
    assert [(c.op, c.rank, c.bytes) for c in snap.collectives] == [("all_reduce", None, 2 * 3 * 48)]
    for _ in range(3):  # the same rings read again: nothing new
        snap = node.poll()
    assert snap.collectives[0].bytes == 2 * 3 * 48
    for r in (0, 1):
        node.rings[r].append(raw(3, 4, sizes=[[256]], dtypes=["Half"]))
    snap = node.poll()
    assert snap.collectives[0].bytes == 2 * (3 * 48 + 512)
    parsed = render(snap)
    assert sample(parsed, n.COLLECTIVE_BYTES_TOTAL, job_id="job", pg="0", pg_desc="default_pg",
                  op="all_reduce") == 2 * (3 * 48 + 512)
    assert "rank" not in parsed[n.COLLECTIVE_BYTES_TOTAL][0][0]
    assert n.COLLECTIVE_DURATION_SECONDS + "_count" not in parsed  # gloo: no durations, no histogram series


def test_restarted_rank_is_a_new_track_and_the_node_counter_stays_monotonic(node_factory: Callable[..., Node]) -> None:
    node = node_factory(2)
    for r in (0, 1):
        node.rings[r] = [raw(i, i + 1) for i in range(5)]
    before = node.poll().collectives[0].bytes
    # Rank 1 restarts: new pid, its recorder's ids start again at 0.
    node.pids[1] += 1
    node.workers.pop().close()
    (node.dir / spool.socket_name(spool.rank_stem("job", 1))).unlink()
    node.start_rank(1)
    node.rings[1] = [raw(0, 1), raw(1, 2)]
    after = node.poll().collectives[0].bytes
    assert after == before + 2 * 48


def test_per_rank_durations_add_the_rank_label(node_factory: Callable[..., Node]) -> None:
    node = node_factory(2, per_rank_durations=True)
    for r in (0, 1):
        node.rings[r] = [raw(i, i + 1, op="nccl:all_reduce", duration=2.0 + r) for i in range(4)]
    snap = node.poll()
    parsed = render(snap)
    for r in (0, 1):
        assert sample(parsed, n.COLLECTIVE_DURATION_SECONDS + "_count", rank=str(r), op="all_reduce") == 4
        duration_sum = sample(parsed, n.COLLECTIVE_DURATION_SECONDS + "_sum", rank=str(r))
        assert duration_sum == pytest.approx(4 * (2.0 + r) / 1000)
        assert sample(parsed, n.COLLECTIVE_DURATION_SECONDS + "_bucket", rank=str(r), le="0.005") == 4
        assert sample(parsed, n.COLLECTIVE_DURATION_SECONDS + "_bucket", rank=str(r), le="0.001") == 0
