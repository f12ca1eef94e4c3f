"""`frexporter analyze`: verdicts from FR dump files, evidence bundles, or a whole job in Prometheus."""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from frexporter import defaults, safetext
from frexporter.analysis import history
from frexporter.analysis.absent import find_absent_in_world
from frexporter.analysis.findings import Finding, FindingsConfig, waits_in_progress
from frexporter.analysis.kinds import LAGGING_RANK, PAST_MISMATCH, RANK_ABSENT
from frexporter.analysis.past_verdicts import lagging_verdict, past_mismatch_verdict
from frexporter.analysis.straggler import WaitLag, wait_ranking
from frexporter.analysis.verdicts import Verdict, VerdictConfig, budget_left, evaluate
from frexporter.fr import trace
from frexporter.model import ACTIVITY_UNKNOWN, Activity, RankState
from frexporter.postmortem import dumpfiles, prometheus
from frexporter.postmortem.dumpfiles import DumpError
from frexporter.spool import MAX_TEXT_CHARS

EVIDENCE_FILE = "verdict.json"
# An exporter's verdict.json holds one verdict and the list of the bundle's files (two a rank at most).
MAX_EVIDENCE_BYTES = 4 * 1024 * 1024
MAX_EVIDENCE_CONTAINERS = 1 << 19
MAX_SUMMARY_CHARS = 4096
_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
               bool: "true or false", type(None): "null"}


@dataclass
class Report:
    source: str
    ranks: tuple[RankState, ...]
    verdicts: tuple[Verdict, ...]  # hangs first, then past mismatches, then lagging ranks
    problems: list[str] = field(default_factory=list)  # one line per skipped file or file with skipped entries
    recorded: dict[str, str] | None = None  # kind, summary, job_id of the verdict recorded in an evidence bundle
    skipped_files: int = 0
    skipped_entries: int = 0
    waits: tuple[Finding, ...] = ()  # waits in progress below their threshold: shown when nothing is stuck
    # The cross-node straggler ranking (analyze --prometheus, exporters with --collective-waits): per PG, by waits
    # (NCCL) or arrivals (gloo), last arriver first, as the PG dashboard's and FrexporterStraggler's recording
    # rules rank them.
    stragglers: tuple[WaitLag, ...] = ()
    # PGs known only by their size and timeouts (analyze --prometheus): idle ones, whose ranks' series were not read.
    unread_pgs: int = 0


def _bundle_file(name: str) -> bool:
    """The files of an evidence bundle that are not dumps: its verdict.json and py-spy's stacks."""
    return name == EVIDENCE_FILE or name.startswith("stacks_rank")


def _text(value: object, limit: int) -> str | None:
    if isinstance(value, str):
        return safetext.repair(value[:limit])
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)[:limit]
    return None


def _json_type(value: object) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def parse_evidence(data: bytes, what: str) -> dict[str, str]:
    """The verdict an exporter recorded in an evidence bundle's verdict.json: its kind, summary and job id
    (text; "" where absent). DumpError, one line, when ``data`` is not such a record."""
    containers = trace.json_containers(data)
    if len(data) > MAX_EVIDENCE_BYTES or containers > MAX_EVIDENCE_CONTAINERS:
        raise DumpError(f"{what}: {len(data)} bytes, up to {containers} objects and lists: over the bound of "
                        f"{MAX_EVIDENCE_BYTES} bytes and {MAX_EVIDENCE_CONTAINERS} for a verdict record")
    try:
        doc = json.loads(data)
    except RecursionError as e:  # nesting deeper than the stack
        raise DumpError(f"{what}: invalid JSON (nested too deeply)") from e
    except ValueError as e:
        raise DumpError(f"{what}: invalid JSON ({safetext.printable(e)})") from e
    verdict = doc.get("verdict") if isinstance(doc, dict) else None
    if not isinstance(verdict, dict):
        got = f'a "verdict" that is {_json_type(verdict)}' if isinstance(doc, dict) else _json_type(doc)
        raise DumpError(f'{what}: not a recorded verdict (an object with a "verdict" object), but {got}')
    return {"kind": _text(verdict.get("kind"), MAX_TEXT_CHARS) or "",
            "summary": _text(verdict.get("summary"), MAX_SUMMARY_CHARS) or "",
            "job_id": _text(verdict.get("job_id"), MAX_TEXT_CHARS) or ""}


def _read_evidence(directory: str) -> dict[str, str]:
    """The bundle's recorded verdict; {} when the directory has no verdict.json (or one that is not a regular
    file: load_dir lists that). DumpError when it cannot be used."""
    path = os.path.join(directory, EVIDENCE_FILE)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return {}
    except OSError:
        return {}
    data, _mtime = dumpfiles.read_regular(path, path, MAX_EVIDENCE_BYTES)
    return parse_evidence(data, path)


def from_dir(directory: str, stuck_after: float, job_id: str = "dump") -> Report:
    dumps, problems = dumpfiles.load_dir(directory, skip=_bundle_file)
    recorded = None
    try:
        recorded = _read_evidence(directory) or None
    except DumpError as e:  # the dumps are judged all the same
        problems.append(str(e))
    if recorded and recorded["job_id"]:
        job_id = recorded["job_id"]
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


def from_prometheus(urls: str | Sequence[str], job_id: str | None, stuck_after: float | None = None,
                    narrow: bool = True) -> Report:
    """The job as one Prometheus holds it, or several together (the shards of a tiered layout).

    ``stuck_after`` None: the exporters' own (the largest ``frexporter_pg_stuck_ceiling_seconds`` they
    report), so that the learned thresholds and the ceilings decide as in the alert rules; the default
    --stuck-after where no exporter reports one (older exporters). A number caps both. ``narrow``: read the
    ranks' series of the active PGs only (prometheus.fetch), which judges alike; False reads every PG's."""
    now = time.time()
    view = prometheus.job_view(urls, job_id, now, narrow=narrow)
    ranks = view.ranks
    if stuck_after is None:
        stuck_after = defaults.STUCK_AFTER if view.stuck_ceiling is None else view.stuck_ceiling
    verdicts = evaluate(ranks, now, VerdictConfig(stuck_after=stuck_after, complete_view=True))
    # Every node's ranks are in the view: a rank below the world size without any series is absent.
    absent = tuple(v for v in find_absent_in_world(ranks) if not any(
        h.kind == RANK_ABSENT and h.job_id == v.job_id for h in verdicts))
    waits = tuple(waits_in_progress(ranks, now, FindingsConfig(stuck_after, complete_view=True)))
    return Report(source=", ".join(prometheus.servers(urls)), ranks=ranks, verdicts=(*verdicts, *absent),
                  waits=waits, problems=view.problems,
                  skipped_entries=view.skipped_series, stragglers=tuple(wait_ranking(ranks, view.collective_rates)),
                  unread_pgs=len(view.unread_pgs))


def _count(count: int, singular: str, plural: str) -> str:
    return f"{count} {singular if count == 1 else plural}"


def render_text(report: Report) -> str:
    """Hangs first (the reason to look), then past mismatches, then lagging ranks."""
    lines = []
    pgs = {(r.job_id, pg.name, pg.ranks) for r in report.ranks for pg in r.pgs}
    idle = f" ({report.unread_pgs} idle: nothing in flight, not read rank by rank)" if report.unread_pgs else ""
    lines.append(f"{report.source}: {_count(len(report.ranks), 'rank', 'ranks')}, "
                 f"{_count(len(pgs) + report.unread_pgs, 'process group', 'process groups')}{idle}")
    if report.problems:
        counted = [_count(report.skipped_files, "file", "files")] if report.skipped_files else []
        if report.skipped_entries:
            counted.append(_count(report.skipped_entries, "entry", "entries"))
        lines.append(f"skipped {' and '.join(counted) or 'nothing usable'}; judged the rest:")
        lines.extend(f"  skipped: {problem}" for problem in report.problems)
    if report.recorded is not None:
        lines.append(f"  evidence bundle recorded by the exporter: {report.recorded.get('kind')}: "
                     f"{report.recorded.get('summary')}")
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
    lines.extend(_straggler_lines(report.stragglers))
    # Names, descriptions, paths and summaries come from dumps, file names and servers: each line is escaped
    # whole, so that none of them can break it, start a line of its own or drive the terminal.
    return "\n".join(safetext.printable(line) for line in lines)


_SHOWN = 16  # ranks listed in a line
_RANKED = 5  # ranks of a PG listed in the straggler ranking


def _straggler_lines(rows: Sequence[WaitLag]) -> list[str]:
    """Per PG with a straggler, its ranks by lag and the signal they were ranked by (the PG dashboard's *Straggler
    ranking*); one line when none."""
    if not rows:
        return []
    by_pg: dict[tuple[str, str], list[WaitLag]] = {}
    for row in rows:
        by_pg.setdefault((row.job_id, row.pg), []).append(row)
    flagged = [group for group in by_pg.values() if any(row.straggler for row in group)]
    if not flagged:
        pgs = _count(len(by_pg), "process group", "process groups")
        return [f"no cross-node straggler in {pgs} with waits or arrivals"]
    lines = [f"{_count(len(flagged), 'process group', 'process groups')} with a straggler (ranks by lag, last "
             "arriver first; by wait: the PG's median wait inside collectives minus the rank's own; by arrival: "
             "the rank's call time minus the PG's median):"]
    for group in flagged:
        first = group[0]
        names = [str(row.rank) for row in group if row.straggler]
        lines.append(f"straggler: job {first.job_id}, PG {first.pg} ({first.pg_desc}), rank(s) {','.join(names)} "
                     f"(by {first.signal})")
        ranked = ", ".join(f"rank {row.rank} {row.lag * 1000:+.1f} ms{' *' if row.straggler else ''}"
                           for row in group[:_RANKED])
        lines.append(f"  {ranked}")
    return lines


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


def _repaired(value: Any) -> Any:
    """``value`` with the lone surrogates of its text replaced (a dump's, a file name's): such text is not
    Unicode, and strict JSON parsers refuse its escapes."""
    if isinstance(value, str):
        return safetext.repair(value)
    if isinstance(value, dict):
        return {_repaired(k): _repaired(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_repaired(v) for v in value]
    return value


def render_json(verdicts: Sequence[Verdict]) -> str:
    """ASCII JSON (every other character escaped), valid in any locale and to any strict parser."""
    return json.dumps(_repaired([v.to_json() for v in verdicts]), indent=1, ensure_ascii=True)
