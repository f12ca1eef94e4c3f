"""What both halves of test_helm.py use: the blocks of docs/kubernetes.md that tests check."""

from __future__ import annotations

import re

from tests.harness import REPO

DOCS = REPO / "docs" / "kubernetes.md"


def doc_block(check: str) -> str:
    """The fenced block right after ``<!-- check: NAME -->`` in docs/kubernetes.md."""
    match = re.search(r"<!-- check: " + re.escape(check) + r" -->\n```[a-z]*\n(.*?)\n```", DOCS.read_text(), re.S)
    assert match, f"docs/kubernetes.md has no block marked {check!r}"
    return match.group(1)
