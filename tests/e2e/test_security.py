"""Security: TLS and basic auth from an exporter-toolkit web config, debug endpoints off by default,
spool permission checks, and the group-shared spool mode.

Certificates are made per session with the openssl CLI (a CA, a server certificate for 127.0.0.1,
client certificates, and a second CA nobody trusts); every TLS test does a real handshake.

Its unit tests are in tests/unit/test_security.py.
"""

from __future__ import annotations

import json
import os
import ssl
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from frexporter import naming as n
from frexporter import spool
from frexporter.app import ServeConfig, build_app
from frexporter.web import webconfig
from frexporter.web.webconfig import WebConfig, WebConfigError, check_debug_exposure, is_loopback
from tests.harness import free_port, metrics, require_module, require_tool, sample, wait_for
from tests.shared.security import ENV, HASH, PASSWORD, basic, frexporter, get, refused, write_config

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


# ---------------------------------------------------------------- TLS


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


def test_tls_min_version_is_enforced(pki: PKI, spool_dir: Path, exporter_factory: Any) -> None:
    config = webconfig.load_web_config(str(write_config(pki.dir, tls_config(pki, "  min_version: TLS13\n"))))
    exp = exporter_factory(spool_dir, web_config=config)
    old = client_context(pki)
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    refused(f"https://127.0.0.1:{exp.app.port}/metrics", old)
    assert get(f"https://127.0.0.1:{exp.app.port}/healthz", client_context(pki))[0] == 200


def test_client_certificate_required(pki: PKI, spool_dir: Path, exporter_factory: Any) -> None:
    text = tls_config(pki, f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca}\n")
    exp = exporter_factory(spool_dir, web_config=webconfig.load_web_config(str(write_config(pki.dir, text))))
    url = f"https://127.0.0.1:{exp.app.port}/metrics"
    refused(url, client_context(pki))  # no client certificate
    refused(url, client_context(pki, (pki.rogue_crt, pki.rogue_key)))  # from a CA the exporter does not trust
    code, body, _ = get(url, client_context(pki, (pki.client_crt, pki.client_key)))
    assert code == 200 and "frexporter_build_info" in body


def test_client_allowed_sans(pki: PKI, spool_dir: Path, exporter_factory: Any) -> None:
    text = tls_config(pki, f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca}\n"
                           "  client_allowed_sans: [scraper]\n")
    exp = exporter_factory(spool_dir, web_config=webconfig.load_web_config(str(write_config(pki.dir, text))))
    url = f"https://127.0.0.1:{exp.app.port}/metrics"
    refused(url, client_context(pki, (pki.other_client_crt, pki.other_client_key)))  # valid, but not "scraper"
    assert get(url, client_context(pki, (pki.client_crt, pki.client_key)))[0] == 200


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


# ---------------------------------------------------------------- config errors


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


def test_config_as_json_without_yaml(pki: PKI, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # the daemon installed without the auth extra
    path = pki.dir / "web.json"
    path.write_text(json.dumps({"tls_server_config": {"cert_file": "server.crt", "key_file": "server.key"}}))
    assert webconfig.load_web_config(str(path)).tls is not None
    path.write_text(tls_config(pki))
    with pytest.raises(WebConfigError, match=r"PyYAML is not installed.*pip install 'frexporter\[auth\]'"):
        webconfig.load_web_config(str(path))


def test_cli_refuses_a_malformed_config(pki: PKI, spool_dir: Path) -> None:
    path = write_config(spool_dir.parent, "basic_auth_users:\n  alice: plaintext\n")
    out = frexporter("serve", "--dir", str(spool_dir), "--listen", "127.0.0.1:0", "--no-nvml", "--web-config",
                     str(path))
    assert out.returncode == 2, out.stderr
    assert f"frexporter: --web-config: web config {path}: basic_auth_users.alice: not a bcrypt hash" in out.stderr
    out = frexporter("serve", "--dir", str(spool_dir), "--listen", "127.0.0.1:0", "--no-nvml", "--web-config",
                     str(spool_dir.parent / "absent.yml"))
    assert out.returncode == 2 and "No such file or directory" in out.stderr


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


def test_cli_refuses_exposed_debug_endpoints(spool_dir: Path) -> None:
    out = frexporter("serve", "--dir", str(spool_dir), "--listen", ":0", "--no-nvml", "--enable-debug-endpoints")
    assert out.returncode == 2, out.stderr
    assert "--enable-debug-endpoints on 0.0.0.0, a non-loopback address, needs TLS and authentication" in out.stderr


def test_serve_strict_permissions_refuses(tmp_path: Path) -> None:
    d = tmp_path / "spool"
    d.mkdir()
    os.chmod(d, 0o777)
    out = frexporter("serve", "--dir", str(d), "--listen", "127.0.0.1:0", "--no-nvml", "--strict-permissions")
    assert out.returncode == 2
    assert f"frexporter: unsafe spool permissions: {d}: world-writable" in out.stderr
    assert f"fix: chmod 700 {d}" in out.stderr


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
