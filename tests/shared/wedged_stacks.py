"""Wedged ranks for the ranks source: spool files with a stale snapshot, and a worker server per rank whose
answers (pyspy_dump among them) a test scripts; ``Rig`` puts them together (the ``rig`` fixture in
tests/conftest.py makes them)."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from pathlib import Path

from frexporter import spool
from frexporter.model import RankState
from frexporter.sources import pyspy
from frexporter.sources.ranks import RanksConfig, RanksSource
from tests import spoolgen

OWN_SAMPLE = ("idle", "/work/tests/workers/job.py", 47)


class ScriptedWorker:
    """A unix socket answering like torch's worker server: ``answers`` maps a handler to (HTTP status, body), or
    to None for a handler that never answers. ``calls`` counts requests per handler; ``shared`` counts the
    pyspy_dump requests open at once, over every worker that shares it."""

    def __init__(self, path: Path, answers: dict[str, tuple[int, bytes] | None], shared: dict[str, int]) -> None:
        self.answers = answers
        self.calls: Counter[str] = Counter()
        self.shared = shared
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.threads: list[threading.Thread] = []
        self.acceptor = threading.Thread(target=self._accept, daemon=True)
        self.acceptor.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                data += chunk
            handler = data.split(b" ")[1].split(b"?")[0].rsplit(b"/", 1)[-1].decode()
            with self.lock:
                self.calls[handler] += 1
                if handler == pyspy.HANDLER:
                    self.shared["open"] += 1
                    self.shared["most"] = max(self.shared["most"], self.shared["open"])
            try:
                answer = self.answers.get(handler, (404, b""))
                if answer is None:
                    self._hang(conn)
                    return
                status, body = answer
                conn.sendall(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n" % (status, len(body)) + body)
            except OSError:
                pass  # the client gave up (an oversized answer, a timeout)
            finally:
                if handler == pyspy.HANDLER:
                    with self.lock:
                        self.shared["open"] -= 1

    def _hang(self, conn: socket.socket) -> None:
        """Answer nothing, until the client hangs up (as py-spy's handler thread would, a request at a time)."""
        conn.settimeout(0.05)
        while not self.stop.is_set():
            try:
                if not conn.recv(1):
                    return
            except TimeoutError:
                continue

    def close(self) -> None:
        self.stop.set()
        self.acceptor.join()
        for thread in self.threads:
            thread.join()
        self.sock.close()


class Rig:
    """Wedged ranks (a stale snapshot, a live socket listing pyspy_dump) and a ranks source whose clocks a test can
    move forward."""

    def __init__(self, tmp: Path, answers: dict[str, tuple[int, bytes] | None], ranks: int = 1,
                 handlers: tuple[str, ...] = ("ping", pyspy.HANDLER), **config: object) -> None:
        self.tmp = tmp
        self.offset = 0.0
        self.shared = {"open": 0, "most": 0}
        self.workers = []
        for rank in range(ranks):
            sock = spoolgen.own_socket("job", rank)
            stem = spoolgen.write_rank(tmp, "job", rank, socket=sock, handlers=list(handlers), recorders=[])
            self.wedge(rank, stem)
            self.workers.append(ScriptedWorker(tmp / sock, answers, self.shared))
        options: dict[str, object] = {"poll_interval": 0.2, "rank_timeout": 0.5, "wedged_stacks": True}
        options.update(config)
        self.config = RanksConfig(directory=str(tmp), **options)  # type: ignore[arg-type]
        self.source = RanksSource(self.config, clock=lambda: time.time() + self.offset,
                                  monotonic=lambda: time.monotonic() + self.offset)
        self.errors: Counter[str] = Counter()
        self.durations: list[float] = []

    def wedge(self, rank: int, stem: str | None = None) -> None:
        """A snapshot from long ago, with the rank's own last sample."""
        stem = stem or spool.rank_stem("job", rank)
        spool.write_json_atomic(str(self.tmp / (stem + spool.SNAPSHOT_SUFFIX)),
                                spoolgen.snapshot(100000 + rank, when=1.0, stack=[list(OWN_SAMPLE)]))

    def poll(self) -> dict[int, RankState]:
        started = time.monotonic()
        reading = self.source.collect()
        self.durations.append(time.monotonic() - started)
        self.errors.update(reason for reason, _ in reading.problems)
        return {s.rank: s for s in reading.ranks or ()}

    def calls(self) -> int:
        return sum(w.calls[pyspy.HANDLER] for w in self.workers)

    def close(self) -> None:
        self.source.close()
        for worker in self.workers:
            worker.close()
