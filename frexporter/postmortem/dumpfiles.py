"""Torch Flight Recorder dump files on disk -> RankState, for post-mortem verdicts.

Dump files are untrusted input: a pickle can run code when loaded, so pickles go
through ``SafeUnpickler``, which admits only plain containers and scalars (every
global lookup is refused) and is bounded in size. JSON dumps are read with ``json``.
One file per rank, named ``<any prefix><rank>`` as torch writes them
(``TORCH_FR_DUMP_TEMP_FILE`` + rank); the rank is the trailing number.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace

from frexporter.analysis import history
from frexporter.fr import trace
from frexporter.fr.domain import translate
from frexporter.model import RANK_OK, InflightCollective, PGState, RankState
from frexporter.spool import SpoolError

MAX_DUMP_BYTES = 512 * 1024 * 1024
_RANK_SUFFIX = re.compile(r"(\d+)(?:\.(?:json|pkl|pickle))?$")


class DumpError(Exception):
    """A dump file that cannot be used; the message says why, for the user."""


class SafeUnpickler(pickle.Unpickler):
    """Loads only what pickle can express without importing anything: dicts, lists, tuples, str, numbers."""

    def find_class(self, module: str, name: str) -> object:
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name}: FR dumps contain only plain data, this file wants code"
        )


_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def _check_memo_indexes(data: bytes) -> None:
    """The C unpickler grows its memo table to the largest index a PUT names, so a 16-byte pickle can make
    it allocate gigabytes. pickle numbers memo entries upwards from 0, one per opcode at most, so an index
    past the opcodes read so far is refused before the real load (this pass costs a few times the load)."""
    for count, (opcode, arg, _pos) in enumerate(pickletools.genops(data)):
        if opcode.name in _MEMO_PUTS and arg > count:
            raise pickle.UnpicklingError(f"memo index {arg} out of range at opcode {count}")


def safe_loads(data: bytes) -> object:
    try:
        _check_memo_indexes(data)
        return SafeUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError:
        raise
    except (EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError, MemoryError,
            RecursionError, OverflowError) as e:  # OverflowError: a memo index past ssize_t
        raise pickle.UnpicklingError(f"corrupt pickle: {e}") from e


def decode(data: bytes, what: str) -> object:
    head = data.lstrip()[:1]
    if head in (b"{", b"["):
        try:
            return json.loads(data)
        except ValueError as e:
            raise DumpError(f"{what}: invalid JSON ({e})") from e
        except RecursionError as e:  # nesting deeper than the stack: no FR dump looks like that
            raise DumpError(f"{what}: invalid JSON (nested too deeply)") from e
    try:
        return safe_loads(data)
    except pickle.UnpicklingError as e:
        raise DumpError(f"{what}: {e}") from e


def rank_of(path: str) -> int | None:
    match = _RANK_SUFFIX.search(os.path.basename(path))
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class RankDump:
    rank: int
    path: str
    dump: trace.FrDump
    mtime: float


def load_file(path: str) -> RankDump:
    rank = rank_of(path)
    if rank is None:
        raise DumpError(f"{path}: no rank number at the end of the file name (torch names dumps <prefix><rank>)")
    try:
        size = os.path.getsize(path)
        if size > MAX_DUMP_BYTES:
            raise DumpError(f"{path}: {size} bytes is over the {MAX_DUMP_BYTES} byte limit")
        with open(path, "rb") as f:
            data = f.read()
        mtime = os.path.getmtime(path)
    except OSError as e:
        raise DumpError(f"{path}: {e.strerror or e}") from e
    obj = decode(data, path)
    try:
        dump = trace.parse_dump(obj, path)
    except SpoolError as e:
        raise DumpError(str(e)) from e
    return RankDump(rank=rank, path=path, dump=dump, mtime=mtime)


def load_dir(directory: str) -> tuple[list[RankDump], list[str]]:
    """Every readable dump in a directory, plus one message per file that was skipped."""
    dumps, problems = [], []
    try:
        names = sorted(os.listdir(directory))
    except OSError as e:
        raise DumpError(f"{directory}: {e.strerror or e}") from e
    for name in names:
        path = os.path.join(directory, name)
        if name.startswith(".") or not os.path.isfile(path):
            continue
        try:
            dumps.append(load_file(path))
        except DumpError as e:
            problems.append(str(e))
    return dumps, problems


Membership = dict[tuple[int, str], tuple[int, ...]]  # (rank, PG name) -> the PG's global ranks


def _declared(cfg: object) -> tuple[int, ...] | None:
    if not isinstance(cfg, dict):
        return None
    try:
        ranks = json.loads(str(cfg.get("ranks", "[]")))
    except ValueError:
        return None
    if isinstance(ranks, list) and ranks and all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        return tuple(sorted(set(ranks)))
    return None


def memberships(dumps: Iterable[RankDump]) -> Membership:
    """Each rank's view of each PG name it recorded: the global ranks of *its* group of that name.

    A name alone does not identify a group: ``split_group`` (and any layout of disjoint groups created in the
    same order) gives several groups one name, so the identity is the name plus the ranks. A rank's own
    ``pg_config`` says which; without one (gloo's is broken in torch 2.8-2.13: one ``''`` key), the one set
    another rank declares for that name with this rank in it; else every rank that recorded the name (WORLD:
    every rank), less those declared in a same-named group without this rank. With no ``pg_config`` at all,
    same-named groups cannot be told apart.
    """
    dumps = list(dumps)
    declared: dict[tuple[int, str], tuple[int, ...]] = {}
    by_name: dict[str, set[tuple[int, ...]]] = {}
    for d in dumps:
        for name, cfg in d.dump.pg_config.items():
            ranks = _declared(cfg) if name else None
            if ranks is not None:
                declared[(d.rank, str(name))] = ranks
                by_name.setdefault(str(name), set()).add(ranks)
    seen: dict[str, set[int]] = {}
    for d in dumps:
        for entry in d.dump.entries:
            seen.setdefault(entry.pg_name, set()).add(d.rank)
    all_ranks = tuple(sorted(d.rank for d in dumps))
    out: Membership = {}
    for name, recorded_by in seen.items():
        for rank in recorded_by:
            own = declared.get((rank, name))
            if own is None:
                sets = by_name.get(name, set())
                holding = [r for r in sets if rank in r]
                # Ranks declared in a same-named group without this rank are not in this one.
                elsewhere = {r for ranks in sets if rank not in ranks for r in ranks}
                own = holding[0] if len(holding) == 1 else all_ranks if name == "0" and not sets else tuple(
                    sorted(recorded_by - elsewhere))
            out[(rank, name)] = own
    return out


def with_pg_ids(dump: trace.FrDump) -> trace.FrDump:
    """Entries without a ``pg_id`` (torch before 2.5, hand-made dumps) grouped by their PG name instead:
    one id per name, negative so that it never collides with a real id (those count up from 0)."""
    if all(e.pg_id >= 0 for e in dump.entries):
        return dump
    ids: dict[str, int] = {}
    entries = tuple(e if e.pg_id >= 0 else replace(e, pg_id=ids.setdefault(e.pg_name, -2 - len(ids)))
                    for e in dump.entries)
    return replace(dump, entries=entries)


def _collective(entry: trace.FrEntry) -> InflightCollective:
    return InflightCollective(
        seq=entry.collective_seq_id, op=entry.op, created=entry.time_created_ns / 1e9,
        timeout_seconds=entry.timeout_ms / 1000.0 if entry.timeout_ms else None,
        input_sizes=entry.input_sizes, input_dtypes=entry.input_dtypes,
        output_sizes=entry.output_sizes, output_dtypes=entry.output_dtypes)


def histories(dumps: list[RankDump], job_id: str = "dump") -> list[history.GroupHistory]:
    """Every collective each rank recorded, per cross-rank group, for judging what already happened."""
    members = memberships(dumps)
    Recorded = dict[int, list[history.Recorded]]
    groups: dict[tuple[str, tuple[int, ...]], tuple[str, Recorded, Recorded]] = {}  # desc, collectives, p2p
    for d in sorted(dumps, key=lambda d: d.rank):
        by_pg: dict[int, list[trace.FrEntry]] = {}
        for entry in with_pg_ids(d.dump).entries:
            by_pg.setdefault(entry.pg_id, []).append(entry)
        for entries in by_pg.values():
            entries.sort(key=lambda e: e.record_id)
            name = entries[-1].pg_name
            key = (name, members.get((d.rank, name), (d.rank,)))
            ranks = groups.setdefault(key, (entries[-1].pg_desc, {}, {}))
            ranks[1][d.rank] = [history.Recorded(_collective(e), e.done, e.state == "completed")
                                for e in entries if not e.is_p2p]
            ranks[2][d.rank] = [history.Recorded(replace(_collective(e), seq=e.p2p_seq_id), e.done,
                                                 e.state == "completed") for e in entries if e.is_p2p]
    return [history.GroupHistory(job_id=job_id, name=name, desc=desc, members=ranks_of,
                                 entries={r: tuple(v) for r, v in per_rank.items()},
                                 p2p={r: tuple(v) for r, v in p2p.items() if v})
            for (name, ranks_of), (desc, per_rank, p2p) in sorted(groups.items())]


def rank_states(dumps: list[RankDump], job_id: str = "dump") -> tuple[RankState, ...]:
    members = memberships(dumps)
    states = []
    for d in sorted(dumps, key=lambda d: d.rank):
        pgs = []
        for view in translate(with_pg_ids(d.dump)).values():
            if not view.name:
                continue  # pg_status of a group whose entries all left the ring: no name to give it
            pgs.append(PGState(
                name=view.name, desc=view.desc, ranks=members.get((d.rank, view.name), ()), backend="",
                last_enqueued=view.enqueued, last_started=view.started, last_completed=view.completed,
                inflight=view.inflight, inflight_count=max(0, view.enqueued - view.completed),
                timeout_seconds=view.timeout_seconds, last_progress=None, exact=view.known, has_p2p=view.has_p2p,
            ))
        states.append(RankState(
            job_id=job_id, rank=d.rank, local_rank=-1, world_size=len(dumps), hostname="", pid=0,
            torch_version="", gpu_uuid="", status=RANK_OK, heartbeat=None, heartbeat_age=None, socket_alive=None,
            pgs=tuple(sorted(pgs, key=lambda p: p.name)), message=d.path,
        ))
    return _settle_completion_lag(tuple(states))


def _settle_completion_lag(states: tuple[RankState, ...]) -> tuple[RankState, ...]:
    """A collective any rank completed is complete on every rank that enqueued it.

    gloo wakes the caller before its worker thread marks the work completed and retired, so a dump taken
    right after a blocking collective can show it still in flight on some ranks while a peer shows it done.
    A collective completes nowhere until every rank has joined it, so one rank's completion proves that no
    one is stuck on it. Left alone, the lagging ranks' frontier would be a collective that is over, hiding
    the real hang behind it (with two lagging ranks of three, "every other rank" would not be enough).
    A rank that truly lags (NCCL: peers saw the kernel finish, it did not) is reported by ``history``.
    """
    done: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for state in states:
        for pg in state.pgs:
            done.setdefault((pg.name, pg.ranks), []).append(pg.last_completed)
    out = []
    for state in states:
        pgs = []
        for pg in state.pgs:
            settled = min(max(done[(pg.name, pg.ranks)]), pg.last_enqueued)
            if settled > pg.last_completed:
                inflight = tuple(e for e in pg.inflight if e.seq > settled)
                pg = replace(pg, last_completed=settled, inflight=inflight,
                             inflight_count=max(0, pg.last_enqueued - settled))
            pgs.append(pg)
        out.append(replace(state, pgs=tuple(pgs)))
    return tuple(out)


def dump_time(dumps: list[RankDump]) -> float:
    """'Now' for a post-mortem: when the dumps were written (the newest file, or newest entry if later).

    File times come from a coarse kernel clock (a few ms behind), so a dump written right after its last
    collective can carry an mtime older than that collective's creation; the entries bound it from below.
    """
    newest_entry = max((e.time_created_ns / 1e9 for d in dumps for e in d.dump.entries), default=0.0)
    return max([d.mtime for d in dumps] + [newest_entry], default=0.0)
