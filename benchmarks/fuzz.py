"""Fuzzing of every parser of outside data: spool files, FR dumps (JSON and pickle), worker-server and
Prometheus answers, py-spy's dump text, the web config file and the Authorization header.

Each target takes bytes (the outside data as it arrives) and runs the parser plus what consumes its
result. A case passes when it returns or raises one of the target's documented error types, its CPU
time stays under the per-case budget (50 ms; 2 s for the web config, read once at start-up), and nothing
was imported or executed on the way (pickles).
Anything else is a failure, reported with the input that caused it.

Two engines:
  hypothesis  structured generation (valid documents with one field mutated, random JSON, byte-level
              mutations of valid files, pickles of arbitrary plain data, hostile pickles, huge/deep input)
  atheris     coverage-guided libFuzzer (``pip install atheris``), seeded with the same valid files

Run by hand: ``python -m benchmarks.fuzz --cases 100000 [--engine hypothesis|atheris|both] [--target NAME]``.
Every (engine, target) runs in its own subprocess with a wall-clock limit, so a parser that hangs inside
C code (where no Python signal handler can run) is reported as a hang instead of stalling the run.
``tests/unit/test_fuzz_slice.py`` and ``tests/e2e/test_fuzz_slice.py`` run a short deterministic hypothesis
slice of the same targets in CI.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import contextlib
import gc
import json
import math
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from frexporter import safetext, spool
from frexporter.analysis import history
from frexporter.analysis.past_verdicts import lagging_verdict, past_mismatch_verdict
from frexporter.analysis.verdicts import VerdictConfig, evaluate
from frexporter.fr import trace
from frexporter.fr.domain import translate
from frexporter.postmortem import dumpfiles, prometheus, report
from frexporter.sources import pyspy, worker_client
from frexporter.sources.base import SourceError
from frexporter.spool import INT_MAX, INT_MIN, SpoolError

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

REPO = Path(__file__).resolve().parent.parent
CASE_CPU_BUDGET_S = 0.050  # per case, uninstrumented; inputs stay within the parsers' own size limits
HANG_ALARM_S = 5.0  # a Python-level loop this long is a hang (C-level hangs: the worker's wall limit)
MEMORY_LIMIT_BYTES = 4 << 30  # a runaway allocation in a worker becomes a MemoryError, not an OOM kill
EXAMPLE_BYTES = 600  # how much of a failing input a report quotes

# A pickle that reaches any of these has made the unpickler run code or import something.
CANARY: list[str] = []
# Modules loaded before a case; a case that adds one made a parser import something (json decoding
# bytes in UTF-16/32 loads that codec from ``encodings``, which is no import a pickle asked for).
_KNOWN_MODULES: set[str] = set()


_SCRATCH_ENV = "FREXPORTER_FUZZ_SCRATCH"
_SCRATCH: list[str] = []


def scratch(prefix: str) -> str:
    """A new directory for this process's files. They all go at exit, or, for a worker that libFuzzer ends
    without running Python's atexit, when the orchestrator removes the root it named in the environment."""
    if not _SCRATCH:
        root = os.environ.get(_SCRATCH_ENV) or tempfile.mkdtemp(prefix="frexporter-fuzz-")
        if _SCRATCH_ENV not in os.environ:
            atexit.register(shutil.rmtree, root, True)
        _SCRATCH.append(root)
    return tempfile.mkdtemp(prefix=prefix, dir=_SCRATCH[0])


def _canary(*args: object) -> None:
    CANARY.append(repr(args)[:80])


class Skip(Exception):
    """The input never reaches this parser in production (e.g. not JSON where JSON is decoded first)."""


class Hang(BaseException):
    """Raised by the per-case alarm; a BaseException so that no parser's ``except Exception`` eats it."""


class Failure(Exception):
    """A case broke the contract; ``signature`` groups failures with the same cause."""

    def __init__(self, signature: str, detail: str) -> None:
        super().__init__(f"{signature}: {detail}")
        self.signature = signature
        self.detail = detail


# ------------------------------------------------------------------------------------------ seeds

GLOO_ENTRY: dict[str, Any] = {
    "record_id": 0, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": 1, "p2p_seq_id": 0,
    "op_id": 1, "profiling_name": "gloo:all_reduce", "time_created_ns": 1795331103554771211,
    "input_sizes": [[4, 3]], "input_dtypes": ["Float"], "output_sizes": [[4, 3]], "output_dtypes": ["Float"],
    "state": "scheduled", "time_discovered_started_ns": 0, "time_discovered_completed_ns": 0, "retired": True,
    "timeout_ms": 1800000, "is_p2p": False,
}
NCCL_ENTRY: dict[str, Any] = {
    **GLOO_ENTRY, "record_id": 1, "pg_id": 1, "process_group": ["1", "tp"], "collective_seq_id": 7,
    "profiling_name": "nccl:all_gather", "state": "started", "retired": False, "duration_ms": 1.5,
    "timeout_ms": 600000, "frames": [{"name": "f", "filename": "x.py", "line": 3}],
}
P2P_ENTRY: dict[str, Any] = {
    **GLOO_ENTRY, "record_id": 2, "collective_seq_id": 0, "p2p_seq_id": 4, "profiling_name": "gloo:send 0->1",
    "is_p2p": True,
}


def json_dump_doc() -> dict[str, Any]:
    """An FR dump as the JSON handlers return it: string ``pg_status`` values, list ``process_group``."""
    return {
        "version": "2.10",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
        "pg_status": {"0": {"last_enqueued_collective": "2", "last_started_collective": "-1",
                            "last_completed_collective": "1"},
                      "1": {"last_enqueued_collective": "7", "last_started_collective": "7",
                            "last_completed_collective": "6"}},
        "entries": [GLOO_ENTRY, NCCL_ENTRY, P2P_ENTRY],
    }


def pickle_dump_doc() -> dict[str, Any]:
    """The same dump as torch pickles it: int ``pg_status`` values, tuple ``process_group``, None times."""
    doc = json_dump_doc()
    doc["pg_status"] = {int(k): {f: int(v) for f, v in s.items()} for k, s in doc["pg_status"].items()}
    doc["entries"] = [{**e, "process_group": tuple(e["process_group"]), "time_discovered_started_ns": None}
                      for e in doc["entries"]]
    return doc


def manifest_doc() -> dict[str, Any]:
    from tests import spoolgen

    return spoolgen.manifest("job-7", 3, pgs=3, world=8, socket="s0123456789ab.sock")


def snapshot_doc() -> dict[str, Any]:
    from tests import spoolgen

    doc = spoolgen.snapshot(100003, pgs=3, seq=12, counter=4, when=1.7e9)
    doc["errors"] = {"snapshot_failed": 2}
    return doc


def snapshot_map_doc() -> dict[str, Any]:
    """The mapped snapshot's JSON: torch's whole status answer per recorder."""
    doc = snapshot_doc()
    doc["format"] = spool.SNAPSHOT_MAP_FORMAT
    doc["status"] = {recorder: {"version": "2.10", "pg_config": {}, "pg_status": status}
                     for recorder, status in doc["status"].items()}
    return doc


def snapshot_map_seeds() -> list[bytes]:
    """Mapped snapshot files as the recorder writes them: fresh, grown, and mid-update (odd sequence)."""
    directory = scratch("map-seeds-")
    path = os.path.join(directory, "seed" + spool.SNAPSHOT_MAP_SUFFIX)
    writer = spool.SnapshotMap(path)
    seeds = []
    for doc in (snapshot_map_doc(), {**snapshot_map_doc(), "message": "x" * 70_000}):
        writer.write(_json(doc))
        with open(path, "rb") as f:
            seeds.append(f.read())
    writer.close()
    torn = bytearray(seeds[0])
    torn[8] += 1  # an odd sequence: the writer is inside an update
    return [seeds[0][:4096], seeds[1][:65536], bytes(torn[:4096])]


def prom_doc() -> dict[str, Any]:
    def sample(metric: str, rank: int, pg: str, value: str) -> dict[str, Any]:
        return {"metric": {"__name__": metric, "job_id": "j", "rank": str(rank), "pg": pg, "pg_desc": "default_pg",
                           "hostname": "node-a", "local_rank": str(rank), "world_size": "2", "pid": "42"},
                "value": [1.7e9, value]}

    return {"status": "success", "data": {"resultType": "vector", "result": [
        sample("frexporter_pg_last_enqueued_seq", 0, "0", "12"),
        sample("frexporter_pg_last_enqueued_seq", 1, "0", "11"),
        sample("frexporter_pg_oldest_inflight_start_timestamp_seconds", 0, "0", "1699999000.5"),
        sample("frexporter_rank_up", 1, "0", "1"),
    ]}}


def prom_seeds() -> list[bytes]:
    """prom_doc, and answers that reach what ``analyze --prometheus`` refuses or repairs: integer labels that
    int() takes and no exporter writes, lone surrogates in labels (escaped and UTF-8 encoded), seqs that are no
    whole numbers, a PG spanning a world with an absent rank, nesting deeper than the stack."""
    base = _json(prom_doc())
    hostile_ints = (base.replace(b'"rank": "1"', b'"rank": "\\u0663"', 1)
                    .replace(b'"local_rank": "0"', b'"local_rank": "+0"', 1)
                    .replace(b'"pid": "42"', b'"pid": "99999999999999999999"', 1))
    surrogates = base.replace(b'"hostname": "node-a"', b'"hostname": "\\udc80"', 1).replace(
        b'"job_id": "j"', b'"job_id": "j\xed\xb2\x80"', 1)
    seqs = base.replace(b'"12"', b'"1e300"').replace(b'"11"', b'"7.5"')
    world = base.replace(b'"world_size": "2"', b'"world_size": "3", "size": "3"')
    deep = b'{"status": "success", "data": {"resultType": "vector", "result": ' + b"[" * 8000 + b"]" * 8000 + b"}}"
    return [base, hostile_ints, surrogates, seqs, world, deep]


class _Reduce:
    """Pickles as ``func(*args)``: how a hostile dump smuggles a call in."""

    def __init__(self, func: Callable[..., object], *args: object) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        return self.func, self.args


def _dag(depth: int) -> list[Any]:
    """A list that holds the previous level twice: pickle memoizes it, so the file stays tiny while
    ``str()`` of it (or any naive walk) is exponential in ``depth``."""
    node: list[Any] = ["x"]
    for _ in range(depth):
        node = [node, node]
    return node


def hostile_pickles() -> list[bytes]:
    exec_canary = "import benchmarks.fuzz as f; f.CANARY.append('exec')"
    payloads: list[object] = [
        _Reduce(_canary, "reduce"),
        _Reduce(exec, exec_canary),
        _Reduce(eval, "__import__('benchmarks.fuzz').fuzz._canary('eval')"),
        {**pickle_dump_doc(), "entries": [{**GLOO_ENTRY, "profiling_name": _Reduce(_canary, "nested")}]},
        {**pickle_dump_doc(), "version": _dag(60)},
        {**pickle_dump_doc(), "pg_config": {"0": {"name": "0", "ranks": _dag(60)}}},
        {**pickle_dump_doc(), "entries": [{**GLOO_ENTRY, "process_group": (_dag(60), "x")},
                                          {**GLOO_ENTRY, "input_dtypes": [_dag(60)]}]},
        {**pickle_dump_doc(), "entries": [GLOO_ENTRY] * 1000},  # memo refs: 1000 entries from 2 bytes each
        # ... each with the same 1024 shapes: 20 million tensor size values from a few kilobytes
        {**pickle_dump_doc(), "entries": [{**GLOO_ENTRY, "input_sizes": [[1]] * 1024}] * 10_000},
        {**pickle_dump_doc(), "version": 10**5000, "pg_status": {10**5000: {"last_enqueued_collective": 10**400}}},
        # text that is not Unicode (a lone surrogate) or that would break a line or drive a terminal
        {**pickle_dump_doc(), "entries": [{**GLOO_ENTRY, "process_group": ("0", "x\udc80\n\x1b]0;t\x07\u202e")}]},
        {**pickle_dump_doc(), "pg_config": {"0": {"name": "0", "ranks": "[" * 5000 + "]" * 5000}}},  # nested text
    ]
    out = []
    for payload in payloads:
        for proto in (0, 2, 5):
            with contextlib.suppress(ValueError):  # protocol 0 writes ints as text, limited to 4300 digits
                out.append(pickle.dumps(payload, protocol=proto))
    out += [
        b"cbuiltins\nexec\n(V" + exec_canary.encode() + b"\ntR.",  # protocol 0 GLOBAL + REDUCE
        b"(ibenchmarks.fuzz\n_canary\nS'inst'\n.",  # INST: instantiate by module and name
        b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\x08builtins\x8c\x04exec\x93.",  # STACK_GLOBAL
        b"\x80\x02X\x01\x00\x00\x00xQ.",  # BINPERSID without persistent_load
        b"\x80\x02\x82\x01.",  # EXT1: the copyreg extension registry
        b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01h\x00u.",  # a dict that contains itself
        b"\x80\x04" + b"N" * 60_000 + b".",  # a flood of NONE opcodes: 60,000 stacked references
        b"\x80\x04" + b"}" * 30_000 + b".",  # 30,000 dicts from a byte each
        b"\x80\x02" + b"]" * 20_000 + b"a" * 19_999 + b".",  # lists nested 20,000 deep
    ]
    return out


def pickle_seeds() -> list[bytes]:
    docs = [pickle_dump_doc(), json_dump_doc(), {"version": "2.4", "pg_config": {}, "entries": ()}, [], {}, 0]
    hostile_json = [b'{"version": "2.10", "entries": [' + b"[" * 20_000 + b"]" * 20_000 + b"]}",
                    b'{"version": "2.10", "entries": [' + b"{}," * 10_000 + b"{}]}",
                    _json({**json_dump_doc(), "entries": [{**GLOO_ENTRY, "process_group": ["0", "x\udc80\n\x1b"]}]})]
    return ([pickle.dumps(d, protocol=p) for d in docs for p in range(pickle.HIGHEST_PROTOCOL + 1)] + hostile_pickles()
            + hostile_json)


def http_seeds() -> list[bytes]:
    body = json.dumps(json_dump_doc()).encode()
    chunks = b"".join(f"{len(body[i:i + 100]):x}\r\n".encode() + body[i:i + 100] + b"\r\n"
                      for i in range(0, len(body), 100))
    return [
        b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\npong",
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode() + b"\r\nConnection: keep-alive\r\n\r\n" + body,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked\r\n\r\n4;ext=1\r\npong\r\n0\r\nTrailer: x\r\n\r\n",
        b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\nnot found",
        b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 14\r\n\r\nKeyError('0')",
        b"HTTP/1.0 200 OK\r\n\r\nbody until EOF",
    ]


def pyspy_seeds() -> list[bytes]:
    """Real py-spy 0.4 output (torch's pyspy_dump answer, a deep stack, --native, forced colours)."""
    return [path.read_bytes() for path in sorted((REPO / "tests" / "golden" / "pyspy").glob("*.txt"))]


def chunk_seeds() -> list[bytes]:
    return [b"4\r\npong\r\n0\r\n\r\n", b"4;x=y\r\npong\r\n2\r\nab\r\n0\r\n\r\n", b"0\r\n\r\n",
            b"A\r\n0123456789\r\n0\r\n"]


def _json(doc: object) -> bytes:
    return json.dumps(doc).encode()


SURROGATE = "\udc80"  # JSON's spelling of a byte that was not UTF-8


def _surrogates(doc: Any) -> Any:
    """``doc`` with a lone surrogate appended to every string value in it (keys are the format's own)."""
    if isinstance(doc, str):
        return doc + SURROGATE
    if isinstance(doc, list):
        return [_surrogates(v) for v in doc]
    if isinstance(doc, dict):
        return {k: _surrogates(v) for k, v in doc.items()}
    return doc


def text_seeds(doc: dict[str, Any]) -> list[bytes]:
    """``doc``, the same with lone surrogates in its strings (and an error kind), and nesting deeper than the
    JSON parser allows."""
    odd = {k: (_surrogates(v) if k not in ("format", "state", "status", "pg_status") else v) for k, v in doc.items()}
    if "errors" in odd:
        odd["errors"] = {"kind" + SURROGATE: 1}
    return [_json(doc), _json(odd), b"[" * 100_000 + b"]" * 100_000,
            _json({**doc, "entries": [{}] * 2000}) if "entries" in doc else _json({**doc, "x": [[[[[]]]]]})]


# ------------------------------------------------------------------------------------------ bounds
#
# Documents with one list or string at a parser's bound (``over=0``: accepted) or one past it (``over=1``:
# refused with a spool.LIMIT_REASONS reason). Each is cheap enough for the per-case CPU budget, except a
# dump at MAX_ENTRIES (tests/e2e/test_spool_bounds.py has it): only one past that bound is generated.


def _with_pg0(doc: dict[str, Any], **fields: Any) -> dict[str, Any]:
    doc["process_groups"][0].update(fields)
    return doc


def _set_status(doc: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    if doc["format"] == spool.SNAPSHOT_MAP_FORMAT:
        status = {r: {"version": "2.10", "pg_config": {}, "pg_status": st} for r, st in status.items()}
    doc["status"] = status
    return doc


_PG_STATUS = {"last_enqueued_collective": "2", "last_started_collective": "-1", "last_completed_collective": "1"}
_TEXT_FIELDS = ("job_id", "hostname", "torch_version", "gpu_uuid", "socket")
_NAME_LISTS = ("handlers", "recorders", "backends")

MANIFEST_BOUNDS: dict[str, Callable[[dict[str, Any], int], dict[str, Any]]] = {
    "members": lambda d, over: _with_pg0(d, ranks=list(range(spool.MAX_PG_MEMBERS + over))),
    "total_members": lambda d, over: {**d, "process_groups": [
        {"name": str(i), "ranks": [0] * (spool.MAX_MANIFEST_MEMBERS // 4 + (over if i == 3 else 0))}
        for i in range(4)]},
    "groups": lambda d, over: {**d, "process_groups": [{"name": str(i), "ranks": []}
                                                       for i in range(spool.MAX_PGS + over)]},
    "rank_value": lambda d, over: _with_pg0(d, ranks=[0, spool.MAX_RANK + over]),
    **{f"text_{f}": (lambda d, over, f=f: {**d, f: "x" * (spool.MAX_TEXT_CHARS + over)}) for f in _TEXT_FIELDS},
    **{f"pg_{f}": (lambda d, over, f=f: _with_pg0(d, **{f: "x" * (spool.MAX_TEXT_CHARS + over)}))
       for f in ("name", "desc", "backend")},
    **{f"list_{f}": (lambda d, over, f=f: {**d, f: ["fr"] * (spool.MAX_NAMES + over)}) for f in _NAME_LISTS},
    **{f"name_{f}": (lambda d, over, f=f: {**d, f: ["x" * (spool.MAX_TEXT_CHARS + over)]}) for f in _NAME_LISTS},
    "local_ids": lambda d, over: _with_pg0(d, local_ids={f"r{i}": i for i in range(spool.MAX_NAMES + over)}),
}
SNAPSHOT_BOUNDS: dict[str, Callable[[dict[str, Any], int], dict[str, Any]]] = {
    "pg_status": lambda d, over: _set_status(d, {"fr": {str(i): _PG_STATUS for i in range(spool.MAX_PGS + over)}}),
    "recorders": lambda d, over: _set_status(d, {f"r{i}": {} for i in range(spool.MAX_RECORDERS + over)}),
    "recorder_name": lambda d, over: _set_status(d, {"x" * (spool.MAX_TEXT_CHARS + over): {}}),
    "errors": lambda d, over: {**d, "errors": {f"e{i}": 1 for i in range(spool.MAX_ERROR_KINDS + over)}},
    "error_kind": lambda d, over: {**d, "errors": {"e" * (spool.MAX_ERROR_KIND_CHARS + over): 1}},
    "state": lambda d, over: {**d, "state": "x" * (spool.MAX_TEXT_CHARS + over)},
    "message": lambda d, over: {**d, "message": "x" * (spool.MAX_MESSAGE_CHARS * 100 + over)},  # cut, not refused
}


def _with_entry(doc: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {**doc, "entries": [{**doc["entries"][0], **fields}, *doc["entries"][1:]]}


DUMP_BOUNDS: dict[str, Callable[[dict[str, Any], int], dict[str, Any]]] = {
    "entries": lambda d, over: {**d, "entries": [0] * (trace.MAX_ENTRIES + 1)},  # see above: past it only
    "tensors": lambda d, over: _with_entry(d, input_sizes=[[1]] * (trace.MAX_ENTRY_TENSORS + over)),
    "dims": lambda d, over: _with_entry(d, output_sizes=[[1] * (trace.MAX_TENSOR_DIMS + over)]),
    "dtypes": lambda d, over: _with_entry(d, input_dtypes=["Float"] * (trace.MAX_ENTRY_TENSORS + over)),
    "dtype": lambda d, over: _with_entry(d, output_dtypes=["x" * (trace.MAX_WORD_CHARS + over)]),
    "pg_name": lambda d, over: _with_entry(d, process_group=["x" * (spool.MAX_TEXT_CHARS + over), "d"]),
    "pg_desc": lambda d, over: _with_entry(d, process_group=["0", "x" * (spool.MAX_TEXT_CHARS + over)]),
    "op": lambda d, over: _with_entry(d, profiling_name="x" * (trace.MAX_OP_CHARS + over)),
    "state": lambda d, over: _with_entry(d, state="x" * (trace.MAX_WORD_CHARS + over)),
    "pg_status": lambda d, over: {**d, "pg_status": {str(i): _PG_STATUS for i in range(spool.MAX_PGS + over)}},
    "pg_config": lambda d, over: {**d, "pg_config": {str(i): {} for i in range(spool.MAX_PGS + over)}},
    "pg_config_keys": lambda d, over: {**d, "pg_config": {"0": {f"k{i}": "v" for i in
                                                                range(trace.MAX_CONFIG_VALUES + over)}}},
    "pg_config_key": lambda d, over: {**d, "pg_config": {"0": {"k" * (trace.MAX_CONFIG_KEY_CHARS + over): ""}}},
}
# Every entry one reference to the same 1024 one-dimension shapes (2048 size values), as a pickle memo can.
_SHARED_SIZES = [[1]] * 1024


def size_values_pickle(over: int) -> bytes:
    entry = {**GLOO_ENTRY, "input_sizes": _SHARED_SIZES, "output_sizes": [], "input_dtypes": [], "output_dtypes": []}
    count = trace.MAX_SIZE_VALUES // (2 * len(_SHARED_SIZES)) + over
    return pickle.dumps({**pickle_dump_doc(), "entries": [entry] * count}, protocol=pickle.HIGHEST_PROTOCOL)


def bound_doc(kind: str, case: str, over: int) -> dict[str, Any]:
    """A valid document of ``kind`` with the bound ``case`` met (``over=0``) or passed by one (``over=1``)."""
    base, cases = {"manifest": (manifest_doc, MANIFEST_BOUNDS), "snapshot": (snapshot_doc, SNAPSHOT_BOUNDS),
                   "snapshot_map": (snapshot_map_doc, SNAPSHOT_BOUNDS), "dump": (json_dump_doc, DUMP_BOUNDS)}[kind]
    return cases[case](base(), over)


# ------------------------------------------------------------------------------------------ invariants


def _check_int(value: int, what: str) -> None:
    if not (isinstance(value, int) and INT_MIN <= value <= INT_MAX):
        raise Failure("invariant", f"{what} = {value!r:.80} is not a 64-bit int")


def _check_float(value: float | None, what: str, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not (isinstance(value, float) and math.isfinite(value)):
        raise Failure("invariant", f"{what} = {value!r:.80} is not a finite float")


def _check_bound(size: int, bound: int, what: str) -> None:
    if size > bound:
        raise Failure("invariant", f"{what}: {size} is past the parser's bound of {bound}")


def _check_text(text: str, what: str) -> None:
    """Every string a parser hands on encodes as UTF-8: one that does not fails every /metrics render."""
    if not safetext.is_valid(text):
        raise Failure("invariant", f"{what} holds a lone surrogate: {text!r:.60}")


def _check_manifest(m: spool.Manifest) -> None:
    for name in ("rank", "local_rank", "world_size", "pid", "fr_buffer_size", "generation"):
        _check_int(getattr(m, name), f"manifest.{name}")
    _check_float(m.start_time, "manifest.start_time")
    if m.rank < 0:
        raise Failure("invariant", "manifest.rank < 0")
    _check_bound(len(m.process_groups), spool.MAX_PGS, "process groups")
    _check_bound(sum(len(pg.ranks) for pg in m.process_groups), spool.MAX_MANIFEST_MEMBERS, "members in all")
    for text in (m.job_id, m.hostname, m.torch_version, m.gpu_uuid, m.socket, *m.handlers, *m.recorders,
                 *m.backends):
        _check_bound(len(text), spool.MAX_TEXT_CHARS, "manifest text")
        _check_text(text, "manifest text")
    for names in (m.handlers, m.recorders, m.backends):
        _check_bound(len(names), spool.MAX_NAMES, "names")
    for pg in m.process_groups:
        _check_float(pg.timeout_seconds, "pg.timeout_seconds", optional=True)
        _check_bound(len(pg.ranks), spool.MAX_PG_MEMBERS, "members")
        for text in (pg.name, pg.desc, pg.backend, *pg.local_ids):
            _check_bound(len(text), spool.MAX_TEXT_CHARS, "pg text")
            _check_text(text, "pg text")
        previous = -1
        for r in pg.ranks:
            _check_int(r, "pg.ranks[]")
            if not previous < r <= spool.MAX_RANK:
                raise Failure("invariant", f"pg.ranks not sorted, distinct ranks from 0 to MAX_RANK at {r}")
            previous = r
    if "/" in m.socket:
        raise Failure("invariant", f"manifest.socket {m.socket!r} leaves the spool directory")


def _check_status(status: dict[int, spool.RawPGStatus], what: str) -> None:
    _check_bound(len(status), spool.MAX_PGS, f"{what} entries")
    for pg_id, s in status.items():
        _check_int(pg_id, f"{what} pg id")
        for name in ("enqueued", "started", "completed"):
            _check_int(getattr(s, name), f"{what}[{pg_id}].{name}")


def _check_snapshot(s: spool.Snapshot) -> None:
    _check_int(s.pid, "snapshot.pid")
    _check_int(s.counter, "snapshot.counter")
    _check_float(s.time, "snapshot.time")
    _check_float(s.interval, "snapshot.interval")
    for recorder, status in s.status.items():
        _check_status(dict(status), f"snapshot.status.{recorder}")
    for reason, count in s.errors.items():
        _check_int(count, f"snapshot.errors[{reason!r}]")
        _check_bound(len(reason), spool.MAX_ERROR_KIND_CHARS, "error kind")
        _check_text(reason, "error kind")
    for text in (s.state, s.message, *s.status):
        _check_text(text, "snapshot text")
    _check_bound(len(s.status), spool.MAX_RECORDERS, "recorders")
    _check_bound(len(s.errors), spool.MAX_ERROR_KINDS, "error kinds")
    _check_bound(len(s.message), spool.MAX_MESSAGE_CHARS, "message")
    _check_bound(len(s.state), spool.MAX_TEXT_CHARS, "state")


def _check_dump(dump: trace.FrDump) -> None:
    _check_status(dump.pg_status, "pg_status")
    _check_bound(len(dump.entries), trace.MAX_ENTRIES, "entries")
    _check_bound(len(dump.pg_config), spool.MAX_PGS, "pg_config entries")
    # The parser hands entries that shared a list in the dump one tuple: check each once, count every use.
    checked: dict[int, int] = {}
    values = 0
    for e in dump.entries:
        for name in ("record_id", "pg_id", "collective_seq_id", "p2p_seq_id", "op_id", "time_created_ns"):
            _check_int(getattr(e, name), f"entry.{name}")
        if e.timeout_ms is not None:
            _check_int(e.timeout_ms, "entry.timeout_ms")
        for text, bound in ((e.pg_name, spool.MAX_TEXT_CHARS), (e.pg_desc, spool.MAX_TEXT_CHARS),
                            (e.profiling_name, trace.MAX_OP_CHARS), (e.state, trace.MAX_WORD_CHARS)):
            _check_bound(len(text), bound, "entry text")
            _check_text(text, "entry text")
        for items in (e.input_sizes, e.output_sizes, e.input_dtypes, e.output_dtypes):
            cost = checked.get(id(items))
            if cost is None:
                cost = checked[id(items)] = _check_items(items)
            values += cost
    _check_bound(values, trace.MAX_SIZE_VALUES, "tensor size values")
    for name, cfg in dump.pg_config.items():
        if not isinstance(name, str) or not all(isinstance(v, str) for v in cfg.values()):
            raise Failure("invariant", f"pg_config[{name!r:.40}] holds non-text values")
        for text in (name, *cfg, *cfg.values()):
            _check_text(text, "pg_config text")
    translate(dump)  # collective-domain progress is derived from these values in the exporter


def _check_items(items: tuple[tuple[int, ...], ...] | tuple[str, ...]) -> int:
    """Check an entry's shapes or dtypes; returns what they cost of MAX_SIZE_VALUES."""
    _check_bound(len(items), trace.MAX_ENTRY_TENSORS, "tensors of an entry")
    cost = 0
    for item in items:
        if isinstance(item, str):
            _check_bound(len(item), trace.MAX_WORD_CHARS, "dtype")
            cost += 1
            continue
        _check_bound(len(item), trace.MAX_TENSOR_DIMS, "dimensions")
        for d in item:
            _check_int(d, "entry size")
        cost += 1 + len(item)
    return cost


# ------------------------------------------------------------------------------------------ targets


# Every reason a spool file or FR dump is refused with: a label value of frexporter_source_errors_total.
SPOOL_REASONS = frozenset({"invalid", "foreign", "unknown_version", "oversized", "truncated", "corrupt", "torn",
                           "missing", "permission", "io", *spool.LIMIT_REASONS})


@contextlib.contextmanager
def _known_reason() -> Iterator[None]:
    try:
        yield
    except SpoolError as e:
        if e.reason not in SPOOL_REASONS:
            raise Failure("reason", f"SpoolError with reason {e.reason!r:.80}, not one of the documented ones") from e
        raise


def _json_or_skip(data: bytes) -> object:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise Skip from e


def run_parse_manifest(data: bytes) -> None:
    with _known_reason():
        _check_manifest(spool.parse_manifest(_json_or_skip(data)))


def run_parse_snapshot(data: bytes) -> None:
    with _known_reason():
        _check_snapshot(spool.parse_snapshot(_json_or_skip(data)))


class _FileBench:
    """Paths of every kind a spool file name can point at, made once per process."""

    KINDS = ("regular", "regular", "regular", "regular", "directory", "missing", "fifo", "dangling_link",
             "link_to_regular")
    LIMITS = (spool.MAX_SNAPSHOT_BYTES, spool.MAX_MANIFEST_BYTES, 1, 16, 256, 4096, 65536)

    def __init__(self) -> None:
        self.root = scratch("files-")
        self.regular = os.path.join(self.root, "r.snapshot.json")
        self.paths = {"regular": self.regular, "directory": os.path.join(self.root, "d.snapshot.json"),
                      "missing": os.path.join(self.root, "missing.snapshot.json"),
                      "fifo": os.path.join(self.root, "f.snapshot.json"),
                      "dangling_link": os.path.join(self.root, "l.snapshot.json"),
                      "link_to_regular": os.path.join(self.root, "lr.snapshot.json")}
        os.mkdir(self.paths["directory"])
        os.mkfifo(self.paths["fifo"])
        os.symlink(os.path.join(self.root, "nowhere"), self.paths["dangling_link"])
        os.symlink(self.regular, self.paths["link_to_regular"])


_files: _FileBench | None = None


def run_read_json_file(data: bytes) -> None:
    """``data[0]`` picks the kind of path, ``data[1]`` the size limit, the rest is the file's content."""
    global _files
    if _files is None:
        _files = _FileBench()
    kind = _files.KINDS[data[0] % len(_files.KINDS)] if data else "regular"
    limit = _files.LIMITS[data[1] % len(_files.LIMITS)] if len(data) > 1 else spool.MAX_SNAPSHOT_BYTES
    with open(_files.regular, "wb") as f:
        f.write(data[2:])
    with _known_reason():
        obj = spool.read_json_file(_files.paths[kind], limit)
    # What the exporter does next with a file that decoded: both parsers must cope with any JSON.
    for parse, check in ((spool.parse_manifest, _check_manifest), (spool.parse_snapshot, _check_snapshot)):
        with contextlib.suppress(SpoolError), _known_reason():
            check(parse(obj))  # type: ignore[operator]


def run_read_snapshot_map(data: bytes) -> None:
    """The file's content is ``data``; read as the exporter reads a mapped snapshot, then parsed."""
    global _files
    if _files is None:
        _files = _FileBench()
    with open(_files.regular, "wb") as f:
        f.write(data)
    with _known_reason():
        _check_snapshot(spool.parse_snapshot(spool.read_snapshot_map(_files.regular)))


def run_parse_dump(data: bytes) -> None:
    with _known_reason():
        _check_dump(trace.parse_dump(_json_or_skip(data)))


# A rank that declares a small ring: an answer past its bounds is refused before it is parsed.
_SMALL_RING = trace.answer_bounds(64, 8)


def run_parse_answer(data: bytes) -> None:
    """A worker server's answer as the exporter reads it: bytes, bounded by the declared ring, then parsed."""
    try:
        dump = trace.parse_answer(bytearray(data), _SMALL_RING, "fuzz")
    except SpoolError as e:
        if e.reason not in (*spool.LIMIT_REASONS, "bad_response", "invalid", "foreign"):
            raise Failure("unknown reason", e.reason) from e
        if e.__context__ is not None or e.__cause__ is not None:
            raise Failure("invariant", "a refusal keeps the parse's exception (and its frames) alive") from e
        return
    _check_dump(dump)


_REFERENCE_DUMP = trace.parse_dump(json_dump_doc())


def _frdump_pipeline(obj: object) -> None:
    """What ``frexporter analyze DIR`` does with a decoded file, next to a well-formed peer rank."""
    with _known_reason():
        dump = trace.parse_dump(obj, "fuzz")
    _check_dump(dump)
    dumps = [dumpfiles.RankDump(rank=0, path="fuzz0", dump=dump, mtime=1.7e9),
             dumpfiles.RankDump(rank=1, path="fuzz1", dump=_REFERENCE_DUMP, mtime=1.7e9)]
    states = dumpfiles.rank_states(dumps)
    now = dumpfiles.dump_time(dumps)
    evaluate(states, now, VerdictConfig(stuck_after=0.0, complete_view=True))
    for group in dumpfiles.histories(dumps):  # the post-mortem's judgment of what already happened
        for past in history.past_mismatches(group):
            past_mismatch_verdict(past)
        if (lag := history.lagging(group, now)) is not None:
            lagging_verdict(lag, now)


def run_frdump_decode(data: bytes) -> None:
    _frdump_pipeline(dumpfiles.decode(data, "fuzz"))


def run_safe_loads(data: bytes) -> None:
    dumpfiles.safe_loads(data)


def evidence_doc() -> dict[str, Any]:
    """An evidence bundle's verdict.json as the exporter writes it."""
    verdict = {"kind": "missing_rank", "job_id": "train", "pg": "0", "pg_desc": "default_pg", "ranks": [2],
               "waiting_ranks": [0, 1], "seq": 5, "op": "all_reduce", "since": 1.7e9, "age_seconds": 700.0,
               "timeout_seconds": 600.0, "budget_used": 1.17, "summary": "Rank 2 never joined all_reduce #5",
               "details": {"unobserved_ranks": [2]}, "activity": {}}
    return {"verdict": verdict, "captured_at": 1.7e9, "bundle": {"name": "b", "mac": "00"},
            "files": {"fr_rank0.json": {"rank": 0, "handler": "fr_trace_json", "bytes": 4096}}}


def evidence_seeds() -> list[bytes]:
    shapes = [b"[1]", b"7", b'"verdict"', b'{"verdict": [1]}', b'{"verdict": "stalled"}', b"[" * 20_000 + b"]" * 20_000]
    return [_json(evidence_doc()), *shapes, b'{"verdict": {"job_id": "j\\udc80\\u001b[2J", "summary": 7}}']


def run_parse_evidence(data: bytes) -> None:
    recorded = report.parse_evidence(data, "fuzz")
    texts = recorded.values()
    if set(recorded) != {"kind", "summary", "job_id"} or not all(
            isinstance(v, str) and safetext.is_valid(v) and len(v) <= report.MAX_SUMMARY_CHARS for v in texts):
        raise Failure("invariant", "a recorded verdict that is not three valid texts within their bounds")


def run_parse_response(data: bytes) -> None:
    body = worker_client._parse_response(data, "fuzz.sock", "fr_trace_json")
    if not isinstance(body, bytes) or len(body) > len(data):
        raise Failure("invariant", "response body is not a slice of the response")


def run_dechunk(data: bytes) -> None:
    body = worker_client._dechunk(data, "fuzz.sock")
    if len(body) > len(data):
        raise Failure("invariant", "dechunked body is longer than its input")


def run_complete(data: bytes) -> None:
    # The read loop's end-of-response test sees the bytes received so far, in any number of chunks.
    cut = data[0] if data else 0
    chunks = [data[1:cut + 1], data[cut + 1:]] if cut else [data[1:]]
    if not isinstance(worker_client._complete(chunks), bool):
        raise Failure("invariant", "_complete returned a non-bool")


def run_pyspy_dump(data: bytes) -> None:
    frames = pyspy.parse_dump(data, "fuzz.sock")
    if len(frames) > spool.MAX_STACK_FRAMES:
        raise Failure("invariant", "more frames than the recorder's bound")
    for function, path, line in frames:
        if not (isinstance(function, str) and isinstance(path, str) and type(line) is int):
            raise Failure("invariant", "a frame that is not (str, str, int)")
        if not (function and path and 0 <= line <= INT_MAX and len(function) <= spool.MAX_FRAME_TEXT_CHARS
                and len(path) <= spool.MAX_FRAME_TEXT_CHARS):
            raise Failure("invariant", "a frame past the recorder's bounds")


def run_parse_query_response(data: bytes) -> None:
    for sample in prometheus.parse_query_response(data):
        if not isinstance(sample, dict) or not isinstance(sample.get("metric"), dict):
            raise Failure("invariant", "a sample without a metric object")
        try:  # lone surrogates are repaired where the answer is parsed: every label encodes
            "".join(k + v for k, v in sample["metric"].items()).encode()
        except UnicodeEncodeError as e:
            raise Failure("invariant", "a label that is not valid text (a lone surrogate)") from e


def run_prom_rank_states(data: bytes) -> None:
    """``analyze --prometheus``: one fuzzed answer stands in for every query the analysis makes."""
    samples = prometheus.parse_query_response(data)
    states = prometheus.rebuild(dict.fromkeys(prometheus.Query, samples), now=1.7e9).ranks
    if any(not 0 <= r.rank <= spool.MAX_RANK for r in states):
        raise Failure("invariant", "a rank that no rank label an exporter writes names")
    evaluate(states, 1.7e9, VerdictConfig(stuck_after=30.0, complete_view=True))


@dataclass(frozen=True)
class Target:
    name: str
    run: Callable[[bytes], None]
    allowed: tuple[type[BaseException], ...]
    seeds: Callable[[], list[bytes]]
    strategy: Callable[[], SearchStrategy[bytes]]
    max_len: int = 16384  # libFuzzer's input cap for this target
    # Per-case CPU budget (uninstrumented). Parsers the exporter runs on every poll or scrape get the tight
    # default; a file read once at start-up by its administrator only has to finish.
    cpu_budget_s: float = CASE_CPU_BUDGET_S


_STRATEGIES: list[Any] = []


def _strategies() -> Any:
    """Hypothesis is imported only where a strategy is built: the atheris engine runs without it."""
    if not _STRATEGIES:
        _STRATEGIES.append(_build_strategies())
    return _STRATEGIES[0]


def _build_strategies() -> Any:
    import copy
    import types

    from hypothesis import strategies as st

    edge_ints = [-1, 0, 1, 2**31, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 10**300, -(10**300)]
    ints = st.integers(-10, 10**6) | st.sampled_from(edge_ints) | st.integers()
    floats = st.floats(allow_nan=True, allow_infinity=True)
    texts = st.text(max_size=20) | st.sampled_from(
        ["", "0", "-1", "1_0", " 7 ", "1e400", "NaN", "inf", "Infinity", "+Inf", "\u0663", "\u00b2", "9" * 5000,
         "frexporter.manifest/1", "frexporter.snapshot/1", "frexporter.x/1", "../../etc/passwd", "a/b.sock"])
    scalars = st.none() | st.booleans() | ints | floats | texts
    json_values = st.recursive(
        scalars, lambda c: st.lists(c, max_size=6) | st.dictionaries(texts, c, max_size=6), max_leaves=40)

    def slots(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
        yield prefix
        items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, (list, tuple)) else ()
        for key, value in items:
            yield from slots(value, (*prefix, key))

    def apply(base: Any, edits: list[tuple[tuple[Any, ...], str, Any]]) -> Any:
        doc = copy.deepcopy(base)
        for path, op, value in edits:
            if not path:
                doc = value if op == "replace" else doc
                continue
            parent = doc
            try:
                for key in path[:-1]:
                    parent = parent[key]
                if not isinstance(parent, (dict, list)):
                    continue  # an earlier edit replaced a container on this path by a scalar or tuple
                if op == "replace":
                    parent[path[-1]] = value
                elif op == "delete":
                    del parent[path[-1]]
                elif isinstance(parent, dict):
                    parent[f"extra{len(parent)}"] = value
                else:
                    parent.append(value)
            except (KeyError, IndexError, TypeError):
                continue  # an earlier edit removed this slot
        return doc

    def mutated_doc(base: Any, values: SearchStrategy[Any] = json_values) -> SearchStrategy[Any]:
        """The realistic way files go wrong: a valid document with a few slots replaced, dropped or added."""
        edit = st.tuples(st.sampled_from(list(slots(base))), st.sampled_from(["replace", "replace", "delete", "add"]),
                         values)
        return st.builds(apply, st.just(base), st.lists(edit, min_size=1, max_size=3))

    def encode(doc: Any, ascii_only: bool) -> bytes:
        return json.dumps(doc, ensure_ascii=ascii_only).encode()

    def json_bytes(docs: SearchStrategy[Any]) -> SearchStrategy[bytes]:
        return st.builds(encode, docs, st.booleans())

    byte_edit = st.tuples(st.sampled_from(["flip", "insert", "delete", "truncate", "duplicate", "digits"]),
                          st.integers(0, 1 << 20), st.integers(1, 64), st.binary(min_size=1, max_size=8))

    def mutate_bytes(seed: bytes, edits: list[tuple[str, int, int, bytes]]) -> bytes:
        b = bytearray(seed)
        for op, pos, n, extra in edits:
            i = pos % (len(b) + 1)
            if op == "flip" and b:
                b[i % len(b)] ^= extra[0] or 1
            elif op == "insert":
                b[i:i] = extra
            elif op == "delete":
                del b[i:i + n]
            elif op == "truncate":
                del b[i:]
            elif op == "duplicate":
                b[i:i] = b[i:i + n] * (1 + extra[0] % 8)
            elif op == "digits":
                b[i:i] = b"9" * (n * 80)  # numbers past int64, float range and the 4300-digit limit
        return bytes(b)

    def mutated_bytes(seeds: Sequence[bytes]) -> SearchStrategy[bytes]:
        return st.builds(mutate_bytes, st.sampled_from(list(seeds)), st.lists(byte_edit, min_size=1, max_size=6))

    # Nesting past the interpreter's recursion limit, within the smallest file size limit.
    deep = st.builds(lambda opener, n: (opener * n)[: spool.MAX_SNAPSHOT_BYTES],
                     st.sampled_from([b"[", b'{"a":', b'[{"x":', b'{"status":{"fr":{"0":']), st.integers(100, 200_000))

    def json_doc(base: dict[str, Any], bounds: SearchStrategy[bytes] | None = None) -> SearchStrategy[bytes]:
        extra = [bounds] if bounds is not None else []
        return st.one_of(json_bytes(mutated_doc(base)), json_bytes(mutated_doc(base)), json_bytes(json_values),
                         mutated_bytes([encode(base, True)]), deep, st.binary(max_size=200), *extra)

    def near_bounds(kind: str) -> SearchStrategy[bytes]:
        """Documents at a bound of the parsers, or one past it (the compact encoding the recorder writes)."""
        cases = {"manifest": MANIFEST_BOUNDS, "snapshot": SNAPSHOT_BOUNDS, "snapshot_map": SNAPSHOT_BOUNDS,
                 "dump": DUMP_BOUNDS}[kind]
        return st.builds(lambda case, over: json.dumps(bound_doc(kind, case, over), separators=(",", ":")).encode(),
                         st.sampled_from(sorted(cases)), st.integers(0, 1))

    def sized(n: int, filler: bytes) -> bytes:
        return b'{"pad":"' + filler * (n // len(filler)) + b'"}'

    near_limit = st.builds(sized, st.integers(spool.MAX_SNAPSHOT_BYTES - 32, spool.MAX_SNAPSHOT_BYTES + 32),
                           st.sampled_from([b" ", b"x", b"\\u00e9"]))

    def spool_file(manifest: dict[str, Any], snapshot: dict[str, Any]) -> SearchStrategy[bytes]:
        truncated = st.builds(lambda doc, cut: doc[:cut], st.sampled_from([encode(manifest, True),
                                                                            encode(snapshot, True)]),
                              st.integers(0, 400))
        content = st.one_of(json_doc(manifest, near_bounds("manifest")), json_doc(snapshot, near_bounds("snapshot")),
                            truncated, near_limit, st.binary(max_size=64))
        return st.builds(lambda kind, limit, body: bytes([kind, limit]) + body, st.integers(0, 255),
                         st.integers(0, 255), content)

    size_tokens = st.sampled_from([b"0", b"4", b"-1", b"-6", b"-0", b"+4", b"0x4", b"ffffffffffffffff", b" a ",
                                   b"1;ext=1", b"", b"\xff", b"4_0", b"9" * 5000])

    def chunk_body(chunks: list[tuple[bytes | None, bytes]], end: bool) -> bytes:
        out = b""
        for token, data in chunks:
            out += (token if token is not None else f"{len(data):x}".encode()) + b"\r\n" + data + b"\r\n"
        return out + (b"0\r\n\r\n" if end else b"")

    chunk_bodies = st.builds(chunk_body, st.lists(st.tuples(st.none() | size_tokens, st.binary(max_size=40)),
                                                   max_size=5), st.booleans())

    def chunked(seeds: Sequence[bytes]) -> SearchStrategy[bytes]:
        return st.one_of(chunk_bodies, mutated_bytes(seeds), st.binary(max_size=200))

    header_names = st.sampled_from([b"Content-Length", b"content-length", b"Transfer-Encoding", b"Connection",
                                    b"Content-Type", b"X", b"", b" Content-Length "])
    header_values = st.sampled_from([b"chunked", b"Chunked", b"identity", b"0", b"4", b"-1", b"-100", b"1e3",
                                     b" 5 ", b"0x10", b"99999999999999999999", b"9" * 5000, b"", b"close"])
    status_lines = st.sampled_from([b"HTTP/1.1 200 OK", b"HTTP/1.0 404 Not Found", b"HTTP/1.1 500 X",
                                    b"HTTP/1.1 2OO OK", b"HTTP/1.1", b"HTTP/1.1 -200 OK", b"HTTP/1.1 +200",
                                    b"HTTP/1.1 1_00 x", b"SSH-2.0-OpenSSH", b"", b"HTTP/1.1 200"])

    def http(status: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
        return status + b"".join(b"\r\n" + k + b": " + v for k, v in headers) + b"\r\n\r\n" + body

    def http_response(seeds: Sequence[bytes]) -> SearchStrategy[bytes]:
        structured = st.builds(http, status_lines, st.lists(st.tuples(header_names, header_values), max_size=4),
                               chunk_bodies | st.binary(max_size=64))
        return st.one_of(structured, structured, mutated_bytes(seeds), st.binary(max_size=300))

    # Built by map: hypothesis reprs sampled values, and repr() of a 5000-digit int raises.
    bignums = st.sampled_from([5000, 20000]).map(lambda digits: 10**digits)
    pickle_scalars = scalars | st.binary(max_size=20) | bignums | st.sampled_from([1j, b"\x80" * 3])
    pickle_values = st.recursive(
        pickle_scalars | st.frozensets(st.integers() | st.text(max_size=5), max_size=4),
        lambda c: st.lists(c, max_size=5) | st.tuples(c, c) | st.dictionaries(ints | texts, c, max_size=5),
        max_leaves=30)

    def dumps(value: Any, protocol: int) -> bytes:
        try:
            return pickle.dumps(value, protocol=protocol)
        except ValueError:  # protocol 0 writes ints as text, which stops at 4300 digits
            return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)

    def pickled(values: SearchStrategy[Any]) -> SearchStrategy[bytes]:
        return st.builds(dumps, values, st.integers(0, pickle.HIGHEST_PROTOCOL))

    def pickles(seeds: Sequence[bytes]) -> SearchStrategy[bytes]:
        return st.one_of(mutated_bytes(seeds), mutated_bytes(seeds), pickled(pickle_values),
                         st.binary(max_size=300))

    def dump_file(json_dump: dict[str, Any], pickle_dump: dict[str, Any], seeds: Sequence[bytes]
                  ) -> SearchStrategy[bytes]:
        return st.one_of(json_doc(json_dump, near_bounds("dump")), pickled(mutated_doc(pickle_dump, pickle_values)),
                         pickles(seeds), st.builds(size_values_pickle, st.integers(0, 1)))

    label_values = texts | st.sampled_from(["0", "1", "7", "-1", "01", "\u0663", "\u00b2", "1.0", "j", ""])
    sample_values = st.sampled_from(["12", "0", "1", "NaN", "+Inf", "-Inf", "1e400", "-1e308", "1699999000.5",
                                     "9" * 400, "x"]) | json_values
    label_names = st.sampled_from(["__name__", "job_id", "rank", "pg", "pg_desc", "hostname", "local_rank",
                                   "world_size", "pid", "torch_version", "gpu_uuid"])
    samples = st.fixed_dictionaries({
        "metric": st.dictionaries(label_names, label_values | json_values, max_size=8),
        "value": st.tuples(floats | json_values, sample_values).map(list) | json_values,
    })

    def answer(result: list[Any]) -> dict[str, Any]:
        return {"status": "success", "data": {"resultType": "vector", "result": result}}

    def prom_answer(doc: dict[str, Any]) -> SearchStrategy[bytes]:
        return st.one_of(json_bytes(st.lists(samples, max_size=12).map(answer)), json_doc(doc))

    deep_yaml = st.builds(lambda opener, n: opener * n, st.sampled_from([b"[", b"{a: ", b"- ", b"&a ["]),
                          st.integers(100, 20_000))

    def yaml_text(seeds: Sequence[bytes]) -> SearchStrategy[bytes]:
        return st.one_of(mutated_bytes(seeds), mutated_bytes(seeds), st.text(max_size=200).map(str.encode),
                         st.binary(max_size=200), deep_yaml)

    # py-spy's dump, line by line: its headers, thread and frame lines, and near misses of each.
    pyspy_lines = st.sampled_from([
        "Process 7: python train.py", "Python v3.11.7 (/usr/bin/python3)", "", 'Thread 7 (idle): "MainThread"',
        "Thread 0x7F3A1C2B4740 (active+gil)", 'Thread 8 (active): "w"', "Thread 7", "Thread  (idle)",
        "    f (a.py:1)", "    f (a.py)", "    f (:1)", "    f ()", "    (a.py:1)", "    f (a.py:-1)",
        "    f (a.py:99999999999999999999)", "    f (a.py:1", "        Locals:", "            x: 1", "-" * 80,
        "\x1b[32mf\x1b[0m", "    f (" + "d/" * 300 + "a.py:1)",
    ]) | texts | texts.map(lambda t: "    " + t) | texts.map(lambda t: f"    {t} ({t}:{len(t)})")
    pyspy_docs = st.builds(lambda lines, crlf: ("\r\n" if crlf else "\n").join(lines).encode(),
                           st.lists(pyspy_lines, max_size=80), st.booleans())

    def pyspy_text(seeds: Sequence[bytes]) -> SearchStrategy[bytes]:
        return st.one_of(mutated_bytes(seeds), mutated_bytes(seeds), pyspy_docs, st.binary(max_size=300))

    def binary_file(seeds: Sequence[bytes]) -> SearchStrategy[bytes]:
        return st.one_of(mutated_bytes(seeds), mutated_bytes(seeds), st.binary(max_size=200))

    return types.SimpleNamespace(json_doc=json_doc, near_bounds=near_bounds,
                                 spool_file=spool_file, chunked=chunked, binary_file=binary_file,
                                 http_response=http_response, pickles=pickles, dump_file=dump_file,
                                 prom_answer=prom_answer, yaml_text=yaml_text, pyspy_text=pyspy_text)


def _bounded_json(base: Callable[[], dict[str, Any]], kind: str) -> Callable[[], SearchStrategy[bytes]]:
    """The strategy of a JSON target: mutations of ``base``, and documents at the bounds of its parser."""
    return lambda: _strategies().json_doc(base(), _strategies().near_bounds(kind))


def _targets() -> dict[str, Target]:
    targets = [
        Target("spool.parse_manifest", run_parse_manifest, (SpoolError, Skip),
               lambda: text_seeds(manifest_doc()), _bounded_json(manifest_doc, "manifest"), max_len=1 << 18),
        Target("spool.parse_snapshot", run_parse_snapshot, (SpoolError, Skip),
               lambda: text_seeds(snapshot_doc()), _bounded_json(snapshot_doc, "snapshot"), max_len=1 << 18),
        Target("spool.read_json_file", run_read_json_file, (SpoolError,),
               lambda: [b"\x00\x00" + _json(snapshot_doc()), b"\x00\x01" + _json(manifest_doc())],
               lambda: _strategies().spool_file(manifest_doc(), snapshot_doc()), max_len=1 << 20),
        Target("spool.parse_snapshot (mapped)", run_parse_snapshot, (SpoolError, Skip),
               lambda: [_json(snapshot_map_doc())], _bounded_json(snapshot_map_doc, "snapshot_map")),
        Target("spool.read_snapshot_map", run_read_snapshot_map, (SpoolError,), snapshot_map_seeds,
               lambda: _strategies().binary_file(snapshot_map_seeds()), max_len=1 << 17),
        Target("trace.parse_dump", run_parse_dump, (SpoolError, Skip),
               lambda: text_seeds(json_dump_doc()), _bounded_json(json_dump_doc, "dump"), max_len=1 << 18),
        Target("trace.parse_answer", run_parse_answer, (SpoolError,),
               lambda: text_seeds(json_dump_doc()), _bounded_json(json_dump_doc, "dump"), max_len=1 << 18),
        Target("worker_client._parse_response", run_parse_response, (SourceError,),
               http_seeds, lambda: _strategies().http_response(http_seeds())),
        Target("worker_client._dechunk", run_dechunk, (SourceError,),
               chunk_seeds, lambda: _strategies().chunked(chunk_seeds())),
        Target("worker_client._complete", run_complete, (),
               lambda: [b"\x10" + s for s in http_seeds()], lambda: _strategies().http_response(http_seeds())),
        Target("pyspy.parse_dump", run_pyspy_dump, (SourceError,),
               pyspy_seeds, lambda: _strategies().pyspy_text(pyspy_seeds()), max_len=65536),
        Target("dumpfiles.safe_loads", run_safe_loads, (pickle.UnpicklingError,),
               pickle_seeds, lambda: _strategies().pickles(pickle_seeds()), max_len=65536),
        Target("dumpfiles.decode", run_frdump_decode, (dumpfiles.DumpError, SpoolError),
               lambda: [*pickle_seeds(), _json(json_dump_doc())],
               lambda: _strategies().dump_file(json_dump_doc(), pickle_dump_doc(), pickle_seeds()), max_len=65536),
        Target("report.parse_evidence", run_parse_evidence, (dumpfiles.DumpError,), evidence_seeds,
               lambda: _strategies().json_doc(evidence_doc()), max_len=65536),
        Target("prometheus.parse_query_response", run_parse_query_response, (prometheus.PrometheusError,),
               prom_seeds, lambda: _strategies().json_doc(prom_doc())),
        Target("prometheus.rank_states", run_prom_rank_states, (prometheus.PrometheusError,),
               prom_seeds, lambda: _strategies().prom_answer(prom_doc())),
    ]
    targets += _webconfig_targets()
    return {t.name: t for t in targets}


def _webconfig_targets() -> list[Target]:
    """The TLS/basic-auth web config file and the Authorization header, where this checkout has them."""
    try:
        from frexporter.web import webconfig  # type: ignore[attr-defined]
    except ImportError:
        return []
    # Names looked up defensively: that module is being written in parallel with this file.
    error = getattr(webconfig, "WebConfigError", None)
    load = getattr(webconfig, "load_web_config", None) or getattr(webconfig, "load", None)
    parse_basic = getattr(webconfig, "_parse_basic", None)
    if not (isinstance(error, type) and issubclass(error, Exception)) or load is None:
        return []
    bench: list[str] = []

    def run_load(data: bytes) -> None:
        if not bench:
            root = scratch("web-")
            for name in ("a.crt", "a.key", "ca.crt"):  # present but not PEM: build_context must refuse them
                Path(root, name).write_bytes(b"-----BEGIN CERTIFICATE-----\nnot base64\n")
            bench.append(os.path.join(root, "web.yml"))
        Path(bench[0]).write_bytes(data)
        load(bench[0])

    def run_basic(data: bytes) -> None:
        # http.server hands header values over as latin-1 text: every byte is a character.
        result = parse_basic(data.decode("latin-1"))  # type: ignore[misc]
        if result is not None and not (isinstance(result[0], str) and isinstance(result[1], bytes)):
            raise Failure("invariant", f"_parse_basic returned {result!r:.80}")

    seeds = [b"tls_server_config:\n  cert_file: a.crt\n  key_file: a.key\n  client_auth_type: "
             b"RequireAndVerifyClientCert\n  client_ca_file: ca.crt\n  min_version: TLS12\n"
             b"basic_auth_users:\n  prometheus: $2y$10$" + b"a" * 53 + b"\nhttp_server_config:\n  headers:\n"
             b"    X-Frame-Options: deny\n", b"{}", b"",
             # exporter-toolkit's inline PEM, rate_limit, versions OpenSSL cannot serve, control characters.
             b"tls_server_config:\n  cert: |\n    -----BEGIN CERTIFICATE-----\n    bm90\n"
             b"    -----END CERTIFICATE-----\n  key: \"-----BEGIN PRIVATE KEY-----\\nx\\n-----END PRIVATE KEY-----\"\n"
             b"  client_ca: \"-----BEGIN \"\n  client_auth_type: RequireAndVerifyClientCert\n  min_version: TLS13\n",
             b"tls_server_config: {cert_file: a.crt, key_file: a.key, min_version: TLS10, max_version: TLS11}\n",
             b"rate_limit:\n  interval: 1m30.5s\n  burst: 3\n", b"rate_limit: {interval: 0, burst: 0}\n",
             b"http_server_config:\n  headers:\n    X-XSS-Protection: 1\n"
             b"    Content-Security-Policy: \"a\\r\\n\\0\\e\"\n"]
    auth_seeds = [b"Basic " + base64.b64encode(b"prometheus:secret"), b"basic  " + base64.b64encode(b":"),
                  b"Bearer x"]
    targets = [Target("webconfig.load", run_load, (error,), lambda: seeds, lambda: _strategies().yaml_text(seeds),
                      max_len=65536, cpu_budget_s=2.0)]
    if parse_basic is not None:
        targets.append(Target("webconfig._parse_basic", run_basic, (), lambda: auth_seeds,
                              lambda: _strategies().yaml_text(auth_seeds)))
    return targets


TARGETS = _targets()


# ------------------------------------------------------------------------------------------ running cases


@dataclass
class Stats:
    target: str
    engine: str
    cases: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: dict[str, dict[str, Any]] = field(default_factory=dict)
    cpu: list[float] = field(default_factory=list)
    max_wall_s: float = 0.0
    max_input_bytes: int = 0
    elapsed_s: float = 0.0
    save_dir: str | None = None  # where the first whole input of each failure signature is written
    slowest: bytes = b""  # the input of the case with the most CPU time, for a look at what costs
    max_cpu_s: float = 0.0

    def add(self, outcome: str, cpu: float, wall: float, data: bytes) -> None:
        size = len(data)
        if cpu >= self.max_cpu_s:
            self.max_cpu_s, self.slowest = cpu, data
        self.cases += 1
        self.outcomes[outcome] += 1
        self.cpu.append(cpu)
        self.max_wall_s = max(self.max_wall_s, wall)
        self.max_input_bytes = max(self.max_input_bytes, size)

    def fail(self, failure: Failure, data: bytes) -> None:
        entry = self.failures.setdefault(failure.signature, {"count": 0, "detail": failure.detail,
                                                             "input": data[:EXAMPLE_BYTES].hex(),
                                                             "input_bytes": len(data)})
        entry["count"] += 1
        if entry["count"] == 1 and self.save_dir:
            name = "".join(c if c.isalnum() or c in "._-" else "_" for c in f"{self.target}-{failure.signature}")
            path = os.path.join(self.save_dir, name + ".bin")
            Path(path).write_bytes(data)
            entry["saved"] = path

    def summary(self) -> dict[str, Any]:
        cpu = sorted(self.cpu)
        if self.save_dir and self.slowest:
            Path(self.save_dir, f"{self.target}-{self.engine}-slowest.bin").write_bytes(self.slowest)
        return {
            "target": self.target, "engine": self.engine, "cases": self.cases, "outcomes": dict(self.outcomes),
            "failures": self.failures, "elapsed_s": round(self.elapsed_s, 2),
            "cpu_max_ms": round(cpu[-1] * 1e3, 3) if cpu else 0.0,
            "cpu_p99_ms": round(cpu[int(len(cpu) * 0.99)] * 1e3, 3) if cpu else 0.0,
            "cpu_median_ms": round(cpu[len(cpu) // 2] * 1e3, 4) if cpu else 0.0,
            "wall_max_ms": round(self.max_wall_s * 1e3, 3), "max_input_bytes": self.max_input_bytes,
        }


def _raise_hang(_signum: int, _frame: object) -> None:
    raise Hang


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    """Interrupts Python-level loops (not C code) in the main thread; elsewhere it does nothing."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return
    previous = signal.signal(signal.SIGALRM, _raise_hang)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _where(e: BaseException) -> str:
    """The innermost frame in frexporter (else the innermost at all): groups one bug's failures."""
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if "/frexporter/" in f.filename] or frames
    f = ours[-1] if ours else None
    return f"{Path(f.filename).name}:{f.lineno}" if f else "?"


def run_case(target: Target, data: bytes, check_budget: bool = True, budget_factor: float = 1.0
             ) -> tuple[str, float, float]:
    """One case: returns (outcome, cpu seconds, wall seconds) or raises Failure."""
    cpu_budget_s = target.cpu_budget_s * budget_factor if check_budget else None
    if len(sys.modules) != len(_KNOWN_MODULES):
        _KNOWN_MODULES.update(sys.modules)
    canaries = len(CANARY)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection of garbage from earlier cases is not this parser's cost
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    try:
        with _alarm(HANG_ALARM_S):
            target.run(data)
        outcome = "ok"
    except Failure:
        raise
    except target.allowed as e:
        outcome = type(e).__name__
    except Hang as e:
        raise Failure("hang", f"still running after {HANG_ALARM_S}s (Python level) at {_where(e)}") from e
    except Exception as e:
        tb = "".join(traceback.format_exception_only(type(e), e)).strip()[:300]
        raise Failure(f"{type(e).__name__} at {_where(e)}", tb) from e
    finally:
        cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
        if gc_was_enabled:
            gc.enable()
    if len(CANARY) != canaries:
        raise Failure("code execution", f"the input ran code: {CANARY[canaries:]}")
    if len(sys.modules) != len(_KNOWN_MODULES):
        new = set(sys.modules) - _KNOWN_MODULES
        _KNOWN_MODULES.update(new)
        if any(not name.startswith("encodings.") for name in new):
            raise Failure("import", f"the input made the parser import {sorted(new)}")
    if cpu_budget_s is not None and cpu > cpu_budget_s:
        raise Failure("slow", f"{cpu * 1e3:.1f} ms CPU for a {len(data)} byte input (budget "
                              f"{cpu_budget_s * 1e3:.0f} ms)")
    return outcome, cpu, wall


def record_case(stats: Stats, target: Target, data: bytes, check_budget: bool) -> None:
    try:
        outcome, cpu, wall = run_case(target, data, check_budget)
    except Failure as f:
        stats.fail(f, data)
        outcome, cpu, wall = f"FAIL {f.signature}", 0.0, 0.0
    stats.add(outcome, cpu, wall, data)


def _warm_up(target: Target) -> None:
    # Lazy imports and first-use caches (regexes, the file bench) belong to no case.
    for seed in target.seeds():
        with contextlib.suppress(Failure):
            run_case(target, seed, check_budget=False)


def hypothesis_run(target: Target, cases: int, seed: int | None, stats: Stats) -> None:
    import warnings

    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import HypothesisWarning

    # The seed files are large on purpose; hypothesis warns that the repr of the strategy holding them is.
    warnings.filterwarnings("ignore", category=HypothesisWarning)
    _warm_up(target)

    @settings(max_examples=cases, deadline=None, database=None, derandomize=seed is None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(target.strategy())
    def body(data: bytes) -> None:
        record_case(stats, target, data, True)

    if seed is not None:
        from hypothesis import seed as hypothesis_seed

        body = hypothesis_seed(seed)(body)
    body()


def _libfuzzer_dict(target: Target, path: Path) -> None:
    """Tokens libFuzzer splices into inputs: JSON keys of the seeds and the syntax the parsers key on."""
    tokens = {"Infinity", "-Infinity", "NaN", "null", "true", "9223372036854775808", "1e400", "\r\n", "\r\n\r\n",
              "Content-Length: ", "Transfer-Encoding: chunked", "HTTP/1.1 ", ";", "-1", "ffffffffffffffff"}
    for seed in target.seeds():
        with contextlib.suppress(ValueError, RecursionError):
            doc = json.loads(seed[2:] if target.name == "spool.read_json_file" else seed)
            stack = [doc]
            while stack:
                node = stack.pop()
                if isinstance(node, dict):
                    tokens.update(f'"{k}"' for k in node if isinstance(k, str) and len(k) < 40)
                    stack.extend(node.values())
                elif isinstance(node, list):
                    stack.extend(node)
    lines = []
    for t in sorted(tokens):
        escaped = "".join(c if 32 <= ord(c) < 127 and c not in '"\\' else f"\\x{ord(c):02x}" for c in t)
        lines.append(f'"{escaped}"')
    path.write_text("\n".join(lines) + "\n")


def atheris_worker(target: Target, cases: int, seed: int, stats: Stats, out: Path) -> None:
    """Coverage-guided fuzzing in this process; libFuzzer exits the process when done, so stats are
    written to ``out`` as the run goes."""
    import atheris

    _warm_up(target)
    work = Path(scratch("atheris-"))
    corpus = work / "corpus"
    corpus.mkdir()
    for i, s in enumerate(target.seeds()):
        (corpus / f"seed{i}").write_bytes(s[: target.max_len])
    _libfuzzer_dict(target, work / "tokens.dict")
    started = time.monotonic()

    def one(data: bytes) -> None:
        # Instrumented code runs slower: the CPU budget applies to the hypothesis engine only.
        record_case(stats, target, data, False)
        if stats.cases % 2000 == 0 or stats.cases >= cases:
            stats.elapsed_s = time.monotonic() - started
            out.write_text(json.dumps(stats.summary()))

    atheris.Setup([sys.argv[0], f"-runs={cases}", f"-max_len={target.max_len}", "-timeout=20",
                   "-rss_limit_mb=4096", f"-seed={seed}", f"-dict={work / 'tokens.dict'}",
                   f"-artifact_prefix={work}/", str(corpus)], one)
    atheris.Fuzz()


def worker(args: argparse.Namespace) -> int:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    target = TARGETS[args.worker]
    stats = Stats(target.name, args.engine, save_dir=args.failures)
    out = Path(args.out)
    started = time.monotonic()
    if args.engine == "atheris":
        atheris_worker(target, args.cases, args.seed or 1, stats, out)
    else:
        hypothesis_run(target, args.cases, args.seed, stats)
    stats.elapsed_s = time.monotonic() - started
    out.write_text(json.dumps(stats.summary()))
    return 0


# Imported under its own name, not as __main__: the hostile pickles point at benchmarks.fuzz._canary.
# For atheris, frexporter is imported under coverage instrumentation (and nothing else: instrumenting
# every loaded module costs more start-up time than the whole run).
_WORKER_BOOT = """
import sys
if sys.argv[sys.argv.index("--engine") + 1] == "atheris":
    import atheris
    with atheris.instrument_imports(include=["frexporter"]):
        import benchmarks.fuzz as f
else:
    import benchmarks.fuzz as f
sys.exit(f.main(sys.argv[1:]))
"""


def orchestrate(names: Sequence[str], engines: Sequence[str], cases: int, seed: int | None, limit_s: float,
                as_json: bool, failures: str) -> int:
    os.makedirs(failures, exist_ok=True)
    rows = []
    for engine in engines:
        for name in names:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                out = Path(f.name)
            cmd = [sys.executable, "-c", _WORKER_BOOT,
                   "--worker", name, "--engine", engine, "--cases", str(cases), "--out", str(out),
                   "--failures", failures, *(["--seed", str(seed)] if seed is not None else [])]
            started = time.monotonic()
            root = tempfile.mkdtemp(prefix="frexporter-fuzz-")
            try:
                proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=limit_s,
                                      env={**os.environ, _SCRATCH_ENV: root})
                rc, log = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as e:
                rc, log = -9, f"killed after {limit_s:.0f}s: {(e.stderr or b'')[-2000:]!r}"
            finally:
                shutil.rmtree(root, ignore_errors=True)
            try:
                row = json.loads(out.read_text() or "{}")
            except ValueError:
                row = {}
            out.unlink(missing_ok=True)
            row = {"target": name, "engine": engine, "cases": 0, "failures": {}, **row}
            row["wall_s"] = round(time.monotonic() - started, 1)
            # libFuzzer ends with exit code 0 after -runs; anything else (a hang it caught, a crash in C,
            # our wall limit) is a failure of the target, not of the harness.
            if rc != 0:
                row["failures"] = {**row["failures"], f"worker exit {rc}": {"count": 1, "detail": log[-1500:]}}
            rows.append(row)
            if not as_json:
                _print_row(row)
    if as_json:
        print(json.dumps(rows, indent=1))
    bad = [r for r in rows if r["failures"]]
    for r in bad:
        print(f"\nFAILURES in {r['target']} ({r['engine']}):", file=sys.stderr)
        for sig, f in r["failures"].items():
            print(f"  {sig} x{f['count']}: {f['detail'][:400]}\n    input[:100] hex: "
                  f"{f.get('input', '')[:200]}  (whole input: {f.get('saved', '-')})", file=sys.stderr)
    return 1 if bad else 0


_HEADER_PRINTED: list[bool] = []


def _print_row(row: dict[str, Any]) -> None:
    if not _HEADER_PRINTED:
        _HEADER_PRINTED.append(True)
        print(f"{'engine':<10} {'target':<32} {'cases':>8} {'fail':>5} {'wall s':>7} {'cpu med ms':>10} "
              f"{'p99 ms':>8} {'max ms':>8} {'max in B':>9}  outcomes")
    outcomes = ", ".join(f"{k}={v}" for k, v in sorted(row.get("outcomes", {}).items()))
    print(f"{row['engine']:<10} {row['target']:<32} {row['cases']:>8} {len(row['failures']):>5} "
          f"{row['wall_s']:>7.1f} {row.get('cpu_median_ms', 0):>10.4f} {row.get('cpu_p99_ms', 0):>8.3f} "
          f"{row.get('cpu_max_ms', 0):>8.3f} {row.get('max_input_bytes', 0):>9}  {outcomes}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=100_000, help="cases per target and engine")
    parser.add_argument("--engine", choices=["hypothesis", "atheris", "both"], default="hypothesis")
    parser.add_argument("--target", action="append", choices=sorted(TARGETS), help="repeatable; default all")
    parser.add_argument("--seed", type=int, default=None, help="default: derandomized hypothesis, libFuzzer seed 1")
    parser.add_argument("--limit", type=float, default=1800.0, help="wall-clock seconds per target and engine")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--list", action="store_true", help="print the target names and exit")
    parser.add_argument("--failures", default=os.path.join(tempfile.gettempdir(), "frexporter-fuzz-failures"),
                        help="directory for the whole input of each distinct failure (default: %(default)s)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(TARGETS))
        return 0
    if args.worker:
        return worker(args)
    engines = ["hypothesis", "atheris"] if args.engine == "both" else [args.engine]
    return orchestrate(args.target or list(TARGETS), engines, args.cases, args.seed, args.limit, args.json,
                       args.failures)


if __name__ == "__main__":
    sys.exit(main())
