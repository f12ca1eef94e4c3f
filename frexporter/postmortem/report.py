"""`frexporter analyze`: verdicts from FR dump files, evidence bundles, or a whole job in Prometheus."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from frexporter.analysis.verdicts import Verdict, VerdictConfig, budget_left, evaluate
from frexporter.model import RankState
from frexporter.postmortem import dumpfiles, prometheus

EVIDENCE_FILE = "verdict.json"
_NOT_DUMPS = (EVIDENCE_FILE,)


@dataclass
class Report:
    source: str
    ranks: tuple[RankState, ...]
    verdicts: tuple[Verdict, ...]
    problems: list[str] = field(default_factory=list)
    recorded: dict[str, Any] | None = None  # the verdict an exporter recorded with an evidence bundle


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
    ranks = dumpfiles.rank_states(dumps, job_id=job_id)
    now = dumpfiles.dump_time(dumps) or time.time()
    verdicts = evaluate(ranks, now, VerdictConfig(stuck_after=stuck_after, complete_view=True))
    return Report(source=directory, ranks=ranks, verdicts=verdicts, problems=problems, recorded=recorded)


def from_prometheus(url: str, job_id: str | None, stuck_after: float) -> Report:
    now = time.time()
    ranks = prometheus.rank_states(url, job_id, now)
    verdicts = evaluate(ranks, now, VerdictConfig(stuck_after=stuck_after, complete_view=True))
    return Report(source=url, ranks=ranks, verdicts=verdicts)


def render_text(report: Report) -> str:
    lines = []
    pgs = {(r.job_id, pg.name) for r in report.ranks for pg in r.pgs}
    lines.append(f"{report.source}: {len(report.ranks)} ranks, {len(pgs)} process groups")
    for problem in report.problems:
        lines.append(f"  skipped: {problem}")
    if report.recorded is not None:
        v = report.recorded.get("verdict", {})
        lines.append(f"  evidence bundle recorded by the exporter: {v.get('kind')}: {v.get('summary')}")
    if not report.verdicts:
        lines.append("no stuck collective found")
    for v in report.verdicts:
        left = budget_left(v)
        budget = f", {left:.0f}s of the {v.timeout_seconds:.0f}s watchdog budget left" if (
            left is not None and v.timeout_seconds) else ""
        culprits = ",".join(map(str, v.ranks))
        lines.append(f"{v.kind}: job {v.job_id}, PG {v.pg} ({v.pg_desc}), {v.op or 'collective'} #{v.seq}, "
                     f"culprit rank(s) {culprits}{budget}")
        lines.append(f"  {v.summary}")
    return "\n".join(lines)


def render_json(verdicts: Sequence[Verdict]) -> str:
    return json.dumps([v.to_json() for v in verdicts], indent=1)
