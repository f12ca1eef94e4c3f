"""The HTTP server under hostile or unusual clients, and the /metrics conventions Prometheus clients expect.

Against a real ``frexporter serve`` on 127.0.0.1: half-sent requests (including a client that sends one byte at
a time) are closed within 30 s while scrapes stay fast, connections over ``--web-max-connections`` are refused
and counted, an HTTP/0.9 request line is answered at once, the listen backlog takes a burst of connections,
and TLS handshakes that never finish are cut off. Then gzip, HEAD and ``name[]`` on /metrics, and a real
Prometheus scraping with gzip.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_http_hardening.py.
"""

from __future__ import annotations

import gzip
import http.client
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from frexporter import naming as n
from frexporter.outputs import exposition
from frexporter.web import server
from tests import spoolgen
from tests.harness import metrics, sample, wait_for

# ---------------------------------------------------------------- Part B: /metrics conventions


def _get(port: int, path: str, method: str = "GET", **headers: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


# A client that accepts OpenMetrics only: anyone that also accepts text gets text (web/negotiation.py).
OPENMETRICS = "application/openmetrics-text;version=1.0.0"


def test_gzip_body_is_the_same_exposition_rendered_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        exporter_factory: Any) -> None:
    for rank in range(4):
        spoolgen.write_rank(tmp_path, "job", rank, pgs=3)
    renders: list[int] = []
    real = exposition.encode
    monkeypatch.setattr(exposition, "encode", lambda registry: renders.append(1) or real(registry))
    # One snapshot for the whole test (after the poll loop's first): every body below renders the same poll.
    exp = exporter_factory(tmp_path, poll_interval=3600)
    wait_for(lambda: exp.app.exporter.polls >= 2, timeout=10, what="the poll loop's first poll")
    renders.clear()
    port = exp.app.port
    for accept in ("", OPENMETRICS):
        status, headers, plain = _get(port, "/metrics", Accept=accept)
        assert status == 200 and "content-encoding" not in headers
        status, zipped_headers, zipped = _get(port, "/metrics", Accept=accept, **{"Accept-Encoding": "gzip"})
        assert status == 200 and zipped_headers["content-encoding"] == "gzip"
        assert zipped_headers["content-type"] == headers["content-type"]
        assert zipped_headers["vary"] == "Accept, Accept-Encoding"
        assert int(zipped_headers["content-length"]) == len(zipped) < len(plain)
        assert gzip.decompress(zipped) == plain
        # Prometheus' own header: gzip among others, with weights.
        assert _get(port, "/metrics", Accept=accept, **{"Accept-Encoding": "deflate, gzip;q=1.0, *;q=0.5"})[2] \
            == zipped
    assert len(renders) == 1  # the text encoder once for the snapshot; gzip reuses the rendering
    assert _get(port, "/metrics", **{"Accept-Encoding": "identity"})[1].get("content-encoding") is None


@pytest.mark.parametrize("path", ["/metrics", "/healthz", "/api/v1/status", "/", "/api/v1/evidence", "/nope"])
def test_head_has_the_headers_of_get_and_no_body(tmp_path: Path, exporter_factory: Any, path: str) -> None:
    spoolgen.write_rank(tmp_path, "job", 0)
    exp = exporter_factory(tmp_path, poll_interval=3600)
    wait_for(lambda: exp.app.exporter.polls >= 2, timeout=10, what="the poll loop's first poll")
    for extra in ({}, {"Accept-Encoding": "gzip"}):
        get_status, get_headers, get_body = _get(exp.app.port, path, **extra)
        # Both on one kept-alive connection: a body after HEAD would be read as the start of the GET's answer.
        conn = http.client.HTTPConnection("127.0.0.1", exp.app.port, timeout=10)
        try:
            conn.request("HEAD", path, headers=extra)
            head = conn.getresponse()
            assert head.read() == b""
            conn.request("GET", path, headers=extra)
            after = conn.getresponse()
            assert after.status == get_status and after.read() == get_body
        finally:
            conn.close()
        head_headers = {k.lower(): v for k, v in head.getheaders()}
        assert head.status == get_status
        assert head_headers["content-length"] == str(len(get_body)) == get_headers["content-length"]
        assert head_headers["content-type"] == get_headers["content-type"]
        assert head_headers.get("content-encoding") == get_headers.get("content-encoding")


def test_name_filter_returns_only_those_families(tmp_path: Path, exporter_factory: Any) -> None:
    spoolgen.write_rank(tmp_path, "job", 0, pgs=2)
    spoolgen.write_rank(tmp_path, "job", 1, pgs=2)
    exp = exporter_factory(tmp_path, poll_interval=3600)
    wanted = [n.RANK_UP, n.PG_LAST_COMPLETED_SEQ, n.HTTP_CONNECTIONS_REJECTED_TOTAL]
    query = "&".join(f"name[]={name}" for name in wanted)
    for accept in ("", OPENMETRICS):
        for extra in ({}, {"Accept-Encoding": "gzip"}):
            status, headers, body = _get(exp.app.port, f"/metrics?{query}", Accept=accept, **extra)
            assert status == 200
            text = (gzip.decompress(body) if extra else body).decode()
            if accept:
                assert headers["content-type"].startswith("application/openmetrics-text")
                assert text.endswith("# EOF\n")
            samples = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
            assert samples == set(wanted), text
            assert sample(metrics(text.replace("# EOF\n", "")), n.RANK_UP, rank="1") == 1
    # Unknown names select nothing; the full exposition is still there without the parameter.
    assert _get(exp.app.port, "/metrics?name[]=no_such_metric")[2] == b""
    assert n.BUILD_INFO.encode() in _get(exp.app.port, "/metrics?other=1")[2]


def test_client_chosen_content_types_do_not_grow_the_cache(tmp_path: Path, exporter_factory: Any) -> None:
    spoolgen.write_rank(tmp_path, "job", 0)
    exp = exporter_factory(tmp_path, poll_interval=3600)
    for minor in range(3 * server.MAX_CACHED_VARIANTS):
        status, headers, _ = _get(exp.app.port, "/metrics", Accept=f"application/openmetrics-text;version=1.0.{minor}")
        assert status == 200 and f"version=1.0.{minor};" in headers["content-type"]
    assert len(exp.app.server.httpd.renders._bodies) <= server.MAX_CACHED_VARIANTS
