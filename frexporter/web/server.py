"""HTTP wiring: /metrics, /healthz, /api/v1/status, / over the exporter's latest snapshot.

With a web config (``serve --web-config``) every endpoint sits behind TLS and/or basic auth, /healthz
included, as in exporter-toolkit. Debug endpoints (``/api/v1/evidence``) exist only when enabled.

Every GET endpoint answers HEAD. /metrics follows prometheus_client's conventions: gzip when the client
accepts it (Prometheus always does), ``name[]`` to select series by sample name.

Scrapes cannot starve the poll loop: a poll's metric families are collected once, and each rendering of them
(whole, or a client's ``name[]`` selection, per content type and encoding) once per poll, up to fixed bounds;
renderings past the bounds are not kept but run one at a time. A web config's ``rate_limit`` (a token bucket
over every request) answers 429 past its burst.

Connections are bounded, as in Go's net/http servers: a request's line and headers must arrive within
HEADER_TIMEOUT of the connection opening (or of the request's first byte on a kept-alive connection), a
kept-alive connection is closed after IDLE_TIMEOUT without a request, a response must be taken within
WRITE_TIMEOUT, and at most ``max_connections`` are open at once; more are closed unserved and counted.
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import io
import json
import logging
import math
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.metrics_core import Metric

from frexporter import defaults
from frexporter.exporter import Exporter
from frexporter.outputs import exposition
from frexporter.outputs.api import status_html, status_json
from frexporter.outputs.evidence import list_evidence
from frexporter.outputs.http_metrics import HttpServerCollector
from frexporter.outputs.identity import IdentityCollector
from frexporter.outputs.snapshot_metrics import SnapshotCollector
from frexporter.ratelimit import LogLimiter
from frexporter.web.webconfig import BasicAuth, RateLimit, TLSContextSource, WebConfig

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
# Cached /metrics renderings per snapshot: the OpenMetrics content type carries the version the client's Accept
# header asked for, so the variants are the client's to choose.
MAX_CACHED_VARIANTS = 8
# ``name[]`` selections kept per poll (each with up to MAX_CACHED_VARIANTS variants, all within
# MAX_CACHED_SELECTED_BYTES): a dashboard's handful of selections renders once per poll however many ask.
# Selections past these bounds are rendered for their request only, one at a time.
MAX_CACHED_NAME_SETS = 32
MAX_CACHED_SELECTED_BYTES = 32 * 1024 * 1024
# Distinct ``name[]`` values one request may ask for; more is answered 400. Every family has one to a few sample
# names, so a real selection needs far fewer; the whole exposition is there without ``name[]``.
MAX_NAMES_PER_REQUEST = 64
# Query fields parsed at most (repeated names included): parse_qs's own bound on a request line of up to 64 KiB.
MAX_QUERY_FIELDS = 1024
# zlib's default: a quarter of level 9's time or less, for 6 % more bytes (benchmarks/exporter_bench.py).
GZIP_LEVEL = 6
EVIDENCE_PATH = "/api/v1/evidence"
TEXT = "text/plain; charset=utf-8"
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
            b"Content-Length: 21\r\nConnection: close\r\n\r\ntoo many connections\n")


Encoder = Callable[[Any], bytes]
# A name[] selection: its sorted, distinct sample names; None for the whole exposition.
Names = tuple[str, ...] | None


class _Families:
    """Already collected metric families, as the registry-like object prometheus_client's encoders take."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def _select(families: list[Metric], names: frozenset[str]) -> Iterator[Metric]:
    """prometheus_client's restricted_registry over collected families: only the samples named."""
    for family in families:
        samples = [s for s in family.samples if s.name in names]
        if samples:
            selected = copy.copy(family)  # the cached family is shared by every rendering of this poll
            selected.samples = samples
            yield selected


@dataclass
class _PollRenders:
    """What one poll's scrapes share: the collected families and the rendered bodies."""

    key: Hashable
    families: list[Metric] | None = None
    # (names, content type, gzip) -> body
    bodies: dict[tuple[Names, str, bool], bytes] = field(default_factory=dict)
    variants: dict[Names, int] = field(default_factory=dict)  # bodies kept per selection
    selected_bytes: int = 0


class _RenderCache:
    """The /metrics bodies of one poll snapshot, per (name[] selection, content type, gzip), shared by every
    scrape of that poll.

    Rendering a 64-rank node costs tens of milliseconds of CPU; without this, 50 concurrent scrapers queue
    behind each other's renders of identical data (seconds at p99), and clients looping over name[]
    selections keep enough threads busy rendering that the poll loop, which needs the GIL back after each of
    its many file reads, falls seconds behind (12.6 s with 24 such clients at 1,000 ranks). The lock makes
    concurrent scrapes of a new snapshot wait for one render instead of each doing its own, and keeps renders
    past the cache's bounds to one at a time; a body already rendered is answered without taking it, so those
    never wait behind them.
    Gzip is applied once to the cached body.
    """

    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect
        self._lock = threading.Lock()
        self._poll = _PollRenders(key=None)

    @property
    def _bodies(self) -> dict[tuple[str, bool], bytes]:
        """The whole exposition's bodies kept for the current poll, by (content type, gzip)."""
        return {(ctype, gz): body for (names, ctype, gz), body in self._poll.bodies.items() if names is None}

    def get(self, key: Hashable, names: Names, content_type: str, gzipped: bool, encoder: Encoder) -> bytes:
        poll = self._poll  # one read: the poll's key and bodies stay a consistent pair without the lock
        if poll.key == key:
            body = poll.bodies.get((names, content_type, gzipped))
            if body is not None:
                return body
        with self._lock:
            if self._poll.key != key:
                self._poll = _PollRenders(key=key)
            poll = self._poll
            body = poll.bodies.get((names, content_type, False))
            if body is None:
                body = self._render(poll, names, encoder)
                self._store(poll, (names, content_type, False), body)
            if not gzipped:
                return body
            packed = poll.bodies.get((names, content_type, True))
            if packed is None:
                packed = gzip.compress(body, GZIP_LEVEL)
                self._store(poll, (names, content_type, True), packed)
            return packed

    def _render(self, poll: _PollRenders, names: Names, encoder: Encoder) -> bytes:
        if poll.families is None:
            poll.families = list(self._collect())
        if names is None:
            return encoder(_Families(poll.families))
        return encoder(_Families(_select(poll.families, frozenset(names))))

    @staticmethod
    def _store(poll: _PollRenders, variant: tuple[Names, str, bool], body: bytes) -> None:
        names = variant[0]
        kept = poll.variants.get(names, 0)
        if kept >= MAX_CACHED_VARIANTS:
            return
        if names is not None:
            if kept == 0 and sum(1 for n in poll.variants if n is not None) >= MAX_CACHED_NAME_SETS:
                return
            if poll.selected_bytes + len(body) > MAX_CACHED_SELECTED_BYTES:
                return
            poll.selected_bytes += len(body)
        poll.variants[names] = kept + 1
        poll.bodies[variant] = body


class _TokenBucket:
    """exporter-toolkit's rate limiter (Go's rate.Limiter): ``burst`` requests at once, refilled by one every
    ``interval`` seconds; one bucket for the whole server, as there."""

    def __init__(self, limit: RateLimit, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._interval = limit.interval
        self._burst = float(limit.burst)
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._tokens = self._burst
        self._last = monotonic()

    def allow(self) -> float:
        """0 when a request may go ahead (its token taken); else the seconds until the next token."""
        with self._lock:
            now = self._monotonic()
            self._tokens = min(self._burst, self._tokens + (now - self._last) / self._interval)
            self._last = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return 0.0
            return (1.0 - self._tokens) * self._interval


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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG
    exporter: Exporter
    registry: CollectorRegistry
    renders: _RenderCache
    limiter: _TokenBucket | None = None
    errors: LogLimiter
    tls: TLSContextSource | None = None
    auth: BasicAuth | None = None
    extra_headers: dict[str, str] = {}
    debug_endpoints: bool = False
    evidence_dir: str = ""
    max_connections: int = defaults.WEB_MAX_CONNECTIONS

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
            request.settimeout(HANDSHAKE_TIMEOUT)
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
            log.debug("refused a connection from %s: %d connections are open", client_address,
                      self.max_connections)
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


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _Server
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
        # The first request must begin within HEADER_TIMEOUT of the connection; a further one may keep the
        # client waiting up to IDLE_TIMEOUT. Once it begins, its headers must be complete within HEADER_TIMEOUT.
        self._reader.deadline = time.monotonic() + (IDLE_TIMEOUT if self._requests else HEADER_TIMEOUT)
        try:
            begun = self._buffered.peek(1)
        except TimeoutError:
            log.debug("closing %s connection from %s: no request within the timeout",
                      "idle" if self._requests else "new", self.address_string())
            begun = b""
        if not begun:
            self.close_connection = True
            return
        self._requests += 1
        self._reader.deadline = time.monotonic() + HEADER_TIMEOUT
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
                self._send(401, b"Unauthorized\n", TEXT,
                           {"WWW-Authenticate": 'Basic realm="frexporter", charset="UTF-8"'})
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
        encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
        if content_type.startswith("text/plain"):
            encoder, content_type = exposition.encode, exposition.CONTENT_TYPE
        gzipped = gzip_accepted(self.headers.get("Accept-Encoding", ""))
        names, problem = _selection(query)
        if problem:
            self._send(400, problem.encode(), TEXT)
            return
        server = self.server
        body = server.renders.get(server.render_key(), names, content_type, gzipped, encoder)
        headers = {"Vary": "Accept-Encoding"}
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
        age = time.time() - exporter.snapshot.time
        # Healthy while the poll loop keeps producing snapshots; a wedged loop is worth a restart.
        if exporter.polls > 0 and age <= max(10.0, 5 * exporter.poll_interval):
            self._send(200, b"ok\n", TEXT)
        else:
            self._send(503, f"poll loop stale ({age:.0f}s since last poll)\n".encode(), TEXT)

    def _send(self, code: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        headers = {**self.server.extra_headers, **(headers or {})}
        # The access log, at debug level, says what was served: size, encoding and client.
        log.debug('%s "%s" %d %d %s %r', self.address_string(), self.requestline, code, len(body),
                  headers.get("Content-Encoding", "identity"), self.headers.get("User-Agent", "")[:100])
        self.connection.settimeout(WRITE_TIMEOUT)
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


def _selection(query: str) -> tuple[Names, str]:
    """The request's ``name[]`` selection (None: everything), or why it is refused."""
    try:
        values = parse_qs(query, max_num_fields=MAX_QUERY_FIELDS).get("name[]")
    except ValueError:
        return None, f"more than {MAX_QUERY_FIELDS} query parameters\n"
    if not values:
        return None, ""
    names = tuple(sorted(set(values)))
    if len(names) > MAX_NAMES_PER_REQUEST:
        return None, (f"{len(names)} distinct name[] values: at most {MAX_NAMES_PER_REQUEST} per request "
                      "(leave name[] out for every series)\n")
    return names, ""


class MetricsServer:
    def __init__(self, exporter: Exporter, host: str, port: int, web_config: WebConfig | None = None,
                 debug_endpoints: bool = False, evidence_dir: str = "", nvlink_per_link: bool = False,
                 max_connections: int = defaults.WEB_MAX_CONNECTIONS) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        # Collectors without describe(): restricted_registry (name[]) filters their output only with this on.
        registry = CollectorRegistry(auto_describe=False, support_collectors_without_names=True)
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
        self.httpd.max_connections = max_connections
        registry.register(HttpServerCollector(lambda: self.httpd.rejected))
        self.httpd.renders = _RenderCache(registry.collect)
        self.httpd.errors = LogLimiter(log)
        if web_config is not None and web_config.rate_limit is not None:
            self.httpd.limiter = _TokenBucket(web_config.rate_limit)
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
        # shutdown() waits for serve_forever to notice, and would wait for ever on a server never started.
        if self._thread.is_alive():
            self.httpd.shutdown()
        self.httpd.server_close()
        self.httpd.close_open_connections()
