"""HTTP wiring: /metrics, /healthz, /api/v1/status, / over the exporter's latest snapshot."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from frexporter.exporter import Exporter
from frexporter.outputs import exposition
from frexporter.outputs.api import status_html, status_json
from frexporter.outputs.prometheus import SnapshotCollector

log = logging.getLogger("frexporter.server")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    exporter: Exporter
    registry: CollectorRegistry

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, handler)

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
            if path == "/metrics":
                accept = self.headers.get("Accept", "")
                encoder, content_type = choose_encoder(accept)
                if content_type.startswith("text/plain"):
                    encoder, content_type = exposition.encode, exposition.CONTENT_TYPE
                self._send(200, encoder(self.server.registry), content_type)
            elif path == "/healthz":
                self._healthz()
            elif path == "/api/v1/status":
                body = json.dumps(status_json(self.server.exporter.snapshot), indent=1).encode()
                self._send(200, body, "application/json")
            elif path in ("/", "/index.html"):
                self._send(200, status_html(self.server.exporter.snapshot).encode(), "text/html; charset=utf-8")
            else:
                self._send(404, b"not found\n", "text/plain; charset=utf-8")
        except BrokenPipeError:
            pass
        except Exception:
            log.exception("error serving %s", path)
            self._send(500, b"internal error\n", "text/plain; charset=utf-8")

    def _healthz(self) -> None:
        exporter = self.server.exporter
        age = time.time() - exporter.snapshot.time
        # Healthy while the poll loop keeps producing snapshots; a wedged loop is worth a restart.
        if exporter.polls > 0 and age <= max(10.0, 5 * exporter.poll_interval):
            self._send(200, b"ok\n", "text/plain; charset=utf-8")
        else:
            self._send(503, f"poll loop stale ({age:.0f}s since last poll)\n".encode(),
                       "text/plain; charset=utf-8")

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s " + format, self.address_string(), *args)


class MetricsServer:
    def __init__(self, exporter: Exporter, host: str, port: int) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(SnapshotCollector(lambda: exporter.snapshot))
        server_class = _Server6 if ":" in host else _Server
        self.httpd = server_class((host, port), _Handler)
        self.httpd.exporter = exporter
        self.httpd.registry = registry
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
