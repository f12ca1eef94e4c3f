"""Parser for torch Flight Recorder dumps (the JSON handlers, or a pickle decoded safely).

Accepts every FR format torch 2.5 to 2.13 writes ("2.4" to "2.10") and tolerates
unknown keys; an entry that is malformed is dropped and counted, never raised.
The differences between JSON and pickle dumps (string vs int ``pg_status``, 0 vs
None for unset times, list vs tuple ``process_group``, an absent ``entries`` key)
are absorbed here.

A dump past one of the bounds below is refused whole (SpoolError with one of
``reasons.LIMIT_REASONS``), never cut short: the entries past a cut would be the
newest, the ones in flight, and a PG name cut short could be another PG's.
"""

from __future__ import annotations

import json
import traceback
from dataclasses import dataclass
from typing import Any

from frexporter import reasons, safetext
from frexporter.spool import (
    INT_MAX,
    INT_MIN,
    MAX_PGS,
    MAX_TEXT_CHARS,
    RawPGStatus,
    SpoolError,
    parse_pg_status,
)

MAX_ENTRIES = 100_000  # entries of one dump: torch's ring holds TORCH_FR_BUFFER_SIZE of them (2000 by default)
MAX_ENTRY_TENSORS = 1024  # shapes, and dtypes, in one entry's input or output list (a coalesced collective's)
MAX_TENSOR_DIMS = 32  # dimensions of one shape
# Dimensions, shapes and dtypes over all entries of one dump. A pickle can hand every entry the same big list
# for two bytes each (a memo reference); without this bound the parsed dump would be that list's size times
# the number of entries. A full 100,000-entry ring of collectives on one 2-D tensor each spends 800,000.
MAX_SIZE_VALUES = 1 << 20
MAX_OP_CHARS = 128  # profiling_name, e.g. "nccl:all_reduce" or "gloo:send 0->1"
MAX_WORD_CHARS = 32  # state, dtype, version
MAX_CONFIG_KEY_CHARS = 64  # keys of a pg_config entry
MAX_CONFIG_VALUES = 16  # keys of a pg_config entry
# Text over all of pg_config; its "ranks" values list every member as text (about 1 MB for 131,072 ranks).
MAX_CONFIG_CHARS = 1 << 24

# A rank's answer to a deep read is bounded before it is parsed, by what the ring its manifest declares can
# hold: json.loads of 60 MB of ``{},`` builds 20 million objects (12 GB) before MAX_ENTRIES could refuse them.
ANSWER_ASSUMED_RING = 2000  # torch's default ring size, for a manifest that does not state its own
# A real gloo entry is about 480 bytes of JSON and opens 8 objects and lists (one tensor in, one out).
ANSWER_BYTES_PER_ENTRY = 4096
ANSWER_CONTAINERS_PER_ENTRY = 16
# Coalesced collectives list a shape per tensor: room for 64 of them with 1024 tensors in and out.
ANSWER_SHAPE_LISTS = 1 << 17
ANSWER_BYTES_PER_SHAPE = 16  # "[1024, 4096], "
ANSWER_BYTES_PER_MEMBER = 8  # "131071, " in pg_config's "ranks" text
ANSWER_BASE_BYTES = 1 << 20  # pg_status, pg_config's other fields, versions
ANSWER_BASE_CONTAINERS = 4 * MAX_PGS  # pg_status and pg_config objects
ANSWER_MAX_BYTES = 64 * 1024 * 1024  # whatever the manifest claims


@dataclass(frozen=True, slots=True)  # slots: a full ring is 100,000 of these
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
    # When a CPU thread (NCCL's watchdog) first saw the entry complete; 0 when unset (always for gloo).
    time_discovered_completed_ns: int = 0

    @property
    def op(self) -> str:
        """``gloo:all_reduce`` -> ``all_reduce``; p2p names keep their peers (``send 1->0``). The op never
        holds a colon, a backend name may (``weird:backend:all_reduce``)."""
        return self.profiling_name.rsplit(":", 1)[-1]

    @property
    def backend(self) -> str:
        """The backend that recorded it, as ``profiling_name`` names it before the op: ``nccl``, ``gloo``, torch
        2.15's ``nccl2``; "" where it names none."""
        head, colon, _ = self.profiling_name.rpartition(":")
        return head if colon else ""

    @property
    def done(self) -> bool:
        # NCCL marks completion in ``state``; gloo only retires (a timed-out gloo op is retired too), and so do
        # the backends torch 2.15's FlightRecorderHook records without a completion hook: retired as soon as
        # issued, never "completed", no duration.
        return self.state == "completed" or self.retired


@dataclass(frozen=True)
class FrDump:
    version: str
    pg_status: dict[int, RawPGStatus]
    entries: tuple[FrEntry, ...]
    pg_config: dict[str, dict[str, Any]]
    dropped_entries: int
    # Strings that held lone surrogates (not valid UTF-8), kept with U+FFFD in their place
    repaired_text: int = 0


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


def _text(v: Any, limit: int, budget: _Budget | None = None) -> str:
    """A scalar as text; a string longer than ``limit`` refuses the dump. Containers are refused: a pickle
    can share one list under itself many times, and ``str()`` of such a DAG is exponential in the file size.
    Lone surrogates (bytes that were not UTF-8) are repaired, and counted in ``budget``: such a string as a
    label value would fail every render of /metrics."""
    if isinstance(v, str):
        if len(v) > limit:
            raise SpoolError(reasons.LIMIT_TEXT, f"a string of {len(v)} characters, over the bound of {limit}")
        if not safetext.is_valid(v):
            if budget is not None:
                budget.repaired += 1
            return safetext.repair(v)
        return v
    if v is None or isinstance(v, (bool, float)) or (isinstance(v, int) and INT_MIN <= v <= INT_MAX):
        return str(v)[:limit]  # a number's text: at most 24 characters, cut only under tiny limits
    raise ValueError(f"expected text, got {type(v).__name__}")


class _Budget:
    """What is left of MAX_SIZE_VALUES for one dump, and the lists already converted: a pickle that hands
    every entry the same list (a memo reference) is converted once, though charged for every use."""

    __slots__ = ("done", "left", "repaired")

    def __init__(self) -> None:
        self.left = MAX_SIZE_VALUES
        self.repaired = 0  # strings whose lone surrogates were replaced
        # id() of a list in the decoded dump -> (its cost, its conversion); the dump outlives the parse
        self.done: dict[int, tuple[int, tuple[Any, ...]]] = {}

    def spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise SpoolError(reasons.LIMIT_ITEMS, f"tensor sizes and dtypes over {MAX_SIZE_VALUES} values in all")


def _tensors(v: Any) -> list[Any] | tuple[Any, ...]:
    if len(v) > MAX_ENTRY_TENSORS:
        raise SpoolError(reasons.LIMIT_ITEMS, f"an entry lists {len(v)} tensors, over the bound of {MAX_ENTRY_TENSORS}")
    return v


def _sizes(v: Any, budget: _Budget) -> tuple[tuple[int, ...], ...]:
    if not isinstance(v, (list, tuple)):
        return ()
    done = budget.done.get(id(v))
    if done is None:
        out = []
        cost = 0
        for shape in _tensors(v):
            if isinstance(shape, (list, tuple)):
                if len(shape) > MAX_TENSOR_DIMS:
                    raise SpoolError(reasons.LIMIT_ITEMS, f"a shape of {len(shape)} dimensions, over the bound of "
                                                          f"{MAX_TENSOR_DIMS}")
                cost += 1 + len(shape)
                out.append(tuple(_int(d) for d in shape))
        done = budget.done[id(v)] = (cost, tuple(out))
    budget.spend(done[0])
    return done[1]


def _strs(v: Any, budget: _Budget) -> tuple[str, ...]:
    if isinstance(v, str):  # one dtype written as a plain string (hand-made dumps, torch's own analyzer tests)
        budget.spend(1)
        return (_text(v[:MAX_WORD_CHARS], MAX_WORD_CHARS, budget),) if v else ()
    if not isinstance(v, (list, tuple)):
        return ()
    done = budget.done.get(id(v))
    if done is None:
        done = budget.done[id(v)] = (len(v), tuple(_text(x, MAX_WORD_CHARS, budget) for x in _tensors(v)))
    budget.spend(done[0])
    return done[1]


def parse_entry(raw: Any, budget: _Budget | None = None) -> FrEntry:
    """One FR entry; ValueError or TypeError when it is malformed, SpoolError when it is past a bound."""
    budget = budget or _Budget()
    if not isinstance(raw, dict):
        raise ValueError("entry is not an object")
    pg = raw.get("process_group")
    if isinstance(pg, (list, tuple)) and len(pg) >= 2:
        pg_name, pg_desc = _text(pg[0], MAX_TEXT_CHARS, budget), _text(pg[1], MAX_TEXT_CHARS, budget)
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
        profiling_name=_text(raw.get("profiling_name", ""), MAX_OP_CHARS, budget),
        time_created_ns=_int(raw.get("time_created_ns")),
        state=_text(raw.get("state", ""), MAX_WORD_CHARS, budget),
        retired=bool(raw.get("retired", False)),
        timeout_ms=_int(timeout) if isinstance(timeout, (int, float, str)) and not isinstance(timeout, bool)
        else None,
        is_p2p=bool(raw.get("is_p2p", False)),
        duration_ms=float(duration) if isinstance(duration, (int, float)) and not isinstance(duration, bool)
        else None,
        input_sizes=_sizes(raw.get("input_sizes"), budget),
        output_sizes=_sizes(raw.get("output_sizes"), budget),
        input_dtypes=_strs(raw.get("input_dtypes"), budget),
        output_dtypes=_strs(raw.get("output_dtypes"), budget),
        time_discovered_started_ns=max(0, _int(raw.get("time_discovered_started_ns"))),
        time_discovered_completed_ns=max(0, _int(raw.get("time_discovered_completed_ns"))),
    )


def parse_dump(obj: Any, what: str = "FR dump") -> FrDump:
    """Turn a decoded FR dump into typed values; raises SpoolError only if it is not a dump at all, or is
    past one of this module's bounds."""
    if not isinstance(obj, dict):
        raise SpoolError(reasons.INVALID, f"{what}: expected an object")
    if "version" not in obj and "pg_status" not in obj and "entries" not in obj:
        raise SpoolError(reasons.FOREIGN, f"{what}: not a Flight Recorder dump")
    raw_version = obj.get("version", "")
    try:  # shown, never compared: cut rather than refused
        version = safetext.repair(_text(raw_version[:MAX_WORD_CHARS] if isinstance(raw_version, str)
                                        else raw_version, MAX_WORD_CHARS))
    except ValueError:
        version = ""
    pg_status = parse_pg_status(obj.get("pg_status", {}), what) if "pg_status" in obj else {}
    raw_entries = obj.get("entries") or []
    if not isinstance(raw_entries, (list, tuple)):
        raise SpoolError(reasons.INVALID, f"{what}: entries must be a list")
    if len(raw_entries) > MAX_ENTRIES:
        raise SpoolError(reasons.LIMIT_ITEMS, f"{what}: {len(raw_entries)} entries, over the bound of {MAX_ENTRIES}")
    entries = []
    dropped = 0
    budget = _Budget()
    try:
        for raw in raw_entries:
            try:
                entries.append(parse_entry(raw, budget))
            except (ValueError, TypeError, OverflowError):
                dropped += 1
        pg_config = _pg_config(obj.get("pg_config"), budget)
    except SpoolError as e:
        raise SpoolError(e.reason, f"{what}: {e}") from e
    return FrDump(
        version=version,
        pg_status=pg_status,
        entries=tuple(entries),
        pg_config=pg_config,
        dropped_entries=dropped,
        repaired_text=budget.repaired,
    )


def json_containers(data: bytes | bytearray) -> int:
    """An upper bound, counted at C speed, on the objects and lists JSON ``data`` parses into (brackets inside
    strings count too): what parsing would cost, known before it runs."""
    return data.count(b"{") + data.count(b"[")


@dataclass(frozen=True)
class AnswerBounds:
    """What one rank's FR answer may hold: its size in bytes, and the objects and lists it may open."""

    max_bytes: int
    max_containers: int


def answer_bounds(ring_size: int, members: int) -> AnswerBounds:
    """Bounds for a rank whose manifest declares a ring of ``ring_size`` entries (0: not stated) and whose
    process groups list ``members`` members in all (pg_config spells each of them).

    A legitimately large ring (100,000 entries) is still read whole; a ring that is not there cannot be.
    """
    ring = min(MAX_ENTRIES, ring_size if ring_size > 0 else ANSWER_ASSUMED_RING)
    max_bytes = (ANSWER_BASE_BYTES + ring * ANSWER_BYTES_PER_ENTRY + ANSWER_SHAPE_LISTS * ANSWER_BYTES_PER_SHAPE
                 + max(0, members) * ANSWER_BYTES_PER_MEMBER)
    return AnswerBounds(max_bytes=min(ANSWER_MAX_BYTES, max_bytes),
                        max_containers=ANSWER_BASE_CONTAINERS + ring * ANSWER_CONTAINERS_PER_ENTRY
                        + ANSWER_SHAPE_LISTS)


def parse_answer(body: bytes | bytearray, bounds: AnswerBounds, what: str) -> FrDump:
    """A rank's JSON answer (torch's ``fr_trace_json`` / ``dump_nccl_trace_json``) as a dump, or SpoolError.

    The objects and lists it opens are counted before it is parsed (``{`` and ``[`` inside strings count too:
    an upper bound, at C speed), so that an answer past ``bounds`` costs no more than its bytes. A refused
    parse leaves no garbage behind: the frames of its traceback, which hold the parsed tree in a cycle only
    the garbage collector would break (and rarely does while millions of objects are young), are cleared.
    """
    error: SpoolError
    try:
        if len(body) > bounds.max_bytes:
            raise SpoolError(reasons.LIMIT_ITEMS, f"{what}: an answer of {len(body)} bytes, over the bound of "
                                                  f"{bounds.max_bytes} for this rank's ring")
        containers = json_containers(body)
        if containers > bounds.max_containers:
            raise SpoolError(reasons.LIMIT_ITEMS, f"{what}: an answer of {containers} objects and lists, over the "
                                                  f"bound of {bounds.max_containers} for this rank's ring")
        return parse_dump(json.loads(body), what)
    except SpoolError as e:
        error = SpoolError(e.reason, str(e))
        _release(e)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the C parser allows
        error = SpoolError(reasons.BAD_RESPONSE, f"{what}: not valid JSON ({type(e).__name__})")
        _release(e)
    try:
        raise error
    finally:
        del error  # or this frame and the error's traceback hold each other, and the answer, in a cycle


def _release(exc: BaseException | None) -> None:
    """Clear the locals of every finished frame in ``exc``'s tracebacks (and its causes')."""
    seen = 0
    while exc is not None and seen < 16:
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
        seen += 1


def _pg_config(raw: Any, budget: _Budget) -> dict[str, dict[str, Any]]:
    """``{name: {"name", "desc", "ranks": "<str of list>"}}`` with text values only, so that later
    ``str()`` or ``json.loads`` of a value costs no more than its size, and MAX_CONFIG_CHARS of it in all."""
    if not isinstance(raw, dict):
        return {}
    if len(raw) > MAX_PGS:
        raise SpoolError(reasons.LIMIT_ITEMS, f"pg_config has {len(raw)} entries, over the bound of {MAX_PGS}")
    out: dict[str, dict[str, Any]] = {}
    chars = 0
    for name, cfg in raw.items():
        if not isinstance(name, str) or not isinstance(cfg, dict):
            continue
        if len(cfg) > MAX_CONFIG_VALUES:
            raise SpoolError(reasons.LIMIT_ITEMS, f"a pg_config entry has {len(cfg)} keys, over the bound of "
                                                  f"{MAX_CONFIG_VALUES}")
        clean = {}
        for key, value in cfg.items():
            try:
                text = _text(value, MAX_CONFIG_CHARS, budget)
                clean[_text(key, MAX_CONFIG_KEY_CHARS, budget)] = text
            except ValueError:
                continue
            chars += len(text)
            if chars > MAX_CONFIG_CHARS:
                raise SpoolError(reasons.LIMIT_TEXT, f"pg_config holds over {MAX_CONFIG_CHARS} characters of text")
        out[_text(name, MAX_TEXT_CHARS, budget)] = clean
    return out
