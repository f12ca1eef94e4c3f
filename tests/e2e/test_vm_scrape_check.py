"""The rules' scrape-time check of in-flight starts holds on VictoriaMetrics as on Prometheus.

A ruler's storage that restarts (or a scraper that does: Prometheus, vmagent) marks nothing stale that vanished
while it was down, so a wait scraped before the outage stays visible for the 5-minute lookback after it. The
wait ages record keeps only the waits that their node's last scrape carried, by comparing ``timestamp()`` of the
wait's start with ``timestamp()`` of the node's poll time: that holds only where ``timestamp()`` gives the raw
sample's time, not the evaluation's. promtool checks it on Prometheus (the case of
tests/rules/collectives_test.yml named below, whose in-flight start the test fixture turns into the exporter's
wait); here the same case's input goes into a real victoria-metrics, its in-flight start imported as that wait,
and the record's own expression (the shipped file's, not a copy) is asked as of the case's evaluation times.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import REPO, require_tool, wait_for
from tests.promstack import instant_query
from tests.rulefile import find_rule
from tests.vmstack import INSTALL_HINT, import_samples, running_victoria_metrics

CASE_FILE = REPO / "tests" / "rules" / "collectives_test.yml"
CASE = "an in-flight start that the node's last scrape did not carry is no wait"
AGES = "job_id_pg_rank:frexporter_pg_wait_start_timestamp_seconds:age"
START = "frexporter_pg_wait_start_timestamp_seconds"
# The case gives the in-flight start; the exporter reports it as the wait's start (the record's threshold plays
# no part in the scrape-time check, which is all this test asks).
INFLIGHT = "frexporter_pg_oldest_inflight_start_timestamp_seconds"
STALE_RANK = "2"  # the case's rank whose start its node's later scrapes no longer carry
# The case's input is written this long before now: every evaluation time of the case is in the past (the storage
# answers for it at once), and well within victoria-metrics' retention.
BACK_S = 600
SEEN_TIMEOUT_S = 30.0  # imported samples become searchable within seconds

_TERM = re.compile(r"^(?P<start>-?[\d.]+)(?:(?P<sign>[+-])(?P<step>[\d.]+))?(?:x(?P<times>\d+))?$")
_BLANKS = re.compile(r"^_(?:x(?P<times>\d+))?$")


def expand(values: str) -> list[float | None]:
    """promtool's expanding notation (``a``, ``axn``, ``a+bxn``, ``a-bxn``, ``_``, ``_xn``), one value per
    interval, None where there is no sample. Staleness markers (``stale``) cannot be imported: refused."""
    out: list[float | None] = []
    for term in values.split():
        blanks = _BLANKS.match(term)
        if blanks:
            out.extend([None] * (int(blanks["times"] or 0) + 1))
            continue
        match = _TERM.match(term)
        if not match:
            raise ValueError(f"unsupported series value {term!r} in {values!r}")
        step = float(match["step"] or 0) * (-1 if match["sign"] == "-" else 1)
        times = int(match["times"]) if match["times"] else 0
        out.extend(float(match["start"]) + step * i for i in range(times + 1))
    return out


def test_expand_reads_promtool_notation() -> None:
    assert expand("0+15x2 7 _x1 5-1x2 _") == [0, 15, 30, 7, None, None, 5, 4, 3, None]
    with pytest.raises(ValueError):
        expand("1 stale")


def _case() -> dict[str, Any]:
    doc = yaml.safe_load(CASE_FILE.read_text(encoding="utf-8"))
    return next(t for t in doc["tests"] if t["name"] == CASE)


def _seconds(duration: str) -> int:
    assert duration.endswith("s"), duration
    return int(duration[:-1])


@pytest.fixture(scope="module")
def victoria(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, int]]:
    """victoria-metrics holding the case's input: (its URL, the case's time 0 as unix seconds, its interval)."""
    require_tool("victoria-metrics", INSTALL_HINT)
    case = _case()
    interval = _seconds(case["interval"])
    base = int(time.time()) - BACK_S
    lines = []
    for series in case["input_series"]:
        name = series["series"]
        if name.startswith(INFLIGHT + "{"):
            name = START + name[len(INFLIGHT):]
        for i, value in enumerate(expand(series["values"])):
            if value is not None:
                lines.append(f"{name} {value:g} {(base + i * interval) * 1000}")
    workdir: Path = tmp_path_factory.mktemp("victoria-metrics")
    with running_victoria_metrics(workdir) as url:
        import_samples(url, lines)
        nodes = len({s["series"] for s in case["input_series"] if s["series"].startswith("frexporter_poll_")})
        wait_for(lambda: len(instant_query(url, "frexporter_poll_timestamp_seconds", time=str(base + interval),
                                           nocache="1")) == nodes,
                 timeout=SEEN_TIMEOUT_S, interval=0.2, what="the case's input searchable in victoria-metrics")
        yield url, base, interval


def _ages(url: str, at: int) -> dict[str, float]:
    """The ages record's expression as of ``at``: rank -> age."""
    expr = find_rule(AGES)["expr"]
    return {r["metric"]["rank"]: float(r["value"][1]) for r in instant_query(url, expr, time=str(at), nocache="1")}


def test_a_start_the_last_scrape_carried_is_a_wait(victoria: tuple[str, int, int]) -> None:
    url, base, interval = victoria
    # At the case's second scrape the start (5 on the node's clock, poll 15) is in that scrape: it waits.
    assert _ages(url, base + interval) == {STALE_RANK: pytest.approx(10.0)}


def test_a_start_the_last_scrape_did_not_carry_is_no_wait(victoria: tuple[str, int, int]) -> None:
    url, base, _ = victoria
    for check in _case()["alert_rule_test"]:
        at = base + _seconds(check["eval_time"])
        # The raw start is still there, within the 5-minute lookback, as on a Prometheus back from an outage...
        still = instant_query(url, START, time=str(at), nocache="1")
        assert [r["metric"]["rank"] for r in still] == [STALE_RANK], check
        # ...and the scrape-time check keeps it out of the waits.
        assert _ages(url, at) == {}, check
