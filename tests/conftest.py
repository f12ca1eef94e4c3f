from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from frexporter.app import App, ServeConfig, build_app
from tests.harness import REQUIRE_TOOLS_ENV, Job, tools_required

pytest_plugins = ["tests.promstack"]


def _skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Where every tool is required (CI), a skip from anywhere (a marker, importorskip, a fixture) is a failure:
    a test that did not run must not pass for one that did."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if tools_required() and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped, but {REQUIRE_TOOLS_ENV}=1 forbids skips: {_skip_reason(report)}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """The same for a whole module skipped while it was collected."""
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if tools_required() and report.skipped:
        report.outcome = "failed"
        report.longrepr = f"skipped, but {REQUIRE_TOOLS_ENV}=1 forbids skips: {_skip_reason(report)}"


class RunningExporter:
    def __init__(self, app: App) -> None:
        self.app = app
        self.base = f"http://127.0.0.1:{app.port}"

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.base + path, timeout=10) as resp:
            return resp.read().decode()

    @property
    def snapshot(self):
        return self.app.exporter.snapshot

    def rank(self, rank: int, job_id: str = "job"):
        for r in self.snapshot.ranks:
            if r.rank == rank and r.job_id == job_id:
                return r
        return None


@pytest.fixture
def job_factory(tmp_path: Path) -> Iterator:
    jobs: list[Job] = []

    def make(scenario: str, world: int, **kw: object) -> Job:
        job = Job(tmp_path / f"job{len(jobs)}", scenario, world, **kw)  # type: ignore[arg-type]
        jobs.append(job)
        return job.start()

    yield make
    for job in jobs:
        job.stop()


@pytest.fixture
def exporter_factory() -> Iterator:
    apps: list[App] = []

    def make(directory: Path, **kw: object) -> RunningExporter:
        options = {"port": 0, "poll_interval": 0.2, "rank_timeout": 1.0, "sources": ("ranks",), "deep_interval": 1.0}
        options.update(kw)
        app = build_app(ServeConfig(directory=str(directory), host="127.0.0.1", **options))  # type: ignore[arg-type]
        app.start()
        apps.append(app)
        return RunningExporter(app)

    yield make
    for app in apps:
        app.stop()
