"""A real Prometheus + Alertmanager on loopback for end-to-end tests of the shipped alert rules.

One stack per test session (Prometheus 2.42 waits about 5 s before its first scrape, so starting one
per test would dominate the run time): Prometheus scrapes fixed loopback ports reserved for the
session (``exporter_port``, and ``exporter_ports[1]`` for a second node), where each test starts its own
exporter(s), and evaluates ``render_rules(SCALE)``; Alertmanager
posts every notification to an in-process webhook receiver that records it. With ``hold_busy`` it routes as
docs/detection.md recommends instead ("Routing busy culprits"): alerts whose culprit is busy computing go to
a second receiver, ``stack.hold``, everything else to ``stack.webhook`` (the pager).

Register with ``pytest_plugins = ["tests.promstack"]`` in tests/conftest.py and take the ``promstack``
fixture. Missing binaries skip the tests, unless FREXPORTER_REQUIRE_TOOLS=1. Outside pytest (benchmarks),
``with running_stack(workdir) as stack:`` starts the same stack, optionally at another scale and interval.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import free_port, missing, wait_for
from tests.rulefile import render_rules

# Shrinks the shipped timings tenfold: FrexporterCollectiveDesync's 30 s threshold becomes 3 s and its
# "for: 15s" 1.5 s, FrexporterRankDown's "for: 1m" 6 s. With 1 s scrape and evaluation intervals that
# keeps the ratio of interval to threshold no worse than in production (15 s against 30 s).
SCALE = 0.1
INTERVAL_S = 1.0
SCRAPE_JOB = "frexporter"  # FrexporterExporterDown selects exporters by a job name containing this
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
HTTP_TIMEOUT_S = 5.0
# The child route of docs/detection.md ("Routing busy culprits"; tests/unit/test_busy_routing.py checks that the
# docs show these routes): a desync whose culprit computes (a checkpoint) is held, not paged.
HOLD_RECEIVER = "hold"
PAGE_RECEIVER = "page"
HOLD_BUSY_ROUTES = [{"receiver": HOLD_RECEIVER, "matchers": ['culprit_state="busy"']}]


@dataclass(frozen=True)
class Notification:
    """One alert out of a webhook POST from Alertmanager."""

    received: float  # time.time() when the POST arrived
    status: str  # "firing" or "resolved"
    labels: dict[str, str]
    annotations: dict[str, str]


class WebhookReceiver:
    """Records every Alertmanager webhook POST, in arrival order."""

    def __init__(self, path: str = "/hook") -> None:
        self._path = path
        self._lock = threading.Lock()
        self._posts: list[tuple[float, dict[str, Any]]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                try:
                    payload = json.loads(body)
                except ValueError:
                    payload = {"unparsable": body.decode(errors="replace")}
                receiver._record(payload)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass  # Alertmanager posts every second while alerts fire; keep the test output readable

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="webhook", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}{self._path}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _record(self, payload: dict[str, Any]) -> None:
        with self._lock:
            self._posts.append((time.time(), payload))

    def posts(self) -> list[tuple[float, dict[str, Any]]]:
        with self._lock:
            return list(self._posts)

    def notifications(self, **labels: str) -> list[Notification]:
        """Every alert posted so far whose labels include ``labels`` (e.g. job_id=...)."""
        out = []
        for received, payload in self.posts():
            for alert in payload.get("alerts", []):
                alert_labels = alert.get("labels", {})
                if all(alert_labels.get(k) == v for k, v in labels.items()):
                    out.append(Notification(received, alert.get("status", ""), alert_labels,
                                            alert.get("annotations", {})))
        return out


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as resp:
        return json.loads(resp.read())


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/-/ready", timeout=HTTP_TIMEOUT_S) as resp:
            return resp.status == 200
    except OSError:
        return False


_RFC3339 = re.compile(r"(.+T\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)")


def parse_rfc3339(text: str) -> float:
    # Go prints up to nanoseconds and "Z", neither of which Python 3.10's fromisoformat takes.
    match = _RFC3339.fullmatch(text)
    if match is None:
        raise ValueError(f"not an RFC 3339 time: {text!r}")
    head, frac, zone = match.groups()
    stamp = datetime.fromisoformat(head + ("+00:00" if zone == "Z" else zone)).timestamp()
    return stamp + float("0." + (frac or "0"))


class QueryError(Exception):
    """Prometheus refused a query (bad PromQL, a matching error): a bug in the query, not a wait."""


class Daemons:
    """A stack's child processes, each logging to ``workdir/NAME.log``; stopped together (also tests/vmstack.py)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def spawn(self, name: str, args: list[str]) -> None:
        with open(self.workdir / f"{name}.log", "wb") as log:
            self._procs.append((name, subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)))

    def alive(self, name: str) -> bool:
        """True while ``name`` runs; RuntimeError with its log once it has exited."""
        for proc_name, proc in self._procs:
            if proc_name == name and proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode}:\n{self.log(name)}")
        return True

    def pid(self, name: str) -> int:
        """The process id of ``name`` (its CPU and memory in /proc, for benchmarks)."""
        return next(proc.pid for proc_name, proc in self._procs if proc_name == name)

    def log(self, name: str) -> str:
        try:
            return (self.workdir / f"{name}.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        for _, proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in self._procs:
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class PromStack:
    """Handles of a running Prometheus + Alertmanager + webhook receiver."""

    def __init__(self, workdir: Path, prometheus: str, alertmanager: str, scale: float = SCALE,
                 interval: float = INTERVAL_S, exporters: int = 1, hold_busy: bool = False) -> None:
        """``exporters``: loopback ports Prometheus scrapes, for as many exporters of one job (nodes)."""
        self.workdir = workdir
        self.scale = scale
        self.interval = interval
        self.exporter_ports = tuple(free_port() for _ in range(exporters))
        self.exporter_port = self.exporter_ports[0]
        self.prom_url = f"http://127.0.0.1:{free_port()}"
        self.am_url = f"http://127.0.0.1:{free_port()}"
        self.webhook = WebhookReceiver()  # every notification, or with hold_busy those that page
        self.hold = WebhookReceiver("/hold") if hold_busy else None
        self._bins = (prometheus, alertmanager)
        self._daemons = Daemons(workdir)

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> PromStack:
        prometheus, alertmanager = self._bins
        self.webhook.start()
        if self.hold is not None:
            self.hold.start()
        rules = self.workdir / "frexporter.rules.yml"
        rules.write_text(render_rules(self.scale), encoding="utf-8")
        am_config = self.workdir / "alertmanager.yml"
        # "..." groups by every label: one notification per alert, nothing held back for a sibling.
        route: dict[str, Any] = {"receiver": "webhook", "group_by": ["..."], "group_wait": "1s",
                                 "group_interval": "1s", "repeat_interval": "1h"}
        receivers = [{"name": "webhook", "webhook_configs": [{"url": self.webhook.url, "send_resolved": True}]}]
        if self.hold is not None:
            route |= {"receiver": PAGE_RECEIVER, "routes": HOLD_BUSY_ROUTES}
            receivers = [
                {"name": PAGE_RECEIVER, "webhook_configs": [{"url": self.webhook.url, "send_resolved": True}]},
                {"name": HOLD_RECEIVER, "webhook_configs": [{"url": self.hold.url, "send_resolved": True}]},
            ]
        am_config.write_text(yaml.safe_dump({"route": route, "receivers": receivers}), encoding="utf-8")
        prom_config = self.workdir / "prometheus.yml"
        prom_config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": f"{self.interval:g}s", "evaluation_interval": f"{self.interval:g}s",
                       "scrape_timeout": f"{self.interval:g}s"},
            "rule_files": [str(rules)],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [self.am_url.split("//")[1]]}]}]},
            "scrape_configs": [{"job_name": SCRAPE_JOB,
                                "static_configs": [{"targets": [f"127.0.0.1:{port}"
                                                                for port in self.exporter_ports]}]}],
        }), encoding="utf-8")
        self._daemons.spawn("alertmanager", [
            alertmanager, f"--config.file={am_config}", f"--storage.path={self.workdir / 'am-data'}",
            f"--web.listen-address={self.am_url.split('//')[1]}",
            # Empty disables HA gossip, which would otherwise bind 0.0.0.0:9094.
            "--cluster.listen-address=", "--log.level=info",
        ])
        self._daemons.spawn("prometheus", [
            prometheus, f"--config.file={prom_config}", f"--storage.tsdb.path={self.workdir / 'prom-data'}",
            f"--web.listen-address={self.prom_url.split('//')[1]}", "--storage.tsdb.retention.time=1h",
            "--log.level=info",
        ])
        for name, url in (("alertmanager", self.am_url), ("prometheus", self.prom_url)):
            wait_for(functools.partial(self._started, name, url), timeout=START_TIMEOUT_S, interval=0.05,
                     what=f"{name} ready")
        return self

    def _started(self, name: str, url: str) -> bool:
        return self._daemons.alive(name) and _ready(url)

    def log(self, name: str) -> str:
        return self._daemons.log(name)

    def stop(self) -> None:
        self._daemons.stop()
        self.webhook.stop()
        if self.hold is not None:
            self.hold.stop()

    # ---------------------------------------------------------------- queries

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The result vector of an instant query."""
        return instant_query(self.prom_url, promql)

    def alerts(self, **labels: str) -> list[dict[str, Any]]:
        """Prometheus' pending and firing alerts whose labels include ``labels``."""
        found: list[dict[str, Any]] = get_json(f"{self.prom_url}/api/v1/alerts")["data"]["alerts"]
        return [a for a in found if all(a["labels"].get(k) == v for k, v in labels.items())]

    def wait_target_up(self, since: float, timeout: float = 20.0, port: int | None = None) -> None:
        """Until Prometheus has scraped the exporter port (the first unless ``port``) successfully after unix
        time ``since`` (the first scrape after the stack starts takes about 5 s: target discovery is batched)."""
        wait_scraped(self.prom_url, self.exporter_port if port is None else port, since, timeout)


def instant_query(url: str, promql: str, **params: str) -> list[dict[str, Any]]:
    """The result vector of an instant query to the Prometheus-compatible API at ``url``."""
    try:
        body = get_json(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": promql, **params}))
    except urllib.error.HTTPError as e:
        # The engine says why in the body. Not an AssertionError: wait_for must not retry a bad query.
        raise QueryError(f"query {promql!r}: HTTP {e.code}: {e.read().decode(errors='replace')}") from e
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def wait_scraped(url: str, port: int, since: float, timeout: float) -> None:
    """Until the scraper at ``url`` (Prometheus, vmagent: the same targets API) has scraped 127.0.0.1:``port``
    successfully after unix time ``since``."""

    def up() -> bool:
        for target in get_json(f"{url}/api/v1/targets")["data"]["activeTargets"]:
            if target["scrapeUrl"].startswith(f"http://127.0.0.1:{port}/") and (
                target["health"] == "up" and parse_rfc3339(target["lastScrape"]) > since
            ):
                return True
        return False

    wait_for(up, timeout=timeout, interval=0.1, what=f"{url}: target 127.0.0.1:{port} up")


class MissingTool(RuntimeError):
    """Prometheus or Alertmanager is not on PATH."""


def _binary(*names: str) -> str:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    raise MissingTool(f"none of {', '.join(names)} on PATH "
                      "(Debian: apt-get install prometheus prometheus-alertmanager)")


def binaries() -> tuple[str, str]:
    """Paths of prometheus and alertmanager; MissingTool when either is missing."""
    return _binary("prometheus"), _binary("prometheus-alertmanager", "alertmanager")


@contextmanager
def running_stack(workdir: Path, scale: float = SCALE, interval: float = INTERVAL_S,
                  exporters: int = 1, hold_busy: bool = False) -> Iterator[PromStack]:
    """A started stack for the ``with`` block, stopped after it (also when it fails to start)."""
    prometheus, alertmanager = binaries()
    workdir.mkdir(parents=True, exist_ok=True)
    stack = PromStack(workdir, prometheus, alertmanager, scale=scale, interval=interval, exporters=exporters,
                      hold_busy=hold_busy)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def promstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PromStack]:
    try:
        binaries()
    except MissingTool as e:
        missing(str(e))
    # Two ports: a job split over two nodes is two exporters feeding one Prometheus (tests/e2e/test_two_exporters.py).
    with running_stack(tmp_path_factory.mktemp("promstack"), exporters=2) as stack:
        yield stack
