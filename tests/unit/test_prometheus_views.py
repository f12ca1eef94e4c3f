"""What people read out of Prometheus, against a real one scraping a real gloo job through the exporter.

- ``frexporter analyze --prometheus``: the whole-job view rebuilt from the series names the rank that
  skipped a collective (and nothing on the same job while it is healthy);
- the Grafana dashboards: every panel query returns data for a job with a desync in flight, except an
  explicit list of queries whose data this CPU job cannot produce (GPUs, NCCL timing, ...).

The unit tests at the end pin how ``promview.rebuild`` reads series (membership, duplicates, heartbeats,
activity) and how ``prometheus.fetch`` quotes the job, with canned query answers instead of a Prometheus.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest

from frexporter import naming as n
from frexporter.analysis.verdicts import MISSING_RANK, RANK_ABSENT, VerdictConfig, evaluate
from frexporter.model import ACTIVITY_IN_COLLECTIVE, RANK_OK, RANK_UNRESPONSIVE
from frexporter.postmortem import prometheus, promview, report
from frexporter.postmortem.promview import Query
from tests.harness import REPO, Job, require_module, wait_for
from tests.promstack import SCALE, PromStack
from tests.rulefile import load_rules

DESYNC = "FrexporterCollectiveDesync"
JOB_TIMEOUT_S = 60.0  # gloo's timeout: every check below must be done well before the ranks give up
POLL_S = 0.25
SEEN_TIMEOUT_S = 20.0  # for Prometheus to show what the exporter already serves (scrape + rule evaluation)
ANALYZE_DEADLINE_S = 30.0  # from the skip to the verdict: the threshold and a few scrapes
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _desync_threshold() -> float:
    """FrexporterCollectiveDesync's in-flight threshold at the stack's scale (3 s at 0.1)."""
    rule = next(r for g in load_rules(SCALE)["groups"] for r in g["rules"] if r.get("alert") == DESYNC)
    for line in rule["expr"].splitlines():
        if "@scale" in line:
            return float(line.split(">=")[1].split("#")[0])
    raise AssertionError(f"no scaled threshold in {DESYNC}: {rule['expr']}")


STUCK_AFTER = _desync_threshold()


def _watch(promstack: PromStack, exporter_factory: Callable[..., Any], job: Job) -> None:
    """Starts the exporter on the port Prometheus scrapes and waits until Prometheus sees every rank up."""
    since = time.time()
    exporter_factory(job.spool, port=promstack.exporter_port, stuck_after=STUCK_AFTER)
    promstack.wait_target_up(since)
    wait_for(lambda: len(promstack.query(f'{n.RANK_UP}{{job_id="{job.job_id}"}} == 1')) == job.world,
             timeout=SEEN_TIMEOUT_S, interval=POLL_S, what=f"Prometheus sees every rank of {job.job_id} up")


def _skip_pair_collective(job: Job) -> None:
    job.touch("skip")
    job.wait_ready("skipped", ranks=[3], timeout=10)


def _pair_skip_job(job_factory: Callable[..., Job], job_id: str) -> Job:
    # Rank 3 will leave out its all_reduce on pair23 ({2,3}); see tests/workers/job.py.
    job = job_factory("pair_skip", 4, job_id=job_id,
                      env={"JOB_TIMEOUT": f"{JOB_TIMEOUT_S:g}", "JOB_STEP_SECONDS": "0.5"})
    job.wait_ready()
    return job


def _assert_alive(job: Job) -> None:
    dead = [rank for rank, proc in enumerate(job.procs) if proc.poll() is not None]
    assert not dead, f"ranks {dead} exited (gloo timed out?):\n{job.log(dead[0])}"


# --- frexporter analyze --prometheus ---------------------------------------------------------------------


def _analyze(promstack: PromStack, job_id: str) -> list[dict[str, Any]]:
    result = subprocess.run(
        [sys.executable, "-m", "frexporter", "analyze", "--prometheus", promstack.prom_url, "--job-id", job_id,
         "--stuck-after", f"{STUCK_AFTER:g}", "--json"],
        capture_output=True, text=True, timeout=60, env=ENV, cwd=REPO, check=False)
    assert result.returncode == 0, result.stderr
    verdicts: list[dict[str, Any]] = json.loads(result.stdout)
    return verdicts


@pytest.mark.e2e
def test_analyze_names_the_rank_that_skipped_a_collective(
    promstack: PromStack, job_factory: Callable[..., Job], exporter_factory: Callable[..., Any],
) -> None:
    job_id = "views-analyze"
    job = _pair_skip_job(job_factory, job_id)
    _watch(promstack, exporter_factory, job)
    # Healthy first: every PG of every rank is in Prometheus, and nobody is blamed.
    wait_for(lambda: len(promstack.query(f'{n.PG_LAST_ENQUEUED_SEQ}{{job_id="{job_id}"}}')) == 4 * 2,
             timeout=SEEN_TIMEOUT_S, interval=POLL_S, what="WORLD and pair PG series of all 4 ranks")
    assert _analyze(promstack, job_id) == []

    _skip_pair_collective(job)

    def blamed() -> list[dict[str, Any]]:
        return [v for v in _analyze(promstack, job_id) if v["kind"] == MISSING_RANK]

    found = wait_for(blamed, timeout=ANALYZE_DEADLINE_S, interval=0.5, what="a missing_rank verdict")
    _assert_alive(job)
    verdict = found[0]
    assert (verdict["job_id"], verdict["pg_desc"], verdict["ranks"]) == (job_id, "pair23", [3]), verdict
    assert 2 in verdict["waiting_ranks"], verdict
    # Timing comes from the involved wait nearest to its watchdog: WORLD's (JOB_TIMEOUT), where ranks 0, 1
    # and 3 block, not pair23's (torch's default for new groups).
    assert verdict["timeout_seconds"] == pytest.approx(JOB_TIMEOUT_S), verdict
    assert 0 < verdict["age_seconds"] < JOB_TIMEOUT_S, verdict
    # The cascade (ranks 0, 1 and 3 blocked in WORLD behind rank 2) is explained, not blamed on anyone else.
    everything = _analyze(promstack, job_id)
    assert {rank for v in everything for rank in v["ranks"]} == {3}, everything


# --- dashboards --------------------------------------------------------------------------------------------


# What a CPU gloo job with a desync in flight, watched with the shipped rules, offers the dashboards.
AVAILABLE = frozenset({"recording_rules", "inflight", "verdict", "alert", "frexporter_scrape_job"})

# Every query left out under AVAILABLE, as (dashboard uid, panel title), once per query. Adding a query
# that this job cannot feed must update this list, and so must a new condition being met.
EXCLUDED = sorted([
    ("frexporter-job", "GPU Xid events by rank"),  # gpu, xid
    ("frexporter-job", "GPUs throttled by reason"),  # gpu
    ("frexporter-pg", "Collective bytes by op"),  # collective_metrics
    ("frexporter-pg", "Collective duration by op"),  # collective_metrics: p50
    ("frexporter-pg", "Collective duration by op"),  # collective_metrics: p99
    ("frexporter-pg", "Last started collective per rank (NCCL)"),  # nccl_timing
    ("frexporter-rank", "GPU ECC errors"),
    ("frexporter-rank", "GPU NVLink errors"),
    ("frexporter-rank", "GPU Xid events"),
    ("frexporter-rank", "GPU lost"),
    ("frexporter-rank", "GPU memory"),  # used
    ("frexporter-rank", "GPU memory"),  # total
    ("frexporter-rank", "GPU power"),
    ("frexporter-rank", "GPU temperature"),
    ("frexporter-rank", "GPU throttle reasons"),
    ("frexporter-rank", "GPU utilization"),
    ("frexporter-rank", "Recorder errors"),  # recorder_errors: a healthy recorder has none
])
MAX_EXCLUDED_FRACTION = 0.25


def _returns_data(promstack: PromStack, promql: str) -> bool:
    return bool(promstack.query(promql))


@pytest.mark.e2e
def test_every_dashboard_query_returns_data_for_a_desync(
    promstack: PromStack, job_factory: Callable[..., Job], exporter_factory: Callable[..., Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    require_module("grafana_foundation_sdk", "grafana-foundation-sdk (the test extra)")  # dev tooling
    from grafana import generate

    assert AVAILABLE <= generate.Needs.ALL
    job_id = "views-dashboards"
    job = _pair_skip_job(job_factory, job_id)
    _watch(promstack, exporter_factory, job)
    _skip_pair_collective(job)
    # Everything the conditions promise: an exporter verdict and a firing alert on this job.
    wait_for(lambda: promstack.query(f'{n.VERDICT}{{job_id="{job_id}",kind="{MISSING_RANK}",rank="3"}}'),
             timeout=SEEN_TIMEOUT_S, interval=POLL_S, what="the exporter's verdict in Prometheus")
    wait_for(lambda: promstack.query(f'ALERTS{{alertname="{DESYNC}",job_id="{job_id}",alertstate="firing"}}'),
             timeout=JOB_TIMEOUT_S / 2, interval=POLL_S, what=f"{DESYNC} firing")
    pair = promstack.query(f'{n.PG_INFO}{{job_id="{job_id}",pg_desc="pair23"}}')
    assert pair, "no pg_info for pair23"
    # The culprit and the PG it skipped: where rank 2 waits (in flight) and the rank dashboard's verdict.
    variables = {n.L_JOB_ID: job_id, n.L_PG: pair[0]["metric"][n.L_PG], n.L_RANK: "3"}

    every = generate.all_panel_queries(variables)
    chosen = generate.all_panel_queries(variables, available=AVAILABLE)
    excluded = sorted((Counter((uid, title) for uid, title, _ in every)
                       - Counter((uid, title) for uid, title, _ in chosen)).elements())
    assert excluded == EXCLUDED
    assert len(excluded) <= MAX_EXCLUDED_FRACTION * len(every), (len(excluded), len(every))

    pending = {expr: (uid, title) for uid, title, expr in chosen}

    def all_answered() -> bool:
        for expr in list(pending):
            if _returns_data(promstack, expr):
                del pending[expr]
        return not pending

    try:
        wait_for(all_answered, timeout=SEEN_TIMEOUT_S, interval=POLL_S, what="data for every panel query")
    except AssertionError:
        empty = "\n".join(f"  {uid} / {title}: {expr}" for expr, (uid, title) in pending.items())
        raise AssertionError(f"{len(pending)} of {len(chosen)} queries returned no data:\n{empty}") from None
    _assert_alive(job)
    # What the culprit is doing, where on-call reads it: rank 3 skipped ahead and blocks in WORLD.
    (verdicts,) = [expr for uid, title, expr in chosen if (uid, title) == (generate.UID_JOB, "Open verdicts")]
    rows = [row for row in promstack.query(verdicts) if row["metric"][n.L_RANK] == "3"]
    assert rows and {row["metric"][n.L_STATE] for row in rows} == {ACTIVITY_IN_COLLECTIVE}, rows
    assert all(float(row["value"][1]) >= 0 for row in rows), rows  # seconds in that state, not the NaN fallback
    (activity,) = [expr for uid, title, expr in chosen if (uid, title) == (generate.UID_RANK, "Activity")]
    (code,) = promstack.query(activity)
    assert float(code["value"][1]) == generate.ACTIVITY_STYLE[ACTIVITY_IN_COLLECTIVE][0], code
    # The ones left out must still be valid PromQL for this Prometheus (an empty answer, not an error).
    for _, _, expr in every:
        promstack.query(expr)
    with capsys.disabled():
        print(f"\n[views] {len(chosen)} dashboard queries returned data for {job_id}; "
              f"{len(excluded)} excluded (GPU, NCCL timing, collective metrics, recorder errors)")


# --- how promview.rebuild reads series (canned answers) -------------------------------------------------------

NOW = 1_700_000_000.0


def _sample(metric: str, value: float, scraped: float, **labels: str) -> dict[str, Any]:
    # "_scraped" is the fake's own: the sample's timestamp, which only timestamp() reveals.
    return {"metric": {"__name__": metric, "job": "frexporter", **labels}, "value": [NOW, repr(value)],
            "_scraped": scraped}


def _pg(metric: str, value: float, rank: int, instance: str = "node0:9400", scraped: float = NOW - 1,
        **extra: str) -> dict[str, Any]:
    return _sample(metric, value, scraped, job_id="j", rank=str(rank), pg="0", pg_desc="default_pg",
                   instance=instance, **extra)


def _pg_static(metric: str, value: float, instance: str = "node0:9400", scraped: float = NOW - 1,
               **extra: str) -> dict[str, Any]:
    """A PG fact the exporter reports once per node, without a rank."""
    return _sample(metric, value, scraped, job_id="j", pg="0", pg_desc="default_pg", instance=instance, **extra)


def _rank(metric: str, value: float, rank: int, instance: str = "node0:9400", scraped: float = NOW - 1,
          **extra: str) -> dict[str, Any]:
    return _sample(metric, value, scraped, job_id="j", rank=str(rank), instance=instance, **extra)


def _answers(samples: list[dict[str, Any]]) -> dict[Query, list[dict[str, Any]]]:
    """What prometheus.fetch returns for samples of one job: each query's, those of its metric; timestamp()'s
    carry when the sample was scraped, and a sample marked ``_past`` was seen in the window (max_over_time)
    only, not now."""
    out: dict[Query, list[dict[str, Any]]] = {}
    for q in Query:
        found = [s for s in samples if s["metric"]["__name__"] == q.metric
                 and (q is Query.BUSY_LATELY or not s.get("_past"))]
        if q is Query.SCRAPED:  # like Prometheus: the name is dropped, the value is when the sample was scraped
            out[q] = [{"metric": {k: v for k, v in s["metric"].items() if k != "__name__"},
                       "value": [NOW, repr(s["_scraped"])]} for s in found]
        else:
            out[q] = [{"metric": s["metric"], "value": s["value"]} for s in found]
    return out


def _served(samples: list[dict[str, Any]]) -> Any:
    """prometheus.fetch standing in for the server, for report.from_prometheus."""
    return mock.patch.object(prometheus, "fetch", lambda *_a, **_k: _answers(samples))


def _rank_series(rank: int, enq: int, done: int, world: int = 3, instance: str = "node0:9400",
                 heartbeat: float = NOW - 1.5, oldest: float | None = None) -> list[dict[str, Any]]:
    """What one exporter reports for one rank of a job whose only PG is WORLD."""
    out = [
        _rank(n.RANK_UP, 1, rank, instance),
        _rank(n.RANK_HEARTBEAT_TIMESTAMP_SECONDS, heartbeat, rank, instance),
        _rank(n.RANK_INFO, 1, rank, instance, world_size=str(world), local_rank=str(rank)),
        _pg_static(n.PG_INFO, 1, instance, size=str(world), backend="nccl"),
        _pg(n.PG_LAST_ENQUEUED_SEQ, enq, rank, instance),
        _pg(n.PG_LAST_COMPLETED_SEQ, done, rank, instance),
        _pg(n.PG_INFLIGHT_COLLECTIVES, enq - done, rank, instance),
        _pg_static(n.PG_TIMEOUT_SECONDS, 600, instance),
    ]
    if oldest is not None:
        out.append(_pg(n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS, oldest, rank, instance))
    return out


def _states(samples: list[dict[str, Any]]) -> tuple[Any, ...]:
    return promview.rebuild(_answers(samples), NOW).ranks


def test_a_rank_without_series_is_still_a_member_of_the_world_pg() -> None:
    # Rank 2's node exporter is gone: ranks 0 and 1 wait in collective 8, which rank 2 never reported.
    samples = [*_rank_series(0, 8, 7, oldest=NOW - 100), *_rank_series(1, 8, 7, oldest=NOW - 100)]
    states = _states(samples)
    assert [pg.ranks for r in states for pg in r.pgs] == [(0, 1, 2), (0, 1, 2)]
    verdicts = evaluate(states, NOW, VerdictConfig(stuck_after=30, complete_view=True))
    assert [(v.kind, v.ranks) for v in verdicts] == [(MISSING_RANK, (2,))], verdicts


def test_a_rank_reported_by_two_exporters_is_read_from_the_fresher() -> None:
    # A sidecar and a node exporter both read rank 1, and "b" is 20 s behind. Series come back sorted by
    # labels, so reading "the last one" takes b's seqs, and a's in-flight start on top of them.
    samples = [
        *_rank_series(0, 9, 8, oldest=NOW - 100),
        *_rank_series(1, 9, 8, instance="a:9400", heartbeat=NOW - 1.2, oldest=NOW - 100),
        *_rank_series(1, 8, 8, instance="b:9400", heartbeat=NOW - 20),
    ]
    rank1 = next(r for r in _states(samples) if r.rank == 1)
    assert [(pg.last_enqueued, pg.last_completed, pg.inflight_count) for pg in rank1.pgs] == [(9, 8, 1)]
    assert rank1.pgs[0].inflight[0].created == NOW - 100
    assert rank1.heartbeat == NOW - 1.2


def test_job_id_is_quoted_in_promql() -> None:
    asked: list[str] = []

    def record(_url: str, promql: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        asked.append(promql)
        return []

    with mock.patch.object(prometheus, "query", record):
        assert prometheus.rank_states("http://prometheus", 'a"b\\c', NOW) == ()
    assert len(asked) == len(Query) and all('{job_id="a\\"b\\\\c"}' in q for q in asked), asked


def test_heartbeat_staleness_is_judged_at_the_scrape() -> None:
    # Prometheus scrapes every 60 s: at query time a healthy rank's heartbeat is up to 60 s old, but it
    # was fresh when scraped. Rank 1's was already 40 s stale at its scrape: wedged.
    scraped = NOW - 55
    samples = [
        _rank(n.RANK_UP, 1, 0, scraped=scraped),
        _rank(n.RANK_HEARTBEAT_TIMESTAMP_SECONDS, scraped - 1, 0, scraped=scraped),
        _rank(n.RANK_UP, 1, 1, scraped=scraped),
        _rank(n.RANK_HEARTBEAT_TIMESTAMP_SECONDS, scraped - 40, 1, scraped=scraped),
    ]
    status = {r.rank: r.status for r in _states(samples)}
    assert status == {0: RANK_OK, 1: RANK_UNRESPONSIVE}


def test_analyze_prometheus_names_the_absent_ranks() -> None:
    # A world of 4: ranks 0 and 1 report and wait in collective 8; ranks 2 and 3 never reported anything.
    samples = [*_rank_series(0, 8, 7, world=4, oldest=NOW - 100), *_rank_series(1, 8, 7, world=4, oldest=NOW - 100)]
    with _served(samples), mock.patch("time.time", return_value=NOW):
        found = report.from_prometheus("http://prometheus", "j", stuck_after=30)
    absent = [v for v in found.verdicts if v.kind == RANK_ABSENT]
    assert [(v.ranks, v.waiting_ranks) for v in absent] == [((2, 3), (0, 1))], found.verdicts
    assert "rank_absent: job j, culprit rank(s) 2,3" in report.render_text(found)
    # All of the world reporting: nothing absent.
    full = [*samples, *_rank_series(2, 8, 8, world=4), *_rank_series(3, 8, 8, world=4)]
    with _served(full):
        assert not [v for v in report.from_prometheus("http://prometheus", "j", 30).verdicts if v.kind == RANK_ABSENT]


def test_analyze_prometheus_says_what_the_culprit_is_doing() -> None:
    # Rank 2 never joined collective 8; its node's exporter saw it busy in save_checkpoint. A bad label value
    # (not a state) is ignored, not trusted.
    samples = [*_rank_series(0, 8, 7, oldest=NOW - 100), *_rank_series(1, 8, 7, oldest=NOW - 100),
               *_rank_series(2, 7, 7),
               _rank(n.VERDICT, 1, 2, kind=MISSING_RANK, pg="0", culprit_state="busy",
                     culprit_function="save_checkpoint"),
               _rank(n.VERDICT, 1, 1, kind=MISSING_RANK, pg="0", culprit_state="<script>", culprit_function="x")]
    states = {r.rank: r for r in _states(samples)}
    assert states[2].activity.state == "busy" and states[2].activity.headline() == ("save_checkpoint", "", 0)
    assert states[1].activity.state == "unknown"
    (v,) = evaluate(states.values(), NOW, VerdictConfig(stuck_after=30, complete_view=True))
    assert v.ranks == (2,) and v.activity["2"].state == "busy"
    assert v.summary.endswith("Rank 2 has been busy in save_checkpoint.")


def test_analyze_prometheus_uses_the_learned_threshold_and_shows_a_wait_below_it() -> None:
    # Ranks 0 and 1 wait in collective 8 since 20 s; rank 2 never enqueued it.
    samples = [*_rank_series(0, 8, 7, oldest=NOW - 20), *_rank_series(1, 8, 7, oldest=NOW - 20),
               *_rank_series(2, 7, 7)]

    def analyze(extra: list[dict[str, Any]]) -> report.Report:
        with _served([*samples, *extra]), mock.patch("time.time", return_value=NOW):
            return report.from_prometheus("http://prometheus", "j", stuck_after=60)

    # The exporters learned 10 s (node1's 25 s loses to the shortest): blamed now, as the alert does.
    learned = analyze([_pg_static(n.PG_STUCK_THRESHOLD_SECONDS, 10, "node0:9400"),
                       _pg_static(n.PG_STUCK_THRESHOLD_SECONDS, 25, "node1:9400")])
    assert [(v.kind, v.ranks) for v in learned.verdicts] == [(MISSING_RANK, (2,))], learned.verdicts
    # Without the series (an older exporter): --stuck-after; the wait is shown, never "nothing found".
    for extra, threshold in (([], 60), ([_pg_static(n.PG_STUCK_THRESHOLD_SECONDS, 30, "node0:9400")], 30)):
        found = analyze(extra)
        assert found.verdicts == ()
        text = report.render_text(found)
        assert "no stuck collective found" not in text
        assert (f"waiting: job j, PG 0 (default_pg), collective #8: ranks 0,1 wait on rank(s) 2 for 20s "
                f"(threshold {threshold}s)") in text, text


def test_analyze_prometheus_gives_a_busy_culprit_the_ceiling_and_an_idle_one_the_learned_threshold() -> None:
    # As FrexporterCollectiveDesync does: ranks 0 and 1 wait in collective 8 for rank 2, which never enqueued
    # it. The exporters learned 10 s for the PG and the shortest --stuck-after among them (the ceiling) is 30 s;
    # what rank 2 is doing (its activity series) decides which of the two the wait is judged against.
    pg = [_pg_static(n.PG_STUCK_THRESHOLD_SECONDS, 10), _pg_static(n.PG_STUCK_CEILING_SECONDS, 30),
          _pg_static(n.PG_STUCK_CEILING_SECONDS, 300, instance="node1:9400")]

    def analyze(waited: float, *extra: dict[str, Any], stuck_after: float | None = None) -> report.Report:
        samples = [*_rank_series(0, 8, 7, oldest=NOW - waited), *_rank_series(1, 8, 7, oldest=NOW - waited),
                   *_rank_series(2, 7, 7), *pg, *extra]
        with _served(samples), mock.patch("time.time", return_value=NOW):
            return report.from_prometheus("http://prometheus", "j", stuck_after)

    def doing(state: str, since: float = NOW - 40) -> dict[str, Any]:
        return _rank(n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS, since, 2, state=state)

    # Busy for 20 s of wait: above the learned 10 s, below the 30 s ceiling: a wait, not a hang.
    busy = analyze(20, doing("busy"))
    assert busy.verdicts == (), busy.verdicts
    text = report.render_text(busy)
    assert ("waiting: job j, PG 0 (default_pg), collective #8: ranks 0,1 wait on rank(s) 2 (busy) for 20s "
            "(threshold 30s)") in text, text
    assert next(r for r in busy.ranks if r.rank == 2).activity.since == NOW - 40
    # Past the ceiling, busy or not, it is a hang; also where analyze is given a longer --stuck-after.
    assert [(v.kind, v.ranks) for v in analyze(31, doing("busy")).verdicts] == [(MISSING_RANK, (2,))]
    assert [(v.kind, v.ranks) for v in analyze(31, doing("busy"), stuck_after=60).verdicts] == [
        (MISSING_RANK, (2,))]
    # Idle (or wedged, gone, unknown, blocked in another collective): the learned threshold.
    for state in ("idle", "wedged", "unknown", "in_collective"):
        hung = analyze(20, doing(state))
        assert [(v.kind, v.ranks, v.seq, v.pg) for v in hung.verdicts] == [(MISSING_RANK, (2,), 8, "0")], state
        if state != "unknown":
            assert f"missing_rank: job j, PG 0 (default_pg), collective #8, culprit rank(s) 2 ({state})" in (
                report.render_text(hung)), report.render_text(hung)
    # The state a rank left can linger a scrape next to its new one: the newest begun is current.
    assert analyze(20, doing("idle", NOW - 60), doing("busy", NOW - 25)).verdicts == ()
    # Idle now, busy within the last minute (CPU use at the busy line): still held, as the alert holds it.
    flipped = analyze(20, doing("idle", NOW - 5), {**doing("busy", NOW - 40), "_past": True})
    assert flipped.verdicts == (), flipped.verdicts
    assert "wait on rank(s) 2 (idle) for 20s (threshold 30s)" in report.render_text(flipped)
    # The exporters' ceiling holds when it is above analyze's default --stuck-after (60 s); a --stuck-after
    # given to analyze caps it.
    pg[1] = _pg_static(n.PG_STUCK_CEILING_SECONDS, 300)
    assert analyze(90, doing("busy")).verdicts == ()
    assert [v.ranks for v in analyze(90, doing("busy"), stuck_after=60).verdicts] == [(2,)]


def test_analyze_prometheus_without_activity_series_judges_as_before() -> None:
    # An older exporter exports neither the activity series nor the ceiling: the culprit's state comes from
    # the exporter's own verdict (culprit_state), and a busy culprit gets analyze's --stuck-after.
    samples = [*_rank_series(0, 8, 7, oldest=NOW - 20), *_rank_series(1, 8, 7, oldest=NOW - 20),
               *_rank_series(2, 7, 7), _pg_static(n.PG_STUCK_THRESHOLD_SECONDS, 10)]
    verdict = _rank(n.VERDICT, 1, 2, kind=MISSING_RANK, pg="0", culprit_state="busy", culprit_function="save")

    def analyze(*extra: dict[str, Any]) -> report.Report:
        with _served([*samples, *extra]), mock.patch("time.time", return_value=NOW):
            return report.from_prometheus("http://prometheus", "j")

    assert [v.ranks for v in analyze().verdicts] == [(2,)]  # nothing known of rank 2: the learned 10 s
    held = analyze(verdict)
    assert held.verdicts == ()
    assert "wait on rank(s) 2 (busy) for 20s (threshold 60s)" in report.render_text(held)
    # Where both say something, the activity series' state wins and the verdict's function goes with it
    # only when the two agree.
    current = analyze(verdict, _rank(n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS, NOW - 30, 2, state="busy"))
    activity = next(r for r in current.ranks if r.rank == 2).activity
    assert (activity.state, activity.headline(), activity.since) == ("busy", ("save", "", 0), NOW - 30)
    changed = analyze(verdict, _rank(n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS, NOW - 3, 2, state="idle"))
    assert next(r for r in changed.ranks if r.rank == 2).activity.frames == ()
    assert [v.ranks for v in changed.verdicts] == [(2,)]
