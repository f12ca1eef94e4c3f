"""Verdicts of ``analyze DIR`` only, from whole dumps (``history``): a collective that completed although its ranks
disagreed on it, and ranks still at collectives their peers saw complete. Not hangs; never live verdicts. The
mismatch wording is shared with the live ``mismatch`` verdict."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from frexporter.analysis import text
from frexporter.analysis.history import Lag, PastMismatch
from frexporter.analysis.kinds import LAGGING_RANK, MAX_DETAIL_RANKS, PAST_MISMATCH
from frexporter.analysis.matching import Mismatch
from frexporter.model import InflightCollective, Verdict


def mismatch_text(m: Mismatch, seq: int, pg: str, pg_desc: str, past: bool) -> str:
    """'Rank 3 joined all_reduce #42 on PG 'tp' with input sizes [[5]] where ranks 0,1,2 have [[4]]'"""
    culprits = text.who(m.culprits)
    majority = text.who(m.majority, capital=False) if m.majority else "the other ranks"
    on = f"on {text.pg_text(pg, pg_desc)}"
    joined = "ran" if past else "joined"
    if m.what == "op":
        head = (f"{culprits} {'ran' if past else 'called'} {text.collective(m.found_op, seq)} {on} where "
                f"{majority} {'ran' if past else 'called'} {m.op}")
    elif m.what == "syntax":
        head = f"{culprits} {joined} a malformed {text.collective(m.found_op, seq)}{m.where} {on}: " \
               f"{m.found}, expected {m.expected}"
    else:
        verb = "had" if past else text.agree(m.majority, "has", "have") if m.majority else "have"
        head = (f"{culprits} {joined} {text.collective(m.op, seq)}{m.where} {on} with {m.what} {m.found} where "
                f"{majority} {verb} {m.expected}")
    if m.no_majority:
        head += " (no majority: as many ranks on each side, so either side may be the wrong one)"
    return head


def mismatch_evidence(m: Mismatch, entries: Mapping[str, Any]) -> dict[str, Any]:
    evidence: dict[str, Any] = {"what": m.what, "expected": m.expected, "found": m.found,
                                "majority_ranks": list(m.majority), "entries": entries}
    if m.no_majority:
        evidence["no_majority"] = True
    return evidence


def entry_json(entry: InflightCollective) -> dict[str, Any]:
    return {"op": entry.op, "input_sizes": [list(s) for s in entry.input_sizes],
            "output_sizes": [list(s) for s in entry.output_sizes],
            "input_dtypes": list(entry.input_dtypes), "output_dtypes": list(entry.output_dtypes)}


def past_mismatch_verdict(p: PastMismatch) -> Verdict:
    """A collective that completed although its ranks disagreed on it: not a hang, its results are suspect."""
    m, g = p.mismatch, p.group
    head = mismatch_text(m, p.seq, g.name, g.desc, past=True)
    summary = (f"{head}. It completed anyway (the backend did not check this), so its results are suspect; "
               f"not a hang.")
    shown = [*m.culprits[:MAX_DETAIL_RANKS], *m.majority[:1]]
    evidence = mismatch_evidence(m, {str(r): entry_json(p.entries[r]) for r in shown if r in p.entries})
    return Verdict(kind=PAST_MISMATCH, job_id=g.job_id, pg=g.name, pg_desc=g.desc, ranks=m.culprits,
                   waiting_ranks=(), seq=p.seq, op=m.op, since=None, age_seconds=None, timeout_seconds=None,
                   budget_used=None, summary=summary, details={"mismatch": evidence, "pg_ranks": list(g.members)})


def lagging_verdict(lag: Lag, now: float) -> Verdict:
    """Ranks still at collectives their peers saw complete: not a hang by itself, a slow rank."""
    g = lag.group
    laggers = sorted(lag.behind)
    worst = max(laggers, key=lambda r: (lag.behind[r], lag.ages[r]))
    many = len(laggers) > 1
    count = lag.behind[worst]
    behind = f"{count} {'collective' if count == 1 else 'collectives'} behind"
    if many:
        behind = f"up to {behind} (rank {worst})"
    where = "that rank's GPU, stream or host" if not many else "those ranks' GPUs, streams or hosts"
    summary = (f"{text.who(laggers)} lagged on {text.pg_text(g.name, g.desc)}: "
               f"{text.agree(laggers, 'it is', 'they are')} still at {text.collective(lag.op, lag.seq)}, in flight "
               f"for {text.seconds(now - lag.since)} at the dump, which {text.who(lag.peers, capital=False)} "
               f"completed: {behind}. Not a hang by itself: look at {where}.")
    details = {"behind": {str(r): lag.behind[r] for r in laggers}, "first_seq": {str(r): lag.first[r] for r in laggers},
               "lag_seconds": {str(r): lag.ages[r] for r in laggers}, "completed_by": list(lag.peers),
               "pg_ranks": list(g.members)}
    return Verdict(kind=LAGGING_RANK, job_id=g.job_id, pg=g.name, pg_desc=g.desc, ranks=tuple(laggers),
                   waiting_ranks=(), seq=lag.seq, op=lag.op, since=lag.since, age_seconds=now - lag.since,
                   timeout_seconds=None, budget_used=None, summary=summary, details=details)
