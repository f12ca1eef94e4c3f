"""What both halves of test_rules.py use: the shipped rules and alerts, and the promtool unit tests of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.harness import REPO
from tests.rulefile import load_rules

UNIT_TESTS = sorted((REPO / "tests" / "rules").glob("*.yml"))
# Test-only rules that a unit test lists before the shipped file: they write what the exporters would (the waits,
# from the inputs the test gives), so that the shipped rules read them in the same evaluation.
EXPORTER_WAITS = REPO / "tests" / "rules" / "fixtures" / "exporter_waits.rules.yml"
FIXTURES = (EXPORTER_WAITS,)


def fixtures_of(test_file: Path, spec: dict[str, Any]) -> list[Path]:
    """The test-only rule files ``spec`` (loaded from ``test_file``) lists, resolved, in its order."""
    resolved = [(test_file.parent / name).resolve() for name in spec["rule_files"]]
    return [path for path in resolved if path in {f.resolve() for f in FIXTURES}]


def with_rules(test_file: Path, spec: dict[str, Any], rules: list[Path]) -> dict[str, Any]:
    """``spec`` with ``rules`` in place of the shipped rules, after the test-only files it lists."""
    return {**spec, "rule_files": [str(p) for p in [*fixtures_of(test_file, spec), *rules]]}


def shipped_rules() -> list[dict[str, Any]]:
    return [rule for group in load_rules()["groups"] for rule in group["rules"]]


def shipped_alerts() -> list[dict[str, Any]]:
    return [rule for rule in shipped_rules() if "alert" in rule]
