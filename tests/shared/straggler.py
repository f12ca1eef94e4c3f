"""What both halves of test_straggler.py use: the one straggler verdict of a poll."""

from __future__ import annotations

from typing import Any

from frexporter.analysis import STRAGGLER


def only_straggler(verdicts: Any) -> Any:
    found = [v for v in verdicts if v.kind == STRAGGLER]
    assert len(found) == 1, verdicts
    return found[0]
