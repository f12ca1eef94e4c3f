"""The HTTP server under hostile or unusual clients, and the /metrics conventions Prometheus clients expect.

Against a real ``frexporter serve`` on 127.0.0.1: half-sent requests (including a client that sends one byte at
a time) are closed within 30 s while scrapes stay fast, connections over ``--web-max-connections`` are refused
and counted, an HTTP/0.9 request line is answered at once, the listen backlog takes a burst of connections,
and TLS handshakes that never finish are cut off. Then gzip, HEAD and ``name[]`` on /metrics, and a real
Prometheus scraping with gzip, served text 0.0.4 although it asks for OpenMetrics first.

Its unit tests are in tests/unit/test_http_hardening.py.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import select
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from frexporter import naming as n
from frexporter.outputs import exposition
from frexporter.web import server
from tests import spoolgen
from tests.harness import REPO, free_port, metrics, require_tool, sample, wait_for
from tests.promstack import PromStack

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
# The acceptance bound for a half-sent request, and for a scrape meanwhile.
HALF_SENT_CLOSED_WITHIN = 30.0
SCRAPE_WITHIN = 1.0
HALF_SENT = 50
PARTIAL_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"


@dataclass
class Serve:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    scheme: str = "http"

    @property
    def base(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"


@contextlib.contextmanager
def serve(tmp_path: Path, *args: str, port: int | None = None, ctx: ssl.SSLContext | None = None) -> Iterator[Serve]:
    spool_dir = tmp_path / "spool"
    for rank in range(2):
        spoolgen.write_rank(spool_dir, "job", rank, pgs=2)
    port = port or free_port()
    log = tmp_path / f"serve-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "frexporter", "--log-level", "debug", "serve", "--dir",
                                 str(spool_dir), "--listen", f"127.0.0.1:{port}", "--poll-interval", "0.2",
                                 "--no-nvml", *args], env=ENV, stdout=out, stderr=subprocess.STDOUT)
    running = Serve(proc, port, log, "https" if ctx is not None else "http")

    def healthy() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"frexporter serve exited {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        try:
            with urllib.request.urlopen(running.base + "/healthz", timeout=5, context=ctx) as resp:
                return resp.status == 200
        except OSError:
            return False

    try:
        wait_for(healthy, timeout=30, what="frexporter serve healthy")
        yield running
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)  # in case a test stopped it
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed ``sock`` (EOF or reset); False while it is open. Never blocks."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    sock.settimeout(0)
    try:
        data = sock.recv(4096)
    except ssl.SSLWantReadError:
        return False  # TLS 1.3 session tickets: records, but no data yet
    except (ConnectionResetError, BrokenPipeError):
        return True
    assert not data, f"the server answered a request it never got the end of: {data[:200]!r}"
    return True


def timed_scrape(url: str, ctx: ssl.SSLContext | None = None) -> tuple[float, bytes]:
    started = time.monotonic()
    with urllib.request.urlopen(url, timeout=10, context=ctx) as resp:
        body = resp.read()
    return time.monotonic() - started, body


def rejected_total(base: str) -> float | None:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        return sample(metrics(resp.read().decode()), n.HTTP_CONNECTIONS_REJECTED_TOTAL)


# ---------------------------------------------------------------- Part A: connections


def test_half_sent_requests_are_closed_while_scrapes_stay_fast(tmp_path: Path) -> None:
    with serve(tmp_path) as srv:
        # What Prometheus does: one kept-alive connection, used again after a quiet spell longer than the
        # header timeout. It must survive the whole test.
        prometheus = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        prometheus.request("GET", "/metrics")
        assert prometheus.getresponse().read().startswith(b"# HELP")
        started = time.monotonic()
        silent = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(5)]
        dribbling = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(5)]
        partial = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(HALF_SENT - 10)]
        for sock in partial:
            sock.sendall(PARTIAL_REQUEST)
        held = silent + dribbling + partial
        open_since = dict.fromkeys(held, started)
        closed_after: dict[socket.socket, float] = {}
        scrapes: list[float] = []
        sent = 0
        try:
            while len(closed_after) < len(held) and time.monotonic() - started < HALF_SENT_CLOSED_WITHIN + 5:
                # A slowloris: a byte of a valid request every few hundred ms, so no single read times out.
                for sock in dribbling:
                    if sock not in closed_after:
                        with contextlib.suppress(OSError):
                            sock.sendall(PARTIAL_REQUEST[sent % len(PARTIAL_REQUEST):][:1])
                sent += 1
                elapsed, body = timed_scrape(srv.base + "/metrics")
                assert b"frexporter_rank_up" in body
                scrapes.append(elapsed)
                for sock in held:
                    if sock not in closed_after and closed_by_server(sock):
                        closed_after[sock] = time.monotonic() - open_since[sock]
                select.select([s for s in held if s not in closed_after], [], [], 0.25)
            prometheus.request("GET", "/metrics")
            response = prometheus.getresponse()
            assert response.status == 200 and b"frexporter_rank_up" in response.read()
        finally:
            prometheus.close()
            for sock in held:
                sock.close()
    assert len(closed_after) == HALF_SENT, f"{HALF_SENT - len(closed_after)} half-sent connections still open"
    assert max(closed_after.values()) < HALF_SENT_CLOSED_WITHIN, sorted(closed_after.values())
    assert len(scrapes) > 10 and max(scrapes) < SCRAPE_WITHIN, sorted(scrapes)[-5:]


def test_connections_over_the_cap_are_refused_and_counted(tmp_path: Path) -> None:
    cap = 4
    refusals = 0

    def scrape_or_refused(path: str) -> tuple[http.client.HTTPConnection, bytes] | None:
        """A kept-alive connection that has been served ``path`` and the body, or None when it was refused."""
        nonlocal refusals
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            body = resp.read()
        except ConnectionError:  # refused before our request arrived: the 503 may be lost to a reset
            refusals += 1
            conn.close()
            return None
        if resp.status == 503:
            assert body == b"too many connections\n" and resp.getheader("Connection") == "close"
            refusals += 1
            conn.close()
            return None
        assert resp.status == 200
        return conn, body

    with serve(tmp_path, "--web-max-connections", str(cap)) as srv:
        held: list[http.client.HTTPConnection] = []
        try:
            # Each held connection has been served, so the server counts it open (the health check's may
            # still be closing at first: a refusal then is counted like any other).
            while len(held) < cap:
                served = scrape_or_refused("/healthz")
                if served is not None:
                    held.append(served[0])
            for _ in range(3):
                with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
                    data = b""
                    while chunk := sock.recv(4096):  # refused at once: the answer and the close come unasked
                        data += chunk
                assert data.startswith(b"HTTP/1.1 503 ") and data.endswith(b"too many connections\n"), data
                refusals += 1
        finally:
            for conn in held:
                conn.close()
        # The held connections' threads see them close; then scrapes get in again, and the refusals show.
        conn, _ = wait_for(lambda: scrape_or_refused("/healthz"), timeout=10, what="a connection after the cap")
        conn.close()
        # Counted when refused, shown from the next scrape on (a scrape refused meanwhile counts as well).
        conn, body = wait_for(lambda: scrape_or_refused("/metrics"), timeout=10, what="a scrape")
        conn.close()
        assert sample(metrics(body.decode()), n.HTTP_CONNECTIONS_REJECTED_TOTAL) == refusals >= 3


def test_http09_request_line_is_answered_at_once(tmp_path: Path) -> None:
    with serve(tmp_path) as srv:
        for line in (b"GET /\r\n", b"GET /metrics\n"):
            with socket.create_connection(("127.0.0.1", srv.port)) as sock:
                # Well inside the header timeout, so that a server waiting for headers fails here.
                sock.settimeout(server.HEADER_TIMEOUT / 2)
                sock.sendall(line)
                data = b""
                while chunk := sock.recv(4096):
                    data += chunk
            assert data.startswith(b"HTTP/1.1 400 "), data[:200]
        assert timed_scrape(srv.base + "/metrics")[0] < SCRAPE_WITHIN


def test_listen_backlog_takes_a_burst(tmp_path: Path) -> None:
    """With the server stopped, the kernel completes handshakes only while the accept queue has room:
    the backlog, not the server, decides how many of a burst get in (socketserver's default was 5)."""
    burst = server.LISTEN_BACKLOG + 1  # the accept queue holds backlog + 1 on Linux
    with serve(tmp_path, "--web-max-connections", str(2 * burst)) as srv:
        socks = []
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            for _ in range(burst):
                sock = socket.socket()
                sock.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    sock.connect(("127.0.0.1", srv.port))
                socks.append(sock)

            def connected() -> bool:
                _, writable, _ = select.select([], socks, [], 0.1)
                assert all(s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0 for s in writable)
                return len(writable) == burst

            wait_for(connected, timeout=10, what=f"{burst} connections established while the server is stopped")
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
            for sock in socks:
                sock.close()
        assert timed_scrape(srv.base + "/metrics")[0] < SCRAPE_WITHIN * 5  # it has 129 closes to take first


def test_idle_keep_alive_connection_is_closed_after_the_idle_timeout(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     exporter_factory: Any) -> None:
    # In-process, with the timeouts shrunk: the real idle timeout is minutes.
    monkeypatch.setattr(server, "HEADER_TIMEOUT", 0.5)
    monkeypatch.setattr(server, "IDLE_TIMEOUT", 3.0)
    spoolgen.write_rank(tmp_path, "job", 0)
    exp = exporter_factory(tmp_path)
    with socket.create_connection(("127.0.0.1", exp.app.port)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(10)
        data = b""
        while not data.endswith(b"\r\n\r\nok\n"):  # headers and body may come in separate reads
            chunk = sock.recv(4096)
            assert chunk, data
            data += chunk
        assert data.startswith(b"HTTP/1.1 200 ")
        opened = time.monotonic()
        # Not cut off by the header timeout between requests: still open after four of them.
        assert not select.select([sock], [], [], 4 * server.HEADER_TIMEOUT)[0]
        wait_for(lambda: closed_by_server(sock), timeout=server.IDLE_TIMEOUT + 10, what="idle connection closed")
        assert time.monotonic() - opened >= server.IDLE_TIMEOUT - 0.5


# ---------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tls")
    out = subprocess.run([require_tool("openssl"), "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                          "-keyout", "server.key", "-out", "server.crt", "-subj", "/CN=127.0.0.1",
                          "-addext", "subjectAltName=IP:127.0.0.1"], cwd=d, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return d / "server.crt", d / "server.key"


def test_tls_handshake_and_half_sent_requests_are_cut_off(tmp_path: Path, certificate: tuple[Path, Path]) -> None:
    crt, key = certificate
    config = tmp_path / "web.yml"
    config.write_text(f"tls_server_config:\n  cert_file: {crt}\n  key_file: {key}\n")
    ctx = ssl.create_default_context(cafile=str(crt))
    with serve(tmp_path, "--web-config", str(config), ctx=ctx) as srv:
        started = time.monotonic()
        no_hello = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(3)]
        half_sent = []
        for _ in range(3):
            tls = ctx.wrap_socket(socket.create_connection(("127.0.0.1", srv.port)), server_hostname="127.0.0.1")
            tls.sendall(PARTIAL_REQUEST)
            half_sent.append(tls)
        held = no_hello + half_sent
        closed_after: dict[socket.socket, float] = {}
        try:
            while len(closed_after) < len(held) and time.monotonic() - started < HALF_SENT_CLOSED_WITHIN + 5:
                assert timed_scrape(srv.base + "/metrics", ctx)[0] < SCRAPE_WITHIN
                for sock in held:
                    if sock not in closed_after and closed_by_server(sock):
                        closed_after[sock] = time.monotonic() - started
                select.select([s for s in held if s not in closed_after], [], [], 0.25)
        finally:
            for sock in held:
                sock.close()
    assert len(closed_after) == len(held), f"{len(held) - len(closed_after)} TLS connections still open"
    # Each is bounded by one timeout: the handshake's, or the headers' once the handshake is done.
    bound = max(server.HANDSHAKE_TIMEOUT, server.HEADER_TIMEOUT) + 5
    assert max(closed_after.values()) < min(bound, HALF_SENT_CLOSED_WITHIN), closed_after


def test_prometheus_scrapes_with_gzip(tmp_path: Path, promstack: PromStack) -> None:
    since = time.time()
    with serve(tmp_path, port=promstack.exporter_port) as srv:
        promstack.wait_target_up(since)
        up = promstack.query(f'up{{instance="127.0.0.1:{srv.port}"}}')
        assert [float(r["value"][1]) for r in up] == [1.0]
        # Both ranks' series came through (their value depends on the synthetic heartbeats' age).
        assert len(promstack.query(f'{n.RANK_UP}{{instance="127.0.0.1:{srv.port}"}}')) == 2
        # The server's access log (debug level) names each response's content type, encoding and client: Prometheus
        # lists OpenMetrics first, and is served text 0.0.4 by frexporter's encoder (web/negotiation.py).
        served = re.compile(r'"GET /metrics HTTP/1.1" 200 \d+ "([^"]*)" gzip \'Prometheus/')
        wait_for(lambda: served.search(srv.log.read_text(errors="replace")), timeout=10,
                 what="a gzip response to Prometheus in the access log")
        content_types = set(served.findall(srv.log.read_text(errors="replace")))
        assert content_types == {exposition.CONTENT_TYPE}, content_types
