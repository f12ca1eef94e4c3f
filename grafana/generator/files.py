"""The committed JSON files: render, write, check for drift, and the command line of ``grafana/generate.py``."""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .build import build_dashboards
from .constants import DASHBOARD_FILES, OUT_DIR

DESCRIPTION = "Generate frexporter's Grafana dashboards, or check the committed JSON for drift."


def render(dashboard: Mapping[str, Any]) -> str:
    """The committed form: sorted keys, 2-space indent, trailing newline."""
    return json.dumps(dashboard, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def _rendered() -> dict[str, str]:
    return {DASHBOARD_FILES[uid]: render(dashboard) for uid, dashboard in build_dashboards().items()}


def write(out_dir: Path = OUT_DIR) -> list[Path]:
    """Write every dashboard; returns the files whose content changed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    changed = []
    for name, text in _rendered().items():
        path = out_dir / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            changed.append(path)
    return changed


def check(out_dir: Path = OUT_DIR, *, max_diff_lines: int = 60) -> list[str]:
    """Problems with the committed dashboards: missing, differing (with a diff) or stale files."""
    problems = []
    expected = _rendered()
    for name, text in expected.items():
        path = out_dir / name
        if not path.exists():
            problems.append(f"{path}: missing")
            continue
        committed = path.read_text(encoding="utf-8")
        if committed != text:
            diff = list(
                difflib.unified_diff(
                    committed.splitlines(), text.splitlines(), f"{name} (committed)", f"{name} (generated)", lineterm=""
                )
            )
            shown = diff[:max_diff_lines]
            if len(diff) > max_diff_lines:
                shown.append(f"... {len(diff) - max_diff_lines} more diff lines")
            problems.append(f"{path}: differs from the generator\n" + "\n".join(shown))
    for path in sorted(out_dir.glob("frexporter-*.json")):
        if path.name not in expected:
            problems.append(f"{path}: stale, no dashboard generates it")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the committed JSON drifted")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="directory of the dashboard JSON (default: grafana/)")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.out)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print("dashboards are out of date: run `python grafana/generate.py` and commit the result", file=sys.stderr)
            return 1
        print(f"{len(DASHBOARD_FILES)} dashboards up to date")
        return 0
    changed = write(args.out)
    for path in changed:
        print(f"wrote {path}")
    if not changed:
        print(f"{len(DASHBOARD_FILES)} dashboards already up to date")
    return 0
