"""Evidence captured when a verdict appears, minutes before the watchdog kills the job.

For each new verdict the exporter reads the full FR buffer of every local rank of the
verdict's PG over its worker-server socket (C++, no GIL needed, so a wedged rank still
answers) and, when enabled, the culprits' Python stacks (torch's ``pyspy_dump``
handler runs py-spy as a child of the rank, which reads the rank without its GIL).
Bundles are directories that ``frexporter analyze`` reads like torch's own dump files.
Count and size are capped; the oldest bundles go first.

The default evidence directory sits in the spool, which the ranks (other users in group
mode) can write, so nothing here trusts a path: the directory is opened without following
a symlink and must belong to this user (or root), every file is created relative to a
directory descriptor with ``O_EXCL | O_NOFOLLOW`` inside a freshly made bundle with an
unguessable name, and pruning removes only bundles whose ``verdict.json`` carries this
exporter's HMAC of the bundle's name.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from frexporter import spool
from frexporter.errors import FrexporterError
from frexporter.model import RankState
from frexporter.sources import worker_client
from frexporter.sources.base import SourceError

log = logging.getLogger("frexporter.outputs.evidence")

VERDICT_FILE = "verdict.json"
MAX_VERDICT_FILE_BYTES = 1024 * 1024
# The per-directory secret that marks bundles as ours (0600, made by the exporter). A dot name: the listing,
# `frexporter analyze` and the ranks source all pass over it.
KEY_FILE = ".frexporter-key"
KEY_BYTES = 32
# Inside an evidence directory others may write: where this user's bundles go, +uid.
PRIVATE_PREFIX = "frexporter-"
MARKER_FIELD = "bundle"  # verdict.json: {"name": <bundle name>, "mac": HMAC-SHA256(key, name)}
# Repeats and floods: the window of the per-rank and node-wide capture limits and of the log limits.
LIMIT_INTERVAL = 300.0

# `reason` values of frexporter_source_errors_total{source="evidence"}, besides the socket reasons of
# worker_client (socket_refused, socket_timeout, ...).
REASON_SYMLINK = "symlink"  # the evidence directory (or its key file) is a symbolic link
REASON_FOREIGN_OWNER = "foreign_owner"  # owned by another user
REASON_NOT_DIRECTORY = "not_a_directory"
REASON_SHARED = "writable_by_others"  # our private directory inside a shared one is not private
REASON_UNSAFE_KEY = "unsafe_key"  # the key file is not a private regular file of ours
REASON_IO = "io"
REASON_DEADLINE = "deadline"  # the capture's time ran out before every rank was read
REASON_QUEUE_FULL = "queue_full"
REASON_RANK_REPEAT = "rank_repeat"  # a rank already captured within LIMIT_INTERVAL
REASON_RATE_LIMITED = "rate_limited"  # the node-wide captures per LIMIT_INTERVAL are spent
REASON_PRUNE = "prune"  # a bundle of ours could not be removed

_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
# O_NONBLOCK: a FIFO planted under a file name must not block open(); fstat then refuses it.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC


class EvidenceRefused(FrexporterError):
    """The evidence directory (or something in it) is not safe to use; ``reason`` is a bounded label value."""


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


class LogLimiter:
    """At most ``burst`` lines per key per ``interval``; later ones are counted and summed up in one line.

    Keys are bounded (reasons, fixed strings): whoever can write the spool decides how often the lines would
    otherwise come.
    """

    def __init__(self, logger: logging.Logger, burst: int = 1, interval: float = LIMIT_INTERVAL) -> None:
        self.logger = logger
        self.burst = burst
        self.interval = interval
        self._lock = threading.Lock()
        self._windows: dict[str, list[float]] = {}  # key -> [window start (monotonic), emitted, suppressed]

    def log(self, level: int, key: str, msg: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            window = self._windows.get(key)
            if window is not None and now - window[0] >= self.interval:
                self._summary(key, window)
                window = None
            if window is None:
                window = self._windows[key] = [now, 0, 0]
            emit = window[1] < self.burst
            window[1 if emit else 2] += 1
        if emit:
            self.logger.log(level, msg, *args, exc_info=exc_info)

    def flush(self, force: bool = False) -> None:
        """Sum up the windows that are over (every window with ``force``)."""
        now = time.monotonic()
        with self._lock:
            for key, window in list(self._windows.items()):
                if force or now - window[0] >= self.interval:
                    self._summary(key, window)
                    del self._windows[key]

    def _summary(self, key: str, window: list[float]) -> None:
        if window[2]:
            self.logger.warning("%d more %s messages suppressed in the last %.0f s", window[2], key,
                                time.monotonic() - window[0])


def _open_leaf(parent_fd: int, leaf: str, what: str, create: bool) -> tuple[int, bool]:
    """(descriptor, made now) of directory ``leaf`` under ``parent_fd``, never through a symlink."""
    made = False
    if create:
        try:
            os.mkdir(leaf, spool.DIR_MODE, dir_fd=parent_fd)
            made = True
        except FileExistsError:
            pass
    try:
        fd = os.open(leaf, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        if stat.S_ISLNK(os.stat(leaf, dir_fd=parent_fd, follow_symlinks=False).st_mode):
            raise EvidenceRefused(REASON_SYMLINK, f"{what}: a symbolic link; refused") from e
        raise EvidenceRefused(REASON_NOT_DIRECTORY, f"{what}: not a directory") from e
    try:
        st = os.fstat(fd)
        # Root may have provisioned it (a Kubernetes emptyDir, /var/lib/...): only root can make a root-owned
        # directory, and root is trusted anyway. Anyone else's is theirs to swap out under us, and so is one
        # that replaced ours between mkdir and open.
        if st.st_uid != os.geteuid() and (made or st.st_uid != 0):
            raise EvidenceRefused(REASON_FOREIGN_OWNER, f"{what}: owned by uid {st.st_uid}, not by this user "
                                                        f"(uid {os.geteuid()}) or root")
        if made:
            os.fchmod(fd, spool.DIR_MODE)  # mkdir applied the umask
    except BaseException:
        os.close(fd)
        raise
    return fd, made


def _open_configured(directory: str, create: bool) -> tuple[int, bool]:
    parent, leaf = os.path.split(os.path.abspath(directory))
    if not leaf:
        raise EvidenceRefused(REASON_NOT_DIRECTORY, f"{directory}: not a usable evidence directory")
    if create:
        os.makedirs(parent, mode=spool.DIR_MODE, exist_ok=True)
    parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    try:
        return _open_leaf(parent_fd, leaf, directory, create)
    finally:
        os.close(parent_fd)


def _private_name() -> str:
    return f"{PRIVATE_PREFIX}{os.geteuid()}"


def open_evidence_dir(directory: str, create: bool = True) -> tuple[int, str]:
    """(descriptor, path) of the directory bundles go to; raises EvidenceRefused or OSError.

    Only the last component of ``directory`` is checked: its parent is the spool or a directory an administrator
    named. That component must be a directory, not a symlink, owned by this user or root. If it already existed
    writable by others (a Kubernetes emptyDir is 0777 or 2777; an older exporter made ``<spool>/evidence`` 2770
    in group mode), bundles go to a private ``frexporter-<uid>`` directory made inside it: nothing is written
    straight into a directory others can write, and no mode this exporter did not set is changed.
    """
    fd, made = _open_configured(directory, create)
    if made or not os.fstat(fd).st_mode & 0o022:
        return fd, directory
    private = os.path.join(directory, _private_name())
    try:
        sub, made = _open_leaf(fd, os.path.basename(private), private, create)
    finally:
        os.close(fd)
    st = os.fstat(sub)
    if not made and (st.st_uid != os.geteuid() or st.st_mode & 0o077):
        os.close(sub)
        raise EvidenceRefused(REASON_FOREIGN_OWNER if st.st_uid != os.geteuid() else REASON_SHARED,
                              f"{private}: not a private directory of this user (uid {st.st_uid}, mode "
                              f"{stat.S_IMODE(st.st_mode):o})")
    return sub, private


def _key(dir_fd: int, directory: str) -> bytes:
    """The directory's bundle key, made on first use: a private regular file of ours, KEY_BYTES long."""
    try:
        fd = os.open(KEY_FILE, _CREATE_FLAGS, spool.FILE_MODE, dir_fd=dir_fd)
    except FileExistsError:
        pass
    else:
        try:
            os.write(fd, secrets.token_bytes(KEY_BYTES))
        finally:
            os.close(fd)
    what = os.path.join(directory, KEY_FILE)
    try:
        fd = os.open(KEY_FILE, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise EvidenceRefused(REASON_SYMLINK, f"{what}: a symbolic link; refused") from e
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise EvidenceRefused(REASON_FOREIGN_OWNER, f"{what}: owned by uid {st.st_uid}, not by this user")
        if (not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_mode & 0o077
                or st.st_size != KEY_BYTES):
            raise EvidenceRefused(REASON_UNSAFE_KEY, f"{what}: not a private {KEY_BYTES}-byte file of this "
                                                     "exporter; remove it and the next capture makes a new one")
        data = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != KEY_BYTES:
        raise EvidenceRefused(REASON_UNSAFE_KEY, f"{what}: short read")
    return data


def _mac(key: bytes, name: str) -> str:
    return hmac.new(key, b"frexporter-evidence-bundle\0" + name.encode(), hashlib.sha256).hexdigest()


def _write_at(dir_fd: int, name: str, data: bytes) -> None:
    # O_EXCL: a name planted in the bundle (a symlink to a file elsewhere) fails here instead of being followed.
    fd = os.open(name, _CREATE_FLAGS, spool.FILE_MODE, dir_fd=dir_fd)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _read_at(dir_fd: int, name: str, max_bytes: int, what: str) -> tuple[os.stat_result, bytes]:
    """A regular file's status and (bounded) bytes, never through a symlink; SpoolError with a reason otherwise."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError as e:
        raise spool.SpoolError("missing", f"{what}: missing") from e
    except OSError as e:
        reason = "symlink" if e.errno == errno.ELOOP else "io"
        raise spool.SpoolError(reason, f"{what}: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise spool.SpoolError("foreign", f"{what}: not a regular file")
        if st.st_size > max_bytes:
            raise spool.SpoolError("oversized", f"{what}: larger than the {max_bytes} byte limit")
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as e:
        raise spool.SpoolError("io", f"{what}: {e.strerror or e}") from e
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise spool.SpoolError("oversized", f"{what}: larger than the {max_bytes} byte limit")
    return st, data


@contextlib.contextmanager
def _opened_dir(name: str, dir_fd: int) -> Iterator[int]:
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def _our_bundle(bundle_fd: int, name: str, key: bytes) -> float | None:
    """When the open directory ``bundle_fd`` is a bundle this exporter wrote under ``name``: its capture time."""
    if os.fstat(bundle_fd).st_uid != os.geteuid():
        return None
    try:
        st, data = _read_at(bundle_fd, VERDICT_FILE, MAX_VERDICT_FILE_BYTES, name)
        doc = spool.parse_json_bytes(data, name)
    except spool.SpoolError:
        return None
    if st.st_uid != os.geteuid() or not isinstance(doc, dict):
        return None
    marker = doc.get(MARKER_FIELD)
    if not isinstance(marker, dict) or marker.get("name") != name or not isinstance(marker.get("mac"), str):
        return None
    if not hmac.compare_digest(marker["mac"].encode(), _mac(key, name).encode()):
        return None
    captured = doc.get("captured_at")
    return float(captured) if isinstance(captured, (int, float)) and not isinstance(captured, bool) else 0.0


class EvidenceWriter:
    def __init__(self, config: EvidenceConfig) -> None:
        self.config = config
        self.written = 0
        self.counts = Counts()
        self.logs = LogLimiter(log)
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
                key = _key(dir_fd, directory)
                name, bundle_fd = self._new_bundle(dir_fd, verdict)
            except (EvidenceRefused, OSError) as e:
                self._refused(e, f"cannot create evidence bundle under {directory}")
                return None
            path = os.path.join(directory, name)
            try:
                self._fill(bundle_fd, name, key, verdict, ranks, socket_dir, started)
            except OSError as e:
                self.note(REASON_IO, f"cannot write evidence bundle {path}: {e.strerror or e}")
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
            self.note(REASON_IO, f"{doing}: {error.strerror or error}")

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
            fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            if os.fstat(fd).st_uid != os.geteuid():  # swapped between mkdir and open (a root-owned shared dir)
                os.close(fd)
                raise EvidenceRefused(REASON_FOREIGN_OWNER, f"bundle {name} changed hands while it was made")
            os.fchmod(fd, spool.DIR_MODE)  # mkdir applied the umask
            return name, fd
        raise AssertionError("unreachable")

    def _fill(self, bundle_fd: int, name: str, key: bytes, verdict: Any, ranks: list[RankState], socket_dir: str,
              started: float) -> None:
        involved = set(verdict.ranks) | set(verdict.waiting_ranks)
        pg_members = {rank for r in ranks for pg in r.pgs if pg.name == verdict.pg for rank in pg.ranks}
        manifest: dict[str, Any] = {"verdict": verdict.to_json(), "captured_at": time.time(), "files": {},
                                    MARKER_FIELD: {"name": name, "mac": _mac(key, name)}}
        budget = self.config.max_bytes
        deadline = started + self.config.deadline
        # Culprits first: when the deadline cuts the capture short, their buffers are the ones that matter.
        culprits = set(verdict.ranks)
        order = sorted(ranks, key=lambda r: (r.rank not in culprits, r.rank))
        for rank in order:
            if rank.job_id != verdict.job_id or not (rank.rank in involved or rank.rank in pg_members):
                continue
            if not rank.socket:
                continue
            sock = os.path.join(socket_dir, rank.socket)
            # <prefix><rank>.json: the file naming torch's analyzer and `frexporter analyze` understand.
            for recorder, handler, query in _handlers(rank):
                body = self._fetch(sock, handler, query, deadline)
                if body is None or len(body) > budget:
                    continue
                budget -= len(body)
                fname = f"{recorder}_rank{rank.rank}.json"
                _write_at(bundle_fd, fname, body)
                manifest["files"][fname] = {"rank": rank.rank, "handler": handler, "bytes": len(body)}
            if self.config.stacks and rank.rank in verdict.ranks and "pyspy_dump" in rank.handlers:
                body = self._fetch(sock, "pyspy_dump", "nonblocking=true", deadline)
                if body is not None and len(body) <= budget:
                    budget -= len(body)
                    _write_at(bundle_fd, f"stacks_rank{rank.rank}.txt", body)
                    manifest["files"][f"stacks_rank{rank.rank}.txt"] = {"rank": rank.rank, "bytes": len(body)}
        # Last: a bundle without its verdict.json (the marker) is never mistaken for a finished one of ours.
        _write_at(bundle_fd, VERDICT_FILE, json.dumps(manifest, indent=1, sort_keys=True).encode())

    def _fetch(self, sock: str, handler: str, query: str, deadline: float) -> bytes | None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            self.note(REASON_DEADLINE, f"{sock}: {handler} not read: the capture's {self.config.deadline:g} s "
                                        "are spent")
            return None
        try:
            return worker_client.post(sock, handler, min(self.config.timeout, remaining), query)
        except SourceError as e:
            self.note(e.reason, str(e))
            return None

    def note(self, reason: str, message: str) -> None:
        """Count a capture that failed or was not made; log it, one line per reason per LIMIT_INTERVAL."""
        self.counts.add(reason, message)
        self.logs.log(logging.WARNING, reason, "evidence capture: %s (reason=%s; one line per reason per %.0f s, "
                      "all counted)", message, reason, self.logs.interval)

    def _prune(self, dir_fd: int, directory: str, key: bytes) -> None:
        """Remove our oldest bundles beyond max_bundles; whatever is not verifiably ours stays."""
        ours = []
        try:
            names = os.listdir(dir_fd)
        except OSError as e:
            self.note(REASON_PRUNE, f"cannot list {directory}: {e.strerror or e}")
            return
        for name in names:
            if name.startswith("."):
                continue
            try:
                with _opened_dir(name, dir_fd) as fd:
                    captured = _our_bundle(fd, name, key)
            except OSError:
                continue  # a symlink, a file, or gone: not ours to touch
            if captured is not None:
                ours.append((captured, name))
        ours.sort()
        for _, name in ours[:max(0, len(ours) - self.config.max_bundles)]:
            try:
                with _opened_dir(name, dir_fd) as fd:
                    if _our_bundle(fd, name, key) is not None:  # still the one we verified
                        self._remove(dir_fd, name, fd)
            except OSError as e:
                self.note(REASON_PRUNE, f"cannot remove evidence bundle {name}: {e.strerror or e}")

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


def _handlers(rank: RankState) -> list[tuple[str, str, str]]:
    out = []
    if "fr_trace_json" in rank.handlers:
        out.append((spool.RECORDER_FR, "fr_trace_json", ""))
    if "dump_nccl_trace_json" in rank.handlers:
        out.append((spool.RECORDER_NCCL, "dump_nccl_trace_json", "includecollectives=true&onlyactive=false"))
    return out


# ---------------------------------------------------------------- listing (/api/v1/evidence)


def list_evidence(directory: str) -> list[dict[str, Any]]:
    """The evidence bundles under ``directory``, newest first: name, size, and what their verdict says.

    The directory may sit in the spool, which ranks (other users in group mode) can write: a symlinked or
    foreign directory lists nothing, symlinked bundles and files are passed over, and every verdict.json is
    read bounded and type-checked, a bad one listed with its error. Bundles in this user's private directory
    (made when ``directory`` is writable by others) are listed as ``frexporter-<uid>/<name>``.
    """
    try:
        dir_fd, _ = _open_configured(directory, create=False)
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
            with _opened_dir(name, dir_fd) as fd:
                if not prefix and name == _private_name() and os.fstat(fd).st_uid == os.geteuid():
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
        _, data = _read_at(bundle_fd, VERDICT_FILE, MAX_VERDICT_FILE_BYTES, os.path.join(name, VERDICT_FILE))
        bundle.update(_verdict_summary(spool.parse_json_bytes(data, name)))
    except spool.SpoolError as e:
        bundle["error"] = e.reason
    return bundle


_VERDICT_FIELDS = {"kind": str, "job_id": str, "pg": str, "pg_desc": str, "op": str, "summary": str, "seq": int,
                   "ranks": list, "waiting_ranks": list}


def _verdict_summary(doc: Any) -> dict[str, Any]:
    if not isinstance(doc, dict) or not isinstance(doc.get("verdict"), dict):
        return {"error": "invalid"}
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
