"""``rank_absent``: ranks that should report and do not, while present ranks wait for them (a node's view, from
its launcher's facts; or a whole job's view, from Prometheus, against its world size)."""

from __future__ import annotations

from collections.abc import Iterable

from frexporter.analysis import text
from frexporter.analysis.kinds import NO_SEQ, RANK_ABSENT, STARTING
from frexporter.model import RankState, Verdict

MAX_EXPANDED_WORLD = 1 << 17  # a world size beyond any real job is not expanded into its ranks


def find_absent_in_world(ranks: Iterable[RankState]) -> list[Verdict]:
    """``rank_absent`` for a view that holds every reporting rank of a job (Prometheus): the ranks below the
    job's world size that report nothing; every reporting rank that is up waits for them (or soon will)."""
    jobs: dict[str, list[RankState]] = {}
    for r in ranks:
        jobs.setdefault(r.job_id, []).append(r)
    out = []
    for job_id, members in sorted(jobs.items()):
        world = max(r.world_size for r in members)
        if world > MAX_EXPANDED_WORLD:
            continue
        present = {r.rank for r in members}
        absent = tuple(r for r in range(world) if r not in present)
        if not absent:
            continue
        waiting = tuple(sorted(r.rank for r in members if r.up))
        summary = text.absent_in_world(absent, job_id, len(present), world, waiting)
        out.append(Verdict(kind=RANK_ABSENT, job_id=job_id, pg="", pg_desc="", ranks=absent, waiting_ranks=waiting,
                           seq=NO_SEQ, op="", since=None, age_seconds=None, timeout_seconds=None,
                           budget_used=None, summary=summary, details={"world_size": world}))
    return out


def find_absent(ranks: Iterable[RankState], now: float, stuck_after: float) -> list[Verdict]:
    """``rank_absent``: per job, the ranks its launcher started on this node (``RankState.node_ranks`` of any
    rank of it) that have no state here, while a present rank has waited for them ``stuck_after`` or more:
    in init_process_group (state ``starting``), or in a collective of a PG that counts them among its members.
    Without such a wait an absent rank is no hang (a rank that exited cleanly is dropped from the view too)."""
    jobs: dict[str, list[RankState]] = {}
    for r in ranks:
        jobs.setdefault(r.job_id, []).append(r)
    out = []
    for job_id, members in sorted(jobs.items()):
        present = {r.rank for r in members}
        expected = {n for r in members for n in r.node_ranks}
        absent = tuple(sorted(expected - present))
        if not absent:
            continue
        waits: dict[int, float] = {}  # waiting rank -> since (unix seconds)
        where: set[str] = set()
        for r in members:
            if not r.up:
                continue
            if r.state == STARTING and r.start_time > 0 and now - r.start_time >= stuck_after:
                waits[r.rank] = r.start_time
                where.add("init_process_group")
                continue
            for pg in r.pgs:
                if pg.last_enqueued <= pg.last_completed or not any(a in pg.ranks for a in absent):
                    continue
                oldest = pg.oldest_inflight
                since = oldest.created if oldest is not None else pg.last_progress
                if since is not None and now - since >= stuck_after:
                    waits[r.rank] = min(since, waits.get(r.rank, since))
                    where.add("a collective")
        if not waits:
            continue
        since = min(waits.values())
        age = max(0.0, now - since)
        waiting = tuple(sorted(waits))
        summary = text.absent_on_node(absent, expected, waiting, age, where)
        out.append(Verdict(kind=RANK_ABSENT, job_id=job_id, pg="", pg_desc="", ranks=absent, waiting_ranks=waiting,
                           seq=NO_SEQ, op="", since=since, age_seconds=age, timeout_seconds=None,
                           budget_used=None, summary=summary,
                           details={"expected_ranks": sorted(expected), "waiting_in": sorted(where)}))
    return out
