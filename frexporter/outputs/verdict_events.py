"""What happens when a verdict appears or clears: one log line each, and evidence captured at once.

Runs as a poll listener. Evidence is read over sockets on a background thread, so a
slow rank never delays the poll loop; at most one capture runs at a time.

Whoever can write the spool decides how many verdicts appear (thousands of fake ranks that
go stale at once), so captures and log lines are bounded: a short queue, one capture per
rank per LIMIT_INTERVAL, a node-wide number of captures per LIMIT_INTERVAL, and verdict
lines beyond a burst summed up in one line. Every capture not made is counted by reason in
``frexporter_source_errors_total{source="evidence"}``.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections import deque
from collections.abc import Hashable

from frexporter import defaults, naming, reasons
from frexporter.analysis import Verdict, VerdictTracker
from frexporter.model import NodeSnapshot, SourceStatus
from frexporter.outputs.evidence import LIMIT_INTERVAL, EvidenceWriter
from frexporter.ratelimit import LogLimiter

log = logging.getLogger("frexporter.outputs.verdict_events")

MAX_PENDING_CAPTURES = 8  # queued or running; a capture can take EvidenceConfig.deadline
# Fewer than EvidenceConfig.max_bundles: a burst of verdicts cannot prune away the bundles from before it.
MAX_CAPTURES_PER_INTERVAL = 10
VERDICT_LOG_BURST = 20  # verdict lines (appeared, cleared) per LIMIT_INTERVAL before they are summed up


class VerdictEvents:
    def __init__(self, spool_dir: str, evidence: EvidenceWriter | None,
                 confirm_after: float = defaults.VERDICT_CONFIRM_AFTER, clear_after: float = 0.0) -> None:
        self.spool_dir = spool_dir
        self.evidence = evidence
        self.tracker = VerdictTracker(confirm_after=confirm_after, clear_after=clear_after)
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="frexporter-evidence")
        self.captures: list[cf.Future[str | None]] = []  # queued or running
        self._recent: dict[Hashable, float] = {}  # a rank's key -> monotonic time of its last capture
        self._started: deque[float] = deque()  # monotonic times of the captures queued in the last interval
        self._logs = LogLimiter(log, burst=VERDICT_LOG_BURST, window=LIMIT_INTERVAL)

    def __call__(self, snapshot: NodeSnapshot) -> None:
        update = self.tracker.update(snapshot.verdicts, snapshot.time)
        self.captures = [f for f in self.captures if not f.done()]
        now = time.monotonic()
        self._forget(now)
        for v in update.appeared:
            self._logs.log(logging.WARNING, "verdict", "verdict %s: %s", v.kind, v.summary)
            if self.evidence is not None:
                self._queue(v, snapshot, now)
        for v in update.cleared:
            self._logs.log(logging.INFO, "verdict cleared", "verdict cleared (%s on PG %s seq %s, ranks %s)", v.kind,
                           v.pg, v.seq, ",".join(map(str, v.ranks)))
        self._logs.flush()
        if self.evidence is not None:
            self.evidence.logs.flush()

    def _queue(self, v: Verdict, snapshot: NodeSnapshot, now: float) -> None:
        assert self.evidence is not None
        # A verdict without culprits (none of today's kinds) is limited per PG and kind instead.
        keys: list[Hashable] = [(v.job_id, r) for r in v.ranks] or [(v.job_id, v.pg, v.kind)]
        if any(k in self._recent for k in keys):
            reason = reasons.RANK_REPEAT
        elif len(self._started) >= MAX_CAPTURES_PER_INTERVAL:
            reason = reasons.RATE_LIMITED
        elif len(self.captures) >= MAX_PENDING_CAPTURES:
            reason = reasons.QUEUE_FULL
        else:
            for k in keys:
                self._recent[k] = now
            self._started.append(now)
            self.captures.append(self._pool.submit(self.evidence.capture, v, snapshot.ranks, self.spool_dir))
            return
        self.evidence.note(reason, f"no evidence for the {v.kind} verdict of job {v.job_id!r} "
                                   f"(ranks {','.join(map(str, v.ranks[:8]))}): {reason}")

    def _forget(self, now: float) -> None:
        while self._started and now - self._started[0] >= LIMIT_INTERVAL:
            self._started.popleft()
        if self._recent:
            self._recent = {k: t for k, t in self._recent.items() if now - t < LIMIT_INTERVAL}

    def status(self) -> SourceStatus:
        """Evidence as a source row: frexporter_source_{up,errors_total,...}{source="evidence"}.

        Up while the evidence directory can be used as it stands (a missing one will be made); errors count
        every capture that failed or was not made, by reason.
        """
        ev = self.evidence
        if ev is None:
            return SourceStatus(name=naming.SOURCE_EVIDENCE, up=True, duration_seconds=0.0, errors_total={})
        return SourceStatus(name=naming.SOURCE_EVIDENCE, up=ev.check_directory(), duration_seconds=ev.duration,
                            errors_total=ev.counts.totals(), last_error=ev.counts.last_error,
                            last_success=ev.last_success)

    def close(self) -> None:
        # Queued captures are dropped: a stopping exporter must not spend minutes on sockets first.
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._logs.flush(force=True)
        if self.evidence is not None:
            self.evidence.logs.flush(force=True)
