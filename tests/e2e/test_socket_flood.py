"""One rank's worker socket is flooded; the poll of every other rank stays within the per-rank timeout.

Ranks 0-2 have a healthy worker server that answers deep reads at once, and make progress between polls
(one collective in flight, a new one each poll), so every poll reads their FR entries over their sockets
and only a read from that poll shows the current collective. Rank 3 has a stale heartbeat, so every
poll pings it and reads it too, but its socket is flooded by other clients and either dribbles its
answers a byte at a time (a server that has too many requests blocked on the GIL) or never accepts
(listen backlog full). Each poll must still end within the per-rank timeout, and ranks 0-2 must stay
fresh: status ok, deep reads that keep succeeding, their in-flight collective known.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from frexporter import naming as n
from frexporter import spool
from frexporter.exporter import Exporter
from frexporter.model import RANK_OK
from frexporter.sources.ranks import RanksConfig, RanksSource
from tests import spoolgen
from tests.fakes.unix_server import UnixServer, fr_dump, http_response

RANK_TIMEOUT = 0.5
POLLS = 8
SLACK = 0.4  # scheduling slack on a loaded 2-core box, as in test_bad_input
FLOOD_CLIENTS = 32
HEALTHY = (0, 1, 2)
FLOODED = 3
POLL_INTERVAL = 0.2
FIRST_SEQ = 11


class Progress:
    """The healthy ranks' current collective: in flight, the one before it completed."""

    seq = FIRST_SEQ


class HealthyWorker(UnixServer):
    def answer(self, conn: socket.socket, request: bytes) -> None:
        conn.sendall(http_response(b"pong" if b"/handler/ping" in request else fr_dump(Progress.seq)))


# The flooded rank's server and its flood of clients live in another process, as they would in a job:
# in this one, their threads would compete with the poll for the GIL and measure the test, not the exporter.
FLOOD_PROCESS = r"""
import socket, sys, threading
path, mode, clients = sys.argv[1], sys.argv[2], int(sys.argv[3])
stop = threading.Event()
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
server.listen(1 if mode == "backlog" else 64)
response = sys.stdin.buffer.readline()  # what the dribbling server sends, one byte every 20 ms

def dribble(conn):
    with conn:
        try:
            conn.recv(4096)
            for byte in response:
                if stop.wait(0.02):
                    return
                conn.sendall(bytes([byte]))
        except OSError:
            pass

def accept():
    while not stop.is_set():
        try:
            conn, _ = server.accept()
        except OSError:
            return
        threading.Thread(target=dribble, args=(conn,), daemon=True).start()

connects = 0
def flood():
    # backlog: blocking connects, each kept open; a full backlog holds them in the kernel, without spinning.
    # dribble: a request at a time, each answer read to the end: the server is busy with all of them.
    global connects
    held = []
    while not stop.is_set():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            s.sendall(b"POST /handler/fr_trace_json HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
        except OSError:
            s.close()
            if stop.wait(0.01):
                break
            continue
        connects += 1
        if mode == "dribble":
            with s:
                try:
                    while s.recv(4096):
                        pass
                except OSError:
                    pass
            continue
        held.append(s)
        if len(held) > 4:
            held.pop(0).close()
    for s in held:
        s.close()

if mode == "dribble":
    threading.Thread(target=accept, daemon=True).start()
threads = [threading.Thread(target=flood, daemon=True) for _ in range(clients)]
for t in threads:
    t.start()
print("ready", flush=True)
sys.stdin.buffer.readline()  # the test closes stdin when done
stop.set()
server.close()
print(connects, flush=True)
"""


@contextlib.contextmanager
def spool_with_flooded_rank(directory: Path, mode: str) -> Iterator[list[int]]:
    """Yields a list that holds, once the block is done, how many flood connections got through."""
    servers: list[UnixServer] = []
    for rank in HEALTHY:
        name = spoolgen.own_socket("job", rank)
        spoolgen.write_rank(directory, "job", rank, socket=name)
        servers.append(HealthyWorker(str(directory / name)))
    flooded = spoolgen.own_socket("job", FLOODED)
    stem = spoolgen.write_rank(directory, "job", FLOODED, socket=flooded)
    # A heartbeat from long ago: the rank looks wedged, so every poll goes to its socket.
    spool.write_json_atomic(str(directory / (stem + spool.SNAPSHOT_SUFFIX)),
                            spoolgen.snapshot(100000 + FLOODED, seq=FIRST_SEQ, when=1.0))
    flood = subprocess.Popen([sys.executable, "-c", FLOOD_PROCESS, str(directory / flooded), mode,
                              str(FLOOD_CLIENTS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert flood.stdin is not None and flood.stdout is not None
    connects: list[int] = []
    try:
        # One line on stdin, so its line breaks go; the answer is never finished within the timeout anyway.
        flood.stdin.write(http_response(fr_dump(FIRST_SEQ)).replace(b"\n", b" ") + b"\n")
        flood.stdin.flush()
        assert flood.stdout.readline().strip() == b"ready"
        yield connects
        flood.stdin.close()
        connects.append(int(flood.stdout.readline() or 0))
        flood.wait(timeout=10)
    finally:
        if flood.poll() is None:
            flood.kill()
            flood.wait()
        for server in servers:
            server.close()


def _pending_snapshot(directory: Path, rank: int, counter: int, now: float) -> None:
    # A message that grows by one byte per poll: the source spots a rewritten file by inode, size and
    # mtime, and two rewrites within one file-timestamp tick on a reused inode would look the same.
    snap = spoolgen.snapshot(100000 + rank, seq=Progress.seq, counter=counter, when=now, message="." * counter)
    snap["status"]["fr"]["0"]["last_completed_collective"] = str(Progress.seq - 1)
    stem = spool.rank_stem("job", rank)
    spool.write_json_atomic(str(directory / (stem + spool.SNAPSHOT_SUFFIX)), snap)


class Clock:
    """The poll loop's clock, one poll interval per poll: the source's pacing rules (least time between
    deep reads) see a steady poll loop without the test sleeping. Socket deadlines use real time."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("mode", ["dribble", "backlog"])
def test_flooded_socket_does_not_hold_the_other_ranks(tmp_path: Path, mode: str) -> None:
    clock = Clock()
    config = RanksConfig(directory=str(tmp_path), poll_interval=POLL_INTERVAL, rank_timeout=RANK_TIMEOUT,
                         deep_interval=0.0)
    source = RanksSource(config, clock=clock)
    exporter = Exporter([(source, 0.0)], poll_interval=POLL_INTERVAL, clock=clock)
    started = time.monotonic()
    durations = []
    Progress.seq = FIRST_SEQ
    with spool_with_flooded_rank(tmp_path, mode) as connects:
        try:
            for counter in range(2, 2 + POLLS):
                clock.now += POLL_INTERVAL
                Progress.seq += 1
                for rank in HEALTHY:
                    _pending_snapshot(tmp_path, rank, counter, clock.now)
                snap = exporter.poll_once()
                durations.append(next(s for s in snap.sources if s.name == n.SOURCE_RANKS).duration_seconds)
                states = {r.rank: r for r in snap.ranks}
                for rank in HEALTHY:
                    state = states[rank]
                    assert state.status == RANK_OK, (counter, rank, state.status)
                    assert state.last_deep_read == clock.now, (counter, rank, "no deep read in this poll")
                    pg = state.pgs[0]
                    assert (pg.last_enqueued, pg.last_completed) == (Progress.seq, Progress.seq - 1)
                    # Only this poll's deep read knows the op and age of the collective in flight now.
                    assert [(c.seq, c.op) for c in pg.inflight] == [(Progress.seq, "all_reduce")], pg.inflight
                assert states[FLOODED].status != RANK_OK
        finally:
            source.close()
    assert max(durations) < RANK_TIMEOUT + SLACK, durations
    errors = next(s for s in exporter.snapshot.sources if s.name == n.SOURCE_RANKS).errors_total
    # A dribbling server holds each request until the deadline; a full backlog refuses at once (EAGAIN).
    assert set(errors) == {"socket_timeout" if mode == "dribble" else "socket_error"}, errors
    assert connects and connects[0] > 0, "no flood client got through"
    assert time.monotonic() - started < POLLS * (RANK_TIMEOUT + SLACK) + 10
