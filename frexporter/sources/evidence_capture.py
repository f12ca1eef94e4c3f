"""What an evidence bundle saves, read from the ranks: FR buffers of a verdict's ranks and the culprits' stacks.

For a new verdict, every local rank of the verdict's PG (and every rank it names) is read over its worker-server
socket: the whole FR buffer of each recorder its process groups use (C++, no GIL needed, so a wedged rank still
answers; the recorders its manifest names, those its snapshot reads: ``RankState.handlers`` lists the FR handlers
of those only, ``worker_handlers.handlers_in_use``) and, with stacks on, each culprit's Python stack (torch's
``pyspy_dump``, py-spy run as a child of the rank). Culprits first: when the capture's deadline cuts it short,
theirs are the buffers that matter. Files are handed on one at a time as they are read (``outputs/evidence.py``
writes them), so a capture holds one answer at a time, never the whole bundle. What could not be read is reported
through ``note(reason, message)``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from frexporter import reasons
from frexporter.model import RankState
from frexporter.sources import worker_handlers
from frexporter.sources.base import SourceError
from frexporter.sources.worker_handlers import Handler


@dataclass(frozen=True)
class CapturedFile:
    name: str  # in the bundle: <recorder>_rank<N>.json (what torch's analyzer and `frexporter analyze` read)
    rank: int
    handler: str
    body: bytes | bytearray


def ranks_to_read(verdict: Any, ranks: Iterable[RankState]) -> list[RankState]:
    """The ranks a bundle reads, culprits first: those of the verdict's job in its PG or named by it, with a
    socket."""
    involved = set(verdict.ranks) | set(verdict.waiting_ranks)
    ranks = list(ranks)
    pg_members = {rank for r in ranks for pg in r.pgs if pg.name == verdict.pg for rank in pg.ranks}
    culprits = set(verdict.ranks)
    return [r for r in sorted(ranks, key=lambda r: (r.rank not in culprits, r.rank))
            if r.job_id == verdict.job_id and (r.rank in involved or r.rank in pg_members) and r.socket]


def read_evidence(verdict: Any, ranks: Iterable[RankState], socket_dir: str, *, stacks: bool, timeout: float,
                  started: float, within: float, max_bytes: int, note: Callable[[str, str], None]
                  ) -> Iterator[CapturedFile]:
    """The files of one bundle, read one at a time; at most ``max_bytes`` in all (an answer past what is left is
    passed over), each request within ``timeout`` and all of them within ``within`` seconds of ``started``
    (monotonic)."""
    budget = max_bytes
    deadline = started + within
    culprits = set(verdict.ranks)
    for rank in ranks_to_read(verdict, ranks):
        sock = os.path.join(socket_dir, rank.socket)
        wanted = [(f"{h.recorder}_rank{rank.rank}.json", h) for h in worker_handlers.trace_handlers(rank.handlers)]
        if stacks and rank.rank in culprits and worker_handlers.PYSPY_DUMP.name in rank.handlers:
            wanted.append((f"stacks_rank{rank.rank}.txt", worker_handlers.PYSPY_DUMP))
        for name, handler in wanted:
            body = _fetch(sock, handler, min(timeout, deadline - time.monotonic()), within, note)
            if body is None or len(body) > budget:
                continue
            budget -= len(body)
            yield CapturedFile(name=name, rank=rank.rank, handler=handler.name, body=body)


def _fetch(sock: str, handler: Handler, timeout: float, within: float, note: Callable[[str, str], None]
           ) -> bytes | bytearray | None:
    if timeout <= 0:
        note(reasons.DEADLINE, f"{sock}: {handler.name} not read: the capture's {within:g} s are spent")
        return None
    try:
        return worker_handlers.call(sock, handler, timeout)
    except SourceError as e:
        note(e.reason, str(e))
        return None
