"""What both halves of test_busy_routing.py use: the Alertmanager block of docs/detection.md."""

from __future__ import annotations

import re

from tests.harness import REPO

DOCS = REPO / "docs" / "detection.md"


def doc_block() -> str:
    match = re.search(r"<!-- check: busy-routing -->\n```yaml\n(.*?)\n```", DOCS.read_text(), re.S)
    assert match, "docs/detection.md has no block marked busy-routing"
    return match.group(1)
