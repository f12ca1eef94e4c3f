"""The kinds of verdict, spelled once (``Verdict.kind``, the ``kind`` label of ``frexporter_verdict``), and the
bound every verdict builder keeps on per-rank evidence."""

from __future__ import annotations

from frexporter.model import STATE_STARTING

MISSING_RANK = "missing_rank"
MISMATCH_KIND = "mismatch"
STALLED = "stalled"
RANK_DOWN_KIND = "rank_down"
RANK_UNRESPONSIVE_KIND = "rank_unresponsive"
STRAGGLER = "straggler"  # a rank consistently late to a PG's collectives (PGState.lateness_seconds)
# A rank its launcher started on this node that never published (never started, died before install(), its
# recorder failed) or vanished, while its local peers wait for it in init_process_group or a collective.
RANK_ABSENT = "rank_absent"
KINDS = (MISSING_RANK, MISMATCH_KIND, STALLED, RANK_DOWN_KIND, RANK_UNRESPONSIVE_KIND, STRAGGLER, RANK_ABSENT)
STARTING = STATE_STARTING  # RankState.state of a rank without a process group yet
# Post-mortem only (`analyze DIR`, from whole dumps; see ``history``): not hangs, never live verdicts.
PAST_MISMATCH = "past_mismatch"  # a collective that completed although its ranks disagreed on it
LAGGING_RANK = "lagging_rank"  # a rank still at a collective its peers saw complete
POST_MORTEM_KINDS = (PAST_MISMATCH, LAGGING_RANK)

NO_SEQ = -1  # seq of a verdict that names no collective (a down rank nobody waits for yet)
MAX_DETAIL_RANKS = 16  # per-rank evidence kept in a verdict's details
