"""The spool is untrusted input: attacks by whoever may write it, against a real exporter over a real spool.

Every attack here is made as an attacker would make it: links planted under spool names (pointing at files
and sockets outside), names swapped between the exporter's check and its use, sockets of another user, a
flood of junk names, a spool opened up while the exporter runs. The exporter must neither read nor connect to
anything outside the spool, count each refusal under a bounded reason, keep its log and its state bounded,
and keep serving the real ranks.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_spool_attacks.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from frexporter import spool
from tests import spoolgen
from tests.shared.spool_attacks import (
    OTHER_UID,
    S0,
    S1,
    as_root,
    errors_of,
    listening,
    make_exporter,
    nothing_connected,
    outside_snapshot,
    private_spool,
)


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
