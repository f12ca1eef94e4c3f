"""The evidence directory is untrusted ground: attacks on it, made as an attacker who can write the spool would
make them, against a real `frexporter serve` on loopback.

Fake ranks stand in for killed ones: a manifest and a snapshot that stop refreshing, and a socket file nobody
listens on (a rank_down verdict), or a socket that answers pings and never answers a Flight Recorder read.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_evidence_attacks.py.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from frexporter.analysis import Verdict
from frexporter.model import NodeSnapshot
from frexporter.outputs import evidence
from frexporter.outputs.evidence import EvidenceConfig, EvidenceWriter
from frexporter.outputs.verdict_events import (
    VerdictEvents,
)
from frexporter.ratelimit import LogLimiter
from tests.shared.evidence_attacks import OLD_NAME, verdict


def test_a_guessed_bundle_name_is_not_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Second line of defence: were the random part guessed, mkdir on the planted name fails and nothing in it is
    opened."""
    target = tmp_path / "precious.txt"
    target.write_text("precious")
    ev = tmp_path / "evidence"
    ev.mkdir(mode=0o700)
    monkeypatch.setattr(evidence.secrets, "token_hex", lambda nbytes: "ab" * nbytes)
    now = time.time()
    for offset in range(-5, 60):
        d = ev / (OLD_NAME.format(ts=time.strftime("%Y%m%dT%H%M%S", time.localtime(now + offset))) + "-abababab")
        d.mkdir()
        os.symlink(target, d / evidence.VERDICT_FILE)
    writer = EvidenceWriter(EvidenceConfig(directory=str(ev)))
    assert writer.capture(verdict(), (), str(tmp_path)) is None
    assert writer.counts.totals() == {evidence.REASON_IO: 1} and "File exists" in writer.counts.last_error
    assert target.read_text() == "precious"


def test_one_capture_per_rank_per_interval(tmp_path: Path) -> None:
    """A rank whose verdict clears and comes back (or changes kind) is captured once per LIMIT_INTERVAL."""
    writer = EvidenceWriter(EvidenceConfig(directory=str(tmp_path / "evidence")))
    events = VerdictEvents(str(tmp_path), writer)
    try:
        def poll(*verdicts: Verdict) -> None:
            events(NodeSnapshot(time=time.time(), hostname="node-a", ranks=(), sources=(), verdicts=verdicts))
            for future in list(events.captures):
                future.result(timeout=30)

        poll(verdict(0))
        poll()
        poll(verdict(0))
        poll(verdict(0, kind="rank_unresponsive"))
        poll(verdict(0, kind="rank_unresponsive"), verdict(1))
        assert writer.written == 2  # rank 0 once, rank 1 once
        assert writer.counts.totals() == {evidence.REASON_RANK_REPEAT: 2}
        assert events.status().errors_total == {evidence.REASON_RANK_REPEAT: 2} and events.status().up
    finally:
        events.close()


def test_log_lines_are_one_per_reason_per_interval_with_the_rest_counted(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("frexporter.test_evidence_attacks")
    limiter = LogLimiter(logger, burst=1)
    caplog.set_level(logging.INFO, logger=logger.name)
    for i in range(500):
        limiter.log(logging.WARNING, "socket_refused", "capture %d failed", i)
        limiter.log(logging.WARNING, "queue_full", "capture %d dropped", i)
    assert [r.getMessage() for r in caplog.records] == ["capture 0 failed", "capture 0 dropped"]
    limiter.flush()  # the interval is not over: nothing to sum up yet
    assert len(caplog.records) == 2
    limiter.flush(force=True)
    summaries = sorted(r.getMessage().split(" suppressed")[0] for r in caplog.records[2:])
    assert summaries == ["499 more queue_full messages", "499 more socket_refused messages"]
