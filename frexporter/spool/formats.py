"""The versioned JSON formats as typed views, and their parsers (every field of untrusted data checked)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from frexporter import reasons, safetext
from frexporter.model import MANIFEST_STATES, STATE_RUNNING, Members
from frexporter.spool.layout import INT_MAX, INT_MIN, MANIFEST_FORMAT, SNAPSHOT_FORMAT, SNAPSHOT_MAP_FORMAT, SpoolError
from frexporter.spool.limits import (
    MAX_ERROR_KIND_CHARS,
    MAX_ERROR_KINDS,
    MAX_LAUNCHER_FIELDS,
    MAX_MANIFEST_MEMBERS,
    MAX_MESSAGE_CHARS,
    MAX_NAMES,
    MAX_PG_MEMBERS,
    MAX_PGS,
    MAX_RANK,
    MAX_RECORDERS,
    MAX_SNAPSHOT_BYTES,
    MAX_TEXT_CHARS,
)
from frexporter.spool.snapshot_fields import parse_gpu_wait, parse_stack

# ---------------------------------------------------------------- typed views


@dataclass(frozen=True)
class PGEntry:
    """One process group as the rank sees it; ``name`` + ``ranks`` is the cross-rank identity."""

    name: str
    desc: str
    ranks: Members | tuple[int, ...]
    backend: str
    local_ids: Mapping[str, int] = field(default_factory=dict)  # recorder -> predicted local pg id
    timeout_seconds: float | None = None


@dataclass(frozen=True)
class Launcher:
    """What the launcher (torchrun/torchelastic, SLURM) told a rank; -1 or "" where it said nothing usable."""

    rank: int = -1
    local_rank: int = -1
    world_size: int = -1
    local_world_size: int = -1
    node_rank: int = -1  # torchrun's GROUP_RANK, SLURM's SLURM_NODEID
    run_id: str = ""  # TORCHELASTIC_RUN_ID or SLURM_JOB_ID
    kind: str = ""  # "torchelastic", "slurm"

    def node_ranks(self) -> tuple[int, ...]:
        """The global ranks the launcher started on this rank's node, () when it did not say enough.

        torchrun and SLURM's block distribution number a node's ranks contiguously, so a rank's node holds
        ``rank - local_rank`` up to ``local_world_size`` ranks on; with no rank, ``node_rank`` stands in."""
        if self.local_world_size <= 0:
            return ()
        if self.rank >= 0 and 0 <= self.local_rank < self.local_world_size:
            base = self.rank - self.local_rank
        elif self.node_rank >= 0:
            base = self.node_rank * self.local_world_size
        else:
            return ()
        top = base + self.local_world_size
        if self.world_size > 0:
            top = min(top, self.world_size)
        return tuple(range(base, top))


_LAUNCHER_INTS = ("rank", "local_rank", "world_size", "local_world_size", "node_rank")
_LAUNCHER_TEXTS = ("run_id", "kind")


def parse_launcher(raw: Any, what: str) -> tuple[Launcher | None, tuple[tuple[str, str], ...]]:
    """A manifest's ``launcher`` map, leniently: each bad field is dropped and reported as (reason, message),
    never failing the manifest (a launcher's facts must not cost a rank its other metrics)."""
    if raw is None:
        return None, ()
    if not isinstance(raw, dict):
        return None, ((reasons.LAUNCHER_INVALID, f"{what}: launcher is not an object; dropped"),)
    if len(raw) > MAX_LAUNCHER_FIELDS:
        return None, ((reasons.LIMIT_ITEMS, f"{what}: launcher has {len(raw)} fields, over the bound of "
                                            f"{MAX_LAUNCHER_FIELDS}; dropped"),)
    problems: list[tuple[str, str]] = []
    values: dict[str, Any] = {}
    for key in _LAUNCHER_INTS:
        if key not in raw:
            continue
        value = raw[key]
        if type(value) is not int or not 0 <= value <= MAX_RANK:
            problems.append((reasons.LAUNCHER_INVALID, f"{what}: launcher.{key} is not an integer from 0 to "
                                                       f"{MAX_RANK}; dropped"))
            continue
        values[key] = value
    for key in _LAUNCHER_TEXTS:
        if key not in raw:
            continue
        value = raw[key]
        if not isinstance(value, str):
            problems.append((reasons.LAUNCHER_INVALID, f"{what}: launcher.{key} is not a string; dropped"))
        elif len(value) > MAX_TEXT_CHARS:
            problems.append((reasons.LIMIT_TEXT, f"{what}: launcher.{key} is {len(value)} characters long, over the "
                                                 f"bound of {MAX_TEXT_CHARS}; dropped"))
        elif not safetext.is_valid(value):
            problems.append((reasons.LAUNCHER_INVALID, f"{what}: launcher.{key} is not UTF-8; dropped"))
        else:
            values[key] = value
    return Launcher(**values), tuple(problems)


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
    # Optional since the launcher facts (older recorders write neither): older manifests read as running.
    state: str = STATE_RUNNING
    launcher: Launcher | None = None
    # (reason, message) per field dropped (launcher fields) or repaired (text that was not valid Unicode)
    problems: tuple[tuple[str, str], ...] = ()

    @property
    def members_total(self) -> int:
        """Members over all of its process groups (what torch's pg_config spells out in a dump)."""
        return sum(len(pg.ranks) for pg in self.process_groups)


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
    state: str  # model.STATE_*: what the rank says of itself (exiting, stopped: its last words)
    message: str
    # The process's CPU seconds so far, and its training thread's stack, innermost first, as
    # (function, file, line); None / () where the snapshot did not carry them (older recorders) or they
    # were dropped as malformed (``problems``).
    cpu: float | None = None
    stack: tuple[tuple[str, str, int], ...] = ()
    # (CUDA device index as the rank numbers them, seconds) while the recorder found that stack standing still
    # with work pending on the rank's GPU (recorder/cuda_probe.py); None otherwise.
    gpu_wait: tuple[int, float] | None = None
    problems: tuple[tuple[str, str], ...] = ()  # (reason, message) of each optional field dropped


class _Fields:
    """Typed access to an untrusted JSON object; every miss is a SpoolError(reasons.INVALID), every string and
    list past its bound a SpoolError with one of reasons.LIMIT_REASONS."""

    def __init__(self, obj: Any, what: str, problems: list[tuple[str, str]] | None = None) -> None:
        if not isinstance(obj, dict):
            raise SpoolError(reasons.INVALID, f"{what}: expected an object, got {type(obj).__name__}")
        self.obj = obj
        self.what = what
        # (TEXT_REPAIRED, message) per string repaired; shared by the views of one file
        self.problems: list[tuple[str, str]] = [] if problems is None else problems

    def text(self, value: str, limit: int, what: str) -> str:
        """``value`` within its bound, lone surrogates repaired (and reported)."""
        return _repaired(_bounded_text(value, limit, what), what, self.problems)

    def _get(self, key: str, types: tuple[type, ...], default: Any) -> Any:
        if key not in self.obj:
            if default is _REQUIRED:
                raise SpoolError(reasons.INVALID, f"{self.what}: missing field {key!r}")
            return default
        value = self.obj[key]
        # bool is an int subclass; a manifest that says rank=true is malformed.
        if isinstance(value, bool) and bool not in types:
            raise SpoolError(reasons.INVALID, f"{self.what}: field {key!r} has the wrong type")
        if not isinstance(value, types):
            raise SpoolError(reasons.INVALID, f"{self.what}: field {key!r} has the wrong type")
        return value

    def text_field(self, key: str, default: Any = None, limit: int = MAX_TEXT_CHARS) -> str:
        return self.text(self._get(key, (str,), _REQUIRED if default is None else default), limit,
                         f"{self.what}: field {key!r}")

    def int_field(self, key: str, default: Any = None) -> int:
        value = self._get(key, (int,), _REQUIRED if default is None else default)
        if not INT_MIN <= value <= INT_MAX:
            raise SpoolError(reasons.INVALID, f"{self.what}: field {key!r} is out of range")
        return value

    def num(self, key: str, default: Any = None) -> float:
        value = _finite(self._get(key, (int, float), _REQUIRED if default is None else default))
        if value is None:
            raise SpoolError(reasons.INVALID, f"{self.what}: field {key!r} is not a finite number")
        return value

    def list_field(self, key: str, default: Any = None, limit: int | None = None) -> list[Any]:
        value = self._get(key, (list,), _REQUIRED if default is None else default)
        if limit is not None and len(value) > limit:
            raise SpoolError(reasons.LIMIT_ITEMS, f"{self.what}: field {key!r} has {len(value)} items, over the "
                                                  f"bound of {limit}")
        return value

    def dict_field(self, key: str, default: Any = None, limit: int | None = None) -> dict[str, Any]:
        value = self._get(key, (dict,), _REQUIRED if default is None else default)
        if limit is not None and len(value) > limit:
            raise SpoolError(reasons.LIMIT_ITEMS, f"{self.what}: field {key!r} has {len(value)} entries, over the "
                                                  f"bound of {limit}")
        return value

    def names(self, key: str) -> tuple[str, ...]:
        """A list of short strings (handlers, recorders, backends)."""
        out = []
        for i, name in enumerate(self.list_field(key, [], limit=MAX_NAMES)):
            if not isinstance(name, str):
                raise SpoolError(reasons.INVALID, f"{self.what}: {key}[{i}] is not a string")
            out.append(self.text(name, MAX_TEXT_CHARS, f"{self.what}: {key}[{i}]"))
        return tuple(out)


def _bounded_text(value: str, limit: int, what: str) -> str:
    if len(value) > limit:
        raise SpoolError(reasons.LIMIT_TEXT, f"{what} is {len(value)} characters long, over the bound of {limit}")
    return value


def _repaired(value: str, what: str, problems: list[tuple[str, str]]) -> str:
    if safetext.is_valid(value):
        return value
    problems.append((reasons.TEXT_REPAIRED,
                     f"{what} is not valid UTF-8; its undecodable characters are shown as U+FFFD"))
    return safetext.repair(value)


_REQUIRED = object()


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or None (JSON admits NaN, Infinity and ints too big for a float)."""
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return out if math.isfinite(out) else None


def _show(value: Any) -> str:
    """A key of untrusted data for a message: repr() of a pickled bignum raises, of a container can be huge."""
    if isinstance(value, str):
        return repr(value[:64])
    if isinstance(value, int) and INT_MIN <= value <= INT_MAX:
        return repr(value)
    return f"<{type(value).__name__}>"


def _int64(value: Any) -> int:
    """A counter of torch's (an int, or a string of one in JSON dumps) that fits in 64 bits."""
    out = int(value)
    if not INT_MIN <= out <= INT_MAX:
        raise ValueError("out of the 64-bit range")
    return out


def _check_format(obj: Any, expected: str, what: str) -> None:
    fmt = obj.get("format") if isinstance(obj, dict) else None
    if not isinstance(fmt, str) or not fmt.startswith("frexporter."):
        raise SpoolError(reasons.FOREIGN, f"{what}: not a frexporter file")
    if fmt != expected:
        raise SpoolError(reasons.UNKNOWN_VERSION, f"{what}: format {fmt[:64]!r} is not supported (want {expected!r})")


def parse_manifest(obj: Any, what: str = "manifest") -> Manifest:
    _check_format(obj, MANIFEST_FORMAT, what)
    f = _Fields(obj, what)
    raw_pgs = f.list_field("process_groups", [], limit=MAX_PGS)
    total = 0
    for i, raw in enumerate(raw_pgs):
        # Counted before any list is parsed: a file over the bound costs no more than reading it.
        ranks = raw.get("ranks") if isinstance(raw, dict) else None
        if isinstance(ranks, list):
            if len(ranks) > MAX_PG_MEMBERS:
                raise SpoolError(reasons.LIMIT_MEMBERS, f"{what}: process_groups[{i}] lists {len(ranks)} members, "
                                                        f"over the bound of {MAX_PG_MEMBERS}")
            total += len(ranks)
    if total > MAX_MANIFEST_MEMBERS:
        raise SpoolError(reasons.LIMIT_MEMBERS, f"{what}: its process groups list {total} members in all, over the "
                                                f"bound of {MAX_MANIFEST_MEMBERS}")
    pgs = [_parse_pg(raw, f"{what}: process_groups[{i}]", f.problems) for i, raw in enumerate(raw_pgs)]
    rank = f.int_field("rank")
    if rank < 0:
        raise SpoolError(reasons.INVALID, f"{what}: rank must be >= 0")
    state = f.text_field("state", STATE_RUNNING)
    if state not in MANIFEST_STATES:
        raise SpoolError(reasons.INVALID, f"{what}: state {state[:32]!r} is not one of {', '.join(MANIFEST_STATES)}")
    launcher, launcher_problems = parse_launcher(obj.get("launcher"), what)
    return Manifest(
        job_id=f.text_field("job_id"),
        rank=rank,
        local_rank=f.int_field("local_rank", -1),
        world_size=f.int_field("world_size", 0),
        pid=f.int_field("pid"),
        hostname=f.text_field("hostname", ""),
        start_time=f.num("start_time", 0.0),
        torch_version=f.text_field("torch_version", ""),
        backends=f.names("backends"),
        gpu_uuid=f.text_field("gpu_uuid", ""),
        socket=os.path.basename(f.text_field("socket", "")),
        handlers=f.names("handlers"),
        recorders=f.names("recorders"),
        fr_buffer_size=f.int_field("fr_buffer_size", 0),
        process_groups=tuple(pgs),
        generation=f.int_field("generation", 0),
        state=state,
        launcher=launcher,
        problems=launcher_problems + tuple(f.problems),  # last: the fields above add their repairs
    )


def _parse_pg(raw: Any, what: str, problems: list[tuple[str, str]]) -> PGEntry:
    p = _Fields(raw, what, problems)
    ranks = p.list_field("ranks")
    # type() rather than isinstance(): bool is an int subclass, and rank true is no rank.
    if not set(map(type, ranks)) <= {int}:
        raise SpoolError(reasons.INVALID, f"{what}.ranks must be non-negative integers")
    try:
        members = Members.of(ranks)
    except OverflowError as e:
        raise SpoolError(reasons.INVALID, f"{what}.ranks must be integers from 0 to {MAX_RANK}") from e
    local_ids = {}
    for k, v in p.dict_field("local_ids", {}, limit=MAX_NAMES).items():
        if isinstance(v, int) and not isinstance(v, bool):
            local_ids[p.text(k, MAX_TEXT_CHARS, f"{what}.local_ids key")] = v
    raw_timeout = p.obj.get("timeout_seconds")
    timeout = _finite(raw_timeout) if isinstance(raw_timeout, (int, float)) else None
    return PGEntry(
        name=p.text_field("name"),
        desc=p.text_field("desc", ""),
        ranks=members,
        backend=p.text_field("backend", ""),
        local_ids=local_ids,
        timeout_seconds=timeout if timeout is not None and timeout > 0 else None,
    )


def parse_pg_status(raw: Any, what: str) -> dict[int, RawPGStatus]:
    """torch's ``pg_status``: ints in pickle dumps, strings in JSON dumps; accept both."""
    if not isinstance(raw, dict):
        raise SpoolError(reasons.INVALID, f"{what}: pg_status must be an object")
    if len(raw) > MAX_PGS:
        raise SpoolError(reasons.LIMIT_ITEMS, f"{what}: pg_status has {len(raw)} entries, over the bound of {MAX_PGS}")
    out: dict[int, RawPGStatus] = {}
    for key, val in raw.items():
        try:
            pg_id = _int64(key)
            if not isinstance(val, dict):
                raise TypeError
            out[pg_id] = RawPGStatus(
                enqueued=_int64(val.get("last_enqueued_collective", -1)),
                started=_int64(val.get("last_started_collective", -1)),
                completed=_int64(val.get("last_completed_collective", -1)),
            )
        except (TypeError, ValueError, OverflowError) as e:
            raise SpoolError(reasons.INVALID, f"{what}: pg_status[{_show(key)}] is malformed") from e
    return out


def parse_snapshot(obj: Any, what: str = "snapshot") -> Snapshot:
    fmt = obj.get("format") if isinstance(obj, dict) else None
    mapped = fmt == SNAPSHOT_MAP_FORMAT
    _check_format(obj, SNAPSHOT_MAP_FORMAT if mapped else SNAPSHOT_FORMAT, what)
    f = _Fields(obj, what)
    status = {}
    for recorder, raw in f.dict_field("status", {}, limit=MAX_RECORDERS).items():
        recorder = f.text(recorder, MAX_TEXT_CHARS, f"{what}: recorder name")
        if mapped:  # torch's whole answer; its pg_status is what we use
            raw = _Fields(raw, f"{what}: status.{recorder}").dict_field("pg_status", {})
        status[recorder] = parse_pg_status(raw, f"{what}: status.{recorder}")
    errors = {}
    for kind, count in f.dict_field("errors", {}, limit=MAX_ERROR_KINDS).items():
        # A label value: cutting it could merge two kinds.
        kind = f.text(kind, MAX_ERROR_KIND_CHARS, f"{what}: error kind")
        if isinstance(count, int) and not isinstance(count, bool) and 0 <= count <= INT_MAX:
            errors[kind] = count
    problems = f.problems
    cpu = obj.get("cpu")
    if cpu is not None:
        cpu = _finite(cpu) if not isinstance(cpu, bool | str) else None
        if cpu is None or cpu < 0:
            problems.append((reasons.SNAPSHOT_FIELD_INVALID, f"{what}: cpu is not a non-negative number; dropped"))
            cpu = None
    stack, stack_problems = parse_stack(obj.get("stack"), what)
    problems.extend(stack_problems)
    gpu_wait, gpu_problems = parse_gpu_wait(obj.get("gpu_wait"), what)
    problems.extend(gpu_problems)
    return Snapshot(
        pid=f.int_field("pid"),
        time=f.num("time"),
        interval=max(0.05, f.num("interval", 1.0)),
        counter=f.int_field("counter", 0),
        status=status,
        errors=errors,
        state=f.text_field("state", STATE_RUNNING),
        message=f.text_field("message", "", limit=MAX_SNAPSHOT_BYTES)[:MAX_MESSAGE_CHARS],
        cpu=cpu,
        stack=stack,
        gpu_wait=gpu_wait,
        problems=tuple(problems),
    )
