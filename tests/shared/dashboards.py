"""What both halves of test_dashboards.py use: every PromQL expression of the dashboards."""

from __future__ import annotations

from tests.harness import require_module

# The SDK is dev tooling, pinned in the test extra.
require_module("grafana_foundation_sdk", "grafana-foundation-sdk (the test extra)")

from grafana import generate  # noqa: E402 (after the check: it imports the SDK)


def all_exprs() -> list[tuple[str, str]]:
    exprs = [
        (f"{query.dashboard_uid} / {query.panel_title} / {query.ref_id}", generate.substitute(query.expr))
        for query in generate.panel_queries()
    ]
    for uid, dashboard in generate.build_dashboards().items():
        exprs += [
            (f"{uid} / variable {name}", generate.substitute(selector))
            for name, selector in generate.variable_selectors(dashboard)
        ]
    return exprs
