"""The listening side of the HTTP server (``HttpServer``): connections accepted up to ``max_connections`` and
the rest refused and counted, the TLS handshake run in each connection's own thread, and the kept-alive
connections closed when the server stops. It also carries what the request handler serves from (the exporter,
the render cache, auth, the rate limit) and the connection timeouts the handler applies (``Timeouts``).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import sys
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry

from frexporter import defaults
from frexporter.exporter import Exporter
from frexporter.ratelimit import LogLimiter
from frexporter.web.basic_auth import BasicAuth
from frexporter.web.render_cache import RenderCache
from frexporter.web.tls_context import TLSContextSource
from frexporter.web.token_bucket import TokenBucket

# The HTTP server's logger name, the same in each of its modules.
log = logging.getLogger("frexporter.web.server")

# A client that opens a connection and never finishes the TLS handshake must not hold a thread forever.
HANDSHAKE_TIMEOUT = 10.0
# From the connection's start (or a further request's first byte) to the end of the request's headers, in
# total: a per-read timeout alone lets a client that sends a byte every few seconds hold a thread for ever.
HEADER_TIMEOUT = 10.0
# Prometheus keeps one connection per target and scrapes it every 15-60 s: a kept-alive connection outlives
# that between requests. With a longer scrape interval it is closed and the next scrape opens a new one.
IDLE_TIMEOUT = 120.0
# The longest one write of a response may take (a /metrics body is at most a few MB, less gzipped).
WRITE_TIMEOUT = 30.0
# socketserver's default of 5 refuses a burst of connections that the accept loop would take in microseconds.
LISTEN_BACKLOG = 128
_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: 21\r\nConnection: close\r\n\r\ntoo many connections\n"
)


@dataclass(frozen=True)
class Timeouts:
    """A connection's bounds in seconds (each described at its default above): the handshake's is applied
    here, the others by the request handler."""

    handshake: float = HANDSHAKE_TIMEOUT
    header: float = HEADER_TIMEOUT
    idle: float = IDLE_TIMEOUT
    write: float = WRITE_TIMEOUT


class HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG
    exporter: Exporter
    registry: CollectorRegistry
    renders: RenderCache
    limiter: TokenBucket | None = None
    errors: LogLimiter
    tls: TLSContextSource | None = None
    auth: BasicAuth | None = None
    extra_headers: dict[str, str] = {}
    debug_endpoints: bool = False
    evidence_dir: str = ""
    max_connections: int = defaults.WEB_MAX_CONNECTIONS
    timeouts: Timeouts = Timeouts()

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        # Written by the accept loop only.
        self.rejected = 0
        super().__init__(address, handler)

    def render_key(self) -> Hashable:
        """What a cached /metrics body depends on: the poll snapshot and this server's own counters."""
        snapshot = self.exporter.snapshot
        return id(snapshot), float(getattr(snapshot, "time", 0.0)), self.rejected

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
            # The ssl module bounds the whole handshake by the socket's timeout, not each read.
            request.settimeout(self.timeouts.handshake)
            tls_sock = self.tls.context().wrap_socket(request, server_side=True)
            if not self.tls.config.peer_allowed(tls_sock.getpeercert()):
                raise ssl.SSLError("client certificate has none of client_allowed_sans")
            return tls_sock
        except (OSError, ValueError) as e:  # ssl.SSLError and timeouts are OSErrors
            # Debug level: anyone who can reach the port can cause these, and logs must not be theirs to fill.
            log.debug("TLS handshake with %s failed: %s", client_address, e)
            with contextlib.suppress(OSError):
                (tls_sock or request).close()
            return None

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        with self._open_lock:
            full = len(self._open) >= self.max_connections
            if not full:
                self._open.add(request)
        if full:
            self.rejected += 1
            log.debug("refused a connection from %s: %d connections are open", client_address, self.max_connections)
            self._refuse(request)
            return
        super().process_request(request, client_address)

    def _refuse(self, request: socket.socket) -> None:
        # In the accept loop: nothing here may block. Plain HTTP gets a 503 (the request already sent is read
        # first, so that closing does not reset the connection before the client reads the answer); a TLS
        # client would take plain text for a broken handshake, so it is just closed.
        with contextlib.suppress(OSError):
            request.setblocking(False)
            if self.tls is None:
                with contextlib.suppress(BlockingIOError):
                    request.recv(65536)
                request.send(_REFUSED)
            request.shutdown(socket.SHUT_RDWR)
        request.close()

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


class HttpServer6(HttpServer):
    address_family = socket.AF_INET6
