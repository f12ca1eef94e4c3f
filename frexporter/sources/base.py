"""What every source shares: a failure that carries a metric-friendly reason."""

from __future__ import annotations


class SourceError(Exception):
    """A source could not produce its reading.

    ``reason`` is a short, bounded-cardinality token (it becomes the ``reason``
    label of ``frexporter_source_errors_total``); the message is for humans.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
