"""Parser for torch Flight Recorder dumps (the JSON handlers, or a pickle decoded safely).

Accepts every FR format torch 2.5 to 2.13 writes ("2.4" to "2.10") and tolerates
unknown keys; an entry that is malformed is dropped and counted, never raised.
The differences between JSON and pickle dumps (string vs int ``pg_status``, 0 vs
None for unset times, list vs tuple ``process_group``, an absent ``entries`` key)
are absorbed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from frexporter.spool import INT_MAX, INT_MIN, RawPGStatus, SpoolError, parse_pg_status

MAX_ENTRIES = 100_000


@dataclass(frozen=True)
class FrEntry:
    record_id: int
    pg_id: int
    pg_name: str
    pg_desc: str
    collective_seq_id: int
    p2p_seq_id: int
    op_id: int
    profiling_name: str
    time_created_ns: int
    state: str
    retired: bool
    timeout_ms: int | None
    is_p2p: bool
    duration_ms: float | None
    input_sizes: tuple[tuple[int, ...], ...]
    output_sizes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]
    output_dtypes: tuple[str, ...]
    # When a CPU thread first saw the start event done; 0 when unset (always for gloo, and NCCL without timing).
    time_discovered_started_ns: int = 0

    @property
    def op(self) -> str:
        """``gloo:all_reduce`` -> ``all_reduce``; p2p names keep their peers (``send 1->0``). The op never
        holds a colon, a backend name may (``weird:backend:all_reduce``)."""
        return self.profiling_name.rsplit(":", 1)[-1]

    @property
    def done(self) -> bool:
        # NCCL marks completion in ``state``; gloo only retires (a timed-out gloo op is retired too).
        return self.state == "completed" or self.retired


@dataclass(frozen=True)
class FrDump:
    version: str
    pg_status: dict[int, RawPGStatus]
    entries: tuple[FrEntry, ...]
    pg_config: dict[str, dict[str, Any]]
    dropped_entries: int


def _int(v: Any, default: int = 0) -> int:
    """torch's 64-bit counters and times; anything else (NaN, inf, a pickled bignum) is the default."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, str):
        try:
            v = int(v)
        except ValueError:
            return default
    elif isinstance(v, float) and v == v and abs(v) < 2.0**63:
        v = int(v)
    if isinstance(v, int) and INT_MIN <= v <= INT_MAX:
        return v
    return default


def _text(v: Any, limit: int) -> str:
    """A scalar as bounded text. Containers are refused: a pickle can share one list under itself
    many times, and ``str()`` of such a DAG is exponential in the file size."""
    if isinstance(v, str):
        return v[:limit]
    if v is None or isinstance(v, (bool, float)) or (isinstance(v, int) and INT_MIN <= v <= INT_MAX):
        return str(v)[:limit]
    raise ValueError(f"expected text, got {type(v).__name__}")


def _sizes(v: Any) -> tuple[tuple[int, ...], ...]:
    if not isinstance(v, (list, tuple)):
        return ()
    out = []
    for shape in v[:64]:
        if isinstance(shape, (list, tuple)):
            out.append(tuple(_int(d) for d in shape[:16]))
    return tuple(out)


def _strs(v: Any) -> tuple[str, ...]:
    if isinstance(v, str):  # one dtype written as a plain string (hand-made dumps, torch's own analyzer tests)
        return (v[:32],) if v else ()
    if not isinstance(v, (list, tuple)):
        return ()
    return tuple(_text(x, 32) for x in v[:64])


def parse_entry(raw: Any) -> FrEntry:
    if not isinstance(raw, dict):
        raise ValueError("entry is not an object")
    pg = raw.get("process_group")
    if isinstance(pg, (list, tuple)) and len(pg) >= 2:
        pg_name, pg_desc = _text(pg[0], 256), _text(pg[1], 256)
    else:
        raise ValueError("entry has no process_group")
    timeout = raw.get("timeout_ms")
    duration = raw.get("duration_ms")
    return FrEntry(
        record_id=_int(raw.get("record_id"), -1),
        pg_id=_int(raw.get("pg_id"), -1),
        pg_name=pg_name,
        pg_desc=pg_desc,
        collective_seq_id=_int(raw.get("collective_seq_id")),
        p2p_seq_id=_int(raw.get("p2p_seq_id")),
        op_id=_int(raw.get("op_id")),
        profiling_name=_text(raw.get("profiling_name", ""), 128),
        time_created_ns=_int(raw.get("time_created_ns")),
        state=_text(raw.get("state", ""), 32),
        retired=bool(raw.get("retired", False)),
        timeout_ms=_int(timeout) if isinstance(timeout, (int, float, str)) and not isinstance(timeout, bool)
        else None,
        is_p2p=bool(raw.get("is_p2p", False)),
        duration_ms=float(duration) if isinstance(duration, (int, float)) and not isinstance(duration, bool)
        else None,
        input_sizes=_sizes(raw.get("input_sizes")),
        output_sizes=_sizes(raw.get("output_sizes")),
        input_dtypes=_strs(raw.get("input_dtypes")),
        output_dtypes=_strs(raw.get("output_dtypes")),
        time_discovered_started_ns=max(0, _int(raw.get("time_discovered_started_ns"))),
    )


def parse_dump(obj: Any, what: str = "FR dump") -> FrDump:
    """Turn a decoded FR dump into typed values; raises SpoolError only if it is not a dump at all."""
    if not isinstance(obj, dict):
        raise SpoolError("invalid", f"{what}: expected an object")
    if "version" not in obj and "pg_status" not in obj and "entries" not in obj:
        raise SpoolError("foreign", f"{what}: not a Flight Recorder dump")
    try:
        version = _text(obj.get("version", ""), 32)
    except ValueError:
        version = ""
    pg_status = parse_pg_status(obj.get("pg_status", {}), what) if "pg_status" in obj else {}
    raw_entries = obj.get("entries") or []
    if not isinstance(raw_entries, (list, tuple)):
        raise SpoolError("invalid", f"{what}: entries must be a list")
    entries = []
    dropped = 0
    for raw in raw_entries[:MAX_ENTRIES]:
        try:
            entries.append(parse_entry(raw))
        except (ValueError, TypeError, OverflowError):
            dropped += 1
    dropped += max(0, len(raw_entries) - MAX_ENTRIES)
    return FrDump(
        version=version,
        pg_status=pg_status,
        entries=tuple(entries),
        pg_config=_pg_config(obj.get("pg_config")),
        dropped_entries=dropped,
    )


def _pg_config(raw: Any) -> dict[str, dict[str, Any]]:
    """``{name: {"name", "desc", "ranks": "<str of list>"}}`` with scalar values only, so that later
    ``str()`` or ``json.loads`` of a value costs no more than its size."""
    if not isinstance(raw, dict):
        return {}
    out: dict[str, dict[str, Any]] = {}
    for name, cfg in list(raw.items())[:MAX_ENTRIES]:
        if not isinstance(name, str) or not isinstance(cfg, dict):
            continue
        clean = {}
        for key, value in list(cfg.items())[:16]:
            try:
                clean[_text(key, 64)] = value if isinstance(value, str) else _text(value, 64)
            except ValueError:
                continue
        out[name[:256]] = clean
    return out
