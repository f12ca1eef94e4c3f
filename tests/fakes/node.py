"""A node of fake ranks for the ranks source: spool files, a fake worker server per rank answering with its
Flight Recorder ring, a RanksSource and an Exporter over them, all on a clock the test moves (``Node``; the
``node_factory`` fixture in tests/conftest.py makes them). ``raw`` and ``entry`` build FR entries."""

from __future__ import annotations

import json
import socketserver
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from frexporter import spool
from frexporter.analysis import make_analyzer
from frexporter.exporter import Exporter
from frexporter.fr.trace import FrEntry, parse_entry
from frexporter.outputs.snapshot_metrics import SnapshotCollector
from frexporter.sources.ranks import RanksConfig, RanksSource
from tests import spoolgen
from tests.harness import metrics

T0 = 1_700_000_000.0


def raw(rid: int, seq: int, *, op: str = "gloo:all_reduce", pg: tuple[str, str] = ("0", "default_pg"),
        created: float | None = None, retired: bool = True, state: str = "scheduled",
        sizes: list[list[int]] | None = None, dtypes: list[str] | None = None, duration: float | None = None,
        p2p: bool = False, started_ns: int = 0, timeout_ms: int = 1_800_000, pg_id: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {
        "record_id": rid, "pg_id": pg_id, "process_group": list(pg), "collective_seq_id": seq, "p2p_seq_id": 0,
        "op_id": seq, "profiling_name": op,
        "time_created_ns": int((created if created is not None else T0 + seq) * 1e9),
        "input_sizes": sizes if sizes is not None else [[4, 3]], "input_dtypes": dtypes or ["Float"],
        "output_sizes": sizes if sizes is not None else [[4, 3]], "output_dtypes": dtypes or ["Float"],
        "state": state, "time_discovered_started_ns": started_ns, "time_discovered_completed_ns": 0,
        "retired": retired, "timeout_ms": timeout_ms, "is_p2p": p2p,
    }
    if duration is not None:
        out["duration_ms"] = duration
    return out


def entry(*args: Any, **kw: Any) -> FrEntry:
    return parse_entry(raw(*args, **kw))


class FakeWorker:
    """A worker-server stand-in on a unix socket: answers every POST with ``dump()`` as JSON."""

    def __init__(self, path: str, dump: Callable[[], dict[str, Any]]) -> None:
        self.reads = 0
        worker = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = self.request.recv(4096)
                    if not chunk:
                        return
                    data += chunk
                worker.reads += 1
                body = json.dumps(dump()).encode()
                self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                                 + str(len(body)).encode() + b"\r\n\r\n" + body)

        self.server = socketserver.ThreadingUnixStreamServer(path, Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Node:
    """Spool files and fake worker servers for a few ranks, a RanksSource over them and a settable clock."""

    def __init__(self, directory: Path, ranks: int, **config: Any) -> None:
        self.dir = directory
        directory.mkdir()
        self.now = T0 + 1000
        self.rings: dict[int, list[dict[str, Any]]] = {r: [] for r in range(ranks)}
        self.pids = {r: 100000 + r for r in range(ranks)}
        self.counter = 0
        self.workers: list[FakeWorker] = []
        for r in range(ranks):
            self.start_rank(r)
        self.source = RanksSource(RanksConfig(str(directory), **{"poll_interval": 1.0, "rank_timeout": 2.0,
                                                                 "deep_interval": 0.0, **config}),
                                  clock=lambda: self.now)
        self.exporter = Exporter([(self.source, 1.0)], clock=lambda: self.now, hostname="node-a",
                                 analyzer=make_analyzer())

    def start_rank(self, r: int) -> None:
        stem = spool.rank_stem("job", r)
        sock = spool.socket_name(stem)
        m = spoolgen.manifest("job", r, world=len(self.rings), socket=sock, pid=self.pids[r])
        spool.write_json_atomic(str(self.dir / (stem + spool.MANIFEST_SUFFIX)), m)
        self.workers.append(FakeWorker(str(self.dir / sock), lambda r=r: self.dump(r)))  # type: ignore[misc]

    def dump(self, r: int) -> dict[str, Any]:
        ring = self.rings[r]
        seq = max((e["op_id"] for e in ring), default=0)
        done = max((e["op_id"] for e in ring if e["retired"]), default=0)
        return {"version": "2.10", "pg_status": {"0": {"last_enqueued_collective": seq, "last_started_collective": -1,
                                                       "last_completed_collective": done}},
                "entries": ring}

    def poll(self) -> Any:
        """Advance the clock, refresh every snapshot with its ring's progress (which makes the source read
        the rings again), and poll once."""
        self.now += 1.0
        self.counter += 1
        for r, ring in self.rings.items():
            seq = max((e["op_id"] for e in ring), default=0)
            snap = spoolgen.snapshot(self.pids[r], seq=seq, counter=self.counter, when=self.now)
            spool.write_json_atomic(str(self.dir / (spool.rank_stem("job", r) + spool.SNAPSHOT_SUFFIX)), snap)
        return self.exporter.poll_once()

    def close(self) -> None:
        self.source.close()
        for w in self.workers:
            w.close()


def render(snapshot: Any) -> dict[str, list[tuple[dict[str, str], float]]]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snapshot))
    return metrics(generate_latest(registry).decode())
