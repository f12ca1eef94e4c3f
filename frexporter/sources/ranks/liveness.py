"""Whether a rank is alive, and what is exported of it: pure functions of a rank's values and the times.

No I/O and no clock: the ranks source passes ``now`` (wall clock, for ages) and ``mono`` (monotonic, for
intervals). A fresh heartbeat is ``ok``; a stale one with a live worker socket is ``unresponsive`` (Python is
wedged, its C++ worker server still answers); stale without one is ``down``; an ``exiting`` snapshot is a
clean exit.
"""

from __future__ import annotations

from dataclasses import dataclass

from frexporter.model import (
    RANK_DOWN,
    RANK_EXITED,
    RANK_OK,
    RANK_UNRESPONSIVE,
    UNKNOWN_ACTIVITY,
    Activity,
    PGState,
    RankState,
)
from frexporter.sources import worker_handlers
from frexporter.spool import DEFAULT_SNAPSHOT_INTERVAL, Manifest, Snapshot


@dataclass(frozen=True)
class Liveness:
    """A rank's liveness as judged at the last poll, and what it carries to the next one."""

    status: str | None = None  # model.RANK_*; None before the first judgement
    wedges: int = 0  # wedges seen so far: a py-spy answer belongs to the wedge it was asked in
    departed_at: float | None = None  # monotonic time since when the rank is down or exited


def stale(last_fresh: float | None, interval: float | None, poll_interval: float, mono: float) -> bool:
    """Whether a heartbeat last renewed at ``last_fresh`` is stale at ``mono``: none for three snapshot intervals
    (at least 1 s) and a poll. ``interval``: the rank's snapshot interval, None before its first snapshot."""
    if last_fresh is None:
        return True
    interval = interval if interval is not None else DEFAULT_SNAPSHOT_INTERVAL
    return mono - last_fresh > max(3 * interval, 1.0) + poll_interval


def judge(*, exiting: bool, stale: bool, socket_alive: bool | None, has_snapshot: bool, since_start: float,
          rank_timeout: float) -> str:
    """A rank's status (model.RANK_*). ``since_start``: seconds since the manifest's start time."""
    if exiting:
        return RANK_EXITED
    if not stale:
        return RANK_OK
    if socket_alive:
        return RANK_UNRESPONSIVE
    if socket_alive is None and not has_snapshot and since_start < rank_timeout * 3:
        return RANK_OK  # just started: the first snapshot is on its way
    return RANK_DOWN


def advance(before: Liveness, status: str, mono: float) -> Liveness:
    """The liveness after judging ``status`` at ``mono``: a new wedge counted, departure timed."""
    wedges = before.wedges + (status == RANK_UNRESPONSIVE and before.status != RANK_UNRESPONSIVE)
    if status in (RANK_OK, RANK_UNRESPONSIVE):
        departed_at = None
    else:
        departed_at = before.departed_at if before.departed_at is not None else mono
    return Liveness(status=status, wedges=wedges, departed_at=departed_at)


def same_wedge(before: str | None, status: str) -> bool:
    """Whether a wedge goes on: only then does a py-spy stack asked in it still stand."""
    return status == RANK_UNRESPONSIVE and before == RANK_UNRESPONSIVE


def exported(liveness: Liveness, mono: float, departed_grace: float) -> bool:
    """Whether the rank is exported at all: a clean exit is the normal end of a job, not an outage (dropped at
    once); a dead rank is shown down for ``departed_grace`` seconds."""
    if liveness.status == RANK_EXITED:
        return False
    return liveness.departed_at is None or mono - liveness.departed_at <= departed_grace


def rank_state(m: Manifest, snap: Snapshot | None, status: str, socket_alive: bool | None,
               pgs: tuple[PGState, ...], last_deep_read: float | None, activity: Activity | None,
               now: float) -> RankState:
    heartbeat = snap.time if snap is not None else None
    return RankState(
        job_id=m.job_id,
        rank=m.rank,
        local_rank=m.local_rank,
        world_size=m.world_size,
        hostname=m.hostname,
        pid=m.pid,
        torch_version=m.torch_version,
        gpu_uuid=m.gpu_uuid,
        status=status,
        heartbeat=heartbeat,
        heartbeat_age=max(0.0, now - heartbeat) if heartbeat is not None else None,
        socket_alive=socket_alive,
        pgs=pgs,
        recorder_errors=dict(snap.errors) if snap is not None else {},
        message=snap.message if snap is not None else "",
        last_deep_read=last_deep_read,
        socket=m.socket,
        # Only the FR handlers of the recorders its snapshot reads: an evidence bundle reads what they answer.
        handlers=worker_handlers.handlers_in_use(m.handlers, m.recorders),
        state=m.state,
        start_time=m.start_time,
        node_ranks=m.launcher.node_ranks() if m.launcher is not None else (),
        activity=activity if activity is not None else UNKNOWN_ACTIVITY,
    )
