"""Verdicts: which rank of which process group is stuck on which collective (pure, no I/O).

``evaluate`` is the engine; ``VerdictTracker`` turns successive evaluations into
appear/clear events. Modules: ``findings`` (per-PG facts), ``matching`` (do
entries at one seq agree, as torch's FR analyzer judges), ``graph`` (root causes
across PGs), ``straggler`` (consistently late ranks), ``gpu`` (NVML facts behind
a verdict), ``text`` (summary phrasing), ``verdicts`` (the public engine),
``tracker`` (appear/clear).
"""

from __future__ import annotations

from frexporter.analysis.kinds import (
    KINDS,
    MISMATCH_KIND,
    MISSING_RANK,
    NO_SEQ,
    RANK_DOWN_KIND,
    RANK_UNRESPONSIVE_KIND,
    STALLED,
    STRAGGLER,
)
from frexporter.analysis.tracker import TrackerUpdate, VerdictKey, VerdictTracker, verdict_key
from frexporter.analysis.verdicts import (
    Verdict,
    VerdictConfig,
    analyze_snapshot,
    budget_left,
    evaluate,
    make_analyzer,
    with_oldest_start,
)

__all__ = [
    "KINDS",
    "MISMATCH_KIND",
    "MISSING_RANK",
    "NO_SEQ",
    "RANK_DOWN_KIND",
    "RANK_UNRESPONSIVE_KIND",
    "STALLED",
    "STRAGGLER",
    "TrackerUpdate",
    "Verdict",
    "VerdictConfig",
    "VerdictKey",
    "VerdictTracker",
    "analyze_snapshot",
    "budget_left",
    "evaluate",
    "make_analyzer",
    "verdict_key",
    "with_oldest_start",
]
