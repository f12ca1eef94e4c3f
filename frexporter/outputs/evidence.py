"""Evidence bundles: what is saved when a verdict appears, minutes before the watchdog kills the job.

For each new verdict the exporter saves the full FR buffer of every local rank of the verdict's PG and, when
enabled, the culprits' Python stacks: ``sources/evidence_capture.py`` reads them from the ranks' sockets, this
module writes them, one file as it comes, into a new bundle. Bundles are directories that ``frexporter
analyze`` reads like torch's own dump files. Count and size are capped; the oldest bundles go first, and only
bundles verifiably written by this exporter are ever removed (``evidence_dir.py``: no path in the evidence
directory is trusted). ``list_evidence`` lists them for /api/v1/evidence.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from frexporter import reasons, spool
from frexporter.model import RankState
from frexporter.outputs.evidence_dir import (
    DIR_FLAGS,
    MARKER_FIELD,
    MAX_VERDICT_FILE_BYTES,
    PRIVATE_PREFIX,
    VERDICT_FILE,
    EvidenceRefused,
    bundle_key,
    mac,
    open_configured,
    open_evidence_dir,
    opened_dir,
    our_bundle,
    private_name,
    read_at,
    write_at,
)
from frexporter.ratelimit import LogLimiter
from frexporter.sources.evidence_capture import read_evidence

log = logging.getLogger("frexporter.outputs.evidence")

# Repeats and floods: the window of the per-rank and node-wide capture limits and of the log limits.
LIMIT_INTERVAL = 300.0

# What frexporter_source_errors_total{source="evidence"} counts, besides the socket reasons of worker_client
# (socket_refused, socket_timeout, ...), under the names callers have long used; the one spelling of each is
# frexporter.reasons, which says what each counts.
REASON_SYMLINK = reasons.SYMLINK
REASON_FOREIGN_OWNER = reasons.FOREIGN_OWNER
REASON_NOT_DIRECTORY = reasons.NOT_A_DIRECTORY
REASON_SHARED = reasons.WRITABLE_BY_OTHERS
REASON_UNSAFE_KEY = reasons.UNSAFE_KEY
REASON_DEADLINE = reasons.DEADLINE
REASON_IO = reasons.IO
REASON_QUEUE_FULL = reasons.QUEUE_FULL
REASON_RANK_REPEAT = reasons.RANK_REPEAT
REASON_RATE_LIMITED = reasons.RATE_LIMITED
REASON_PRUNE = reasons.PRUNE

__all__ = ["LIMIT_INTERVAL", "MARKER_FIELD", "PRIVATE_PREFIX", "REASON_DEADLINE", "REASON_FOREIGN_OWNER", "REASON_IO",
           "REASON_NOT_DIRECTORY", "REASON_PRUNE", "REASON_QUEUE_FULL", "REASON_RANK_REPEAT", "REASON_RATE_LIMITED",
           "REASON_SHARED", "REASON_SYMLINK", "REASON_UNSAFE_KEY", "VERDICT_FILE", "Counts", "EvidenceConfig",
           "EvidenceRefused", "EvidenceWriter", "list_evidence", "open_evidence_dir"]

_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class EvidenceConfig:
    directory: str
    max_bundles: int = 20
    max_bytes: int = 200 * 1024 * 1024
    stacks: bool = False
    timeout: float = 5.0  # per socket request
    deadline: float = 30.0  # per capture: a PG of many dead or silent ranks must not hold the capture thread


class Counts:
    """Failures by reason since start, shared by the capture thread and the poll loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, int] = {}
        self.last_error = ""

    def add(self, reason: str, message: str, n: int = 1) -> None:
        with self._lock:
            self._totals[reason] = self._totals.get(reason, 0) + n
            self.last_error = message

    def totals(self) -> dict[str, int]:
        with self._lock:
            return dict(self._totals)


class EvidenceWriter:
    def __init__(self, config: EvidenceConfig) -> None:
        self.config = config
        self.written = 0
        self.counts = Counts()
        self.logs = LogLimiter(log, burst=1, window=LIMIT_INTERVAL)
        self.dir_ok = True  # False while the evidence directory is refused or cannot be written
        self.last_success: float | None = None
        self.duration = 0.0

    def capture(self, verdict: Any, ranks: Iterable[RankState], socket_dir: str) -> str | None:
        """Write one bundle for ``verdict``; returns its path, or None when nothing could be written."""
        started = time.monotonic()
        try:
            return self._capture(verdict, list(ranks), socket_dir, started)
        finally:
            self.duration = time.monotonic() - started

    def check_directory(self) -> bool:
        """Whether the evidence directory is usable as it stands (a missing one is: it will be made)."""
        try:
            os.close(open_evidence_dir(self.config.directory, create=False)[0])
        except FileNotFoundError:
            return True
        except (EvidenceRefused, OSError):
            return False
        return True

    def _capture(self, verdict: Any, ranks: list[RankState], socket_dir: str, started: float) -> str | None:
        directory = self.config.directory
        try:
            dir_fd, directory = open_evidence_dir(directory)
        except (EvidenceRefused, OSError) as e:
            self._refused(e, f"cannot open evidence directory {directory}")
            return None
        try:
            try:
                key = bundle_key(dir_fd, directory)
                name, bundle_fd = self._new_bundle(dir_fd, verdict)
            except (EvidenceRefused, OSError) as e:
                self._refused(e, f"cannot create evidence bundle under {directory}")
                return None
            path = os.path.join(directory, name)
            try:
                self._fill(bundle_fd, name, key, verdict, ranks, socket_dir, started)
            except OSError as e:
                self.note(reasons.IO, f"cannot write evidence bundle {path}: {e.strerror or e}")
                with contextlib.suppress(OSError):
                    self._remove(dir_fd, name, bundle_fd)
                return None
            finally:
                os.close(bundle_fd)
            self.dir_ok = True
            self.written += 1
            self.last_success = time.time()
            self._prune(dir_fd, directory, key)
        finally:
            os.close(dir_fd)
        log.info("evidence for %s on PG %s seq %s written to %s", verdict.kind, verdict.pg, verdict.seq, path)
        return path

    def _refused(self, error: EvidenceRefused | OSError, doing: str) -> None:
        """The directory could not be used: counted by its reason, and evidence is down until a capture works."""
        self.dir_ok = False
        if isinstance(error, EvidenceRefused):
            self.note(error.reason, f"evidence directory refused: {error}")
        else:
            self.note(reasons.IO, f"{doing}: {error.strerror or error}")

    def _new_bundle(self, dir_fd: int, verdict: Any) -> tuple[str, int]:
        """A new, empty bundle directory: the time and kind for people, a random suffix against planted names."""
        stem = _SAFE.sub("_", f"{time.strftime('%Y%m%dT%H%M%S')}-{str(verdict.kind)[:32]}-"
                              f"{str(verdict.job_id)[:64]}-{str(verdict.pg)[:12]}-{verdict.seq}")
        for attempt in range(3):
            name = f"{stem}-{secrets.token_hex(4)}"
            try:
                os.mkdir(name, spool.DIR_MODE, dir_fd=dir_fd)  # fails on an existing name: nothing planted is reused
            except FileExistsError:
                if attempt == 2:
                    raise
                continue
            fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
            if os.fstat(fd).st_uid != os.geteuid():  # swapped between mkdir and open (a root-owned shared dir)
                os.close(fd)
                raise EvidenceRefused(reasons.FOREIGN_OWNER, f"bundle {name} changed hands while it was made")
            os.fchmod(fd, spool.DIR_MODE)  # mkdir applied the umask
            return name, fd
        raise AssertionError("unreachable")

    def _fill(self, bundle_fd: int, name: str, key: bytes, verdict: Any, ranks: list[RankState], socket_dir: str,
              started: float) -> None:
        manifest: dict[str, Any] = {"verdict": verdict.to_json(), "captured_at": time.time(), "files": {},
                                    MARKER_FIELD: {"name": name, "mac": mac(key, name)}}
        cfg = self.config
        for captured in read_evidence(verdict, ranks, socket_dir, stacks=cfg.stacks, timeout=cfg.timeout,
                                      started=started, within=cfg.deadline, max_bytes=cfg.max_bytes, note=self.note):
            write_at(bundle_fd, captured.name, captured.body)
            manifest["files"][captured.name] = {"rank": captured.rank, "handler": captured.handler,
                                                "bytes": len(captured.body)}
        # Last: a bundle without its verdict.json (the marker) is never mistaken for a finished one of ours.
        write_at(bundle_fd, VERDICT_FILE, json.dumps(manifest, indent=1, sort_keys=True).encode())

    def note(self, reason: str, message: str) -> None:
        """Count a capture that failed or was not made; log it, one line per reason per LIMIT_INTERVAL."""
        self.counts.add(reason, message)
        self.logs.log(logging.WARNING, reason, "evidence capture: %s (reason=%s; one line per reason per %.0f s, "
                      "all counted)", message, reason, self.logs.window)

    def _prune(self, dir_fd: int, directory: str, key: bytes) -> None:
        """Remove our oldest bundles beyond max_bundles; whatever is not verifiably ours stays."""
        ours = []
        try:
            names = os.listdir(dir_fd)
        except OSError as e:
            self.note(reasons.PRUNE, f"cannot list {directory}: {e.strerror or e}")
            return
        for name in names:
            if name.startswith("."):
                continue
            try:
                with opened_dir(name, dir_fd) as fd:
                    captured = our_bundle(fd, name, key)
            except OSError:
                continue  # a symlink, a file, or gone: not ours to touch
            if captured is not None:
                ours.append((captured, name))
        ours.sort()
        for _, name in ours[:max(0, len(ours) - self.config.max_bundles)]:
            try:
                with opened_dir(name, dir_fd) as fd:
                    if our_bundle(fd, name, key) is not None:  # still the one we verified
                        self._remove(dir_fd, name, fd)
            except OSError as e:
                self.note(reasons.PRUNE, f"cannot remove evidence bundle {name}: {e.strerror or e}")

    def _remove(self, dir_fd: int, name: str, bundle_fd: int) -> None:
        """Empty the open bundle through its descriptor, marker last, then remove its name if it still is that bundle.

        Only names inside the bundle are unlinked (a planted symlink goes, its target stays); a subdirectory is
        nothing this exporter writes, so it is left and the bundle with it.
        """
        entries = os.listdir(bundle_fd)
        for entry in sorted(entries, key=lambda e: e == VERDICT_FILE):
            if stat.S_ISDIR(os.stat(entry, dir_fd=bundle_fd, follow_symlinks=False).st_mode):
                continue
            os.unlink(entry, dir_fd=bundle_fd)
        here, st = os.fstat(bundle_fd), os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if (here.st_dev, here.st_ino) == (st.st_dev, st.st_ino):
            os.rmdir(name, dir_fd=dir_fd)


# ---------------------------------------------------------------- listing (/api/v1/evidence)


def list_evidence(directory: str) -> list[dict[str, Any]]:
    """The evidence bundles under ``directory``, newest first: name, size, and what their verdict says.

    The directory may sit in the spool, which ranks (other users in group mode) can write: a symlinked or
    foreign directory lists nothing, symlinked bundles and files are passed over, and every verdict.json is
    read bounded and type-checked, a bad one listed with its error. Bundles in this user's private directory
    (made when ``directory`` is writable by others) are listed as ``frexporter-<uid>/<name>``.
    """
    try:
        dir_fd, _ = open_configured(directory, create=False)
    except (EvidenceRefused, OSError):
        return []
    try:
        bundles = _list_at(dir_fd, "")
    finally:
        os.close(dir_fd)
    bundles.sort(key=lambda b: (b.get("captured_at") or b["modified"], b["name"]), reverse=True)
    return bundles


def _list_at(dir_fd: int, prefix: str) -> list[dict[str, Any]]:
    bundles = []
    try:
        names = os.listdir(dir_fd)
    except OSError:
        return []
    for name in names:
        if name.startswith("."):
            continue
        try:
            with opened_dir(name, dir_fd) as fd:
                if not prefix and name == private_name() and os.fstat(fd).st_uid == os.geteuid():
                    bundles.extend(_list_at(fd, name + "/"))
                else:
                    bundles.append(_describe(fd, prefix + name))
        except OSError:
            continue  # not a directory, a symlink, or pruned while we looked
    return bundles


def _describe(bundle_fd: int, name: str) -> dict[str, Any]:
    files, size = 0, 0
    with os.scandir(bundle_fd) as contents:
        for item in contents:
            if item.is_file(follow_symlinks=False):
                files += 1
                size += item.stat(follow_symlinks=False).st_size
    bundle: dict[str, Any] = {"name": name, "bytes": size, "files": files, "modified": os.fstat(bundle_fd).st_mtime}
    try:
        _, data = read_at(bundle_fd, VERDICT_FILE, MAX_VERDICT_FILE_BYTES, os.path.join(name, VERDICT_FILE))
        bundle.update(_verdict_summary(spool.parse_json_bytes(data, name)))
    except spool.SpoolError as e:
        bundle["error"] = e.reason
    return bundle


_VERDICT_FIELDS = {"kind": str, "job_id": str, "pg": str, "pg_desc": str, "op": str, "summary": str, "seq": int,
                   "ranks": list, "waiting_ranks": list}


def _verdict_summary(doc: Any) -> dict[str, Any]:
    if not isinstance(doc, dict) or not isinstance(doc.get("verdict"), dict):
        return {"error": reasons.INVALID}
    verdict = {}
    for key, kind in _VERDICT_FIELDS.items():
        value = doc["verdict"].get(key)
        if isinstance(value, kind) and not isinstance(value, bool):
            if isinstance(value, str):
                value = value[:500]
            elif isinstance(value, list):
                value = [r for r in value[:1000] if isinstance(r, int) and not isinstance(r, bool)]
            verdict[key] = value
    out: dict[str, Any] = {"verdict": verdict}
    captured = doc.get("captured_at")
    if isinstance(captured, (int, float)) and not isinstance(captured, bool):
        out["captured_at"] = float(captured)
    return out
