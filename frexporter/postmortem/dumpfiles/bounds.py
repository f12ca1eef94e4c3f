"""Pure: how much a dump file may hold and what its parse may build, checked before it is parsed.

The byte bounds of a file (``MAX_DUMP_BYTES``, ``MAX_JSON_BYTES``), the counts of what a parse would build
(``check_json``, ``check_pickle``: at C speed, an upper bound, bounded by what ``trace.MAX_ENTRIES`` real
entries need), and what the parsed dumps of one analysis may keep in all (``MAX_PARSED_BYTES``).
"""

from __future__ import annotations

from frexporter.fr import trace
from frexporter.spool import MAX_PGS

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


def _bytes_not_in(kept: bytes) -> bytes:
    return bytes(b for b in range(256) if b not in kept)


def _count(data: bytes, others: bytes) -> int:
    """How many bytes of ``data`` are not among ``others`` (made by ``_bytes_not_in``), in one C-speed pass
    (by slices: ``translate`` copies what it keeps)."""
    step = 1 << 22
    return sum(len(data[i : i + step].translate(None, others)) for i in range(0, len(data), step))


_NOT_UTF8_WIDE = _bytes_not_in(bytes(range(0xF0, 0xF5)))  # leads of characters past U+FFFF: 4 bytes a char
_NOT_UTF8_MID = _bytes_not_in(bytes(range(0xC4, 0xF0)))  # leads of characters past U+00FF: 2 bytes a char
# Pickle opcodes by what they put on the unpickler's stack, its marks or its memo (every other opcode
# takes from the stack, or fails: globals are refused).
_PICKLE_CONTAINERS = b"]}\x8fdlt\x85\x86\x87\x91"  # EMPTY_LIST/DICT/SET, DICT, LIST, TUPLE, TUPLE1-3, FROZENSET
_PICKLE_STRINGS = b"\x8c\x8dXVSTUBC\x8e\x96"  # text, bytes and bytearrays in every protocol's form
_PICKLE_NUMBERS = b"IJMLFG\x8a\x8b"  # new int and float objects (BININT1's are shared)
_PICKLE_VALUES = _PICKLE_CONTAINERS + _PICKLE_STRINGS + _PICKLE_NUMBERS + b")N\x88\x89Kghj2(pqr\x94"
_NOT_PICKLE = {
    name: _bytes_not_in(ops)
    for name, ops in (
        ("containers", _PICKLE_CONTAINERS),
        ("strings", _PICKLE_STRINGS),
        ("numbers", _PICKLE_NUMBERS),
        ("values", _PICKLE_VALUES),
    )
}
_UNITS = {
    "containers": "objects and lists",
    "strings": "strings",
    "keys": "keys",
    "numbers": "numbers",
    "values": "values",
}


def _over_bounds(counts: dict[str, int], bounds: dict[str, int]) -> str | None:
    for name, count in counts.items():
        if count > bounds[name]:
            return (
                f"up to {count} {_UNITS[name]} (counted before parsing), over the bound of {bounds[name]} that "
                f"{trace.MAX_ENTRIES} entries need"
            )
    return None


_JSON_BOUNDS = {
    "containers": MAX_FILE_CONTAINERS,
    "strings": MAX_FILE_STRINGS,
    "keys": MAX_JSON_KEYS,
    "values": MAX_JSON_VALUES,
}
_PICKLE_BOUNDS = {
    "containers": MAX_FILE_CONTAINERS,
    "strings": MAX_FILE_STRINGS,
    "numbers": MAX_FILE_NUMBERS,
    "values": MAX_PICKLE_VALUES,
}


def check_json(data: bytes) -> str | None:
    """Why parsing ``data`` as JSON could build more than a dump can hold, or None."""
    # json.loads decodes the bytes first, into a str as wide as its widest character
    width = 4 if _count(data, _NOT_UTF8_WIDE) else 2 if _count(data, _NOT_UTF8_MID) else 1
    if len(data) * width > MAX_JSON_BYTES:
        return f"{len(data)} bytes of JSON ({width} a character decoded), over the bound of {MAX_JSON_BYTES}"
    containers = trace.json_containers(data)
    counts = {
        "containers": containers,
        "strings": data.count(b'"') // 2,
        "keys": data.count(b":"),
        "values": containers + data.count(b","),
    }
    return _over_bounds(counts, _JSON_BOUNDS)


def check_pickle(data: bytes) -> str | None:
    """Why unpickling ``data`` could build more than a dump can hold, or None."""
    return _over_bounds({name: _count(data, others) for name, others in _NOT_PICKLE.items()}, _PICKLE_BOUNDS)
