"""The per-rank series budget (docs/architecture.md, Budgets): at most 40 series per rank at the defaults.

The reference node and how its series are counted are in tests/shared/series_budget.py (docs/scale.md counts
the same node): 8 ranks in 8 process groups, two of them shared by the node's ranks, at steady state.
"""

from __future__ import annotations

from frexporter import naming as n
from tests.shared.series_budget import CROSS_NODE_PGS, RANKS_PER_NODE, SHARED_PGS, reference_node, series_per_rank

SERIES_BUDGET_PER_RANK = 40


def test_reference_node_is_what_it_claims() -> None:
    snap = reference_node()
    assert len(snap.ranks) == RANKS_PER_NODE
    for rank in snap.ranks:
        assert len(rank.pgs) == len(SHARED_PGS) + len(CROSS_NODE_PGS) == 8
        shared = [pg for pg in rank.pgs if sum(1 for m in pg.ranks if m // RANKS_PER_NODE == 1) > 1]
        assert [pg.name for pg in shared] == list(SHARED_PGS)
        assert all(pg.lateness_seconds is not None for pg in shared)


def test_series_per_rank_within_budget() -> None:
    per_rank, by_family = series_per_rank(reference_node())
    assert by_family[n.RANK_STRAGGLER_LATENESS_SECONDS] == RANKS_PER_NODE * len(SHARED_PGS), by_family
    assert by_family[n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS] == RANKS_PER_NODE, by_family
    assert per_rank <= SERIES_BUDGET_PER_RANK, (
        f"{per_rank:g} series per rank over the budget of {SERIES_BUDGET_PER_RANK}: {dict(by_family)}")
