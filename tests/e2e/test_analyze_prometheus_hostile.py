"""`frexporter analyze --prometheus` against a hostile or broken server: every answer is bounded before it costs.

- time: one deadline per query for the whole exchange (a server that drips a byte at a time), one for all the
  queries of an analysis (a server that answers each just in time);
- memory: an answer's bytes and series (a flood of ``{}``), and what world sizes expand into over all PGs and
  jobs (thousands of PGs claiming 131,072 members), measured in a child process under a memory rlimit;
- labels: integer labels parsed strictly, server text escaped in messages and repaired where it is invalid.

The servers are real sockets on loopback; the memory checks run in a child so that its peak RSS is the analysis's.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socketserver
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO
from unittest import mock

import pytest

from frexporter import naming as n
from frexporter import safetext
from frexporter.analysis.verdicts import RANK_ABSENT
from frexporter.postmortem import promclient, prometheus, report
from frexporter.postmortem.promview import Query

NOW = 1_700_000_000.0
DRIP_S = 0.5  # the hostile server's pace: one byte, then this long
DEADLINE_S = 2.0  # the deadline the tests give a query, or all of an analysis's queries
MARGIN_S = 1.5  # past the deadline: thread start, connect, two shared cores
MEMORY_GROWTH_LIMIT = 200 << 20  # peak RSS a hostile answer may add to the analysing process
# What expanded member lists may add: the analysis of the largest genuine world (131,072 ranks, all but two
# absent from the view) takes ~120 MiB by itself; the bound admits a few times its members.
MEMBERS_GROWTH_LIMIT = 256 << 20
# The child's address space: a regression becomes a MemoryError there, not an OOM kill of a shared machine.
CHILD_ADDRESS_SPACE = 2 << 30
CHILD_TIMEOUT_S = 60.0
# The frexporter under test, for the child (the same one this process imported).
PACKAGE_ROOT = str(Path(prometheus.__file__).resolve().parents[2])

Responder = Callable[[str, BinaryIO, threading.Event], None]


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up on a dripping answer is what the deadline is for


@contextlib.contextmanager
def serving(respond: Responder) -> Iterator[str]:
    """A loopback HTTP server whose answer to each request is ``respond(promql, out, stop)``; its URL."""
    stop = threading.Event()

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            request_line = self.rfile.readline(65537).decode("latin-1")
            while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                pass
            target = request_line.split(" ")[1] if request_line.count(" ") >= 2 else "/"
            promql = urllib.parse.parse_qs(urllib.parse.urlsplit(target).query).get("query", [""])[0]
            respond(promql, self.wfile, stop)

    server = _Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        stop.set()  # ends the dripping handlers; closing their sockets ends a client still reading them
        server.shutdown()
        server.server_close()
        thread.join()


def dripping(head: bytes, drop: bytes) -> Responder:
    """Sends ``head``, then ``drop`` every DRIP_S until the server stops: never a complete answer."""
    def respond(_promql: str, out: BinaryIO, stop: threading.Event) -> None:
        out.write(head)
        while not stop.wait(DRIP_S):
            out.write(drop)
    return respond


def answer(body: bytes, status: str = "200 OK", pause: float = 0.0) -> Responder:
    def respond(_promql: str, out: BinaryIO, stop: threading.Event) -> None:
        if pause and stop.wait(pause):
            return
        out.write(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                  "Connection: close\r\n\r\n".encode() + body)
    return respond


def vector(samples: list[dict[str, Any]]) -> bytes:
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": samples}}).encode()


def _metric_name(promql: str) -> str:
    return promql.removeprefix("timestamp(").removeprefix("max_over_time(").split("{")[0]


def by_metric(samples: list[dict[str, Any]]) -> Responder:
    """Answers each query with the samples of its metric (timestamp() and max_over_time() as the plain one)."""
    def respond(promql: str, out: BinaryIO, stop: threading.Event) -> None:
        name = _metric_name(promql)
        answer(vector([s for s in samples if s["metric"]["__name__"] == name]))(promql, out, stop)
    return respond


def within(limit: float, call: Callable[[], object]) -> tuple[object, float]:
    """``call()``'s result or exception, and the seconds it took; fails when it takes longer than ``limit``
    (the call goes on in a daemon thread, which the server's stop then ends)."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as e:
            outcome.append(e)

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    elapsed = time.monotonic() - start
    assert not thread.is_alive(), f"still waiting after {elapsed:.1f} s (limit {limit} s)"
    return outcome[0], elapsed


def sample(metric: str, value: float, **labels: str) -> dict[str, Any]:
    return {"metric": {"__name__": metric, "job": "frexporter", "instance": "node0:9400", **labels},
            "value": [NOW, repr(value)]}


def rank_series(job: str, rank: int, world: int, pgs: tuple[str, ...] = ("0",), size: int | None = None,
                enq: int = 8, done: int = 7) -> list[dict[str, Any]]:
    """One rank of ``job`` waiting in collective ``enq`` of each of ``pgs`` (PG size ``size``, the world's
    when None)."""
    out = [sample(n.RANK_UP, 1, job_id=job, rank=str(rank)),
           sample(n.RANK_HEARTBEAT_TIMESTAMP_SECONDS, NOW - 1, job_id=job, rank=str(rank)),
           sample(n.RANK_INFO, 1, job_id=job, rank=str(rank), local_rank="0", world_size=str(world),
                  hostname="node0", pid="42")]
    for pg in pgs:
        pg_labels = {"job_id": job, "pg": pg, "pg_desc": "default_pg"}
        out += [sample(n.PG_INFO, 1, **pg_labels, size=str(world if size is None else size), backend="nccl"),
                sample(n.PG_LAST_ENQUEUED_SEQ, enq, **pg_labels, rank=str(rank)),
                sample(n.PG_LAST_COMPLETED_SEQ, done, **pg_labels, rank=str(rank)),
                sample(n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS, NOW - 100, **pg_labels, rank=str(rank))]
    return out


def answers(samples: list[dict[str, Any]]) -> dict[Query, list[dict[str, Any]]]:
    """What prometheus.fetch returns for these samples: each query's, those of its metric (timestamp() and
    max_over_time() as the plain one)."""
    return {q: [s for s in samples if s["metric"]["__name__"] == q.metric] for q in Query}


def analyze_fake(samples: list[dict[str, Any]]) -> report.Report:
    with mock.patch.object(prometheus, "fetch", lambda *_a, **_k: answers(samples)), \
            mock.patch("time.time", return_value=NOW):
        return report.from_prometheus("http://prometheus", None, stuck_after=30)


# ----------------------------------------------------------------------------------------------- time

JSON_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
DRIPS = {
    "status line": (b"", b"H"),
    "header": (b"HTTP/1.1 200 OK\r\n", b"X"),
    "body": (JSON_HEAD + b"Content-Length: 1000000\r\n\r\n" + b'{"status": ', b" "),
    "chunked body": (JSON_HEAD + b"Transfer-Encoding: chunked\r\n\r\n", b"1\r\n \r\n"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("where", sorted(DRIPS))
def test_a_server_that_drips_fails_the_query_at_its_deadline(where: str) -> None:
    with serving(dripping(*DRIPS[where])) as url:
        error, elapsed = within(DEADLINE_S + MARGIN_S, lambda: prometheus.query(url, "up", timeout=DEADLINE_S))
    assert isinstance(error, prometheus.PrometheusError), error
    assert f"no complete answer within {DEADLINE_S:g} s" in str(error)
    assert elapsed >= DEADLINE_S * 0.9  # the deadline, not an early give-up, ended it


@pytest.mark.e2e
def test_analyze_gives_up_when_all_its_queries_take_longer_than_its_deadline() -> None:
    # Each answer is complete and valid, and comes 0.4 s late: 17 queries would take 7 s.
    with serving(answer(vector([]), pause=0.4)) as url, \
            mock.patch.object(prometheus, "ANALYZE_TIMEOUT_SECONDS", DEADLINE_S):
        error, _ = within(DEADLINE_S + MARGIN_S, lambda: report.from_prometheus(url, "j"))
    assert isinstance(error, prometheus.PrometheusError), error
    assert f"the analysis's queries took more than {DEADLINE_S:g} s" in str(error)


def test_a_declared_length_past_the_cap_is_refused_before_the_body() -> None:
    head = JSON_HEAD + f"Content-Length: {prometheus.MAX_RESPONSE_BYTES + 1}\r\n\r\n".encode()
    with serving(dripping(head, b" ")) as url:
        error, elapsed = within(DEADLINE_S + MARGIN_S, lambda: prometheus.query(url, "up", timeout=DEADLINE_S))
    assert isinstance(error, prometheus.PrometheusError), error
    assert f"response larger than {prometheus.MAX_RESPONSE_BYTES} bytes" in str(error)
    assert elapsed < DEADLINE_S / 2


def test_a_broken_status_line_or_url_is_a_prometheus_error() -> None:
    with serving(lambda _q, out, _stop: out.write(b"HELLO\r\n\r\n")) as url, \
            pytest.raises(prometheus.PrometheusError):
        prometheus.query(url, "up", timeout=DEADLINE_S)
    for bad in ("prometheus.example", "localhost:9090", "file:///etc/passwd", "ftp://prometheus/"):
        with pytest.raises(prometheus.PrometheusError, match="not an http:// or https:// URL"):
            prometheus.query(bad, "up")


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_a_flood_of_empty_objects_is_refused_while_reading_with_little_memory() -> None:
    # 60 MB of {}: 20 million dicts once parsed (1.6 GB, a minute), under the byte cap.
    flood = b'{"status":"success","data":{"resultType":"vector","result":[' + b"{}," * 20_000_000 + b"{}]}}"
    assert len(flood) < prometheus.MAX_RESPONSE_BYTES
    with serving(answer(flood)) as url:
        result = analyze_in_child(url)
    assert f"more than {prometheus.MAX_SERIES} series" in result.get("error", ""), result
    assert result["growth"] < MEMORY_GROWTH_LIMIT
    assert result["elapsed"] < 10


@pytest.mark.e2e
def test_the_largest_container_flood_the_bound_admits_parses_within_bounded_memory() -> None:
    # Just under the container bound: parsed (every {} is a dict), then refused by its count of results.
    count = 3 * prometheus.MAX_SERIES
    flood = b'{"status":"success","data":{"resultType":"vector","result":[' + b"{}," * (count - 1) + b"{}]}}"
    with serving(answer(flood)) as url:
        result = analyze_in_child(url)
    assert f"more than {prometheus.MAX_SERIES} series" in result.get("error", ""), result
    assert result["growth"] < MEMORY_GROWTH_LIMIT


WORLD = 1 << 17  # the largest world the analysis expands


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_a_genuine_100000_rank_world_is_still_expanded() -> None:
    # Ranks 0 and 1 report and wait in collective 8 of WORLD; the other 99,998 report nothing.
    found = analyze_fake([*rank_series("j", 0, 100_000), *rank_series("j", 1, 100_000)])
    assert [pg.ranks == tuple(range(100_000)) for r in found.ranks for pg in r.pgs] == [True, True]
    absent = [v for v in found.verdicts if v.kind == RANK_ABSENT]
    assert [(v.ranks == tuple(range(2, 100_000)), v.waiting_ranks) for v in absent] == [(True, (0, 1))]
    assert found.problems == []


def test_an_answer_with_more_series_than_the_bound_is_refused() -> None:
    samples = [sample(n.RANK_UP, 1, job_id="j", rank=str(r)) for r in range(11)]
    with mock.patch.object(promclient, "MAX_SERIES", 10):
        assert len(prometheus.parse_query_response(vector(samples[:10]))) == 10
        with pytest.raises(prometheus.PrometheusError, match="more than 10 series"):
            prometheus.parse_query_response(vector(samples))


# --------------------------------------------------------------------------------------------- labels

# What int() takes and no exporter writes: each would merge its series into another rank's (or make one up).
BAD_INTS = ["٣", " 1", "1 ", "1\n", "1_0", "+2", "-1", "01", "1.0", "0x1", "", "2147483648", "12345678901234567890"]


@pytest.mark.parametrize("bad", BAD_INTS, ids=ascii)
def test_a_rank_label_that_is_not_a_decimal_rank_is_a_counted_skipped_series(bad: str) -> None:
    hostile = [s for s in rank_series("j", 0, 4) if "rank" in s["metric"]]
    for s in hostile:
        s["metric"]["rank"] = bad
    found = analyze_fake([*rank_series("j", 3, 4), *hostile])
    assert [r.rank for r in found.ranks] == [3]
    # Each answer that holds one counts it: the heartbeat's twice (its value and its timestamp()).
    assert found.skipped_entries == len(hostile) + 1
    assert found.problems == [f"{len(hostile) + 1} series with a rank label that is not a whole number up to "
                              f'{2**31 - 1}, first: rank="{safetext.printable(bad)}" of {n.RANK_UP}']


def test_ranks_at_the_bounds_are_accepted() -> None:
    found = analyze_fake([*rank_series("j", 0, 4), *rank_series("j", 2**31 - 1, 4)])
    assert [r.rank for r in found.ranks] == [0, 2**31 - 1]
    assert found.problems == []


@pytest.mark.parametrize("label", ["local_rank", "world_size", "pid", "size"])
def test_other_integer_labels_are_parsed_as_strictly(label: str) -> None:
    series = rank_series("j", 0, 4)
    hostile = next(s for s in series if label in s["metric"])
    hostile["metric"][label] = "٣"
    found = analyze_fake(series)
    assert found.skipped_entries == 1
    assert found.problems == [f'1 series with a {label} label that is not a whole number up to {2**31 - 1}, '
                              f'first: {label}="٣" of {hostile["metric"]["__name__"]}']


@pytest.mark.parametrize("value", ["7.5", "1e300", "-2"])
def test_a_seq_that_is_not_a_whole_number_is_a_counted_skipped_series(value: str) -> None:
    series = rank_series("j", 0, 4)
    enqueued = next(s for s in series if s["metric"]["__name__"] == n.PG_LAST_ENQUEUED_SEQ)
    enqueued["value"] = [NOW, value]
    found = analyze_fake(series)
    assert [r.pgs for r in found.ranks] == [()]  # without its enqueued seq the PG says nothing
    assert found.problems == [f"1 series whose value is not a whole number from -1 to {2**53}, "
                              f"first: {value} of {n.PG_LAST_ENQUEUED_SEQ}"]


def test_server_text_in_messages_cannot_break_the_terminal() -> None:
    forged = "bad\x1b]0;owned\x07\nfrexporter analyze: all good\u202e"
    body = json.dumps({"status": "error", "error": forged}).encode()
    with serving(answer(body)) as url, pytest.raises(prometheus.PrometheusError) as error:
        prometheus.query(url, "up", timeout=DEADLINE_S)
    assert safetext.printable(forged) in str(error.value)
    series = rank_series("j", 0, 4)
    for s in series:
        if "rank" in s["metric"]:
            s["metric"]["rank"] = forged
    problems = analyze_fake(series).problems
    assert len(problems) == 1 and safetext.printable(forged) in problems[0]
    assert [m for m in (str(error.value), problems[0]) if safetext.printable(m) != m] == []


def test_lone_surrogates_in_labels_are_repaired_where_parsed() -> None:
    # One spelled as a JSON escape, one as the UTF-8 bytes of a surrogate (which json.loads would pass on).
    escaped = vector([sample(n.RANK_UP, 1, job_id="j\udc80", rank="0")])
    raw = vector([sample(n.RANK_UP, 1, job_id="jX", rank="0")]).replace(b"jX", b"j\xed\xb2\x80")
    for body in (escaped, raw):
        samples = prometheus.parse_query_response(body)
        assert [s["metric"]["job_id"] for s in samples] == ["j\ufffd"], body
