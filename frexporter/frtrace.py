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

from frexporter.spool import RawPGStatus, SpoolError, parse_pg_status

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

    @property
    def op(self) -> str:
        """``gloo:all_reduce`` -> ``all_reduce``; p2p names keep their peers (``send 1->0``)."""
        return self.profiling_name.split(":", 1)[-1]

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
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            return default
    if isinstance(v, float) and v == v:
        return int(v)
    return default


def _sizes(v: Any) -> tuple[tuple[int, ...], ...]:
    if not isinstance(v, (list, tuple)):
        return ()
    out = []
    for shape in v[:64]:
        if isinstance(shape, (list, tuple)):
            out.append(tuple(_int(d) for d in shape[:16]))
    return tuple(out)


def _strs(v: Any) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)):
        return ()
    return tuple(str(x)[:32] for x in v[:64])


def parse_entry(raw: Any) -> FrEntry:
    if not isinstance(raw, dict):
        raise ValueError("entry is not an object")
    pg = raw.get("process_group")
    if isinstance(pg, (list, tuple)) and len(pg) >= 2:
        pg_name, pg_desc = str(pg[0]), str(pg[1])
    else:
        raise ValueError("entry has no process_group")
    timeout = raw.get("timeout_ms")
    duration = raw.get("duration_ms")
    return FrEntry(
        record_id=_int(raw.get("record_id"), -1),
        pg_id=_int(raw.get("pg_id"), -1),
        pg_name=pg_name[:256],
        pg_desc=pg_desc[:256],
        collective_seq_id=_int(raw.get("collective_seq_id")),
        p2p_seq_id=_int(raw.get("p2p_seq_id")),
        op_id=_int(raw.get("op_id")),
        profiling_name=str(raw.get("profiling_name", ""))[:128],
        time_created_ns=_int(raw.get("time_created_ns")),
        state=str(raw.get("state", ""))[:32],
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
    )


def parse_dump(obj: Any, what: str = "FR dump") -> FrDump:
    """Turn a decoded FR dump into typed values; raises SpoolError only if it is not a dump at all."""
    if not isinstance(obj, dict):
        raise SpoolError("invalid", f"{what}: expected an object")
    if "version" not in obj and "pg_status" not in obj and "entries" not in obj:
        raise SpoolError("foreign", f"{what}: not a Flight Recorder dump")
    version = str(obj.get("version", ""))
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
    pg_config = obj.get("pg_config")
    return FrDump(
        version=version,
        pg_status=pg_status,
        entries=tuple(entries),
        pg_config=pg_config if isinstance(pg_config, dict) else {},
        dropped_entries=dropped,
    )
