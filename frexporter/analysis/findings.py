"""Per process group: which collective the group is stuck at, who waits there, who never joined (pure).

A *finding* is one PG's frontier: the lowest collective seq ``s`` some live member
waits at (``s = last_completed + 1`` with something in flight). It records the
live members in flight at ``s`` (``waiting``), the observed members whose
``last_enqueued < s`` (``missing``), members whose process is gone (``down``) and
members the input has no state for at all (``unobserved``). Findings are facts
about one PG; which of them is a root cause is decided by ``graph``.

Guards that keep healthy or restarting jobs silent:

- a finding is ``stuck`` only when a waiter is known to have waited
  ``stuck_after`` seconds, from the in-flight entry's creation time until the
  read that last showed it in flight (this poll for exact values, the last deep
  read for PGs whose p2p traffic hides the collective domain). Without a start
  time (no deep read yet, no metric) nothing is stuck: a rarely used PG with an
  old ``last_progress`` must not look hung the moment it is used again.
- a PG whose ranks cannot all be in the same incarnation yields no finding: a
  live rank completed the seq others wait for, or a fresh, exact rank is more
  than one collective behind ranks that completed everything before ``s`` (they
  could not have without it). That is what a restart looks like while old and
  new state mix.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from frexporter.analysis.matching import Mismatch, find_mismatch
from frexporter.model import (
    RANK_DOWN,
    RANK_EXITED,
    RANK_OK,
    RANK_UNRESPONSIVE,
    InflightCollective,
    Members,
    PGState,
    RankList,
    RankState,
)

RankKey = tuple[str, int]  # (job_id, global rank)


@dataclass(frozen=True)
class Finding:
    job_id: str
    pg: str
    pg_desc: str
    members: tuple[int, ...] | Members
    seq: int
    op: str  # "" when no entry names it (metrics-only input)
    since: float | None  # creation of the oldest waiter's entry at the frontier
    timeout_seconds: float | None
    stuck: bool
    waiting: tuple[int, ...]  # live members in flight at seq
    missing: tuple[int, ...]  # observed members (not down) with last_enqueued < seq
    down: tuple[int, ...]  # members whose process is gone, joined or not
    unobserved: tuple[int, ...] | Members  # members with no RankState in the input
    blockers: tuple[int, ...]  # who the waiting ranks wait for
    mismatch: Mismatch | None = None
    inexact: tuple[int, ...] = ()  # members whose collective-domain values come from an older deep read
    p2p: bool = False  # a send or recv waiting for its peer (post-mortem only); ``seq`` is then the p2p seq
    threshold_seconds: float | None = None  # the wait after which this one is stuck (see pg_threshold)
    waited_seconds: float | None = None  # the longest wait the evidence proves


@dataclass(frozen=True)
class FindingsConfig:
    stuck_after: float
    complete_view: bool


@dataclass
class _Group:
    job_id: str
    name: str
    declared: tuple[int, ...] | Members  # canonical: sorted, distinct
    desc: str = ""
    states: dict[int, PGState] = field(default_factory=dict)

    @property
    def members(self) -> tuple[int, ...] | Members:
        # A packed list is canonical and answers ``in`` by bisection: when it lists every rank with state, it is
        # the answer without a copy (a tuple would take a scan per rank, quadratic in a complete view).
        if isinstance(self.declared, Members) and all(r in self.declared for r in self.states):
            return self.declared
        return tuple(sorted(set(self.declared) | set(self.states)))


def wedged_seconds(rank: RankState, now: float) -> float | None:
    if rank.heartbeat_age is not None:
        return rank.heartbeat_age
    return None if rank.heartbeat is None else now - rank.heartbeat


def condition(rank: RankState, now: float, stuck_after: float) -> str:
    """The rank's status as the engine uses it: unresponsive only once stale for ``stuck_after``."""
    if rank.status in (RANK_DOWN, RANK_EXITED):
        return rank.status
    if rank.status == RANK_UNRESPONSIVE:
        age = wedged_seconds(rank, now)
        # No age at all: trust the source, which only says "unresponsive" after seeing a stale heartbeat.
        if age is None or age >= stuck_after:
            return RANK_UNRESPONSIVE
    return RANK_OK


def can_wait(cond: str) -> bool:
    """Whether a rank in flight counts as waiting there. A wedged rank does: a rank whose Python holds
    the GIL inside a collective wait looks exactly like one wedged in its own code, and the graph tells
    them apart (a wedged rank waiting in a blocked collective is a victim, one waiting nowhere a cause)."""
    return cond in (RANK_OK, RANK_UNRESPONSIVE)


def unique_ranks(ranks: Iterable[RankState]) -> dict[RankKey, RankState]:
    out: dict[RankKey, RankState] = {}
    for rank in ranks:
        out.setdefault((rank.job_id, rank.rank), rank)  # the first report of a rank wins
    return out


class _MemberSets:
    """Canonical sorted member tuples, one id each. A whole-job view repeats a WORLD of thousands of ranks
    once per rank: normalize each distinct list once, and skip even hashing it when the very same tuple
    object comes again (the input keeps it alive for the whole evaluation, so its id() is stable)."""

    def __init__(self) -> None:
        self._by_object: dict[int, int] = {}
        self._by_value: dict[RankList, int] = {}
        self._by_canonical: dict[RankList, int] = {}
        self.canonical: list[RankList] = []

    def id_of(self, ranks: RankList) -> int:
        found = self._by_object.get(id(ranks))
        if found is None:
            found = self._by_value.get(ranks)
            if found is None:
                # The spool's member lists are canonical already; copying one of 131,072 ranks into a tuple
                # would cost 5 MB per distinct list, every poll.
                canonical = ranks if isinstance(ranks, Members) else tuple(sorted(set(ranks)))
                found = self._by_value[ranks] = self._canonical_id(canonical)
            self._by_object[id(ranks)] = found
        return found

    def _canonical_id(self, canonical: RankList) -> int:
        if canonical not in self._by_canonical:
            self._by_canonical[canonical] = len(self.canonical)
            self.canonical.append(canonical)
        return self._by_canonical[canonical]


def _groups(ranks: Mapping[RankKey, RankState]) -> list[_Group]:
    sets = _MemberSets()
    empty = sets.id_of(())
    declared: dict[tuple[str, str], set[int]] = defaultdict(set)
    for rank in ranks.values():
        for pg in rank.pgs:
            if pg.ranks:
                declared[(rank.job_id, pg.name)].add(sets.id_of(pg.ranks))
    groups: dict[tuple[str, str, int], _Group] = {}
    for rank in ranks.values():
        for pg in rank.pgs:
            members = sets.id_of(pg.ranks)
            options = declared.get((rank.job_id, pg.name), set())
            if members == empty and len(options) == 1:
                members = next(iter(options))  # a rank that lacks the PG table still reports the same group
            key = (rank.job_id, pg.name, members)
            if key not in groups:
                groups[key] = _Group(rank.job_id, pg.name, sets.canonical[members])
            group = groups[key]
            group.states.setdefault(rank.rank, pg)
            group.desc = group.desc or pg.desc
    return sorted(groups.values(), key=lambda g: (g.job_id, g.name, g.declared))


def _progress(pg: PGState | None) -> tuple[int, int]:
    # A rank that has not reported the PG has run no collective on it.
    return (0, 0) if pg is None else (pg.last_enqueued, pg.last_completed)


def _in_flight(pg: PGState | None) -> bool:
    return pg is not None and pg.last_enqueued > pg.last_completed


def _first_entry_from(pg: PGState, seq: int) -> InflightCollective | None:
    # The entry at seq itself when known; a later one only underestimates the wait, which is the safe side.
    return next((e for e in pg.inflight if e.seq >= seq), None)


def _entries_at(pg: PGState | None, seq: int) -> tuple[InflightCollective, ...]:
    return () if pg is None else tuple(e for e in pg.inflight if e.seq == seq)


def _consistent(group: _Group, seq: int, ranks: Mapping[int, RankState], cond: Mapping[int, str]) -> bool:
    for r, rank in ranks.items():
        pg = group.states.get(r)
        enqueued, completed = _progress(pg)
        if cond[r] == RANK_OK and pg is not None and completed >= seq:
            return False
        fresh = rank.status == RANK_OK and (pg is None or pg.exact)
        if fresh and enqueued < seq - 1:
            return False
    return True


def _proven_wait(pg: PGState, rank: RankState, entry: InflightCollective, now: float) -> float:
    """How long the rank is known to have waited on ``entry``. Exact values are this poll's, so until now;
    inexact ones (p2p traffic hid the collective domain) only until the deep read that showed the entry."""
    seen_at = now if pg.exact or rank.last_deep_read is None else min(now, rank.last_deep_read)
    return seen_at - entry.created


def _timing(group: _Group, ranks: Mapping[int, RankState], waiting: tuple[int, ...], seq: int,
            now: float) -> tuple[float | None, float | None, float | None]:
    """(since, timeout) of the oldest waiter, and the longest wait the evidence proves (None: no entries)."""
    oldest: tuple[float, int] | None = None
    proven: float | None = None
    for r in waiting:
        entry = _first_entry_from(group.states[r], seq)
        if entry is None:
            continue
        wait = _proven_wait(group.states[r], ranks[r], entry, now)
        proven = wait if proven is None else max(proven, wait)
        if oldest is None or (entry.created, r) < oldest:
            oldest = (entry.created, r)
    order = list(waiting) if oldest is None else [oldest[1], *waiting]
    timeout = None
    for r in order:
        entry = _first_entry_from(group.states[r], seq)
        timeout = (entry.timeout_seconds if entry is not None else None) or group.states[r].timeout_seconds
        if timeout:
            break
    return (None if oldest is None else oldest[0]), timeout or None, proven


def pg_threshold(states: Iterable[PGState], stuck_after: float) -> float:
    """The stuck threshold of a PG: the shortest its ranks' sources learned (one node's history is as good
    as another's), never above ``stuck_after``, which is also the answer where none was learned."""
    learned = [s.stuck_threshold_seconds for s in states if s.stuck_threshold_seconds is not None]
    return min([stuck_after, *learned])


def pg_ceiling(states: Iterable[PGState], stuck_after: float) -> float:
    """The threshold of a wait whose culprits are all busy computing: the shortest ceiling (the exporters'
    --stuck-after) the PG's ranks' sources set, never above ``stuck_after``, which is also the answer where
    none set one (dumps, older exporters)."""
    ceilings = [s.stuck_ceiling_seconds for s in states if s.stuck_ceiling_seconds is not None]
    return min([stuck_after, *ceilings])


def _op(entries: Mapping[int, tuple[InflightCollective, ...]], mismatch: Mismatch | None) -> str:
    named = {r: g[0].op for r, g in entries.items() if g and g[0].op}
    if mismatch is not None and mismatch.majority:
        return named.get(mismatch.majority[0], "")
    return named[min(named)] if named else ""


def _finding(group: _Group, ranks: Mapping[int, RankState], cond: Mapping[int, str], now: float,
             config: FindingsConfig) -> Finding | None:
    members = group.members
    observed = {r: ranks[r] for r in members if r in ranks}
    waiters = [r for r in observed if can_wait(cond[r]) and _in_flight(group.states.get(r))]
    # Fresh ranks set the frontier; a wedged rank's snapshot may lag, so it only does when nobody else waits.
    fresh = [r for r in waiters if cond[r] == RANK_OK] or waiters
    if not fresh:
        return None
    seq = min(_progress(group.states[r])[1] + 1 for r in fresh)
    if not _consistent(group, seq, observed, cond):
        return None
    joined = tuple(r for r in observed if r in group.states and _progress(group.states[r])[0] >= seq)
    waiting = tuple(r for r in joined if can_wait(cond[r]) and _progress(group.states[r])[1] < seq)
    joined_set = set(joined)
    missing = tuple(r for r in observed if r not in joined_set and cond[r] != RANK_DOWN)
    down = tuple(r for r in observed if cond[r] == RANK_DOWN)
    unobserved: tuple[int, ...] | Members = tuple(r for r in members if r not in observed)
    if isinstance(members, Members):  # from one node, most of a big WORLD: packed, 4 bytes a rank
        unobserved = Members.of(unobserved)
    blockers = tuple(sorted(set(missing) | set(down) | (set(unobserved) if config.complete_view else set())))
    entries = {r: _entries_at(group.states.get(r), seq) for r in joined}
    mismatch = find_mismatch(entries, len(group.declared) or None)
    since, timeout, proven = _timing(group, observed, waiting, seq, now)
    threshold = pg_threshold(group.states.values(), config.stuck_after)
    if missing and not down and not (config.complete_view and unobserved) and all(
            observed[r].activity.held_busy(now) for r in missing):
        # Every rank the others wait for is computing (a checkpoint, an evaluation), or was within
        # model.BUSY_HOLD_SECONDS: patience up to --stuck-after. A culprit that is idle, gone, wedged or blocked
        # elsewhere gets the learned threshold.
        threshold = pg_ceiling(group.states.values(), config.stuck_after)
    return Finding(
        job_id=group.job_id, pg=group.name, pg_desc=group.desc, members=members, seq=seq,
        op=_op(entries, mismatch), since=since, timeout_seconds=timeout,
        stuck=proven is not None and proven >= threshold, threshold_seconds=threshold, waited_seconds=proven,
        waiting=waiting, missing=missing, down=down, unobserved=unobserved, blockers=blockers, mismatch=mismatch,
        inexact=tuple(r for r in observed if r in group.states and not group.states[r].exact),
    )


def find_all(ranks: Mapping[RankKey, RankState], conditions: Mapping[RankKey, str], now: float,
             config: FindingsConfig) -> list[Finding]:
    """One finding per PG that has a live member in flight, in (job, pg) order."""
    out = []
    for group in _groups(ranks):
        job_ranks = {r: ranks[(group.job_id, r)] for r in group.members if (group.job_id, r) in ranks}
        cond = {r: conditions[(group.job_id, r)] for r in job_ranks}
        finding = _finding(group, job_ranks, cond, now, config)
        if finding is not None:
            out.append(finding)
    return out


def waits_in_progress(ranks: Iterable[RankState], now: float, config: FindingsConfig) -> list[Finding]:
    """Waits that are not stuck yet (below their PG's threshold): what a view shows instead of "nothing"."""
    states = unique_ranks(ranks)
    conditions = {key: condition(rank, now, config.stuck_after) for key, rank in states.items()}
    return [f for f in find_all(states, conditions, now, config)
            if not f.stuck and f.waiting and f.waited_seconds is not None]
