"""The handlers of torch's worker server that frexporter calls: one table, the only place they are spelled.

torch's C++ worker server answers ``POST /handler/<name>?<query>`` on the rank's unix socket
(``worker_client`` is the transport). Each row says what is sent, how large an answer may be before it is
refused unread, which recorder's entries it returns, and who calls it:

- the poll loop (the ranks source's socket pool, within ``--rank-timeout``) calls only handlers that answer from
  C++ without the rank's GIL, so that a rank whose Python is wedged still answers;
- the py-spy pool (``--evidence-stacks``, never waited for by a poll) calls ``pyspy_dump``, whose C++ handler
  runs py-spy as a child of the rank (no GIL either, but tens of milliseconds and a process);
- the evidence capture thread reads whole FR buffers, and the culprits' stacks, of a new verdict's ranks.

torch's ``dump_traceback`` handler takes the GIL, so a wedged rank never answers it: it is not in the table.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from frexporter import spool
from frexporter.sources import worker_client

CALLER_POLL = "poll"  # pings and deep reads, every poll
CALLER_STACKS = "stacks"  # a wedged rank's py-spy stack, once per wedge and every pyspy.REFRESH_INTERVAL
CALLER_EVIDENCE = "evidence"  # a new verdict's evidence bundle


@dataclass(frozen=True)
class Handler:
    name: str
    query: str  # the query string sent with every call ("" for none)
    # The largest answer read; a larger one is refused as `oversized` before its body is read. FR answers are
    # bounded tighter where the rank declared its ring (fr.trace.answer_bounds).
    max_bytes: int
    recorder: str | None  # the recorder (spool.RECORDER_*) whose entries it returns
    callers: frozenset[str]


PING = Handler("ping", "", worker_client.MAX_RESPONSE_BYTES, None, frozenset({CALLER_POLL}))
FR_TRACE = Handler("fr_trace_json", "", worker_client.MAX_RESPONSE_BYTES, spool.RECORDER_FR,
                   frozenset({CALLER_POLL, CALLER_EVIDENCE}))
NCCL_TRACE = Handler("dump_nccl_trace_json", "includecollectives=true&onlyactive=false",
                     worker_client.MAX_RESPONSE_BYTES, spool.RECORDER_NCCL, frozenset({CALLER_POLL, CALLER_EVIDENCE}))
# torch passes --nonblocking to py-spy when the parameter is present: py-spy reads the rank's memory without
# stopping it (a wedged main thread does not move, so the read is consistent; a rank that recovers is not
# paused). A dump of a process with 100 threads of 50 frames each is about 400 KB.
PYSPY_DUMP = Handler("pyspy_dump", "nonblocking=1", 1 << 20, None, frozenset({CALLER_STACKS, CALLER_EVIDENCE}))

HANDLERS: tuple[Handler, ...] = (PING, FR_TRACE, NCCL_TRACE, PYSPY_DUMP)
# Which handler returns which recorder's entries, FR's first.
BY_RECORDER: dict[str, Handler] = {h.recorder: h for h in HANDLERS if h.recorder is not None}


def trace_handlers(listed: Collection[str]) -> tuple[Handler, ...]:
    """The FR handlers among those a rank's manifest lists, FR's first."""
    return tuple(h for h in BY_RECORDER.values() if h.name in listed)


def handlers_in_use(listed: Collection[str], recorders: Collection[str]) -> tuple[str, ...]:
    """The handlers a rank's manifest lists (``listed``: what its torch offers) less the FR handlers of recorders
    it does not use (``recorders``, the manifest's: those its process groups write to, the ones its snapshot
    reads). What reads a rank's FR rings follows the snapshot's rule: a gloo-only job on a CUDA build has an NCCL
    recorder too, empty, and its evidence bundle must not hold it. A manifest that names no recorder says nothing
    of them (a starting rank's lists no handler either): it keeps what it lists."""
    if not recorders:
        return tuple(listed)
    unused = {h.name for h in BY_RECORDER.values() if h.recorder not in recorders}
    return tuple(name for name in listed if name not in unused)


def call(path: str, handler: Handler, timeout: float, max_bytes: int | None = None,
         trust: spool.Trust | None = None) -> bytes | bytearray:
    """``handler``'s answer from the rank behind socket ``path``, at most ``max_bytes`` (and never more than the
    handler's own bound); SourceError with worker_client's reasons otherwise."""
    bound = handler.max_bytes if max_bytes is None else min(max_bytes, handler.max_bytes)
    return worker_client.post(path, handler.name, timeout, handler.query, max_bytes=bound, trust=trust)


def ping(path: str, timeout: float, trust: spool.Trust | None = None) -> bool:
    return call(path, PING, timeout, trust=trust).strip() == b"pong"
