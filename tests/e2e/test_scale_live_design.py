"""The rule design benchmarks/scale_live.py measures (--design waits): it passes promtool's check and its own
promtool tests (a desync, a stall, the watchdog budget, a healthy job), the cases its live run does not check.

Its unit tests are in tests/unit/test_scale_live_design.py."""

from __future__ import annotations

import subprocess

from benchmarks.scale_live import DESIGNS
from tests.harness import require_tool

PROMTOOL_TIMEOUT_S = 120


def test_the_waits_design_passes_promtool_check_and_its_tests() -> None:
    promtool = require_tool("promtool", "Debian: apt-get install prometheus")
    path = DESIGNS["waits"][0]
    for args in (["check", "rules", str(path)], ["test", "rules", str(path.with_name("waits_test.yml"))]):
        result = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=PROMTOOL_TIMEOUT_S,
                                check=False)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "SUCCESS" in result.stdout
