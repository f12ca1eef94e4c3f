"""Straggler signal: per-rank lateness from FR entries of local ranks, its gauge, and the straggler verdict.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_straggler.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from frexporter import naming as n
from frexporter.analysis import STRAGGLER, VerdictConfig, evaluate
from frexporter.fr.trace import FrEntry
from frexporter.model import RANK_DOWN, RANK_OK, InflightCollective, PGState, RankState
from frexporter.sources.collectives import LONE_PENDING, LatenessTracker
from tests.fakes.node import T0, Node, entry, raw, render
from tests.harness import sample
from tests.shared.straggler import only_straggler

KEY = ("job", "0", hash((0, 1, 2)), "fr")
MEMBERS = {0: 100, 1: 101, 2: 102}


def arrivals(seqs: range, late: dict[int, float], rank: int) -> list[FrEntry]:
    return [entry(seq, seq, created=T0 + seq + late.get(rank, 0.0)) for seq in seqs]


# ---------------------------------------------------------------- tracker


def test_lateness_is_measured_from_the_first_local_arrival_across_separate_reads() -> None:
    tracker = LatenessTracker()
    late = {1: 1.5, 2: 0.25}
    tracker.observe(KEY, MEMBERS, 0, arrivals(range(1, 31), late, 0))
    assert tracker.score(KEY, 0) == (None, 0)  # ranks 1 and 2 not read yet: nothing matched
    tracker.observe(KEY, MEMBERS, 1, arrivals(range(1, 31), late, 1))
    tracker.observe(KEY, MEMBERS, 2, arrivals(range(1, 21), late, 2))  # rank 2's read is behind
    assert tracker.score(KEY, 1) == (pytest.approx(1.5), 20)
    assert tracker.score(KEY, 2) == (pytest.approx(0.25), 20)
    assert tracker.score(KEY, 0) == (pytest.approx(0.0), 20)
    tracker.observe(KEY, MEMBERS, 2, arrivals(range(21, 31), late, 2))
    assert tracker.score(KEY, 1)[1] == 30


def test_score_leaves_out_the_slowest_tenth() -> None:
    tracker = LatenessTracker(window=100)
    members = {0: 100, 1: 101}
    key = ("job", "0", hash((0, 1)), "fr")
    tracker.observe(key, members, 0, arrivals(range(1, 101), {}, 0))
    # Rank 1 is 0.2 s late, except one 120 s checkpoint pause: that pause must not make it a straggler.
    ones = [entry(seq, seq, created=T0 + seq + (120.0 if seq == 50 else 0.2)) for seq in range(1, 101)]
    tracker.observe(key, members, 1, ones)
    assert tracker.score(key, 1) == (pytest.approx(0.2), 100)


def test_window_keeps_the_latest_collectives() -> None:
    tracker = LatenessTracker(window=10)
    key, members = ("job", "0", hash((0, 1)), "fr"), {0: 100, 1: 101}
    tracker.observe(key, members, 0, arrivals(range(1, 41), {}, 0))
    tracker.observe(key, members, 1, [entry(s, s, created=T0 + s + (5.0 if s <= 30 else 0.5)) for s in range(1, 41)])
    assert tracker.score(key, 1) == (pytest.approx(0.5), 10)


def test_entries_lost_to_ring_wrap_are_dropped_not_matched_later() -> None:
    tracker = LatenessTracker()
    key, members = ("job", "0", hash((0, 1)), "fr"), {0: 100, 1: 101}
    tracker.observe(key, members, 0, arrivals(range(1, 11), {}, 0))
    tracker.observe(key, members, 1, arrivals(range(6, 11), {1: 0.5}, 1))  # 1..5 wrapped out of rank 1's ring
    assert tracker.score(key, 1) == (pytest.approx(0.5), 5)
    assert not tracker._groups[key].pending


def test_a_restarted_member_starts_a_new_incarnation() -> None:
    tracker = LatenessTracker()
    key = ("job", "0", hash((0, 1)), "fr")
    tracker.observe(key, {0: 100, 1: 101}, 0, arrivals(range(1, 11), {}, 0))
    # Rank 1 restarted (new pid) and counts from 1 again, hours later: old and new seqs must not match.
    restarted = {0: 100, 1: 201}
    tracker.observe(key, restarted, 1, [entry(s, s, created=T0 + 7200 + s) for s in range(1, 11)])
    assert tracker.score(key, 1) == (None, 0)
    tracker.observe(key, restarted, 0, [entry(s, s, created=T0 + 7200 + s) for s in range(1, 11)])
    assert tracker.score(key, 1) == (pytest.approx(0.0), 10)


def test_spread_beyond_the_watchdog_timeout_is_not_lateness() -> None:
    tracker = LatenessTracker()
    key, members = ("job", "0", hash((0, 1)), "fr"), {0: 100, 1: 101}
    tracker.observe(key, members, 0, [entry(1, 1, created=T0, timeout_ms=10_000)])
    tracker.observe(key, members, 1, [entry(1, 1, created=T0 + 60, timeout_ms=10_000)])
    assert tracker.score(key, 1) == (None, 0)


def test_a_pg_with_one_local_rank_has_no_score_and_keeps_little() -> None:
    tracker = LatenessTracker()
    tracker.observe(KEY, {0: 100}, 0, arrivals(range(1, 2001), {}, 0))
    assert tracker.score(KEY, 0) == (None, 0)
    assert len(tracker._groups[KEY].pending) == LONE_PENDING


def test_p2p_entries_are_ignored() -> None:
    tracker = LatenessTracker()
    key, members = ("job", "0", hash((0, 1)), "fr"), {0: 100, 1: 101}
    tracker.observe(key, members, 0, [entry(1, 1, p2p=True, op="nccl:send 0->1")])
    tracker.observe(key, members, 1, [entry(1, 1, p2p=True, op="nccl:recv 1<-0", created=T0 + 5)])
    assert tracker.score(key, 1) == (None, 0)


# ---------------------------------------------------------------- through the ranks source


def test_ranks_source_exports_the_score_and_feeds_the_verdict(node_factory: Callable[..., Node]) -> None:
    node = node_factory(3)
    late = {1: 2.0, 2: 0.1}
    for r in (0, 1, 2):
        node.rings[r] = [raw(i, i + 1, created=T0 + 10 * i + late.get(r, 0.0)) for i in range(25)]
    snap = node.poll()
    scores = {r.rank: (r.pgs[0].lateness_seconds, r.pgs[0].lateness_samples) for r in snap.ranks}
    assert scores == {0: (pytest.approx(0.0), 25), 1: (pytest.approx(2.0), 25), 2: (pytest.approx(0.1), 25)}
    parsed = render(snap)
    assert sample(parsed, n.RANK_STRAGGLER_LATENESS_SECONDS, job_id="job", rank="1", pg="0",
                  pg_desc="default_pg") == pytest.approx(2.0)
    # The first name stays, with the same value on every series, for one release.
    for r in ("0", "1", "2"):
        labels = {"job_id": "job", "rank": r, "pg": "0", "pg_desc": "default_pg"}
        value = sample(parsed, n.RANK_STRAGGLER_LATENESS_SECONDS, **labels)
        assert value is not None and sample(parsed, n.RANK_STRAGGLER_SCORE_DEPRECATED, **labels) == value
    v = only_straggler(snap.verdicts)
    assert (v.ranks, v.waiting_ranks, v.pg, v.seq, v.op) == ((1,), (0, 2), "0", -1, "")
    assert "Rank 1 (host node-a, pid 100001) is a straggler on PG 'default_pg' (0)" in v.summary
    assert "2.0s after the first local rank" in v.summary and "ranks 0,2 wait for it every time" in v.summary
    assert v.details["lateness_seconds"]["1"] == pytest.approx(2.0)


# ---------------------------------------------------------------- engine

NOW = 1_800_000_000.0


def scored(r: int, lateness: float | None, samples: int = 200, status: str = RANK_OK,
           ranks: tuple[int, ...] = (0, 1, 2, 3)) -> RankState:
    pg = PGState(name="0", desc="default_pg", ranks=ranks, backend="nccl", last_enqueued=500, last_started=-1,
                 last_completed=500, inflight=(), inflight_count=0, timeout_seconds=600.0,
                 last_progress=NOW - 1, exact=True, has_p2p=False, lateness_seconds=lateness,
                 lateness_samples=samples if lateness is not None else 0)
    return RankState(job_id="job", rank=r, local_rank=r, world_size=len(ranks), hostname="node-a", pid=1000 + r,
                     torch_version="2.13", gpu_uuid=f"GPU-{r}", status=status, heartbeat=NOW - 1, heartbeat_age=1.0,
                     socket_alive=True, pgs=(pg,))


def test_straggler_verdict_names_the_late_rank() -> None:
    v = only_straggler(evaluate([scored(0, 0.0), scored(1, 0.05), scored(2, 3.2), scored(3, 0.1)], NOW))
    assert v.ranks == (2,) and v.waiting_ranks == (0, 1, 3)
    assert v.timeout_seconds == 600.0 and v.since is None and v.budget_used is None
    assert "over the last 200 collectives it enqueued each 3.2s after the first local rank" in v.summary
    assert v.details["threshold_seconds"] == pytest.approx(1.0)
    assert v.to_json()["kind"] == STRAGGLER


@pytest.mark.parametrize(("scores", "why"), [
    ((0.0, 0.05, 0.9, 0.1), "below the 1 s floor"),
    ((0.0, 1.0, 2.5, 1.2), "everybody is late: 2.5 s is not 3x the peers' 1.0 s median"),
])
def test_no_straggler_within_the_noise(scores: tuple[float, ...], why: str) -> None:
    assert evaluate([scored(r, s) for r, s in enumerate(scores)], NOW) == (), why


def test_too_few_samples_is_no_verdict_yet() -> None:
    assert evaluate([scored(0, 0.0, samples=19), scored(1, 5.0, samples=19)], NOW) == ()
    assert only_straggler(evaluate([scored(0, 0.0, samples=20), scored(1, 5.0, samples=20)], NOW)).ranks == (1,)


def test_thresholds_are_configurable() -> None:
    ranks = [scored(0, 0.0, samples=10), scored(1, 0.2, samples=10)]
    assert evaluate(ranks, NOW) == ()
    config = VerdictConfig(straggler_min_lateness=0.1, straggler_min_samples=10)
    assert only_straggler(evaluate(ranks, NOW, config)).ranks == (1,)


def test_a_down_rank_is_not_called_a_straggler() -> None:
    verdicts = evaluate([scored(0, 0.0), scored(1, 4.0, status=RANK_DOWN)], NOW)
    assert [v.kind for v in verdicts] == ["rank_down"]


def test_a_hang_on_the_pg_supersedes_the_straggler() -> None:
    stuck = InflightCollective(seq=501, op="all_reduce", created=NOW - 120, timeout_seconds=600.0)
    waiter, late = scored(0, 0.0, ranks=(0, 1)), scored(1, 4.0, ranks=(0, 1))
    waiter = replace(waiter, pgs=(replace(waiter.pgs[0], last_enqueued=501, inflight=(stuck,), inflight_count=1),))
    assert [(v.kind, v.ranks) for v in evaluate([waiter, late], NOW)] == [("missing_rank", (1,))]


def test_a_peer_known_late_is_still_matched_with_what_came_before() -> None:
    tracker = LatenessTracker()
    key = ("job", "0", hash((0, 1)), "fr")
    # Rank 1's manifest did not list the PG yet when rank 0 was read.
    tracker.observe(key, {0: 100}, 0, arrivals(range(1, 11), {}, 0))
    tracker.observe(key, {0: 100, 1: 101}, 1, arrivals(range(1, 11), {1: 0.5}, 1))
    assert tracker.score(key, 1) == (pytest.approx(0.5), 10)
