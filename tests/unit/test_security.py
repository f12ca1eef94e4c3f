"""Security: TLS and basic auth from an exporter-toolkit web config, debug endpoints off by default,
spool permission checks, and the group-shared spool mode.

Certificates are made per session with the openssl CLI (a CA, a server certificate for 127.0.0.1,
client certificates, and a second CA nobody trusts); every TLS test does a real handshake.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_security.py.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Any

import pytest

from frexporter import cli, spool
from frexporter.web import webconfig
from frexporter.web.webconfig import BasicAuth, check_debug_exposure, is_loopback
from tests import spoolgen
from tests.shared.security import HASH, PASSWORD, basic, get, write_config


def test_basic_auth_unit() -> None:
    auth = BasicAuth({"a": HASH})
    assert auth.check(basic("a", PASSWORD))
    assert not auth.check(basic("a", PASSWORD + "x"))
    assert not auth.check(basic("b", PASSWORD))  # unknown user: a dummy bcrypt, same cost
    assert not auth.check(None) and not auth.check("") and not auth.check("Basic")
    assert not auth.check("Basic " + base64.b64encode(b"no-colon").decode())
    assert not auth.check("Basic " + base64.b64encode(b"a:\xff\x00").decode())
    assert auth.check("basic " + base64.b64encode(f"a:{PASSWORD}".encode()).decode())  # scheme is case-insensitive
    # A bounded cache: a flood of distinct wrong passwords cannot evict the right one.
    auth.MAX_CACHED_BAD = 4
    for i in range(10):
        assert not auth.check(basic("a", f"guess{i}"))
    calls = auth.bcrypt_calls
    assert auth.check(basic("a", PASSWORD)) and auth.bcrypt_calls == calls


def test_empty_config_means_plain_http(tmp_path: Path) -> None:
    config = webconfig.load_web_config(str(write_config(tmp_path, "")))
    assert config.tls is None and not config.basic_auth_users and not config.authenticates


# ---------------------------------------------------------------- debug endpoints


def _bundle(evidence: Path, name: str, verdict: Any, captured_at: float = 1.0) -> None:
    d = evidence / name
    d.mkdir(parents=True)
    (d / "fr_rank0.json").write_text('{"entries": []}')
    (d / "verdict.json").write_text(json.dumps({"verdict": verdict, "captured_at": captured_at, "files": {}})
                                    if verdict is not None else "{not json")


def test_evidence_endpoint_is_off_by_default(spool_dir: Path, exporter_factory: Any) -> None:
    exp = exporter_factory(spool_dir)
    code, body, _ = get(exp.base + "/api/v1/evidence")
    assert code == 404 and "--enable-debug-endpoints" in body


def test_evidence_endpoint_lists_bundles_on_loopback(spool_dir: Path, exporter_factory: Any) -> None:
    evidence = spool_dir / spool.EVIDENCE_DIRNAME
    verdict = {"kind": "missing_rank", "job_id": "job", "pg": "0", "pg_desc": "default_pg", "seq": 7,
               "op": "all_reduce", "ranks": [3], "waiting_ranks": [0, 1, 2], "summary": "rank 3 never joined",
               "since": 1.0, "extra": {"nested": "ignored"}}
    _bundle(evidence, "20250101T000000-missing_rank-job-0-7", verdict, captured_at=100.0)
    _bundle(evidence, "20250101T000100-broken", None, captured_at=0)
    _bundle(evidence, "20250101T000200-odd", {"kind": 5, "ranks": ["x", 1, True]}, captured_at=200.0)
    os.utime(evidence / "20250101T000100-broken", (1.0, 1.0))  # no captured_at: listed by its mtime
    (evidence / "stray-file").write_text("x")
    exp = exporter_factory(spool_dir, debug_endpoints=True)
    code, body, _ = get(exp.base + "/api/v1/evidence")
    assert code == 200
    listing = json.loads(body)
    assert listing["enabled"] is True
    by_name = {b["name"]: b for b in listing["bundles"]}
    assert set(by_name) == {"20250101T000000-missing_rank-job-0-7", "20250101T000100-broken", "20250101T000200-odd"}
    good = by_name["20250101T000000-missing_rank-job-0-7"]
    assert good["files"] == 2 and good["bytes"] > 0 and good["captured_at"] == 100.0
    assert good["verdict"] == {k: v for k, v in verdict.items() if k not in ("since", "extra")}
    assert by_name["20250101T000100-broken"]["error"] in ("corrupt", "truncated")
    assert by_name["20250101T000200-odd"]["verdict"] == {"ranks": [1]}
    assert [b["name"] for b in listing["bundles"]] == [  # newest first
        "20250101T000200-odd", "20250101T000000-missing_rank-job-0-7", "20250101T000100-broken"]
    disabled = exporter_factory(spool_dir, debug_endpoints=True, evidence_dir="")
    assert json.loads(get(disabled.base + "/api/v1/evidence")[1]) == {"enabled": False, "bundles": []}


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.53", "::ffff:127.0.0.1"])
def test_loopback_hosts(host: str) -> None:
    assert is_loopback(host)
    check_debug_exposure(host, None)


# ---------------------------------------------------------------- spool permissions


def test_recorder_modes_pass_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(spool.GROUP_ENV, raising=False)
    private = tmp_path / "private"
    spool.ensure_dir(str(private))
    spool.write_json_atomic(str(private / "j.r0.snapshot.json"), {"a": 1})
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert stat.S_IMODE((private / "j.r0.snapshot.json").stat().st_mode) == 0o600
    assert spool.socket_mode() == 0o600
    assert spool.check_permissions(str(private)) == []

    monkeypatch.setenv(spool.GROUP_ENV, "1")
    shared = tmp_path / "shared"
    spool.ensure_dir(str(shared))
    spool.write_json_atomic(str(shared / "j.r0.manifest.json"), {"a": 1})
    assert stat.S_IMODE(shared.stat().st_mode) == 0o2770
    assert stat.S_IMODE((shared / "j.r0.manifest.json").stat().st_mode) == 0o640
    assert spool.socket_mode() == 0o660
    assert spool.check_permissions(str(shared)) == []
    # The private directory switches to group mode when its owner's recorder does.
    spool.ensure_dir(str(private))
    assert stat.S_IMODE(private.stat().st_mode) == 0o2770


def test_missing_directory_is_not_a_problem(tmp_path: Path) -> None:
    assert spool.check_permissions(str(tmp_path / "absent")) == []
    (tmp_path / "file").write_text("x")
    (problem,) = spool.check_permissions(str(tmp_path / "file"))
    assert problem.problem == "is not a directory"


def test_world_writable_spool_is_named_with_its_fix(tmp_path: Path) -> None:
    d = tmp_path / "spool"
    d.mkdir()
    os.chmod(d, 0o777)
    (problem,) = spool.check_permissions(str(d), group=False)
    assert problem.path == str(d) and "world-writable (mode 777)" in problem.problem
    assert problem.fix == f"chmod 700 {d}"
    assert str(problem).startswith(f"{d}: world-writable") and str(problem).endswith(f"fix: chmod 700 {d}")
    (problem,) = spool.check_permissions(str(d), group=True)
    assert problem.fix == f"chmod 2770 {d}"


def test_group_writable_spool_needs_group_mode(tmp_path: Path) -> None:
    d = tmp_path / "spool"
    d.mkdir()
    os.chmod(d, 0o2770)
    (problem,) = spool.check_permissions(str(d), group=False)
    assert "group-writable" in problem.problem and spool.GROUP_ENV in problem.fix
    assert spool.check_permissions(str(d), group=True) == []
    (problem,) = spool.check_permissions(str(d), group=True, gids={d.stat().st_gid + 1})
    assert f"belongs to group {d.stat().st_gid}, which this process is not in" in problem.problem


def test_spool_owned_by_someone_else(tmp_path: Path) -> None:
    d = tmp_path / "spool"
    d.mkdir(mode=0o700)
    if os.getuid() == 0:
        os.chown(d, 4242, -1)
        uid = 0
    else:
        uid = os.getuid() + 1  # as if the exporter ran as another user
    (problem,) = spool.check_permissions(str(d), group=False, uid=uid)
    assert f"owned by uid {d.stat().st_uid}, not by this user (uid {uid}) or root" in problem.problem
    os.chown(d, 0, -1) if os.getuid() == 0 else None
    if d.stat().st_uid == 0:
        assert spool.check_permissions(str(d), group=False, uid=uid) == []  # root provisioned it: fine


def test_files_and_sockets_open_to_everyone(tmp_path: Path) -> None:
    d = tmp_path / "s"
    d.mkdir(mode=0o700)
    spoolgen.write_rank(d, "job", 0)
    spoolgen.write_rank(d, "job", 1)
    assert spool.check_permissions(str(d), group=False) == []
    os.chmod(d / "job.r1.manifest.json", 0o644)
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(d / "sabc.sock"))
        os.chmod(d / "sabc.sock", 0o666)
        (problem,) = spool.check_permissions(str(d), group=False)
    assert problem.path == f"{d / 'job.r1.manifest.json'} and 1 more"
    assert problem.fix == f"chmod o-rwx {d}/*; the recorder creates them 600"
    (d / "other.txt").write_text("not a spool file")
    os.chmod(d / "other.txt", 0o644)
    assert len(spool.check_permissions(str(d), group=False)) == 1


def test_spool_permissions_warned_or_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks source's policy: a group-writable spool in private mode is warned about and counted, refused
    under --strict-permissions, and what group mode asks for."""
    from frexporter.sources.base import Reading, SourceError
    from frexporter.sources.ranks import RanksConfig, RanksSource

    def collect(strict: bool) -> Reading:
        source = RanksSource(RanksConfig(directory=str(d), strict_permissions=strict))
        try:
            return source.collect()
        finally:
            source.close()

    d = tmp_path / "spool"
    d.mkdir()
    os.chmod(d, 0o2770)
    monkeypatch.delenv(spool.GROUP_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="frexporter"):
        assert [reason for reason, _ in collect(strict=False).problems] == ["unsafe_permissions"]
    assert f"unsafe spool permissions: {d}: group-writable" in caplog.text
    with pytest.raises(SourceError) as refused:
        collect(strict=True)
    assert refused.value.reason == "unsafe_permissions" and f"{d}: group-writable" in str(refused.value)
    monkeypatch.setenv(spool.GROUP_ENV, "1")  # the same directory is what group mode asks for
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="frexporter"):
        assert collect(strict=True).problems == ()
    assert caplog.text == ""


def test_rank_files_open_to_everyone_are_warned_once_or_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                                ) -> None:
    """Rank files any local user may read (the ranks' privacy): warned on the spool's first read, not counted;
    under --strict-permissions the spool is not read."""
    from frexporter.sources.base import SourceError
    from frexporter.sources.ranks import RanksConfig, RanksSource

    d = tmp_path / "spool"
    d.mkdir(mode=0o700)
    os.chmod(d, 0o700)
    stem = spoolgen.write_rank(d, "job", 0)
    os.chmod(d / (stem + spool.MANIFEST_SUFFIX), 0o644)
    source = RanksSource(RanksConfig(directory=str(d)))
    try:
        with caplog.at_level(logging.WARNING, logger="frexporter"):
            for _ in range(3):
                reading = source.collect()
                assert reading.problems == () and [r.rank for r in reading.ranks or ()] == [0]
    finally:
        source.close()
    assert caplog.text.count("open to every local user") == 1
    strict = RanksSource(RanksConfig(directory=str(d), strict_permissions=True))
    try:
        with pytest.raises(SourceError, match="open to every local user"):
            strict.collect()
        os.chmod(d / (stem + spool.MANIFEST_SUFFIX), 0o600)
        assert [r.rank for r in strict.collect().ranks or ()] == [0]
    finally:
        strict.close()


def test_root_warning() -> None:
    assert cli.root_warning(1000) is None
    warning = cli.root_warning(0)
    assert warning is not None and "running as root" in warning and "65532" in warning


def test_atomic_write_never_follows_a_planted_link(tmp_path: Path) -> None:
    """The temporary name is predictable; a link planted there must neither be written through nor survive."""
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    target = tmp_path / "r.snapshot.json"
    tmp = tmp_path / f".tmp-{target.name}.{os.getpid()}"
    tmp.symlink_to(victim)
    spool.write_json_atomic(str(target), {"format": "x"})
    assert victim.read_text() == "untouched"
    assert json.loads(target.read_text()) == {"format": "x"}
    assert stat.S_IMODE(target.stat().st_mode) == spool.FILE_MODE
    assert not tmp.exists() and not tmp.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.snapshot.json", "victim"]
