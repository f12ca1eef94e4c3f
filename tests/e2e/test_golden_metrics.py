"""/metrics for a fixed snapshot equals the committed golden file, and promtool accepts it.

Its unit tests are in tests/unit/test_golden_metrics.py."""

from __future__ import annotations

import subprocess

from tests.fakes.snapshot import GOLDEN
from tests.harness import require_tool


def test_golden_metrics_pass_promtool() -> None:
    promtool = require_tool("promtool")
    out = subprocess.run([promtool, "check", "metrics"], input=GOLDEN.read_text(), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
