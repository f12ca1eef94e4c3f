"""Pieces the recorder benchmarks share: a free port for a gloo job, and the snapshot's GIL-holding parts.

``snapshot_gil_parts`` runs inside a rank (the benchmarks' rank scripts import it; the repository root is on
their PYTHONPATH).
"""

from __future__ import annotations

import socket
import tempfile
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


def snapshot_gil_parts() -> dict[str, float]:
    """Median thread CPU of a snapshot's parts, which hold the GIL throughout (no syscall inside): reading
    torch's status JSON, and building and storing the snapshot in its mapped file (a memory copy)."""
    from frexporter import spool
    from frexporter.recorder import fr
    from frexporter.recorder.publisher import Publisher

    with tempfile.TemporaryDirectory() as directory:
        pub = Publisher(directory, "probe", 1.0)
        pub._stem = "probe.r0"
        pub._map = spool.SnapshotMap(pub._path(spool.SNAPSHOT_MAP_SUFFIX))
        pub._status = reader = fr.StatusReader(fr.available_recorders())
        status = reader.read()
        pub._write_snapshot(status)  # creates the mapped file (syscalls, once)
        parts = {"read_status_us": _thread_cpu_us(reader.read),
                 "write_snapshot_us": _thread_cpu_us(lambda: pub._write_snapshot(status))}
        assert spool.read_snapshot_map(pub._path(spool.SNAPSHOT_MAP_SUFFIX))["counter"] == pub._counter
        pub._map.close()
    return parts
