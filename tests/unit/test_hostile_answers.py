"""Text that is not valid UTF-8, and socket answers far larger than the rank's ring: one series or one read
lost at most, never the node's /metrics, never the exporter's memory.

A lone surrogate (how JSON and Python carry bytes that were not UTF-8) in any string a rank publishes used to
make every /metrics answer 500; a rank answering 60 MB of ``{}`` took the exporter to 12 GB.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_hostile_answers.py.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from frexporter import spool
from frexporter.fr import trace
from frexporter.sources.base import SourceError
from tests.fakes.unix_server import UnixServer


def test_an_answer_past_its_bounds_is_refused_before_it_is_parsed() -> None:
    bounds = trace.answer_bounds(2000, 8)
    empties = b'{"version":"2.10","pg_config":{},"pg_status":{},"entries":[' + b"{}," * 1_000_000 + b"{}]}"
    assert len(empties) < bounds.max_bytes  # within the byte bound: the container count refuses it
    tracemalloc.start()
    try:
        with pytest.raises(spool.SpoolError) as refused:
            trace.parse_answer(empties, bounds, "answer")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused.value.reason == spool.LIMIT_ITEMS
    assert peak < 1024 * 1024, peak  # json.loads would have built a million dicts (over 60 MB)
    nested = b"[" * 200_000 + b"]" * 200_000
    with pytest.raises(spool.SpoolError) as deep:
        trace.parse_answer(nested, trace.answer_bounds(100_000, 8), "nested")
    assert deep.value.reason == "bad_response"


def test_a_refused_parse_leaves_no_garbage() -> None:
    """An answer parsed and then refused (its entries are not a list) is freed at once, not when the cyclic
    garbage collector gets round to the traceback that holds it (nor is the answer's own buffer)."""
    bounds = trace.answer_bounds(100_000, 8)
    body = json.dumps({"version": "2.10", "entries": {str(i): ["x" * 8] * 4 for i in range(100_000)}}).encode()
    gc.collect()
    gc.disable()
    try:
        tracemalloc.start()
        before, _ = tracemalloc.get_traced_memory()
        with pytest.raises(spool.SpoolError):
            trace.parse_answer(bytearray(body), bounds, "answer")  # as the socket client hands it over
        after, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    finally:
        gc.enable()
    assert peak - before > 10 * 1024 * 1024  # it was parsed
    assert after - before < 1024 * 1024, after - before  # and is gone without gc.collect()


def test_an_announced_oversized_answer_is_not_read(short_tmp: Path) -> None:
    from frexporter.sources import worker_client

    received = threading.Event()

    class Announcer(UnixServer):
        def answer(self, conn: socket.socket, request: bytes) -> None:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 60000000\r\n\r\n")
            received.set()
            conn.sendall(b" " * (1 << 20))  # and then it would go on

    server = Announcer(str(short_tmp / "s.sock"))
    os.chmod(short_tmp / "s.sock", spool.SOCKET_MODE)
    try:
        started = time.monotonic()
        with pytest.raises(SourceError) as refused:
            worker_client.post(str(short_tmp / "s.sock"), "fr_trace_json", 5.0, max_bytes=1 << 20)
        assert refused.value.reason == "oversized"
        assert "not read" in str(refused.value)
        assert time.monotonic() - started < 5.0
    finally:
        server.close()
