"""The cross-node straggler ranking of gloo PGs (``analysis.straggler.wait_ranking`` by arrivals): what
``analyze --prometheus`` prints from frexporter_rank_collective_arrival_timestamp_seconds, ranked as
FrexporterStraggler's recording rules rank it, and how ``promview.rebuild`` reads the series and their rates.

The NCCL side (waits) is in tests/unit/test_collective_waits.py."""

from __future__ import annotations

import math

import pytest

from frexporter.analysis.straggler import (
    ARRIVAL_HALF_BLOCK,
    ARRIVAL_MAX_LAG,
    SIGNAL_ARRIVAL,
    SIGNAL_WAIT,
    WaitLag,
    wait_ranking,
)
from frexporter.model import RANK_OK, UNKNOWN_ACTIVITY, PGState, RankState
from frexporter.postmortem import report
from frexporter.postmortem.promview import JobView, Query, rebuild
from frexporter.postmortem.report import Report, render_text
from frexporter.sources.arrivals import ARRIVAL_BLOCK, ARRIVAL_GRID
from tests.unit.test_prometheus_rebuild import NOW, job, series

T = 1_700_000_000.0  # the PG's median arrival, about
PG = "3"


def _ranks(arrivals: dict[int, float], waits: dict[int, float] | None = None) -> list[RankState]:
    out = []
    for rank, arrival in arrivals.items():
        state = PGState(name=PG, desc="dp", ranks=tuple(arrivals), backend="gloo", last_enqueued=400,
                        last_started=-1, last_completed=400, inflight=(), inflight_count=0, timeout_seconds=1800.0,
                        last_progress=None, exact=True, has_p2p=False, arrival_timestamp=arrival,
                        wait_seconds=(waits or {}).get(rank))
        out.append(RankState(job_id="llm", rank=rank, local_rank=0, world_size=len(arrivals), hostname=f"n{rank}",
                             pid=rank, torch_version="", gpu_uuid="", status=RANK_OK, heartbeat=0.0,
                             heartbeat_age=0.0, socket_alive=None, pgs=(state,), activity=UNKNOWN_ACTIVITY))
    return out


def _rates(rate: float, ranks: range | list[int]) -> dict[tuple[str, int, str], float]:
    return {("llm", rank, PG): rate for rank in ranks}


def test_a_late_gloo_rank_is_named_by_its_arrival() -> None:
    arrivals = {0: T, 1: T + 0.001, 2: T + 0.040, 3: T - 0.001}
    rows = wait_ranking(_ranks(arrivals), _rates(10.0, range(4)))
    assert [row.rank for row in rows] == [2, 1, 0, 3]
    assert [row.rank for row in rows if row.straggler] == [2]
    late = rows[0]
    assert late.signal == SIGNAL_ARRIVAL and late.wait is None and late.arrival == T + 0.040
    # Against the median of the four, T + 0.5 ms; unix times near 1.7e9 carry about 0.2 us.
    assert late.lag == pytest.approx(0.040 - 0.0005, abs=1e-6)
    # Early ranks have a negative lag: they wait for the others.
    assert rows[-1].lag == pytest.approx(-0.0015, abs=1e-6)


def test_arrivals_within_the_floor_or_the_spread_name_nobody() -> None:
    assert not any(row.straggler for row in wait_ranking(_ranks({0: T, 1: T + 0.001, 2: T + 0.004, 3: T})))
    noisy = {0: T, 1: T + 0.010, 2: T - 0.010, 3: T + 0.012, 4: T - 0.011}  # one MAD of 10 ms
    assert not any(row.straggler for row in wait_ranking(_ranks(noisy), _rates(5.0, range(5))))


def test_a_rank_a_block_away_is_left_out() -> None:
    # At 20 collectives a second a block of 4 is 200 ms long: rank 4's calls straddled a block boundary and it
    # reports the next block, which would make it the worst straggler of the PG.
    arrivals = {0: T, 1: T + 0.001, 2: T - 0.001, 3: T + 0.0005, 4: T + 0.2}
    rows = wait_ranking(_ranks(arrivals), _rates(20.0, range(5)))
    assert sorted(row.rank for row in rows) == [0, 1, 2, 3]
    assert not any(row.straggler for row in rows)
    # A rank with no rate of its own runs at its peers'.
    assert [row.rank for row in wait_ranking(_ranks(arrivals), _rates(20.0, range(4)))] == [1, 3, 0, 2]
    # An idle PG's block is infinitely long (the rule's 2 / 0): nobody is left out.
    assert 4 in {row.rank for row in wait_ranking(_ranks(arrivals), _rates(0.0, range(5)))}


def test_without_a_rate_a_rank_past_a_second_is_left_out() -> None:
    # At 1 collective a second a neighbouring block is 4 s away; a genuine lag of 0.8 s stays in and is named.
    arrivals = {0: T, 1: T + 0.001, 2: T - 0.001, 3: T + 0.8, 4: T + 4.0}
    rows = wait_ranking(_ranks(arrivals))
    assert 4 not in {row.rank for row in rows}
    assert [row.rank for row in rows if row.straggler] == [3]
    assert ARRIVAL_MAX_LAG == ARRIVAL_HALF_BLOCK / 2.0  # half a block at 2 collectives a second


def test_the_half_block_is_the_sources_block() -> None:
    # straggler.py may not import sources/arrivals.py (the analysis layer imports base only): held equal here.
    assert ARRIVAL_HALF_BLOCK == ARRIVAL_BLOCK / 2


def test_analyze_reads_arrivals_one_grid_period_back_as_the_rule_does() -> None:
    assert Query.PG_ARRIVAL.value[1].endswith(f" offset {ARRIVAL_GRID:g}s")


def test_two_ranks_are_not_ranked() -> None:
    assert wait_ranking(_ranks({0: T, 1: T + 0.5}), _rates(1.0, range(2))) == []
    # Nor are three of which one reports a neighbouring block: the rule counts the ranks with a lag.
    assert wait_ranking(_ranks({0: T, 1: T + 0.05, 2: T + 0.4}), _rates(10.0, range(3))) == []


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_a_bad_arrival_is_no_rank(bad: float) -> None:
    rows = wait_ranking(_ranks({0: T, 1: T + 0.001, 2: T + 0.040, 3: bad}), _rates(10.0, range(4)))
    assert sorted(row.rank for row in rows) == [0, 1, 2]


def test_a_pg_with_waits_is_ranked_by_them() -> None:
    # NCCL exports waits, gloo arrivals; a PG with both (no exporter writes that) is ranked as NCCL.
    ranks = _ranks({0: T, 1: T, 2: T + 0.5}, waits={0: 0.045, 1: 0.045, 2: 0.005})
    rows = wait_ranking(ranks)
    assert {row.signal for row in rows} == {SIGNAL_WAIT}
    assert [row.rank for row in rows if row.straggler] == [2] and rows[0].arrival is None


def test_prometheus_view_reads_arrivals_and_the_report_ranks_them() -> None:
    answers = job(4, {r: (10, 10) for r in range(4)})
    arrivals = {0: NOW - 20.0, 1: NOW - 19.999, 2: NOW - 19.96, 3: NOW - 20.001}

    def pg(value: float | str, rank: int) -> dict[str, object]:
        return series(value, job_id="j", rank=str(rank), pg="0", pg_desc="default_pg")

    answers[Query.PG_ARRIVAL] = [pg(a, r) for r, a in arrivals.items()]
    answers[Query.PG_ARRIVAL] += [pg("-5", 3), pg("NaN", 2)]  # a negative one is counted, no number dropped
    # No rate() is below 0: left out, not counted again (the seq series it is the rate of is).
    answers[Query.PG_RATE] = [pg(10, r) for r in range(3)] + [pg("-1", 3)]
    answers[Query.NODE_NOW] = [series(NOW - 3.0)]  # node0's clock is 3 s behind the caller's
    view = rebuild(answers, NOW)
    # On their nodes' clocks, as the rule compares them: not moved by the exporters' offsets.
    assert {r.rank: r.pgs[0].arrival_timestamp for r in view.ranks} == arrivals
    assert view.collective_rates == {("j", r, "0"): 10.0 for r in range(3)}
    assert view.skipped_series == 1
    assert any("arrival series" in line for line in view.problems)
    rows = wait_ranking(view.ranks, view.collective_rates)
    text = render_text(Report(source="prom", ranks=view.ranks, verdicts=(), stragglers=tuple(rows)))
    assert "straggler: job j, PG 0 (default_pg), rank(s) 2 (by arrival)" in text
    assert "rank 2 +39.5 ms *, rank 1 +0.5 ms" in text
    quiet = wait_ranking(_ranks({0: T, 1: T, 2: T}))
    text = render_text(Report(source="prom", ranks=view.ranks, verdicts=(), stragglers=tuple(quiet)))
    assert "no cross-node straggler in 1 process group with waits or arrivals" in text


def test_analyze_prometheus_passes_the_rates_to_the_ranking(monkeypatch: pytest.MonkeyPatch) -> None:
    ranks = tuple(_ranks({0: T, 1: T + 0.001, 2: T - 0.001, 3: T + 0.0005, 4: T + 0.2}))
    view = JobView(ranks=ranks, problems=[], skipped_series=0, collective_rates=_rates(20.0, range(5)))
    monkeypatch.setattr(report.prometheus, "job_view", lambda *args, **kwargs: view)
    out = report.from_prometheus("http://prom", "llm")
    assert sorted(row.rank for row in out.stragglers) == [0, 1, 2, 3]
    assert all(isinstance(row, WaitLag) and row.signal == SIGNAL_ARRIVAL for row in out.stragglers)
