#!/usr/bin/env python3
"""Generate frexporter's Grafana dashboards, or check the committed JSON for drift.

    python grafana/generate.py            # (re)write grafana/frexporter-*.json
    python grafana/generate.py --check    # exit 1 with a diff when they differ from this code

The dashboards are built by the ``grafana.generator`` package (its docstring describes the layout); this
script is its command line, and the module tests import (``from grafana import generate``) for the public API
re-exported below.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Run as a script from a checkout, frexporter need not be installed; its
# names must come from this tree, never from another installed copy.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from grafana.generator.build import all_panel_queries, build_dashboards, panel_queries  # noqa: E402
from grafana.generator.constants import (  # noqa: E402
    DASHBOARD_FILES,
    OUT_DIR,
    SAMPLE_VARIABLES,
    UID_JOB,
    UID_PG,
    UID_RANK,
    V_RUNBOOK_BASE,
)
from grafana.generator.files import check, main, render, write  # noqa: E402
from grafana.generator.promql import ACTIVITY_STYLE  # noqa: E402
from grafana.generator.queries import (  # noqa: E402
    Needs,
    PanelQuery,
    metric_names,
    panel_targets,
    substitute,
    variable_selectors,
)

__all__ = [
    "ACTIVITY_STYLE",
    "DASHBOARD_FILES",
    "OUT_DIR",
    "SAMPLE_VARIABLES",
    "UID_JOB",
    "UID_PG",
    "UID_RANK",
    "V_RUNBOOK_BASE",
    "Needs",
    "PanelQuery",
    "all_panel_queries",
    "build_dashboards",
    "check",
    "main",
    "metric_names",
    "panel_queries",
    "panel_targets",
    "render",
    "substitute",
    "variable_selectors",
    "write",
]

if __name__ == "__main__":
    sys.exit(main())
