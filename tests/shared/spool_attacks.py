"""What both halves of test_spool_attacks.py use: a private spool, an exporter over it, a secret outside it
that a planted file points at, and a unix socket that never accepts."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from frexporter import naming as n
from frexporter import spool
from frexporter.exporter import Exporter
from frexporter.sources.ranks import RanksConfig, RanksSource
from tests import spoolgen
from tests.fakes.clock import Clock

POLL = 0.2
SECRET = "SECRET-outside-the-spool"
OTHER_UID = 12345
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own files as another user")


def private_spool(tmp_path: Path) -> Path:
    d = tmp_path / "spool"
    d.mkdir(mode=0o700)
    os.chmod(d, 0o700)
    return d


def make_exporter(directory: Path, clock: Clock | None = None, **config: Any) -> tuple[Exporter, RanksSource]:
    source = RanksSource(RanksConfig(directory=str(directory), poll_interval=POLL, rank_timeout=0.5, **config),
                         **({"clock": clock} if clock else {}))
    return Exporter([(source, 0.0)], poll_interval=POLL, **({"clock": clock} if clock else {})), source


def errors_of(exporter: Exporter) -> dict[str, int]:
    return dict(next(s for s in exporter.snapshot.sources if s.name == n.SOURCE_RANKS).errors_total)


def outside_snapshot(outside: Path, pid: int, mapped: bool) -> Path:
    """A valid snapshot of rank ``pid`` whose message is the secret: a file the planter wants read."""
    doc = spoolgen.snapshot(pid, message=SECRET)
    if mapped:
        path = outside / ("victim" + spool.SNAPSHOT_MAP_SUFFIX)
        writer = spool.SnapshotMap(str(path))
        writer.write(json.dumps(spoolgen.as_mapped(doc)).encode())
        writer.close()
    else:
        path = outside / ("victim" + spool.SNAPSHOT_SUFFIX)
        spool.write_json_atomic(str(path), doc)
    return path


@contextlib.contextmanager
def listening(path: Path) -> Iterator[socket.socket]:
    """A unix socket that listens and never accepts: whatever connects waits in its queue."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(16)
    sock.setblocking(False)
    try:
        yield sock
    finally:
        sock.close()


def nothing_connected(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()
    except BlockingIOError:
        return True
    conn.close()
    return False


S0, S1 = spoolgen.own_socket("job", 0), spoolgen.own_socket("job", 1)
