"""The one failure shape of frexporter: a bounded ``reason`` and a message for people.

``reason`` is a short token from the fixed set in ``frexporter.reasons`` (it becomes the ``reason``
label of ``frexporter_source_errors_total``), so a caller counts any of these failures the same way
without converting one kind into another. Pass the constant, never a literal: tests/unit/test_reasons.py
fails on a literal.
"""

from __future__ import annotations


class FrexporterError(Exception):
    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(message or reason)
        self.reason = reason
