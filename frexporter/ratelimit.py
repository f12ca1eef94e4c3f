"""Log lines rate-limited per key, the rest counted and summed up in one line when their window ends.

Whoever can write the spool, answer on a rank's socket or send requests decides how often a warning would
otherwise be logged. The events themselves stay counted where they are counted (frexporter_source_errors_total);
only their lines are limited. One class for every such log: the ranks source's warnings, the evidence writer's,
the verdict lines and the web server's internal errors, each with its own burst and window.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

# The summary line: %(count)d lines held back under %(key)s in the last %(seconds).0f s.
DEFAULT_SUMMARY = "%(count)d more %(key)s messages suppressed in the last %(seconds).0f s"


class LogLimiter:
    """At most ``burst`` lines per key per ``window`` seconds; the lines past it are counted and summed up in one
    line (``summary``) once the window is over: at the key's next line, or at ``flush()``.

    Keys must be bounded (reasons, fixed strings): each one holds a window until it is summed up. Thread-safe:
    the evidence writer's is shared by its capture thread and the poll loop. ``monotonic`` is injectable so that a
    test's fake clock can end a window.
    """

    def __init__(self, logger: logging.Logger, burst: int = 1, window: float = 300.0,
                 monotonic: Callable[[], float] = time.monotonic, summary: str = DEFAULT_SUMMARY) -> None:
        self.logger = logger
        self.burst = burst
        self.window = window
        self.summary = summary
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._windows: dict[str, list[float]] = {}  # key -> [window start, logged, held back]

    def log(self, level: int, key: str, msg: str, *args: object, exc_info: bool = False) -> None:
        now = self._monotonic()
        with self._lock:
            window = self._windows.get(key)
            if window is not None and now - window[0] >= self.window:
                self._summarise(key, window, now)
                window = None
            if window is None:
                window = self._windows[key] = [now, 0, 0]
            emit = window[1] < self.burst
            window[1 if emit else 2] += 1
        if emit:
            self.logger.log(level, msg, *args, exc_info=exc_info)

    def warning(self, key: str, msg: str, *args: object) -> None:
        self.log(logging.WARNING, key, msg, *args)

    def flush(self, force: bool = False) -> None:
        """Sum up the windows that are over (every window with ``force``, as when the process stops)."""
        now = self._monotonic()
        with self._lock:
            for key, window in list(self._windows.items()):
                if force or now - window[0] >= self.window:
                    self._summarise(key, window, now)
                    del self._windows[key]

    def _summarise(self, key: str, window: list[float], now: float) -> None:
        if window[2]:
            self.logger.warning(self.summary, {"count": window[2], "key": key, "seconds": now - window[0]})
