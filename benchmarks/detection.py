"""Detection latency and false positives, end to end: real gloo jobs, the exporter, Prometheus, Alertmanager.

    python -m benchmarks.detection                 # inject each fault, print the latency table
    python -m benchmarks.detection --soak [SECONDS]  # a healthy, skewed job: count verdicts and alerts (0)
    python -m benchmarks.detection --steady          # idle, deadlock, SIGKILL at the shipped settings
    python -m benchmarks.detection --checkpoint-soak [SECONDS]  # busy evaluations and a 3-minute checkpoint

For each fault a fresh job (its own job_id) runs under one exporter on the port the stack's Prometheus
scrapes; the fault is injected through the job's control files (tests/workers/job.py) and timed from the
moment the rank acted on it (its marker file's mtime, or the SIGKILLed process's exit) to

- the first ``/api/v1/status`` of the exporter that carries the expected verdict naming the culprit, and
- the first Alertmanager webhook POST of the matching alert (firing) for the job.

The stack is tests/promstack.py: the shipped rules with every timing multiplied by ``--scale`` (0.1:
the desync threshold of 30 s becomes 3 s), scraped and evaluated every ``--interval`` seconds. The
exporter's ``stuck_after`` defaults to the scaled desync threshold, as in the e2e tests, and its
``deep_interval`` to the shipped one times the scale (the in-flight ages of a PG with p2p traffic lag by
up to that much, so left at 15 s it alone would outlast a 3 s threshold). All settings are printed with
the results. Exit status 1 when a fault goes undetected or blames the wrong rank, or when the soak sees
any verdict or fired alert.

The checkpoint soak runs at the shipped settings (rules unscaled, scrape and evaluation every 15 s, the
default ``serve`` flags, the recorder's default snapshot interval) with Alertmanager routed as
docs/detection.md recommends: alerts whose culprit is busy go to a "hold" receiver, all others to "page".
Rank 0 evaluates (computes in Python) 20 s every few hundred steps and checkpoints (computes) 3 minutes once
while the others wait in the next collective. Exit status 1 on any page, on a verdict outside the
checkpoint, or when the checkpoint's verdict does not call its culprit busy or nothing reaches "hold".
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frexporter import defaults
from frexporter import naming as n
from frexporter.app import App, ServeConfig, build_app
from frexporter.sources.ranks import RanksConfig
from frexporter.spool import DEFAULT_SNAPSHOT_INTERVAL
from tests.harness import Job, wait_for
from tests.promstack import INTERVAL_S, SCALE, Notification, PromStack, running_stack
from tests.rulefile import load_rules, parse_duration

DESYNC = "FrexporterCollectiveDesync"
STALLED = "FrexporterCollectiveStalled"
BUDGET = "FrexporterWatchdogBudget"
RANK_DOWN = "FrexporterRankDown"
UNRESPONSIVE = "FrexporterRankUnresponsive"
STATUS_POLL_S = 0.1  # resolution of the verdict latency
SNAPSHOT_INTERVAL_S = 0.2  # FREXPORTER_SNAPSHOT_INTERVAL the harness gives the ranks
HTTP_TIMEOUT_S = 5.0
SOAK_JITTER_S = 0.3  # each soak step's random compute, at most
SOAK_PAUSE_EVERY = 5  # steps between rank 0's pauses in the soak
# The checkpoint soak (issues 13 and 15). A step takes about 0.28 s here (4 ranks, 2 cores), so rank 0
# evaluates about every 85 s of steps: four or five times in 10 minutes, besides the checkpoint.
CHECKPOINT_SOAK_S = 600.0
CKPT_EVAL_EVERY = 300  # steps
CKPT_EVAL_S = 20.0
CKPT_AT_S = 240.0  # after the job's first step: the PG has history by then
CKPT_S = 180.0
CKPT_TIMEOUT_S = 600.0  # the ranks' watchdog timeout: NCCL's default


# --- the rules at the stack's scale ------------------------------------------------------------------------

_SCALED = re.compile(r"([\d.]+)[\s)\]]*#\s*@scale")


@dataclass(frozen=True)
class Timing:
    # The first scaled literal (seconds) of the recording rules the alert reads, then of its own expression;
    # FrexporterCollectiveDesync: the fallback threshold of its culprits' record, not its busy ceiling.
    threshold: float | None
    hold: float  # "for:"


def rule_timings(scale: float) -> dict[str, Timing]:
    rules = [rule for group in load_rules(scale)["groups"] for rule in group["rules"]]
    records = {rule["record"]: rule["expr"] for rule in rules if "record" in rule}
    out = {}
    for rule in rules:
        if "alert" in rule:
            read = "".join(expr for name, expr in records.items() if name in rule["expr"])
            found = _SCALED.search(read + "\n" + rule["expr"])
            out[rule["alert"]] = Timing(float(found[1]) if found else None, parse_duration(rule.get("for", "0s")))
    return out


# --- settings ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    scale: float
    interval: float  # Prometheus scrape and rule evaluation interval
    poll_interval: float  # exporter
    stuck_after: float  # exporter
    deep_interval: float  # exporter: how stale a PG with p2p traffic may be reported (see RanksConfig)
    rules: dict[str, Timing] = field(hash=False)
    snapshot_interval: float = SNAPSHOT_INTERVAL_S  # ranks (FREXPORTER_SNAPSHOT_INTERVAL)

    def describe(self) -> str:
        def rule(name: str) -> str:
            t = self.rules[name]
            if name == BUDGET:  # its scaled literal is a margin below half of each PG's own timeout
                return f"{name} >= 0.5 x timeout - {t.threshold:g}s, for {t.hold:g}s"
            if name == DESYNC:  # the learned threshold, this where none is exported; busy culprits: the ceiling
                return (f"{name} >= the PG's learned threshold ({t.threshold:g}s without one; a busy culprit: "
                        f"the ceiling, --stuck-after), for {t.hold:g}s")
            return f"{name} {'' if t.threshold is None else f'>= {t.threshold:g}s, '}for {t.hold:g}s"

        return "\n".join([
            f"rule scale {self.scale:g} (shipped timings x {self.scale:g}); Prometheus scrape = evaluation interval "
            f"{self.interval:g}s; Alertmanager group_wait = group_interval 1s",
            f"exporter: poll interval {self.poll_interval:g}s, stuck_after {self.stuck_after:g}s, deep_interval "
            f"{self.deep_interval:g}s, rank_timeout {RanksConfig.rank_timeout:g}s, nvml off; ranks: snapshot "
            f"interval {self.snapshot_interval:g}s; "
            f"verdicts polled every {STATUS_POLL_S:g}s",
            "rules: " + "; ".join(rule(a) for a in (DESYNC, STALLED, BUDGET, RANK_DOWN, UNRESPONSIVE)),
        ])


# --- one watched job ---------------------------------------------------------------------------------------


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as resp:
        return json.loads(resp.read())


class Watched:
    """A job under an exporter on the stack's scrape port, and Prometheus seeing all of its ranks up."""

    def __init__(self, stack: PromStack, settings: Settings, workdir: Path, scenario: str, world: int,
                 job_id: str, env: dict[str, str]) -> None:
        self.stack = stack
        self.job = Job(workdir, scenario, world, job_id=job_id,
                       env={"FREXPORTER_SNAPSHOT_INTERVAL": f"{settings.snapshot_interval:g}", **env})
        self.settings = settings
        self.app: App | None = None

    def __enter__(self) -> Watched:
        try:
            self.job.start()
            self.job.wait_ready()
            since = time.time()
            self.app = build_app(ServeConfig(
                directory=str(self.job.spool), host="127.0.0.1", port=self.stack.exporter_port,
                poll_interval=self.settings.poll_interval, stuck_after=self.settings.stuck_after,
                deep_interval=self.settings.deep_interval, sources=(n.SOURCE_RANKS,)))
            self.app.start()
            self.stack.wait_target_up(since)
            wait_for(lambda: len(self.stack.query(f'{n.RANK_UP}{{job_id="{self.job.job_id}"}} == 1'))
                     == self.job.world, timeout=30, interval=0.2, what="Prometheus sees every rank up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        if self.app is not None:
            self.app.stop()
            self.app = None
        self.job.stop()

    def verdicts(self) -> list[dict[str, Any]]:
        assert self.app is not None
        found: list[dict[str, Any]] = _get_json(f"http://127.0.0.1:{self.app.port}/api/v1/status")["verdicts"]
        return [v for v in found if v["job_id"] == self.job.job_id]

    def learned(self) -> bool:
        assert self.app is not None
        groups = [g for g in _get_json(f"http://127.0.0.1:{self.app.port}/api/v1/status")["process_groups"]
                  if g["job_id"] == self.job.job_id]
        return bool(groups) and all((g.get("stuck_threshold_seconds") or math.inf) < self.settings.stuck_after
                                    for g in groups)

    def firing(self, alertname: str | None = None) -> list[tuple[float, dict[str, str]]]:
        """(received, labels) of every firing notification for the job, oldest first."""
        labels = {"job_id": self.job.job_id} | ({"alertname": alertname} if alertname else {})
        return [(note.received, note.labels) for note in self.stack.webhook.notifications(**labels)
                if note.status == "firing"]

    def held(self) -> list[Notification]:
        """Every notification for the job at the stack's hold receiver (firing and resolved)."""
        return [] if self.stack.hold is None else self.stack.hold.notifications(job_id=self.job.job_id)

    def status(self) -> tuple[list[dict[str, Any]], dict[int, str]]:
        """The job's verdicts, and each of its ranks' activity state, from one /api/v1/status."""
        assert self.app is not None
        found = _get_json(f"http://127.0.0.1:{self.app.port}/api/v1/status")
        job = self.job.job_id
        return ([v for v in found["verdicts"] if v["job_id"] == job],
                {r["rank"]: r["activity"]["state"] for r in found["ranks"] if r["job_id"] == job})


# --- faults ------------------------------------------------------------------------------------------------


def _marker_time(job: Job, rank: int, tag: str) -> float:
    job.wait_ready(tag, ranks=[rank], timeout=15)
    return job.marker(rank, tag).stat().st_mtime


def _skip(job: Job) -> float:
    job.touch("skip")
    return _marker_time(job, 3, "skipped")


def _mismatch(job: Job) -> float:
    job.touch("mismatch")
    return _marker_time(job, job.world - 1, "mismatched")


def _wedge(job: Job) -> float:
    job.touch("wedge")
    return _marker_time(job, 0, "wedged")


def _kill(job: Job) -> float:
    job.touch("kill")
    wait_for(lambda: job.procs[1].poll() is not None, timeout=10, interval=0.005, what="rank 1 killed")
    return time.time()


def _no_env(_: Settings) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class Fault:
    kind: str  # the verdict expected
    what: str
    scenario: str
    world: int
    inject: Callable[[Job], float]  # returns the unix time the fault took effect
    culprit: int
    alert: str
    alert_labels: dict[str, str] = field(hash=False)  # the notification must carry these
    env: Callable[[Settings], dict[str, str]] = _no_env
    budget: bool = False  # also time FrexporterWatchdogBudget against the hung PG's watchdog timeout
    also: tuple[tuple[str, int], ...] = ()  # other (verdict kind, culprit) pairs that are right too


def _alert_wait(settings: Settings, alert: str) -> float:
    """Longest a correct alert may take: threshold, hold, and a few scrapes, evaluations and AM rounds."""
    timing = settings.rules[alert]
    return (timing.threshold or 0.0) + timing.hold + 6 * settings.interval + 10.0


def _job_timeout(settings: Settings, fault: Fault) -> float:
    # gloo's (the watchdog's) timeout: far enough out for the fault's own alert to come first.
    return max(60.0, 2 * _alert_wait(settings, fault.alert))


def _steady_fault(tag: str, marker: str, rank: int) -> Callable[[Job], float]:
    def inject(job: Job) -> float:
        job.touch(tag)
        return _marker_time(job, rank, marker)
    return inject


# A steady job (all_reduce on WORLD and on pair {0,1} every 0.1 s), watched with the default serve flags and
# the shipped rules unscaled (--steady): issue 15's targets, node verdict <= 15 s and alert <= 45 s.
STEADY_FAULTS = (
    Fault("missing_rank", "rank 3 idles (no collective)", "steady", 4, _steady_fault("idle", "idled", 3), 3,
          DESYNC, {"rank": "3", "pg_desc": "default_pg"}, lambda s: {"JOB_VICTIM": "3"}),
    # gloo fails the peers' collectives as soon as the culprit's connections close, so nobody is left
    # waiting (NCCL's peers would hang, and page as for an idle culprit): the page is FrexporterRankDown.
    Fault("rank_down", "rank 3 SIGKILLed", "steady", 4, _steady_fault("kill", "killing", 3), 3,
          RANK_DOWN, {"rank": "3"}, lambda s: {"JOB_VICTIM": "3"}, also=(("missing_rank", 3),)),
    Fault("mismatch", "rank 0 takes pair01 before WORLD (deadlock)", "steady", 4,
          _steady_fault("deadlock", "deadlocked", 0), 0, DESYNC, {}, lambda s: {"JOB_VICTIM": "3"},
          also=(("missing_rank", 0), ("missing_rank", 1), ("mismatch", 1))),
)

FAULTS = (
    Fault("missing_rank", "rank 3 skips an all_reduce on pair23", "pair_skip", 4, _skip, 3, DESYNC,
          {"rank": "3", "pg_desc": "pair23"}, lambda s: {"JOB_STEP_SECONDS": "0.5"}, budget=True),
    Fault("mismatch", "rank 2 all_gathers, ranks 0-1 all_reduce", "op_mismatch", 3, _mismatch, 2, STALLED,
          {"pg_desc": "default_pg"}, lambda s: {"JOB_STEP_SECONDS": "0.2"}),
    Fault("rank_unresponsive", "rank 0 holds the GIL in C", "gil", 2, _wedge, 0, UNRESPONSIVE, {"rank": "0"},
          lambda s: {"JOB_GIL_SECONDS": f"{2 * _alert_wait(s, UNRESPONSIVE):g}"}),
    Fault("rank_down", "rank 1 SIGKILLed", "kill", 2, _kill, 1, RANK_DOWN, {"rank": "1"}),
)


@dataclass
class Budget:
    """When FrexporterWatchdogBudget fired, as a fraction of the hung PG's timeout since its oldest wait."""

    timeout: float
    prometheus: float  # in Prometheus' /api/v1/alerts (state firing)
    webhook: float | None = None


@dataclass
class Result:
    fault: Fault
    verdict_s: float | None = None
    verdict: str = ""  # kind and culprits of the first verdict naming anyone, as seen
    alert_s: float | None = None
    alert_labels: dict[str, str] = field(default_factory=dict)
    alerts: list[dict[str, str]] = field(default_factory=list)  # labels of every firing notification
    budget: Budget | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def done(self) -> bool:
        return self.verdict_s is not None and self.alert_s is not None and (
            not self.fault.budget or (self.budget is not None and self.budget.webhook is not None))


def _budget_fired(stack: PromStack, job_id: str) -> Budget | None:
    for alert in stack.alerts(alertname=BUDGET, job_id=job_id):
        if alert["state"] == "firing":
            now = time.time()
            sel = f'{{job_id="{job_id}",pg="{alert["labels"]["pg"]}"}}'
            start = float(stack.query(f"min({n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS}{sel})")[0]["value"][1])
            timeout = float(stack.query(f"max({n.PG_TIMEOUT_SECONDS}{sel})")[0]["value"][1])
            return Budget(timeout, (now - start) / timeout)
    return None


def run_fault(stack: PromStack, settings: Settings, fault: Fault, workdir: Path) -> Result:
    result = Result(fault)
    job_id = f"detect-{fault.kind.replace('_', '-')}-{int(time.time())}"
    timeout = _job_timeout(settings, fault)
    env = {"JOB_TIMEOUT": f"{timeout:g}", "JOB_MAX_LIFETIME": f"{timeout + 120:g}", **fault.env(settings)}
    wait = max(_alert_wait(settings, fault.alert), timeout / 2 + 10 * settings.interval if fault.budget else 0.0)
    with Watched(stack, settings, workdir, fault.scenario, fault.world, job_id, env) as watched:
        if fault.scenario == "steady":  # a job that ran long enough for its PGs' thresholds to be learned
            wait_for(lambda: watched.learned(), timeout=120, interval=0.5, what="every PG's threshold learned")
        injected = fault.inject(watched.job)
        deadline = time.time() + wait
        while time.time() < deadline and not result.done:
            now = time.time()
            if result.verdict_s is None:
                for v in watched.verdicts():
                    result.verdict = result.verdict or f"{v['kind']} {v['ranks']}"
                    right = ((fault.kind, fault.culprit), *fault.also)
                    if any(v["kind"] == kind and culprit in v["ranks"] for kind, culprit in right):
                        result.verdict_s = now - injected
                        result.verdict = f"{v['kind']} {v['ranks']}"
                        if len(v["ranks"]) != 1:
                            result.problems.append(f"verdict also blames {v['ranks']}")
            if fault.budget and result.budget is None:
                result.budget = _budget_fired(stack, job_id)
            notes = watched.firing()
            result.alerts = [labels for _, labels in notes]
            for received, labels in notes:
                if result.alert_s is None and _expected(fault, labels):
                    result.alert_s = received - injected
                    result.alert_labels = labels
                if labels["alertname"] == BUDGET and result.budget is not None and result.budget.webhook is None:
                    pg = f'{{job_id="{job_id}",pg="{labels["pg"]}"}}'
                    start = float(stack.query(f"min({n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS}{pg})")[0][
                        "value"][1])
                    result.budget.webhook = (received - start) / result.budget.timeout
            time.sleep(STATUS_POLL_S)
        alive = [r for r, p in enumerate(watched.job.procs) if p.poll() is None]
        if fault.kind != "rank_down" and len(alive) != fault.world:
            result.problems.append(f"ranks exited early (gloo timeout?); alive {alive}")
    if result.verdict_s is None:
        result.problems.append(f"no {fault.kind} verdict naming rank {fault.culprit} (first seen: "
                               f"{result.verdict or 'none'})")
    if result.alert_s is None:
        result.problems.append(f"no {fault.alert} {fault.alert_labels} at the webhook")
    if fault.budget and (result.budget is None or result.budget.webhook is None):
        result.problems.append(f"no {BUDGET} at the webhook")
    # The watchdog budget alert names no rank and may follow any hang; anything else must be the expected one.
    wrong = sorted({_short(labels) for labels in result.alerts
                    if labels["alertname"] != BUDGET and not _expected(fault, labels)})
    if wrong:
        result.problems.append(f"other alerts fired: {wrong}")
    return result


def _expected(fault: Fault, labels: dict[str, str]) -> bool:
    return labels["alertname"] == fault.alert and all(labels.get(k) == v for k, v in fault.alert_labels.items())


def _short(labels: dict[str, str]) -> str:
    return labels["alertname"] + "".join(f" {k}={labels[k]}" for k in ("rank", "pg_desc") if k in labels)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_table(results: list[Result], settings: Settings) -> None:
    head = (f"{'fault':<18} {'injected':<40} {'verdict (first)':<22} {'verdict s':>9} {'- stuck':>7} "
            f"{'alert':<27} {'alert s':>7}  labels")
    print(head)
    print("-" * len(head))
    for r in results:
        after = None if r.verdict_s is None else r.verdict_s - settings.stuck_after
        labels = ",".join(f"{k}={r.alert_labels[k]}" for k in ("rank", "pg_desc", "severity", "culprit_state")
                           if k in r.alert_labels)
        print(f"{r.fault.kind:<18} {r.fault.what:<40} {r.verdict:<22} {_cell(r.verdict_s):>9} "
              f"{_cell(after) if r.fault.kind in ('missing_rank', 'mismatch') else '':>7} "
              f"{r.fault.alert:<27} {_cell(r.alert_s):>7}  {labels}")
    print()
    print(f"Latencies in seconds from the rank acting on the fault (its marker's mtime, or the killed process's "
          f"exit). '- stuck': verdict latency minus stuck_after ({settings.stuck_after:g}s); budget for "
          f"missing_rank (docs/architecture.md, Budgets): two exporter polls ({2 * settings.poll_interval:g}s).")
    for r in results:
        if r.budget is not None:
            webhook = "-" if r.budget.webhook is None else f"{100 * r.budget.webhook:.1f}%"
            print(f"{BUDGET} ({r.fault.kind}, critical): fired in Prometheus at {100 * r.budget.prometheus:.1f}% "
                  f"and reached the webhook at {webhook} of the {r.budget.timeout:g}s watchdog timeout, counted "
                  "from the PG's oldest wait (docs/architecture.md, Budgets: before 50%)")
    for r in results:
        for problem in r.problems:
            print(f"PROBLEM {r.fault.kind}: {problem}")


# --- soak --------------------------------------------------------------------------------------------------


def run_soak(stack: PromStack, settings: Settings, seconds: float, workdir: Path, world: int,
             pause_fraction: float) -> bool:
    pause = pause_fraction * settings.stuck_after
    job_id = f"soak-{int(time.time())}"
    # The shortest watchdog timeout the faults use: the budget alert gets the least room to misfire.
    env = {"JOB_TIMEOUT": "60", "JOB_PAUSE_SECONDS": f"{pause:g}",
           "JOB_JITTER_SECONDS": f"{SOAK_JITTER_S:g}", "JOB_PAUSE_EVERY": str(SOAK_PAUSE_EVERY),
           "JOB_MAX_LIFETIME": f"{seconds + 120:g}"}
    print(f"soak: {world} gloo ranks, steps of 0-{SOAK_JITTER_S:g}s random compute + send/recv pipeline + "
          f"all_reduce; every {SOAK_PAUSE_EVERY}th step rank 0 pauses {pause:g}s ({pause_fraction:g} x stuck_after), "
          f"alternately before the pipeline and before the all_reduce; watched {seconds:g}s", flush=True)
    verdicts: dict[tuple[str, str, str, int], float] = {}
    with Watched(stack, settings, workdir, "soak", world, job_id, env) as watched:
        seq = f'max({n.PG_LAST_COMPLETED_SEQ}{{job_id="{job_id}",pg_desc="default_pg"}})'
        first_seq = float(stack.query(seq)[0]["value"][1])
        started = time.time()
        while time.time() - started < seconds:
            for v in watched.verdicts():
                verdicts.setdefault((v["kind"], v["pg_desc"], json.dumps(v["ranks"]), v["seq"]),
                                    time.time() - started)
            time.sleep(STATUS_POLL_S)
        span = int(time.time() - started) + 1
        dead = [r for r, p in enumerate(watched.job.procs) if p.poll() is not None]
        steps = float(stack.query(seq)[0]["value"][1]) - first_seq
        age = f'max(time() - {n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS}{{job_id="{job_id}"}})'
        longest = stack.query(f"max_over_time(({age})[{span}s:{settings.interval:g}s])")
        alerts = stack.query(f'max_over_time(ALERTS{{job_id="{job_id}"}}[{span}s])')
        exported = stack.query(f'max_over_time({n.VERDICT}{{job_id="{job_id}"}}[{span}s])')
        notes = watched.firing()
    seen = sorted({a["metric"]["alertname"] + "/" + a["metric"]["alertstate"] for a in alerts})
    fired = [a for a in alerts if a["metric"]["alertstate"] == "firing"]
    longest_s = float(longest[0]["value"][1]) if longest else float("nan")
    print(f"soak result: {steps:.0f} collective steps ({steps // SOAK_PAUSE_EVERY:.0f} rank-0 pauses) in {span}s; "
          f"longest in-flight wait Prometheus saw {longest_s:.2f}s (stuck_after {settings.stuck_after:g}s, "
          f"desync threshold {settings.rules[DESYNC].threshold:g}s)")
    print(f"  verdicts seen at /api/v1/status: {len(verdicts)}"
          + "".join(f"\n    {k} at {t:.1f}s" for k, t in sorted(verdicts.items(), key=lambda kv: kv[1])))
    print(f"  frexporter_verdict series in Prometheus: {len(exported)}")
    print(f"  alerts fired (webhook): {len(notes)}" + "".join(f"\n    {labels}" for _, labels in notes))
    # Pending is no page: "for" exists to ride out a condition that holds for one evaluation.
    print(f"  alerts in Prometheus (ALERTS, pending or firing at any evaluation): {len(seen)} {seen if seen else ''}")
    if dead:
        print(f"  ranks {dead} exited during the soak")
    return not (verdicts or exported or notes or fired or dead)


# --- checkpoint soak -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointPlan:
    seconds: float  # watched
    eval_every: int  # steps
    eval_s: float
    checkpoint_at: float  # seconds after the job's first step
    checkpoint_s: float
    timeout: float  # the ranks' watchdog timeout


@dataclass
class Seen:
    """One verdict (kind, PG, culprits, seq) as polled: when, and what its culprits were doing."""

    first: float
    last: float
    states: set[str] = field(default_factory=set)
    functions: set[str] = field(default_factory=set)


def _busy_windows(job: Job) -> list[tuple[str, float, float]]:
    path = job.control / "rank0.busy.log"
    lines = path.read_text().split("\n") if path.exists() else []
    return [(kind, float(start), float(end)) for kind, start, end in (line.split() for line in lines if line)]


def _scalar(stack: PromStack, promql: str) -> float | None:
    found = stack.query(promql)
    return float(found[0]["value"][1]) if found else None


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def run_checkpoint_soak(stack: PromStack, settings: Settings, plan: CheckpointPlan, workdir: Path,
                        world: int) -> bool:
    job_id = f"checkpoint-soak-{int(time.time())}"
    env = {"JOB_TIMEOUT": f"{plan.timeout:g}", "JOB_JITTER_SECONDS": f"{SOAK_JITTER_S:g}",
           "JOB_EVAL_EVERY": str(plan.eval_every), "JOB_EVAL_SECONDS": f"{plan.eval_s:g}",
           "JOB_CHECKPOINT_AFTER": f"{plan.checkpoint_at:g}", "JOB_CHECKPOINT_SECONDS": f"{plan.checkpoint_s:g}",
           "JOB_MAX_LIFETIME": f"{plan.seconds + 300:g}"}
    print(f"checkpoint soak: {world} gloo ranks (watchdog timeout {plan.timeout:g}s), steps of 0-{SOAK_JITTER_S:g}s "
          f"random sleep + send/recv pipeline + all_reduce; every {plan.eval_every} steps rank 0 evaluates "
          f"{plan.eval_s:g}s (computes in Python), alternately before the pipeline (the others wait in a p2p recv) "
          f"and before the all_reduce (they wait in it); once, {plan.checkpoint_at:g}s after its first step, rank 0 "
          f"checkpoints {plan.checkpoint_s:g}s (computes) before the all_reduce; watched {plan.seconds:g}s",
          flush=True)
    print("Alertmanager: root receiver 'page'; child route culprit_state=\"busy\" -> 'hold' (docs/detection.md)",
          flush=True)
    seen: dict[tuple[str, str, str, int], Seen] = {}
    rank0: list[tuple[float, str]] = []  # (time, rank 0's activity state) at every status poll
    with Watched(stack, settings, workdir, "checkpoint_soak", world, job_id, env) as watched:
        sel = f'job_id="{job_id}",pg_desc="default_pg"'
        first_seq = _scalar(stack, f"max({n.PG_LAST_COMPLETED_SEQ}{{{sel}}})") or 0.0
        started = time.time()
        while time.time() - started < plan.seconds:
            now = time.time()
            verdicts, states = watched.status()
            if 0 in states:
                rank0.append((now, states[0]))
            for v in verdicts:
                one = seen.setdefault((v["kind"], v["pg_desc"], json.dumps(v["ranks"]), v["seq"]), Seen(now, now))
                one.last = now
                for activity in v["activity"].values():
                    one.states.add(activity["state"])
                    one.functions.update(f["function"] for f in activity["frames"][:1])
            time.sleep(STATUS_POLL_S)
        ended = time.time()
        span = int(ended - started) + 1
        dead = [r for r, p in enumerate(watched.job.procs) if p.poll() is not None]
        steps = (_scalar(stack, f"max({n.PG_LAST_COMPLETED_SEQ}{{{sel}}})") or 0.0) - first_seq
        every = f"[{span}s:{settings.interval:g}s]"
        age = f"max(time() - {n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS}{{job_id=\"{job_id}\"}})"
        longest = _scalar(stack, f"max_over_time(({age}){every})")
        threshold = f"{n.PG_STUCK_THRESHOLD_SECONDS}{{{sel}}}"
        lowest, highest = (_scalar(stack, f"{f}_over_time((min({threshold})){every})") for f in ("min", "max"))
        alerts = stack.query(f'max_over_time(ALERTS{{job_id="{job_id}"}}[{span}s])')
        exported = stack.query(f'max_over_time({n.VERDICT}{{job_id="{job_id}"}}[{span}s])')
        windows = _busy_windows(watched.job)
        checkpoint = next(((s, e) for kind, s, e in windows if kind == "checkpoint"), None)
        at_checkpoint = None if checkpoint is None or checkpoint[0] < started else _scalar(
            stack, f"min({threshold} offset {max(1, int(ended - checkpoint[0]))}s)")
        paged = [(t, labels) for t, labels in watched.firing()]
        held = watched.held()
    problems: list[str] = []
    print(f"checkpoint soak result: {steps:.0f} collective steps in {span}s; longest in-flight wait Prometheus saw "
          f"{_s(longest)}; default_pg's learned stuck threshold {_s(lowest)} to {_s(highest)} over the soak "
          f"({_s(at_checkpoint)} when the checkpoint began; ceiling --stuck-after {settings.stuck_after:g}s)")
    origin = checkpoint[0] if checkpoint else started
    print("  rank 0 busy windows (s after the watch began; the share of status polls in the window that saw rank 0 "
          "busy, the first and last 3 s left out):")
    for kind, start, end in windows:
        inside = [state for t, state in rank0 if start + 3 <= t <= end - 3]
        share = f"{100 * inside.count('busy') / len(inside):.0f}% of {len(inside)}" if inside else "-"
        print(f"    {kind:<10} {start - started:7.1f} to {end - started:7.1f} ({end - start:.1f}s), busy {share}")
    if checkpoint is None or checkpoint[1] > ended:
        problems.append("the checkpoint did not finish within the soak (raise SECONDS)")
    print(f"  verdicts seen at /api/v1/status: {len(seen)} (times from the checkpoint's start)")
    for (kind, pg_desc, ranks, seq), one in sorted(seen.items(), key=lambda kv: kv[1].first):
        print(f"    {kind} {pg_desc} culprits {ranks} seq {seq}: {one.first - origin:.1f}s to "
              f"{one.last - origin:.1f}s, culprit activity {sorted(one.states)} in {sorted(one.functions)}")
        if checkpoint is None or not checkpoint[0] <= one.first <= checkpoint[1] + 2 * settings.poll_interval:
            problems.append(f"verdict outside the checkpoint: {kind} {pg_desc} {ranks}")
        elif kind != "missing_rank" or ranks != "[0]" or "busy" not in one.states:
            problems.append(f"the checkpoint's verdict is {kind} {ranks} {sorted(one.states)}, not missing_rank "
                            "[0] busy")
    if checkpoint is not None and not seen:
        problems.append("no verdict for the checkpoint")
    print("  frexporter_verdict series in Prometheus: "
          + ", ".join(f"{e['metric']['kind']} rank {e['metric']['rank']} {e['metric'].get('culprit_state', '')}"
                      for e in exported))
    print(f"  alerts at the page receiver: {len(paged)}"
          + "".join(f"\n    {t - origin:.1f}s {_short(labels)} {labels.get('severity')}" for t, labels in paged))
    print(f"  alerts at the hold receiver: {sum(1 for h in held if h.status == 'firing')} firing"
          + "".join(f"\n    {h.status} {h.received - origin:.1f}s {_short(h.labels)} culprit_state="
                    f"{h.labels.get('culprit_state')} severity={h.labels.get('severity')}" for h in held))
    print("  alerts in Prometheus (ALERTS, pending or firing at any evaluation): "
          + (", ".join(sorted({f"{a['metric']['alertname']}/{a['metric']['alertstate']}"
                               f"/{a['metric'].get('severity')}/{a['metric'].get('culprit_state', '-')}"
                               for a in alerts})) or "none"))
    critical = [a for a in alerts
                if a["metric"].get("severity") == "critical" and a["metric"]["alertstate"] == "firing"]
    # The budget rule's condition holds from 0.5 T - 30 s of wait; "for: 15s" fires it 15 to 30 s later.
    budget_at = 0.5 * plan.timeout - settings.rules[BUDGET].threshold + settings.rules[BUDGET].hold
    print(f"  critical alerts fired: {len(critical)}" + "".join(f" {_short(a['metric'])}" for a in critical)
          + f"; FrexporterWatchdogBudget would fire no earlier than {budget_at:g}s into a wait (timeout "
          f"{plan.timeout:g}s), the longest wait was {_s(longest)}: "
          + ("a critical alert fired before it would" if critical else "no critical alert before it"))
    if paged:
        problems.append(f"{len(paged)} alert(s) paged")
    if checkpoint is not None and not any(h.status == "firing" and h.labels.get("alertname") == DESYNC
                                          and h.labels.get("rank") == "0" for h in held):
        problems.append("no FrexporterCollectiveDesync rank=0 at the hold receiver for the checkpoint")
    if dead:
        problems.append(f"ranks {dead} exited during the soak")
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return not problems


# --- main --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.detection", description=__doc__.split("\n\n")[0])
    parser.add_argument("--soak", type=float, nargs="?", const=300.0, default=None, metavar="SECONDS",
                        help="instead of the fault table, watch a healthy skewed job this long (default 300)")
    parser.add_argument("--faults", nargs="+", choices=[f.kind for f in FAULTS], default=[f.kind for f in FAULTS])
    parser.add_argument("--scale", type=float, default=SCALE, help=f"rule timing scale (default {SCALE:g})")
    parser.add_argument("--interval", type=float, default=INTERVAL_S,
                        help=f"Prometheus scrape and evaluation interval, seconds (default {INTERVAL_S:g})")
    parser.add_argument("--poll-interval", type=float, default=0.5, help="exporter poll interval (default 0.5)")
    parser.add_argument("--stuck-after", type=float, default=None,
                        help="exporter stuck_after (default: the scaled FrexporterCollectiveDesync threshold)")
    parser.add_argument("--deep-interval", type=float, default=None,
                        help="exporter deep_interval (default: the shipped one times --scale). A PG with p2p "
                             "traffic is reported as of its last deep read, so its in-flight ages can run this "
                             "much behind; unscaled, that alone outlasts the scaled desync threshold")
    parser.add_argument("--steady", action="store_true",
                        help="issue 15's table: a steady job (idle, dead, deadlock), the default serve flags, the "
                             "shipped rules unscaled, 15 s scrape and evaluation")
    parser.add_argument("--checkpoint-soak", type=float, nargs="?", const=CHECKPOINT_SOAK_S, default=None,
                        metavar="SECONDS",
                        help="issues 13 and 15: watch a healthy job with busy evaluations and one busy checkpoint "
                             f"on rank 0 this long (default {CHECKPOINT_SOAK_S:g}) at the shipped settings (as "
                             "--steady), Alertmanager routing busy culprits to a non-paging receiver")
    parser.add_argument("--eval-every", type=int, default=CKPT_EVAL_EVERY,
                        help=f"checkpoint soak: steps between rank 0's evaluations (default {CKPT_EVAL_EVERY})")
    parser.add_argument("--eval-seconds", type=float, default=CKPT_EVAL_S,
                        help=f"checkpoint soak: one evaluation's compute (default {CKPT_EVAL_S:g})")
    parser.add_argument("--checkpoint-at", type=float, default=CKPT_AT_S,
                        help=f"checkpoint soak: seconds after the job's first step (default {CKPT_AT_S:g})")
    parser.add_argument("--checkpoint-seconds", type=float, default=CKPT_S,
                        help=f"checkpoint soak: the checkpoint's compute (default {CKPT_S:g})")
    parser.add_argument("--soak-ranks", type=int, default=4)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, spools)")
    parser.add_argument("--pause-fraction", type=float, default=0.5,
                        help="rank 0's pauses in the soak, as a fraction of stuck_after (default 0.5)")
    args = parser.parse_args(argv)
    faults = FAULTS
    if args.steady or args.checkpoint_soak is not None:
        args.scale, args.interval, args.poll_interval = 1.0, 15.0, defaults.POLL_INTERVAL
        args.stuck_after, args.deep_interval = defaults.STUCK_AFTER, defaults.DEEP_INTERVAL
        faults = STEADY_FAULTS
    rules = rule_timings(args.scale)
    threshold = rules[DESYNC].threshold
    assert threshold is not None
    settings = Settings(scale=args.scale, interval=args.interval, poll_interval=args.poll_interval,
                        stuck_after=threshold if args.stuck_after is None else args.stuck_after,
                        deep_interval=RanksConfig.deep_interval * args.scale if args.deep_interval is None
                        else args.deep_interval, rules=rules,
                        snapshot_interval=SNAPSHOT_INTERVAL_S if args.checkpoint_soak is None
                        else DEFAULT_SNAPSHOT_INTERVAL)
    print(settings.describe(), flush=True)
    root = Path(tempfile.mkdtemp(prefix="frexporter-detection-"))
    try:
        with running_stack(root / "stack", scale=args.scale, interval=args.interval,
                           hold_busy=args.checkpoint_soak is not None) as stack:
            if args.checkpoint_soak is not None:
                plan = CheckpointPlan(args.checkpoint_soak, args.eval_every, args.eval_seconds, args.checkpoint_at,
                                      args.checkpoint_seconds, CKPT_TIMEOUT_S)
                return 0 if run_checkpoint_soak(stack, settings, plan, root / "checkpoint-soak",
                                                args.soak_ranks) else 1
            if args.soak is not None:
                return 0 if run_soak(stack, settings, args.soak, root / "soak", args.soak_ranks,
                                     args.pause_fraction) else 1
            results = []
            for fault in faults:
                if fault.kind in args.faults:
                    print(f"injecting {fault.kind}: {fault.what} ...", flush=True)
                    results.append(run_fault(stack, settings, fault, root / fault.kind))
            print()
            print_table(results, settings)
            return 0 if all(r.ok for r in results) else 1
    finally:
        if args.keep:
            print(f"kept {root} (job logs, spools, Prometheus and Alertmanager logs)")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
