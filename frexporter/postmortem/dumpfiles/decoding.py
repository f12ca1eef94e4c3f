"""A dump file's name and bytes as a parsed dump of one rank (``RankDump``); no file access.

Dump files are untrusted input: a pickle can run code when loaded, so pickles go through ``SafeUnpickler``,
which admits only plain containers and scalars (every global lookup is refused). JSON dumps are read with
``json``. Either is refused before it is parsed when it could build more than a dump can hold (``bounds``).
The rank is the trailing number of the file name (``<any prefix><rank>``, as torch writes them).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import re
from dataclasses import dataclass

from frexporter.fr import trace
from frexporter.postmortem.dumpfiles.bounds import check_json, check_pickle
from frexporter.spool import MAX_RANK, SpoolError

_RANK_SUFFIX = re.compile(r"([0-9]+)(?:\.(?:json|pkl|pickle))?$")
_FIRST_BYTE = re.compile(rb"[ \t\r\n]*(.)", re.DOTALL)  # JSON's own whitespace


class DumpError(Exception):
    """A dump file that cannot be used; the message says why, for the user."""


class _Refused(pickle.UnpicklingError):
    """A pickle refused for what it asks, not for being corrupt."""


class SafeUnpickler(pickle.Unpickler):
    """Loads only what pickle can express without importing anything: dicts, lists, tuples, str, numbers."""

    def find_class(self, module: str, name: str) -> object:
        raise _Refused(f"refusing to load {module}.{name}: FR dumps contain only plain data, this file wants code")


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
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        IndexError,
        KeyError,
        AttributeError,
        MemoryError,
        RecursionError,
        OverflowError,
    ) as e:  # OverflowError: a memo index past ssize_t
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


def parse_decoded(obj: object, what: str) -> trace.FrDump:
    """A decoded dump file (``decode``) as a parsed dump (DumpError when it is not one)."""
    try:
        return trace.parse_dump(obj, what)
    except SpoolError as e:
        raise DumpError(str(e)) from e


def parse_file(data: bytes, what: str) -> trace.FrDump:
    """A dump file's bytes as a parsed dump (DumpError when it is not one, or past a bound)."""
    return parse_decoded(decode(data, what), what)


def rank_of(path: str) -> int | None:
    match = _RANK_SUFFIX.search(os.path.basename(path))
    if match is None or len(match.group(1)) > 10:
        return None
    rank = int(match.group(1))
    return rank if rank <= MAX_RANK else None


@dataclass(frozen=True)
class RankDump:
    rank: int
    path: str
    dump: trace.FrDump
    mtime: float
