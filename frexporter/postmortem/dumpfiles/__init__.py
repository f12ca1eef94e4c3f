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

Modules, in the direction data flows (each imports only those before it); only ``reading`` does I/O:

- ``bounds.py``: the bounds on a file and on what its parse may build, counted before parsing;
- ``decoding.py``: a file's name and bytes -> ``RankDump`` (``SafeUnpickler``, ``decode``, ``parse_file``);
- ``interning.py``: one object for each distinct text and shape across the dumps, and what each dump keeps;
- ``reading.py``: the directory and its files (``read_regular``, ``load_file``, ``load_dir``);
- ``views.py``: parsed dumps -> rank states, group histories, memberships and the dumps' time.
"""

from __future__ import annotations

from frexporter.fr import trace
from frexporter.postmortem.dumpfiles.bounds import (
    CONTAINERS_PER_ENTRY,
    ENTRY_BYTES,
    JSON_VALUES_PER_ENTRY,
    KEYS_PER_ENTRY,
    MAX_DUMP_BYTES,
    MAX_FILE_CONTAINERS,
    MAX_FILE_NUMBERS,
    MAX_FILE_STRINGS,
    MAX_JSON_BYTES,
    MAX_JSON_KEYS,
    MAX_JSON_VALUES,
    MAX_PARSED_BYTES,
    MAX_PICKLE_VALUES,
    NUMBERS_PER_ENTRY,
    PG_STATUS_BYTES,
    PICKLE_VALUES_PER_ENTRY,
    STRINGS_PER_ENTRY,
    check_json,
    check_pickle,
)
from frexporter.postmortem.dumpfiles.decoding import (
    DumpError,
    RankDump,
    SafeUnpickler,
    decode,
    parse_file,
    rank_of,
    safe_loads,
)
from frexporter.postmortem.dumpfiles.interning import Interner as _Interner
from frexporter.postmortem.dumpfiles.interning import compact as _compact
from frexporter.postmortem.dumpfiles.reading import load_dir, load_file, read_regular
from frexporter.postmortem.dumpfiles.views import (
    Membership,
    dump_time,
    histories,
    memberships,
    rank_states,
    with_pg_ids,
)
from frexporter.postmortem.dumpfiles.views import settle_completion_lag as _settle_completion_lag

# The names the module had before it became a package, all still importable from here (the underscored ones
# and ``trace`` for tests that reason about its internals).
__all__ = [
    "CONTAINERS_PER_ENTRY",
    "ENTRY_BYTES",
    "JSON_VALUES_PER_ENTRY",
    "KEYS_PER_ENTRY",
    "MAX_DUMP_BYTES",
    "MAX_FILE_CONTAINERS",
    "MAX_FILE_NUMBERS",
    "MAX_FILE_STRINGS",
    "MAX_JSON_BYTES",
    "MAX_JSON_KEYS",
    "MAX_JSON_VALUES",
    "MAX_PARSED_BYTES",
    "MAX_PICKLE_VALUES",
    "NUMBERS_PER_ENTRY",
    "PG_STATUS_BYTES",
    "PICKLE_VALUES_PER_ENTRY",
    "STRINGS_PER_ENTRY",
    "DumpError",
    "Membership",
    "RankDump",
    "SafeUnpickler",
    "_Interner",
    "_compact",
    "_settle_completion_lag",
    "check_json",
    "check_pickle",
    "decode",
    "dump_time",
    "histories",
    "load_dir",
    "load_file",
    "memberships",
    "parse_file",
    "rank_of",
    "rank_states",
    "read_regular",
    "safe_loads",
    "trace",
    "with_pg_ids",
]
