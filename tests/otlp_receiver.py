"""A minimal real OTLP metrics receiver for tests: OTLP/HTTP (protobuf or JSON, gzip) and OTLP/gRPC.

Run as ``python -m tests.otlp_receiver OUT.jsonl``: it binds free loopback ports, prints one JSON line
``{"http": PORT, "grpc": PORT}`` on stdout once both listen, and appends one JSON row per data point to
OUT.jsonl. Requests are decoded with the official opentelemetry-proto messages, so what a test reads is what
a collector would have received, not what our code meant to send.

Row: transport, request (1, 2, ... in arrival order), metric, type (gauge/sum/...), unit, description, is_monotonic,
temporality, attrs, value, time_unix_nano, start_time_unix_nano, resource, scope; histograms add count,
bucket_counts and explicit_bounds (their value is the sum).
"""

from __future__ import annotations

import gzip
import itertools
import json
import sys
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as ms
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as ms_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

_TEMPORALITY = {0: "unspecified", 1: "delta", 2: "cumulative"}


def plain(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [plain(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return attributes(value.kvlist_value.values)
    return getattr(value, which) if which else None


def attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: plain(kv.value) for kv in pairs if isinstance(kv, KeyValue)}


def rows(request: ms.ExportMetricsServiceRequest, transport: str, number: int) -> list[dict[str, Any]]:
    out = []
    for rm in request.resource_metrics:
        resource = attributes(rm.resource.attributes)
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                kind = metric.WhichOneof("data")
                data = getattr(metric, kind)
                for dp in data.data_points:
                    value = getattr(dp, dp.WhichOneof("value")) if kind in ("gauge", "sum") else dp.sum
                    out.append({
                        "transport": transport, "request": number, "metric": metric.name, "type": kind,
                        "unit": metric.unit, "description": metric.description,
                        "is_monotonic": getattr(data, "is_monotonic", None),
                        "temporality": _TEMPORALITY.get(getattr(data, "aggregation_temporality", 0)),
                        "attrs": attributes(dp.attributes), "value": value, "time_unix_nano": dp.time_unix_nano,
                        "start_time_unix_nano": dp.start_time_unix_nano, "resource": resource,
                        "scope": sm.scope.name,
                    })
                    if kind == "histogram":
                        out[-1].update({"count": dp.count, "bucket_counts": list(dp.bucket_counts),
                                        "explicit_bounds": list(dp.explicit_bounds)})
    return out


class Sink:
    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.numbers = itertools.count(1)

    def record(self, transport: str, request: ms.ExportMetricsServiceRequest) -> None:
        with self.lock:
            decoded = rows(request, transport, next(self.numbers))
            with open(self.path, "a") as f:
                f.writelines(json.dumps(row) + "\n" for row in decoded)


def http_handler(sink: Sink) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/metrics":
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            ctype = self.headers.get("Content-Type", "application/x-protobuf")
            if ctype.startswith("application/json"):
                request = json_format.Parse(body, ms.ExportMetricsServiceRequest())
                out = b"{}"
            else:
                request = ms.ExportMetricsServiceRequest.FromString(body)
                out = ms.ExportMetricsServiceResponse().SerializeToString()
            sink.record("http", request)
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: object) -> None:
            pass

    return Handler


class MetricsService(ms_grpc.MetricsServiceServicer):
    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    def Export(self, request: ms.ExportMetricsServiceRequest, context: object) -> ms.ExportMetricsServiceResponse:
        self.sink.record("grpc", request)
        return ms.ExportMetricsServiceResponse()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.otlp_receiver OUT.jsonl", file=sys.stderr)
        return 2
    sink = Sink(argv[0])
    server = grpc.server(futures.ThreadPoolExecutor(4))
    ms_grpc.add_MetricsServiceServicer_to_server(MetricsService(sink), server)
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), http_handler(sink))
    print(json.dumps({"http": httpd.server_address[1], "grpc": grpc_port}), flush=True)
    try:
        httpd.serve_forever()
    finally:
        server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
