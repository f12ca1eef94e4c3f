"""Security: TLS and basic auth from an exporter-toolkit web config, debug endpoints off by default,
spool permission checks, and the group-shared spool mode.

Certificates are made per session with the openssl CLI (a CA, a server certificate for 127.0.0.1,
client certificates, and a second CA nobody trusts); every TLS test does a real handshake.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import ssl
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from frexporter import cli, spool
from frexporter import naming as n
from frexporter.app import ServeConfig, build_app
from frexporter.web import webconfig
from frexporter.web.webconfig import BasicAuth, WebConfig, WebConfigError, check_debug_exposure, is_loopback
from tests import spoolgen
from tests.harness import REPO, free_port, metrics, require_module, require_tool, sample, wait_for

bcrypt = require_module("bcrypt", "bcrypt (the auth extra)")

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
PASSWORD = "correct horse"
# htpasswd writes $2y$; the Python bcrypt package writes $2b$. Both must work, as in exporter-toolkit.
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode().replace("$2b$", "$2y$", 1)


# ---------------------------------------------------------------- certificates


@dataclass(frozen=True)
class PKI:
    dir: Path
    ca: Path
    server_crt: Path
    server_key: Path
    client_crt: Path  # SAN DNS:scraper
    client_key: Path
    other_client_crt: Path  # SAN DNS:intruder, same CA
    other_client_key: Path
    rogue_crt: Path  # signed by a CA the exporter does not trust
    rogue_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    out = subprocess.run([require_tool("openssl"), *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def _make_ca(d: Path, name: str) -> tuple[Path, Path]:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=d)
    return d / f"{name}.crt", d / f"{name}.key"


def _make_leaf(d: Path, name: str, ca: str, usage: str, san: str) -> tuple[Path, Path]:
    (d / f"{name}.ext").write_text(
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        f"extendedKeyUsage={usage}\nsubjectAltName={san}\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-out", f"{name}.crt", "-extfile", f"{name}.ext", cwd=d)
    return d / f"{name}.crt", d / f"{name}.key"


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    d = tmp_path_factory.mktemp("pki")
    ca, _ = _make_ca(d, "ca")
    _make_ca(d, "rogue-ca")
    server = _make_leaf(d, "server", "ca", "serverAuth", "IP:127.0.0.1,DNS:localhost")
    client = _make_leaf(d, "client", "ca", "clientAuth", "DNS:scraper")
    other = _make_leaf(d, "intruder", "ca", "clientAuth", "DNS:intruder")
    rogue = _make_leaf(d, "rogue", "rogue-ca", "clientAuth", "DNS:scraper")
    return PKI(d, ca, *server, *client, *other, *rogue)


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "web.yml"
    path.write_text(text)
    return path


def tls_config(pki: PKI, extra: str = "") -> str:
    # Relative file names: exporter-toolkit resolves them against the config file's directory.
    return (f"tls_server_config:\n  cert_file: {pki.server_crt.name}\n  key_file: {pki.server_key.name}\n"
            + extra)


def client_context(pki: PKI, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    """What Prometheus does with tls_config: {ca_file, cert_file, key_file}."""
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert[0]), str(cert[1]))
    return ctx


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def get(url: str, ctx: ssl.SSLContext | None = None, auth: str | None = None) -> tuple[int, str, Any]:
    request = urllib.request.Request(url, headers={"Authorization": auth} if auth else {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=ctx) as resp:
            return resp.status, resp.read().decode(), resp.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers


def refused(url: str, ctx: ssl.SSLContext | None = None) -> OSError:
    """The connection fails below HTTP: no status code at all."""
    try:
        with urllib.request.urlopen(url, timeout=10, context=ctx) as resp:
            pytest.fail(f"{url} answered {resp.status}")
    except urllib.error.HTTPError as e:
        pytest.fail(f"{url} answered HTTP {e.code}; the handshake should have failed")
    except OSError as e:  # URLError, ssl.SSLError, a reset or a closed connection
        return e
    raise AssertionError("unreachable")


@pytest.fixture
def spool_dir(tmp_path: Path) -> Path:
    d = tmp_path / "spool"
    spoolgen.write_rank(d, "job", 0, pgs=2)
    os.chmod(d, spool.DIR_MODE)
    return d


# ---------------------------------------------------------------- TLS


@pytest.mark.e2e
def test_prometheus_style_scrape_over_tls(pki: PKI, spool_dir: Path, exporter_factory: Any) -> None:
    config = webconfig.load_web_config(str(write_config(pki.dir, tls_config(pki))))
    exp = exporter_factory(spool_dir, web_config=config)
    base = f"https://127.0.0.1:{exp.app.port}"
    code, text, _ = get(base + "/metrics", client_context(pki))
    assert code == 200
    assert sample(metrics(text), "frexporter_pg_last_completed_seq", rank="0", pg_desc="pg1") == 10
    for path in ("/healthz", "/api/v1/status", "/"):
        assert get(base + path, client_context(pki))[0] == 200, path
    # A keep-alive connection serves several scrapes over one handshake, as Prometheus does.
    import http.client

    conn = http.client.HTTPSConnection("127.0.0.1", exp.app.port, context=client_context(pki), timeout=10)
    try:
        for _ in range(3):
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            assert resp.status == 200 and b"frexporter_build_info" in resp.read()
    finally:
        conn.close()
    # A client that does not trust the CA refuses the server; plain HTTP gets no answer.
    error = refused(base + "/metrics", ssl.create_default_context())
    assert isinstance(getattr(error, "reason", error), ssl.SSLCertVerificationError)
    refused(f"http://127.0.0.1:{exp.app.port}/metrics")
    # Still serving after the failed handshakes.
    assert get(base + "/healthz", client_context(pki))[0] == 200


@pytest.mark.e2e
def test_tls_min_version_is_enforced(pki: PKI, spool_dir: Path, exporter_factory: Any) -> None:
    config = webconfig.load_web_config(str(write_config(pki.dir, tls_config(pki, "  min_version: TLS13\n"))))
    exp = exporter_factory(spool_dir, web_config=config)
    old = client_context(pki)
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    refused(f"https://127.0.0.1:{exp.app.port}/metrics", old)
    assert get(f"https://127.0.0.1:{exp.app.port}/healthz", client_context(pki))[0] == 200


@pytest.mark.e2e
def test_client_certificate_required(pki: PKI, spool_dir: Path, exporter_factory: Any) -> None:
    text = tls_config(pki, f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca}\n")
    exp = exporter_factory(spool_dir, web_config=webconfig.load_web_config(str(write_config(pki.dir, text))))
    url = f"https://127.0.0.1:{exp.app.port}/metrics"
    refused(url, client_context(pki))  # no client certificate
    refused(url, client_context(pki, (pki.rogue_crt, pki.rogue_key)))  # from a CA the exporter does not trust
    code, body, _ = get(url, client_context(pki, (pki.client_crt, pki.client_key)))
    assert code == 200 and "frexporter_build_info" in body


@pytest.mark.e2e
def test_client_allowed_sans(pki: PKI, spool_dir: Path, exporter_factory: Any) -> None:
    text = tls_config(pki, f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca}\n"
                           "  client_allowed_sans: [scraper]\n")
    exp = exporter_factory(spool_dir, web_config=webconfig.load_web_config(str(write_config(pki.dir, text))))
    url = f"https://127.0.0.1:{exp.app.port}/metrics"
    refused(url, client_context(pki, (pki.other_client_crt, pki.other_client_key)))  # valid, but not "scraper"
    assert get(url, client_context(pki, (pki.client_crt, pki.client_key)))[0] == 200


@pytest.mark.e2e
def test_rotated_certificate_is_picked_up(pki: PKI, tmp_path: Path, spool_dir: Path, exporter_factory: Any) -> None:
    crt, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    crt.write_bytes(pki.client_crt.read_bytes())  # a certificate without the server's SAN
    key.write_bytes(pki.client_key.read_bytes())
    config = webconfig.load_web_config(str(write_config(tmp_path, "tls_server_config:\n  cert_file: tls.crt\n"
                                                                  "  key_file: tls.key\n")))
    exp = exporter_factory(spool_dir, web_config=config)
    url = f"https://127.0.0.1:{exp.app.port}/healthz"
    refused(url, client_context(pki))  # hostname mismatch
    # What cert-manager does: the secret's files are replaced; the next handshake uses the new pair.
    crt.write_bytes(pki.server_crt.read_bytes())
    key.write_bytes(pki.server_key.read_bytes())
    os.utime(crt, ns=(time.time_ns(), time.time_ns() + 10**9))  # a coarse-mtime file system must still see it
    assert get(url, client_context(pki))[0] == 200


# ---------------------------------------------------------------- basic auth


@pytest.mark.e2e
def test_basic_auth_protects_every_endpoint(pki: PKI, spool_dir: Path, exporter_factory: Any) -> None:
    text = tls_config(pki, f"basic_auth_users:\n  prometheus: '{HASH}'\n"
                           "http_server_config:\n  headers:\n    X-Content-Type-Options: nosniff\n")
    exp = exporter_factory(spool_dir, web_config=webconfig.load_web_config(str(write_config(pki.dir, text))))
    base, ctx = f"https://127.0.0.1:{exp.app.port}", client_context(pki)
    for path in ("/metrics", "/healthz", "/api/v1/status", "/", "/nope", "/api/v1/evidence"):
        code, _, headers = get(base + path, ctx)
        assert code == 401, path
        assert headers["WWW-Authenticate"].startswith("Basic")
    assert get(base + "/metrics", ctx, basic("prometheus", "wrong"))[0] == 401
    assert get(base + "/metrics", ctx, basic("nobody", PASSWORD))[0] == 401
    assert get(base + "/metrics", ctx, "Bearer " + PASSWORD)[0] == 401
    assert get(base + "/metrics", ctx, "Basic !!!not-base64")[0] == 401
    code, body, headers = get(base + "/metrics", ctx, basic("prometheus", PASSWORD))
    assert code == 200 and "frexporter_build_info" in body
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert get(base + "/nope", ctx, basic("prometheus", PASSWORD))[0] == 404


@pytest.mark.e2e
def test_repeated_scrapes_cost_one_bcrypt(pki: PKI, spool_dir: Path, exporter_factory: Any) -> None:
    config = WebConfig(path="test", basic_auth_users={"prometheus": HASH})
    exp = exporter_factory(spool_dir, web_config=config)
    auth = exp.app.server.httpd.auth
    assert auth is not None and exp.app.server.scheme == "http"
    base = f"http://127.0.0.1:{exp.app.port}"
    for _ in range(5):
        assert get(base + "/metrics", auth=basic("prometheus", PASSWORD))[0] == 200
    assert auth.bcrypt_calls == 1
    for _ in range(3):
        assert get(base + "/metrics", auth=basic("prometheus", "guess"))[0] == 401
    assert auth.bcrypt_calls == 2  # failures are cached too, apart from successes
    assert get(base + "/metrics", auth=basic("prometheus", PASSWORD))[0] == 200
    assert auth.bcrypt_calls == 2


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


# ---------------------------------------------------------------- config errors


@pytest.mark.e2e
@pytest.mark.parametrize(("text", "message"), [
    ("tls_server_config: [\n", "not valid YAML"),
    ("- a\n- b\n", "the top level must be a mapping, got list"),
    ("tls_server_confg:\n  cert_file: x\n", "unknown key 'tls_server_confg' (known in the top level: "
                                            "tls_server_config, basic_auth_users, http_server_config, rate_limit)"),
    ("tls_server_config:\n  cert_file: server.crt\n", "tls_server_config.key_file is required"),
    ("tls_server_config:\n  key_file: server.key\n", "tls_server_config.cert_file is required"),
    ("tls_server_config:\n  cert_file: missing.crt\n  key_file: server.key\n",
     "tls_server_config.cert_file: {dir}/missing.crt does not exist or is not a file"),
    ("tls_server_config:\n  cert_file: server.crt\n  key_file: client.key\n",
     "tls_server_config: cannot load cert_file {dir}/server.crt with key_file {dir}/client.key"),
    ("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  client_auth_type: Sometimes\n",
     "client_auth_type 'Sometimes' is not one of NoClientCert, VerifyClientCertIfGiven, RequireAndVerifyClientCert"),
    ("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  client_auth_type: RequireAnyClientCert\n",
     "RequireAnyClientCert is not supported (it accepts unverified certificates)"),
    ("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  client_ca_file: ca.crt\n",
     "client_ca_file is set but client_auth_type is NoClientCert"),
    ("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
     "  client_auth_type: RequireAndVerifyClientCert\n", "needs client_ca_file"),
    ("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  client_allowed_sans: [a]\n",
     "client_allowed_sans needs client_auth_type RequireAndVerifyClientCert"),
    ("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  min_version: TLS14\n",
     "min_version 'TLS14' is not one of TLS10, TLS11, TLS12, TLS13"),
    ("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  min_version: TLS13\n"
     "  max_version: TLS12\n", "min_version TLS13 is above max_version TLS12"),
    ("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  cipher_suites: [TLS_AES_128_GCM_SHA256]\n",
     "cipher_suites is not supported"),
    ("basic_auth_users:\n  alice: hunter2\n", "basic_auth_users.alice: not a bcrypt hash"),
    ("basic_auth_users: [alice]\n", "basic_auth_users must be a mapping of user name to bcrypt hash, got list"),
    ("basic_auth_users:\n  'a:b': '" + HASH + "'\n", "user name 'a:b' must be a non-empty string without ':'"),
    ("http_server_config:\n  headers:\n    Set-Cookie: x\n", "'Set-Cookie' cannot be set"),
])
def test_malformed_config_is_refused_with_a_clear_message(pki: PKI, text: str, message: str) -> None:
    path = write_config(pki.dir, text)
    with pytest.raises(WebConfigError) as err:
        webconfig.load_web_config(str(path))
    assert str(err.value).startswith(f"web config {path}: "), err.value
    assert message.format(dir=pki.dir) in str(err.value)


def test_empty_config_means_plain_http(tmp_path: Path) -> None:
    config = webconfig.load_web_config(str(write_config(tmp_path, "")))
    assert config.tls is None and not config.basic_auth_users and not config.authenticates


@pytest.mark.e2e
def test_config_as_json_without_yaml(pki: PKI, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # the daemon installed without the auth extra
    path = pki.dir / "web.json"
    path.write_text(json.dumps({"tls_server_config": {"cert_file": "server.crt", "key_file": "server.key"}}))
    assert webconfig.load_web_config(str(path)).tls is not None
    path.write_text(tls_config(pki))
    with pytest.raises(WebConfigError, match=r"PyYAML is not installed.*pip install 'frexporter\[auth\]'"):
        webconfig.load_web_config(str(path))


def frexporter(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "frexporter", *args], capture_output=True, text=True, timeout=60,
                          env=ENV)


@pytest.mark.e2e
def test_cli_refuses_a_malformed_config(pki: PKI, spool_dir: Path) -> None:
    path = write_config(spool_dir.parent, "basic_auth_users:\n  alice: plaintext\n")
    out = frexporter("serve", "--dir", str(spool_dir), "--listen", "127.0.0.1:0", "--no-nvml", "--web-config",
                     str(path))
    assert out.returncode == 2, out.stderr
    assert f"frexporter: --web-config: web config {path}: basic_auth_users.alice: not a bcrypt hash" in out.stderr
    out = frexporter("serve", "--dir", str(spool_dir), "--listen", "127.0.0.1:0", "--no-nvml", "--web-config",
                     str(spool_dir.parent / "absent.yml"))
    assert out.returncode == 2 and "No such file or directory" in out.stderr


@pytest.mark.e2e
def test_cli_serves_tls_and_basic_auth(pki: PKI, spool_dir: Path) -> None:
    path = write_config(pki.dir, tls_config(pki, f"basic_auth_users:\n  prometheus: '{HASH}'\n"))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "frexporter", "serve", "--dir", str(spool_dir), "--listen",
                             f"127.0.0.1:{port}", "--poll-interval", "0.2", "--no-nvml", "--web-config", str(path)],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url, ctx = f"https://127.0.0.1:{port}/healthz", client_context(pki)

    def healthy() -> bool:
        if proc.poll() is not None:
            pytest.fail(proc.stderr.read() if proc.stderr else "exited")
        try:
            return get(url, ctx, basic("prometheus", PASSWORD))[0] == 200
        except OSError:
            return False  # not listening yet

    try:
        wait_for(healthy, timeout=20, what="https healthz")
        assert get(url, ctx)[0] == 401
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0


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


@pytest.mark.e2e
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.1.2.3", "fe80::1", "node-a.example.com"])
def test_debug_endpoints_refused_when_exposed_without_tls_and_auth(pki: PKI, host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(WebConfigError, match="needs TLS and authentication"):
        check_debug_exposure(host, None)
    tls_only = webconfig.load_web_config(str(write_config(pki.dir, tls_config(pki))))
    with pytest.raises(WebConfigError, match="needs authentication"):
        check_debug_exposure(host, tls_only)
    with pytest.raises(WebConfigError, match="needs TLS and authentication"):
        check_debug_exposure(host, WebConfig(path="x", basic_auth_users={"a": HASH}))  # passwords in clear text
    mtls = webconfig.load_web_config(str(write_config(pki.dir, tls_config(
        pki, f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca}\n"))))
    check_debug_exposure(host, mtls)
    both = webconfig.load_web_config(str(write_config(pki.dir, tls_config(
        pki, f"basic_auth_users:\n  prometheus: '{HASH}'\n"))))
    check_debug_exposure(host, both)


@pytest.mark.e2e
def test_debug_endpoints_on_all_addresses_with_tls_and_auth(pki: PKI, spool_dir: Path) -> None:
    with pytest.raises(WebConfigError):
        build_app(ServeConfig(directory=str(spool_dir), host="0.0.0.0", port=0, sources=(n.SOURCE_RANKS,),
                              debug_endpoints=True))
    config = webconfig.load_web_config(str(write_config(pki.dir, tls_config(
        pki, f"basic_auth_users:\n  prometheus: '{HASH}'\n"))))
    app = build_app(ServeConfig(directory=str(spool_dir), host="0.0.0.0", port=0, sources=(n.SOURCE_RANKS,),
                                poll_interval=0.2, web_config=config, debug_endpoints=True))
    app.start()
    try:
        url = f"https://127.0.0.1:{app.port}/api/v1/evidence"
        assert get(url, client_context(pki))[0] == 401
        code, body, _ = get(url, client_context(pki), basic("prometheus", PASSWORD))
        assert code == 200 and json.loads(body)["bundles"] == []
    finally:
        app.stop()


@pytest.mark.e2e
def test_cli_refuses_exposed_debug_endpoints(spool_dir: Path) -> None:
    out = frexporter("serve", "--dir", str(spool_dir), "--listen", ":0", "--no-nvml", "--enable-debug-endpoints")
    assert out.returncode == 2, out.stderr
    assert "--enable-debug-endpoints on 0.0.0.0, a non-loopback address, needs TLS and authentication" in out.stderr


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


@pytest.mark.e2e
def test_serve_strict_permissions_refuses(tmp_path: Path) -> None:
    d = tmp_path / "spool"
    d.mkdir()
    os.chmod(d, 0o777)
    out = frexporter("serve", "--dir", str(d), "--listen", "127.0.0.1:0", "--no-nvml", "--strict-permissions")
    assert out.returncode == 2
    assert f"frexporter: unsafe spool permissions: {d}: world-writable" in out.stderr
    assert f"fix: chmod 700 {d}" in out.stderr


@pytest.mark.e2e
def test_serve_refuses_a_spool_that_turns_up_unsafe(tmp_path: Path) -> None:
    """A sidecar starts before its trainer makes the spool: the ranks source's first read of it decides."""
    d = tmp_path / "spool"
    proc = subprocess.Popen([sys.executable, "-m", "frexporter", "serve", "--dir", str(d), "--listen", "127.0.0.1:0",
                             "--no-nvml", "--strict-permissions", "--poll-interval", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        assert proc.stderr is not None
        # No spool yet: it says it waits for one, and does not refuse (other warnings may come first).
        waiting = ""
        deadline = time.monotonic() + 30
        while "does not exist yet; waiting" not in waiting and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            waiting += line
        assert "does not exist yet; waiting" in waiting and proc.poll() is None, waiting
        d.mkdir()
        os.chmod(d, 0o777)
        _, rest = proc.communicate(timeout=30)
        err = waiting + rest
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 2, err
    assert f"frexporter: unsafe spool permissions: {d}: world-writable" in err and f"fix: chmod 700 {d}" in err


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


@pytest.mark.e2e
def test_group_mode_with_real_ranks(job_factory: Any, exporter_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    require_module("torch")
    job = job_factory("counts", 2, env={spool.GROUP_ENV: "1"})
    job.wait_ready()
    wait_for(lambda: len(list(job.spool.glob("*.sock"))) == 2 and len(list(job.spool.glob("*.manifest.json"))) == 2,
             timeout=30, what="both ranks' sockets and manifests")
    assert stat.S_IMODE(job.spool.stat().st_mode) == 0o2770
    for path in job.spool.iterdir():
        if path.name.endswith(".sock"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o660, path
        elif path.name.endswith(".json"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o640, path
    monkeypatch.setenv(spool.GROUP_ENV, "1")
    assert spool.check_permissions(str(job.spool)) == []
    exp = exporter_factory(job.spool)
    wait_for(lambda: len(exp.snapshot.ranks) == 2 and all(r.socket_alive for r in exp.snapshot.ranks),
             timeout=30, what="both ranks read, sockets answering")


@pytest.mark.e2e
def test_stop_closes_kept_alive_tls_connections(pki: PKI, spool_dir: Path) -> None:
    import http.client

    config = webconfig.load_web_config(str(write_config(pki.dir, tls_config(pki))))
    app = build_app(ServeConfig(directory=str(spool_dir), host="127.0.0.1", port=0, sources=(n.SOURCE_RANKS,),
                                poll_interval=0.2, web_config=config))
    app.start()
    conn = http.client.HTTPSConnection("127.0.0.1", app.port, context=client_context(pki), timeout=10)
    try:
        conn.request("GET", "/healthz")
        assert conn.getresponse().read() == b"ok\n"
        app.stop()
        # The stopped exporter must not go on answering over a connection Prometheus keeps open.
        with pytest.raises((OSError, http.client.HTTPException)):
            conn.request("GET", "/metrics")
            conn.getresponse().read()
    finally:
        conn.close()


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
