"""The spool directory: the on-disk contract between the in-rank recorder and the exporter.

One place defines file names, the versioned JSON formats, the size limits and the
validation, so that writer and reader cannot drift. Everything read here comes
from another process and is treated as untrusted: bounded in size, parsed with
``json`` only, every field type-checked.

Per rank (``stem`` = sanitized job id + rank):
  ``<stem>.manifest.json``  identity and process-group table, rewritten when PGs change
  ``<stem>.snapshot.json``  heartbeat + raw ``pg_status``, rewritten every snapshot interval
  ``s<hash>.sock``          torch's C++ worker server (named by hash: unix socket paths are short)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MANIFEST_FORMAT = "frexporter.manifest/1"
SNAPSHOT_FORMAT = "frexporter.snapshot/1"
MANIFEST_SUFFIX = ".manifest.json"
SNAPSHOT_SUFFIX = ".snapshot.json"
SOCKET_SUFFIX = ".sock"
EVIDENCE_DIRNAME = "evidence"  # the exporter's default evidence location inside the spool directory

MAX_MANIFEST_BYTES = 4 * 1024 * 1024
MAX_SNAPSHOT_BYTES = 1024 * 1024
DIR_MODE = 0o700
FILE_MODE = 0o600

# Recorder names as they appear in snapshots: torch keeps one FR ring per kind.
RECORDER_FR = "fr"  # the generic recorder (gloo and others), ``_dump_fr_trace*``
RECORDER_NCCL = "nccl"  # ``_dump_nccl_trace*`` in CUDA builds

_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class SpoolError(Exception):
    """A spool file could not be used; ``reason`` is a bounded label value."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def default_dir() -> str:
    """``$FREXPORTER_DIR``, else a per-user directory under the system temp dir."""
    env = os.environ.get("FREXPORTER_DIR")
    if env:
        return env
    return os.path.join(tempfile.gettempdir(), f"frexporter-{os.getuid()}")


def rank_stem(job_id: str, rank: int) -> str:
    safe = _SAFE.sub("_", job_id)[:64] or "job"
    return f"{safe}.r{rank}"


def socket_name(stem: str) -> str:
    # AF_UNIX paths are limited to about 107 bytes; a short hash keeps deep spool paths usable.
    return "s" + hashlib.sha1(stem.encode()).hexdigest()[:12] + SOCKET_SUFFIX


def ensure_dir(path: str) -> None:
    """Create the spool directory private to this user (0700)."""
    os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    st = os.stat(path)
    if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)


def write_json_atomic(path: str, payload: Mapping[str, Any]) -> None:
    """Write-then-rename so a reader never sees a half-written file; mode 0600."""
    data = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_json_file(path: str, max_bytes: int) -> Any:
    """Read a bounded JSON file, mapping every failure to a SpoolError with a reason."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError as e:
        raise SpoolError("missing", f"{path}: vanished while reading") from e
    except PermissionError as e:
        raise SpoolError("permission", f"{path}: permission denied") from e
    except IsADirectoryError as e:
        raise SpoolError("foreign", f"{path}: is a directory") from e
    except OSError as e:
        raise SpoolError("io", f"{path}: {e.strerror or e}") from e
    if len(data) > max_bytes:
        raise SpoolError("oversized", f"{path}: larger than the {max_bytes} byte limit")
    if not data:
        raise SpoolError("truncated", f"{path}: empty file")
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        reason = "truncated" if data.lstrip()[:1] in (b"{", b"[") else "corrupt"
        raise SpoolError(reason, f"{path}: not valid JSON ({e})") from e


# ---------------------------------------------------------------- typed views


@dataclass(frozen=True)
class PGEntry:
    """One process group as the rank sees it; ``name`` + ``ranks`` is the cross-rank identity."""

    name: str
    desc: str
    ranks: tuple[int, ...]
    backend: str
    local_ids: Mapping[str, int] = field(default_factory=dict)  # recorder -> predicted local pg id
    timeout_seconds: float | None = None


@dataclass(frozen=True)
class Manifest:
    job_id: str
    rank: int
    local_rank: int
    world_size: int
    pid: int
    hostname: str
    start_time: float
    torch_version: str
    backends: tuple[str, ...]
    gpu_uuid: str
    socket: str  # file name inside the spool directory, "" when the worker server is off
    handlers: tuple[str, ...]
    recorders: tuple[str, ...]
    fr_buffer_size: int
    process_groups: tuple[PGEntry, ...]
    generation: int


@dataclass(frozen=True)
class RawPGStatus:
    """``pg_status`` of one local pg id, in torch's own (mixed) sequence domain."""

    enqueued: int
    started: int
    completed: int


@dataclass(frozen=True)
class Snapshot:
    pid: int
    time: float
    interval: float
    counter: int
    status: Mapping[str, Mapping[int, RawPGStatus]]  # recorder -> local pg id -> status
    errors: Mapping[str, int]
    state: str  # "running", "exiting", "stopped"
    message: str


class _Fields:
    """Typed access to an untrusted JSON object; every miss is a SpoolError('invalid')."""

    def __init__(self, obj: Any, what: str) -> None:
        if not isinstance(obj, dict):
            raise SpoolError("invalid", f"{what}: expected an object, got {type(obj).__name__}")
        self.obj = obj
        self.what = what

    def _get(self, key: str, types: tuple[type, ...], default: Any) -> Any:
        if key not in self.obj:
            if default is _REQUIRED:
                raise SpoolError("invalid", f"{self.what}: missing field {key!r}")
            return default
        value = self.obj[key]
        # bool is an int subclass; a manifest that says rank=true is malformed.
        if isinstance(value, bool) and bool not in types:
            raise SpoolError("invalid", f"{self.what}: field {key!r} has the wrong type")
        if not isinstance(value, types):
            raise SpoolError("invalid", f"{self.what}: field {key!r} has the wrong type")
        return value

    def str(self, key: str, default: Any = None) -> str:
        return self._get(key, (str,), _REQUIRED if default is None else default)

    def int(self, key: str, default: Any = None) -> int:
        return self._get(key, (int,), _REQUIRED if default is None else default)

    def num(self, key: str, default: Any = None) -> float:
        return float(self._get(key, (int, float), _REQUIRED if default is None else default))

    def list(self, key: str, default: Any = None) -> list[Any]:
        return self._get(key, (list,), _REQUIRED if default is None else default)

    def dict(self, key: str, default: Any = None) -> dict[str, Any]:
        return self._get(key, (dict,), _REQUIRED if default is None else default)


_REQUIRED = object()


def _check_format(obj: Any, expected: str, what: str) -> None:
    fmt = obj.get("format") if isinstance(obj, dict) else None
    if not isinstance(fmt, str) or not fmt.startswith("frexporter."):
        raise SpoolError("foreign", f"{what}: not a frexporter file")
    if fmt != expected:
        raise SpoolError("unknown_version", f"{what}: format {fmt!r} is not supported (want {expected!r})")


def parse_manifest(obj: Any, what: str = "manifest") -> Manifest:
    _check_format(obj, MANIFEST_FORMAT, what)
    f = _Fields(obj, what)
    pgs = []
    for i, raw in enumerate(f.list("process_groups", [])[:4096]):
        p = _Fields(raw, f"{what}: process_groups[{i}]")
        ranks = p.list("ranks")
        if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
            raise SpoolError("invalid", f"{what}: process_groups[{i}].ranks must be non-negative integers")
        local_ids = {}
        for k, v in p.dict("local_ids", {}).items():
            if isinstance(v, int) and not isinstance(v, bool):
                local_ids[str(k)] = v
        timeout = p.obj.get("timeout_seconds")
        pgs.append(
            PGEntry(
                name=p.str("name"),
                desc=p.str("desc", ""),
                ranks=tuple(sorted(ranks)),
                backend=p.str("backend", ""),
                local_ids=local_ids,
                timeout_seconds=float(timeout) if isinstance(timeout, (int, float)) and timeout > 0 else None,
            )
        )
    rank = f.int("rank")
    if rank < 0:
        raise SpoolError("invalid", f"{what}: rank must be >= 0")
    return Manifest(
        job_id=f.str("job_id"),
        rank=rank,
        local_rank=f.int("local_rank", -1),
        world_size=f.int("world_size", 0),
        pid=f.int("pid"),
        hostname=f.str("hostname", ""),
        start_time=f.num("start_time", 0.0),
        torch_version=f.str("torch_version", ""),
        backends=tuple(str(b) for b in f.list("backends", [])),
        gpu_uuid=f.str("gpu_uuid", ""),
        socket=os.path.basename(f.str("socket", "")),
        handlers=tuple(str(h) for h in f.list("handlers", [])),
        recorders=tuple(str(r) for r in f.list("recorders", [])),
        fr_buffer_size=f.int("fr_buffer_size", 0),
        process_groups=tuple(pgs),
        generation=f.int("generation", 0),
    )


def parse_pg_status(raw: Any, what: str) -> dict[int, RawPGStatus]:
    """torch's ``pg_status``: ints in pickle dumps, strings in JSON dumps; accept both."""
    if not isinstance(raw, dict):
        raise SpoolError("invalid", f"{what}: pg_status must be an object")
    out: dict[int, RawPGStatus] = {}
    for key, val in raw.items():
        try:
            pg_id = int(key)
            if not isinstance(val, dict):
                raise TypeError
            out[pg_id] = RawPGStatus(
                enqueued=int(val.get("last_enqueued_collective", -1)),
                started=int(val.get("last_started_collective", -1)),
                completed=int(val.get("last_completed_collective", -1)),
            )
        except (TypeError, ValueError) as e:
            raise SpoolError("invalid", f"{what}: pg_status[{key!r}] is malformed") from e
    return out


def parse_snapshot(obj: Any, what: str = "snapshot") -> Snapshot:
    _check_format(obj, SNAPSHOT_FORMAT, what)
    f = _Fields(obj, what)
    status = {
        str(recorder): parse_pg_status(raw, f"{what}: status.{recorder}")
        for recorder, raw in f.dict("status", {}).items()
    }
    errors = {
        str(k)[:64]: v
        for k, v in f.dict("errors", {}).items()
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0
    }
    return Snapshot(
        pid=f.int("pid"),
        time=f.num("time"),
        interval=max(0.05, f.num("interval", 1.0)),
        counter=f.int("counter", 0),
        status=status,
        errors=errors,
        state=f.str("state", "running"),
        message=f.str("message", "")[:500],
    )
