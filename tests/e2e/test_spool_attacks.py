"""The spool is untrusted input: attacks by whoever may write it, against a real exporter over a real spool.

Every attack here is made as an attacker would make it: links planted under spool names (pointing at files
and sockets outside), names swapped between the exporter's check and its use, sockets of another user, a
flood of junk names, a spool opened up while the exporter runs. The exporter must neither read nor connect to
anything outside the spool, count each refusal under a bounded reason, keep its log and its state bounded,
and keep serving the real ranks.

Its unit tests are in tests/unit/test_spool_attacks.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
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
from frexporter.model import RANK_OK
from frexporter.sources import ranks as ranks_module
from tests import spoolgen
from tests.fakes.clock import Clock
from tests.harness import REPO, free_port, metrics, sample, wait_for
from tests.shared.spool_attacks import (
    OTHER_UID,
    POLL,
    S0,
    SECRET,
    as_root,
    errors_of,
    listening,
    make_exporter,
    nothing_connected,
    outside_snapshot,
    private_spool,
)

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


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


@as_root


# ---------------------------------------------------------------- sockets


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
