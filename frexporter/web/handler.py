"""One connection's requests (``RequestHandler``): read deadlines, authentication and the rate limit before
routing, then /metrics, /healthz, /api/v1/status, / and the debug endpoints, every GET also as HEAD.

The server it runs under (``http_server.HttpServer``) holds what it serves from and the timeouts it applies.
"""

from __future__ import annotations

import io
import json
import logging
import math
import socket
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.exposition import gzip_accepted

from frexporter.outputs.api import health_text, status_html, status_json
from frexporter.outputs.evidence import list_evidence
from frexporter.web import negotiation
from frexporter.web.http_server import HttpServer
from frexporter.web.selection import names_from_query

# The HTTP server's logger name, the same in each of its modules.
log = logging.getLogger("frexporter.web.server")

EVIDENCE_PATH = "/api/v1/evidence"
TEXT = "text/plain; charset=utf-8"


class _DeadlineReader(io.RawIOBase):
    """A connection's reads, each given only what is left until ``deadline`` (monotonic seconds)."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self._sock = sock
        self.deadline = math.inf

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("read deadline passed")
        self._sock.settimeout(remaining)
        return self._sock.recv_into(buffer)


class RequestHandler(BaseHTTPRequestHandler):
    server: HttpServer
    protocol_version = "HTTP/1.1"
    # BaseHTTPRequestHandler's "BaseHTTP/0.6 Python/3.x" tells a scanner which CVEs to try; this says nothing.
    server_version = "frexporter"
    sys_version = ""

    def version_string(self) -> str:
        return self.server_version

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the plain file socketserver made: reads go through the deadline instead
        self._reader = _DeadlineReader(self.connection)
        self._buffered = io.BufferedReader(self._reader)
        self.rfile = self._buffered
        self._requests = 0

    def handle_one_request(self) -> None:
        # The first request must begin within the header timeout of the connection; a further one may keep the
        # client waiting up to the idle timeout. Once it begins, its headers must be complete within the header
        # timeout.
        timeouts = self.server.timeouts
        self._reader.deadline = time.monotonic() + (timeouts.idle if self._requests else timeouts.header)
        try:
            begun = self._buffered.peek(1)
        except TimeoutError:
            log.debug(
                "closing %s connection from %s: no request within the timeout",
                "idle" if self._requests else "new",
                self.address_string(),
            )
            begun = b""
        if not begun:
            self.close_connection = True
            return
        self._requests += 1
        self._reader.deadline = time.monotonic() + timeouts.header
        super().handle_one_request()  # closes the connection itself when its reads time out

    raw_requestline: bytes  # set by BaseHTTPRequestHandler.handle_one_request before it calls parse_request

    def parse_request(self) -> bool:
        if len(self.raw_requestline.split()) == 2:
            # HTTP/0.9 (no version): BaseHTTPRequestHandler would wait for headers such a client never sends.
            self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
            self.request_version = "HTTP/1.0"  # an answer with a status line, which any client can read
            self.command = None  # type: ignore[assignment]  # what BaseHTTPRequestHandler sets for no command
            self.close_connection = True
            self.send_error(HTTPStatus.BAD_REQUEST, "HTTP/0.9 requests are not served")
            return False
        return super().parse_request()

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        path = url.path
        if self.headers.get("Transfer-Encoding") or self.headers.get("Content-Length", "0").strip() != "0":
            # No endpoint reads a body: answer, then close rather than read what the client sends after.
            self.close_connection = True
        try:
            # Before authentication, as in exporter-toolkit: a flood of guesses is turned away before bcrypt runs.
            if not self._within_rate_limit():
                return
            auth = self.server.auth
            # Before routing: an unauthenticated client learns nothing, not even which paths exist.
            if auth is not None and not auth.check(self.headers.get("Authorization")):
                self._send(
                    401, b"Unauthorized\n", TEXT, {"WWW-Authenticate": 'Basic realm="frexporter", charset="UTF-8"'}
                )
                return
            if path == "/metrics":
                self._metrics(url.query)
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
            # Whatever failed will fail for every request alike: one traceback per interval, not one per request.
            self.server.errors.log(logging.ERROR, "internal error", "error serving %s", path[:256], exc_info=True)
            self.server.errors.flush()
            self._send(500, b"internal error\n", TEXT)

    # The same answer without its body: _send leaves the body out.
    do_HEAD = do_GET

    def _within_rate_limit(self) -> bool:
        limiter = self.server.limiter
        wait = limiter.allow() if limiter is not None else 0.0
        if wait > 0:
            self._send(429, b"Too Many Requests\n", TEXT, {"Retry-After": str(max(1, math.ceil(wait)))})
        return wait <= 0

    def _metrics(self, query: str) -> None:
        names, problem = names_from_query(query)
        fmt, format_problem = negotiation.format_from_query(query)
        if problem or format_problem:
            self._send(400, (problem or format_problem).encode(), TEXT)
            return
        # Text 0.0.4 by frexporter's encoder to whoever accepts it (Prometheus does, after OpenMetrics): see
        # web/negotiation.py.
        encoder, content_type = negotiation.choose(self.headers.get("Accept", ""), fmt)
        gzipped = gzip_accepted(self.headers.get("Accept-Encoding", ""))
        server = self.server
        body = server.renders.get(server.render_key(), names, content_type, gzipped, encoder)
        headers = {"Vary": "Accept, Accept-Encoding"}  # the format follows Accept, the encoding Accept-Encoding
        if gzipped:
            headers["Content-Encoding"] = "gzip"
        self._send(200, body, content_type, headers)

    def _evidence(self) -> None:
        if not self.server.debug_endpoints:
            self._send(404, b"not found (debug endpoints are off: serve --enable-debug-endpoints)\n", TEXT)
            return
        directory = self.server.evidence_dir
        body = {"enabled": bool(directory), "bundles": list_evidence(directory) if directory else []}
        self._send(200, json.dumps(body, indent=1).encode(), "application/json")

    def _healthz(self) -> None:
        exporter = self.server.exporter
        snapshot = exporter.snapshot
        age = time.time() - snapshot.time
        # Healthy (200) while the poll loop keeps producing snapshots: a wedged loop is worth a restart, a source
        # that is down is not (a restart does not mend a GPU or a driver), so it is named in the body instead.
        if exporter.polls > 0 and age <= max(10.0, 5 * exporter.poll_interval):
            self._send(200, health_text(snapshot).encode(), TEXT)
        else:
            self._send(503, f"poll loop stale ({age:.0f}s since last poll)\n".encode(), TEXT)

    def _send(self, code: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        headers = {**self.server.extra_headers, **(headers or {})}
        # The access log, at debug level, says what was served: size, content type, encoding and client.
        log.debug(
            '%s "%s" %d %d "%s" %s %r',
            self.address_string(),
            self.requestline,
            code,
            len(body),
            content_type,
            headers.get("Content-Encoding", "identity"),
            self.headers.get("User-Agent", "")[:100],
        )
        self.connection.settimeout(self.server.timeouts.write)
        self.send_response_only(code)
        self.send_header("Server", self.version_string())
        self.send_header("Date", self.date_time_string())
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s " + format, self.address_string(), *args)
