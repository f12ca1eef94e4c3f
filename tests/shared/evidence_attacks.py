"""What both halves of test_evidence_attacks.py use: a verdict, and the bundle name an old exporter gave it."""

from __future__ import annotations

from frexporter.analysis import Verdict

# The name an exporter before this fix gave a lone rank_down bundle of rank 0 of job "job": predictable.
OLD_NAME = "{ts}-rank_down-job---1"


def verdict(rank: int = 0, kind: str = "rank_down", job_id: str = "job") -> Verdict:
    return Verdict(kind=kind, job_id=job_id, pg="", pg_desc="", ranks=(rank,), waiting_ranks=(), seq=-1, op="",
                   since=None, age_seconds=None, timeout_seconds=None, budget_used=None,
                   summary=f"Rank {rank} is down")
