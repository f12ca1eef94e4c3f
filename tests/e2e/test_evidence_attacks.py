"""The evidence directory is untrusted ground: attacks on it, made as an attacker who can write the spool would
make them, against a real `frexporter serve` on loopback.

Fake ranks stand in for killed ones: a manifest and a snapshot that stop refreshing, and a socket file nobody
listens on (a rank_down verdict), or a socket that answers pings and never answers a Flight Recorder read.

Its unit tests are in tests/unit/test_evidence_attacks.py.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from frexporter import naming as n
from frexporter import spool
from frexporter.analysis import Verdict
from frexporter.outputs import evidence
from frexporter.outputs.evidence import EvidenceConfig, EvidenceWriter, list_evidence
from frexporter.outputs.verdict_events import (
    MAX_CAPTURES_PER_INTERVAL,
    MAX_PENDING_CAPTURES,
    VERDICT_LOG_BURST,
)
from tests import spoolgen
from tests.harness import REPO, free_port, metrics, sample, wait_for
from tests.shared.evidence_attacks import OLD_NAME, verdict

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
DROPS = (evidence.REASON_QUEUE_FULL, evidence.REASON_RATE_LIMITED, evidence.REASON_RANK_REPEAT)


class Serve:
    """`frexporter serve` in a subprocess, its log in a file (a flood must not fill a pipe)."""

    def __init__(self, spool_dir: Path, *args: str, poll: str = "0.2") -> None:
        self.port = free_port()
        self.log = spool_dir.parent / f"serve-{self.port}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "frexporter", "serve", "--dir", str(spool_dir), "--listen",
                 f"127.0.0.1:{self.port}", "--poll-interval", poll, "--no-nvml", *args],
                env=ENV, stdout=subprocess.DEVNULL, stderr=out)

    def __enter__(self) -> Serve:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        import urllib.request

        if self.proc.poll() is not None:
            pytest.fail(f"serve exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as resp:
                return metrics(resp.read().decode())
        except OSError:
            return {}  # not listening yet

    def evidence_errors(self) -> dict[str, float]:
        return {labels[n.L_REASON]: value for labels, value in self.metrics().get(n.SOURCE_ERRORS_TOTAL, [])
                if labels.get(n.L_SOURCE) == n.SOURCE_EVIDENCE}

    def stop(self) -> float:
        """SIGTERM; seconds until it exited."""
        started = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                pytest.fail("serve did not stop within 60 s of SIGTERM")
        return time.monotonic() - started

    def lines(self, *loggers: str) -> list[str]:
        return [line for line in self.log.read_text(errors="replace").splitlines()
                if any(f" {name}: " in line for name in loggers)]


def dead_socket(spool_dir: Path, rank: int) -> str:
    """Rank ``rank``'s socket file with nobody listening: what a killed rank leaves behind (connections are
    refused). Returns its name."""
    name = spoolgen.own_socket("job", rank)
    os.makedirs(spool_dir, exist_ok=True)
    path = spool_dir / name
    if not path.exists():
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(path))
        os.chmod(path, spool.SOCKET_MODE)
    return name


def killed_rank(spool_dir: Path, rank: int = 0, **kw: Any) -> None:
    spoolgen.write_rank(spool_dir, "job", rank, socket=dead_socket(spool_dir, rank), **kw)


def tree(root: Path) -> dict[str, tuple[int, int, bytes | str | None]]:
    """Every entry under root, links not followed: type and mode, mtime, content (or link target)."""
    out: dict[str, tuple[int, int, bytes | str | None]] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            body: bytes | str | None = None
            if stat.S_ISREG(st.st_mode):
                body = p.read_bytes()
            elif stat.S_ISLNK(st.st_mode):
                body = os.readlink(p)
            out[str(p.relative_to(root))] = (st.st_mode, st.st_mtime_ns, body)
    return out


def old_dirs(root: Path, count: int, prefix: str = "old") -> None:
    for i in range(count):
        d = root / f"{prefix}{i:02d}"
        d.mkdir(parents=True)
        (d / "data.txt").write_text(f"precious {i}")
        os.utime(d, (1_000_000 + i, 1_000_000 + i))


def bundles_under(root: Path) -> list[Path]:
    """Bundles with a regular verdict.json, in root or in a private frexporter-<uid> directory inside it."""
    found = []
    for d in [root, root / f"{evidence.PRIVATE_PREFIX}{os.geteuid()}"]:
        if d.is_dir() and not d.is_symlink():
            found += [p for p in d.iterdir() if not p.is_symlink() and p.is_dir()
                      and (p / evidence.VERDICT_FILE).is_file() and not (p / evidence.VERDICT_FILE).is_symlink()]
    return found


# ---------------------------------------------------------------- the directory itself


def test_symlinked_evidence_dir_gets_nothing_created_or_deleted(tmp_path: Path) -> None:
    """The reported attack: <spool>/evidence a symlink to a directory of 40 old subdirectories, one killed rank."""
    outside = tmp_path / "outside"
    old_dirs(outside, 40)
    spool_dir = tmp_path / "spool"
    killed_rank(spool_dir)
    os.symlink(outside, spool_dir / spool.EVIDENCE_DIRNAME)
    before, outside_mtime = tree(outside), outside.stat().st_mtime_ns
    with Serve(spool_dir) as serve:
        wait_for(lambda: serve.evidence_errors().get(evidence.REASON_SYMLINK), timeout=30,
                 what="the symlinked evidence directory refused and counted")
        assert sample(serve.metrics(), n.SOURCE_UP, source=n.SOURCE_EVIDENCE) == 0
    assert tree(outside) == before and outside.stat().st_mtime_ns == outside_mtime
    assert (spool_dir / spool.EVIDENCE_DIRNAME).is_symlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory another user owns")
@pytest.mark.parametrize("planted", ["evidence", "private"])
def test_directory_planted_by_another_user_is_refused(tmp_path: Path, planted: str) -> None:
    """A rank of another uid makes <spool>/evidence first (or, in an evidence directory others may write, the
    exporter's private directory): the exporter writes nothing there and removes nothing."""
    spool_dir = tmp_path / "spool"
    killed_rank(spool_dir)
    ev = spool_dir / spool.EVIDENCE_DIRNAME
    ev.mkdir()
    os.chmod(ev, 0o777)
    target = ev
    if planted == "private":
        target = ev / f"{evidence.PRIVATE_PREFIX}{os.geteuid()}"
        target.mkdir()
        os.chmod(target, 0o700)
    old_dirs(target, 25, prefix="theirs")
    for p in [target, *target.rglob("*")]:
        os.chown(p, 4242, 4242)
    before = tree(ev)
    with Serve(spool_dir) as serve:
        wait_for(lambda: serve.evidence_errors().get(evidence.REASON_FOREIGN_OWNER), timeout=30,
                 what="the foreign directory refused and counted")
        assert sample(serve.metrics(), n.SOURCE_UP, source=n.SOURCE_EVIDENCE) == 0
    assert tree(ev) == before


def test_a_directory_others_may_write_gets_a_private_one_inside(tmp_path: Path) -> None:
    """<spool>/evidence of ours but 2770 (as an older exporter made it in group mode): its mode stays, bundles go
    to a 0700 directory of ours inside it."""
    spool_dir = tmp_path / "spool"
    killed_rank(spool_dir)
    ev = spool_dir / spool.EVIDENCE_DIRNAME
    ev.mkdir()
    os.chmod(ev, 0o2770)
    with Serve(spool_dir) as serve:
        (bundle,) = wait_for(lambda: bundles_under(ev), timeout=30, what="a bundle")
        wait_for(lambda: serve.metrics().get(n.SOURCE_UP), timeout=10)
        assert sample(serve.metrics(), n.SOURCE_UP, source=n.SOURCE_EVIDENCE) == 1
    private = ev / f"{evidence.PRIVATE_PREFIX}{os.geteuid()}"
    assert bundle.parent == private and stat.S_IMODE(private.stat().st_mode) == 0o700
    assert stat.S_IMODE(ev.stat().st_mode) == 0o2770
    assert [b["name"] for b in list_evidence(str(ev))] == [f"{private.name}/{bundle.name}"]


# ---------------------------------------------------------------- planted files


@pytest.mark.parametrize("mode", [0o700, 0o2770])
def test_planted_verdict_symlink_in_a_guessable_bundle_is_not_followed(tmp_path: Path, mode: int) -> None:
    """The attacker fills the evidence directory with the bundle names the next minute would have used, each with
    verdict.json (and fr_rank0.json) a symlink to a file elsewhere; the exporter then captures a killed rank."""
    target = tmp_path / "precious.txt"
    target.write_text("precious")
    target_stat = target.stat()
    spool_dir = tmp_path / "spool"
    ev = spool_dir / spool.EVIDENCE_DIRNAME
    ev.mkdir(parents=True)
    os.chmod(ev, mode)
    now = time.time()
    for offset in range(-5, 90):
        d = ev / OLD_NAME.format(ts=time.strftime("%Y%m%dT%H%M%S", time.localtime(now + offset)))
        d.mkdir()
        os.symlink(target, d / evidence.VERDICT_FILE)
        os.symlink(target, d / "fr_rank0.json")
    planted = tree(ev)
    killed_rank(spool_dir)
    with Serve(spool_dir) as serve:
        (bundle,) = wait_for(lambda: bundles_under(ev), timeout=30, what="a bundle")
        assert serve.evidence_errors().get(evidence.REASON_IO) is None
    assert target.read_text() == "precious"
    assert (target.stat().st_mtime_ns, target.stat().st_size) == (target_stat.st_mtime_ns, target_stat.st_size)
    after = tree(ev)
    assert {k: after[k] for k in planted if k != "."} == {k: v for k, v in planted.items() if k != "."}
    doc = json.loads((bundle / evidence.VERDICT_FILE).read_text())
    assert doc["verdict"]["kind"] == "rank_down" and doc[evidence.MARKER_FIELD]["name"] == bundle.name
    assert stat.S_IMODE(bundle.stat().st_mode) == 0o700
    assert stat.S_IMODE((bundle / evidence.VERDICT_FILE).stat().st_mode) == spool.FILE_MODE


# ---------------------------------------------------------------- pruning


def test_pruning_removes_only_bundles_it_wrote(tmp_path: Path) -> None:
    """The evidence directory holds 20 genuine bundles (the cap), the 40 old subdirectories of the report, and
    forgeries: a marker with the right name and a wrong HMAC, a genuine marker copied under another name, an old
    bundle without a marker, a symlink to a directory elsewhere. One killed rank later, the one bundle pruned is
    the oldest genuine one, and a symlink planted inside it goes without its target."""
    spool_dir = tmp_path / "spool"
    ev = spool_dir / spool.EVIDENCE_DIRNAME
    writer = EvidenceWriter(EvidenceConfig(directory=str(ev)))
    genuine = [Path(p) for p in (writer.capture(verdict(rank=100 + i), (), str(spool_dir)) for i in range(20)) if p]
    assert len(genuine) == 20
    outside = tmp_path / "outside"
    old_dirs(outside, 5)
    (outside / "file.txt").write_text("precious")
    os.symlink(outside / "file.txt", genuine[0] / "planted-link")
    old_dirs(ev, 40)
    forged = ev / "20000101T000000-rank_down-job---1-deadbeef"
    forged.mkdir()
    (forged / evidence.VERDICT_FILE).write_text(json.dumps(
        {"verdict": {"kind": "rank_down"}, "captured_at": 1.0, evidence.MARKER_FIELD: {"name": forged.name,
                                                                                         "mac": "00" * 32}}))
    replayed = ev / "20000101T000000-replayed"
    replayed.mkdir()
    shutil.copy(genuine[1] / evidence.VERDICT_FILE, replayed / evidence.VERDICT_FILE)
    unmarked = ev / "20000101T000000-rank_down-job-0-7"
    unmarked.mkdir()
    (unmarked / evidence.VERDICT_FILE).write_text(json.dumps({"verdict": {"kind": "rank_down"}, "captured_at": 1.0}))
    os.symlink(outside, ev / "20000101T000000-link")
    for p in (forged, replayed, unmarked):
        os.utime(p, (1.0, 1.0))
    planted = {k: v for k, v in tree(ev).items() if not k.startswith(tuple(p.name for p in genuine))}
    outside_before = tree(outside)
    killed_rank(spool_dir)
    with Serve(spool_dir):
        wait_for(lambda: not genuine[0].exists(), timeout=30, what="the oldest genuine bundle pruned")
        new = wait_for(lambda: [b for b in bundles_under(ev) if b not in genuine and b != replayed
                                and b != forged and b != unmarked], timeout=10, what="the new bundle")
    after = tree(ev)
    assert {k: after.get(k) for k in planted if k != "."} == {k: v for k, v in planted.items() if k != "."}
    assert tree(outside) == outside_before
    assert sorted(p for p in genuine if p.exists()) == sorted(genuine[1:]) and len(new) == 1


# ---------------------------------------------------------------- floods


def test_a_flood_of_stale_fake_ranks_is_bounded(tmp_path: Path) -> None:
    """5,000 fake ranks that all go down at once: the ranks source tracks MAX_RANKS_PER_NODE of them (the rest
    are refused and counted there), so that many verdicts; at most MAX_CAPTURES_PER_INTERVAL captures (each
    writes one bundle and makes one refused connection), every other one counted, and the verdict and
    evidence log lines bounded."""
    fakes = 5000
    ranks = min(fakes, spool.MAX_RANKS_PER_NODE)
    spool_dir = tmp_path / "spool"
    for rank in range(fakes):
        spoolgen.write_rank(spool_dir, "job", rank, socket=dead_socket(spool_dir, rank))
    ev = spool_dir / spool.EVIDENCE_DIRNAME

    def accounted() -> tuple[float, float] | None:
        errors = serve.evidence_errors()
        dropped, captured = sum(errors.get(r, 0) for r in DROPS), errors.get("socket_refused", 0)
        return (dropped, captured) if dropped + captured >= ranks else None

    with Serve(spool_dir, poll="1") as serve:
        dropped, captured = wait_for(accounted, timeout=180, interval=1.0, what="every verdict captured or counted")
        wait_for(lambda: len(bundles_under(ev)) >= captured, timeout=30, what="the bundles of the captures")
    assert dropped + captured == ranks
    assert 0 < captured <= MAX_CAPTURES_PER_INTERVAL
    assert len(bundles_under(ev)) == captured
    lines = serve.lines("frexporter.outputs.verdict_events", "frexporter.outputs.evidence")
    # A burst of verdict lines, one line per capture, one per reason, and the sums of what was suppressed.
    assert len(lines) <= VERDICT_LOG_BURST + captured + len(DROPS) + 4 + 2, lines[-20:]
    assert any("more verdict messages suppressed" in line for line in lines)


class SilentRank:
    """The sockets of many fake ranks (each its own, as the recorder makes them): answers ping, holds every
    Flight Recorder read unanswered, counts them."""

    def __init__(self, spool_dir: Path, job_id: str, ranks: int) -> None:
        self.socks = []
        for rank in range(ranks):
            path = spool_dir / spoolgen.own_socket(job_id, rank)
            sock = socket.socket(socket.AF_UNIX)
            sock.bind(str(path))
            os.chmod(path, spool.SOCKET_MODE)
            sock.listen(16)
            self.socks.append(sock)
        self.held: list[socket.socket] = []
        self.reads = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            for sock in self.socks:
                selector.register(sock, selectors.EVENT_READ)
            while not self.stopped.is_set():
                for key, _ in selector.select(timeout=0.2):
                    self._answer(key.fileobj)  # type: ignore[arg-type]

    def _answer(self, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, TimeoutError):
            return
        conn.settimeout(2)
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
        except OSError:
            conn.close()
            return
        if b"/handler/ping" in data.split(b"\r\n", 1)[0]:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\npong")
            conn.close()
        else:
            self.reads += 1
            self.held.append(conn)

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)
        for conn in self.held:
            conn.close()
        for sock in self.socks:
            sock.close()


def test_captures_of_silent_ranks_are_queued_at_most_eight_and_do_not_hold_shutdown(tmp_path: Path) -> None:
    """40 wedged fake ranks whose sockets accept and never answer a read: each capture would take the socket
    timeout, so 40 queued captures would hold the exporter for minutes. At most MAX_PENDING_CAPTURES are queued
    (the rest counted as queue_full), and SIGTERM drops the queue: exit within one capture's timeout."""
    ranks = 40
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir(mode=0o700)
    silent = SilentRank(spool_dir, "job", ranks)
    try:
        for rank in range(ranks):
            # No recorders: the exporter's routine deep reads leave the rank alone, so every read is a capture.
            spoolgen.write_rank(spool_dir, "job", rank, socket=spoolgen.own_socket("job", rank), recorders=[])
        with Serve(spool_dir, "--stuck-after", "1") as serve:  # a wedged rank is a verdict after --stuck-after
            wait_for(lambda: serve.evidence_errors().get(evidence.REASON_QUEUE_FULL, 0) >= ranks - MAX_PENDING_CAPTURES,
                     timeout=60, what="the verdicts beyond the queue counted")
            wait_for(lambda: silent.reads >= 1, timeout=30, what="the first capture's read")
            assert silent.reads <= MAX_PENDING_CAPTURES
            took = serve.stop()
        assert silent.reads <= MAX_PENDING_CAPTURES
        # One capture may be running: it ends at the socket timeout. Generous slack for the poll loop's own stop.
        assert took < EvidenceConfig.timeout + 15, took
    finally:
        silent.close()


# ---------------------------------------------------------------- listing


def test_listing_follows_no_symlink(tmp_path: Path) -> None:
    """/api/v1/evidence: a symlinked evidence directory lists nothing; a symlinked bundle is not listed; a
    verdict.json that is a symlink (to a valid verdict elsewhere) is an error, not read."""
    real = tmp_path / "real"
    writer = EvidenceWriter(EvidenceConfig(directory=str(real)))
    bundle = Path(writer.capture(verdict(), (), str(tmp_path)) or "")
    assert [b["name"] for b in list_evidence(str(real))] == [bundle.name]
    os.symlink(real, tmp_path / "link")
    assert list_evidence(str(tmp_path / "link")) == []
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(bundle / evidence.VERDICT_FILE, tmp_path / "elsewhere" / evidence.VERDICT_FILE)
    os.symlink(tmp_path / "elsewhere", real / "20000101T000000-linked-bundle")
    lured = real / "20000101T000000-lured"
    lured.mkdir()
    os.symlink(tmp_path / "elsewhere" / evidence.VERDICT_FILE, lured / evidence.VERDICT_FILE)
    listing = {b["name"]: b for b in list_evidence(str(real))}
    assert set(listing) == {bundle.name, lured.name}
    assert listing[lured.name]["error"] == "symlink" and "verdict" not in listing[lured.name]

    spool_dir = tmp_path / "spool"
    spool_dir.mkdir(mode=0o700)
    os.symlink(real, spool_dir / spool.EVIDENCE_DIRNAME)
    with Serve(spool_dir, "--enable-debug-endpoints") as serve:
        import urllib.request

        wait_for(serve.metrics, timeout=30, what="serve up")
        with urllib.request.urlopen(f"http://127.0.0.1:{serve.port}/api/v1/evidence", timeout=10) as resp:
            assert json.loads(resp.read()) == {"enabled": True, "bundles": []}


def test_one_capture_reads_sockets_for_at_most_its_deadline(tmp_path: Path) -> None:
    """A PG of 8 wedged ranks whose sockets never answer: the capture stops at its deadline, counts the reads it
    skipped, and still writes the bundle."""
    from frexporter.sources.ranks import RanksConfig, RanksSource

    spool_dir = tmp_path / "spool"
    spool_dir.mkdir(mode=0o700)
    silent = SilentRank(spool_dir, "job", 8)
    try:
        for rank in range(8):
            spoolgen.write_rank(spool_dir, "job", rank, socket=spoolgen.own_socket("job", rank), recorders=[])
        source = RanksSource(RanksConfig(directory=str(spool_dir)))
        ranks = source.collect().ranks
        source.close()
        assert len(ranks) == 8
        config = EvidenceConfig(directory=str(tmp_path / "evidence"), timeout=0.5, deadline=1.2)
        writer = EvidenceWriter(config)
        stuck = Verdict(kind="missing_rank", job_id="job", pg="0", pg_desc="default_pg", ranks=(5,),
                        waiting_ranks=(0, 1, 2, 3, 4, 6, 7), seq=11, op="all_reduce", since=None, age_seconds=None,
                        timeout_seconds=None, budget_used=None, summary="rank 5 never joined")
        path = writer.capture(stuck, ranks, str(spool_dir))
        totals = writer.counts.totals()
        # ceil(deadline / timeout) reads at most; every other rank counted instead of read.
        assert silent.reads <= 3 and totals["socket_timeout"] == silent.reads
        assert totals[evidence.REASON_DEADLINE] == 8 - silent.reads
        assert path is not None and json.loads((Path(path) / evidence.VERDICT_FILE).read_text())["files"] == {}
    finally:
        silent.close()
