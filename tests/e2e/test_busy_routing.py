"""The Alertmanager routing of docs/detection.md ("Routing busy culprits"): busy culprits are held, the rest pages.

The docs' block passes amtool and routes as described; the e2e stack (tests/promstack.py, ``hold_busy``) uses
the same route tree, and a real Alertmanager delivers by it.

Its unit tests are in tests/unit/test_busy_routing.py.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.harness import missing, require_tool, wait_for
from tests.promstack import HOLD_RECEIVER, PAGE_RECEIVER, MissingTool, binaries, running_stack
from tests.shared.busy_routing import doc_block

DESYNC = "FrexporterCollectiveDesync"


def _route(config: Path, *labels: str) -> subprocess.CompletedProcess[str]:
    amtool = require_tool("amtool", "Debian: prometheus-alertmanager")
    return subprocess.run([amtool, "config", "routes", "test", "--config.file", str(config), *labels],
                          capture_output=True, text=True, timeout=60)


def test_docs_routing_passes_amtool_and_holds_only_busy_culprits(tmp_path: Path) -> None:
    config = tmp_path / "alertmanager.yml"
    config.write_text(doc_block())
    amtool = require_tool("amtool", "Debian: prometheus-alertmanager")
    out = subprocess.run([amtool, "check-config", str(config)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    cases = [
        ((f"alertname={DESYNC}", "culprit_state=busy", "severity=info", "job_id=llm", "pg=0"), HOLD_RECEIVER),
        ((f"alertname={DESYNC}", "culprit_state=idle", "severity=warning", "job_id=llm", "pg=0"), PAGE_RECEIVER),
        ((f"alertname={DESYNC}", "culprit_state=unknown", "severity=warning"), PAGE_RECEIVER),
        (("alertname=FrexporterWatchdogBudget", "severity=critical", "job_id=llm", "pg=0"), PAGE_RECEIVER),
        (("alertname=FrexporterRankDown", "severity=critical", "rank=3"), PAGE_RECEIVER),
    ]
    for labels, receiver in cases:
        out = _route(config, f"--verify.receivers={receiver}", *labels)
        assert out.returncode == 0, f"{labels}: {out.stdout}{out.stderr}"


def _post_alert(am_url: str, labels: dict[str, str]) -> None:
    body = json.dumps([{"labels": labels, "startsAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}])
    request = urllib.request.Request(f"{am_url}/api/v2/alerts", data=body.encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        assert resp.status == 200


def test_hold_busy_stack_delivers_busy_culprits_to_hold_and_pages_the_rest(tmp_path: Path) -> None:
    try:
        binaries()
    except MissingTool as e:
        missing(str(e))
    with running_stack(tmp_path, hold_busy=True) as stack:
        assert stack.hold is not None
        busy: dict[str, Any] = {"alertname": DESYNC, "job_id": "routing", "rank": "0", "culprit_state": "busy",
                                "severity": "info"}
        idle = busy | {"rank": "1", "culprit_state": "idle", "severity": "warning"}
        _post_alert(stack.am_url, busy)
        _post_alert(stack.am_url, idle)
        held = wait_for(lambda: stack.hold.notifications(job_id="routing"), timeout=30, interval=0.1,
                        what="the busy culprit at the hold receiver")
        paged = wait_for(lambda: stack.webhook.notifications(job_id="routing"), timeout=30, interval=0.1,
                         what="the idle culprit at the page receiver")
        assert {n.labels["rank"] for n in held} == {"0"}
        assert {n.labels["rank"] for n in paged} == {"1"}
