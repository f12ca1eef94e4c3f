"""Names every module of the generator shares: dashboard uids and files, variables, the datasource, paths."""

from __future__ import annotations

from pathlib import Path

from grafana_foundation_sdk.models import dashboard as mdash

from frexporter import naming as n

REPO = Path(__file__).resolve().parents[2]
OUT_DIR = REPO / "grafana"
TAGS = ["frexporter"]
# Where an alert's runbook lives, relative to the repository root: the canonical rules' runbook_url says the
# same (tests/unit/test_dashboards.py checks). The Active alerts table links to it under the dashboard variable
# below, which the Helm chart fills from prometheusRule.runbookBaseURL; frexporter has no address of its own.
RUNBOOK_PATH = "docs/runbooks/{}.md"
V_RUNBOOK_BASE = "runbook_base"

UID_JOB = "frexporter-job"
UID_PG = "frexporter-pg"
UID_RANK = "frexporter-rank"
DASHBOARD_FILES = {
    UID_JOB: "frexporter-job.json",
    UID_PG: "frexporter-pg.json",
    UID_RANK: "frexporter-rank.json",
}

# Dashboard variables are named after the labels they select on, so that
# Grafana's "include variables" links and ${var:queryparam} carry over.
V_DATASOURCE = "datasource"
V_JOB = n.L_JOB_ID
V_PG = n.L_PG
V_RANK = n.L_RANK

# Values that make every query a valid, data-returning PromQL expression for a
# job like tests/golden/metrics.txt; callers override what their job differs in.
SAMPLE_VARIABLES: dict[str, str] = {
    V_DATASOURCE: "prometheus",
    V_JOB: "llm",
    V_PG: "0",
    V_RANK: "0",
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "1h",
}

DATASOURCE = mdash.DataSourceRef(type_val="prometheus", uid="${" + V_DATASOURCE + "}")
