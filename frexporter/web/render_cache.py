"""The /metrics bodies of one poll snapshot, shared by every scrape of that poll (``RenderCache``).

A poll's metric families are collected once, and each rendering of them (whole, or a ``name[]`` selection, per
content type and encoding) once per poll, up to fixed bounds; renderings past the bounds are not kept but run one
at a time.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.metrics_core import Metric

from frexporter.web.selection import Names, select_samples

# Cached /metrics renderings per snapshot: the OpenMetrics content type carries the version the client's Accept
# header asked for (a client that accepts no text 0.0.4: web/negotiation.py), so the variants are the client's to
# choose.
MAX_CACHED_VARIANTS = 8
# ``name[]`` selections kept per poll (each with up to MAX_CACHED_VARIANTS variants, all within
# MAX_CACHED_SELECTED_BYTES): a dashboard's handful of selections renders once per poll however many ask.
# Selections past these bounds are rendered for their request only, one at a time.
MAX_CACHED_NAME_SETS = 32
MAX_CACHED_SELECTED_BYTES = 32 * 1024 * 1024
# zlib's default: a quarter of level 9's time or less, for 6 % more bytes (benchmarks/exporter_bench.py).
GZIP_LEVEL = 6

Encoder = Callable[[Any], bytes]


class _Families:
    """Already collected metric families, as the registry-like object prometheus_client's encoders take."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


@dataclass
class _PollRenders:
    """What one poll's scrapes share: the collected families and the rendered bodies."""

    key: Hashable
    families: list[Metric] | None = None
    # (names, content type, gzip) -> body
    bodies: dict[tuple[Names, str, bool], bytes] = field(default_factory=dict)
    variants: dict[Names, int] = field(default_factory=dict)  # bodies kept per selection
    selected_bytes: int = 0


class RenderCache:
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
        return encoder(_Families(select_samples(poll.families, frozenset(names))))

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
