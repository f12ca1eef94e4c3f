"""Pure: the parsed dumps of one analysis made compact, and what each keeps estimated.

Every entry repeats its PG's name and description, its op, state and shapes; ``Interner`` keeps one object
for each distinct value across all the dumps, and ``compact`` returns a dump that uses them, with what it
keeps beyond them (in ``bounds``' units: ``ENTRY_BYTES`` an entry, ``PG_STATUS_BYTES`` a PG status).
"""

from __future__ import annotations

import operator
import sys
from dataclasses import fields, replace

from frexporter.fr import trace
from frexporter.postmortem.dumpfiles.bounds import ENTRY_BYTES, PG_STATUS_BYTES


class Interner:
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
_SHARED_AT = tuple(
    _ENTRY_FIELDS.index(f)
    for f in (
        "pg_name",
        "pg_desc",
        "profiling_name",
        "state",
        "input_sizes",
        "output_sizes",
        "input_dtypes",
        "output_dtypes",
    )
)


def compact(dump: trace.FrDump, shared: Interner) -> tuple[trace.FrDump, int]:
    """``dump`` with its repeated values shared (``Interner``), and what it keeps beyond them, estimated."""
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
    config = sum(
        64 + len(name) + sum(128 + len(k) + len(str(v)) for k, v in cfg.items()) for name, cfg in dump.pg_config.items()
    )
    cost = len(entries) * ENTRY_BYTES + len(dump.pg_status) * PG_STATUS_BYTES + config
    return replace(dump, entries=tuple(entries)), cost
