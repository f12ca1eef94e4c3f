"""Straggler signal: per-rank lateness from FR entries of local ranks, its gauge, and the straggler verdict.

Its unit tests are in tests/unit/test_straggler.py."""

from __future__ import annotations

from typing import Any

import pytest

from frexporter import naming as n
from frexporter.analysis import STRAGGLER, VerdictConfig, evaluate
from tests.harness import metrics, sample, wait_for
from tests.shared.straggler import only_straggler

# ---------------------------------------------------------------- a real gloo job


def test_real_gloo_job_with_a_late_rank(job_factory: Any, exporter_factory: Any) -> None:
    late = 0.15
    job = job_factory("straggler", 2, env={"JOB_LATE_SECONDS": str(late), "JOB_STEPS": "14"})
    exp = exporter_factory(job.spool)
    job.wait_ready()

    def scores() -> dict[int, tuple[float | None, int]] | None:
        states = {r: exp.rank(r) for r in (0, 1)}
        if any(s is None or not s.pgs for s in states.values()):
            return None
        out = {r: (s.pgs[0].lateness_seconds, s.pgs[0].lateness_samples) for r, s in states.items() if s}
        return out if all(samples >= 14 for _, samples in out.values()) else None

    seen = wait_for(scores, timeout=30, what="lateness of both ranks over all 14 all_reduces")
    assert seen[0][0] == pytest.approx(0.0, abs=0.02)
    assert seen[1][0] == pytest.approx(late, abs=0.1)
    parsed = metrics(exp.get("/metrics"))
    assert sample(parsed, n.RANK_STRAGGLER_LATENESS_SECONDS, rank="1", pg_desc="default_pg") == \
        pytest.approx(late, abs=0.1)
    # The default floor (1 s) keeps a 0.15 s skew quiet; a lower one names rank 1.
    snap = exp.snapshot
    assert not [v for v in evaluate(snap.ranks, snap.time) if v.kind == STRAGGLER]
    config = VerdictConfig(straggler_min_lateness=late / 2, straggler_min_samples=10)
    assert only_straggler(evaluate(snap.ranks, snap.time, config)).ranks == (1,)
