"""A settable clock: a test moves ``now``; the exporter, source or tracker that takes the clock calls it."""

from __future__ import annotations

import time


class Clock:
    def __init__(self, now: float | None = None) -> None:
        """``now`` defaults to the wall clock's time at construction."""
        self.now = time.time() if now is None else now

    def __call__(self) -> float:
        return self.now
