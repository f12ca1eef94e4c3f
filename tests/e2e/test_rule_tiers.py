"""The rules in two tiers (scripts/rule_tiers.py) under promtool: every unit test of tests/rules/ passes on the shard
and global files loaded together (one shard: the same alerts, labels and texts as the single file), and the global
tier's own tests (tests/rules/tiers/) join two shards. tests/e2e/test_tiers_live.py runs real shards.

The split itself is unit-tested in tests/unit/test_rule_tiers.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from scripts import rule_tiers
from tests.harness import REPO, require_tool
from tests.rulefile import load_rules, render_rules
from tests.shared.rules import UNIT_TESTS, with_rules

PROMTOOL_TIMEOUT_S = 120
TIER_TESTS = sorted((REPO / "tests" / "rules" / "tiers").glob("*.yml"))


@pytest.fixture(scope="module")
def promtool() -> str:
    return require_tool("promtool", "Debian: apt-get install prometheus")


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=PROMTOOL_TIMEOUT_S, check=False)


def _write_tiers(directory: Path, scale: float = 1.0) -> list[Path]:
    doc = yaml.safe_load(render_rules(scale))
    paths = []
    for tier in rule_tiers.TIERS:
        path = directory / f"{tier}.rules.yml"
        path.write_text(rule_tiers.render(doc, tier), encoding="utf-8")
        paths.append(path)
    return paths


def _against(test_file: Path, rule_files: list[Path], directory: Path) -> Path:
    """``test_file`` with its rules replaced by ``rule_files``, evaluated shard groups first (as one Prometheus would
    in one group: a later group reads an earlier one's records of the same evaluation)."""
    spec = with_rules(test_file, yaml.safe_load(test_file.read_text(encoding="utf-8")), rule_files)
    spec["group_eval_order"] = [g["name"] for p in spec["rule_files"]
                                for g in yaml.safe_load(Path(p).read_text())["groups"]]
    copy = directory / test_file.name
    copy.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return copy


def test_tier_files_pass_promtool_check_and_lint(promtool: str) -> None:
    for tier in rule_tiers.TIERS:
        path = REPO / rule_tiers.TIER_FILES[tier]
        result = _run([promtool, "check", "rules", "--lint=all", "--lint-fatal", str(path)])
        assert result.returncode == 0, result.stdout + result.stderr
        assert re.search(r"SUCCESS: [1-9]\d* rules found", result.stdout), result.stdout


def test_every_unit_test_passes_on_the_two_tiers_together(promtool: str, tmp_path: Path) -> None:
    copies = [_against(t, _write_tiers(tmp_path), tmp_path) for t in UNIT_TESTS]
    result = _run([promtool, "test", "rules", *map(str, copies)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(UNIT_TESTS), result.stdout


def test_the_two_tiers_pin_every_alert_to_its_shipped_timing(promtool: str, tmp_path: Path) -> None:
    """Halved timings fail for every alert on the tiers too: the tiers keep the single file's boundaries."""
    copies = [_against(t, _write_tiers(tmp_path, 0.5), tmp_path) for t in UNIT_TESTS]
    result = _run([promtool, "test", "rules", *map(str, copies)])
    assert result.returncode != 0, result.stdout
    failed = set(re.findall(r"alertname: (\w+), time:", result.stdout + result.stderr))
    assert failed == {r["alert"] for g in load_rules()["groups"] for r in g["rules"] if "alert" in r}


def test_global_tier_unit_tests_pass(promtool: str) -> None:
    assert TIER_TESTS, "no promtool unit tests in tests/rules/tiers/"
    for test_file in TIER_TESTS:
        spec = yaml.safe_load(test_file.read_text(encoding="utf-8"))
        assert [(test_file.parent / f).resolve() for f in spec["rule_files"]] == [
            (REPO / rule_tiers.TIER_FILES[rule_tiers.GLOBAL]).resolve()]
    result = _run([promtool, "test", "rules", *map(str, TIER_TESTS)])
    assert result.returncode == 0, result.stdout + result.stderr
