from __future__ import annotations

import os
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from frexporter import spool
from frexporter.app import App, ServeConfig, build_app
from tests import spoolgen
from tests.fakes.node import Node
from tests.harness import EXPORTER_OPTIONS, REQUIRE_TOOLS_ENV, Job, tools_required
from tests.shared.wedged_stacks import Rig

if TYPE_CHECKING:  # the otlp extra is optional: tests/*/test_otlp.py skip without it
    from frexporter.outputs.otlp import OtlpPusher

pytest_plugins = ["tests.promstack"]

E2E_DIR = Path(__file__).resolve().parent / "e2e"


def _skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The folder says the kind: every test under tests/e2e/ is marked e2e (``pytest -m "not e2e"`` is the fast
    run, the same set as ``pytest tests/unit``). See pyproject.toml's e2e marker for what makes a test e2e."""
    for item in items:
        if E2E_DIR in item.path.resolve().parents:
            item.add_marker(pytest.mark.e2e)


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
        options = dict(EXPORTER_OPTIONS)
        options.update(kw)
        app = build_app(ServeConfig(directory=str(directory), host="127.0.0.1", **options))
        app.start()
        apps.append(app)
        return RunningExporter(app)

    yield make
    for app in apps:
        app.stop()


# ---------------------------------------------------------------- fixtures of more than one test module


@pytest.fixture
def node_factory(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    nodes: list[Node] = []

    def make(ranks: int = 2, **config: Any) -> Node:
        node = Node(tmp_path / f"n{len(nodes)}", ranks, **config)
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.close()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    # unix socket paths are short; pytest's tmp_path can be too long for one
    with tempfile.TemporaryDirectory(prefix="frx-") as d:
        os.chmod(d, 0o700)
        yield Path(d)


@pytest.fixture
def pushers() -> Iterator[list[OtlpPusher]]:
    made: list[OtlpPusher] = []
    yield made
    for pusher in made:
        pusher.shutdown()


@pytest.fixture
def spool_dir(tmp_path: Path) -> Path:
    d = tmp_path / "spool"
    spoolgen.write_rank(d, "job", 0, pgs=2)
    os.chmod(d, spool.DIR_MODE)
    return d


@pytest.fixture
def rig(tmp_path: Path):
    rigs: list[Rig] = []

    def make(*args: object, **kw: object) -> Rig:
        rigs.append(Rig(tmp_path / f"spool{len(rigs)}", *args, **kw))  # type: ignore[arg-type]
        return rigs[-1]

    yield make
    for r in rigs:
        r.close()
