"""What happens when a verdict appears or clears: one log line each, and evidence captured at once.

Runs as a poll listener. Evidence is read over sockets on a background thread, so a
slow rank never delays the poll loop; at most one capture runs at a time.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging

from frexporter.analysis import VerdictTracker
from frexporter.model import NodeSnapshot
from frexporter.outputs.evidence import EvidenceWriter

log = logging.getLogger("frexporter.outputs.verdict_events")


class VerdictEvents:
    def __init__(self, spool_dir: str, evidence: EvidenceWriter | None, confirm_after: float = 0.0,
                 clear_after: float = 0.0) -> None:
        self.spool_dir = spool_dir
        self.evidence = evidence
        self.tracker = VerdictTracker(confirm_after=confirm_after, clear_after=clear_after)
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="frexporter-evidence")
        self.captures: list[cf.Future[str | None]] = []

    def __call__(self, snapshot: NodeSnapshot) -> None:
        update = self.tracker.update(snapshot.verdicts, snapshot.time)
        for v in update.appeared:
            log.warning("verdict %s: %s", v.kind, v.summary)
            if self.evidence is not None:
                self.captures.append(self._pool.submit(self.evidence.capture, v, snapshot.ranks, self.spool_dir))
        for v in update.cleared:
            log.info("verdict cleared (%s on PG %s seq %s, ranks %s)", v.kind, v.pg, v.seq,
                     ",".join(map(str, v.ranks)))
        self.captures = [f for f in self.captures if not f.done()]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)
