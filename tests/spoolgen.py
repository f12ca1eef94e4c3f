"""Synthetic spool files for tests and benchmarks, written through the same format module as the recorder."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from frexporter import spool


def own_socket(job_id: str, rank: int) -> str:
    """The socket file name the recorder gives rank ``rank`` of ``job_id`` (the exporter uses no other)."""
    return spool.socket_name(spool.rank_stem(job_id, rank))


def manifest(job_id: str, rank: int, pgs: int = 1, world: int = 8, socket: str = "", pid: int | None = None,
             **extra: Any) -> dict[str, Any]:
    groups = [{"name": "0", "desc": "default_pg", "ranks": list(range(world)), "backend": "cpu:gloo",
               "local_ids": {"fr": 0}, "timeout_seconds": 1800.0}]
    for i in range(1, pgs):
        groups.append({"name": str(i), "desc": f"pg{i}", "ranks": list(range(world)), "backend": "cpu:gloo",
                       "local_ids": {"fr": i}, "timeout_seconds": 600.0})
    out = {
        "format": spool.MANIFEST_FORMAT, "job_id": job_id, "rank": rank, "local_rank": rank % 8,
        "world_size": world, "pid": pid if pid is not None else 100000 + rank, "hostname": "node-a",
        "start_time": 1.0, "torch_version": "2.13.0+cpu", "backends": ["cpu:gloo"], "gpu_uuid": "",
        "socket": socket, "handlers": ["fr_trace_json", "ping"], "recorders": ["fr"],
        "fr_buffer_size": 2000, "process_groups": groups, "generation": 1,
    }
    out.update(extra)
    return out


def snapshot(pid: int, pgs: int = 1, seq: int = 10, counter: int = 1, when: float | None = None,
             **extra: Any) -> dict[str, Any]:
    status = {str(i): {"last_enqueued_collective": str(seq), "last_started_collective": "-1",
                       "last_completed_collective": str(seq)} for i in range(pgs)}
    out = {"format": spool.SNAPSHOT_FORMAT, "pid": pid, "time": when if when is not None else time.time(),
           "interval": 0.2, "counter": counter, "status": {"fr": status}, "errors": {}, "state": "running",
           "message": ""}
    out.update(extra)
    return out


def as_mapped(doc: dict[str, Any]) -> dict[str, Any]:
    """A snapshot/1 document as the recorder writes it today (snapshot/2: torch's whole answer per recorder)."""
    return {**doc, "format": spool.SNAPSHOT_MAP_FORMAT,
            "status": {r: {"version": "2.10", "pg_config": {}, "pg_status": st} for r, st in doc["status"].items()}}


# One writer per mapped file, kept open as a recorder keeps it: refreshes update the file in place.
_MAPS: dict[str, spool.SnapshotMap] = {}


def write_snapshot(directory: Path, stem: str, doc: dict[str, Any], mapped: bool = False) -> None:
    """``doc`` (a snapshot/1 document) as a JSON file (older recorders) or a mapped file (current ones)."""
    if not mapped:
        spool.write_json_atomic(str(directory / (stem + spool.SNAPSHOT_SUFFIX)), doc)
        return
    path = str(directory / (stem + spool.SNAPSHOT_MAP_SUFFIX))
    writer = _MAPS.get(path)
    if writer is None or writer.gone():
        if writer is not None:
            writer.close()
        writer = _MAPS[path] = spool.SnapshotMap(path)
    writer.write(json.dumps(as_mapped(doc)).encode())


def write_rank(directory: Path, job_id: str, rank: int, pgs: int = 1, seq: int = 10, mapped: bool = False,
               **kw: Any) -> str:
    """A healthy rank (manifest + fresh snapshot, no socket); returns its stem."""
    os.makedirs(directory, exist_ok=True)
    stem = spool.rank_stem(job_id, rank)
    m = manifest(job_id, rank, pgs=pgs, **kw)
    spool.write_json_atomic(str(directory / (stem + spool.MANIFEST_SUFFIX)), m)
    write_snapshot(directory, stem, snapshot(m["pid"], pgs=pgs, seq=seq), mapped)
    return stem


def refresh(directory: Path, job_id: str, rank: int, counter: int, pgs: int = 1, seq: int = 10,
            pid: int | None = None, mapped: bool = False) -> None:
    stem = spool.rank_stem(job_id, rank)
    write_snapshot(directory, stem,
                   snapshot(pid if pid is not None else 100000 + rank, pgs=pgs, seq=seq, counter=counter), mapped)
