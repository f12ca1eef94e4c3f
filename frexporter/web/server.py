"""HTTP wiring: /metrics, /healthz, /api/v1/status, / over the exporter's latest snapshot.

With a web config (``serve --web-config``) every endpoint sits behind TLS and/or basic auth, /healthz
included, as in exporter-toolkit. Debug endpoints (``/api/v1/evidence``) exist only when enabled.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from frexporter.exporter import Exporter
from frexporter.outputs import exposition
from frexporter.outputs.api import status_html, status_json
from frexporter.outputs.evidence import list_evidence
from frexporter.outputs.identity import IdentityCollector
from frexporter.outputs.prometheus import SnapshotCollector
from frexporter.web.webconfig import BasicAuth, TLSContextSource, WebConfig

log = logging.getLogger("frexporter.web.server")

# A client that opens a connection and never finishes the TLS handshake must not hold a thread forever.
HANDSHAKE_TIMEOUT = 10.0
EVIDENCE_PATH = "/api/v1/evidence"
TEXT = "text/plain; charset=utf-8"


class _RenderCache:
    """One rendering of /metrics per (poll snapshot, content type), shared by every scrape of that poll.

    Rendering a 64-rank node costs tens of milliseconds of CPU; without this, 50 concurrent scrapers queue
    behind each other's renders of identical data (seconds at p99). The lock makes concurrent scrapes of a
    new snapshot wait for one render instead of each doing its own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bodies: dict[str, tuple[tuple[int, float], bytes]] = {}

    def get(self, snapshot: object, content_type: str, render: Callable[[], bytes]) -> bytes:
        key = (id(snapshot), float(getattr(snapshot, "time", 0.0)))
        with self._lock:
            cached = self._bodies.get(content_type)
            if cached is None or cached[0] != key:
                cached = (key, render())
                self._bodies[content_type] = cached
            return cached[1]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    exporter: Exporter
    registry: CollectorRegistry
    renders: _RenderCache
    tls: TLSContextSource | None = None
    auth: BasicAuth | None = None
    extra_headers: dict[str, str] = {}
    debug_endpoints: bool = False
    evidence_dir: str = ""

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, handler)

    def finish_request(self, request: socket.socket, client_address: Any) -> None:  # type: ignore[override]
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        # The handshake runs here, in the connection's own thread: in the accept loop a slow or
        # malicious client would stall every other scrape.
        tls_sock = self._handshake(request, client_address)
        if tls_sock is None:
            return
        with self._open_lock:
            self._open.discard(request)  # wrap_socket detached it; shut the TLS socket down instead
            self._open.add(tls_sock)
        try:
            super().finish_request(tls_sock, client_address)
        finally:
            with self._open_lock:
                self._open.discard(tls_sock)
            with contextlib.suppress(OSError):
                tls_sock.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A peer that vanishes mid-request (a TLS client closing without close_notify, a reset) is routine;
        # socketserver would print a traceback to stderr for each one.
        if isinstance(sys.exc_info()[1], OSError):
            log.debug("connection from %s ended: %s", client_address, sys.exc_info()[1])
            return
        super().handle_error(request, client_address)

    def _handshake(self, request: socket.socket, client_address: Any) -> ssl.SSLSocket | None:
        assert self.tls is not None
        tls_sock = None
        try:
            request.settimeout(HANDSHAKE_TIMEOUT)
            tls_sock = self.tls.context().wrap_socket(request, server_side=True)
            if not self.tls.config.peer_allowed(tls_sock.getpeercert()):
                raise ssl.SSLError("client certificate has none of client_allowed_sans")
            tls_sock.settimeout(None)
            return tls_sock
        except (OSError, ValueError) as e:  # ssl.SSLError and timeouts are OSErrors
            # Debug level: anyone who can reach the port can cause these, and logs must not be theirs to fill.
            log.debug("TLS handshake with %s failed: %s", client_address, e)
            with contextlib.suppress(OSError):
                (tls_sock or request).close()
            return None

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: socket.socket) -> None:  # type: ignore[override]
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def close_open_connections(self) -> None:
        # A keep-alive connection (Prometheus holds one per target) outlives serve_forever; left open, its
        # handler thread would go on answering scrapes from the stopped exporter's last snapshot.
        with self._open_lock:
            open_now = list(self._open)
        for request in open_now:
            with contextlib.suppress(OSError):  # the peer may have gone already
                request.shutdown(socket.SHUT_RDWR)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        try:
            auth = self.server.auth
            # Before routing: an unauthenticated client learns nothing, not even which paths exist.
            if auth is not None and not auth.check(self.headers.get("Authorization")):
                self._send(401, b"Unauthorized\n", TEXT,
                           {"WWW-Authenticate": 'Basic realm="frexporter", charset="UTF-8"'})
                return
            if path == "/metrics":
                accept = self.headers.get("Accept", "")
                encoder, content_type = choose_encoder(accept)
                if content_type.startswith("text/plain"):
                    encoder, content_type = exposition.encode, exposition.CONTENT_TYPE
                registry = self.server.registry
                body = self.server.renders.get(self.server.exporter.snapshot, content_type,
                                               lambda: encoder(registry))
                self._send(200, body, content_type)
            elif path == "/healthz":
                self._healthz()
            elif path == "/api/v1/status":
                body = json.dumps(status_json(self.server.exporter.snapshot), indent=1).encode()
                self._send(200, body, "application/json")
            elif path in ("/", "/index.html"):
                self._send(200, status_html(self.server.exporter.snapshot).encode(), "text/html; charset=utf-8")
            elif path == EVIDENCE_PATH:
                self._evidence()
            else:
                self._send(404, b"not found\n", TEXT)
        except BrokenPipeError:
            pass
        except Exception:
            log.exception("error serving %s", path)
            self._send(500, b"internal error\n", TEXT)

    def _evidence(self) -> None:
        if not self.server.debug_endpoints:
            self._send(404, b"not found (debug endpoints are off: serve --enable-debug-endpoints)\n", TEXT)
            return
        directory = self.server.evidence_dir
        body = {"enabled": bool(directory), "bundles": list_evidence(directory) if directory else []}
        self._send(200, json.dumps(body, indent=1).encode(), "application/json")

    def _healthz(self) -> None:
        exporter = self.server.exporter
        age = time.time() - exporter.snapshot.time
        # Healthy while the poll loop keeps producing snapshots; a wedged loop is worth a restart.
        if exporter.polls > 0 and age <= max(10.0, 5 * exporter.poll_interval):
            self._send(200, b"ok\n", TEXT)
        else:
            self._send(503, f"poll loop stale ({age:.0f}s since last poll)\n".encode(), TEXT)

    def _send(self, code: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in {**self.server.extra_headers, **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s " + format, self.address_string(), *args)


class MetricsServer:
    def __init__(self, exporter: Exporter, host: str, port: int, web_config: WebConfig | None = None,
                 debug_endpoints: bool = False, evidence_dir: str = "", nvlink_per_link: bool = False) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(SnapshotCollector(lambda: exporter.snapshot, nvlink_per_link=nvlink_per_link))
        registry.register(IdentityCollector())
        # Built before binding: a bad certificate or a missing bcrypt must not leave a listening socket behind.
        tls = TLSContextSource(web_config.tls) if web_config is not None and web_config.tls is not None else None
        auth = BasicAuth(web_config.basic_auth_users) if web_config is not None and web_config.basic_auth_users \
            else None
        server_class = _Server6 if ":" in host else _Server
        self.httpd = server_class((host, port), _Handler)
        self.httpd.exporter = exporter
        self.httpd.registry = registry
        self.httpd.renders = _RenderCache()
        self.httpd.tls = tls
        self.httpd.auth = auth
        self.httpd.extra_headers = dict(web_config.headers) if web_config is not None else {}
        self.httpd.debug_endpoints = debug_endpoints
        self.httpd.evidence_dir = evidence_dir
        self.scheme = "https" if tls is not None else "http"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="frexporter-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.httpd.close_open_connections()
