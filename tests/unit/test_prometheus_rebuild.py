"""``promview.rebuild``: a job's ranks from the answers to each query, written here as literal dicts (what
``prometheus.fetch`` returns), with no server, no PromQL and no clock.

A healthy job, a rank that reports nothing, a rank whose heartbeat is stale, integer labels and values read
strictly (and counted where they are not ones), and the bound on what member lists expand to.
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from frexporter import safetext
from frexporter.analysis.absent import find_absent_in_world
from frexporter.analysis.kinds import MISSING_RANK, RANK_ABSENT
from frexporter.analysis.verdicts import VerdictConfig, evaluate
from frexporter.model import RANK_DOWN, RANK_OK, RANK_UNRESPONSIVE
from frexporter.postmortem import promseries, promview
from frexporter.postmortem.promview import Query, rebuild
from tests.shared.layering import IMPURE_MODULES

NOW = 1_700_000_000.0
SCRAPED = NOW - 5  # when Prometheus last scraped every series below
CONFIG = VerdictConfig(stuck_after=30, complete_view=True)


def series(value: float | str, **labels: str) -> dict[str, Any]:
    """One sample of an instant vector, from node0's exporter."""
    return {"metric": {"job": "frexporter", "instance": "node0:9400", **labels}, "value": [NOW, str(value)]}


def job(world: int, seqs: dict[int, tuple[int, int]], oldest: float = NOW - 100) -> dict[Query, list[dict[str, Any]]]:
    """The answers for job "j": each rank of ``seqs`` up, its heartbeat 1 s old at the scrape, in the WORLD PG
    (size ``world``) with (enqueued, completed) seqs, its oldest in-flight collective begun at ``oldest``."""
    ranks = sorted(seqs)
    waiting = [r for r in ranks if seqs[r][0] > seqs[r][1]]

    def pg(values: dict[int, float]) -> list[dict[str, Any]]:
        return [series(v, job_id="j", rank=str(r), pg="0", pg_desc="default_pg") for r, v in values.items()]

    return {
        Query.UP: [series(1, job_id="j", rank=str(r)) for r in ranks],
        Query.HEARTBEAT: [series(SCRAPED - 1, job_id="j", rank=str(r)) for r in ranks],
        Query.SCRAPED: [series(SCRAPED, job_id="j", rank=str(r)) for r in ranks],
        Query.INFO: [series(1, job_id="j", rank=str(r), local_rank=str(r), world_size=str(world),
                            hostname="node0", pid=str(100 + r)) for r in ranks],
        Query.PG_INFO: [series(1, job_id="j", pg="0", pg_desc="default_pg", size=str(world), backend="nccl")],
        Query.PG_TIMEOUT: [series(600, job_id="j", pg="0", pg_desc="default_pg")],
        Query.PG_STUCK_THRESHOLD: [series(10, job_id="j", pg="0", pg_desc="default_pg")],
        Query.PG_ENQUEUED: pg({r: seqs[r][0] for r in ranks}),
        Query.PG_COMPLETED: pg({r: seqs[r][1] for r in ranks}),
        Query.PG_OLDEST: pg(dict.fromkeys(waiting, oldest)),
    }


# ------------------------------------------------------------------------------------------------ healthy


def test_a_healthy_job_is_every_rank_ok_in_its_world_pg() -> None:
    answers = {
        Query.UP: [series(1, job_id="j", rank="0"), series(1, job_id="j", rank="1")],
        Query.HEARTBEAT: [series(NOW - 6, job_id="j", rank="0"), series(NOW - 7, job_id="j", rank="1")],
        Query.SCRAPED: [series(NOW - 5, job_id="j", rank="0"), series(NOW - 5, job_id="j", rank="1")],
        Query.INFO: [series(1, job_id="j", rank="0", local_rank="0", world_size="2", hostname="node0", pid="41",
                            torch_version="2.5.0", gpu_uuid="GPU-0"),
                     series(1, job_id="j", rank="1", local_rank="1", world_size="2", hostname="node0", pid="42")],
        Query.PG_INFO: [series(1, job_id="j", pg="0", pg_desc="default_pg", size="2", backend="nccl")],
        Query.PG_TIMEOUT: [series(600, job_id="j", pg="0", pg_desc="default_pg")],
        Query.PG_STUCK_THRESHOLD: [series(10, job_id="j", pg="0", pg_desc="default_pg")],
        Query.PG_STUCK_CEILING: [series(300, job_id="j", pg="0", pg_desc="default_pg")],
        Query.PG_ENQUEUED: [series(12, job_id="j", rank="0", pg="0", pg_desc="default_pg"),
                            series(12, job_id="j", rank="1", pg="0", pg_desc="default_pg")],
        Query.PG_COMPLETED: [series(12, job_id="j", rank="0", pg="0", pg_desc="default_pg"),
                             series(12, job_id="j", rank="1", pg="0", pg_desc="default_pg")],
        Query.PG_STARTED: [series(12, job_id="j", rank="0", pg="0", pg_desc="default_pg")],
        Query.PG_INFLIGHT: [series(0, job_id="j", rank="0", pg="0", pg_desc="default_pg")],
        Query.PG_PROGRESS: [series(NOW - 8, job_id="j", rank="0", pg="0", pg_desc="default_pg")],
        Query.ACTIVITY: [series(NOW - 30, job_id="j", rank="0", state="in_collective")],
    }
    before = copy.deepcopy(answers)
    view = rebuild(answers, NOW)
    assert answers == before  # read, never changed
    assert (view.problems, view.skipped_series) == ([], 0)
    r0, r1 = view.ranks
    assert [(r.job_id, r.rank, r.local_rank, r.world_size, r.hostname, r.pid, r.status) for r in view.ranks] == [
        ("j", 0, 0, 2, "node0", 41, RANK_OK), ("j", 1, 1, 2, "node0", 42, RANK_OK)]
    assert (r0.torch_version, r0.gpu_uuid, r1.torch_version, r1.gpu_uuid) == ("2.5.0", "GPU-0", "", "")
    # Fresh at the scrape: the age is how old the heartbeat was then, not at ``now``.
    assert (r0.heartbeat, r0.heartbeat_age, r1.heartbeat_age) == (NOW - 6, 1.0, 2.0)
    (pg0,), (pg1,) = r0.pgs, r1.pgs
    assert (pg0.name, pg0.desc, pg0.ranks, pg0.last_enqueued, pg0.last_started, pg0.last_completed) == (
        "0", "default_pg", (0, 1), 12, 12, 12)
    assert (pg0.inflight_count, pg0.inflight, pg0.timeout_seconds, pg0.last_progress) == (0, (), 600.0, NOW - 8)
    assert (pg0.stuck_threshold_seconds, pg0.stuck_ceiling_seconds) == (10.0, 300.0)
    assert (pg1.last_started, pg1.last_progress) == (-1, None)  # not reported: unknown, not zero
    assert (r0.activity.state, r0.activity.since, r1.activity.state) == ("in_collective", NOW - 30, "unknown")
    assert evaluate(view.ranks, NOW, CONFIG) == () and find_absent_in_world(view.ranks) == []


def test_queries_left_out_answered_nothing() -> None:
    assert rebuild({}, NOW) == promview.JobView(ranks=(), problems=[], skipped_series=0)
    only_up = rebuild({Query.UP: [series(1, job_id="j", rank="3")]}, NOW)
    assert [(r.rank, r.status, r.world_size, r.heartbeat, r.pgs) for r in only_up.ranks] == [(3, RANK_OK, -1, None, ())]


def test_the_ages_come_from_now_as_given() -> None:
    answers = job(2, {0: (8, 7), 1: (8, 7)})
    del answers[Query.SCRAPED]  # without scrape times, judged at ``now``
    assert [r.heartbeat_age for r in rebuild(answers, NOW).ranks] == [6.0, 6.0]
    assert [r.heartbeat_age for r in rebuild(answers, NOW + 10).ranks] == [16.0, 16.0]


# ------------------------------------------------------------------------------------------- missing rank


def test_a_rank_without_series_is_a_member_of_the_world_pg_and_blamed() -> None:
    # Ranks 0 and 1 wait in collective 8 of a world of 3; rank 2's exporter sent nothing.
    view = rebuild(job(3, {0: (8, 7), 1: (8, 7)}), NOW)
    assert [r.rank for r in view.ranks] == [0, 1]
    assert [pg.ranks for r in view.ranks for pg in r.pgs] == [(0, 1, 2), (0, 1, 2)]
    assert [pg.inflight[0].created for r in view.ranks for pg in r.pgs] == [NOW - 100, NOW - 100]
    verdicts = evaluate(view.ranks, NOW, CONFIG)
    assert [(v.kind, v.ranks) for v in verdicts] == [(MISSING_RANK, (2,))], verdicts
    assert [(v.kind, v.ranks, v.waiting_ranks) for v in find_absent_in_world(view.ranks)] == [
        (RANK_ABSENT, (2,), (0, 1))]


def test_a_pg_smaller_than_the_world_is_only_the_ranks_that_report_it() -> None:
    answers = job(3, {0: (8, 7), 1: (8, 7)})
    answers[Query.PG_INFO] = [series(1, job_id="j", pg="0", pg_desc="default_pg", size="2")]
    assert [pg.ranks for r in rebuild(answers, NOW).ranks for pg in r.pgs] == [(0, 1), (0, 1)]


def test_a_rank_reported_by_two_exporters_is_read_from_the_fresher() -> None:
    answers = job(2, {0: (9, 8), 1: (9, 8)})
    # Exporter "b" reports rank 1 too, 20 s behind, with older seqs and no in-flight start.
    b = {"instance": "b:9400", "job_id": "j", "rank": "1"}
    answers[Query.HEARTBEAT].append({"metric": {"job": "frexporter", **b}, "value": [NOW, str(NOW - 25)]})
    for q, seq in ((Query.PG_ENQUEUED, 8), (Query.PG_COMPLETED, 8)):
        answers[q].append({"metric": {"job": "frexporter", **b, "pg": "0", "pg_desc": "default_pg"},
                           "value": [NOW, str(seq)]})
    rank1 = rebuild(answers, NOW).ranks[1]
    assert [(pg.last_enqueued, pg.last_completed, pg.inflight_count) for pg in rank1.pgs] == [(9, 8, 1)]
    assert (rank1.heartbeat, rank1.pgs[0].inflight[0].created) == (SCRAPED - 1, NOW - 100)


# ------------------------------------------------------------------------------------------------- stale


def test_a_rank_whose_heartbeat_was_stale_at_its_scrape_is_unresponsive() -> None:
    answers = job(3, {0: (8, 8), 1: (8, 8), 2: (8, 8)})
    # Rank 1's heartbeat was 40 s old when scraped (its Python is wedged); rank 2's exporter says it is down.
    answers[Query.HEARTBEAT][1] = series(SCRAPED - 40, job_id="j", rank="1")
    answers[Query.UP][2] = series(0, job_id="j", rank="2")
    ranks = rebuild(answers, NOW).ranks
    assert [r.status for r in ranks] == [RANK_OK, RANK_UNRESPONSIVE, RANK_DOWN]
    # A wedged rank has not beaten since: its age runs to ``now``; a healthy one's stops at its scrape.
    assert [r.heartbeat_age for r in ranks] == [1.0, 45.0, 1.0]
    # Old at query time only (a long scrape interval) is not stale.
    answers[Query.HEARTBEAT][1] = series(SCRAPED - 1, job_id="j", rank="1")
    assert [r.status for r in rebuild(answers, NOW + 55).ranks] == [RANK_OK, RANK_OK, RANK_DOWN]
    # The threshold is the caller's.
    assert [r.status for r in rebuild(answers, NOW, stale_after=0.5).ranks] == [RANK_UNRESPONSIVE] * 2 + [RANK_DOWN]


# ---------------------------------------------------------------------------------------- strict labels


@pytest.mark.parametrize("bad", ["٣", " 1", "1_0", "+2", "-1", "01", "1.0", "", "2147483648"], ids=ascii)
def test_a_rank_label_that_is_not_a_decimal_rank_is_counted_out(bad: str) -> None:
    answers = job(4, {3: (8, 8)})
    answers[Query.UP].append(series(1, __name__="frexporter_rank_up", job_id="j", rank=bad))
    answers[Query.PG_ENQUEUED].append(series(9, job_id="j", rank=bad, pg="0", pg_desc="default_pg"))
    view = rebuild(answers, NOW)
    assert [r.rank for r in view.ranks] == [3]
    assert view.skipped_series == 2
    assert view.problems == [f'2 series with a rank label that is not a whole number up to {2**31 - 1}, '
                             f'first: rank="{safetext.printable(bad)}" of frexporter_rank_up']


@pytest.mark.parametrize("label", ["local_rank", "world_size", "pid"])
def test_other_integer_labels_are_read_as_strictly(label: str) -> None:
    answers = job(2, {0: (8, 8), 1: (8, 8)})
    answers[Query.INFO][1]["metric"].update({"__name__": "frexporter_rank_info", label: "+1"})
    view = rebuild(answers, NOW)
    assert [r.rank for r in view.ranks] == [0, 1]  # still up: only its info series is left out
    assert (view.ranks[1].world_size, view.ranks[1].pid) == (-1, -1)
    assert view.problems == [f'1 series with a {label} label that is not a whole number up to {2**31 - 1}, '
                             f'first: {label}="+1" of frexporter_rank_info']


@pytest.mark.parametrize("value", ["7.5", "1e300", "-2"])
def test_a_seq_that_is_not_a_whole_number_is_counted_out(value: str) -> None:
    answers = job(2, {0: (8, 8), 1: (8, 8)})
    answers[Query.PG_ENQUEUED][0] = series(value, __name__="frexporter_pg_last_enqueued_seq", job_id="j", rank="0",
                                           pg="0", pg_desc="default_pg")
    view = rebuild(answers, NOW)
    assert [len(r.pgs) for r in view.ranks] == [0, 1]  # without its enqueued seq the PG says nothing
    assert view.problems == [f"1 series whose value is not a whole number from -1 to {2**53}, "
                             f"first: {value} of frexporter_pg_last_enqueued_seq"]


def test_an_activity_state_that_no_exporter_writes_is_unknown() -> None:
    answers = job(2, {0: (8, 8), 1: (8, 8)})
    answers[Query.ACTIVITY] = [series(NOW - 3, job_id="j", rank="0", state="<script>")]
    answers[Query.VERDICT] = [series(1, job_id="j", rank="1", culprit_state="busy", culprit_function="save")]
    r0, r1 = rebuild(answers, NOW).ranks
    assert r0.activity.state == "unknown"
    assert (r1.activity.state, r1.activity.headline()) == ("busy", ("save", "", 0))


def test_busy_within_the_hold_is_remembered_as_now() -> None:
    answers = job(2, {0: (8, 8), 1: (8, 8)})
    answers[Query.ACTIVITY] = [series(NOW - 5, job_id="j", rank=str(r), state="idle") for r in (0, 1)]
    answers[Query.BUSY_LATELY] = [series(NOW - 40, job_id="j", rank="1", state="busy")]
    assert [r.activity.last_busy for r in rebuild(answers, NOW).ranks] == [None, NOW]


# ------------------------------------------------------------------------------------- member expansion


def test_world_spanning_pgs_past_the_expansion_bound_are_left_as_reported() -> None:
    # A world of 4, two ranks reporting; three world-sized PGs. With 10 members to expand in all, the job's
    # absent ranks take 4 and PG "0" 4; PGs "1" and "2" would pass the bound.
    answers = job(4, {0: (8, 8), 1: (8, 8)})
    for q in (Query.PG_INFO, Query.PG_ENQUEUED, Query.PG_COMPLETED):
        answers[q] = [{**s, "metric": {**s["metric"], "pg": pg}} for pg in "012" for s in answers[q]]
    with mock.patch.object(promview, "MAX_EXPANDED_MEMBERS", 10):
        view = rebuild(answers, NOW)
    assert [(pg.name, pg.ranks) for pg in view.ranks[0].pgs] == [("0", (0, 1, 2, 3)), ("1", (0, 1)), ("2", (0, 1))]
    assert view.ranks[0].world_size == 4
    assert view.skipped_series == 0  # a bound on the view, not a series left out
    assert view.problems == ["2 world-spanning process groups whose members are only the ranks that report them "
                             "(past 10 members expanded in all), first: job j, PG 1"]


def test_worlds_past_the_expansion_bound_are_unknown_and_the_reporting_job_goes_first() -> None:
    # Job "j" has two reporting ranks, jobs "k" and "l" one each; worlds of 4 with 8 members to expand in all:
    # j's absent ranks and its WORLD PG take them.
    answers = job(4, {0: (8, 8), 1: (8, 8)})
    for other in ("k", "l"):
        answers[Query.UP].append(series(1, job_id=other, rank="0"))
        answers[Query.INFO].append(series(1, job_id=other, rank="0", world_size="4"))
    with mock.patch.object(promview, "MAX_EXPANDED_MEMBERS", 8):
        view = rebuild(answers, NOW)
    assert [(r.job_id, r.world_size) for r in view.ranks] == [("j", 4), ("j", 4), ("k", -1), ("l", -1)]
    assert [pg.ranks for r in view.ranks for pg in r.pgs] == [(0, 1, 2, 3), (0, 1, 2, 3)]
    assert view.problems == ["2 jobs whose absent ranks are not listed (past 8 members expanded in all), first: job k"]
    assert [(v.job_id, v.ranks) for v in find_absent_in_world(view.ranks)] == [("j", (2, 3))]


def test_a_world_beyond_any_real_job_is_expanded_nowhere() -> None:
    world = promview.MAX_WORLD_SIZE + 1
    view = rebuild(job(world, {0: (8, 7)}), NOW)
    assert [pg.ranks for r in view.ranks for pg in r.pgs] == [(0,)]
    assert (view.problems, find_absent_in_world(view.ranks)) == ([], [])


# ------------------------------------------------------------------------------------------------- pure


@pytest.mark.parametrize("module", [promview, promseries])
def test_the_rebuild_imports_nothing_that_reaches_the_outside(module: Any) -> None:
    tree = ast.parse(Path(module.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {f"{node.module}.{alias.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 for alias in node.names}
    assert {name.split(".")[0] for name in imported} & IMPURE_MODULES == set()
    # Nor the modules that do (the HTTP client, the fetch).
    assert {name for name in imported if name.startswith(("frexporter.postmortem.prometheus",
                                                          "frexporter.postmortem.promclient"))} == set()
