"""A real VictoriaMetrics stack on loopback (vmagent, victoria-metrics, vmalert) evaluating the shipped rules.

The VictoriaMetrics counterpart of tests/promstack.py, for tests that compare what vmalert fires with what
Prometheus fires for the same input: vmagent scrapes the same loopback exporter ports as a ``PromStack`` (so both
read the same exporter at once), under the same job name and intervals, and writes to victoria-metrics; vmalert
evaluates ``render_rules(scale)`` against it, writes its recording rules back there (it has no local storage:
recording rules reach the alerts that read them only through victoria-metrics), and sends its alerts to the
given Alertmanager (the ``PromStack``'s) with the extra label ``ruler="vmalert"`` (on its recorded series too), so
that they reach the same webhook receiver as Prometheus' and can be told apart from them there.

Debian's ``victoria-metrics`` package (1.79) ships all three binaries. tests/e2e/test_vmalert.py starts one stack
for its module next to the session's ``PromStack`` (missing binaries skip it, or fail it under
FREXPORTER_REQUIRE_TOOLS=1); outside pytest, ``with running_vmstack(...) as stack:``.
"""

from __future__ import annotations

import shutil
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from tests.harness import free_port, wait_for
from tests.promstack import (
    HTTP_TIMEOUT_S,
    INTERVAL_S,
    SCALE,
    SCRAPE_JOB,
    START_TIMEOUT_S,
    Daemons,
    MissingTool,
    get_json,
    instant_query,
    wait_scraped,
)
from tests.rulefile import render_rules

BINARIES = ("victoria-metrics", "vmagent", "vmalert")
INSTALL_HINT = "Debian: apt-get install victoria-metrics"
# The label vmalert adds to every alert it sends (-external.label): how its notifications are told from
# Prometheus' at a shared Alertmanager. vmalert also adds "alertgroup" (the rule group's name).
RULER_LABEL = "ruler"
RULER = "vmalert"
ENGINE_LABELS = frozenset({RULER_LABEL, "alertgroup"})


def binaries() -> tuple[str, str, str]:
    """Paths of victoria-metrics, vmagent and vmalert; MissingTool when one is missing."""
    paths = []
    for name in BINARIES:
        path = shutil.which(name)
        if path is None:
            raise MissingTool(f"{name} is not on PATH ({INSTALL_HINT})")
        paths.append(path)
    return paths[0], paths[1], paths[2]


def _duration(seconds: float) -> str:
    """A Go duration flag value (whole milliseconds)."""
    return f"{max(1, round(seconds * 1000))}ms"


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=HTTP_TIMEOUT_S) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _spawn_victoria_metrics(daemons: Daemons, binary: str, workdir: Path, url: str) -> None:
    daemons.spawn("victoria-metrics", [
        binary, f"-storageDataPath={workdir / 'vm-data'}", f"-httpListenAddr={url.split('//')[1]}",
        # By default victoria-metrics answers a query for any time less than 30 s ago as of 30 s ago (unless it
        # says nocache=1, which vmalert 1.79 does not): every alert would come 30 s late. vmalert's
        # -datasource.lookback (VmStack) allows for the data's delay instead, by one evaluation interval.
        "-search.latencyOffset=0s",
    ])
    wait_for(lambda: daemons.alive("victoria-metrics") and _healthy(url), timeout=START_TIMEOUT_S, interval=0.05,
             what="victoria-metrics healthy")


@contextmanager
def running_victoria_metrics(workdir: Path) -> Iterator[str]:
    """victoria-metrics alone (no scraper, no ruler) for the ``with`` block: its URL, for data a test imports
    (``import_samples``) and queries it makes itself."""
    workdir.mkdir(parents=True, exist_ok=True)
    daemons = Daemons(workdir)
    url = f"http://127.0.0.1:{free_port()}"
    try:
        _spawn_victoria_metrics(daemons, binaries()[0], workdir, url)
        yield url
    finally:
        daemons.stop()


def import_samples(url: str, lines: Sequence[str]) -> None:
    """Writes samples to victoria-metrics at ``url``: Prometheus text lines, each with its timestamp (ms)."""
    body = "".join(line + "\n" for line in lines).encode()
    request = urllib.request.Request(f"{url}/api/v1/import/prometheus", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as resp:
        resp.read()


class VmStack:
    """Handles of a running victoria-metrics + vmagent + vmalert."""

    def __init__(self, workdir: Path, exporter_ports: Sequence[int], notifier_url: str, scale: float = SCALE,
                 interval: float = INTERVAL_S, scrape_jobs: Sequence[dict[str, Any]] = ()) -> None:
        """``exporter_ports``: the loopback ports vmagent scrapes; ``notifier_url``: the Alertmanager vmalert
        sends to; ``scrape_jobs``: vmagent's scrape jobs instead of one over ``exporter_ports`` (a simulated
        fleet's, benchmarks/scale_vm.py)."""
        self.workdir = workdir
        self.scale = scale
        self.interval = interval
        self.exporter_ports = tuple(exporter_ports)
        self.exporter_port = self.exporter_ports[0] if self.exporter_ports else 0
        self.scrape_jobs = list(scrape_jobs) or [{"job_name": SCRAPE_JOB, "static_configs": [
            {"targets": [f"127.0.0.1:{port}" for port in self.exporter_ports]}]}]
        self.notifier_url = notifier_url
        self.vm_url = f"http://127.0.0.1:{free_port()}"
        self.agent_url = f"http://127.0.0.1:{free_port()}"
        self.alert_url = f"http://127.0.0.1:{free_port()}"
        self._bins = binaries()
        self._daemons = Daemons(workdir)

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> VmStack:
        victoria_metrics, vmagent, vmalert = self._bins
        interval = _duration(self.interval)
        flush = _duration(self.interval / 10)
        rules = self.workdir / "frexporter.rules.yml"
        rules.write_text(render_rules(self.scale), encoding="utf-8")
        scrape_config = self.workdir / "vmagent.yml"
        scrape_config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": interval, "scrape_timeout": interval},
            "scrape_configs": self.scrape_jobs,
        }), encoding="utf-8")
        _spawn_victoria_metrics(self._daemons, victoria_metrics, self.workdir, self.vm_url)
        self._daemons.spawn("vmagent", [
            vmagent, f"-promscrape.config={scrape_config}", f"-remoteWrite.url={self.vm_url}/api/v1/write",
            f"-remoteWrite.tmpDataPath={self.workdir / 'vmagent-data'}",
            f"-httpListenAddr={self.agent_url.split('//')[1]}",
            # Each scrape on its way to victoria-metrics within a tenth of an interval (default 1 s, a whole one).
            f"-remoteWrite.flushInterval={flush}",
        ])
        self._daemons.spawn("vmalert", [
            vmalert, f"-rule={rules}", f"-datasource.url={self.vm_url}", f"-remoteWrite.url={self.vm_url}",
            f"-notifier.url={self.notifier_url}", f"-httpListenAddr={self.alert_url.split('//')[1]}",
            f"-evaluationInterval={interval}", f"-external.label={RULER_LABEL}={RULER}",
            # Evaluate as of one evaluation interval ago. Prometheus evaluates what it scraped itself; here a scrape
            # reaches the rules only after vmagent's push and victoria-metrics' flush of what it received (every
            # second): queried at "now", the last scrape would be missing or half there (some series at the new
            # scrape, others still at the one before), and vmalert's own recording rules (below) too. Costs
            # one interval of latency (plus up to one more: vmalert 1.79 sends whole seconds, aligned to the
            # interval by the default -datasource.queryTimeAlignment). -datasource.queryStep stays at its
            # 5 m, the lookback of a plain selector like Prometheus' lookback delta: series that end are ended
            # by vmagent's staleness markers, as by Prometheus'.
            f"-datasource.lookback={interval}",
            # vmalert keeps no recording rule results of its own: FrexporterCollectiveDesync reads the culprits its
            # group has just recorded back from victoria-metrics, so they must get there fast (default every 5 s).
            f"-remoteWrite.flushInterval={flush}",
        ])
        for name, url in (("vmagent", self.agent_url), ("vmalert", self.alert_url)):
            self._wait_healthy(name, url)
        return self

    def _wait_healthy(self, name: str, url: str) -> None:
        wait_for(lambda: self._daemons.alive(name) and _healthy(url), timeout=START_TIMEOUT_S, interval=0.05,
                 what=f"{name} healthy")

    def log(self, name: str) -> str:
        return self._daemons.log(name)

    def pid(self, name: str) -> int:
        return self._daemons.pid(name)

    def stop(self) -> None:
        self._daemons.stop()

    # ---------------------------------------------------------------- queries

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The result vector of an instant query to victoria-metrics (MetricsQL), now."""
        return instant_query(self.vm_url, promql, nocache="1")

    def alerts(self, **labels: str) -> list[dict[str, Any]]:
        """vmalert's pending and firing alerts whose labels include ``labels``."""
        found: list[dict[str, Any]] = get_json(f"{self.alert_url}/api/v1/alerts")["data"]["alerts"] or []
        return [a for a in found if all(a["labels"].get(k) == v for k, v in labels.items())]

    def wait_target_up(self, since: float, timeout: float = 20.0, port: int | None = None) -> None:
        """Until vmagent has scraped the exporter port (the first unless ``port``) successfully after unix time
        ``since``."""
        wait_scraped(self.agent_url, self.exporter_port if port is None else port, since, timeout)


@contextmanager
def running_vmstack(workdir: Path, exporter_ports: Sequence[int], notifier_url: str, scale: float = SCALE,
                    interval: float = INTERVAL_S, scrape_jobs: Sequence[dict[str, Any]] = ()) -> Iterator[VmStack]:
    """A started stack for the ``with`` block, stopped after it (also when it fails to start)."""
    workdir.mkdir(parents=True, exist_ok=True)
    stack = VmStack(workdir, exporter_ports, notifier_url, scale=scale, interval=interval, scrape_jobs=scrape_jobs)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()

