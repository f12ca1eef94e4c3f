"""A restarted exporter relearns each PG's stuck threshold from its ranks' Flight Recorder rings in one deep read
(issue 25, item 6): the replay of a ring, the learner's seed, and a restart in the middle of a hang on fake ranks.

The same on a real gloo job: tests/e2e/test_restart_thresholds.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from frexporter import defaults, spool
from frexporter.analysis import make_analyzer
from frexporter.analysis.kinds import MISSING_RANK
from frexporter.exporter import Exporter
from frexporter.fr.trace import FrEntry, parse_entry
from frexporter.model import NodeSnapshot
from frexporter.sources.ranks import RanksConfig, RanksSource
from frexporter.sources.thresholds import ThresholdConfig, ThresholdLearner, history_samples, stuck_threshold
from tests import spoolgen
from tests.fakes.node import T0, Node, entry, raw

CONFIG = ThresholdConfig(ceiling=60.0, floor=10.0, multiple=3.0, quantile=0.99, min_samples=20)


def nccl(rid: int, seq: int, created: float, completed: float | None, **kw: Any) -> FrEntry:
    """A stock NCCL entry, completed at ``completed`` by its watchdog's clock (None: still in flight)."""
    doc = raw(rid, seq, op="nccl:all_reduce", created=created, retired=completed is not None,
              state="completed" if completed is not None else "scheduled", **kw)
    doc["time_discovered_completed_ns"] = int(completed * 1e9) if completed is not None else 0
    return parse_entry(doc)


# ---------------------------------------------------------------- the replay of one ring (pure)


def test_a_steady_ring_replays_as_the_live_learner_polls_it() -> None:
    # A collective every 100 ms for 6 s, read by an exporter polling every 0.2 s: one sample per replayed poll
    # (never one per collective), each a poll's gap or the age of a collective it saw complete.
    ring = [entry(i, i, created=T0 + 0.1 * i) for i in range(1, 61)]
    samples = history_samples(ring, 0.2)
    assert 25 <= len(samples) <= 30
    assert all(0.2 - 1e-6 <= s <= 0.3 + 1e-6 for s in samples), samples
    assert stuck_threshold(samples, CONFIG) == CONFIG.floor


def test_the_wait_in_progress_is_never_a_sample() -> None:
    # Thirty collectives a second apart, then the hang: an all_reduce in flight for 500 s, and a later entry that
    # completed out of order (the live counter stops at the first collective in flight, so does the replay).
    ring = [entry(i, i, created=T0 + i) for i in range(1, 31)]
    ring += [entry(31, 31, created=T0 + 31, retired=False), entry(32, 32, created=T0 + 531)]
    samples = history_samples(ring, 1.0)
    assert len(samples) == 29 and max(samples) == 1.0
    # The hang's entry may bound its predecessor's completion (gloo records none): it was created before the hang.
    assert history_samples([entry(1, 1, created=T0), entry(2, 2, created=T0 + 1, retired=False)], 1.0) == ()


def test_a_pause_is_learned_as_the_live_learner_would_learn_it() -> None:
    # A 1 s step, and every 20th an 8 s evaluation: 5 % of the gaps, so the threshold is 3 x 8 s.
    t, ring = T0, []
    for i in range(1, 201):
        t += 8.0 if i % 20 == 0 else 1.0
        ring.append(entry(i, i, created=t))
    samples = history_samples(ring, 1.0)
    assert sorted(set(samples)) == [1.0, 8.0]
    assert stuck_threshold(samples, CONFIG) == 24.0
    # Read on a coarser grid (a slower poll, or a PG only deep reads move), gaps are as long as the live
    # learner's: never shorter than the grid, one sample per replayed poll.
    coarse = history_samples(ring, 5.0)
    assert min(coarse) >= 5.0 and len(coarse) < len(samples)
    # The counters it reads are up to a snapshot interval old, whose grid drifts against the poll's: a gap it
    # sees can be that much longer, so the replay's are.
    assert sorted(set(history_samples(ring, 1.0, lag=1.0))) == [2.0, 9.0]


def test_nccl_waits_come_from_its_own_completion_times() -> None:
    # Collectives enqueued every 0.5 s, each completing 4 s later (queued behind the step's compute): the gaps
    # are short, the waits are not, and the replay keeps the waits (the live learner samples them too).
    ring = [nccl(i, i, T0 + 0.5 * i, T0 + 0.5 * i + 4.0) for i in range(1, 41)]
    samples = history_samples(ring, 1.0)
    assert min(samples) >= 4.0 and max(samples) <= 5.0
    # A collective its watchdog retired without completing (timed out, aborted) ends the history there.
    failed = [*ring[:10], parse_entry({**raw(11, 11, op="nccl:all_reduce", created=T0 + 5.5, retired=True,
                                             state="scheduled")}), *ring[11:]]
    assert len(history_samples(failed, 1.0)) < 10


def test_p2p_and_malformed_entries_are_not_samples() -> None:
    ring = [entry(i, i, created=T0 + i) for i in range(1, 11)]
    ring += [entry(100 + i, 0, op="gloo:send 0->1", p2p=True, created=T0 + 1000 + i) for i in range(5)]
    assert max(history_samples(ring, 1.0)) == 1.0
    assert history_samples(ring, 0.0) == () and history_samples(ring, float("nan")) == ()
    assert history_samples([], 1.0) == ()


# ---------------------------------------------------------------- the learner takes one replay per PG


def test_the_learner_takes_each_ranks_history_before_its_live_samples() -> None:
    learner = ThresholdLearner(CONFIG)
    key = ("job", "0")
    learner.observe(key, 1.0)
    assert learner.threshold(key) == CONFIG.ceiling
    learner.seed(key, [8.0] + [1.0] * 9)  # rank 0's ring: still a cold start, as 11 live samples would be
    assert learner.samples(key) == 11 and learner.threshold(key) == CONFIG.ceiling
    learner.seed(key, [1.0] * 10 + [float("nan"), -1.0])  # rank 1's: together as many as the live learner needs
    assert learner.samples(key) == 21 and learner.threshold(key) == 24.0
    # A PG dropped and created again starts over, its new rings' histories included.
    learner.retain([])
    assert learner.samples(key) == 0
    learner.seed(key, [1.0] * 30)
    assert learner.threshold(key) == CONFIG.floor
    # The window keeps the newest: the live samples before the older history.
    small = ThresholdLearner(ThresholdConfig(history=4, min_samples=1))
    for _ in range(3):
        small.observe(key, 2.0)
    small.seed(key, [9.0, 1.0, 1.0])
    assert small.samples(key) == 4 and small.threshold(key) == defaults.STUCK_FLOOR


def test_the_replay_stops_where_the_live_learner_began() -> None:
    ring = [entry(i, i, created=T0 + i) for i in range(1, 41)]
    # gloo's completion is bounded by the next collective's creation: by T0 + 20.5, collectives 1-19 completed
    # (the first of them no sample: a first sight); the whole ring replays 39 (the 40th has no bound).
    assert len(history_samples(ring, 1.0, until=T0 + 20.5)) == 18
    assert len(history_samples(ring, 1.0)) == 38


# ---------------------------------------------------------------- a restart in the middle of a hang, fake ranks


def _poll(node: Node, exporter: Exporter, advance: float = 1.0) -> NodeSnapshot:
    """Advance the clock, publish each rank's pg_status as its ring says, and poll ``exporter`` once."""
    node.now += advance
    node.counter += 1
    for r in node.rings:
        status = {k: str(v) for k, v in node.dump(r)["pg_status"]["0"].items()}
        snap = spoolgen.snapshot(node.pids[r], counter=node.counter, when=node.now, status={"fr": {"0": status}})
        spool.write_json_atomic(str(node.dir / (spool.rank_stem("job", r) + spool.SNAPSHOT_SUFFIX)), snap)
    return exporter.poll_once()


def _pg0(snap: NodeSnapshot, rank: int = 0) -> Any:
    r = next(r for r in snap.ranks if r.rank == rank)
    return next(p for p in r.pgs if p.name == "0")


def test_restart_in_a_hang_keeps_the_learned_threshold_and_the_waits_since(tmp_path: Path) -> None:
    node = Node(tmp_path / "n", 2)
    second: RanksSource | None = None
    try:
        # A job with a 1 s step and an 8 s pause every 20 steps, watched from its start: the live learner
        # learns 3 x 8 s.
        seq = 0
        snap = _poll(node, node.exporter)
        for _ in range(4):
            for _ in range(19):
                seq += 1
                for r in node.rings:
                    node.rings[r].append(raw(seq, seq, created=node.now))
                snap = _poll(node, node.exporter)
            snap = _poll(node, node.exporter, advance=7.0)
            seq += 1
            for r in node.rings:
                node.rings[r].append(raw(seq, seq, created=node.now))
            snap = _poll(node, node.exporter)
        live = _pg0(snap).stuck_threshold_seconds
        assert live == 24.0
        # Rank 0 enters the next all_reduce, rank 1 never does; 30 s into the wait the exporter restarts.
        node.rings[0].append(raw(seq + 1, seq + 1, created=node.now, retired=False))
        hung_at = node.now
        node.now += 30.0
        node.source.close()
        second = RanksSource(RanksConfig(str(node.dir), poll_interval=1.0, rank_timeout=2.0, deep_interval=0.0),
                             clock=lambda: node.now)
        restarted = Exporter([(second, 1.0)], clock=lambda: node.now, hostname="node-a", analyzer=make_analyzer())
        snap = _poll(node, restarted)
        # Its first poll: the history from the rings (no shorter than the live learner's, and within the floor
        # of it), and the verdict, dated from FR's own clock.
        seeded = _pg0(snap).stuck_threshold_seconds
        assert seeded is not None and live <= seeded <= live + CONFIG.floor, (live, seeded)
        (v,) = [v for v in snap.verdicts if v.kind == MISSING_RANK]
        assert v.ranks == (1,) and v.waiting_ranks == (0,) and v.seq == seq + 1
        assert abs(v.since - hung_at) < 1e-3 and abs(v.age_seconds - 31.0) < 1e-3
    finally:
        if second is not None:
            second.close()
        node.close()
