"""Pieces the recorder benchmarks share: a free port for a gloo job, and the snapshot's GIL-holding parts.

``snapshot_gil_parts`` runs inside a rank (the benchmarks' rank scripts import it; the repository root is on
their PYTHONPATH).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _thread_cpu_us(fn: Callable[[], object], n: int = 500) -> float:
    samples = []
    for _ in range(n):
        c = time.thread_time()
        fn()
        samples.append((time.thread_time() - c) * 1e6)
    return sorted(samples)[n // 2]


def snapshot_gil_parts(probe_path: str | None = None) -> dict[str, float]:
    """Median thread CPU of a snapshot's Python parts, which hold the GIL throughout: reading ``pg_status``
    from torch and encoding the JSON; with ``probe_path``, also the whole file write (its syscalls release
    the GIL, its Python around them does not)."""
    from frexporter import spool
    from frexporter.recorder import fr

    status = fr.read_pg_status(fr.available_recorders())
    payload = {"format": spool.SNAPSHOT_FORMAT, "status": status, "pid": 1, "time": 1.0, "errors": {}}
    parts = {"read_pg_status_us": _thread_cpu_us(lambda: fr.read_pg_status(fr.available_recorders())),
             "encode_us": _thread_cpu_us(lambda: json.dumps(payload, separators=(",", ":"), sort_keys=True))}
    if probe_path is not None:
        parts["write_file_us"] = _thread_cpu_us(lambda: spool.write_json_atomic(probe_path, payload), 200)
    return parts
