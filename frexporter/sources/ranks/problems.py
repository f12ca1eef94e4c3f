"""What a poll of the ranks source counted without failing, and its warnings, rate-limited per reason."""

from __future__ import annotations

import logging
from collections.abc import Callable

from frexporter.ratelimit import LogLimiter

# Warnings logged per reason and window; the rest are counted as ever (frexporter_source_errors_total stays
# exact) and summed up in one line when the window ends: a spool full of junk must not fill the log too.
LOG_BURST = 10
LOG_WINDOW = 60.0
SUMMARY = ("%(count)d more like these (%(key)s) in the last %(seconds).0f s were not logged; "
           "frexporter_source_errors_total counts every one")


class Problems:
    """The (reason, message) of every problem counted in this poll, for ``Reading.problems``."""

    def __init__(self, logger: logging.Logger, monotonic: Callable[[], float]) -> None:
        self.logs = LogLimiter(logger, burst=LOG_BURST, window=LOG_WINDOW, monotonic=monotonic, summary=SUMMARY)
        self.items: list[tuple[str, str]] = []

    def start_poll(self) -> None:
        self.items = []
        self.logs.flush()

    def count(self, reason: str, message: str) -> None:
        """Counted; the caller logs it its own way (or not)."""
        self.items.append((reason, message))

    def add(self, reason: str, message: str) -> None:
        """Counted and logged (rate-limited per reason)."""
        self.items.append((reason, message))
        self.logs.warning(reason, "%s (reason=%s)", message, reason)
