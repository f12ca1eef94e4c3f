"""What people read out of Prometheus, against a real one scraping a real gloo job through the exporter.

- ``frexporter analyze --prometheus``: the whole-job view rebuilt from the series names the rank that
  skipped a collective (and nothing on the same job while it is healthy);
- the Grafana dashboards: every panel query returns data for a job with a desync in flight, except an
  explicit list of queries whose data this CPU job cannot produce (GPUs, NCCL timing, ...).

The unit tests in tests/unit/test_prometheus_views.py pin how ``promview.rebuild`` reads series (membership,
duplicates, heartbeats, activity) and how ``prometheus.fetch`` quotes the job, with canned query answers instead
of a Prometheus.
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

import pytest

from frexporter import naming as n
from frexporter.analysis.kinds import MISSING_RANK
from frexporter.model import ACTIVITY_IN_COLLECTIVE, Verdict
from frexporter.postmortem import report
from tests.harness import REPO, Job, require_module, wait_for
from tests.promstack import SCALE, PromStack
from tests.rulefile import desync_timing

DESYNC = "FrexporterCollectiveDesync"
JOB_TIMEOUT_S = 60.0  # gloo's timeout: every check below must be done well before the ranks give up
POLL_S = 0.25
SEEN_TIMEOUT_S = 20.0  # for Prometheus to show what the exporter already serves (scrape + rule evaluation)
ANALYZE_DEADLINE_S = 30.0  # from the skip to the verdict: the threshold and a few scrapes
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


STUCK_AFTER, _ = desync_timing(SCALE)  # the exporter's --stuck-after: its threshold, which the rules read


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
    # Reading only the active PGs' series per rank (WORLD and pair23; pair01 is idle: ranks 0 and 1 wait in WORLD)
    # judges as reading every PG's.
    narrowed = report.from_prometheus(promstack.prom_url, job_id, STUCK_AFTER)
    every = report.from_prometheus(promstack.prom_url, job_id, STUCK_AFTER, narrow=False)
    assert [_judged(v) for v in narrowed.verdicts] == [_judged(v) for v in every.verdicts] != []
    assert (narrowed.unread_pgs, every.unread_pgs) == (1, 0)
    assert sorted({pg.desc for r in narrowed.ranks for pg in r.pgs}) == ["default_pg", "pair23"]


def _judged(v: Verdict) -> tuple[object, ...]:
    """What a verdict says, without its ages (two analyses a moment apart)."""
    return (v.kind, v.job_id, v.pg, v.pg_desc, v.ranks, v.waiting_ranks, v.seq, v.op, v.timeout_seconds)


# --- dashboards --------------------------------------------------------------------------------------------


# What a CPU gloo job with a desync in flight, watched with the shipped rules, offers the dashboards.
AVAILABLE = frozenset({"recording_rules", "inflight", "wait", "verdict", "alert", "frexporter_scrape_job"})

# Every query left out under AVAILABLE, as (dashboard uid, panel title), once per query. Adding a query
# that this job cannot feed must update this list, and so must a new condition being met.
EXCLUDED = sorted([
    ("frexporter-job", "GPU Xid events by rank"),  # gpu, xid
    ("frexporter-job", "GPUs throttled by reason"),  # gpu
    ("frexporter-pg", "Collective bytes by op"),  # collective_metrics
    ("frexporter-pg", "Collective duration by op"),  # collective_metrics: p50
    ("frexporter-pg", "Arrival lag per rank"),  # collective_waits (gloo's arrivals)
    ("frexporter-pg", "Collective duration by op"),  # collective_metrics: p99
    ("frexporter-pg", "Last started collective per rank (NCCL)"),  # nccl_timing
    ("frexporter-pg", "Straggler ranking"),  # collective_waits: lag
    ("frexporter-pg", "Straggler ranking"),  # collective_waits: loss
    ("frexporter-pg", "Wait inside collectives per rank"),  # collective_waits
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
# 21 of 82 queries: the cross-node straggler row (waits, arrivals, ranking) needs --collective-waits and a PG
# of 3+ ranks running steadily, which this desync does not offer: tests/e2e/test_straggler_live.py checks the
# series under it, benchmarks/straggler.py the whole row's chain.
MAX_EXCLUDED_FRACTION = 0.26


def _returns_data(promstack: PromStack, promql: str) -> bool:
    return bool(promstack.query(promql))


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
              f"{len(excluded)} excluded (GPU, NCCL timing, collective metrics, collective waits, recorder errors)")
