"""`frexporter analyze`: verdicts from FR dump files, evidence bundles, or a whole job in Prometheus."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from frexporter import defaults
from frexporter.analysis import history
from frexporter.analysis.findings import Finding, FindingsConfig, waits_in_progress
from frexporter.analysis.verdicts import (
    LAGGING_RANK,
    PAST_MISMATCH,
    RANK_ABSENT,
    Verdict,
    VerdictConfig,
    budget_left,
    evaluate,
    find_absent_in_world,
    lagging_verdict,
    past_mismatch_verdict,
)
from frexporter.fr import trace
from frexporter.model import ACTIVITY_UNKNOWN, Activity, RankState
from frexporter.postmortem import dumpfiles, prometheus

EVIDENCE_FILE = "verdict.json"
_NOT_DUMPS = (EVIDENCE_FILE,)


@dataclass
class Report:
    source: str
    ranks: tuple[RankState, ...]
    verdicts: tuple[Verdict, ...]  # hangs first, then past mismatches, then lagging ranks
    problems: list[str] = field(default_factory=list)  # one line per skipped file or file with skipped entries
    recorded: dict[str, Any] | None = None  # the verdict an exporter recorded with an evidence bundle
    skipped_files: int = 0
    skipped_entries: int = 0
    waits: tuple[Finding, ...] = ()  # waits in progress below their threshold: shown when nothing is stuck


def from_dir(directory: str, stuck_after: float, job_id: str = "dump") -> Report:
    dumps, problems = dumpfiles.load_dir(directory)
    problems = [p for p in problems if not any(os.path.basename(p.split(":")[0]) == f for f in _NOT_DUMPS)
                and not os.path.basename(p.split(":")[0]).startswith("stacks_rank")]
    recorded = None
    evidence = os.path.join(directory, EVIDENCE_FILE)
    if os.path.isfile(evidence):
        try:
            with open(evidence, "rb") as f:
                recorded = json.loads(f.read(16 * 1024 * 1024))
        except (OSError, ValueError) as e:
            problems.append(f"{evidence}: {e}")
    if isinstance(recorded, dict) and isinstance(recorded.get("verdict"), dict):
        job_id = str(recorded["verdict"].get("job_id", job_id))
    skipped_files = len(problems)
    skipped_entries = 0
    for d in dumps:
        if d.dump.dropped_entries:
            skipped_entries += d.dump.dropped_entries
            total = d.dump.dropped_entries + len(d.dump.entries)
            problems.append(f"{d.path}: {d.dump.dropped_entries} of {total} entries skipped (not an object, no "
                            f"process_group, a field of the wrong type, or past {trace.MAX_ENTRIES})")
    ranks = dumpfiles.rank_states(dumps, job_id=job_id)
    now = dumpfiles.dump_time(dumps) or time.time()
    groups = dumpfiles.histories(dumps, job_id=job_id)
    observed = [d.rank for d in dumps]
    p2p = [f for g in groups for f in history.p2p_waits(g, observed, now, stuck_after)]
    hangs = evaluate(ranks, now, VerdictConfig(stuck_after=stuck_after, complete_view=True), more_findings=p2p)
    past = [past_mismatch_verdict(p) for g in groups for p in history.past_mismatches(g)]
    lags = [lagging_verdict(lag, now) for g in groups if (lag := history.lagging(g, now)) is not None]
    waits = tuple(waits_in_progress(ranks, now, FindingsConfig(stuck_after, complete_view=True)))
    return Report(source=directory, ranks=ranks, verdicts=(*hangs, *past, *lags), problems=problems,
                  recorded=recorded, skipped_files=skipped_files, skipped_entries=skipped_entries, waits=waits)


def from_prometheus(url: str, job_id: str | None, stuck_after: float | None = None) -> Report:
    """``stuck_after`` None: the exporters' own (the largest ``frexporter_pg_stuck_ceiling_seconds`` they
    report), so that the learned thresholds and the ceilings decide as in the alert rules; the default
    --stuck-after where no exporter reports one (older exporters). A number caps both."""
    now = time.time()
    ranks = prometheus.rank_states(url, job_id, now)
    if stuck_after is None:
        ceilings = [pg.stuck_ceiling_seconds for r in ranks for pg in r.pgs if pg.stuck_ceiling_seconds is not None]
        stuck_after = max(ceilings, default=defaults.STUCK_AFTER)
    verdicts = evaluate(ranks, now, VerdictConfig(stuck_after=stuck_after, complete_view=True))
    # Every node's ranks are in the view: a rank below the world size without any series is absent.
    absent = tuple(v for v in find_absent_in_world(ranks) if not any(
        h.kind == RANK_ABSENT and h.job_id == v.job_id for h in verdicts))
    waits = tuple(waits_in_progress(ranks, now, FindingsConfig(stuck_after, complete_view=True)))
    return Report(source=url, ranks=ranks, verdicts=(*verdicts, *absent), waits=waits)


def _count(count: int, singular: str, plural: str) -> str:
    return f"{count} {singular if count == 1 else plural}"


def render_text(report: Report) -> str:
    """Hangs first (the reason to look), then past mismatches, then lagging ranks."""
    lines = []
    pgs = {(r.job_id, pg.name, pg.ranks) for r in report.ranks for pg in r.pgs}
    lines.append(f"{report.source}: {_count(len(report.ranks), 'rank', 'ranks')}, "
                 f"{_count(len(pgs), 'process group', 'process groups')}")
    if report.problems:
        counted = [_count(report.skipped_files, "file", "files")] if report.skipped_files else []
        if report.skipped_entries:
            counted.append(_count(report.skipped_entries, "entry", "entries"))
        lines.append(f"skipped {' and '.join(counted) or 'nothing usable'}; judged the rest:")
        lines.extend(f"  skipped: {problem}" for problem in report.problems)
    if report.recorded is not None:
        v = report.recorded.get("verdict", {})
        lines.append(f"  evidence bundle recorded by the exporter: {v.get('kind')}: {v.get('summary')}")
    hangs = [v for v in report.verdicts if v.kind not in (PAST_MISMATCH, LAGGING_RANK)]
    past = [v for v in report.verdicts if v.kind == PAST_MISMATCH]
    lags = [v for v in report.verdicts if v.kind == LAGGING_RANK]
    activity = {(r.job_id, r.rank): r.activity for r in report.ranks}
    if not hangs:
        lines.extend(_wait_line(f, activity) for f in report.waits)
        if not report.waits:
            lines.append("no stuck collective found")
    for v in hangs:
        left = budget_left(v)
        budget = f", {left:.0f}s of the {v.timeout_seconds:.0f}s watchdog budget left" if (
            left is not None and v.timeout_seconds) else ""
        where = f"PG {v.pg} ({v.pg_desc}), {v.op or 'collective'} #{v.seq}, " if v.pg else ""
        doing = _doing([v.activity.get(str(r)) for r in v.ranks[:_SHOWN]])
        culprits = ",".join(map(str, v.ranks))
        lines.append(f"{v.kind}: job {v.job_id}, {where}culprit rank(s) {culprits}{doing}{budget}")
        lines.append(f"  {v.summary}")
    if past:
        lines.append(f"{_count(len(past), 'past mismatch', 'past mismatches')} "
                     "(collectives that completed although their ranks disagreed):")
    for v in past:
        lines.append(f"{v.kind}: job {v.job_id}, PG {v.pg} ({v.pg_desc}), {v.op} #{v.seq}, "
                     f"culprit rank(s) {','.join(map(str, v.ranks))}")
        lines.append(f"  {v.summary}")
    if lags:
        groups = _count(len(lags), "process group", "process groups")
        lines.append(f"{groups} with lagging ranks (not hangs by themselves):")
    for v in lags:
        lines.append(f"{v.kind}: job {v.job_id}, PG {v.pg} ({v.pg_desc}), {v.op} #{v.seq}, "
                     f"rank(s) {','.join(map(str, v.ranks))}")
        lines.append(f"  {v.summary}")
    return "\n".join(lines)


_SHOWN = 16  # ranks listed in a line


def _ranks(ranks: Sequence[int]) -> str:
    shown = ",".join(map(str, ranks[:_SHOWN]))
    return shown + (f",... ({len(ranks)})" if len(ranks) > _SHOWN else "")


def _doing(activities: Sequence[Activity | None]) -> str:
    """' (idle)' when the shown culprits are all in one state, ' (busy, idle)' rank by rank otherwise; ''
    when none is known (dump files carry no activity). The state is what decided the threshold."""
    states = [a.state if a is not None else ACTIVITY_UNKNOWN for a in activities]
    if all(s == ACTIVITY_UNKNOWN for s in states):
        return ""
    return f" ({states[0]})" if len(set(states)) == 1 else f" ({', '.join(states)})"


def _wait_line(f: Finding, activity: dict[tuple[str, int], Activity]) -> str:
    """A wait in progress, not stuck yet: who waits on whom, what they are doing, for how long, against which
    threshold (the ceiling when they are all busy computing, docs/detection.md)."""
    doing = _doing([activity.get((f.job_id, r)) for r in f.blockers[:_SHOWN]])
    on = f"rank(s) {_ranks(f.blockers)}{doing}" if f.blockers else "the collective to complete"
    waited = f.waited_seconds or 0.0
    threshold = f" (threshold {f.threshold_seconds:.0f}s)" if f.threshold_seconds is not None else ""
    return (f"waiting: job {f.job_id}, PG {f.pg} ({f.pg_desc}), {f.op or 'collective'} #{f.seq}: ranks "
            f"{_ranks(f.waiting)} wait on {on} for {waited:.0f}s{threshold}")


def render_json(verdicts: Sequence[Verdict]) -> str:
    return json.dumps([v.to_json() for v in verdicts], indent=1)
