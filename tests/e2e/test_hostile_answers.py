"""Text that is not valid UTF-8, and socket answers far larger than the rank's ring: one series or one read
lost at most, never the node's /metrics, never the exporter's memory.

A lone surrogate (how JSON and Python carry bytes that were not UTF-8) in any string a rank publishes used to
make every /metrics answer 500; a rank answering 60 MB of ``{}`` took the exporter to 12 GB.

Its unit tests are in tests/unit/test_hostile_answers.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from frexporter import naming as n
from frexporter import spool
from frexporter.app import ServeConfig, build_app
from frexporter.fr import trace
from tests import spoolgen
from tests.fakes.unix_server import UnixServer, fr_dump
from tests.harness import REPO, Job, free_port, metrics, require_tool, wait_for

SURROGATE = "\udc80"
READS = 10  # refused 60 MB answers; RSS grew with every one of them (1.0 -> 2.6 GB in 25 s at 8 MB)
LATIN1_JOB = "train-\udce9t\udce9"  # what Python makes of FREXPORTER_JOB_ID=b"train-\xe9t\xe9" in a UTF-8 locale


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:  # not listening yet
        return 0, b""


def _promtool_clean(text: bytes) -> None:
    promtool = require_tool("promtool", "Debian: apt-get install prometheus")
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60)
    # promtool's lint warns about nothing in our output; any line it prints is a problem.
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out


class Worker(UnixServer):
    """A worker server answering every deep read with ``body``."""

    def __init__(self, path: str, body: bytes, content_length: bool = True) -> None:
        self.body = body
        self.content_length = content_length
        super().__init__(path)

    def answer(self, conn: socket.socket, request: bytes) -> None:
        if b"/handler/ping" in request:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\npong")
            return
        head = b"HTTP/1.1 200 OK\r\n"
        if self.content_length:
            head += b"Content-Length: " + str(len(self.body)).encode() + b"\r\n"
        conn.sendall(head + b"\r\n")
        view = memoryview(self.body)
        for start in range(0, len(view), 1 << 20):
            conn.sendall(view[start:start + (1 << 20)])


def _rank_with_socket(directory: Path, worker_body: bytes, manifest_fields: dict[str, Any] | None = None,
                      snapshot_fields: dict[str, Any] | None = None, pending: bool = True,
                      content_length: bool = True) -> Worker:
    """Rank 0 of job ``job``, live (this test's pid), a collective in flight (so it is read at once), and a
    worker server that answers ``worker_body``."""
    stem = spool.rank_stem((manifest_fields or {}).get("job_id", "job"), 0)
    sock = spool.socket_name(stem)
    worker = Worker(str(directory / sock), worker_body, content_length)
    os.chmod(directory / sock, spool.SOCKET_MODE)
    m = spoolgen.manifest("job", 0, world=1, socket=sock, pid=os.getpid())
    m.update(manifest_fields or {})
    spool.write_json_atomic(str(directory / (stem + spool.MANIFEST_SUFFIX)), m)
    snap = spoolgen.snapshot(os.getpid(), seq=10)
    if pending:
        snap["status"]["fr"]["0"]["last_completed_collective"] = "9"
    snap.update(snapshot_fields or {})
    spoolgen.write_snapshot(directory, stem, snap)
    return worker


# ------------------------------------------------------------------ text that is not valid UTF-8


def _fr_answer_with_op(op: str) -> bytes:
    doc = json.loads(fr_dump(11))
    for entry in doc["entries"]:
        entry["profiling_name"] = op
    return json.dumps(doc).encode()  # ensure_ascii: the surrogate goes over the socket as \udc80


def _pg(**fields: Any) -> list[dict[str, Any]]:
    pg = spoolgen.manifest("job", 0, world=1)["process_groups"][0]
    return [{**pg, **fields}]


# field -> (manifest fields, snapshot fields, FR op name)
SURROGATE_FIELDS: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "job_id": ({"job_id": "job" + SURROGATE}, {}, "gloo:all_reduce"),
    "hostname": ({"hostname": "node" + SURROGATE}, {}, "gloo:all_reduce"),
    "pg_name": ({"process_groups": _pg(name="0" + SURROGATE)}, {}, "gloo:all_reduce"),
    "pg_desc": ({"process_groups": _pg(desc="default" + SURROGATE)}, {}, "gloo:all_reduce"),
    "backend": ({"process_groups": _pg(backend="cpu:gloo" + SURROGATE), "backends": ["cpu:gloo" + SURROGATE]},
                {}, "gloo:all_reduce"),
    "torch_version": ({"torch_version": "2.13.0" + SURROGATE}, {}, "gloo:all_reduce"),
    "gpu_uuid": ({"gpu_uuid": "GPU-" + SURROGATE}, {}, "gloo:all_reduce"),
    "error_kind": ({}, {"errors": {"status" + SURROGATE: 3}}, "gloo:all_reduce"),
    "fr_op": ({}, {}, "gloo:all_reduce" + SURROGATE),
}


@pytest.mark.parametrize("field", sorted(SURROGATE_FIELDS))
def test_a_lone_surrogate_costs_one_repaired_string_not_the_node(short_tmp: Path, field: str) -> None:
    manifest_fields, snapshot_fields, op = SURROGATE_FIELDS[field]
    spoolgen.write_rank(short_tmp, "other", 1)  # a healthy neighbour whose series must stay
    worker = _rank_with_socket(short_tmp, _fr_answer_with_op(op), manifest_fields, snapshot_fields)
    app = build_app(ServeConfig(str(short_tmp), port=0, poll_interval=0.2, sources=["ranks"], evidence_dir=""))
    try:
        app.start()
        app.exporter.poll_once()
        status, body = _get(app.port, "/metrics")
        assert status == 200, body[:500]
        _promtool_clean(body)
        parsed = metrics(body.decode())
        assert {s[0]["job_id"] for s in parsed[n.RANK_UP]} == {"other", manifest_fields.get("job_id", "job")
                                                               .replace(SURROGATE, "\ufffd")}
        errors = {s[0]["reason"]: s[1] for s in parsed[n.SOURCE_ERRORS_TOTAL]
                  if s[0]["source"] == n.SOURCE_RANKS}
        assert errors.get(spool.TEXT_REPAIRED, 0) >= 1, errors
        for path in ("/", "/api/v1/status"):
            status, page = _get(app.port, path)
            assert status == 200, (path, page[:300])
            page.decode("utf-8")  # valid UTF-8 throughout
        assert {r["job_id"] for r in json.loads(_get(app.port, "/api/v1/status")[1])["ranks"]} == {
            "other", manifest_fields.get("job_id", "job").replace(SURROGATE, "\ufffd")}
    finally:
        app.stop()
        worker.close()


def test_real_ranks_with_a_latin1_job_id(tmp_path: Path) -> None:
    """Two gloo ranks started with FREXPORTER_JOB_ID holding Latin-1 bytes: one job, served, promtool-clean;
    both ranks spell it the same (their stems and series agree)."""
    job = Job(tmp_path, "counts", world=2, job_id=LATIN1_JOB).start()
    try:
        job.wait_ready()
        expected = "train-\\xe9t\\xe9"
        app = build_app(ServeConfig(str(job.spool), port=0, poll_interval=0.2, sources=["ranks"], evidence_dir=""))
        try:
            app.start()

            def both_up() -> bytes | None:
                status, body = _get(app.port, "/metrics")
                assert status == 200, body[:500]
                ups = metrics(body.decode()).get(n.RANK_UP, [])
                return body if sorted(s[0]["rank"] for s in ups if s[1] == 1) == ["0", "1"] else None

            body = wait_for(both_up, timeout=30, what="both ranks up")
            # Both ranks wrote their files under one stem: the same job on every node.
            assert {p.name for p in job.spool.glob("*" + spool.MANIFEST_SUFFIX)} == {
                spool.rank_stem(expected, r) + spool.MANIFEST_SUFFIX for r in (0, 1)}
            _promtool_clean(body)
            assert {s[0]["job_id"] for s in metrics(body.decode())[n.RANK_UP]} == {expected}
            assert _get(app.port, "/")[0] == 200
        finally:
            app.stop()
    finally:
        job.stop()


# ------------------------------------------------------------------ answers past the ring's bounds


def test_bounds_follow_the_declared_ring() -> None:
    small, large = trace.answer_bounds(2000, 8), trace.answer_bounds(100_000, 131_072)
    assert small.max_bytes < 16 * 1024 * 1024 < large.max_bytes
    assert trace.answer_bounds(0, 8) == small  # a manifest that does not say: torch's default ring
    # A full 100,000-entry gloo ring (about 480 bytes and 8 objects and lists per entry) is read whole.
    entry = json.loads(fr_dump(11))["entries"][0]
    ring = json.dumps({"version": "2.10", "pg_status": {}, "entries": [entry] * trace.MAX_ENTRIES}).encode()
    assert len(trace.parse_answer(ring, large, "ring").entries) == trace.MAX_ENTRIES


def _vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.mark.parametrize("ring,content_length", [(2000, True), (2000, False), (100_000, True)],
                         ids=["default-ring", "no-length", "ring-claims-100000"])
def test_exporter_memory_stays_bounded_while_a_rank_answers_60_mb(short_tmp: Path, ring: int,
                                                                 content_length: bool) -> None:
    """`frexporter serve` against a rank that answers every deep read with 60 MB of empty objects: peak RSS
    under 200 MB (it reached 12 GB), the read refused and counted, /metrics still served."""
    body = b'{"version":"2.10","pg_config":{},"pg_status":{},"entries":[' + b"{}," * 20_000_000 + b"{}]}"
    worker = _rank_with_socket(short_tmp, body, {"fr_buffer_size": ring}, content_length=content_length)
    del body
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "frexporter", "serve", "--dir", str(short_tmp), "--listen",
                             f"127.0.0.1:{port}", "--poll-interval", "0.2", "--deep-interval", "0", "--no-nvml",
                             "--rank-timeout", "5", "--evidence-dir", ""],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: _get(port, "/healthz")[0] == 200 if proc.poll() is None else pytest.fail("exited"),
                 timeout=30, what="healthz")
        served = worker.served

        def refusals() -> dict[str, float] | None:
            status, text = _get(port, "/metrics")
            assert status == 200
            errors = {s[0]["reason"]: s[1] for s in metrics(text.decode())[n.SOURCE_ERRORS_TOTAL]
                      if s[0]["source"] == n.SOURCE_RANKS}
            done = errors.get("oversized", 0) + errors.get(spool.LIMIT_ITEMS, 0) >= READS
            return errors if done and worker.served >= served + READS else None

        errors = wait_for(refusals, timeout=120, what=f"{READS} refused deep reads")
        peak_mib = _vm_hwm_kib(proc.pid) / 1024
        print(f"peak RSS {peak_mib:.0f} MiB after {worker.served - served} answers of 60 MB; errors {errors}")
        assert peak_mib < 200, peak_mib
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        worker.close()
