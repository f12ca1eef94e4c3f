#!/usr/bin/env python3
"""Copy the canonical rules, their two tiers and the generated dashboards into the Helm chart.

The chart renders its PrometheusRules and dashboard ConfigMaps with ``.Files``, which
only reads files inside the chart directory, so it carries copies:

  frexporter/rules/frexporter.rules.yml         ->  helm/frexporter/files/frexporter.rules.yml
  frexporter/rules/frexporter.shard.rules.yml   ->  helm/frexporter/files/frexporter.shard.rules.yml
  frexporter/rules/frexporter.global.rules.yml  ->  helm/frexporter/files/frexporter.global.rules.yml
  grafana/*.json                                 ->  helm/frexporter/files/dashboards/*.json

The tier files are generated from the canonical one by scripts/rule_tiers.py; this
script copies them as they are committed and does not regenerate them.

``python scripts/sync_chart.py`` refreshes the copies (and removes dashboards whose
source is gone); ``--check`` changes nothing and exits 1 when a copy drifted.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RULES_DIR = Path("frexporter/rules")
# The single-Prometheus rules (prometheusRule.layout: single) and the two tiers (layout: tiered).
RULES_FILES = ("frexporter.rules.yml", "frexporter.shard.rules.yml", "frexporter.global.rules.yml")
DASHBOARDS_SOURCE = Path("grafana")
CHART = Path("helm/frexporter")
RULES_TARGET_DIR = Path("files")
DASHBOARDS_TARGET = Path("files/dashboards")


@dataclass(frozen=True)
class Change:
    kind: str  # "missing", "differs" or "stale"
    target: Path
    source: Path | None

    def describe(self, root: Path) -> str:
        target = _show(self.target, root)
        if self.source is None:
            return f"{target}: stale, its source {DASHBOARDS_SOURCE / self.target.name} is gone"
        source = _show(self.source, root)
        if self.kind == "missing":
            return f"{target}: missing (copy of {source})"
        return f"{target}: differs from {source}"


def _show(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def plan(repo: Path, chart: Path) -> list[Change]:
    """Every copy that does not match its source, and every copied dashboard without one."""
    pairs = [(repo / RULES_DIR / name, chart / RULES_TARGET_DIR / name) for name in RULES_FILES]
    sources = sorted((repo / DASHBOARDS_SOURCE).glob("*.json"))
    pairs += [(src, chart / DASHBOARDS_TARGET / src.name) for src in sources]
    changes = []
    for src, dst in pairs:
        if not src.is_file():
            raise FileNotFoundError(f"{src}: source file not found")
        if not dst.is_file():
            changes.append(Change("missing", dst, src))
        elif dst.read_bytes() != src.read_bytes():
            changes.append(Change("differs", dst, src))
    wanted = {src.name for src in sources}
    for dst in sorted((chart / DASHBOARDS_TARGET).glob("*.json")):
        if dst.name not in wanted:
            changes.append(Change("stale", dst, None))
    return changes


def apply(changes: list[Change]) -> None:
    for change in changes:
        if change.source is None:
            change.target.unlink()
            continue
        change.target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(change.source, change.target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a copy drifted")
    parser.add_argument("--repo", type=Path, default=REPO, help="repository root (default: this script's repo)")
    parser.add_argument("--chart", type=Path, default=None, help="chart directory (default: REPO/helm/frexporter)")
    args = parser.parse_args(argv)
    repo = args.repo.resolve()
    chart = (args.chart or repo / CHART).resolve()
    try:
        changes = plan(repo, chart)
    except FileNotFoundError as e:
        print(f"sync_chart: {e}", file=sys.stderr)
        return 2
    if args.check:
        for change in changes:
            print(f"sync_chart: {change.describe(repo)}", file=sys.stderr)
        if changes:
            print("sync_chart: the chart's copies drifted; run python scripts/sync_chart.py", file=sys.stderr)
            return 1
        return 0
    apply(changes)
    for change in changes:
        verb = "removed" if change.source is None else "updated"
        print(f"sync_chart: {verb} {_show(change.target, repo)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
