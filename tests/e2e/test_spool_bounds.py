"""The spool is untrusted input: bounds on what a file parses into, and on what the exporter serves.

A spool file's byte limit caps bytes, not parsed size: 4 MiB of compact JSON is 470,000 ranks in one member
list. Past a parser bound the whole file is refused with a counted reason (``spool.LIMIT_REASONS``) and the
other ranks are served as before; /api/v1/status and / list up to their own bounds, flagged where cut.

Its unit tests are in tests/unit/test_spool_bounds.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks import fuzz
from frexporter import naming as n
from frexporter import spool
from frexporter.fr import trace
from frexporter.model import RANK_OK
from frexporter.outputs import api
from frexporter.spool import SpoolError
from tests import spoolgen
from tests.harness import REPO, free_port, metrics, sample, wait_for
from tests.shared.spool_bounds import write_manifest

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
HOSTILE_MANIFESTS = 20
HOSTILE_MEMBERS = 470_000  # what fits in one manifest under the 4 MiB byte limit
RSS_LIMIT_KIB = 150 * 1024  # the exporter's peak resident memory through either attack
STATUS_LIMIT_BYTES = 256 * 1024
STATUS_SECONDS = 5.0  # generous: the unbounded status took 9.9 s on this attack


# ---------------------------------------------------------------- a real `frexporter serve`


def _http(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read()


@contextlib.contextmanager
def serve(directory: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "frexporter", "serve", "--dir", str(directory), "--listen",
                             f"127.0.0.1:{port}", "--poll-interval", "0.2", "--no-nvml"], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"serve exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")  # type: ignore
        with contextlib.suppress(OSError):
            return _http(base + "/healthz") == b"ok\n"
        return False

    try:
        wait_for(healthy, timeout=30, what="healthz")
        yield base, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def peak_rss_kib(pid: int) -> int:
    """VmHWM: the process's peak resident set so far."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/PID/status")


def timed_status(base: str) -> tuple[bytes, float]:
    started = time.monotonic()
    body = _http(base + "/api/v1/status")
    return body, time.monotonic() - started


def test_hostile_member_lists_are_refused_and_the_exporter_stays_small(tmp_path: Path) -> None:
    spoolgen.write_rank(tmp_path, "job", 0)
    for i in range(HOSTILE_MANIFESTS):
        doc = spoolgen.manifest("evil", i, pid=200000 + i)
        doc["process_groups"][0]["ranks"] = list(range(HOSTILE_MEMBERS))
        write_manifest(tmp_path, doc)
        spool.write_json_atomic(str(tmp_path / (spool.rank_stem("evil", i) + spool.SNAPSHOT_SUFFIX)),
                                spoolgen.snapshot(200000 + i))
    counter = iter(range(2, 1 << 30))
    with serve(tmp_path) as (base, proc):
        def refused() -> dict[str, Any] | None:
            spoolgen.refresh(tmp_path, "job", 0, next(counter))  # the honest rank's heartbeat
            parsed = metrics(_http(base + "/metrics").decode())
            count = sample(parsed, n.SOURCE_ERRORS_TOTAL, source=n.SOURCE_RANKS, reason=spool.LIMIT_MEMBERS)
            status = json.loads(_http(base + "/api/v1/status"))
            served = [(r["job_id"], r["rank"], r["status"]) for r in status["ranks"]] == [("job", 0, RANK_OK)]
            return status if count == HOSTILE_MANIFESTS and served else None

        status = wait_for(refused, timeout=60, what=f"{HOSTILE_MANIFESTS} manifests refused with "
                                                    f"{spool.LIMIT_MEMBERS}, the honest rank served")
        assert status["sources"][0]["errors_total"] == {spool.LIMIT_MEMBERS: HOSTILE_MANIFESTS}
        body, seconds = timed_status(base)
        assert len(body) < STATUS_LIMIT_BYTES and seconds < STATUS_SECONDS, (len(body), seconds)
        assert peak_rss_kib(proc.pid) < RSS_LIMIT_KIB


def test_member_lists_at_the_bound_are_served_small(tmp_path: Path) -> None:
    """The worst the bound admits: every rank lists its own 131,072-member group, with work in flight."""
    when = time.time()
    for r in range(HOSTILE_MANIFESTS):
        doc = spoolgen.manifest("job", r)
        first = 1000 + r * spool.MAX_PG_MEMBERS  # distinct lists: nothing to share between ranks
        doc["process_groups"][0]["ranks"] = [r, *range(first, first + spool.MAX_PG_MEMBERS - 1)]
        write_manifest(tmp_path, doc)
        snap = spoolgen.snapshot(doc["pid"], seq=10, when=when)
        snap["status"]["fr"]["0"]["last_completed_collective"] = "9"
        spool.write_json_atomic(str(tmp_path / (spool.rank_stem("job", r) + spool.SNAPSHOT_SUFFIX)), snap)
    with serve(tmp_path) as (base, proc):
        def listed() -> dict[str, Any] | None:
            status = json.loads(_http(base + "/api/v1/status"))
            return status if len(status["ranks"]) == HOSTILE_MANIFESTS else None

        status = wait_for(listed, timeout=60, what="every rank at the bound listed")
        assert status["sources"][0]["errors_total"] == {}
        pgs = [pg for r in status["ranks"] for pg in r["process_groups"]]
        assert [(pg["size"], len(pg["ranks"]), pg["ranks_truncated"]) for pg in pgs] == [
            (spool.MAX_PG_MEMBERS, api.MAX_LISTED_MEMBERS, True)] * HOSTILE_MANIFESTS
        body, seconds = timed_status(base)
        assert len(body) < STATUS_LIMIT_BYTES and seconds < STATUS_SECONDS, (len(body), seconds)
        assert len(_http(base + "/")) < STATUS_LIMIT_BYTES
        assert peak_rss_kib(proc.pid) < RSS_LIMIT_KIB


def test_a_full_ring_at_the_entry_bound_parses() -> None:
    entries = [{**fuzz.GLOO_ENTRY, "record_id": i, "collective_seq_id": i + 1} for i in range(trace.MAX_ENTRIES)]
    dump = trace.parse_dump({"version": "2.10", "entries": entries})
    assert len(dump.entries) == trace.MAX_ENTRIES and dump.dropped_entries == 0
    with pytest.raises(SpoolError) as e:
        trace.parse_dump({"version": "2.10", "entries": [*entries, fuzz.GLOO_ENTRY]})
    assert e.value.reason == spool.LIMIT_ITEMS
