"""The shipped rules (scaled) against a real Prometheus scraping nodes whose clocks are off by 120 s.

tests/rules/clock_skew_test.yml pins the same at the unscaled for: boundaries in promtool; here Prometheus takes
real scrape times (timestamp()), evaluates its groups on its own schedule, and the series come over HTTP. Each
"node" is a loopback server on one of the session stack's exporter ports, serving at every scrape what an
exporter polled every 0.2 s on a node whose clock is off by OFFSET_S would: frexporter_poll_timestamp_seconds
and every other timestamp on that clock.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from frexporter import naming as n
from tests.harness import hold as hold_true
from tests.harness import require_module, wait_for
from tests.promstack import SCALE, PromStack
from tests.rulefile import load_rules, parse_duration

OFFSET_S = 120.0
POLL_S = 0.2
UNRESPONSIVE = "FrexporterRankUnresponsive"
# The alerts a healthy job on a node 120 s behind fired when the rules took ages against Prometheus' time().
SKEW_PAGED = (UNRESPONSIVE, "FrexporterCollectiveStalled", "FrexporterWatchdogBudget", "FrexporterCollectiveDesync")


def _unresponsive_timing() -> tuple[float, float]:
    """The scaled FrexporterRankUnresponsive heartbeat age and "for"."""
    rule = next(r for g in load_rules(SCALE)["groups"] for r in g["rules"] if r.get("alert") == UNRESPONSIVE)
    return 60 * SCALE, parse_duration(rule["for"])


@contextmanager
def _node(port: int, offset: float, body: Callable[[float], list[str]]) -> Iterator[None]:
    """A node whose clock is ``offset`` off, serving ``body(poll)`` (lines of the text exposition) for the poll
    before each scrape, after its own frexporter_poll_timestamp_seconds."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            poll = math.floor((time.time() + offset) / POLL_S) * POLL_S  # the node's clock at its last poll
            text = "\n".join([f"{n.POLL_TIMESTAMP_SECONDS} {poll!r}", *body(poll)]) + "\n"
            data = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _healthy_busy_job(job_id: str) -> Callable[[float], list[str]]:
    """Two ranks of one node, beating, in a process group whose collectives complete every poll: at each poll
    both are in the next one, begun 0.1 s before (FrexporterCollectiveStalled's "all joined"), under a 200 s
    watchdog timeout."""

    def body(poll: float) -> list[str]:
        seq = int(poll / POLL_S) % 1_000_000
        lines = [f'{n.PG_TIMEOUT_SECONDS}{{job_id="{job_id}",pg="0",pg_desc="default_pg"}} 200']
        for rank in (0, 1):
            r = f'job_id="{job_id}",rank="{rank}"'
            pg = f'{r},pg="0",pg_desc="default_pg"'
            lines += [f"{n.RANK_UP}{{{r}}} 1", f"{n.RANK_HEARTBEAT_TIMESTAMP_SECONDS}{{{r}}} {poll - 0.3!r}",
                      f'{n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS}{{{r},state="busy"}} {poll - 600!r}',
                      f"{n.PG_LAST_ENQUEUED_SEQ}{{{pg}}} {seq + 1}", f"{n.PG_LAST_COMPLETED_SEQ}{{{pg}}} {seq}",
                      f"{n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS}{{{pg}}} {poll - 0.1!r}"]
        return lines

    return body


def _wedged_rank(job_id: str, since: float) -> Callable[[float], list[str]]:
    """One rank whose process is up and whose heartbeat stopped at ``since`` (the node's clock)."""
    r = f'job_id="{job_id}",rank="0"'
    return lambda _poll: [f"{n.RANK_UP}{{{r}}} 1", f"{n.RANK_HEARTBEAT_TIMESTAMP_SECONDS}{{{r}}} {since!r}"]


def test_nodes_120s_off_neither_page_nor_delay_a_page(promstack: PromStack) -> None:
    behind, ahead = "skew-behind", "skew-ahead"
    age, hold = _unresponsive_timing()
    wedged_at = time.time()
    with _node(promstack.exporter_ports[0], -OFFSET_S, _healthy_busy_job(behind)), \
            _node(promstack.exporter_ports[1], OFFSET_S, _wedged_rank(ahead, wedged_at + OFFSET_S)):
        promstack.wait_target_up(wedged_at)
        promstack.wait_target_up(wedged_at, port=promstack.exporter_ports[1])
        # The wedge on the node ahead pages once its heartbeat is `age` old on that node's clock, after "for"
        # and a few scrape and evaluation intervals; against Prometheus' time() that took OFFSET_S longer.
        wait_for(lambda: [a for a in promstack.alerts(alertname=UNRESPONSIVE, job_id=ahead) if a["state"] == "firing"],
                 timeout=age + hold + 10 * promstack.interval, interval=POLL_S,
                 what=f"{UNRESPONSIVE} for the wedged rank on the node {OFFSET_S:g} s ahead")
        fired = time.time() - wedged_at
        assert fired >= age + hold, fired
        # Meanwhile, and for a while longer, the healthy job on the node behind has nothing even pending.
        def quiet_behind() -> None:
            assert [a for a in promstack.alerts(job_id=behind) if a["labels"]["alertname"] in SKEW_PAGED] == []

        hold_true(quiet_behind, 2 * hold, POLL_S)
        # The dashboards' ages, taken when a panel loads, are the true ones on the node behind: the oldest
        # heartbeat (0.3 s old at the poll, plus the scrape's), and the watchdog time left (the timeout, 200 s,
        # less the in-flight age, 0.1 s at the poll), not 120 s more or less.
        require_module("grafana_foundation_sdk", "grafana-foundation-sdk (the test extra)")  # dev tooling
        from grafana.generator.promql import age, budget_left

        of_behind = f'job_id="{behind}"'
        (beat,) = promstack.query(f"max({age(f'{n.RANK_HEARTBEAT_TIMESTAMP_SECONDS}{{{of_behind}}}')})")
        assert 0 <= float(beat["value"][1]) < 3 * promstack.interval, beat
        (left,) = promstack.query(f"min({budget_left(of_behind)})")
        assert 200 - 3 * promstack.interval < float(left["value"][1]) <= 200, left
