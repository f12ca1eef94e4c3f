"""Text from ranks, dumps and servers, made safe for the places it goes (pure, standard library only).

Two hazards, two functions:

* ``repair``: a string that is not valid Unicode text. Python hands undecodable bytes of the environment or a
  file name over as lone surrogates (``"\\udce9"``), and JSON may spell them (``"\\udc80"``); neither can be
  encoded as UTF-8, so one of them in a label value fails every ``/metrics`` render. Parsers repair each
  string where they read it and count the repair.
* ``printable``: a string bound for a log line or a terminal. Control characters (a newline forges a log
  line, an ESC sequence sets a terminal's title or clears its screen), the Unicode line and paragraph
  separators, bidirectional overrides and lone surrogates are written as Python escapes, so a value shows
  what it holds and can never start a line of its own.
"""

from __future__ import annotations

import re

REPLACEMENT = "\ufffd"
_SURROGATE = re.compile("[\ud800-\udfff]")
# C0 and C1 controls, DEL, line/paragraph separators, bidi embeddings/overrides/isolates, surrogates.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def is_valid(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (holds no lone surrogate)."""
    return _SURROGATE.search(text) is None


def repair(text: str) -> str:
    """``text`` with every lone surrogate replaced by U+FFFD; ``text`` itself when it is valid."""
    return _SURROGATE.sub(REPLACEMENT, text)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}"


def printable(text: object) -> str:
    """``str(text)`` with everything that could break or forge a line escaped (``\\n`` -> ``\\x0a``).

    Ordinary text, accents and other scripts included, is kept as it is.
    """
    s = text if isinstance(text, str) else str(text)
    return _UNPRINTABLE.sub(_escape, s)


def from_environment(value: str) -> str:
    """An environment value as valid text, the same on every machine that holds the same bytes.

    Undecodable bytes (a Latin-1 ``\\xe9`` in a UTF-8 locale reaches Python as ``"\\udce9"``) are written as
    ``\\xe9``, so two values that differ in their bytes still differ as text.
    """
    if is_valid(value):
        return value
    return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
