"""What both halves of test_analyze_prometheus_hostile.py use: a loopback Prometheus HTTP API whose answers
a test scripts (complete, slow, or dripping a byte at a time), rank series as Prometheus would answer them,
and a deadline check."""

from __future__ import annotations

import contextlib
import json
import socketserver
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO
from unittest import mock

from frexporter import naming as n
from frexporter.postmortem import prometheus, report
from frexporter.postmortem.promview import Query

NOW = 1_700_000_000.0
DRIP_S = 0.5  # the hostile server's pace: one byte, then this long
DEADLINE_S = 2.0  # the deadline the tests give a query, or all of an analysis's queries
MARGIN_S = 1.5  # past the deadline: thread start, connect, two shared cores

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
            length = 0
            while (header := self.rfile.readline(65537)) not in (b"\r\n", b"\n", b""):
                name, _, value = header.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            target = request_line.split(" ")[1] if request_line.count(" ") >= 2 else "/"
            # A long query comes in a POST body (promclient.MAX_GET_QUERY_CHARS), a short one in the URL.
            form = self.rfile.read(length).decode("latin-1") if length else urllib.parse.urlsplit(target).query
            promql = urllib.parse.parse_qs(form).get("query", [""])[0]
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


JSON_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
