"""`frexporter analyze --prometheus` against a hostile or broken server: every answer is bounded before it costs.

- time: one deadline per query for the whole exchange (a server that drips a byte at a time), one for all the
  queries of an analysis (a server that answers each just in time);
- memory: an answer's bytes and series (a flood of ``{}``), and what world sizes expand into over all PGs and
  jobs (thousands of PGs claiming 131,072 members), measured in a child process under a memory rlimit;
- labels: integer labels parsed strictly, server text escaped in messages and repaired where it is invalid.

The servers are real sockets on loopback; the memory checks run in a child so that its peak RSS is the analysis's.

Its unit tests are in tests/unit/test_analyze_prometheus_hostile.py.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, BinaryIO
from unittest import mock

import pytest

from frexporter import naming as n
from frexporter.analysis.kinds import RANK_ABSENT
from frexporter.postmortem import prometheus, report
from frexporter.postmortem.promview import Query
from tests.shared.analyze_prometheus_hostile import (
    DEADLINE_S,
    JSON_HEAD,
    MARGIN_S,
    NOW,
    Responder,
    analyze_fake,
    answer,
    dripping,
    rank_series,
    serving,
    vector,
    within,
)

MEMORY_GROWTH_LIMIT = 200 << 20  # peak RSS a hostile answer may add to the analysing process
# What expanded member lists may add: the analysis of the largest genuine world (131,072 ranks, all but two
# absent from the view) takes ~120 MiB by itself; the bound admits a few times its members.
MEMBERS_GROWTH_LIMIT = 256 << 20
# The child's address space: a regression becomes a MemoryError there, not an OOM kill of a shared machine.
CHILD_ADDRESS_SPACE = 2 << 30
CHILD_TIMEOUT_S = 60.0
# The frexporter under test, for the child (the same one this process imported).
PACKAGE_ROOT = str(Path(prometheus.__file__).resolve().parents[2])


_ACTIVE = Query.PG_ACTIVE.promql("{}").split("{")[0]
_ACTIVE_SIGNS = {n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS, n.RANK_COLLECTIVE_WAIT_SECONDS,
                 n.RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS}


def by_metric(samples: list[dict[str, Any]]) -> Responder:
    """Answers each query with the samples of its metric (the first it names: timestamp(), max_over_time() and
    the per-PG aggregations as the plain one), and Query.PG_ACTIVE with the (job_id, pg) of the PGs in flight."""
    active = [{"metric": {"job_id": job, "pg": pg}, "value": [NOW, "1"]} for job, pg in sorted(
        {(s["metric"]["job_id"], s["metric"]["pg"]) for s in samples if s["metric"]["__name__"] in _ACTIVE_SIGNS})]

    def respond(promql: str, out: BinaryIO, stop: threading.Event) -> None:
        if promql.startswith(_ACTIVE):
            answer(vector(active))(promql, out, stop)
            return
        name = re.search(r"frexporter_\w+", promql)
        answer(vector([s for s in samples if name and s["metric"]["__name__"] == name.group()]))(promql, out, stop)
    return respond


# ----------------------------------------------------------------------------------------------- time


DRIPS = {
    "status line": (b"", b"H"),
    "header": (b"HTTP/1.1 200 OK\r\n", b"X"),
    "body": (JSON_HEAD + b"Content-Length: 1000000\r\n\r\n" + b'{"status": ', b" "),
    "chunked body": (JSON_HEAD + b"Transfer-Encoding: chunked\r\n\r\n", b"1\r\n \r\n"),
}


@pytest.mark.parametrize("where", sorted(DRIPS))
def test_a_server_that_drips_fails_the_query_at_its_deadline(where: str) -> None:
    with serving(dripping(*DRIPS[where])) as url:
        error, elapsed = within(DEADLINE_S + MARGIN_S, lambda: prometheus.query(url, "up", timeout=DEADLINE_S))
    assert isinstance(error, prometheus.PrometheusError), error
    assert f"no complete answer within {DEADLINE_S:g} s" in str(error)
    assert elapsed >= DEADLINE_S * 0.9  # the deadline, not an early give-up, ended it


def test_analyze_gives_up_when_all_its_queries_take_longer_than_its_deadline() -> None:
    # Each answer is complete and valid, and comes 0.8 s late, within one query's deadline: 14 queries (no PG is
    # active: none per rank and PG), asked QUERIES_IN_FLIGHT (4) at a time, take 3.2 s.
    with serving(answer(vector([]), pause=0.8)) as url, \
            mock.patch.object(prometheus, "ANALYZE_TIMEOUT_SECONDS", DEADLINE_S):
        error, _ = within(DEADLINE_S + MARGIN_S, lambda: report.from_prometheus(url, "j"))
    assert isinstance(error, prometheus.PrometheusError), error
    assert f"the analysis's queries took more than {DEADLINE_S:g} s" in str(error)


def test_cli_says_what_is_wrong_with_the_url_instead_of_a_traceback() -> None:
    # Without a scheme, urllib raised ValueError: the command ended in a traceback.
    out = subprocess.run([sys.executable, "-m", "frexporter", "analyze", "--prometheus", "prometheus.example"],
                         capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                         env={**os.environ, "PYTHONPATH": PACKAGE_ROOT})
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip() == "frexporter analyze: prometheus.example: not an http:// or https:// URL"


# --------------------------------------------------------------------------------------------- memory

CHILD = """
import json, resource, sys, time
from frexporter.postmortem import prometheus, report

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

before, start = peak(), time.monotonic()
try:
    found = report.from_prometheus(sys.argv[1], None, stuck_after=30)
    outcome = {"ranks": len(found.ranks), "problems": found.problems,
               "member_lists": sorted(len(pg.ranks) for r in found.ranks for pg in r.pgs),
               "absent": [len(v.ranks) for v in found.verdicts if v.kind == "rank_absent"]}
except prometheus.PrometheusError as e:
    outcome = {"error": str(e)}
print(json.dumps({**outcome, "growth": peak() - before, "elapsed": time.monotonic() - start}))
"""


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_ADDRESS_SPACE, CHILD_ADDRESS_SPACE))


def analyze_in_child(url: str) -> dict[str, Any]:
    """report.from_prometheus(url) in a child under CHILD_ADDRESS_SPACE: its outcome, peak RSS growth, time."""
    out = subprocess.run([sys.executable, "-c", CHILD, url], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                         env={**os.environ, "PYTHONPATH": PACKAGE_ROOT}, preexec_fn=_limit_address_space)
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, Any] = json.loads(out.stdout)
    print(f"{url}: {result['growth'] / 2**20:.0f} MiB peak growth, {result['elapsed']:.2f} s")  # for -s
    return result


def test_a_flood_of_empty_objects_is_refused_while_reading_with_little_memory() -> None:
    # 60 MB of {}: 20 million dicts once parsed (1.6 GB, a minute), under the byte cap.
    flood = b'{"status":"success","data":{"resultType":"vector","result":[' + b"{}," * 20_000_000 + b"{}]}}"
    assert len(flood) < prometheus.MAX_RESPONSE_BYTES
    with serving(answer(flood)) as url:
        result = analyze_in_child(url)
    assert f"more than {prometheus.MAX_SERIES} series" in result.get("error", ""), result
    assert result["growth"] < MEMORY_GROWTH_LIMIT
    assert result["elapsed"] < 10


def test_the_largest_container_flood_the_bound_admits_parses_within_bounded_memory() -> None:
    # Just under the container bound: parsed (every {} is a dict), then refused by its count of results.
    count = 3 * prometheus.MAX_SERIES
    flood = b'{"status":"success","data":{"resultType":"vector","result":[' + b"{}," * (count - 1) + b"{}]}}"
    with serving(answer(flood)) as url:
        result = analyze_in_child(url)
    assert f"more than {prometheus.MAX_SERIES} series" in result.get("error", ""), result
    assert result["growth"] < MEMORY_GROWTH_LIMIT


WORLD = 1 << 17  # the largest world the analysis expands


def test_thousands_of_world_sized_pgs_are_not_expanded_past_the_bound_in_all() -> None:
    # One rank claims 3,000 PGs as large as its 131,072-rank world: 390 million members (~14 GB of ints).
    pgs = tuple(str(i) for i in range(3000))
    with serving(by_metric(rank_series("j", 0, WORLD, pgs))) as url:
        result = analyze_in_child(url)
    lists = result["member_lists"]
    expanded = prometheus.MAX_EXPANDED_MEMBERS // WORLD - 1  # the job's absent ranks take one world's worth
    assert lists.count(WORLD) == expanded and lists.count(1) == 3000 - expanded, result["problems"]
    assert result["problems"] == [
        f"{3000 - expanded} world-spanning process groups whose members are only the ranks that report them "
        f"(past {prometheus.MAX_EXPANDED_MEMBERS} members expanded in all), first: job j, PG {pgs[expanded]}"]
    assert result["absent"] == [WORLD - 1]
    assert result["growth"] < MEMBERS_GROWTH_LIMIT


def test_thousands_of_world_sized_jobs_are_not_expanded_past_the_bound_in_all() -> None:
    # 3,000 jobs of one rank each claim a 131,072-rank world: the absent ranks of all would be 390 million.
    jobs = [f"job{i:04d}" for i in range(3000)]
    samples = [s for job in jobs for s in rank_series(job, 0, WORLD, pgs=())]
    with serving(by_metric(samples)) as url:
        result = analyze_in_child(url)
    expanded = prometheus.MAX_EXPANDED_MEMBERS // WORLD
    assert result["absent"] == [WORLD - 1] * expanded
    assert result["problems"] == [
        f"{3000 - expanded} jobs whose absent ranks are not listed (past {prometheus.MAX_EXPANDED_MEMBERS} "
        f"members expanded in all), first: job {jobs[expanded]}"]
    assert result["growth"] < MEMBERS_GROWTH_LIMIT


def test_a_genuine_100000_rank_world_is_still_expanded() -> None:
    # Ranks 0 and 1 report and wait in collective 8 of WORLD; the other 99,998 report nothing.
    found = analyze_fake([*rank_series("j", 0, 100_000), *rank_series("j", 1, 100_000)])
    assert [pg.ranks == tuple(range(100_000)) for r in found.ranks for pg in r.pgs] == [True, True]
    absent = [v for v in found.verdicts if v.kind == RANK_ABSENT]
    assert [(v.ranks == tuple(range(2, 100_000)), v.waiting_ranks) for v in absent] == [(True, (0, 1))]
    assert found.problems == []
