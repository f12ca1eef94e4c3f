"""The canonical alert and recording rules: promtool's checks, its unit tests in
tests/rules/, the conventions every alert follows, and the timing scaler.

Its unit tests are in tests/unit/test_rules.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.harness import require_tool
from tests.rulefile import RULES_PATH, render_rules
from tests.shared.rules import UNIT_TESTS, shipped_alerts, shipped_rules, with_rules

PROMTOOL_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def promtool() -> str:
    return require_tool("promtool", "Debian: apt-get install prometheus")


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=PROMTOOL_TIMEOUT_S, check=False)


def _check_rules(promtool: str, path: Path) -> None:
    result = _run([promtool, "check", "rules", "--lint=all", "--lint-fatal", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr
    # A file that parses to no rules also "succeeds".
    assert f"SUCCESS: {len(shipped_rules())} rules found" in result.stdout


def test_shipped_rules_pass_promtool_check_and_lint(promtool: str) -> None:
    _check_rules(promtool, RULES_PATH)


@pytest.mark.parametrize("scale", [0.1, 0.01])
def test_scaled_rules_pass_promtool_check(promtool: str, tmp_path: Path, scale: float) -> None:
    path = tmp_path / "scaled.rules.yml"
    path.write_text(render_rules(scale), encoding="utf-8")
    _check_rules(promtool, path)


def test_promtool_unit_tests_pass(promtool: str) -> None:
    assert UNIT_TESTS, "no promtool unit tests in tests/rules/"
    result = _run([promtool, "test", "rules", *map(str, UNIT_TESTS)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_unit_tests_pin_every_alert_to_its_shipped_timing(promtool: str, tmp_path: Path) -> None:
    """The same unit tests against rules with halved timings must fail for
    every alert; otherwise a boundary test would pass whatever the timing."""
    scaled = tmp_path / "scaled.rules.yml"
    scaled.write_text(render_rules(0.5), encoding="utf-8")
    copies = []
    for test_file in UNIT_TESTS:
        spec = with_rules(test_file, yaml.safe_load(test_file.read_text(encoding="utf-8")), [scaled])
        copy = tmp_path / test_file.name
        copy.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
        copies.append(str(copy))
    result = _run([promtool, "test", "rules", *copies])
    assert result.returncode != 0, result.stdout
    failed = set(re.findall(r"alertname: (\w+), time:", result.stdout + result.stderr))
    assert failed == {alert["alert"] for alert in shipped_alerts()}
