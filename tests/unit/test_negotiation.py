"""Which format /metrics serves (frexporter/web/negotiation.py): text 0.0.4 by frexporter's encoder to every
client that accepts it, Prometheus included although it lists OpenMetrics first; OpenMetrics by prometheus_client
only to a client that accepts nothing else, or that asks with ``?format=openmetrics``; text, never an error, for
a header that does not parse. And why that loses Prometheus nothing: the OpenMetrics and text expositions of
frexporter's families hold the same series, with no exemplars, ``_created`` samples or units.

The real Prometheus' scrape: tests/e2e/test_http_hardening.py (test_prometheus_scrapes_with_gzip).
"""

from __future__ import annotations

import http.client
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text
from prometheus_client.utils import floatToGoString

from frexporter.exporter import Exporter
from frexporter.outputs import exposition
from frexporter.outputs.http_metrics import HttpServerCollector
from frexporter.outputs.identity import IdentityCollector
from frexporter.outputs.snapshot_metrics import SnapshotCollector
from frexporter.sources.ranks import RanksConfig, RanksSource
from frexporter.web import negotiation
from frexporter.web.negotiation import MediaRange, choose, format_from_query, parse_accept
from tests import spoolgen
from tests.fakes.snapshot import fixed_snapshot
from tests.harness import wait_for

# What Prometheus 2.42 sends (seen on the wire from the Debian package, 2.42.0+ds), and 3.x's default
# (scrape_protocols: OpenMetricsText1.0.0, OpenMetricsText0.0.1, PrometheusText1.0.0, PrometheusText0.0.4).
PROMETHEUS_2_42 = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                   "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
PROMETHEUS_3 = ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
                "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,"
                "text/plain;version=0.0.4;q=0.2,*/*;q=0.1")
OPENMETRICS_ONLY = "application/openmetrics-text;version=1.0.0"
OM_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def is_text(choice: tuple[Any, str]) -> bool:
    encoder, content_type = choice
    return encoder is exposition.encode and content_type == exposition.CONTENT_TYPE


def is_openmetrics(choice: tuple[Any, str]) -> bool:
    return choice[1].startswith(OM_CONTENT_TYPE)


@pytest.mark.parametrize("accept", [PROMETHEUS_2_42, PROMETHEUS_3])
def test_prometheus_is_served_text_by_the_custom_encoder(accept: str) -> None:
    assert is_text(choose(accept))


def test_a_client_that_accepts_only_openmetrics_gets_openmetrics() -> None:
    encoder, content_type = choose(OPENMETRICS_ONLY)
    assert content_type.startswith(OM_CONTENT_TYPE)
    registry = _registry(fixed_snapshot())
    assert encoder(registry) == generate_openmetrics(registry)
    # Its escaping, as prometheus_client reads it, and a version prometheus_client writes.
    assert choose(OPENMETRICS_ONLY + ";escaping=allow-utf-8")[1].endswith("escaping=allow-utf-8")
    assert "version=2.0.0" in choose("application/openmetrics-text;version=2.0.0")[1]
    assert is_openmetrics(choose("application/openmetrics-text"))


@pytest.mark.parametrize("accept", [
    "", "   ", "garbage", ",,,;;;", "*/*", "text/plain", "text/*", "text/plain;version=0.0.4", "application/json",
    "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8",  # a browser
    # prometheus_client compared "abc" with numbers: a TypeError, answered 500 before.
    "application/openmetrics-text;version=abc", "application/openmetrics-text;version=1.0.0\x00",
    "application/openmetrics-text;version=0.0.1",  # a version prometheus_client does not write
    "application/openmetrics-text;q=abc", "application/openmetrics-text;q=2", "application/openmetrics-text;q=nan",
    "application/openmetrics-text;q=-1", "*/openmetrics-text", "application/", "/openmetrics-text", "\u00e9/\u00e9",
    ";q=1", "=,=;=", "a" * 100_000,
    ",".join(["application/json"] * 1000) + "," + OPENMETRICS_ONLY,  # past MAX_MEDIA_RANGES: read no further
])
def test_anything_else_is_text_and_never_an_error(accept: str) -> None:
    assert is_text(choose(accept))


@pytest.mark.parametrize(("accept", "openmetrics"), [
    # q=0 refuses, and the most specific range decides: */* does not take back a text/plain;q=0.
    ("text/plain;q=0,*/*", True),
    ("text/plain;version=0.0.4;q=0," + OPENMETRICS_ONLY, True),
    ("text/*;q=0,application/*", True),
    ("text/plain;q=0.001," + OPENMETRICS_ONLY, False),  # accepted, however little
    ("text/plain;version=0.0.4;q=0,text/plain;q=1," + OPENMETRICS_ONLY, True),  # the versioned range is narrower
    ("text/plain;version=1.0.0," + OPENMETRICS_ONLY, True),  # another text version does not accept 0.0.4
    ("text/plain;version=1.0.0,*/*;q=0.1", False),  # */* does
    (OPENMETRICS_ONLY + ";q=0,text/plain;q=0", False),  # nothing acceptable: text all the same
    (OPENMETRICS_ONLY + ";q=0,text/plain;q=0,*/*", False),
    ("application/openmetrics-text;version=1.0.0;q=0,application/openmetrics-text,text/plain;q=0", False),
    ('APPLICATION/OpenMetrics-Text ; Version="1.0.0" ; Q=1 , text/plain;q=0', True),  # case, spaces, quotes
])
def test_q_values_decide_what_is_acceptable(accept: str, openmetrics: bool) -> None:
    choice = choose(accept)
    assert is_openmetrics(choice) if openmetrics else is_text(choice), choice[1]


def test_the_format_parameter_overrides_the_accept_header() -> None:
    for accept in (PROMETHEUS_2_42, "", "garbage", "text/plain"):
        encoder, content_type = choose(accept, negotiation.OPENMETRICS)
        assert content_type.startswith(OM_CONTENT_TYPE) and encoder is not exposition.encode
    assert choose(OPENMETRICS_ONLY + ";escaping=allow-utf-8", negotiation.OPENMETRICS)[1].endswith("allow-utf-8")
    assert is_text(choose(OPENMETRICS_ONLY, negotiation.TEXT))
    assert format_from_query("") == (None, "")
    assert format_from_query("name[]=up&format=openmetrics") == ("openmetrics", "")
    assert format_from_query("format=text&format=text") == ("text", "")
    assert format_from_query("format=") == (None, "")  # blank, as if left out
    for bad in ("format=xml", "format=text&format=openmetrics", "format=OpenMetrics"):
        assert format_from_query(bad)[1], bad
    assert "query parameters" in format_from_query("&".join(["a=1"] * 2000))[1]


def test_accept_parsing() -> None:
    assert parse_accept(PROMETHEUS_2_42) == [
        MediaRange("application", "openmetrics-text", (("version", "1.0.0"),), 1.0),
        MediaRange("application", "openmetrics-text", (("version", "0.0.1"),), 0.75),
        MediaRange("text", "plain", (("version", "0.0.4"),), 0.5),
        MediaRange("*", "*", (), 0.1),
    ]
    # Parameters after q are accept extensions; a malformed parameter is skipped, a malformed q drops the range.
    assert parse_accept("text/plain;q=0.5;version=9, text/html;junk;charset=UTF-8, a/b;q=x") == [
        MediaRange("text", "plain", (), 0.5),
        MediaRange("text", "html", (("charset", "UTF-8"),), 1.0),
    ]


# ---------------------------------------------------------------- what Prometheus would lose: nothing


def _registry(snapshot: Any) -> CollectorRegistry:
    """The families /metrics serves (web/server.py registers these), over ``snapshot``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snapshot))
    registry.register(IdentityCollector({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "POD_NAME": "p", "NODE_NAME": "n"}))
    registry.register(HttpServerCollector(lambda: 3))
    return registry


def _series(families: Any) -> list[tuple[str, tuple[tuple[str, str], ...], str, Any]]:
    # Timestamps as seconds: the OpenMetrics parser gives a Timestamp, the text one a float (the gloo arrivals
    # are stamped: sources/arrivals.py).
    return sorted((s.name, tuple(sorted(s.labels.items())), floatToGoString(s.value),
                   None if s.timestamp is None else float(s.timestamp))
                  for family in families for s in family.samples)


def _many_ranks(tmp_path: Path) -> Any:
    for rank in range(8):
        spoolgen.write_rank(tmp_path, "job", rank, pgs=3, world=8)
    exporter = Exporter([(RanksSource(RanksConfig(str(tmp_path))), 1.0)])
    exporter.poll_once()
    return exporter.snapshot


@pytest.mark.parametrize("which", ["golden", "ranks"])
def test_openmetrics_would_carry_nothing_more_than_text(which: str, tmp_path: Path) -> None:
    registry = _registry(fixed_snapshot() if which == "golden" else _many_ranks(tmp_path))
    families: list[Metric] = list(registry.collect())
    # What only OpenMetrics carries: none of it is in frexporter's families. If this fails, a family now needs
    # OpenMetrics (an exemplar, a created timestamp, a unit, an info or stateset family): rethink negotiation.py.
    assert not [s for f in families for s in f.samples if s.exemplar is not None]
    assert not [s.name for f in families for s in f.samples if s.name.endswith("_created")]
    assert not [f.name for f in families if f.unit]
    assert {f.type for f in families} <= {"counter", "gauge", "histogram"}
    text = exposition.encode(registry).decode()
    assert text.encode() == generate_latest(registry)  # the custom encoder's golden reference
    openmetrics_text = generate_openmetrics(registry).decode()
    assert "_created" not in openmetrics_text and "# UNIT" not in openmetrics_text
    # Prometheus stores the same series, values and timestamps from either.
    assert _series(parse_openmetrics(openmetrics_text)) == _series(parse_text(text))
    assert len(_series(parse_text(text))) > 50


# ---------------------------------------------------------------- served over HTTP


def _get(port: int, path: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def test_prometheus_gets_the_custom_encoders_bytes(tmp_path: Path, exporter_factory: Any) -> None:
    for rank in range(4):
        spoolgen.write_rank(tmp_path, "job", rank, pgs=3)
    exp = exporter_factory(tmp_path, poll_interval=3600)  # one snapshot for the whole test
    wait_for(lambda: exp.app.exporter.polls >= 2, timeout=10, what="the poll loop's first poll")
    port, registry = exp.app.port, exp.app.server.httpd.registry
    status, headers, body = _get(port, "/metrics", Accept=PROMETHEUS_2_42, **{"User-Agent": "Prometheus/2.42.0"})
    assert status == 200 and headers["content-type"] == exposition.CONTENT_TYPE
    assert headers["vary"] == "Accept, Accept-Encoding"
    assert body == exposition.encode(registry) == generate_latest(registry)
    # Forced, or to a client that takes nothing else: prometheus_client's OpenMetrics.
    for path, accept in (("/metrics?format=openmetrics", PROMETHEUS_2_42), ("/metrics", OPENMETRICS_ONLY)):
        status, headers, body = _get(port, path, Accept=accept)
        assert status == 200 and headers["content-type"].startswith(OM_CONTENT_TYPE)
        assert body == generate_openmetrics(registry) and body.endswith(b"# EOF\n")
    status, headers, body = _get(port, "/metrics?format=xml")
    assert status == 400 and b"format=" in body


@pytest.mark.parametrize("accept", ["application/openmetrics-text;version=abc", "\u00ff\u00fe", "*/*;q=x", ","])
def test_a_bad_accept_header_is_served_text_not_500(tmp_path: Path, exporter_factory: Any, accept: str) -> None:
    spoolgen.write_rank(tmp_path, "job", 0)
    exp = exporter_factory(tmp_path, poll_interval=3600)
    status, headers, body = _get(exp.app.port, "/metrics", Accept=accept)
    assert (status, headers["content-type"]) == (200, exposition.CONTENT_TYPE), body[:200]
