"""The dashboards this package builds, and every query their panels run, for the files and for tests."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from .board import Board
from .job import job_dashboard
from .pg import pg_dashboard
from .queries import Needs, PanelQuery, substitute
from .rank import rank_dashboard

# In drill-down order; the order the files are written and queries listed in.
_BOARDS = (job_dashboard, pg_dashboard, rank_dashboard)


def _build() -> list[Board]:
    return [make() for make in _BOARDS]


def build_dashboards() -> dict[str, dict[str, Any]]:
    """Dashboard JSON by uid."""
    return {board.uid: board.build() for board in _build()}


def panel_queries() -> list[PanelQuery]:
    """Every panel target of every dashboard, with its raw expression and data conditions."""
    return [query for board in _build() for query in board.queries]


def all_panel_queries(
    variables: Mapping[str, str] | None = None, *, available: Collection[str] | None = None
) -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, expr) for every panel target, variables substituted.

    ``variables`` overrides ``SAMPLE_VARIABLES`` (e.g. ``{"job_id": "job", "rank": "1"}``).
    ``available``: the ``Needs`` conditions a scenario meets; when given, only
    queries that should return data under them are listed. An end-to-end test
    runs these against Prometheus and asserts each returns at least one series.
    """
    allowed = None if available is None else frozenset(available)
    unknown = (allowed or frozenset()) - Needs.ALL
    if unknown:
        raise ValueError(f"unknown conditions {sorted(unknown)}; known: {sorted(Needs.ALL)}")
    return [
        (query.dashboard_uid, query.panel_title, substitute(query.expr, variables))
        for query in panel_queries()
        if allowed is None or query.needs <= allowed
    ]
