"""Parsers of outside data (spool files, FR dumps, worker-server answers) never raise anything unexpected.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_parsers.py."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frexporter import spool
from frexporter.fr import trace
from frexporter.sources import worker_client
from frexporter.sources.base import SourceError
from frexporter.spool import SpoolError
from tests import spoolgen
from tests.shared.parsers import GLOO_ENTRY, json_values, mutated


@settings(max_examples=300, deadline=None)
@given(st.one_of(json_values, mutated(spoolgen.snapshot(1, pgs=2))))
def test_snapshot_parser_only_raises_spool_errors(doc: object) -> None:
    try:
        s = spool.parse_snapshot(doc)
    except SpoolError:
        return
    for statuses in s.status.values():
        assert all(isinstance(k, int) for k in statuses)


def test_fr_dump_json_and_pickle_shapes_agree() -> None:
    as_json = {"version": "2.10", "pg_status": {"0": {"last_enqueued_collective": "2",
                                                       "last_started_collective": "-1",
                                                       "last_completed_collective": "1"}},
               "entries": [GLOO_ENTRY]}
    as_pickle = {"version": "2.10", "pg_status": {0: {"last_enqueued_collective": 2, "last_started_collective": -1,
                                                       "last_completed_collective": 1}},
                 "entries": [{**GLOO_ENTRY, "process_group": ("0", "default_pg"),
                              "time_discovered_started_ns": None}]}
    a, b = trace.parse_dump(as_json), trace.parse_dump(as_pickle)
    assert a.pg_status == b.pg_status and a.entries == b.entries
    assert a.entries[0].op == "all_reduce" and a.entries[0].done


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_worker_response_parser_only_raises_source_errors(data: bytes) -> None:
    with contextlib.suppress(SourceError):
        worker_client._parse_response(data, "sock", "h")


@settings(max_examples=200, deadline=None)
@given(st.integers(200, 599), st.binary(max_size=100), st.booleans())
def test_worker_response_round_trip(code: int, body: bytes, chunked: bool) -> None:
    if chunked:
        raw = (f"HTTP/1.1 {code} X\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
               + (f"{len(body):x}\r\n".encode() + body + b"\r\n" if body else b"") + b"0\r\n\r\n")
    else:
        raw = f"HTTP/1.1 {code} X\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    try:
        assert worker_client._parse_response(raw, "sock", "h") == body
        assert code == 200
    except SourceError as e:
        assert code != 200 and e.reason in ("handler_missing", "handler_failed")


def test_atomic_write_is_private(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    spool.write_json_atomic(str(path), {"a": 1})
    assert path.stat().st_mode & 0o777 == 0o600
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]
