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

This module is the entry point and the server's lifecycle (``MetricsServer``: build, start, stop); the pieces:

- ``http_server``: the listening side (connection bounds, TLS handshakes, refusals) and ``Timeouts``
- ``handler``: one connection's requests, and the routes
- ``render_cache``: the /metrics bodies of a poll, shared by its scrapes
- ``selection``: the ``name[]`` selection of /metrics
- ``token_bucket``: the web config's ``rate_limit``
"""

from __future__ import annotations

import logging
import threading

from prometheus_client import CollectorRegistry

from frexporter import defaults
from frexporter.exporter import Exporter
from frexporter.outputs.http_metrics import HttpServerCollector
from frexporter.outputs.identity import IdentityCollector
from frexporter.outputs.snapshot_metrics import SnapshotCollector
from frexporter.ratelimit import LogLimiter
from frexporter.web.basic_auth import BasicAuth
from frexporter.web.config_model import WebConfig
from frexporter.web.handler import EVIDENCE_PATH, TEXT, RequestHandler
from frexporter.web.http_server import (
    HANDSHAKE_TIMEOUT,
    HEADER_TIMEOUT,
    IDLE_TIMEOUT,
    LISTEN_BACKLOG,
    WRITE_TIMEOUT,
    HttpServer,
    HttpServer6,
    Timeouts,
)
from frexporter.web.render_cache import (
    GZIP_LEVEL,
    MAX_CACHED_NAME_SETS,
    MAX_CACHED_SELECTED_BYTES,
    MAX_CACHED_VARIANTS,
    RenderCache,
)
from frexporter.web.selection import MAX_NAMES_PER_REQUEST, MAX_QUERY_FIELDS
from frexporter.web.tls_context import TLSContextSource
from frexporter.web.token_bucket import TokenBucket

log = logging.getLogger("frexporter.web.server")

# The name tests have long used for the rate limiter.
_TokenBucket = TokenBucket

__all__ = [
    "EVIDENCE_PATH",
    "GZIP_LEVEL",
    "HANDSHAKE_TIMEOUT",
    "HEADER_TIMEOUT",
    "IDLE_TIMEOUT",
    "LISTEN_BACKLOG",
    "MAX_CACHED_NAME_SETS",
    "MAX_CACHED_SELECTED_BYTES",
    "MAX_CACHED_VARIANTS",
    "MAX_NAMES_PER_REQUEST",
    "MAX_QUERY_FIELDS",
    "TEXT",
    "WRITE_TIMEOUT",
    "MetricsServer",
    "_TokenBucket",
]


class MetricsServer:
    """The exporter's HTTP endpoints over its latest snapshot: bound when built, served by a daemon thread from
    ``start()`` until ``stop()``."""

    def __init__(
        self,
        exporter: Exporter,
        host: str,
        port: int,
        web_config: WebConfig | None = None,
        debug_endpoints: bool = False,
        evidence_dir: str = "",
        nvlink_per_link: bool = False,
        max_connections: int = defaults.WEB_MAX_CONNECTIONS,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        # Collectors without describe(): restricted_registry (name[]) filters their output only with this on.
        registry = CollectorRegistry(auto_describe=False, support_collectors_without_names=True)
        registry.register(SnapshotCollector(lambda: exporter.snapshot, nvlink_per_link=nvlink_per_link))
        registry.register(IdentityCollector())
        # Built before binding: a bad certificate or a missing bcrypt must not leave a listening socket behind.
        tls = TLSContextSource(web_config.tls) if web_config is not None and web_config.tls is not None else None
        auth = (
            BasicAuth(web_config.basic_auth_users) if web_config is not None and web_config.basic_auth_users else None
        )
        server_class = HttpServer6 if ":" in host else HttpServer
        self.httpd = server_class((host, port), RequestHandler)
        self.httpd.exporter = exporter
        self.httpd.registry = registry
        self.httpd.max_connections = max_connections
        # This module's names, read as the server is built: a test shrinks server.HEADER_TIMEOUT and IDLE_TIMEOUT.
        self.httpd.timeouts = Timeouts(
            handshake=HANDSHAKE_TIMEOUT, header=HEADER_TIMEOUT, idle=IDLE_TIMEOUT, write=WRITE_TIMEOUT
        )
        registry.register(HttpServerCollector(lambda: self.httpd.rejected))
        self.httpd.renders = RenderCache(registry.collect)
        self.httpd.errors = LogLimiter(log)
        if web_config is not None and web_config.rate_limit is not None:
            self.httpd.limiter = TokenBucket(web_config.rate_limit)
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
