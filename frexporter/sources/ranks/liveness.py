"""Whether a rank is alive, and what is exported of it: pure functions of a rank's values and the times.

No I/O and no clock: the ranks source passes ``now`` (wall clock, for ages) and ``mono`` (monotonic, for
intervals). A fresh heartbeat is ``ok``; a stale one with a live worker socket is ``unresponsive`` (Python is
wedged, its C++ worker server still answers); stale without one is ``down``; an ``exiting`` snapshot is a
clean exit.

A rank that departed (exited, or down past ``departed_grace``) is dropped from the view, unless local peers still
wait for it (``held``): then it stays, down, as the culprit of their wait, never leaving them to be blamed.
"""

from __future__ import annotations

from collections.abc import Iterable
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


# Seconds a peer must be seen still waiting after a departed rank's last word (its goodbye, or its last
# snapshot) before the rank is held as that wait's culprit, where its own counters cannot settle it (a crash, a
# goodbye without counters, a collective it entered but did not complete): had the rank completed the collective,
# its peers would have completed it too within milliseconds (an NCCL watchdog notices within a fraction of this).
EXIT_EVIDENCE_SECONDS = 2.0


@dataclass(frozen=True)
class Hold:
    """Why a departed rank stays in the view: ``waiters`` (local ranks of its job) wait in ``op`` #``seq`` of PG
    ``pg``, which it never completed. ``timeout``: the longest watchdog timeout of those waits (None: unknown)."""

    waiters: tuple[int, ...]
    pg: str
    seq: int
    op: str
    timeout: float | None


def held(departed: RankState, final: bool, peers: Iterable[RankState]) -> Hold | None:
    """Whether live ``peers`` wait for the ``departed`` rank (its PGs as last known), and where.

    A peer of the same job waits for it in PG P when the peer is up, in flight at its frontier ``s`` of P
    (``last_completed + 1``), and the departed rank is a member of P that never completed ``s``. That settles it
    at once when the departed rank's counters are ``final`` (its goodbye carried them) and exact, and it never
    enqueued ``s``: it never will. Otherwise (it entered ``s`` and left, or its counters may be a snapshot old)
    only when the peer is seen still waiting EXIT_EVIDENCE_SECONDS after the departed rank's last word.
    """
    mine = {pg.name: pg for pg in departed.pgs if not pg.ranks or departed.rank in pg.ranks}
    last_word = departed.heartbeat
    found: dict[tuple[str, int], tuple[tuple[int, ...], str, float | None]] = {}  # (pg, seq) -> waiters, op, timeout
    for peer in peers:
        if peer.job_id != departed.job_id or peer.rank == departed.rank or not peer.up:
            continue
        for pg in peer.pgs:
            own = mine.get(pg.name)
            if own is None or pg.last_enqueued <= pg.last_completed:
                continue
            if pg.ranks and departed.rank not in pg.ranks:
                continue
            seq = pg.last_completed + 1
            if own.last_completed >= seq:
                continue  # it completed the collective the peer is at: the peer does not wait for it
            settled = final and own.exact and own.last_enqueued < seq
            # When the peer was last seen in flight there: its snapshot's time, or the deep read's where its values
            # come from one (p2p traffic hides the collective domain; a wedged rank's snapshot is stale).
            seen = peer.heartbeat
            if not pg.exact or (peer.status == RANK_UNRESPONSIVE and peer.last_deep_read is not None):
                seen = peer.last_deep_read
            if not settled and (last_word is None or seen is None or seen < last_word + EXIT_EVIDENCE_SECONDS):
                continue
            entry = next((e for e in pg.inflight if e.seq == seq), None)
            timeout = (entry.timeout_seconds if entry is not None else None) or pg.timeout_seconds
            waiters, op, longest = found.get((pg.name, seq), ((), "", None))
            if timeout is not None and (longest is None or timeout > longest):
                longest = timeout
            found[(pg.name, seq)] = ((*waiters, peer.rank), op or (entry.op if entry is not None else ""), longest)
    if not found:
        return None
    # The wait most peers share (then the oldest collective, the PG by name) is the one to name.
    (pg_name, seq), (waiters, op, timeout) = min(found.items(), key=lambda kv: (-len(kv[1][0]), kv[0][1], kv[0][0]))
    return Hold(waiters=tuple(sorted(waiters)), pg=pg_name, seq=seq, op=op, timeout=timeout)


def holds(liveness: Liveness, hold: Hold | None, mono: float, departed_grace: float) -> bool:
    """Whether a departed rank that ``hold`` says is waited for stays in the view at ``mono``: for as long as the
    wait lasts, at most the wait's watchdog timeout (after which torch aborts the waiters) or ``departed_grace``,
    whichever is longer, after the rank departed."""
    if hold is None or liveness.departed_at is None:
        return False
    return mono - liveness.departed_at <= max(departed_grace, hold.timeout or 0.0)


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
