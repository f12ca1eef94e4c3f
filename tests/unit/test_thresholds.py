"""Adaptive stuck thresholds: the pure math, and what the ranks source learns from a job (issue 15)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from frexporter import defaults, spool
from frexporter.analysis import VerdictConfig, evaluate, make_analyzer
from frexporter.analysis.findings import FindingsConfig, waits_in_progress
from frexporter.analysis.kinds import MISSING_RANK
from frexporter.exporter import Exporter
from frexporter.model import ACTIVITY_BUSY, ACTIVITY_IDLE, BUSY_HOLD_SECONDS, Activity, NodeSnapshot, RankState
from frexporter.outputs.api import status_html, status_json
from frexporter.sources.ranks import RanksConfig, RanksSource
from frexporter.sources.thresholds import ThresholdConfig, ThresholdLearner, quantile, stuck_threshold
from tests import spoolgen
from tests.fakes.node import Node, raw
from tests.fakes.rank_states import NODE, NOW, tp_missing_rank_3

CONFIG = ThresholdConfig(ceiling=60.0, floor=10.0, multiple=3.0, quantile=0.99, min_samples=20)


def test_cold_start_is_the_ceiling() -> None:
    assert stuck_threshold([], CONFIG) == 60.0
    assert stuck_threshold([0.1] * 19, CONFIG) == 60.0


def test_a_single_sample_never_goes_below_the_floor() -> None:
    one = ThresholdConfig(ceiling=60.0, floor=10.0, multiple=3.0, min_samples=1)
    assert stuck_threshold([0.001], one) == 10.0
    assert stuck_threshold([0.0], one) == 10.0
    assert stuck_threshold([100.0], one) == 60.0


def test_steady_job_gets_the_floor_and_pauses_raise_it_up_to_the_ceiling() -> None:
    steady = [0.1] * 200
    assert stuck_threshold(steady, CONFIG) == 10.0
    # Rank 0 evaluates for 8 s every 20 collectives: 5 % of the gaps, above the 1 % the quantile ignores.
    paused = ([1.0] * 19 + [8.0]) * 10
    assert stuck_threshold(paused, CONFIG) == 24.0
    assert stuck_threshold(([1.0] * 19 + [30.0]) * 10, CONFIG) == 60.0


def test_bad_samples_and_a_ceiling_below_the_floor() -> None:
    assert stuck_threshold([math.nan, -5.0, math.inf] * 10, CONFIG) == 60.0
    low = ThresholdConfig(ceiling=4.0, floor=10.0, min_samples=1)
    assert stuck_threshold([0.1], low) == 4.0  # the user's --stuck-after below the floor wins
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([3.0, 1.0, 2.0], 1.0) == 3.0


def test_learner_forgets_a_destroyed_pg() -> None:
    learner = ThresholdLearner(ThresholdConfig(min_samples=1))
    for _ in range(5):
        learner.observe(("job", "1"), 0.5)
        learner.observe(("job", "2"), 0.5)
    learner.observe(("job", "1"), -1.0)  # a counter reset is not a sample
    assert learner.samples(("job", "1")) == 5
    assert learner.threshold(("job", "1")) == defaults.STUCK_FLOOR
    learner.retain([("job", "2")])
    assert learner.samples(("job", "1")) == 0
    assert learner.threshold(("job", "1")) == defaults.STUCK_AFTER  # created again: a cold start
    assert learner.threshold(("job", "2")) == defaults.STUCK_FLOOR


def _threshold(snap: NodeSnapshot, rank: int = 0) -> float | None:
    r = next(r for r in snap.ranks if r.rank == rank)
    return next(p for p in r.pgs if p.name == "0").stuck_threshold_seconds


def _poll(node: Node) -> NodeSnapshot:
    """Node.poll, with each rank's pg_status as its ring says (enqueued and completed apart)."""
    node.now += 1.0
    node.counter += 1
    for r in node.rings:
        status = {k: str(v) for k, v in node.dump(r)["pg_status"]["0"].items()}
        snap = spoolgen.snapshot(node.pids[r], counter=node.counter, when=node.now, status={"fr": {"0": status}})
        spool.write_json_atomic(str(node.dir / (spool.rank_stem("job", r) + spool.SNAPSHOT_SUFFIX)), snap)
    return node.exporter.poll_once()


def _steady(node: Node, polls: int, seq: int, step: Callable[[], None] | None = None) -> tuple[NodeSnapshot, int]:
    """Both ranks complete one more collective per poll."""
    snap = None
    for _ in range(polls):
        seq += 1
        for r in node.rings:
            node.rings[r].append(raw(seq, seq, created=node.now))
        if step is not None:
            step()
        snap = _poll(node)
    assert snap is not None
    return snap, seq


def test_steady_job_is_named_after_the_floor_not_the_ceiling(node_factory) -> None:
    node = node_factory(2)
    snap = _poll(node)
    assert _threshold(snap) == defaults.STUCK_AFTER  # cold start
    snap, seq = _steady(node, defaults.STUCK_MIN_SAMPLES + 5, 0)
    assert _threshold(snap) == defaults.STUCK_FLOOR
    # Rank 0 enters the next all_reduce, rank 1 never does: a verdict once the floor has passed, not at 60 s.
    node.rings[0].append(raw(seq + 1, seq + 1, created=node.now, retired=False))
    hung_at = node.now
    snap = _poll(node)
    # Below the threshold: no verdict yet, and every view shows the wait against its threshold.
    assert snap.verdicts == ()
    status = status_json(snap)
    group = next(g for g in status["process_groups"] if g["pg"] == "0")
    assert group["stuck_threshold_seconds"] == defaults.STUCK_FLOOR and group["wait_seconds"] >= 1.0
    rank0 = next(r for r in status["ranks"] if r["rank"] == 0)
    pg0 = next(p for p in rank0["process_groups"] if p["pg"] == "0")
    assert pg0["wait_seconds"] >= 1.0 and pg0["stuck_threshold_seconds"] == defaults.STUCK_FLOOR
    assert "(threshold 10s)" in status_html(snap)
    while node.now - hung_at < defaults.STUCK_FLOOR + 2 * 1.0:
        snap = _poll(node)
        if any(v.kind == MISSING_RANK for v in snap.verdicts):
            break
    missing = [v for v in snap.verdicts if v.kind == MISSING_RANK]
    assert missing and missing[0].ranks == (1,)
    assert node.now - hung_at >= defaults.STUCK_FLOOR  # and not before


def test_rank_restart_is_not_learned_as_a_pause(node_factory) -> None:
    node = node_factory(2)
    _steady(node, defaults.STUCK_MIN_SAMPLES + 5, 0)
    for _ in range(40):  # the job stops (rank 0 restarts, say): no progress, nothing in flight
        _poll(node)
    for r in node.rings:  # and comes back with its counters from the start
        node.rings[r] = [raw(1, 1, created=node.now)]
    snap, _ = _steady(node, 5, 1)
    assert _threshold(snap) == defaults.STUCK_FLOOR  # the 40 s across the restart was not a sample


def test_wall_clock_jumps_are_not_learned(tmp_path: Path) -> None:
    node = Node(tmp_path / "n", 2)
    mono = [5000.0]
    node.source.close()
    node.source = RanksSource(RanksConfig(str(node.dir), poll_interval=1.0, rank_timeout=2.0, deep_interval=0.0),
                              clock=lambda: node.now, monotonic=lambda: mono[0])
    node.exporter = Exporter([(node.source, 1.0)], clock=lambda: node.now, monotonic=lambda: mono[0],
                             hostname="node-a", analyzer=make_analyzer(VerdictConfig()))
    polls = [0]

    def step() -> None:
        mono[0] += 1.0
        polls[0] += 1
        if polls[0] == 10:
            node.now += 3600.0  # NTP steps the wall clock an hour forward
        if polls[0] == 20:
            node.now -= 1800.0  # and back
    try:
        snap, _ = _steady(node, defaults.STUCK_MIN_SAMPLES + 10, 0, step)
        assert _threshold(snap) == defaults.STUCK_FLOOR
        assert snap.verdicts == ()
    finally:
        node.close()


def test_history_goes_with_the_ranks(node_factory) -> None:
    node = node_factory(2)
    _steady(node, defaults.STUCK_MIN_SAMPLES + 5, 0)
    assert node.source._thresholds.samples(("job", "0")) > 0
    for name in os.listdir(node.dir):
        if name.endswith(spool.MANIFEST_SUFFIX):
            os.unlink(node.dir / name)
    _poll(node)
    assert node.source._thresholds.samples(("job", "0")) == 0


def test_verdict_uses_the_shortest_learned_threshold_capped_by_stuck_after() -> None:
    def learned(thresholds: dict[int, float], age: float) -> list[RankState]:
        ranks = tp_missing_rank_3(age=age)
        return [replace(r, pgs=tuple(replace(p, stuck_threshold_seconds=thresholds.get(r.rank)) for p in r.pgs))
                for r in ranks]

    # Ranks 0-2 wait 15 s for rank 3: stuck where a rank's source learned 10 s, not with none learned.
    assert [v.ranks for v in evaluate(learned({0: 10.0, 1: 25.0}, 15.0), NOW, NODE)] == [(3,)]
    assert evaluate(learned({}, 15.0), NOW, NODE) == ()
    assert evaluate(learned({0: 20.0}, 15.0), NOW, NODE) == ()
    # A learned threshold above --stuck-after never delays the verdict past it.
    assert [v.ranks for v in evaluate(learned({0: 600.0}, 61.0), NOW, NODE)] == [(3,)]
    # Activity decides patience: a culprit busy computing gets --stuck-after, an idle one the learned threshold.
    def doing(state: str, age: float) -> list[RankState]:
        return [replace(r, activity=Activity(state=state)) if r.rank == 3 else r for r in learned({0: 10.0}, age)]

    assert evaluate(doing(ACTIVITY_BUSY, 15.0), NOW, NODE) == ()
    assert [v.ranks for v in evaluate(doing(ACTIVITY_BUSY, 61.0), NOW, NODE)] == [(3,)]
    assert [v.ranks for v in evaluate(doing(ACTIVITY_IDLE, 15.0), NOW, NODE)] == [(3,)]

    # Idle now but busy within BUSY_HOLD_SECONDS (CPU use at the busy line): still the busy patience, as in
    # FrexporterCollectiveDesync; once the hold has passed, the learned threshold.
    def flipped(last_busy_ago: float, age: float) -> list[RankState]:
        act = Activity(state=ACTIVITY_IDLE, last_busy=NOW - last_busy_ago)
        return [replace(r, activity=act) if r.rank == 3 else r for r in learned({0: 10.0}, age)]

    assert evaluate(flipped(BUSY_HOLD_SECONDS - 1, 15.0), NOW, NODE) == ()
    assert [v.ranks for v in evaluate(flipped(BUSY_HOLD_SECONDS + 1, 15.0), NOW, NODE)] == [(3,)]
    # Below the threshold the wait is shown with it.
    waits = waits_in_progress(learned({0: 20.0}, 15.0), NOW, FindingsConfig(NODE.stuck_after, False))
    assert [(w.waiting, w.blockers, w.threshold_seconds, round(w.waited_seconds or 0)) for w in waits] == [
        ((0, 1, 2), (3,), 20.0, 15)]
