"""One answer everywhere: a job split over two exporters, one Prometheus, the alert and `analyze --prometheus`.

A real 4-rank gloo job whose ranks 0-1 publish to one spool and ranks 2-3 to another (two nodes), one
exporter per spool, both scraped by the session's Prometheus with the shipped rules (scaled). Rank 3 stops
calling collectives and sleeps (an idle culprit, on the second exporter) while ranks 0, 1 and 2 wait for it
in WORLD. While the wait is below the PG's learned threshold, `frexporter analyze --prometheus` already
shows it (who waits on whom, what the culprit does, for how long, against which threshold); once
FrexporterCollectiveDesync fires, analyze names the rank, PG and seq the alert names, as a hang.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from frexporter import cli
from frexporter import naming as n
from tests.harness import Job, wait_for
from tests.promstack import PromStack

DESYNC = "FrexporterCollectiveDesync"
JOB_ID = "two-exporters"
CULPRIT = 3
WAITERS = (0, 1, 2)
STUCK_FLOOR_S = 5.0  # the learned threshold of a steady job: long enough to watch a wait below it
STUCK_AFTER_S = 12.0  # the ceiling (a busy culprit's threshold): above the floor, so the two differ
JOB_TIMEOUT_S = 60.0  # gloo's: the page must come long before the ranks give up
SEEN_TIMEOUT_S = 20.0  # for Prometheus to show what the exporters serve (scrapes, learning, evaluations)
FIRE_TIMEOUT_S = STUCK_FLOOR_S + 20.0  # the threshold, a scaled "for", evaluations and scrapes
POLL_S = 0.2
WAIT_SEEN_S = 1.0  # an in-flight age a healthy steady job never shows (its collectives take milliseconds)


def _analyze(promstack: PromStack, *extra: str) -> str:
    """`frexporter analyze --prometheus URL --job-id J` as the CLI runs it (in process: it is polled), its output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["analyze", "--prometheus", promstack.prom_url, "--job-id", JOB_ID, *extra])
    assert code == 0, out.getvalue()
    return out.getvalue()


def _firing(promstack: PromStack) -> list[dict[str, Any]]:
    return [a for a in promstack.alerts(alertname=DESYNC, job_id=JOB_ID) if a["state"] == "firing"]


def _static(promstack: PromStack, metric: str) -> dict[str, float]:
    """WORLD's per-node fact ``metric`` by exporter (instance)."""
    found = promstack.query(f'{metric}{{job_id="{JOB_ID}",pg_desc="default_pg"}}')
    return {s["metric"]["instance"]: float(s["value"][1]) for s in found}


def _assert_alive(job: Job) -> None:
    dead = [rank for rank, proc in enumerate(job.procs) if proc.poll() is not None and rank != CULPRIT]
    assert not dead, f"ranks {dead} exited (gloo timed out?):\n{job.log(dead[0])}"


def test_analyze_prometheus_and_the_alert_agree_on_a_job_over_two_exporters(
    promstack: PromStack, job_factory: Callable[..., Job], exporter_factory: Callable[..., Any],
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    assert len(promstack.exporter_ports) >= 2, "the session's Prometheus scrapes one exporter port only"
    spools = (tmp_path / "node-a", tmp_path / "node-b")
    job = job_factory("steady", 4, job_id=JOB_ID,
                      env={"JOB_TIMEOUT": f"{JOB_TIMEOUT_S:g}", "JOB_VICTIM": str(CULPRIT)},
                      rank_env={rank: {"FREXPORTER_DIR": str(spools[rank // 2])} for rank in range(4)})
    job.wait_ready()
    since = time.time()
    ports = promstack.exporter_ports[:2]
    for spool, port in zip(spools, ports, strict=True):
        exporter_factory(spool, port=port, stuck_after=STUCK_AFTER_S, stuck_floor=STUCK_FLOOR_S)
    for port in ports:
        promstack.wait_target_up(since, port=port)

    # Healthy first: both exporters report their two ranks, and have learned WORLD's threshold (the floor).
    def reporting() -> dict[str, set[str]]:
        up = promstack.query(f'{n.RANK_UP}{{job_id="{JOB_ID}"}} == 1')
        by_exporter: dict[str, set[str]] = {}
        for s in up:
            by_exporter.setdefault(s["metric"]["instance"], set()).add(s["metric"][n.L_RANK])
        return by_exporter

    exporters = wait_for(lambda: len(reporting()) == 2 and reporting(), timeout=SEEN_TIMEOUT_S, interval=POLL_S,
                         what="Prometheus sees ranks 0-1 on one exporter and 2-3 on the other")
    assert sorted(map(sorted, exporters.values())) == [["0", "1"], ["2", "3"]], exporters
    learned = wait_for(lambda: (t := _static(promstack, n.PG_STUCK_THRESHOLD_SECONDS)) and len(t) == 2
                       and set(t.values()) == {STUCK_FLOOR_S} and t,
                       timeout=SEEN_TIMEOUT_S, interval=POLL_S, what="both exporters' learned WORLD threshold")
    assert set(_static(promstack, n.PG_STUCK_CEILING_SECONDS).values()) == {STUCK_AFTER_S}
    threshold = min(learned.values())
    assert json.loads(_analyze(promstack, "--json")) == []

    job.touch("idle")  # rank 3 stops calling collectives and sleeps; 0, 1 and 2 block in WORLD's next one
    job.wait_ready("idled", ranks=[CULPRIT], timeout=10)
    idled_at = job.marker(CULPRIT, "idled").stat().st_mtime

    # a. From when Prometheus holds the wait until the alert fires, analyze shows it, never "nothing".
    waiting_age = (f'time() - {n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS}'
                   f'{{job_id="{JOB_ID}",pg_desc="default_pg"}} >= {WAIT_SEEN_S:g}')
    wait_for(lambda: len(promstack.query(waiting_age)) == len(WAITERS), timeout=SEEN_TIMEOUT_S, interval=0.1,
             what=f"Prometheus sees ranks {WAITERS} waiting")
    wait_line = re.compile(
        rf"waiting: job {JOB_ID}, PG (\S+) \(default_pg\), collective #(\d+): ranks 0,1,2 wait on "
        rf"rank\(s\) {CULPRIT} \(idle\) for (\d+)s \(threshold {threshold:.0f}s\)")
    hang_line = re.compile(rf"missing_rank: job {JOB_ID}, PG (\S+) \(default_pg\), collective #(\d+), "
                           rf"culprit rank\(s\) {CULPRIT} \(idle\)")
    below: list[tuple[str, int, int]] = []  # (pg, seq, seconds waited) of every wait shown below the threshold
    deadline = time.monotonic() + FIRE_TIMEOUT_S
    while not (firing := _firing(promstack)):
        assert time.monotonic() < deadline, f"{DESYNC} did not fire within {FIRE_TIMEOUT_S:g}s of the wait"
        text = _analyze(promstack)
        assert "no stuck collective found" not in text, text
        shown = wait_line.search(text)
        if shown is not None:
            below.append((shown[1], int(shown[2]), int(shown[3])))
        else:  # past the threshold, the alert pending: already the hang
            assert hang_line.search(text), text
        time.sleep(POLL_S)
    fired_at = time.time()
    _assert_alive(job)
    assert below, "analyze never showed the wait below its threshold before the alert fired"
    assert all(waited <= threshold for _, _, waited in below), below
    assert len({(pg, seq) for pg, seq, _ in below}) == 1, below

    # b. The alert and analyze name the same culprit, PG and seq, and analyze calls it a hang.
    (alert,) = firing
    labels = alert["labels"]
    assert (labels[n.L_RANK], labels[n.L_PG_DESC]) == (str(CULPRIT), "default_pg"), labels
    seq = int(float(alert["value"]))
    assert below[0][:2] == (labels[n.L_PG], seq), (below, labels, seq)
    verdicts = json.loads(_analyze(promstack, "--json"))
    assert [(v["kind"], v["ranks"], v["pg"], v["seq"]) for v in verdicts] == [
        ("missing_rank", [CULPRIT], labels[n.L_PG], seq)], verdicts
    (verdict,) = verdicts
    assert verdict["waiting_ranks"] == list(WAITERS), verdict
    assert verdict["activity"][str(CULPRIT)]["state"] == labels.get("culprit_state", "idle") == "idle", verdict
    text = _analyze(promstack)
    assert hang_line.search(text) and "waiting:" not in text, text
    with capsys.disabled():
        print(f"\n[two exporters] analyze showed the wait {len(below)}x below its {threshold:g}s threshold "
              f"({below[0][2]}-{below[-1][2]}s waited); {DESYNC} fired {fired_at - idled_at:.1f}s after rank "
              f"{CULPRIT} went idle; both name rank {CULPRIT}, PG {labels[n.L_PG]}, seq {seq} (alert's "
              f"culprit_state: {labels.get('culprit_state', 'none')})")
