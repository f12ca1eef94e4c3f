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

from frexporter.fr import trace
from frexporter.fr.domain import translate
from frexporter.model import RANK_OK, PGState, RankState
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


def _members(dumps: Iterable[RankDump]) -> dict[str, tuple[int, ...]]:
    """PG name -> member ranks: from a usable ``pg_config``, else from which ranks recorded the PG.

    gloo's ``pg_config`` is broken in torch 2.8-2.13 (one ``''`` key), so the fallback matters.
    """
    members: dict[str, set[int]] = {}
    for d in dumps:
        for name, cfg in d.dump.pg_config.items():
            if not name or not isinstance(cfg, dict):
                continue
            try:
                ranks = json.loads(str(cfg.get("ranks", "[]")))
            except ValueError:
                continue
            if isinstance(ranks, list) and ranks and all(isinstance(r, int) for r in ranks):
                members.setdefault(str(name), set()).update(ranks)
    seen: dict[str, set[int]] = {}
    for d in dumps:
        for entry in d.dump.entries:
            seen.setdefault(entry.pg_name, set()).add(d.rank)
    all_ranks = {d.rank for d in dumps}
    for name, ranks in seen.items():
        if name not in members:
            members[name] = all_ranks if name == "0" else ranks  # WORLD is every rank
    return {name: tuple(sorted(r)) for name, r in members.items()}


def rank_states(dumps: list[RankDump], job_id: str = "dump") -> tuple[RankState, ...]:
    members = _members(dumps)
    states = []
    for d in sorted(dumps, key=lambda d: d.rank):
        pgs = []
        for view in translate(d.dump).values():
            if not view.name:
                continue  # pg_status of a group whose entries all left the ring: no name to give it
            pgs.append(PGState(
                name=view.name, desc=view.desc, ranks=members.get(view.name, ()), backend="",
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
    """
    done: dict[str, list[int]] = {}
    for state in states:
        for pg in state.pgs:
            done.setdefault(pg.name, []).append(pg.last_completed)
    out = []
    for state in states:
        pgs = []
        for pg in state.pgs:
            settled = min(max(done[pg.name]), pg.last_enqueued)
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
