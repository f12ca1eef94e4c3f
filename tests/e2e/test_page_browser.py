"""The `/` page in a real headless Chromium, on a real gloo job whose culprit is busy: the culprit's row is
highlighted with its activity, the verdict shows the watchdog budget left, and the page reloads by itself."""

from __future__ import annotations

from frexporter.outputs.api import PAGE_REFRESH_SECONDS
from tests.harness import require_module, require_tool, wait_for


def test_page_highlights_the_culprit_and_refreshes(job_factory, exporter_factory) -> None:
    chromium = require_tool("chromium", "apt-get install chromium")
    sync_api = require_module("playwright.sync_api", "playwright")
    job = job_factory("culprit", 2, env={"JOB_CULPRIT": "busy", "JOB_TIMEOUT": "120"})
    job.wait_ready()
    exp = exporter_factory(job.spool, stuck_after=2.0)
    wait_for(lambda: any(v.activity.get("1") is not None and v.activity["1"].state == "busy"
                         for v in exp.snapshot.verdicts), timeout=30, what="a verdict whose culprit is busy")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page()
            loads: list[str] = []
            page.on("load", lambda: loads.append(page.url))
            page.goto(exp.base + "/", wait_until="load")
            culprit = page.locator("tr.culprit")
            assert culprit.count() >= 1
            row = culprit.first.inner_text()
            assert "busy in culprit_busy_checkpoint (job.py:" in row and "% CPU" in row
            highlighted = {c.inner_text() for c in page.locator("tr.culprit td:nth-child(2)").all()}
            assert highlighted == {"1"}  # the culprit's rows only, not the waiting rank's
            # Highlighted as the eye sees it, not only by a class name.
            background = culprit.first.evaluate("e => getComputedStyle(e).backgroundColor")
            assert background not in ("rgba(0, 0, 0, 0)", "transparent")
            verdict = page.locator("li", has_text="never joined").first.inner_text()
            assert "Rank 1 has been busy in culprit_busy_checkpoint" in verdict
            assert "watchdog budget left" in verdict
            # Reloads by itself: a second load event with no action of ours.
            wait_for(lambda: (page.wait_for_timeout(100), len(loads) >= 2)[1], timeout=PAGE_REFRESH_SECONDS * 4,
                     what="the page reloading itself")
        finally:
            browser.close()
    job.touch("stop")
