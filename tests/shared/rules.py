"""What both halves of test_rules.py use: the shipped rules and alerts, and the promtool unit tests of them."""

from __future__ import annotations

from typing import Any

from tests.harness import REPO
from tests.rulefile import load_rules

UNIT_TESTS = sorted((REPO / "tests" / "rules").glob("*.yml"))


def shipped_rules() -> list[dict[str, Any]]:
    return [rule for group in load_rules()["groups"] for rule in group["rules"]]


def shipped_alerts() -> list[dict[str, Any]]:
    return [rule for rule in shipped_rules() if "alert" in rule]
