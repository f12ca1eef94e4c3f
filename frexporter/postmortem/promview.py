"""A whole job's RankStates rebuilt from the answers to the queries of ``Query``: pure, no I/O and no clock.

Prometheus holds what no single node sees: every rank of every PG. Series carry no FR entries, only counts and
the oldest in-flight start, which the engine accepts through ``with_oldest_start`` (missing ranks and budgets
can be judged; mismatches cannot, they need entries).

Series with a label or value no exporter writes are left out and counted (``JobView.problems``), never guessed
at; member lists are bounded by what they expand to over all jobs.
"""

from __future__ import annotations

import enum
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from frexporter import naming as n
from frexporter.analysis.verdicts import with_oldest_start
from frexporter.model import (
    ACTIVITY_BUSY,
    ACTIVITY_STATES,
    ACTIVITY_UNKNOWN,
    BUSY_HOLD_SECONDS,
    RANK_DOWN,
    RANK_OK,
    RANK_UNRESPONSIVE,
    UNKNOWN_ACTIVITY,
    Activity,
    PGState,
    RankState,
)
from frexporter.postmortem import promseries as ps
from frexporter.postmortem.promseries import EXAMPLE_CHARS, RankKey, Sample, Source
from frexporter.spool.limits import MAX_MANIFEST_MEMBERS, MAX_PG_MEMBERS

# A heartbeat this old when scraped, on an up rank: its Python is wedged. Above the exporter's poll
# interval (<= 15 s, see frexporter.rules.yml) plus the snapshot interval, which a healthy rank can reach.
STALE_HEARTBEAT_SECONDS = 30.0
MAX_WAIT_SECONDS = 3600.0  # a mean wait inside collectives beyond this is no exporter's (it drops such waits)
MAX_WORLD_SIZE = MAX_PG_MEMBERS  # a world_size label beyond any real job is not expanded into members
# Ranks that worlds expand into over all jobs of a view: each world-spanning PG's member list and each job's
# rank list (the absent ranks of report.from_prometheus). As many as one rank's manifest may list: a
# 131,072-rank job's absent ranks and three PGs that span it. The analysis then costs ~1 KB per member (the
# verdicts' wait-for graph), so a few MB of answers claiming thousands of PGs or jobs of that size, which
# would expand into gigabytes, cost ~200 MB at most.
MAX_EXPANDED_MEMBERS = MAX_MANIFEST_MEMBERS
_PLAIN = "{metric}{sel}"
# Gloo's arrivals are stamped with their grid instant's time and read one grid period back, as the rule reads them:
# by then every node's sample of the same instant is in (frexporter/sources/arrivals.py, ARRIVAL_GRID, which this
# layer may not import: tests/unit/test_arrival_ranking.py holds the two equal).
_ONE_GRID_BACK = "{metric}{sel} offset 15s"
# Collectives a second over the rules' window: how far apart the blocks of arrivals are.
_RATE = "rate({metric}{sel}[1m])"
# Only the busy state's series: the rest say nothing of a busy hold (a rank's other states, an idle fleet's).
_BUSY_HOLD = f"max_over_time({{metric}}{{busy_sel}}[{BUSY_HOLD_SECONDS:.0f}s])"
_BY_PG = f"{n.L_JOB_ID}, {n.L_PG}"
# A PG fact each node exports (a series per node and PG, as many as the node's ranks' PGs): the rebuild keeps the
# shortest positive one of each PG, which the server computes instead of sending every node's.
_SHORTEST = f"min by ({_BY_PG}) ({{metric}}{{sel}} > 0)"
# Every PG a rank reports, a series each, valued by its signs of activity (OF_ACTIVE_PGS): its ranks' in-flight
# starts, the waits their exporters report, collective waits or arrivals where it has any, else its ranks with a
# collective in flight (0: idle).
_ACTIVITY_SIGNS = " or ".join([*(f"count by ({_BY_PG}) ({sign})" for sign in (
    f"{n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS}{{sel}}", f"{n.PG_WAIT_START_TIMESTAMP_SECONDS}{{sel}}",
    f"{n.RANK_COLLECTIVE_WAIT_SECONDS}{{sel}}",
    f"{n.RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS}{{sel}} offset 15s")),
    f"sum by ({_BY_PG}) ({{metric}}{{sel}} > bool 0)"])


class Query(enum.Enum):
    """The answers the rebuild reads, in the order they are asked: the metric each reads, and its PromQL with
    ``{sel}`` for the job's selector."""

    UP = (n.RANK_UP, _PLAIN)
    HEARTBEAT = (n.RANK_HEARTBEAT_TIMESTAMP_SECONDS, _PLAIN)
    # When each heartbeat was scraped (Prometheus' clock): staleness is judged there, not at the query time, for
    # exporters without the poll series below (older ones; asked only when one reports, see LATER).
    SCRAPED = (n.RANK_HEARTBEAT_TIMESTAMP_SECONDS, "timestamp({metric}{sel})")
    # Each exporter's node clock at the poll its last scrape shows: a heartbeat's staleness is judged there, on
    # the node's own clock. Every exporter's (the series has no job_id; one per node), used for those of the job.
    POLL = (n.POLL_TIMESTAMP_SECONDS, "{metric}")
    # And that clock now (the poll's, plus the time since the scrape on Prometheus' clock), as the rules take it:
    # every timestamp of the node is moved onto the caller's clock by the difference, so that no node's clock
    # offset (nor the caller's) ages anything.
    NODE_NOW = (n.POLL_TIMESTAMP_SECONDS, "{metric} + time() - timestamp({metric})")
    INFO = (n.RANK_INFO, _PLAIN)
    # Each PG's sizes as the nodes report them (the rebuild takes the largest).
    PG_INFO = (n.PG_INFO, f"group by ({_BY_PG}, {n.L_SIZE}) ({{metric}}{{sel}})")
    PG_TIMEOUT = (n.PG_TIMEOUT_SECONDS, _SHORTEST)
    # The exporters' learned stuck thresholds (absent from older ones: the caller's fixed one applies).
    PG_STUCK_THRESHOLD = (n.PG_STUCK_THRESHOLD_SECONDS, _SHORTEST)
    # And their ceilings (--stuck-after), the threshold of a wait on busy culprits (absent from older ones too).
    PG_STUCK_CEILING = (n.PG_STUCK_CEILING_SECONDS, _SHORTEST)
    # The largest of the PGs' ceilings (--stuck-after of analyze when not given), over every PG of the job.
    JOB_STUCK_CEILING = (n.PG_STUCK_CEILING_SECONDS, f"max by ({n.L_JOB_ID}) ({_SHORTEST})")
    # Every PG and whether it is active: those whose series OF_ACTIVE_PGS reads.
    PG_ACTIVE = (n.PG_INFLIGHT_COLLECTIVES, _ACTIVITY_SIGNS)
    PG_ENQUEUED = (n.PG_LAST_ENQUEUED_SEQ, _PLAIN)
    PG_COMPLETED = (n.PG_LAST_COMPLETED_SEQ, _PLAIN)
    PG_STARTED = (n.PG_LAST_STARTED_SEQ, _PLAIN)
    PG_INFLIGHT = (n.PG_INFLIGHT_COLLECTIVES, _PLAIN)
    PG_OLDEST = (n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS, _PLAIN)
    PG_PROGRESS = (n.PG_LAST_PROGRESS_TIMESTAMP_SECONDS, _PLAIN)
    # The waits the exporters report (a rank that has waited half its PG's stuck threshold): what the rebuild
    # reads in place of the completed seq and in-flight start where a relabel recipe dropped those.
    PG_WAIT_SEQ = (n.PG_WAIT_SEQ, _PLAIN)
    PG_WAIT_START = (n.PG_WAIT_START_TIMESTAMP_SECONDS, _PLAIN)
    # Each rank's mean wait inside a PG's collectives (exporters with --collective-waits): the straggler ranking.
    PG_WAIT = (n.RANK_COLLECTIVE_WAIT_SECONDS, _PLAIN)
    # The same where FR records no completion (gloo): each rank's mean call time at the PG's current block.
    PG_ARRIVAL = (n.RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS, _ONE_GRID_BACK)
    # Each rank's collectives a second in the PG, which the rule divides half a block of arrivals by.
    PG_RATE = (n.PG_LAST_ENQUEUED_SEQ, _RATE)
    VERDICT = (n.VERDICT, _PLAIN)
    ACTIVITY = (n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS, _PLAIN)
    # Busy at any time within the hold, as FrexporterCollectiveDesync asks it (model.BUSY_HOLD_SECONDS).
    BUSY_LATELY = (n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS, _BUSY_HOLD)

    def __init__(self, metric: str, form: str) -> None:
        self.metric = metric
        self.form = form

    def promql(self, selector: str) -> str:
        busy = f'{n.L_STATE}="{ACTIVITY_BUSY}"'
        return self.form.format(metric=self.metric, sel=selector,
                                busy_sel="{" + ", ".join(m for m in (selector[1:-1], busy) if m) + "}")


Answers = Mapping[Query, list[Sample]]  # a query left out is one that returned nothing

# Queries asked only when another one answered: the rates serve the ranking by arrivals alone, and they are a
# series per rank and PG (an eighth of what an analysis reads).
ASKED_ONLY_WITH: Mapping[Query, Query] = {Query.PG_RATE: Query.PG_ARRIVAL}

# The queries of a PG's series (per rank and PG: most of what an analysis reads, 6 of a rank's 8 at 4 PGs; per node
# and PG: 4 more), asked only of the PGs PG_ACTIVE finds active when they are few (prometheus.fetch). A PG is
# active when one of its ranks has a collective in flight (a count above 0, or an in-flight start) or reports
# collective waits or arrivals. Every hang verdict needs a collective in flight (a wait, a stall, a budget, an
# absent member waited on) and the straggler ranking needs waits or arrivals, so an idle PG (every member's
# collectives completed) gives nothing to judge and only PG_ACTIVE counts it.
OF_ACTIVE_PGS = frozenset({Query.PG_INFO, Query.PG_TIMEOUT, Query.PG_STUCK_THRESHOLD, Query.PG_STUCK_CEILING,
                           Query.PG_ENQUEUED, Query.PG_COMPLETED, Query.PG_STARTED, Query.PG_INFLIGHT,
                           Query.PG_OLDEST, Query.PG_PROGRESS, Query.PG_WAIT_SEQ, Query.PG_WAIT_START,
                           Query.PG_WAIT, Query.PG_ARRIVAL, Query.PG_RATE})
# Asked after the others, only when their answers call for them: OF_ACTIVE_PGS, and SCRAPED (scrape_times_needed).
LATER = OF_ACTIVE_PGS | {Query.SCRAPED}

# Answers whose series another query's answers hold and count: PG_RATE's are PG_ENQUEUED's, PG_ACTIVE's and
# JOB_STUCK_CEILING's aggregate others'.
_NOT_COUNTED = frozenset({Query.PG_RATE, Query.PG_ACTIVE, Query.JOB_STUCK_CEILING})

_PG_FIELDS = {Query.PG_ENQUEUED: "enqueued", Query.PG_COMPLETED: "completed", Query.PG_STARTED: "started",
              Query.PG_INFLIGHT: "inflight", Query.PG_OLDEST: "oldest", Query.PG_PROGRESS: "progress",
              Query.PG_WAIT: "wait", Query.PG_ARRIVAL: "arrival", Query.PG_WAIT_SEQ: "wait_seq",
              Query.PG_WAIT_START: "wait_start"}
_COUNT_FIELDS = frozenset({"enqueued", "completed", "started", "inflight", "wait_seq"})
_TIME_FIELDS = frozenset({"oldest", "progress", "wait_start"})  # node timestamps
PGKey = tuple[str, str]  # (job id, PG)
RankPGKey = tuple[str, int, str]  # (job id, rank, PG)
ByRank = dict[RankKey, dict[Source, Sample]]


@dataclass(frozen=True)
class JobView:
    """Every rank of a job as of the latest scrapes, and what was left out of it (one line per reason)."""

    ranks: tuple[RankState, ...]
    problems: list[str]
    skipped_series: int
    # Each rank's collectives a second in each PG (rate over the rules' window), for the straggler ranking by
    # arrivals: PGState has no rate, a single scrape cannot give one.
    collective_rates: Mapping[RankPGKey, float] = field(default_factory=dict)
    # PGs the ranks report (Query.PG_ACTIVE) that no rank's PGState holds: the idle ones, whose series were not
    # read (OF_ACTIVE_PGS), and any whose ranks report no seqs.
    unread_pgs: frozenset[PGKey] = frozenset()
    # The largest stuck ceiling of any PG (None: no node reports one).
    stuck_ceiling: float | None = None


def pg_keys(samples: list[Sample], active: bool = False) -> set[PGKey]:
    """The (job id, PG) of each sample that has both labels; ``active``: of those valued above 0 (the answers of
    Query.PG_ACTIVE: the active PGs)."""
    return {(job, pg) for s in samples
            if (job := s["metric"].get(n.L_JOB_ID)) is not None and (pg := s["metric"].get(n.L_PG)) is not None
            and (not active or (ps.value(s) or 0) > 0)}


def scrape_times_needed(answers: Answers) -> bool:
    """Whether an exporter of a heartbeat reports no poll time (an older one): Query.SCRAPED dates its heartbeats."""
    polled = {ps.source(s["metric"]) for s in answers.get(Query.POLL, ())}
    return any(ps.source(s["metric"]) not in polled for s in answers.get(Query.HEARTBEAT, ()))


def rebuild(answers: Answers, now: float, stale_after: float = STALE_HEARTBEAT_SECONDS) -> JobView:
    """Every rank the answers name, as of the latest scrapes; ``now`` is when they were asked, on the caller's
    clock.

    A rank several exporters report (a sidecar and a node exporter, or two replicas) is read from the
    one with the freshest heartbeat only: mixing their series could combine one's seqs with the other's
    in-flight start. A rank is unresponsive when its heartbeat was ``stale_after`` old already when its
    exporter last polled (judged on the node's clock; for an older exporter, when Prometheus last scraped
    it): judged at the query time instead, every healthy rank would look stale whenever the scrape interval
    is longer than that.

    Every node's timestamps (heartbeats, in-flight starts, progress, activity) are moved onto the caller's
    clock by their exporter's offset (``now`` minus the node's clock now, Query.NODE_NOW), so that their ages
    are the ones the node's own clock gives, whatever its offset; an older exporter's are taken as they are.
    """
    skipped = ps.Skipped()
    # A series left out of _NOT_COUNTED's answers is counted where it is read.
    got = {q: ps.screened(answers.get(q, []), ps.Skipped() if q in _NOT_COUNTED else skipped)
           for q in Query}
    up, heartbeat, scraped, info = (ps.by_source(got[q]) for q in (Query.UP, Query.HEARTBEAT, Query.SCRAPED,
                                                                     Query.INFO))
    polls = _per_exporter(got[Query.POLL])
    offsets = {source: now - clock for source, clock in _per_exporter(got[Query.NODE_NOW]).items()}
    pg_samples = [(field_name, s) for q, field_name in _PG_FIELDS.items() for s in got[q]]
    chosen = _chosen(up, heartbeat, info, pg_samples)

    def pick(table: ByRank, key: RankKey) -> Sample | None:
        return table.get(key, {}).get(chosen[key])

    pg_series = _pg_series(pg_samples, chosen, skipped, offsets)
    members, unexpanded = _members(pg_series, got[Query.PG_INFO], {key: pick(info, key) for key in chosen}, skipped)
    by_rank = _pg_states(pg_series, members, got)
    judged = {(job, pg.name) for (job, _), pgs in by_rank.items() for pg in pgs}
    ceilings = [v for s in got[Query.JOB_STUCK_CEILING] if (v := ps.value(s)) is not None and v > 0]
    culprits = _culprit_activities(got[Query.VERDICT])
    activity = ps.newest_state(got[Query.ACTIVITY])
    busy_lately = {key for s in got[Query.BUSY_LATELY]
                   if s["metric"].get(n.L_STATE) == ACTIVITY_BUSY and (key := ps.rank_key(s["metric"])) is not None}
    out = []
    for key in sorted(set(by_rank) | {key for key in chosen if pick(up, key) is not None}):
        job, rank = key
        info_sample = pick(info, key)
        labels = info_sample["metric"] if info_sample is not None else {}
        offset = offsets.get(chosen[key], 0.0)
        status, hb, age = _liveness(pick(up, key), pick(heartbeat, key), pick(scraped, key),
                                    polls.get(chosen[key]), offset, now, stale_after)
        out.append(RankState(
            job_id=job, rank=rank, local_rank=ps.int_label(labels.get(n.L_LOCAL_RANK)),
            # A world left unexpanded (past MAX_EXPANDED_MEMBERS) is unknown: its absent ranks are not listed.
            world_size=-1 if job in unexpanded else ps.int_label(labels.get(n.L_WORLD_SIZE)),
            hostname=labels.get(n.L_HOSTNAME, ""),
            pid=ps.int_label(labels.get(n.L_PID)), torch_version=labels.get(n.L_TORCH_VERSION, ""),
            gpu_uuid=labels.get(n.L_GPU_UUID, ""), status=status, heartbeat=hb, heartbeat_age=age,
            socket_alive=None, pgs=tuple(by_rank.get(key, ())),
            activity=_activity(pick(activity, key), culprits.get(key), now if key in busy_lately else None,
                               offset),
        ))
    return JobView(ranks=tuple(out), problems=skipped.lines(), skipped_series=skipped.series,
                   collective_rates=_rates(got[Query.PG_RATE], chosen),
                   unread_pgs=frozenset(pg_keys(got[Query.PG_ACTIVE]) - judged),
                   stuck_ceiling=max(ceilings, default=None))


def _chosen(up: ByRank, heartbeat: ByRank, info: ByRank, pg_samples: list[tuple[str, Sample]],
            ) -> dict[RankKey, Source]:
    """Each rank's exporter: of those that report it, the one with the freshest heartbeat."""
    sources: dict[RankKey, set[Source]] = defaultdict(set)
    for table in (up, heartbeat, info):
        for key, by_source in table.items():
            sources[key].update(by_source)
    for _, s in pg_samples:
        reporting = ps.rank_key(s["metric"])
        if reporting is not None:
            sources[reporting].add(ps.source(s["metric"]))

    def freshness(key: RankKey, source: Source) -> tuple[float, Source]:
        beat = ps.value(heartbeat[key][source]) if source in heartbeat.get(key, {}) else None
        return (-math.inf if beat is None else beat, source)

    return {key: max(found, key=partial(freshness, key)) for key, found in sources.items()}


def _per_exporter(samples: list[Sample]) -> dict[Source, float]:
    """A per-exporter series' value by exporter (a clock: Query.POLL, Query.NODE_NOW)."""
    return {ps.source(s["metric"]): v for s in samples if (v := ps.value(s)) is not None}


def _moved(timestamp: float | None, offset: float) -> float | None:
    """A node's timestamp on the caller's clock; None where a hostile answer would make it no number."""
    if timestamp is None:
        return None
    moved = timestamp + offset
    return moved if math.isfinite(moved) else None


def _liveness(up: Sample | None, heartbeat: Sample | None, scraped: Sample | None, poll: float | None,
              offset: float, now: float, stale_after: float) -> tuple[str, float | None, float | None]:
    """The rank's status, heartbeat (on the caller's clock) and heartbeat age. ``poll``: the node's clock at the
    poll that read the heartbeat; ``scraped``: when Prometheus scraped it (an older exporter's only time)."""
    raw = None if heartbeat is None else ps.value(heartbeat)
    if raw is not None and poll is not None:
        stale: float | None = poll - raw  # one clock: the node's
    else:
        at = None if scraped is None else ps.value(scraped)
        stale = None if raw is None else (now if at is None else at) - raw
    hb = _moved(raw, offset)
    if hb is None:
        stale = None
    status = RANK_OK
    if up is not None and ps.value(up) == 0:
        status = RANK_DOWN
    elif stale is not None and stale > stale_after:
        status = RANK_UNRESPONSIVE
    # A wedged rank has not beaten since its heartbeat; a healthy one was that fresh at its poll (or scrape).
    age = None if hb is None or stale is None else max(0.0, now - hb if status == RANK_UNRESPONSIVE else stale)
    return status, hb, age


def _pg_states(pg_series: dict[tuple[str, int, str], dict[str, Any]], members: dict[PGKey, tuple[int, ...]],
               got: Answers) -> dict[RankKey, list[PGState]]:
    """Each rank's PGs, those whose enqueued seq is known. Where the completed seq is not (the alerting relabel
    recipe drops it), a rank's reported wait says what it waits on, and a rank without one has no collective in
    flight that has waited half its stuck threshold: none that a verdict could count."""
    timeouts = _pg_timeouts(got[Query.PG_TIMEOUT])
    thresholds = _pg_timeouts(got[Query.PG_STUCK_THRESHOLD])
    ceilings = _pg_timeouts(got[Query.PG_STUCK_CEILING])
    by_rank: dict[RankKey, list[PGState]] = defaultdict(list)
    for (job, rank, pg), v in sorted(pg_series.items()):
        if v.get("enqueued") is None:
            continue
        enq = int(v["enqueued"])
        if v.get("completed") is not None:
            done = int(v["completed"])
        else:
            done = int(v["wait_seq"]) - 1 if v.get("wait_seq") is not None else enq
        inflight = v.get("inflight")
        state = PGState(
            name=pg, desc=str(v.get("desc", "")), ranks=members[(job, pg)], backend="",
            last_enqueued=enq, last_started=int(v["started"]) if v.get("started") is not None else -1,
            last_completed=done, inflight=(),
            # A reported 0 is an answer, not a gap to fill from the seqs.
            inflight_count=max(0, enq - done) if inflight is None else max(0, int(inflight)),
            timeout_seconds=timeouts.get((job, pg)), last_progress=v.get("progress"), exact=True, has_p2p=False,
            stuck_threshold_seconds=thresholds.get((job, pg)), stuck_ceiling_seconds=ceilings.get((job, pg)),
            wait_seconds=v.get("wait"), arrival_timestamp=v.get("arrival"),
        )
        oldest = v.get("oldest") if v.get("oldest") is not None else v.get("wait_start")
        by_rank[(job, rank)].append(with_oldest_start(state, oldest))
    return by_rank


def _pg_series(pg_samples: list[tuple[str, Sample]], chosen: dict[RankKey, Source], skipped: ps.Skipped,
               offsets: dict[Source, float]) -> dict[tuple[str, int, str], dict[str, Any]]:
    """(job, rank, PG) -> field -> value, from the chosen exporter of each rank, timestamps on the caller's clock
    (``offsets``); a seq or count that is not a whole number (7.5, 1e300) is counted in ``skipped``, not cut to
    one."""
    pg_series: dict[tuple[str, int, str], dict[str, Any]] = defaultdict(dict)
    for field_name, s in pg_samples:
        labels = s["metric"]
        key = ps.rank_key(labels)
        if key is None or n.L_PG not in labels or ps.source(labels) != chosen[key]:
            continue
        value = ps.value(s)
        if field_name in _COUNT_FIELDS and not ps.is_count(value):
            skipped.add(f"series whose value is not a whole number from -1 to {ps.MAX_SEQ}",
                        f"{str(s['value'][1])[:EXAMPLE_CHARS]} of {labels.get('__name__', '?')[:EXAMPLE_CHARS]}")
            continue
        if field_name == "wait" and (value is None or not 0.0 <= value <= MAX_WAIT_SECONDS):
            if value is not None:  # a sample with no number (NaN, none at all) says nothing: dropped quietly
                skipped.add("wait series that are not seconds from 0 to an hour",
                            f"{value!r:.{EXAMPLE_CHARS}} of {labels.get('__name__', '?')[:EXAMPLE_CHARS]}")
            continue
        if field_name == "arrival" and (value is None or value < 0):
            if value is not None:  # as for waits: no number says nothing, a negative one is no exporter's
                skipped.add("arrival series that are no unix time (below 0)",
                            f"{value!r:.{EXAMPLE_CHARS}} of {labels.get('__name__', '?')[:EXAMPLE_CHARS]}")
            continue
        # Arrivals stay on their node's clock, as the rule compares them: moved by the offset (known only to the
        # time between a poll and its scrape, seconds) they would be off by far more than a lag of milliseconds.
        if field_name in _TIME_FIELDS:
            value = _moved(value, offsets.get(chosen[key], 0.0))
        pg_key = (*key, labels[n.L_PG])
        series = pg_series[pg_key]
        series[field_name] = value
        series["desc"] = labels.get(n.L_PG_DESC, "")
    return pg_series


def _rates(samples: list[Sample], chosen: dict[RankKey, Source]) -> dict[RankPGKey, float]:
    """Each rank's collectives a second in each PG, from its chosen exporter. Kept apart from the PG series: a
    rate alone makes no rank a member of a PG. One below 0 or of no number is left out uncounted: no rate() gives
    one, and the seq series it would be the rate of is counted where bad."""
    out: dict[RankPGKey, float] = {}
    for s in samples:
        labels = s["metric"]
        key, value = ps.rank_key(labels), ps.value(s)
        if key is None or n.L_PG not in labels or ps.source(labels) != chosen.get(key) or value is None or value < 0:
            continue
        out[(key[0], key[1], labels[n.L_PG])] = value
    return out


def _activity(sample: Sample | None, culprit: Activity | None, last_busy: float | None, offset: float) -> Activity:
    """The rank's activity from its exporter's activity series (state and since, moved onto the caller's clock by
    ``offset``), with the function a verdict of that state names; from the verdict alone where the exporter
    exports no activity (older). ``last_busy``: a time within the busy hold when the series said busy in it."""
    if sample is None or sample["metric"].get(n.L_STATE) not in ACTIVITY_STATES:
        return culprit or UNKNOWN_ACTIVITY
    state: str = sample["metric"][n.L_STATE]
    frames = culprit.frames if culprit is not None and culprit.state == state else ()
    return Activity(state=state, frames=frames, since=_moved(ps.value(sample), offset), last_busy=last_busy)


def _culprit_activities(samples: list[Sample]) -> dict[RankKey, Activity]:
    """What each culprit was doing as its node's exporter saw it (frexporter_verdict's culprit_state and
    culprit_function); the function is all of the stack a series carries."""
    out: dict[RankKey, Activity] = {}
    for s in samples:
        labels = s["metric"]
        key, state = ps.rank_key(labels), labels.get(n.L_CULPRIT_STATE, "")
        if key is None or state not in ACTIVITY_STATES or state == ACTIVITY_UNKNOWN:
            continue
        function = labels.get(n.L_CULPRIT_FUNCTION, "")[:n.MAX_FUNCTION_LABEL_CHARS]
        out[key] = Activity(state=state, frames=((function, "", 0),) if function else ())
    return out


def _pg_timeouts(samples: list[Sample]) -> dict[PGKey, float]:
    """Each PG's watchdog timeout or stuck threshold (exported per node, without a rank): the shortest any
    node reports."""
    out: dict[PGKey, float] = {}
    for s in samples:
        job, pg = s["metric"].get(n.L_JOB_ID), s["metric"].get(n.L_PG)
        value = ps.value(s)
        if job is None or pg is None or value is None or value <= 0:
            continue
        out[(job, pg)] = min(out.get((job, pg), value), value)
    return out


def _members(pg_series: dict[tuple[str, int, str], dict[str, Any]], pg_info: list[Sample],
             rank_info: dict[RankKey, Sample | None], skipped: ps.Skipped,
             ) -> tuple[dict[PGKey, tuple[int, ...]], set[str]]:
    """Each PG's ranks: those with series, or every rank of the job when the PG spans the world; and the jobs
    whose world is left unexpanded (see _expansions).

    A rank whose exporter is down or never saw it has no series at all; counted out, it could never be
    blamed for the collective its peers wait on. Only a PG as large as the world says who is missing.
    """
    seen: dict[PGKey, set[int]] = defaultdict(set)
    for job, rank, pg in pg_series:
        seen[(job, pg)].add(rank)
    size: dict[PGKey, int] = {}
    for s in pg_info:  # per node, without a rank: every node that reports the PG agrees on its size
        job, pg = s["metric"].get(n.L_JOB_ID), s["metric"].get(n.L_PG)
        if job is not None and pg is not None:
            size[(job, pg)] = max(size.get((job, pg), 0), ps.int_label(s["metric"].get(n.L_SIZE)))
    world: dict[str, int] = defaultdict(int)
    reporting: dict[str, int] = defaultdict(int)
    for (job, _), sample in rank_info.items():
        reporting[job] += 1
        if sample is not None:
            world[job] = max(world[job], ps.int_label(sample["metric"].get(n.L_WORLD_SIZE)))
    spanning = {key for key, ranks in seen.items() if size.get(key, -1) == world[key[0]] > len(ranks)}
    expanded, unexpanded = _expansions(world, spanning, reporting, skipped)
    out = {}
    for (job, pg), ranks in seen.items():
        if (job, pg) in expanded:  # every rank below the world size, and any the series name beyond it
            out[(job, pg)] = tuple(range(world[job])) + tuple(sorted(r for r in ranks if r >= world[job]))
        else:
            out[(job, pg)] = tuple(sorted(ranks))
    return out, unexpanded


def _expansions(world: dict[str, int], spanning: set[PGKey], reporting: dict[str, int],
                skipped: ps.Skipped) -> tuple[set[PGKey], set[str]]:
    """The world-spanning PGs expanded into every rank of their world, and the jobs whose world is not expanded
    (into report.from_prometheus's absent ranks), so that all expansions together stay within
    MAX_EXPANDED_MEMBERS. The jobs with the most reporting ranks go first, each its world, then its PGs: a few MB
    of answers claiming thousands of world-sized PGs or jobs cannot crowd out the job that reports."""
    left = MAX_EXPANDED_MEMBERS
    expanded: set[PGKey] = set()
    unexpanded: set[str] = set()
    by_job: dict[str, list[str]] = defaultdict(list)
    for job, pg in sorted(spanning, key=lambda key: (key[0], len(key[1]), key[1])):  # PG "2" before "10"
        by_job[job].append(pg)
    reason = f"past {MAX_EXPANDED_MEMBERS} members expanded in all"
    for job in sorted(world, key=lambda j: (-reporting[j], j)):
        size = world[job]
        if size > MAX_WORLD_SIZE:
            continue  # beyond any real job: expanded nowhere (absent.find_absent_in_world skips it too)
        if size > left:
            unexpanded.add(job)
            skipped.add(f"jobs whose absent ranks are not listed ({reason})", f"job {job[:EXAMPLE_CHARS]}",
                        series=False)
        else:
            left -= size
        for pg in by_job.get(job, ()):
            if size > left:
                skipped.add(f"world-spanning process groups whose members are only the ranks that report them "
                            f"({reason})", f"job {job[:EXAMPLE_CHARS]}, PG {pg[:EXAMPLE_CHARS]}", series=False)
                continue
            left -= size
            expanded.add((job, pg))
    return expanded, unexpanded
