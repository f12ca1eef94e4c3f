"""The Grafana dashboards in grafana/: committed JSON equals what grafana/generate.py
(the grafana/generator package) builds, the JSON loads into the Grafana 11.6 schema
(grafana-foundation-sdk), every query is PromQL that promtool parses, and every series
a query reads is one that frexporter exports, one of its recording rules, or Prometheus' own.

Its unit tests are in tests/unit/test_dashboards.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO, require_module, require_tool
from tests.shared.dashboards import all_exprs

# The SDK is dev tooling, pinned in the test extra.
require_module("grafana_foundation_sdk", "grafana-foundation-sdk (the test extra)")

GRAFANA = REPO / "grafana"
PROMTOOL_TIMEOUT_S = 120


def test_script_runs_from_a_checkout_without_installing_frexporter() -> None:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, str(GRAFANA / "generate.py"), "--check"],
        cwd=REPO.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- PromQL ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def promtool() -> str:
    return require_tool("promtool", "Debian: apt-get install prometheus")


def _promtool_parse(promtool: str, tmp_path: Path, exprs: list[tuple[str, str]]) -> subprocess.CompletedProcess[str]:
    """Check ``(name, expr)`` pairs as recording rules, one group each so that errors name the query."""
    groups = [
        {"name": name, "rules": [{"record": f"frexporter_dashboard_query_{i}", "expr": expr}]}
        for i, (name, expr) in enumerate(exprs)
    ]
    path = tmp_path / "dashboard_queries.rules.yml"
    path.write_text(json.dumps({"groups": groups}, indent=1), encoding="utf-8")  # JSON is YAML
    return subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=PROMTOOL_TIMEOUT_S, check=False
    )


def test_every_query_parses_with_promtool(promtool: str, tmp_path: Path) -> None:
    exprs = all_exprs()
    result = _promtool_parse(promtool, tmp_path, exprs)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout


def test_promtool_harness_catches_a_bad_query(promtool: str, tmp_path: Path) -> None:
    result = _promtool_parse(promtool, tmp_path, [("good", "sum(up)"), ("frexporter-job / Broken / A", "sum(up")])
    assert result.returncode != 0
    assert "frexporter-job / Broken / A" in result.stdout + result.stderr
