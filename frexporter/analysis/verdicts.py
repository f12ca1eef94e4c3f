"""The verdict engine: who is stuck, where, why, and how much watchdog budget is left (pure, no I/O).

``evaluate(ranks, now, config, gpus=None)`` takes ``RankState`` objects from any source and
returns ``Verdict`` objects in a deterministic order:

- one node's snapshot (``complete_view=False``): PG members on other nodes are
  simply not seen and never blamed. When every observed member joined and the
  collective is stuck, the verdict is ``stalled`` naming this node's ranks, with
  the unseen members in ``details["unobserved_ranks"]``: from one node a missing
  rank elsewhere and a stalled network look the same, so the cross-node view
  (Prometheus rules, ``analyze --prometheus``) must decide.
- a whole job rebuilt from Prometheus series, or FR dump files
  (``complete_view=True``): a member with no state at all is as good as one that
  never joined, so it is blamed (``details["unobserved_ranks"]`` says it had no data).

Metrics carry no in-flight entries, only a count and the oldest start time:
``with_oldest_start`` turns those into one synthetic entry with op ``""`` (the
op is then unknown and mismatches cannot be judged, but missing ranks and
budgets can). How findings become root causes: see ``findings`` and ``graph``.

Besides hangs: ``straggler`` verdicts from the per-rank lateness scores in the
model (``straggler``), and, when ``evaluate`` gets the node's ``GpuReading``,
GPU facts attached to every verdict whose ranks run on its GPUs (``gpu``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from frexporter import defaults
from frexporter.analysis import text
from frexporter.analysis.absent import find_absent
from frexporter.analysis.culprit_activity import with_activity
from frexporter.analysis.findings import (
    Finding,
    FindingsConfig,
    RankKey,
    can_wait,
    condition,
    find_all,
    unique_ranks,
    wedged_seconds,
)
from frexporter.analysis.gpu import gpu_facts
from frexporter.analysis.graph import MISMATCH, PG, RANK, Cause, build, resolve
from frexporter.analysis.kinds import (
    MAX_DETAIL_RANKS,
    MISMATCH_KIND,
    MISSING_RANK,
    NO_SEQ,
    RANK_DOWN_KIND,
    RANK_UNRESPONSIVE_KIND,
    STALLED,
    STRAGGLER,
)
from frexporter.analysis.past_verdicts import (
    mismatch_evidence,
    mismatch_text,
)
from frexporter.analysis.straggler import Straggler, StragglerConfig, find_stragglers
from frexporter.model import (
    RANK_DOWN,
    RANK_OK,
    RANK_UNRESPONSIVE,
    InflightCollective,
    NodeSnapshot,
    PGState,
    RankState,
    Verdict,
)


@dataclass(frozen=True)
class VerdictConfig:
    """``stuck_after``: seconds a collective may wait before that is a verdict (also the threshold for a
    stale heartbeat to count as a wedged rank). ``complete_view``: the input holds every rank of the job
    (Prometheus, dump files), so members without state are blamed rather than ignored."""

    stuck_after: float = defaults.STUCK_AFTER
    complete_view: bool = False
    # Straggler: mean lateness above max(min_lateness, factor x the peers' median) over min_samples collectives.
    straggler_min_lateness: float = StragglerConfig.min_lateness
    straggler_factor: float = StragglerConfig.factor
    straggler_min_samples: int = StragglerConfig.min_samples


def budget_left(verdict: Verdict) -> float | None:
    """Seconds before the watchdog fires on the collective (negative once past), None if unknown."""
    if verdict.timeout_seconds is None or verdict.age_seconds is None:
        return None
    return verdict.timeout_seconds - verdict.age_seconds


def with_oldest_start(pg: PGState, oldest_start: float | None) -> PGState:
    """A PG rebuilt from metrics (count and oldest start, no entries) as the engine reads it.

    Adds one synthetic entry at ``last_completed + 1`` with op ``""``; PGs that have entries, or
    nothing in flight, or no start time come back unchanged.
    """
    if pg.inflight or oldest_start is None or pg.last_enqueued <= pg.last_completed:
        return pg
    entry = InflightCollective(seq=pg.last_completed + 1, op="", created=oldest_start,
                               timeout_seconds=pg.timeout_seconds)
    return replace(pg, inflight=(entry,))


def verdict_sort_key(v: Verdict) -> tuple[str, str, str, tuple[int, ...], int]:
    return (v.job_id, v.pg, v.kind, v.ranks, v.seq)


@dataclass
class _Context:
    findings: Sequence[Finding]
    ranks: Mapping[RankKey, RankState]
    conditions: Mapping[RankKey, str]
    now: float

    def rank(self, job_id: str, rank: int) -> RankState | None:
        return self.ranks.get((job_id, rank))

    def timing(self, indexes: Iterable[int]) -> tuple[float | None, float | None, float | None]:
        """(since, age, timeout) of the involved finding nearest to its watchdog (else the oldest)."""
        timed = [self.findings[i] for i in indexes if self.findings[i].since is not None]
        if not timed:
            return None, None, None

        def left(f: Finding) -> tuple[float, float]:
            assert f.since is not None
            age = self.now - f.since
            return (f.timeout_seconds - age if f.timeout_seconds else float("inf"), f.since)

        urgent = min(timed, key=left)
        assert urgent.since is not None
        return urgent.since, self.now - urgent.since, urgent.timeout_seconds


def _budget_used(age: float | None, timeout: float | None) -> float | None:
    return None if age is None or not timeout else age / timeout


def _host(rank: RankState | None) -> str:
    if rank is None or not rank.hostname:
        return ""
    return f" (host {rank.hostname}, pid {rank.pid})"


def _rank_evidence(rank: RankState | None, now: float) -> dict[str, Any]:
    if rank is None:
        return {}
    return {"hostname": rank.hostname, "pid": rank.pid, "status": rank.status,
            "heartbeat_age_seconds": wedged_seconds(rank, now), "socket_alive": rank.socket_alive,
            "exited": rank.exited}


def _entry_evidence(f: Finding, ctx: _Context, ranks: Iterable[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in list(ranks)[:MAX_DETAIL_RANKS]:
        state = ctx.rank(f.job_id, r)
        pg = next((p for p in state.pgs if p.name == f.pg), None) if state else None
        entry = next((e for e in pg.inflight if e.seq == f.seq), None) if pg else None
        if entry is not None:
            out[str(r)] = {"op": entry.op, "input_sizes": [list(s) for s in entry.input_sizes],
                           "output_sizes": [list(s) for s in entry.output_sizes],
                           "input_dtypes": list(entry.input_dtypes), "output_dtypes": list(entry.output_dtypes)}
    return out


class _Builder:
    """Phrases one root cause as a Verdict."""

    def __init__(self, cause: Cause, ctx: _Context) -> None:
        self.cause = cause
        self.ctx = ctx
        assert cause.anchor is not None
        self.f = ctx.findings[cause.anchor]
        involved = [cause.anchor, *cause.upstream, *cause.cycle]
        self.since, self.age, self.timeout = ctx.timing(involved)
        if self.since is None:
            self.timeout = self.f.timeout_seconds
        # PGs of a deadlock are described as such, not as collateral.
        upstream = set(cause.upstream) - set(cause.cycle)
        self.blocked = sorted({(ctx.findings[i].pg, ctx.findings[i].pg_desc) for i in upstream}
                              - {(self.f.pg, self.f.pg_desc)})

    def make(self, kind: str, summary: str, extra: Mapping[str, Any]) -> Verdict:
        details: dict[str, Any] = {"blocked_pgs": [name for name, _ in self.blocked]}
        if self.f.unobserved:
            details["unobserved_ranks"] = list(self.f.unobserved)
        if self.f.inexact:
            details["inexact_ranks"] = list(self.f.inexact)
        if self.f.p2p:
            details["seq_domain"] = "p2p"  # ``seq`` counts the PG's sends and recvs, not its collectives
        details.update(extra)
        return Verdict(kind=kind, job_id=self.f.job_id, pg=self.f.pg, pg_desc=self.f.pg_desc,
                       ranks=self.cause.culprits, waiting_ranks=self.cause.waiting, seq=self.f.seq, op=self.f.op,
                       since=self.since, age_seconds=self.age, timeout_seconds=self.timeout,
                       budget_used=_budget_used(self.age, self.timeout), summary=summary, details=details)

    @property
    def where(self) -> str:
        return f"{text.collective(self.f.op, self.f.seq)} on {text.pg_text(self.f.pg, self.f.pg_desc)}"

    def tail(self, empty_subject: str | None = None) -> str:
        """'ranks 0,1 have waited 95s (also blocking ...), 505s left before the 600s watchdog timeout'"""
        return (f"{text.waited(self.cause.waiting, self.age, empty_subject)}{text.also_blocking(self.blocked)}, "
                f"{text.budget(self.age, self.timeout)}")

    def missing_rank(self) -> Verdict:
        culprits = self.cause.culprits
        unseen = sorted(set(culprits) & set(self.f.unobserved))
        nodata = f" (no data from {text.who(unseen, capital=False)})" if unseen else ""
        summary = (f"{text.who(culprits)} {text.never_joined(self.f.op, self.f.seq)} on "
                   f"{text.pg_text(self.f.pg, self.f.pg_desc)}{nodata}; {self.tail()}.")
        hosts = {str(r): s.hostname for r in culprits[:MAX_DETAIL_RANKS] if (s := self.ctx.rank(self.f.job_id, r))}
        return self.make(MISSING_RANK, summary, {"hosts": hosts})

    def stalled(self) -> Verdict:
        f = self.f
        head = f"joined {text.collective(f.op, f.seq)} and none has completed it"
        if not self.cause.waiting and self.age is not None:
            head += f" for {text.seconds(self.age)}"  # no upstream: the age is this collective's own
        tail = f"{self.tail()}." if self.cause.waiting else f"{text.budget(self.age, self.timeout)}."
        unobserved = set(f.unobserved)  # a tuple would make this quadratic in a WORLD of 100,000 ranks
        if unobserved and not unobserved & set(f.blockers):
            seen = [r for r in f.members if r not in unobserved]
            summary = (f"{text.who(seen)} of {text.pg_text(f.pg, f.pg_desc)} "
                       f"({text.agree(seen, 'the only one', 'all')} observed here) {head}; "
                       f"{text.who(f.unobserved, capital=False)} {text.agree(f.unobserved, 'is', 'are')} not "
                       f"observed here: check {text.agree(f.unobserved, 'it', 'them')} in the cross-node view; {tail}")
        else:
            summary = (f"All {len(f.members)} ranks of {text.pg_text(f.pg, f.pg_desc)} {head}: suspect the network "
                       f"or a GPU of {text.who(f.members, capital=False)}; {tail}")
        return self.make(STALLED, summary, {})

    def mismatch(self) -> Verdict:
        m = self.f.mismatch
        assert m is not None
        head = mismatch_text(m, self.f.seq, self.f.pg, self.f.pg_desc, past=False)
        evidence = mismatch_evidence(m, _entry_evidence(self.f, self.ctx, [*m.culprits, *m.majority[:1]]))
        return self.make(MISMATCH_KIND, f"{head}; {self.tail(empty_subject='they')}.", {"mismatch": evidence})

    def rank_gone(self, kind: str) -> Verdict:
        r = self.cause.culprits[0]
        state = self.ctx.rank(self.f.job_id, r)
        if state is not None and state.exited:
            # It left the job cleanly (its Python returned, or called exit) before the collective its peers wait in.
            hb = wedged_seconds(state, self.ctx.now)
            summary = (f"{text.exited_while(r, _host(state), self.cause.waiting, self.where)}: a clean exit"
                       f"{'' if hb is None else f' {text.seconds(hb)} ago'}, without completing it; "
                       f"{text.waited(self.cause.waiting, self.age)}{text.also_blocking(self.blocked)}, "
                       f"{text.budget(self.age, self.timeout)}.")
            return self.make(kind, summary, _rank_evidence(state, self.ctx.now))
        summary = (f"{_gone_text(kind, r, state, self.ctx.now)}; {text.waited(self.cause.waiting, self.age)} "
                   f"for it in {self.where}{text.also_blocking(self.blocked)}, {text.budget(self.age, self.timeout)}.")
        return self.make(kind, summary, _rank_evidence(state, self.ctx.now))

    def deadlock(self) -> Verdict:
        cycle = [self.ctx.findings[i] for i in self.cause.cycle]
        # Ranks that wait in one PG of the cycle and are waited for in another.
        in_cycle = set().union(*(f.waiting for f in cycle)) & set().union(*(f.blockers for f in cycle))
        parts = []
        for f in cycle:
            waits, missing = sorted(set(f.waiting) & in_cycle), sorted(set(f.blockers) & in_cycle)
            if waits and missing:
                parts.append(f"{text.who(waits, capital=False)} in {text.collective(f.op, f.seq)} on "
                             f"{text.pg_text(f.pg, f.pg_desc)} for {text.who(missing, capital=False)}")
        edges = [{"pg": f.pg, "pg_desc": f.pg_desc, "seq": f.seq, "op": f.op, "waiting": list(f.waiting),
                  "missing": list(f.blockers)} for f in cycle]
        waited = text.waited(set(self.cause.waiting) - in_cycle, self.age, "they")
        tail = f"{waited}{text.also_blocking(self.blocked)}, {text.budget(self.age, self.timeout)}."
        culprits = set(self.cause.culprits)
        if culprits < in_cycle:
            # Timing named who went off order first: that rank is the one to look at.
            summary = (f"{text.who(culprits)} {text.never_joined(self.f.op, self.f.seq)} on "
                       f"{text.pg_text(self.f.pg, self.f.pg_desc)}, which has waited longest, and went on into "
                       f"other collectives: a deadlock from collectives issued in different orders "
                       f"({'; '.join(parts)}); {tail}")
        else:
            summary = (f"{text.who(in_cycle)} deadlock, each waiting in a collective another never joined "
                       f"({'; '.join(parts)}): they issued collectives in different orders; {tail}")
        return self.make(MISSING_RANK, summary, {"deadlock": edges, "cycle_ranks": sorted(in_cycle)})


def _gone_text(kind: str, rank: int, state: RankState | None, now: float) -> str:
    hb = wedged_seconds(state, now) if state is not None else None
    if kind == RANK_DOWN_KIND and state is not None and state.exited:
        return f"Rank {rank}{_host(state)} exited cleanly{f' {text.seconds(hb)} ago' if hb is not None else ''}"
    if kind == RANK_DOWN_KIND:
        last = f", last heartbeat {text.seconds(hb)} ago" if hb is not None else ""
        return f"Rank {rank}{_host(state)} is down (process gone{last})"
    wedged = f" for {text.seconds(hb)}" if hb is not None else ""
    socket = ", worker socket alive" if state is not None and state.socket_alive else ""
    return f"Rank {rank}{_host(state)} is unresponsive: its Python has been wedged{wedged} (heartbeat stale{socket})"


def _lone_rank(kind: str, state: RankState, now: float) -> Verdict:
    """A down or wedged rank nobody waits for (yet)."""
    age = wedged_seconds(state, now)
    summary = f"{_gone_text(kind, state.rank, state, now)}; no collective waits on it yet."
    return Verdict(kind=kind, job_id=state.job_id, pg="", pg_desc="", ranks=(state.rank,), waiting_ranks=(),
                   seq=NO_SEQ, op="", since=state.heartbeat, age_seconds=age, timeout_seconds=None,
                   budget_used=None, summary=summary, details=_rank_evidence(state, now))


_GONE_KINDS = {RANK_DOWN: RANK_DOWN_KIND, RANK_UNRESPONSIVE: RANK_UNRESPONSIVE_KIND}


def _phrase(cause: Cause, ctx: _Context) -> Verdict | None:
    involved = [i for i in (cause.anchor, *cause.upstream, *cause.cycle) if i is not None]
    gone = _GONE_KINDS.get(ctx.conditions.get((cause.job_id, cause.culprits[0]), RANK_OK)) \
        if cause.kind == RANK and len(cause.culprits) == 1 else None
    # Down and wedged ranks are verdicts in their own right; everything else waits out stuck_after.
    if gone is None and not any(ctx.findings[i].stuck for i in involved):
        return None
    builder = _Builder(cause, ctx)
    if gone is not None:
        return builder.rank_gone(gone)
    if cause.kind == RANK:
        return builder.missing_rank()
    if cause.kind == MISMATCH:
        return builder.mismatch()
    if cause.kind == PG:
        return builder.stalled()
    return builder.deadlock()


def _straggler(s: Straggler, ctx: _Context) -> Verdict:
    worst = max(s.culprits, key=lambda r: s.lateness[r])
    many = len(s.culprits) > 1
    late = text.seconds_fine(s.lateness[worst]) + (f" (rank {worst})" if many else "")
    host = "" if many else _host(ctx.rank(s.job_id, worst))
    samples = min(s.samples[r] for r in s.culprits)
    they = text.agree(s.culprits, "it", "they")
    waits = (f", so {text.who(s.peers, capital=False)} {text.agree(s.peers, 'waits', 'wait')} for "
             f"{text.agree(s.culprits, 'it', 'them')} every time" if s.peers else "")
    summary = (f"{text.who(s.culprits)}{host} {text.agree(s.culprits, 'is a straggler', 'are stragglers')} on "
               f"{text.pg_text(s.pg, s.pg_desc)}: over the last {samples} collectives {they} enqueued each "
               f"{'up to ' if many else ''}{late} after the first local rank on average (peers: "
               f"{text.seconds_fine(s.peer_median)} median){waits}. Not a hang: look for slow input, host CPU "
               f"contention or a slowed GPU on {text.agree(s.culprits, 'that rank', 'those ranks')}.")
    details = {"lateness_seconds": {str(r): v for r, v in sorted(s.lateness.items())},
               "samples": {str(r): v for r, v in sorted(s.samples.items())},
               "peer_median_seconds": s.peer_median, "threshold_seconds": s.threshold}
    return Verdict(kind=STRAGGLER, job_id=s.job_id, pg=s.pg, pg_desc=s.pg_desc, ranks=s.culprits,
                   waiting_ranks=s.peers, seq=NO_SEQ, op="", since=None, age_seconds=None,
                   timeout_seconds=s.timeout_seconds, budget_used=None, summary=summary, details=details)


def _with_gpu_facts(v: Verdict, ranks: Mapping[RankKey, RankState], gpus: Any) -> Verdict:
    sentence, facts = gpu_facts(v.job_id, v.ranks, v.waiting_ranks, ranks, gpus, hang=v.kind != STRAGGLER)
    if not facts:
        return v
    summary = f"{v.summary} {sentence}" if sentence else v.summary
    return replace(v, summary=summary, details={**v.details, "gpu": facts})


def evaluate(ranks: Iterable[RankState], now: float, config: VerdictConfig | None = None,
             gpus: Any = None, more_findings: Sequence[Finding] = ()) -> tuple[Verdict, ...]:
    """All verdicts for these ranks at ``now`` (unix seconds), sorted by job, PG, kind, culprits.

    ``gpus``: the node's ``GpuReading`` (NVML); verdicts whose ranks run on its GPUs then carry GPU facts
    in ``details["gpu"]`` and a sentence in the summary. ``more_findings``: waits the ranks' states cannot
    show, judged with the rest (a post-mortem's sends and recvs without a counterpart, ``history``).
    """
    config = config or VerdictConfig()
    states = unique_ranks(ranks)
    conditions = {key: condition(rank, now, config.stuck_after) for key, rank in states.items()}
    findings = [*find_all(states, conditions, now, FindingsConfig(config.stuck_after, config.complete_view)),
                *more_findings]
    graph = build(findings, {key: can_wait(c) for key, c in conditions.items()})
    gone = {key for key, c in conditions.items() if c in _GONE_KINDS}
    ctx = _Context(findings, states, conditions, now)
    verdicts = [v for cause in resolve(graph, findings, gone) if (v := _phrase(cause, ctx)) is not None]
    # A down or wedged rank nobody waits for is still a verdict, unless it is itself waiting in a blocked
    # collective (wedged while waiting: a victim, already counted among the waiting ranks of the root).
    linked = {(n.job_id, n.key) for n in graph.succ if n.kind == RANK}
    verdicts += [_lone_rank(_GONE_KINDS[conditions[key]], states[key], now) for key in sorted(gone - linked)]
    # A PG with a hang verdict is described by it; its ranks' past lateness would only add noise.
    hung = {(v.job_id, v.pg) for v in verdicts if v.pg}
    straggler_config = StragglerConfig(config.straggler_min_lateness, config.straggler_factor,
                                       config.straggler_min_samples)
    verdicts += [_straggler(s, ctx) for s in find_stragglers(states, conditions, straggler_config)
                 if (s.job_id, s.pg) not in hung]
    verdicts += find_absent(states.values(), now, config.stuck_after)
    if gpus is not None:
        verdicts = [_with_gpu_facts(v, states, gpus) for v in verdicts]
    verdicts = [with_activity(v, states, now, gpus) for v in verdicts]
    return tuple(sorted(verdicts, key=verdict_sort_key))


def analyze_snapshot(snapshot: NodeSnapshot, config: VerdictConfig | None = None) -> tuple[Verdict, ...]:
    return evaluate(snapshot.ranks, snapshot.time, config, gpus=snapshot.gpus)


def make_analyzer(config: VerdictConfig | None = None) -> Callable[[NodeSnapshot], tuple[Verdict, ...]]:
    """The ``Exporter.analyzer`` callable for a node view."""
    return lambda snapshot: analyze_snapshot(snapshot, config)
