"""The web config's ``rate_limit`` at run time: one token bucket over every request the server answers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from frexporter.web.config_model import RateLimit


class TokenBucket:
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
