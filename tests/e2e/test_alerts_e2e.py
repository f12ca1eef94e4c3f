"""The shipped alert rules end to end: real gloo jobs, a real exporter, real Prometheus and Alertmanager.

Every test runs its own job (its own job_id) and its own exporter on the port the session's Prometheus
scrapes, and judges only the alerts that carry its job_id. Timings are the shipped ones scaled by
tests.promstack.SCALE.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.harness import Job, hold, wait_for
from tests.promstack import INTERVAL_S, SCALE, Notification, PromStack
from tests.rulefile import alert_for, desync_timing

DESYNC = "FrexporterCollectiveDesync"
RANK_DOWN = "FrexporterRankDown"
RANK_ABSENT = "FrexporterRankAbsent"
JOB_TIMEOUT_S = 60.0  # gloo's own timeout in the desync job: the page must come well before it
POLL_S = 0.2


def _start_exporter(promstack: PromStack, exporter_factory: Callable[..., Any], job: Job) -> None:
    threshold, _ = desync_timing(SCALE)
    since = time.time()
    # stuck_after at the rules' threshold, so the exporter's own verdict (quoted in the alert's
    # description) is there when the alert fires.
    exporter_factory(job.spool, port=promstack.exporter_port, stuck_after=threshold)
    promstack.wait_target_up(since)

    def all_up() -> bool:
        return len(promstack.query(f'frexporter_rank_up{{job_id="{job.job_id}"}} == 1')) == job.world

    wait_for(all_up, timeout=15, interval=POLL_S, what=f"Prometheus sees every rank of {job.job_id} up")


def _firing(promstack: PromStack, alertname: str, job_id: str) -> list[Notification]:
    return [n for n in promstack.webhook.notifications(alertname=alertname, job_id=job_id) if n.status == "firing"]


def _report(capsys: pytest.CaptureFixture[str], line: str) -> None:
    with capsys.disabled():
        print(f"\n[e2e] {line}")


def test_skipped_subgroup_collective_pages_only_the_root_rank(
    promstack: PromStack, job_factory: Callable[..., Job], exporter_factory: Callable[..., Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    job_id = "e2e-pair-skip"
    job = job_factory("pair_skip", 4, job_id=job_id,
                      env={"JOB_TIMEOUT": f"{JOB_TIMEOUT_S:g}", "JOB_STEP_SECONDS": "0.5"})
    job.wait_ready()
    _start_exporter(promstack, exporter_factory, job)
    job.touch("skip")
    job.wait_ready("skipped", ranks=[3], timeout=10)
    skipped_at = job.marker(3, "skipped").stat().st_mtime

    firing = wait_for(lambda: _firing(promstack, DESYNC, job_id), timeout=JOB_TIMEOUT_S / 2, interval=0.05,
                      what=f"{DESYNC} for {job_id} at the webhook")
    latency = firing[0].received - skipped_at
    assert all(proc.poll() is None for proc in job.procs), "a rank exited before the page: gloo timed out?"
    assert latency < JOB_TIMEOUT_S
    root = firing[0].labels
    assert (root["rank"], root["pg_desc"]) == ("3", "pair23"), root
    assert root["severity"] == "warning"
    assert root["culprit_state"] == "in_collective", root  # it skipped ahead and blocks in WORLD
    assert "Rank 3 of job e2e-pair-skip" in firing[0].annotations["summary"]

    # Rank 2 lags in WORLD a step's compute after rank 3 lags in the pair PG, so had the rules blamed it,
    # it would have gone pending by now and fire within one "for" and a notification round trip more.
    threshold, hold_for = desync_timing(SCALE)

    def only_rank_3() -> None:
        noted = {(n.labels["rank"], n.labels["pg_desc"]) for n in promstack.webhook.notifications(job_id=job_id)}
        assert noted <= {("3", "pair23")}, noted
        active = {(a["labels"]["rank"], a["labels"]["pg_desc"], a["state"])
                  for a in promstack.alerts(alertname=DESYNC, job_id=job_id)}
        assert {(rank, pg) for rank, pg, _ in active} <= {("3", "pair23")}, active

    hold(only_rank_3, hold_for + 4.0, POLL_S)
    # Anything that came and went between two polls, pending included.
    window = int(time.time() - skipped_at) + 2
    others = promstack.query(f'max_over_time(ALERTS{{job_id="{job_id}",rank!="3"}}[{window}s])')
    assert others == [], others
    _report(capsys, f"{DESYNC} rank 3 (pair23): webhook {latency:.2f}s after the skip "
                    f"(threshold {threshold:g}s, for {hold_for:g}s, gloo timeout {JOB_TIMEOUT_S:g}s)")


def test_legitimately_slow_rank0_does_not_page(
    promstack: PromStack, job_factory: Callable[..., Job], exporter_factory: Callable[..., Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    job_id = "e2e-slow-rank0"
    threshold, hold_for = desync_timing(SCALE)
    slow = threshold / 2  # below the threshold by more than a poll, a scrape and an evaluation
    job = job_factory("slow_rank0", 3, job_id=job_id, env={"JOB_SLOW_SECONDS": f"{slow:g}"})
    job.wait_ready()
    _start_exporter(promstack, exporter_factory, job)
    age = f'max(time() - frexporter_pg_oldest_inflight_start_timestamp_seconds{{job_id="{job_id}"}})'
    # The quiet window proves nothing unless Prometheus really sees ranks 1 and 2 waiting on rank 0.
    wait_for(lambda: promstack.query(f"{age} >= {slow / 3:g}"), timeout=15, interval=POLL_S,
             what="Prometheus sees the others waiting on rank 0")
    seq = f'max(frexporter_pg_last_completed_seq{{job_id="{job_id}",pg_desc="default_pg"}})'
    seq_before = float(promstack.query(seq)[0]["value"][1])
    started = time.time()

    def quiet() -> None:
        assert promstack.webhook.notifications(job_id=job_id) == []
        firing = [a for a in promstack.alerts(job_id=job_id) if a["state"] == "firing"]
        assert firing == [], firing

    window = 2 * (threshold + hold_for) + 1.0
    hold(quiet, window, POLL_S)
    span = int(time.time() - started) + 1
    assert promstack.query(f'max_over_time(ALERTS{{job_id="{job_id}",alertstate="firing"}}[{span}s])') == []
    longest = float(promstack.query(f"max_over_time(({age})[{span}s:])")[0]["value"][1])
    steps = float(promstack.query(seq)[0]["value"][1]) - seq_before
    # Healthy: it kept stepping at rank 0's pace through the window, while the others waited each time.
    assert steps >= window / slow / 2, steps
    _report(capsys, f"slow rank 0 ({slow:g}s per step, {steps:.0f} steps): no alert in {window:g}s; "
                    f"longest wait Prometheus saw {longest:.2f}s (threshold {threshold:g}s)")


@pytest.mark.parametrize(("mode", "severity"), [("busy", "info"), ("idle", "warning")])
def test_desync_alert_says_what_the_culprit_is_doing(
    promstack: PromStack, job_factory: Callable[..., Job], exporter_factory: Callable[..., Any],
    capsys: pytest.CaptureFixture[str], mode: str, severity: str,
) -> None:
    # Rank 0 waits in an all_reduce; rank 1 computes in Python (busy) or sleeps (idle) instead. The label
    # comes from rank 1's activity series through Prometheus; a busy culprit is info, so routing can hold it.
    # (Here the exporter's learned threshold is still its ceiling, a cold start: when the hold ends is
    # tests/rules/activity_test.yml's to show.)
    job_id = f"e2e-culprit-{mode}"
    job = job_factory("culprit", 2, job_id=job_id, env={"JOB_CULPRIT": mode, "JOB_TIMEOUT": f"{JOB_TIMEOUT_S:g}"})
    job.wait_ready()
    _start_exporter(promstack, exporter_factory, job)
    firing = wait_for(lambda: _firing(promstack, DESYNC, job_id), timeout=JOB_TIMEOUT_S / 2, interval=0.05,
                      what=f"{DESYNC} for {job_id} at the webhook")
    labels = firing[0].labels
    assert (labels["rank"], labels["culprit_state"], labels["severity"]) == ("1", mode, severity), labels
    assert f"Rank 1 is {mode}" in firing[0].annotations["description"], firing[0].annotations
    job.touch("stop")
    _report(capsys, f"{DESYNC}, {mode} culprit: culprit_state={labels['culprit_state']}, "
                    f"severity={labels['severity']}")


def test_sigkilled_rank_pages_rank_down(
    promstack: PromStack, job_factory: Callable[..., Job], exporter_factory: Callable[..., Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    job_id = "e2e-kill"
    job = job_factory("kill", 2, job_id=job_id)
    job.wait_ready()
    _start_exporter(promstack, exporter_factory, job)
    job.touch("kill")
    wait_for(lambda: job.procs[1].poll() is not None, timeout=10, what="rank 1 killed")
    killed_at = time.time()

    firing = wait_for(lambda: _firing(promstack, RANK_DOWN, job_id), timeout=30, interval=0.05,
                      what=f"{RANK_DOWN} for {job_id} at the webhook")
    latency = firing[0].received - killed_at
    assert {n.labels["rank"] for n in firing} == {"1"}
    assert firing[0].labels["severity"] == "critical"
    hold_for = alert_for(RANK_DOWN, SCALE)
    _report(capsys, f"{RANK_DOWN} rank 1: webhook {latency:.2f}s after SIGKILL (for {hold_for:g}s)")


def test_rank_failing_before_init_pages_rank_absent(
    promstack: PromStack, job_factory: Callable[..., Job], exporter_factory: Callable[..., Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    # torchrun-like, 3 ranks: rank 1 crashes before install(); ranks 0 and 2 wait in init_process_group.
    job_id = "e2e-absent"
    job = job_factory("pre_init_fail", 3, job_id=job_id, launcher_env=True)
    try:
        threshold, _ = desync_timing(SCALE)
        since = time.time()
        exporter_factory(job.spool, port=promstack.exporter_port, stuck_after=threshold)
        promstack.wait_target_up(since)

        def two_reporting() -> bool:
            return len(promstack.query(f'frexporter_rank_info{{job_id="{job_id}"}}')) == 2

        wait_for(two_reporting, timeout=30, interval=POLL_S, what=f"Prometheus sees ranks 0 and 2 of {job_id}")
        seen_at = time.time()
        hold_for = alert_for(RANK_ABSENT, SCALE)
        firing = wait_for(lambda: _firing(promstack, RANK_ABSENT, job_id), timeout=hold_for + 60, interval=0.1,
                          what=f"{RANK_ABSENT} for {job_id} at the webhook")
        latency = firing[0].received - seen_at
        assert latency >= hold_for - 2 * INTERVAL_S, latency  # not before its "for"
        assert firing[0].labels["severity"] == "warning"
        assert firing[0].annotations["summary"].startswith("1 rank(s) of job e2e-absent"), firing[0].annotations
        _report(capsys, f"{RANK_ABSENT}: webhook {latency:.2f}s after Prometheus saw 2 of 3 ranks (for {hold_for:g}s)")
    finally:
        for proc in job.procs:  # blocked in init_process_group: the stop file is never read
            if proc.poll() is None:
                proc.kill()
                proc.wait()
