"""Which exposition format a /metrics request gets (``choose``): Prometheus' text format 0.0.4, written by
frexporter's own encoder (``outputs/exposition.py``), to every client that accepts it, whatever order it lists
its types in; OpenMetrics, written by prometheus_client, to a client that accepts OpenMetrics and not text 0.0.4,
or that asks for it with ``?format=openmetrics``. Pure.

Why text, although Prometheus lists OpenMetrics first (2.42 sends ``application/openmetrics-text;version=1.0.0,
application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1``): prometheus_client's
OpenMetrics encoder takes about four times as long as the text encoder (benchmarks/exporter_bench.py), and
frexporter's families hold nothing only OpenMetrics can carry: no exemplars, no ``_created`` samples, no units,
and their series names (``_total``, ``_info``) are the same in both formats, so Prometheus stores the same series
whichever it gets (tests/unit/test_negotiation.py checks all of this on the golden snapshot). The q-values are a
client's relative preference; the server may answer with any type the client accepts (RFC 9110, 12.5.1), as
Go's promhttp does, which serves text unless OpenMetrics is enabled in the exporter. The q-values decide what is
acceptable: a type is acceptable when the most specific media range that matches it has q > 0, so ``q=0``
refuses a type even where ``*/*`` would take it.

A header that names nothing we serve, or that does not parse, gets text 0.0.4 (what prometheus_client and
promhttp answer), never an error.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import parse_qs

from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics import exposition as om_exposition

from frexporter.outputs import exposition
from frexporter.web.selection import MAX_QUERY_FIELDS

Encoder = Callable[[Any], bytes]

# The query parameter that chooses the format whatever the Accept header says, and its values. A scraper that
# needs OpenMetrics but also lists text (Prometheus before 2.49 cannot change its Accept header) sets it in its
# scrape config: ``params: {format: [openmetrics]}``.
FORMAT_PARAM = "format"
OPENMETRICS = "openmetrics"
TEXT = "text"
FORMATS = (TEXT, OPENMETRICS)
# Media ranges read from one Accept header at most; a longer list is read no further (http.server bounds the
# header to 64 KiB, this bounds the work on it).
MAX_MEDIA_RANGES = 64

_TEXT_TYPE = ("text", "plain")
_TEXT_VERSION = "0.0.4"
_OM_TYPE = ("application", "openmetrics-text")
_OM_VERSION = "1.0.0"
_VERSION = re.compile(r"[0-9]{1,6}(?:\.[0-9]{1,6}){0,3}")


@dataclass(frozen=True)
class MediaRange:
    """One entry of an Accept header: type and subtype lower-cased (``*`` for a wildcard), its parameters other
    than q (keys lower-cased, values unquoted), and its q-value."""

    type: str
    subtype: str
    params: tuple[tuple[str, str], ...]
    q: float

    def param(self, key: str) -> str | None:
        for k, v in self.params:
            if k == key:
                return v
        return None

    def header(self) -> str:
        """The range as an Accept header entry, without its q."""
        return ";".join([f"{self.type}/{self.subtype}", *(f"{k}={v}" for k, v in self.params)])


def _token(text: str) -> bool:
    return bool(text) and all(c.isascii() and (c.isalnum() or c in "!#$%&'*+-.^_`|~") for c in text)


def _qvalue(text: str) -> float | None:
    # RFC 9110 allows 0 to 1 with three decimals at most; read leniently (any float in [0, 1]), so that a
    # sloppy client is not misread, but nothing else: a range whose q is not a number is ignored.
    try:
        q = float(text)
    except ValueError:
        return None
    return q if math.isfinite(q) and 0.0 <= q <= 1.0 else None


def _media_range(entry: str) -> MediaRange | None:
    pieces = entry.split(";")
    kind, slash, subtype = pieces[0].strip().lower().partition("/")
    if not slash or not _token(kind) or not _token(subtype) or (kind == "*" and subtype != "*"):
        return None
    params: list[tuple[str, str]] = []
    q = 1.0
    for piece in pieces[1:]:
        key, equals, value = piece.partition("=")
        key = key.strip().lower()
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        if not equals or not _token(key) or not value:
            continue  # a malformed or empty parameter: ignored, the range is still read
        if key == "q":
            parsed = _qvalue(value)
            if parsed is None:
                return None
            q = parsed
            break  # what follows q are accept extensions, not media type parameters
        params.append((key, value))
    return MediaRange(kind, subtype, tuple(params), q)


def parse_accept(header: str) -> list[MediaRange]:
    """The media ranges of an Accept header, in its order; entries that do not parse are left out."""
    ranges = []
    for entry in header.split(",")[:MAX_MEDIA_RANGES]:
        parsed = _media_range(entry)
        if parsed is not None:
            ranges.append(parsed)
    return ranges


def _quality(ranges: Iterable[MediaRange], kind: str, subtype: str, version: str) -> float:
    """The q-value the client gives to ``kind/subtype;version=...``: that of the most specific range matching it
    (a range with a ``version`` matches only that version; its other parameters, such as ``escaping`` or
    ``charset``, do not narrow it); the highest among equally specific ones; 0 where none matches."""
    best: tuple[int, float] = (-1, 0.0)
    for r in ranges:
        if r.type not in ("*", kind) or r.subtype not in ("*", subtype):
            continue
        wanted = r.param("version")
        if wanted is not None and wanted != version:
            continue
        specificity = (r.type != "*") + (r.subtype != "*") + (wanted is not None)
        best = max(best, (specificity, r.q))
    return best[1]


def _openmetrics(ranges: list[MediaRange]) -> tuple[Encoder, str] | None:
    """prometheus_client's OpenMetrics encoder for the OpenMetrics version the client wants most of those it
    accepts and prometheus_client writes (and the escaping asked for, as prometheus_client reads it); OpenMetrics
    1.0.0 for a wildcard (``application/*``, ``*/*``); None where it accepts none of these."""
    named = sorted((r for r in ranges if r.q > 0 and (r.type, r.subtype) == _OM_TYPE), key=lambda r: -r.q)
    for r in named:
        version = r.param("version") or _OM_VERSION
        # Digits and dots only: prometheus_client compares the version as numbers (other text raised a
        # TypeError: a 500) and writes it into the Content-Type.
        if not _VERSION.fullmatch(version) or _quality(ranges, *_OM_TYPE, version) <= 0:
            continue
        encoder, content_type = choose_encoder(r.header())
        if content_type.startswith("application/openmetrics-text"):
            return encoder, content_type
    if _quality(ranges, *_OM_TYPE, _OM_VERSION) > 0:
        return _default_openmetrics()
    return None


def _default_openmetrics() -> tuple[Encoder, str]:
    encoder = partial(om_exposition.generate_latest, escaping=om_exposition.UNDERSCORES, version=_OM_VERSION)
    return encoder, om_exposition.CONTENT_TYPE_LATEST


def format_from_query(query: str) -> tuple[str | None, str]:
    """The request's ``format`` parameter (None where it has none), or why it is refused."""
    try:
        values = set(parse_qs(query, max_num_fields=MAX_QUERY_FIELDS).get(FORMAT_PARAM, ()))
    except ValueError:
        return None, f"more than {MAX_QUERY_FIELDS} query parameters\n"
    if not values:
        return None, ""
    if len(values) > 1 or not values <= set(FORMATS):
        return None, f"{FORMAT_PARAM}= takes one of: {', '.join(FORMATS)} (leave it out to go by the Accept header)\n"
    return values.pop(), ""


def choose(accept: str, fmt: str | None = None) -> tuple[Encoder, str]:
    """The encoder and Content-Type for a request's Accept header and its ``format`` parameter (one of FORMATS, or
    None where the request has none; the caller refuses other values)."""
    if fmt == TEXT:
        return exposition.encode, exposition.CONTENT_TYPE
    ranges = parse_accept(accept or "")
    if fmt == OPENMETRICS:
        return _openmetrics(ranges) or _default_openmetrics()
    if not ranges or _quality(ranges, *_TEXT_TYPE, _TEXT_VERSION) > 0:
        return exposition.encode, exposition.CONTENT_TYPE
    # Text 0.0.4 refused (q=0) or not named: OpenMetrics if the client takes it, else text all the same.
    return _openmetrics(ranges) or (exposition.encode, exposition.CONTENT_TYPE)
