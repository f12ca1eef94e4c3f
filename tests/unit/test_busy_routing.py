"""The Alertmanager routing of docs/detection.md ("Routing busy culprits"): busy culprits are held, the rest pages.

The docs' block passes amtool and routes as described; the e2e stack (tests/promstack.py, ``hold_busy``) uses
the same route tree, and a real Alertmanager delivers by it.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_busy_routing.py.
"""

from __future__ import annotations

import yaml

from tests.promstack import HOLD_BUSY_ROUTES, PAGE_RECEIVER
from tests.shared.busy_routing import doc_block


def test_docs_show_the_stacks_route_tree() -> None:
    route = yaml.safe_load(doc_block())["route"]
    assert route["receiver"] == PAGE_RECEIVER
    assert route["routes"] == HOLD_BUSY_ROUTES
