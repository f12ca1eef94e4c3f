"""What a verdict's culprits are doing: their activity (from the snapshot's ranks) and one line of summary."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from frexporter.analysis import text
from frexporter.model import (
    ACTIVITY_BUSY,
    ACTIVITY_GONE,
    ACTIVITY_IDLE,
    ACTIVITY_IN_COLLECTIVE,
    ACTIVITY_UNKNOWN,
    ACTIVITY_WEDGED,
    FRAMES_PYSPY,
    UNKNOWN_ACTIVITY,
    Activity,
    RankState,
)

if TYPE_CHECKING:
    from frexporter.analysis.verdicts import Verdict

MAX_ACTIVITY_RANKS = 16  # culprits per verdict given an activity (the rest are in the ranks' own objects)
MAX_ACTIVITY_LINES = 2  # culprits described in the summary line


def where(activity: Activity) -> str:
    """'save_checkpoint (train.py:142)' for the headline frame; '' without a stack."""
    frame = activity.headline()
    if frame is None:
        return ""
    function, path, line = frame
    if not path:  # from a metric label: the function alone
        return function
    return f"{function} ({path.replace(chr(92), '/').rsplit('/', 1)[-1]}:{line})"


def describe(rank: int, activity: Activity, now: float) -> str:
    """'rank 3 has been busy in save_checkpoint (train.py:142) for 95s, 100 % CPU'; '' when nothing is known."""
    at = where(activity)
    cpu = f", {round(activity.cpu_percent)} % CPU" if activity.cpu_percent is not None else ""
    span = f" for {text.seconds(now - activity.since)}" if activity.since is not None else ""
    if activity.state == ACTIVITY_WEDGED:
        if activity.frames_source == FRAMES_PYSPY:
            where_now = f" in {at}" if at else " (no Python frames in its main thread)"
            return (f"rank {rank} has been wedged{span}: its Python cannot run (the GIL held in native code); py-spy "
                    f"finds its main thread{where_now}")
        last = f" (its last sample was in {at})" if at else ""
        return (f"rank {rank} is wedged: its Python cannot run (the GIL held in native code), so it cannot "
                f"sample itself{last}; with --evidence-stacks py-spy reads its stack for the exporter and the "
                "evidence bundle")
    if activity.state == ACTIVITY_IN_COLLECTIVE:
        return f"rank {rank} has been waiting in a collective{span}" + (f", called from {at}" if at else "")
    if activity.state in (ACTIVITY_BUSY, ACTIVITY_IDLE) and at:
        return f"rank {rank} has been {activity.state} in {at}{span}{cpu}"
    return ""


def with_activity(verdict: Verdict, ranks: Mapping[tuple[str, int], RankState], now: float) -> Verdict:
    """The verdict with its culprits' activities and, where one says something, a summary line about it."""
    acts: dict[str, Activity] = {}
    for rank in verdict.ranks[:MAX_ACTIVITY_RANKS]:
        state = ranks.get((verdict.job_id, rank))
        acts[str(rank)] = state.activity if state is not None else UNKNOWN_ACTIVITY
    lines = [line for rank, act in list(acts.items())[:MAX_ACTIVITY_LINES]
             if act.state not in (ACTIVITY_UNKNOWN, ACTIVITY_GONE) and (line := describe(int(rank), act, now))]
    summary = verdict.summary
    if lines:
        summary = f"{summary} {'; '.join(lines)[:1].upper()}{'; '.join(lines)[1:]}."
    return replace(verdict, activity=acts, summary=summary)
