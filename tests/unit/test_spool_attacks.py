"""The spool is untrusted input: attacks by whoever may write it, against a real exporter over a real spool.

Every attack here is made as an attacker would make it: links planted under spool names (pointing at files
and sockets outside), names swapped between the exporter's check and its use, sockets of another user, a
flood of junk names, a spool opened up while the exporter runs. The exporter must neither read nor connect to
anything outside the spool, count each refusal under a bounded reason, keep its log and its state bounded,
and keep serving the real ranks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from frexporter import naming as n
from frexporter import spool
from frexporter.exporter import Exporter
from frexporter.model import RANK_OK
from frexporter.sources import ranks as ranks_module
from frexporter.sources.ranks import RanksConfig, RanksSource
from tests import spoolgen
from tests.harness import REPO, free_port, metrics, sample, wait_for

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
POLL = 0.2
SECRET = "SECRET-outside-the-spool"
OTHER_UID = 12345
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own files as another user")


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


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


# ---------------------------------------------------------------- files: links planted and swapped


@contextlib.contextmanager
def serve(directory: Path, log: Path, *flags: str) -> Iterator[str]:
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "frexporter", "serve", "--dir", str(directory), "--listen",
                                 f"127.0.0.1:{port}", "--poll-interval", str(POLL), "--no-nvml", *flags],
                                env=ENV, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"serve exited {proc.returncode}:\n{log.read_text()}")
        with contextlib.suppress(OSError):
            return bool(status(base))
        return False

    try:
        wait_for(up, timeout=30, what="serve answering")
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


def get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def status(base: str) -> dict[str, Any]:
    return json.loads(get(base + "/api/v1/status"))


def ranks_errors(doc: dict[str, Any]) -> dict[str, int]:
    return next(s for s in doc["sources"] if s["source"] == n.SOURCE_RANKS)["errors_total"]


@pytest.mark.e2e
@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "json"])
def test_linked_files_are_never_read_by_a_serving_exporter(tmp_path: Path, mapped: bool) -> None:
    """Symbolic and hard links under spool names, to a snapshot and a manifest outside the spool."""
    d = private_spool(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    # Rank 0's snapshot is a symbolic link to a snapshot outside; rank 1's a hard link to one.
    for rank, link in ((0, os.symlink), (1, os.link)):
        name = spoolgen.write_rank(d, "job", rank, mapped=mapped) + (
            spool.SNAPSHOT_MAP_SUFFIX if mapped else spool.SNAPSHOT_SUFFIX)
        os.unlink(d / name)
        (outside / str(rank)).mkdir()
        link(outside_snapshot(outside / str(rank), 100000 + rank, mapped), d / name)
    # Ranks 2 and 3: their manifests are links to a manifest outside, of a job the planter invents.
    spool.write_json_atomic(str(outside / "m.json"), spoolgen.manifest("outside-job", 7))
    os.symlink(outside / "m.json", d / ("job.r2" + spool.MANIFEST_SUFFIX))
    os.link(outside / "m.json", d / ("job.r3" + spool.MANIFEST_SUFFIX))
    with serve(d, tmp_path / "serve.log") as base:
        # Four refusals, each counted once however many polls see it.
        wait_for(lambda: ranks_errors(status(base)).get("foreign", 0) >= 4, timeout=20, what="the links refused")
        polls_later = time.monotonic() + 5 * POLL
        while time.monotonic() < polls_later:
            text = get(base + "/api/v1/status")
            assert SECRET not in text and "outside-job" not in text
        doc = status(base)
        assert ranks_errors(doc) == {"foreign": 4}
        assert sorted(r["rank"] for r in doc["ranks"]) == [0, 1]
        assert all(r["message"] == "" and r["heartbeat"] is None for r in doc["ranks"])
        parsed = metrics(get(base + "/metrics"))
        assert sample(parsed, n.SOURCE_ERRORS_TOTAL, source="ranks", reason="foreign") == 4
        assert sample(parsed, n.SOURCE_UP, source="ranks") == 1
    assert "a symbolic link; refused" in (tmp_path / "serve.log").read_text()


@contextlib.contextmanager
def swap_at_open(name: str, target: Path) -> Iterator[list[str]]:
    """Replace spool entry ``name`` with a link to ``target`` at the moment the exporter opens it: after every
    check the exporter made of the name, before the open (the race a planter would try to win)."""
    real_open = os.open
    swapped: list[str] = []

    def racing_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if not swapped and os.path.basename(os.fspath(path)) == name:
            if dir_fd is None:
                link = os.path.join(os.path.dirname(os.fspath(path)), ".planted")
                os.symlink(target, link)
                os.replace(link, path)
            else:
                os.symlink(target, ".planted", dir_fd=dir_fd)
                os.replace(".planted", path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            swapped.append(name)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    os.open = racing_open  # type: ignore[assignment]
    try:
        yield swapped
    finally:
        os.open = real_open


def test_manifest_swapped_for_a_link_between_check_and_open(tmp_path: Path) -> None:
    d = private_spool(tmp_path)
    spoolgen.write_rank(d, "job", 0)
    spool.write_json_atomic(str(tmp_path / "outside.json"), spoolgen.manifest("outside-job", 7))
    exporter, source = make_exporter(d)
    try:
        exporter.poll_once()
        # The rank rewrites its manifest (a new version to read); the planter swaps it as the exporter opens it.
        spool.write_json_atomic(str(d / ("job.r0" + spool.MANIFEST_SUFFIX)), spoolgen.manifest("job", 0, pgs=2))
        with swap_at_open("job.r0" + spool.MANIFEST_SUFFIX, tmp_path / "outside.json") as swapped:
            exporter.poll_once()
        assert swapped, "the exporter never opened the manifest"
        for _ in range(3):
            exporter.poll_once()
        assert {r.job_id for r in exporter.snapshot.ranks} == {"job"}  # the old version, never the outside one
        assert errors_of(exporter)["foreign"] >= 1
    finally:
        source.close()


def test_mapped_snapshot_swapped_for_a_link_between_check_and_open(tmp_path: Path) -> None:
    d = private_spool(tmp_path)
    stem = spoolgen.write_rank(d, "job", 0, mapped=True)
    (tmp_path / "o").mkdir()
    target = outside_snapshot(tmp_path / "o", 100000, mapped=True)
    exporter, source = make_exporter(d)
    try:
        with swap_at_open(stem + spool.SNAPSHOT_MAP_SUFFIX, target) as swapped:
            exporter.poll_once()
        assert swapped
        for _ in range(3):
            exporter.poll_once()
        assert [r.message for r in exporter.snapshot.ranks] == [""]
        assert errors_of(exporter) == {"foreign": 1}
    finally:
        source.close()


# ---------------------------------------------------------------- sockets


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


def spool_with_socket_ranks(d: Path) -> None:
    """Rank 0 fresh with work to read (a deep read is due at once), rank 1 stale (a ping is due)."""
    spoolgen.write_rank(d, "job", 0, socket=S0)
    stem = spoolgen.write_rank(d, "job", 1, socket=S1)
    spool.write_json_atomic(str(d / (stem + spool.SNAPSHOT_SUFFIX)), spoolgen.snapshot(100001, when=1.0))


def test_socket_linked_to_another_socket_gets_no_connection(tmp_path: Path) -> None:
    d = private_spool(tmp_path)
    spool_with_socket_ranks(d)
    with listening(tmp_path / "victim.sock") as victim:
        os.symlink(tmp_path / "victim.sock", d / S0)
        os.symlink(tmp_path / "victim.sock", d / S1)
        exporter, source = make_exporter(d)
        try:
            for _ in range(5):
                exporter.poll_once()
        finally:
            source.close()
        assert nothing_connected(victim)
    assert errors_of(exporter) == {"socket_untrusted": 2}  # once per socket, not per poll
    assert [r.socket_alive for r in exporter.snapshot.ranks] == [False, False]


@as_root
def test_socket_of_another_user_is_refused(tmp_path: Path) -> None:
    d = private_spool(tmp_path)
    spool_with_socket_ranks(d)
    with listening(d / S0) as s0, listening(d / S1) as s1:
        for name in (S0, S1):
            os.chown(d / name, OTHER_UID, OTHER_UID)
        exporter, source = make_exporter(d)
        try:
            for _ in range(3):
                exporter.poll_once()
        finally:
            source.close()
        assert nothing_connected(s0) and nothing_connected(s1)
    assert errors_of(exporter) == {"socket_untrusted": 2}
    assert "owned by uid 12345" in next(s for s in exporter.snapshot.sources if s.name == "ranks").last_error


VICTIM = r"""
import socket, sys
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(sys.argv[1])
server.listen(4)
print("listening", flush=True)
server.settimeout(30)
conn, _ = server.accept()
conn.settimeout(10)
data = b""
try:
    while chunk := conn.recv(4096):
        data += chunk
except OSError:
    pass
print(len(data), flush=True)
"""


@pytest.mark.e2e
@as_root
def test_socket_swapped_after_the_check_is_caught_by_peer_credentials(tmp_path: Path) -> None:
    """The planter swaps the rank's socket for a link to another user's service after every check of the name:
    the connection reaches that service, which must receive nothing (SO_PEERCRED names its uid first)."""
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    base = Path(tempfile.mkdtemp(prefix="frexporter-victim-"))
    os.chmod(base, 0o755)
    (base / "svc").mkdir()
    os.chown(base / "svc", OTHER_UID, OTHER_UID)
    victim_path = base / "svc" / "service.sock"
    victim = subprocess.Popen([python, "-c", VICTIM, str(victim_path)], user=OTHER_UID, cwd="/",
                              stdout=subprocess.PIPE, text=True)
    d = private_spool(tmp_path)
    spoolgen.write_rank(d, "job", 0, socket=S0)
    try:
        assert victim.stdout is not None and victim.stdout.readline().strip() == "listening"
        with listening(d / S0) as real:
            real_lstat = os.lstat
            swapped: list[str] = []

            def racing_lstat(path: Any, *args: Any, **kw: Any) -> os.stat_result:
                result = real_lstat(path, *args, **kw)
                if not swapped and os.fspath(path) == str(d / S0):
                    os.symlink(victim_path, d / ".planted")
                    os.replace(d / ".planted", d / S0)
                    swapped.append(S0)
                return result

            exporter, source = make_exporter(d)
            os.lstat = racing_lstat  # type: ignore[assignment]
            try:
                exporter.poll_once()
            finally:
                os.lstat = real_lstat
                source.close()
            assert swapped, "the exporter never checked the socket before connecting"
            assert nothing_connected(real)
        assert victim.stdout.readline().strip() == "0"  # connected to, but not one byte sent
        assert victim.wait(timeout=20) == 0
        errors = errors_of(exporter)
        assert errors == {"socket_untrusted": 1}, errors
        last = next(s for s in exporter.snapshot.sources if s.name == "ranks").last_error
        assert f"answered by uid {OTHER_UID}" in last and "nothing sent" in last
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
        shutil.rmtree(base)


# ---------------------------------------------------------------- floods and state


JUNK = 80_000


@pytest.mark.e2e
def test_junk_flood_is_counted_exactly_with_a_bounded_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = private_spool(tmp_path)
    spoolgen.write_rank(d, "job", 0)
    for i in range(JUNK):
        os.close(os.open(d / f"junk-{i}", os.O_CREAT | os.O_WRONLY, 0o600))
    clock = Clock()
    exporter, source = make_exporter(d, clock)
    caplog.set_level(logging.INFO, logger="frexporter")
    try:
        for _ in range(3):
            clock.now += POLL
            spoolgen.refresh(d, "job", 0, counter=int(clock.now * 10))
            exporter.poll_once()
        assert errors_of(exporter) == {"foreign": JUNK}  # each name once, not once per poll
        assert {r.rank for r in exporter.snapshot.ranks if r.status == RANK_OK} == {0}
        junk_lines = [r for r in caplog.records if "not a frexporter spool file" in r.getMessage()]
        assert len(junk_lines) == len(caplog.records) == ranks_module.LOG_BURST
        # When the window ends, one line sums up what was not logged.
        clock.now += ranks_module.LOG_WINDOW
        exporter.poll_once()
        (summary,) = [r.getMessage() for r in caplog.records if "were not logged" in r.getMessage()]
        assert f"{JUNK - ranks_module.LOG_BURST} more like these (foreign)" in summary
        assert errors_of(exporter) == {"foreign": JUNK}
    finally:
        source.close()


def test_state_of_vanished_names_is_dropped(tmp_path: Path) -> None:
    d = private_spool(tmp_path)
    spoolgen.write_rank(d, "job", 0)
    stem = spoolgen.write_rank(d, "job", 1, socket=S1)  # stale, its socket missing: a logged failure
    spool.write_json_atomic(str(d / (stem + spool.SNAPSHOT_SUFFIX)), spoolgen.snapshot(100001, when=1.0))
    planted = [d / f"junk-{i}" for i in range(50)] + [d / f"bad.r{i}{spool.MANIFEST_SUFFIX}" for i in range(50)]
    for path in planted:
        path.write_bytes(b"garbage")
    os.symlink("/etc/hostname", d / ("job.r0" + spool.SNAPSHOT_MAP_SUFFIX))
    exporter, source = make_exporter(d)
    try:
        exporter.poll_once()
        assert len(source._spool.bad_files) == 101 and source._sockets.logged
        first = errors_of(exporter)
        assert first["foreign"] == 51 and first["corrupt"] == 50
        for path in planted:
            path.unlink()
        os.unlink(d / ("job.r0" + spool.SNAPSHOT_MAP_SUFFIX))
        os.unlink(d / (stem + spool.MANIFEST_SUFFIX))
        exporter.poll_once()
        assert source._spool.bad_files == {} and source._sockets.logged == set()
        assert [r.rank for r in exporter.snapshot.ranks] == [0]
        # A name planted again is a new bad file, counted again.
        planted[0].write_bytes(b"garbage")
        exporter.poll_once()
        assert errors_of(exporter)["foreign"] == first["foreign"] + 1
    finally:
        source.close()


def test_ranks_beyond_the_bound_are_refused_and_counted(tmp_path: Path) -> None:
    d = private_spool(tmp_path)
    extra = 6
    for rank in range(spool.MAX_RANKS_PER_NODE + extra):
        spool.write_json_atomic(str(d / (spool.rank_stem("job", rank) + spool.MANIFEST_SUFFIX)),
                                spoolgen.manifest("job", rank, world=2))
    exporter, source = make_exporter(d)
    try:
        for _ in range(3):
            exporter.poll_once()
        tracked = {r.rank for r in exporter.snapshot.ranks}
        assert len(tracked) == spool.MAX_RANKS_PER_NODE
        assert errors_of(exporter) == {"too_many_ranks": extra}  # once per manifest, not per poll
        # Ranks that leave make room: the refused ones are read (within two polls: the first may see the new
        # manifests before it drops the departed ranks).
        refused = set(range(spool.MAX_RANKS_PER_NODE + extra)) - tracked
        departed = set(sorted(tracked)[:extra])
        for rank in departed:
            os.unlink(d / (spool.rank_stem("job", rank) + spool.MANIFEST_SUFFIX))
        exporter.poll_once()
        exporter.poll_once()
        assert {r.rank for r in exporter.snapshot.ranks} == (tracked - departed) | refused
        assert errors_of(exporter) == {"too_many_ranks": extra}
    finally:
        source.close()


# ---------------------------------------------------------------- permissions while running


def test_spool_opened_up_while_running_is_warned_and_counted(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    d = private_spool(tmp_path)
    stem = spoolgen.write_rank(d, "job", 0)
    exporter, source = make_exporter(d)
    caplog.set_level(logging.WARNING, logger="frexporter")

    def polls(count: int) -> None:
        for _ in range(count):
            exporter.poll_once()
            assert [r.rank for r in exporter.snapshot.ranks] == [0]  # still read: no --strict-permissions

    def warned(what: str) -> int:
        return sum("unsafe spool permissions" in r.getMessage() and what in r.getMessage() for r in caplog.records)

    try:
        polls(2)
        assert errors_of(exporter) == {} and warned("") == 0
        os.chmod(d, 0o777)
        polls(4)
        assert errors_of(exporter) == {"unsafe_permissions": 1} and warned("world-writable (mode 777)") == 1
        os.chmod(d, 0o700)
        polls(2)
        os.chmod(d, 0o777)  # back again: reported again
        polls(2)
        assert errors_of(exporter) == {"unsafe_permissions": 2} and warned("world-writable (mode 777)") == 2
        os.chmod(d, 0o700)
        os.chmod(d / (stem + spool.MANIFEST_SUFFIX), 0o666)
        polls(3)
        assert errors_of(exporter) == {"unsafe_permissions": 3}
        assert warned("writable by every local user (mode 666)") == 1
    finally:
        source.close()


@pytest.mark.e2e
def test_strict_serve_stops_reading_a_spool_opened_up_and_resumes_when_fixed(tmp_path: Path) -> None:
    d = private_spool(tmp_path)
    stem = spoolgen.write_rank(d, "job", 0, mapped=True)
    log = tmp_path / "serve.log"
    deadline = 30 * POLL + 10  # a few polls, on a loaded machine

    def source_up(base: str) -> float | None:
        return sample(metrics(get(base + "/metrics")), n.SOURCE_UP, source="ranks")

    def until(base: str, predicate: Callable[[dict[str, Any], float | None], bool], what: str) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            doc = status(base)
            return doc if predicate(doc, source_up(base)) else None

        return wait_for(check, timeout=deadline, what=what)

    with serve(d, log, "--strict-permissions") as base:
        until(base, lambda doc, up: up == 1 and len(doc["ranks"]) == 1, "rank 0 served")
        os.chmod(d, 0o777)
        doc = until(base, lambda doc, up: up == 0, "source down")
        assert doc["ranks"] == [] and ranks_errors(doc)["unsafe_permissions"] >= 1
        os.chmod(d, 0o700)
        until(base, lambda doc, up: up == 1 and len(doc["ranks"]) == 1, "source back")
        os.chmod(d / (stem + spool.SNAPSHOT_MAP_SUFFIX), 0o666)  # a rank file anyone may rewrite
        until(base, lambda doc, up: up == 0, "source down for a file")
        os.chmod(d / (stem + spool.SNAPSHOT_MAP_SUFFIX), 0o600)
        until(base, lambda doc, up: up == 1 and len(doc["ranks"]) == 1, "source back after the file")
    text = log.read_text()
    # One line per episode however many polls it lasted, naming the problem and the fix.
    assert text.count("world-writable (mode 777)") == 1, text
    assert text.count("writable by every local user (mode 666)") == 1, text
    assert f"fix: chmod 700 {d}" in text and text.count("source ranks recovered") == 2


def test_manifest_naming_something_else_as_its_socket_gets_no_connection(tmp_path: Path) -> None:
    d = private_spool(tmp_path)
    spool_with_socket_ranks(d)
    # Rank 0's manifest names the spool's parent directory, rank 1's another rank's manifest: neither is the
    # socket the recorder makes for its stem, so neither is connected to.
    spool.write_json_atomic(str(d / ("job.r0" + spool.MANIFEST_SUFFIX)), spoolgen.manifest("job", 0, socket=".."))
    spool.write_json_atomic(str(d / ("job.r1" + spool.MANIFEST_SUFFIX)),
                            spoolgen.manifest("job", 1, socket="job.r0" + spool.MANIFEST_SUFFIX))
    exporter, source = make_exporter(d)
    try:
        for _ in range(4):
            exporter.poll_once()
    finally:
        source.close()
    assert errors_of(exporter) == {"socket_mismatch": 2}
    assert [(r.rank, r.socket) for r in exporter.snapshot.ranks] == [(0, ""), (1, "")]


def test_manifest_naming_another_ranks_socket_is_not_shown_with_its_state(tmp_path: Path) -> None:
    """Rank 1's manifest names rank 0's (live, answering) socket: its pings and FR entries would be rank 0's."""
    d = private_spool(tmp_path)
    spool_with_socket_ranks(d)
    spool.write_json_atomic(str(d / ("job.r1" + spool.MANIFEST_SUFFIX)), spoolgen.manifest("job", 1, socket=S0))
    with listening(d / S0):
        exporter, source = make_exporter(d)
        try:
            for _ in range(4):
                exporter.poll_once()
        finally:
            source.close()
    assert errors_of(exporter).get("socket_mismatch") == 1
    assert [(r.rank, r.socket) for r in exporter.snapshot.ranks] == [(0, S0), (1, "")]


@as_root
def test_socket_trust_follows_the_spool_mode(tmp_path: Path) -> None:
    with listening(tmp_path / "s.sock"):
        os.chown(tmp_path / "s.sock", OTHER_UID, OTHER_UID)
        st = os.lstat(tmp_path / "s.sock")
        private = spool.Trust(group=False, uid=0, gids=frozenset({0}))
        assert spool.socket_problem(st, private) == "a socket owned by uid 12345, not by this user (uid 0) or root"
        assert spool.socket_problem(st, spool.Trust(group=False, uid=OTHER_UID, gids=frozenset())) is None
        assert spool.socket_problem(st, spool.Trust(group=True, uid=0, gids=frozenset({OTHER_UID}))) is None
        assert "group 12345, which this process is not in" in str(
            spool.socket_problem(st, spool.Trust(group=True, uid=0, gids=frozenset({0}))))
        os.link(tmp_path / "s.sock", tmp_path / "other-name.sock")
        assert "2 hard links" in str(spool.socket_problem(os.lstat(tmp_path / "s.sock"),
                                                          spool.Trust(group=False, uid=OTHER_UID, gids=frozenset())))
