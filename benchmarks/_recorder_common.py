"""Pieces the recorder benchmarks share: a free port for a gloo job, a t quantile, and the snapshot's
GIL-holding parts.

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


def t_quantile_975(df: int) -> float:
    # Two-sided 95 % Student t; close enough beyond the table.
    table = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23,
             15: 2.13, 20: 2.09, 30: 2.04, 40: 2.02, 60: 2.00}
    for k in sorted(table):
        if df <= k:
            return table[k]
    return 1.96


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
    from frexporter.recorder import torch_fr
    from frexporter.recorder.publisher import Publisher

    with tempfile.TemporaryDirectory() as directory:
        pub = Publisher(directory, "probe", 1.0)
        pub._stem = "probe.r0"
        pub._map = spool.SnapshotMap(pub._path(spool.SNAPSHOT_MAP_SUFFIX))
        pub._status = reader = torch_fr.StatusReader(torch_fr.available_recorders())
        status = reader.read()
        pub._write_snapshot(status)  # creates the mapped file (syscalls, once)
        parts = {"read_status_us": _thread_cpu_us(reader.read),
                 "write_snapshot_us": _thread_cpu_us(lambda: pub._write_snapshot(status))}
        assert spool.read_snapshot_map(pub._path(spool.SNAPSHOT_MAP_SUFFIX))["counter"] == pub._counter
        pub._map.close()
    return parts
