"""A wedged rank's stack from py-spy (torch's ``pyspy_dump``): the parser on real py-spy output and on garbage, the
activity it makes, and how the ranks source asks for it (once per wedge, never holding a poll, a few at a time).
The live end-to-end test is tests/e2e/test_wedged_stacks_live.py.

Its unit tests are in tests/unit/test_wedged_stacks.py."""

from __future__ import annotations

from frexporter.model import FRAMES_RECORDER
from frexporter.sources import pyspy
from tests.harness import wait_for

# ------------------------------------------------------------------ the ranks source, over real sockets


def test_hung_py_spy_never_holds_a_poll_and_few_run_at_once(rig) -> None:
    r = rig({"ping": (200, b"pong"), pyspy.HANDLER: None}, ranks=4, stack_timeout=1.0)
    # Every wedged rank is asked in the end, at most MAX_CONCURRENT at a time; each fetch gives up at its timeout.
    wait_for(lambda: r.poll() and r.errors["socket_timeout"] >= 4, timeout=20, what="every fetch timed out")
    assert r.calls() == 4 and r.shared["most"] == pyspy.MAX_CONCURRENT
    # A poll waits on pings (rank_timeout at most), never on py-spy (plus scheduling slack on a shared machine).
    assert max(r.durations) < r.config.rank_timeout + 0.4, max(r.durations)
    assert all(s.activity.frames_source == FRAMES_RECORDER for s in r.poll().values())
