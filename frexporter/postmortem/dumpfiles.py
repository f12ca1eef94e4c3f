"""Torch Flight Recorder dump files on disk -> RankState, for post-mortem verdicts.

Dump files are untrusted input: a pickle can run code when loaded, so pickles go
through ``SafeUnpickler``, which admits only plain containers and scalars (every
global lookup is refused). JSON dumps are read with ``json``.
One file per rank, named ``<any prefix><rank>`` as torch writes them
(``TORCH_FR_DUMP_TEMP_FILE`` + rank); the rank is the trailing number.

Whoever can write the directory can plant entries in it: a file is read only when it is a regular file
(never through a symbolic link, never blocking on a FIFO); what its parse may build is bounded before it is
parsed (by what MAX_ENTRIES real entries need); files are parsed one at a time, each into its compact parsed
form, and what all of them keep is bounded by MAX_PARSED_BYTES. A second file for one rank is not used.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import io
import json
import operator
import os
import pickle
import pickletools
import re
import stat
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields, replace

from frexporter.analysis import history
from frexporter.fr import trace
from frexporter.fr.domain import translate
from frexporter.model import RANK_OK, InflightCollective, PGState, RankList, RankState
from frexporter.spool import MAX_PGS, MAX_RANK, SpoolError

# Torch's entries (2.13, gloo, measured): a JSON one is about 470 bytes, a pickled one 125-185 (torch's pickler
# memoizes stack frames and repeated text); pg_config's text comes on top.
MAX_DUMP_BYTES = trace.MAX_ENTRIES * 1280
MAX_JSON_BYTES = trace.MAX_ENTRIES * 512 + trace.MAX_CONFIG_CHARS  # and its decoded text (1 to 4 bytes a char)
# What a file's parse may build, counted before it is parsed, at C speed, as an upper bound (bytes inside
# strings count too), and bounded by what MAX_ENTRIES entries need: json.loads of 64 MB of ``{},`` builds 22
# million dicts (1.7 GB), and the unpickler stacks 64 million references for 64 MB of NONE opcodes.
# Torch's entries need, measured: JSON 8 objects and lists, 28 strings and 23 colons (22 keys), 29 values;
# pickle 9.3 containers, 0.3 strings, 2 numbers past 255 and 67 values (97 with 34 stack frames).
CONTAINERS_PER_ENTRY = 16
STRINGS_PER_ENTRY = 40
KEYS_PER_ENTRY = 32  # JSON: each distinct key is a string, a slot and a memo entry (pickles memoize keys)
NUMBERS_PER_ENTRY = 16  # pickles: JSON numbers cannot be told from other values at C speed
JSON_VALUES_PER_ENTRY = 48
PICKLE_VALUES_PER_ENTRY = 128
# Beyond the entries: pg_status and pg_config (a few objects and strings per PG), the shape lists of coalesced
# collectives, every tensor size value and dtype (in and out), and the members pg_config's "ranks" text lists.
_BEYOND_VALUES = 2 * trace.MAX_SIZE_VALUES + (1 << 20)
MAX_FILE_CONTAINERS = 4 * MAX_PGS + (1 << 17) + trace.MAX_ENTRIES * CONTAINERS_PER_ENTRY
MAX_FILE_STRINGS = 4 * MAX_PGS + trace.MAX_SIZE_VALUES + trace.MAX_ENTRIES * STRINGS_PER_ENTRY
MAX_FILE_NUMBERS = 2 * trace.MAX_SIZE_VALUES + trace.MAX_ENTRIES * NUMBERS_PER_ENTRY
MAX_JSON_KEYS = 16 * MAX_PGS + trace.MAX_ENTRIES * KEYS_PER_ENTRY
MAX_JSON_VALUES = _BEYOND_VALUES + trace.MAX_ENTRIES * JSON_VALUES_PER_ENTRY
MAX_PICKLE_VALUES = _BEYOND_VALUES + trace.MAX_ENTRIES * PICKLE_VALUES_PER_ENTRY
# What the parsed dumps of one analysis keep in all (estimated: ENTRY_BYTES an entry, plus each distinct text
# and shape list once). Torch's entries take about 300 bytes; the estimate holds 2.8 million (1,400 ranks of
# torch's default 2000-entry ring); the analysis takes about as much again.
MAX_PARSED_BYTES = 1 << 30
ENTRY_BYTES = 384  # an FrEntry and its numbers
PG_STATUS_BYTES = 256
_RANK_SUFFIX = re.compile(r"([0-9]+)(?:\.(?:json|pkl|pickle))?$")
_FIRST_BYTE = re.compile(rb"[ \t\r\n]*(.)", re.DOTALL)  # JSON's own whitespace
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFLNK: "a symbolic link", stat.S_IFIFO: "a FIFO",
          stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


class DumpError(Exception):
    """A dump file that cannot be used; the message says why, for the user."""


def _bytes_not_in(kept: bytes) -> bytes:
    return bytes(b for b in range(256) if b not in kept)


def _count(data: bytes, others: bytes) -> int:
    """How many bytes of ``data`` are not among ``others`` (made by ``_bytes_not_in``), in one C-speed pass
    (by slices: ``translate`` copies what it keeps)."""
    step = 1 << 22
    return sum(len(data[i:i + step].translate(None, others)) for i in range(0, len(data), step))


_NOT_UTF8_WIDE = _bytes_not_in(bytes(range(0xF0, 0xF5)))  # leads of characters past U+FFFF: 4 bytes a char
_NOT_UTF8_MID = _bytes_not_in(bytes(range(0xC4, 0xF0)))  # leads of characters past U+00FF: 2 bytes a char
# Pickle opcodes by what they put on the unpickler's stack, its marks or its memo (every other opcode
# takes from the stack, or fails: globals are refused).
_PICKLE_CONTAINERS = b"]}\x8fdlt\x85\x86\x87\x91"  # EMPTY_LIST/DICT/SET, DICT, LIST, TUPLE, TUPLE1-3, FROZENSET
_PICKLE_STRINGS = b"\x8c\x8dXVSTUBC\x8e\x96"  # text, bytes and bytearrays in every protocol's form
_PICKLE_NUMBERS = b"IJMLFG\x8a\x8b"  # new int and float objects (BININT1's are shared)
_PICKLE_VALUES = _PICKLE_CONTAINERS + _PICKLE_STRINGS + _PICKLE_NUMBERS + b")N\x88\x89Kghj2(pqr\x94"
_NOT_PICKLE = {name: _bytes_not_in(ops) for name, ops in (("containers", _PICKLE_CONTAINERS),
               ("strings", _PICKLE_STRINGS), ("numbers", _PICKLE_NUMBERS), ("values", _PICKLE_VALUES))}
_UNITS = {"containers": "objects and lists", "strings": "strings", "keys": "keys", "numbers": "numbers",
          "values": "values"}


def _over_bounds(counts: dict[str, int], bounds: dict[str, int]) -> str | None:
    for name, count in counts.items():
        if count > bounds[name]:
            return (f"up to {count} {_UNITS[name]} (counted before parsing), over the bound of {bounds[name]} that "
                    f"{trace.MAX_ENTRIES} entries need")
    return None


_JSON_BOUNDS = {"containers": MAX_FILE_CONTAINERS, "strings": MAX_FILE_STRINGS, "keys": MAX_JSON_KEYS,
                "values": MAX_JSON_VALUES}
_PICKLE_BOUNDS = {"containers": MAX_FILE_CONTAINERS, "strings": MAX_FILE_STRINGS, "numbers": MAX_FILE_NUMBERS,
                  "values": MAX_PICKLE_VALUES}


def check_json(data: bytes) -> str | None:
    """Why parsing ``data`` as JSON could build more than a dump can hold, or None."""
    # json.loads decodes the bytes first, into a str as wide as its widest character
    width = 4 if _count(data, _NOT_UTF8_WIDE) else 2 if _count(data, _NOT_UTF8_MID) else 1
    if len(data) * width > MAX_JSON_BYTES:
        return f"{len(data)} bytes of JSON ({width} a character decoded), over the bound of {MAX_JSON_BYTES}"
    containers = trace.json_containers(data)
    counts = {"containers": containers, "strings": data.count(b'"') // 2, "keys": data.count(b":"),
              "values": containers + data.count(b",")}
    return _over_bounds(counts, _JSON_BOUNDS)


def check_pickle(data: bytes) -> str | None:
    """Why unpickling ``data`` could build more than a dump can hold, or None."""
    return _over_bounds({name: _count(data, others) for name, others in _NOT_PICKLE.items()}, _PICKLE_BOUNDS)


class _Refused(pickle.UnpicklingError):
    """A pickle refused for what it asks, not for being corrupt."""


class SafeUnpickler(pickle.Unpickler):
    """Loads only what pickle can express without importing anything: dicts, lists, tuples, str, numbers."""

    def find_class(self, module: str, name: str) -> object:
        raise _Refused(
            f"refusing to load {module}.{name}: FR dumps contain only plain data, this file wants code"
        )


_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def _check_memo_indexes(data: bytes) -> None:
    """The C unpickler grows its memo table to the largest index a PUT names, so a 16-byte pickle can make
    it allocate gigabytes. pickle numbers memo entries upwards from 0, one per opcode at most, so an index
    past the opcodes read so far is refused before the real load (this pass costs a few times the load)."""
    if b"p" not in data and b"r" not in data:
        return  # no PUT or LONG_BINPUT: BINPUT's one-byte index and MEMOIZE cannot grow the memo past 512
    for count, (opcode, arg, _pos) in enumerate(pickletools.genops(data)):
        if opcode.name in _MEMO_PUTS and isinstance(arg, int) and arg > count:
            raise _Refused(f"memo index {arg} out of range at opcode {count}")


def safe_loads(data: bytes) -> object:
    over = check_pickle(data)
    if over is not None:
        raise _Refused(over)
    try:
        _check_memo_indexes(data)
        return SafeUnpickler(io.BytesIO(data)).load()
    except _Refused:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            MemoryError, RecursionError, OverflowError) as e:  # OverflowError: a memo index past ssize_t
        raise pickle.UnpicklingError(f"corrupt pickle: {e}") from e


def decode(data: bytes, what: str) -> object:
    first = _FIRST_BYTE.match(data)
    if first is not None and first.group(1) in (b"{", b"["):
        over = check_json(data)
        if over is not None:
            raise DumpError(f"{what}: {over}")
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


def _parse(obj: object, what: str) -> trace.FrDump:
    try:
        return trace.parse_dump(obj, what)
    except SpoolError as e:
        raise DumpError(str(e)) from e


def parse_file(data: bytes, what: str) -> trace.FrDump:
    """A dump file's bytes as a parsed dump (DumpError when it is not one, or past a bound)."""
    return _parse(decode(data, what), what)


def rank_of(path: str) -> int | None:
    match = _RANK_SUFFIX.search(os.path.basename(path))
    if match is None or len(match.group(1)) > 10:
        return None
    rank = int(match.group(1))
    return rank if rank <= MAX_RANK else None


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def read_regular(name: str, what: str, limit: int, dir_fd: int | None = None) -> tuple[bytes, float]:
    """The bytes and mtime of the regular file ``name`` (relative to ``dir_fd``), at most ``limit`` of them.

    A symbolic link is not followed (O_NOFOLLOW), a FIFO cannot block the open (O_NONBLOCK), and what was
    opened is checked to be a regular file (fstat), so an entry swapped after it was listed is refused too.
    """
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise DumpError(f"{what}: a symbolic link, not followed") from e
        raise DumpError(f"{what}: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DumpError(f"{what}: {_kind(st.st_mode)}, not a regular file; not read")
        if st.st_size > limit:
            raise DumpError(f"{what}: {st.st_size} bytes, over the bound of {limit}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(st.st_size + 1)
            if len(data) > st.st_size:  # it grew after fstat
                data += f.read(limit + 1 - len(data))
    except OSError as e:
        raise DumpError(f"{what}: {e.strerror or e}") from e
    finally:
        os.close(fd)
    if len(data) > limit:
        raise DumpError(f"{what}: over the bound of {limit} bytes")
    return data, st.st_mtime


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
    data, mtime = read_regular(path, path, MAX_DUMP_BYTES)
    return RankDump(rank=rank, path=path, dump=parse_file(data, path), mtime=mtime)


class _Interner:
    """One object for each distinct text, shape list and dtype list across the dumps of one analysis.

    Parsing makes one per entry: every entry repeats its PG's name and description, its op, state and shapes,
    and kept apart they take three times the memory (900 rather than 300 bytes a torch entry).
    """

    def __init__(self) -> None:
        self.kept: dict[object, object] = {}
        self.bytes = 0  # what the distinct objects take, estimated

    def add(self, value: object) -> object:
        self.kept[value] = value
        self.bytes += _footprint(value)
        return value


def _footprint(value: object) -> int:
    if isinstance(value, tuple):
        return sys.getsizeof(value) + sum(_footprint(v) for v in value)
    return sys.getsizeof(value) if isinstance(value, str) else 32


_ENTRY_FIELDS = tuple(f.name for f in fields(trace.FrEntry))
_entry_values = operator.attrgetter(*_ENTRY_FIELDS)
_SHARED_AT = tuple(_ENTRY_FIELDS.index(f) for f in ("pg_name", "pg_desc", "profiling_name", "state", "input_sizes",
                                                    "output_sizes", "input_dtypes", "output_dtypes"))


def _compact(dump: trace.FrDump, shared: _Interner) -> tuple[trace.FrDump, int]:
    """``dump`` with its repeated values shared (``_Interner``), and what it keeps beyond them, estimated."""
    get, add = shared.kept.get, shared.add
    entries = []
    for e in dump.entries:
        values = list(_entry_values(e))
        changed = False
        for i in _SHARED_AT:
            kept = get(values[i])
            if kept is None:
                add(values[i])
            elif kept is not values[i]:
                values[i], changed = kept, True
        entries.append(trace.FrEntry(*values) if changed else e)
    config = sum(64 + len(name) + sum(128 + len(k) + len(str(v)) for k, v in cfg.items())
                 for name, cfg in dump.pg_config.items())
    cost = len(entries) * ENTRY_BYTES + len(dump.pg_status) * PG_STATUS_BYTES + config
    return replace(dump, entries=tuple(entries)), cost


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while dumps are parsed (a parse makes millions of objects, none in a
    cycle, and each batch of them would start a collection that walks everything kept so far); on again as it
    was. Cycles a file does leave (a pickle may hold itself) are collected after that file."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class _Held:
    dump: RankDump
    cost: int


class _Loader:
    """The dumps of one directory, read one file at a time, with the problems of those passed over."""

    def __init__(self, directory: str, dir_fd: int, max_parsed_bytes: int) -> None:
        self.directory, self.dir_fd, self.max_parsed_bytes = directory, dir_fd, max_parsed_bytes
        self.held: dict[int, _Held] = {}
        self.problems: list[str] = []
        self.shared = _Interner()
        self.kept_bytes = 0  # beyond the shared objects

    def add(self, name: str, skip: Callable[[str], bool]) -> None:
        path = os.path.join(self.directory, name)
        try:
            st = os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
        except OSError as e:
            self.problems.append(f"{path}: {e.strerror or e}")
            return
        if not stat.S_ISREG(st.st_mode):
            self.problems.append(f"{path}: {_kind(st.st_mode)}, not a regular file; not read")
        elif not skip(name):
            try:
                self._load(name, path)
            except DumpError as e:
                self.problems.append(str(e))
            gc.collect(0)  # this file's cycles, if it left any: only its own objects are this young

    def _load(self, name: str, path: str) -> None:
        rank = rank_of(name)
        if rank is None:
            raise DumpError(f"{path}: no rank number at the end of the file name (torch names dumps <prefix><rank>)")
        data, mtime = read_regular(name, path, MAX_DUMP_BYTES, self.dir_fd)
        obj = decode(data, path)
        del data  # gone before the tree is parsed, and the tree before the next file is read
        parsed = _parse(obj, path)
        del obj
        dump, cost = _compact(parsed, self.shared)
        del parsed
        new = RankDump(rank=rank, path=path, dump=dump, mtime=mtime)
        held = self.held.get(rank)
        if held is not None and len(dump.entries) <= len(held.dump.dump.entries):
            raise DumpError(_duplicate(path, rank, held.dump.path))
        total = self.shared.bytes + self.kept_bytes + cost - (held.cost if held else 0)
        if total > self.max_parsed_bytes:
            raise DumpError(f"{path}: not used: with it the parsed dumps would hold about {total >> 20} MiB, over "
                            f"the bound of {self.max_parsed_bytes >> 20} MiB for all of them")
        if held is not None:
            self.problems.append(_duplicate(held.dump.path, rank, path))
            self.kept_bytes -= held.cost
        self.held[rank] = _Held(new, cost)
        self.kept_bytes += cost

    def dumps(self) -> list[RankDump]:
        return [h.dump for h in self.held.values()]


def _duplicate(path: str, rank: int, used: str) -> str:
    return (f"{path}: a second dump of rank {rank}; not used: {used} is (one dump a rank: the one with more "
            "entries, else the first by name)")


def _no_skip(name: str) -> bool:
    return False


def load_dir(directory: str, skip: Callable[[str], bool] = _no_skip,
             max_parsed_bytes: int = MAX_PARSED_BYTES) -> tuple[list[RankDump], list[str]]:
    """Every usable dump in a directory, one a rank, plus one message per entry passed over: a file that is
    not a dump, is past a bound or is a second dump of a rank, and every entry that is not a regular file.
    Hidden entries (``.name``) are passed over silently, and so are the regular files ``skip`` names (the
    other files of an evidence bundle)."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise DumpError(f"{directory}: {e.strerror or e}") from e
    try:
        loader = _Loader(directory, dir_fd, max_parsed_bytes)
        with _collector_paused():
            for name in sorted(os.listdir(dir_fd)):
                if not name.startswith("."):
                    loader.add(name, skip)
    except OSError as e:
        raise DumpError(f"{directory}: {e.strerror or e}") from e
    finally:
        os.close(dir_fd)
    return sorted(loader.dumps(), key=lambda d: d.rank), loader.problems


Membership = dict[tuple[int, str], tuple[int, ...]]  # (rank, PG name) -> the PG's global ranks


# pg_config's "ranks" as torch writes it (``str`` of a list of ints). Matched rather than json.loads'ed: the text
# is the dump's (up to trace.MAX_CONFIG_CHARS), and nested brackets would recurse past the stack.
_RANK_LIST = re.compile(r"\[\s*[0-9]{1,10}(?:\s*,\s*[0-9]{1,10})*\s*\]")


def _declared(cfg: object) -> tuple[int, ...] | None:
    if not isinstance(cfg, dict):
        return None
    text = cfg.get("ranks")
    if not isinstance(text, str) or _RANK_LIST.fullmatch(text) is None:
        return None
    ranks = {int(r) for r in text[1:-1].split(",")}
    return tuple(sorted(ranks)) if max(ranks) <= MAX_RANK else None


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
    done: dict[tuple[str, RankList], list[int]] = {}
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
