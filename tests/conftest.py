from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from frexporter.app import App, build_app
from tests.harness import Job

pytest_plugins = ["tests.promstack"]


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
        options = {"port": 0, "poll_interval": 0.2, "rank_timeout": 1.0, "nvml": False, "deep_interval": 1.0}
        options.update(kw)
        app = build_app(directory=str(directory), host="127.0.0.1", **options)  # type: ignore[arg-type]
        app.start()
        apps.append(app)
        return RunningExporter(app)

    yield make
    for app in apps:
        app.stop()
