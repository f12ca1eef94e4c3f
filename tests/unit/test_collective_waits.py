"""The cross-node straggler signal's pure computation: each rank's wait inside a PG's collectives
(``sources/collectives.py``: ``entry_wait``, ``WaitTracker``), and its series."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from frexporter import naming as n
from frexporter.analysis.straggler import WAIT_MAD_FACTOR, WAIT_MIN_LAG, WAIT_MIN_RANKS, wait_ranking
from frexporter.fr.trace import FrEntry
from frexporter.model import RANK_OK, UNKNOWN_ACTIVITY, PGState, RankState
from frexporter.outputs.snapshot_metrics import SnapshotCollector
from frexporter.postmortem.promview import Query, rebuild
from frexporter.postmortem.report import Report, render_text
from frexporter.sources.collectives import MIN_WAIT_SAMPLES, WaitTracker, entry_wait
from tests.fakes.node import Node, raw, render
from tests.harness import sample
from tests.shared.rules import shipped_alerts
from tests.unit.test_series_budget import SERIES_BUDGET_PER_RANK, reference_node, series_per_rank

KEY = ("job", "0", 123, "nccl")
T0 = 1_700_000_000 * 10**9


def nccl(seq: int, wait: float, *, created: int | None = None, duration_ms: float | None = None,
         state: str = "completed", p2p: bool = False, timeout_ms: int | None = 600_000) -> FrEntry:
    at = T0 + seq * 10**9 if created is None else created
    return FrEntry(record_id=seq, pg_id=0, pg_name="0", pg_desc="default_pg", collective_seq_id=0 if p2p else seq,
                   p2p_seq_id=seq if p2p else 0, op_id=seq, profiling_name="nccl:all_reduce", time_created_ns=at,
                   state=state, retired=True, timeout_ms=timeout_ms, is_p2p=p2p, duration_ms=duration_ms,
                   input_sizes=((4,),), output_sizes=((4,),), input_dtypes=("Float",), output_dtypes=("Float",),
                   time_discovered_completed_ns=at + round(wait * 1e9) if state == "completed" else 0)


def gloo(seq: int) -> FrEntry:
    return replace(nccl(seq, 0.0, state="scheduled"), profiling_name="gloo:all_reduce")


def steady(tracker: WaitTracker, rank: int, waits: list[float], pid: int = 100, first_seq: int = 1) -> None:
    tracker.observe(KEY, rank, pid, [nccl(first_seq + i, w) for i, w in enumerate(waits)])


def test_entry_wait_per_backend() -> None:
    assert entry_wait(nccl(1, 0.05)) == 0.05  # completion discovered minus the call
    assert entry_wait(nccl(1, 0.05, duration_ms=12.0)) == 0.012  # GPU timing wins where it is on
    assert entry_wait(gloo(1)) is None  # gloo: never completed, no duration
    assert entry_wait(nccl(1, 0.05, state="scheduled")) is None
    assert entry_wait(nccl(1, 0.05, p2p=True)) is None  # send/recv: no peers' common collective


def test_clock_jumps_are_no_wait() -> None:
    assert entry_wait(nccl(1, -2.0)) is None  # the clock stepped back between call and completion
    assert entry_wait(nccl(1, 3600.0)) is None  # ... or forward past the watchdog's timeout
    assert entry_wait(nccl(1, 5000.0, timeout_ms=None)) is None  # no timeout: an hour bounds it


def test_too_few_samples_give_no_score() -> None:
    tracker = WaitTracker()
    steady(tracker, 0, [0.05] * (MIN_WAIT_SAMPLES - 1))
    assert tracker.score(KEY, 0) == (None, MIN_WAIT_SAMPLES - 1)
    assert tracker.score(KEY, 7) == (None, 0)  # never seen: an idle or unknown PG
    steady(tracker, 0, [0.05], first_seq=MIN_WAIT_SAMPLES)
    wait, samples = tracker.score(KEY, 0)
    assert wait is not None and abs(wait - 0.05) < 1e-9 and samples == MIN_WAIT_SAMPLES


def test_one_late_collective_moves_nothing() -> None:
    # A checkpoint: once, the rank arrives 30 s late (waits nothing), its peers wait 30 s more. The trimmed mean
    # leaves both ends out.
    tracker = WaitTracker()
    steady(tracker, 0, [0.05] * 99 + [0.0])  # the late rank
    steady(tracker, 1, [0.05] * 99 + [30.05])  # a peer that waited for it
    for rank in (0, 1):
        wait, _ = tracker.score(KEY, rank)
        assert wait is not None and abs(wait - 0.05) < 1e-9


def test_clock_jump_sample_is_dropped_or_trimmed() -> None:
    tracker = WaitTracker()
    entries = [nccl(i, 0.05) for i in range(1, 101)]
    entries[50] = nccl(51, -5.0)  # step back: dropped
    entries[60] = nccl(61, 2.0)  # a small step forward: one large sample, trimmed
    tracker.observe(KEY, 0, 100, entries)
    wait, samples = tracker.score(KEY, 0)
    assert samples == 99 and wait is not None and abs(wait - 0.05) < 1e-9


def test_restart_starts_over() -> None:
    tracker = WaitTracker()
    steady(tracker, 0, [0.5] * 50, pid=100)
    steady(tracker, 0, [0.05] * 5, pid=101)  # new incarnation: its seqs start again
    assert tracker.score(KEY, 0) == (None, 5)
    steady(tracker, 0, [0.05] * 30, pid=101, first_seq=6)
    wait, samples = tracker.score(KEY, 0)
    assert samples == 35 and wait is not None and abs(wait - 0.05) < 1e-9


def test_each_collective_counts_once() -> None:
    tracker = WaitTracker()
    steady(tracker, 0, [0.05] * 30)
    steady(tracker, 0, [9.0] * 30)  # the same seqs again (a later deep read, coalesced entries): ignored
    assert tracker.score(KEY, 0)[1] == 30


def test_window_keeps_the_recent_collectives() -> None:
    tracker = WaitTracker(window=40)
    steady(tracker, 0, [0.5] * 40)
    steady(tracker, 0, [0.05] * 40, first_seq=41)
    wait, samples = tracker.score(KEY, 0)
    assert samples == 40 and wait is not None and abs(wait - 0.05) < 1e-9


def test_straggler_waits_least() -> None:
    # Rank 2 arrives 40 ms after its peers every step: its peers wait for it, it barely waits.
    tracker = WaitTracker()
    for rank in range(4):
        steady(tracker, rank, [0.002 if rank == 2 else 0.042] * 50)
    waits = {rank: tracker.score(KEY, rank)[0] for rank in range(4)}
    assert min(waits, key=lambda r: waits[r] or 0.0) == 2


def test_forget() -> None:
    tracker = WaitTracker()
    steady(tracker, 0, [0.05] * 30)
    tracker.forget(set())
    assert tracker.score(KEY, 0) == (None, 0)


def _with_waits() -> object:
    snap = reference_node()
    ranks = []
    for r in snap.ranks:
        pgs = tuple(replace(pg, wait_seconds=0.01 * r.local_rank, wait_samples=200) for pg in r.pgs)
        ranks.append(replace(r, pgs=pgs))
    return replace(snap, ranks=tuple(ranks))


def test_wait_series() -> None:
    snap = _with_waits()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snap))  # type: ignore[arg-type,return-value]
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    samples = families[n.RANK_COLLECTIVE_WAIT_SECONDS].samples
    assert len(samples) == 8 * 8
    assert {s.labels[n.L_RANK] for s in samples} == {str(r) for r in range(8, 16)}


def test_budget_default_off_and_opt_in_cost() -> None:
    # Off by default (--collective-waits): the default stays within the budget; on, each PG costs one more
    # series per rank (docs/durations.md).
    assert series_per_rank(reference_node())[1][n.RANK_COLLECTIVE_WAIT_SECONDS] == 0
    per_rank_off, _ = series_per_rank(reference_node())
    per_rank_on, by_family = series_per_rank(_with_waits())  # type: ignore[arg-type]
    assert per_rank_off <= SERIES_BUDGET_PER_RANK
    assert per_rank_on - per_rank_off == 8 == by_family[n.RANK_COLLECTIVE_WAIT_SECONDS] / 8


# ------------------------------------------------------------------ the ranking (analyze --prometheus, dashboard)

def _ranks(waits: dict[int, float], pg: str = "5") -> list[RankState]:
    out = []
    for rank, wait in waits.items():
        state = PGState(name=pg, desc="dp", ranks=tuple(waits), backend="nccl", last_enqueued=10, last_started=-1,
                        last_completed=10, inflight=(), inflight_count=0, timeout_seconds=600.0, last_progress=None,
                        exact=True, has_p2p=False, wait_seconds=wait, wait_samples=200)
        out.append(RankState(job_id="llm", rank=rank, local_rank=0, world_size=len(waits), hostname=f"n{rank}",
                             pid=rank, torch_version="", gpu_uuid="", status=RANK_OK, heartbeat=0.0,
                             heartbeat_age=0.0, socket_alive=None, pgs=(state,), activity=UNKNOWN_ACTIVITY))
    return out


def test_ranking_names_the_last_arriver() -> None:
    rows = wait_ranking(_ranks({0: 0.045, 1: 0.045, 2: 0.005, 3: 0.046}))
    assert [row.rank for row in rows] == [2, 0, 1, 3]
    assert [row.rank for row in rows if row.straggler] == [2]
    assert abs(rows[0].lag - 0.04) < 1e-9


def test_ranking_one_noisy_rank_does_not_name_everybody() -> None:
    # Rank 4 waits far longer than the rest (it is early, or noisy): nobody is late by the robust margin.
    rows = wait_ranking(_ranks({0: 0.045, 1: 0.044, 2: 0.046, 3: 0.045, 4: 0.5}))
    assert not any(row.straggler for row in rows)


def test_ranking_identical_waits_two_ranks_and_gaps_below_the_floor_name_nobody() -> None:
    assert not any(row.straggler for row in wait_ranking(_ranks(dict.fromkeys(range(4), 0.045))))
    assert wait_ranking(_ranks({0: 0.005, 1: 0.045})) == []  # two ranks: no ranking
    assert not any(row.straggler for row in wait_ranking(_ranks({0: 0.045, 1: 0.045, 2: 0.042, 3: 0.045})))


def test_ranking_puts_pgs_with_a_straggler_first() -> None:
    quiet = _ranks(dict.fromkeys(range(3), 0.045), pg="1")
    late = _ranks({0: 0.045, 1: 0.045, 2: 0.001}, pg="9")
    rows = wait_ranking(quiet + late)
    assert rows[0].pg == "9" and rows[0].straggler and len(rows) == 6


def test_ranking_and_rule_use_the_same_numbers() -> None:
    alert = next(a for a in shipped_alerts() if a["alert"] == "FrexporterStraggler")
    expr = " ".join(alert["expr"].split())
    for signal in (n.RANK_COLLECTIVE_WAIT_SECONDS, n.RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS):
        assert f"{WAIT_MAD_FACTOR:g} * job_id_pg:{signal}:mad" in expr
        assert f"job_id_pg_rank:{signal}:straggler_lag > {WAIT_MIN_LAG:g}" in expr
        assert f"sum by (job_id, pg, pg_desc) (job_id_pg_shard:{signal}:count) >= {WAIT_MIN_RANKS}" in expr


def test_prometheus_view_reads_waits_and_the_report_ranks_them() -> None:
    from tests.unit.test_prometheus_rebuild import NOW, job, series

    answers = job(4, {r: (10, 10) for r in range(4)})
    waits = {0: 0.045, 1: 0.045, 2: 0.005, 3: 0.046}
    answers[Query.PG_WAIT] = [series(w, job_id="j", rank=str(r), pg="0", pg_desc="default_pg")
                              for r, w in waits.items()]
    answers[Query.PG_WAIT].append(series("-1", job_id="j", rank="3", pg="0", pg_desc="default_pg"))
    view = rebuild(answers, NOW)
    assert {r.rank: r.pgs[0].wait_seconds for r in view.ranks} == waits
    assert view.skipped_series == 1  # a negative wait is no exporter's
    report = Report(source="prom", ranks=view.ranks, verdicts=(), stragglers=tuple(wait_ranking(view.ranks)))
    text = render_text(report)
    assert "straggler: job j, PG 0 (default_pg), rank(s) 2" in text
    assert "rank 2 +40.0 ms *, rank 0 +0.0 ms" in text
    quiet = Report(source="prom", ranks=view.ranks, verdicts=(),
                   stragglers=tuple(wait_ranking(_ranks(dict.fromkeys(range(3), 0.045)))))
    assert "no cross-node straggler in 1 process group with waits" in render_text(quiet)


# ------------------------------------------------------------------ through the ranks source (fake ranks)

def _ring(wait: float, count: int = 30) -> list[dict[str, Any]]:
    ring = []
    for i in range(count):
        e = raw(i, i + 1, op="nccl:all_reduce", state="completed", timeout_ms=600_000)
        e["time_discovered_completed_ns"] = e["time_created_ns"] + round(wait * 1e9)
        ring.append(e)
    return ring


@pytest.mark.parametrize("on", [True, False])
def test_ranks_source_exports_waits_only_when_asked(node_factory: Callable[..., Node], on: bool) -> None:
    node = node_factory(2, collective_waits=on)
    node.rings[0] = _ring(0.040)
    node.rings[1] = _ring(0.002)  # arrives last: waits least
    parsed = render(node.poll())
    for r, wait in ((0, 0.040), (1, 0.002)):
        value = sample(parsed, n.RANK_COLLECTIVE_WAIT_SECONDS, job_id="job", rank=str(r), pg="0")
        assert value == (pytest.approx(wait) if on else None)


def test_ranks_source_gives_gloo_no_wait(node_factory: Callable[..., Node]) -> None:
    node = node_factory(2, collective_waits=True)
    for r in (0, 1):
        node.rings[r] = [raw(i, i + 1) for i in range(30)]  # gloo: retired, never completed
    assert sample(render(node.poll()), n.RANK_COLLECTIVE_WAIT_SECONDS, job_id="job", rank="0", pg="0") is None
