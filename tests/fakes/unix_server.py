"""A worker-server stand-in on a unix socket (``UnixServer``: a test subclass says how it answers), and a
Flight Recorder dump of one completed collective and one in flight (``fr_dump``)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time


def fr_dump(seq: int) -> bytes:
    entry = {"record_id": 0, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": seq - 1,
             "p2p_seq_id": 0, "op_id": seq - 1, "profiling_name": "gloo:all_reduce",
             "time_created_ns": time.time_ns() - 5_000_000_000, "input_sizes": [[4]], "input_dtypes": ["Float"],
             "output_sizes": [[4]], "output_dtypes": ["Float"], "state": "scheduled", "retired": True,
             "timeout_ms": 1_800_000, "is_p2p": False}
    pending = {**entry, "record_id": 1, "collective_seq_id": seq, "op_id": seq, "retired": False}
    return json.dumps({"version": "2.10", "pg_status": {"0": {
        "last_enqueued_collective": str(seq), "last_started_collective": "-1",
        "last_completed_collective": str(seq - 1)}}, "entries": [entry, pending]}).encode()


def http_response(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body


def _read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


class UnixServer:
    """A worker-server stand-in on a unix socket, one thread per connection."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.stop = threading.Event()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(64)
        self.threads: list[threading.Thread] = []
        self.served = 0
        self._spawn(self._accept_loop)

    def _spawn(self, target: object, *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        t.start()
        self.threads.append(t)

    def _accept_loop(self) -> None:
        self.sock.settimeout(0.05)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self._spawn(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(2.0)
            with contextlib.suppress(OSError):
                self.answer(conn, _read_request(conn))
                self.served += 1

    def answer(self, conn: socket.socket, request: bytes) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        for t in self.threads:
            t.join(timeout=5)
