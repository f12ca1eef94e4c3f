"""Evidence captured when a verdict appears, minutes before the watchdog kills the job.

For each new verdict the exporter reads the full FR buffer of every local rank of the
verdict's PG over its worker-server socket (C++, no GIL needed, so a wedged rank still
answers) and, when enabled, the culprits' Python stacks (torch's ``pyspy_dump``
handler runs py-spy outside the rank). Bundles are directories that ``frexporter
analyze`` reads like torch's own dump files. Count and size are capped; the oldest
bundles go first.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from frexporter import spool
from frexporter.model import RankState
from frexporter.sources import worker_client
from frexporter.sources.base import SourceError

log = logging.getLogger("frexporter.outputs.evidence")

VERDICT_FILE = "verdict.json"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class EvidenceConfig:
    directory: str
    max_bundles: int = 20
    max_bytes: int = 200 * 1024 * 1024
    stacks: bool = False
    timeout: float = 5.0


class EvidenceWriter:
    def __init__(self, config: EvidenceConfig) -> None:
        self.config = config
        self.written = 0
        self.errors: list[tuple[str, str]] = []
        self._warned = False

    def capture(self, verdict: Any, ranks: Iterable[RankState], socket_dir: str) -> str | None:
        """Write one bundle for ``verdict``; returns its path, or None when nothing could be written."""
        self.errors = []
        try:
            spool.ensure_dir(self.config.directory)
            name = _SAFE.sub("_", f"{time.strftime('%Y%m%dT%H%M%S')}-{verdict.kind}-{verdict.job_id}-"
                                  f"{verdict.pg[:12]}-{verdict.seq}")
            path = os.path.join(self.config.directory, name)
            os.makedirs(path, mode=spool.DIR_MODE, exist_ok=True)
        except OSError as e:
            self._fail("io", f"cannot create evidence bundle under {self.config.directory}: {e.strerror or e}")
            return None
        involved = set(verdict.ranks) | set(verdict.waiting_ranks)
        pg_members = {rank for r in ranks for pg in r.pgs if pg.name == verdict.pg for rank in pg.ranks}
        manifest: dict[str, Any] = {"verdict": verdict.to_json(), "captured_at": time.time(), "files": {}}
        budget = self.config.max_bytes
        for rank in sorted(ranks, key=lambda r: r.rank):
            if rank.job_id != verdict.job_id or not (rank.rank in involved or rank.rank in pg_members):
                continue
            if not rank.socket:
                continue
            sock = os.path.join(socket_dir, rank.socket)
            # <prefix><rank>.json: the file naming torch's analyzer and `frexporter analyze` understand.
            for recorder, handler, query in _handlers(rank):
                body = self._fetch(sock, handler, query)
                if body is None or len(body) > budget:
                    continue
                budget -= len(body)
                fname = f"{recorder}_rank{rank.rank}.json"
                _write(os.path.join(path, fname), body)
                manifest["files"][fname] = {"rank": rank.rank, "handler": handler, "bytes": len(body)}
            if self.config.stacks and rank.rank in verdict.ranks and "pyspy_dump" in rank.handlers:
                body = self._fetch(sock, "pyspy_dump", "nonblocking=true")
                if body is not None and len(body) <= budget:
                    budget -= len(body)
                    _write(os.path.join(path, f"stacks_rank{rank.rank}.txt"), body)
                    manifest["files"][f"stacks_rank{rank.rank}.txt"] = {"rank": rank.rank, "bytes": len(body)}
        _write(os.path.join(path, VERDICT_FILE), json.dumps(manifest, indent=1, sort_keys=True).encode())
        self.written += 1
        self._prune()
        log.info("evidence for %s on PG %s seq %s written to %s", verdict.kind, verdict.pg, verdict.seq, path)
        return path

    def _fetch(self, sock: str, handler: str, query: str) -> bytes | None:
        try:
            return worker_client.post(sock, handler, self.config.timeout, query)
        except SourceError as e:
            self._fail(e.reason, str(e))
            return None

    def _fail(self, reason: str, message: str) -> None:
        self.errors.append((reason, message))
        if not self._warned:
            self._warned = True
            log.warning("evidence capture: %s (further failures are counted)", message)

    def _prune(self) -> None:
        try:
            bundles = sorted(
                (os.path.join(self.config.directory, n) for n in os.listdir(self.config.directory)),
                key=os.path.getmtime,
            )
        except OSError:
            return
        while len(bundles) > self.config.max_bundles:
            shutil.rmtree(bundles.pop(0), ignore_errors=True)


def _handlers(rank: RankState) -> list[tuple[str, str, str]]:
    out = []
    if "fr_trace_json" in rank.handlers:
        out.append((spool.RECORDER_FR, "fr_trace_json", ""))
    if "dump_nccl_trace_json" in rank.handlers:
        out.append((spool.RECORDER_NCCL, "dump_nccl_trace_json", "includecollectives=true&onlyactive=false"))
    return out


def _write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, spool.FILE_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
