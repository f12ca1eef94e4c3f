"""Prometheus view of the latest NodeSnapshot: a custom collector yielding fresh families per scrape."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from frexporter import __version__
from frexporter import naming as n
from frexporter.defaults import IDLE_CANDIDATES_PER_NODE, WAIT_REPORT_SHARE
from frexporter.model import ACTIVITY_STATES, DURATION_BUCKETS, UNKNOWN_ACTIVITY, NodeSnapshot, PGState, RankState

_LE = tuple(floatToGoString(b) for b in DURATION_BUCKETS)


def _pg_labels(rank: RankState, pg: PGState) -> list[str]:
    return [rank.job_id, str(rank.rank), pg.name, pg.desc]


def collective_wait_start(pg: PGState) -> float | None:
    """When the PG's oldest in-flight collective began, while one is enqueued and not completed (seqs are
    collective-domain: a p2p op in flight is no wait); None otherwise."""
    first = pg.oldest_inflight
    if first is None or pg.inflight_count <= 0 or pg.last_enqueued <= pg.last_completed:
        return None
    return first.created


def reported_wait(rank: RankState, pg: PGState, start: float | None, now: float) -> float | None:
    """The start of the rank's wait in the PG, given the PG's collective_wait_start ``start``, if it is one the
    waits report: the rank is up and has waited WAIT_REPORT_SHARE of the PG's stuck threshold (of its ceiling where
    none is learned) at ``now``, on this node's clock. None otherwise, and where the PG knows no threshold at all."""
    limit = _report_limit(pg)
    if not rank.up or start is None or limit is None or now - start < WAIT_REPORT_SHARE * limit:
        return None
    return start


def _report_limit(pg: PGState) -> float | None:
    """The stuck threshold the waits and idle ranks are reported against: the learned one, else the ceiling."""
    return pg.stuck_threshold_seconds if pg.stuck_threshold_seconds is not None else pg.stuck_ceiling_seconds


def reported_idle(pg: PGState, flying: float | None, now: float) -> bool:
    """Whether the rank is idle in the PG as the exporter reports it (a desync's candidate culprit), given the PG's
    collective_wait_start ``flying``: no collective of the PG enqueued and not completed, and its completed seq has
    not advanced for WAIT_REPORT_SHARE of the PG's stuck threshold at ``now`` on this node's clock, or never has. A
    culprit that never enqueued the collective its peers wait on completed its last one before they began to wait,
    so it is idle by the time they are; a rank that is down is idle too (FrexporterRankDown pages for it as well).
    False where the PG knows no threshold."""
    limit = _report_limit(pg)
    if flying is not None or limit is None:
        return False
    return pg.last_progress is None or now - pg.last_progress >= WAIT_REPORT_SHARE * limit


class _IdleCandidates:
    """Per (job, PG), the node's IDLE_CANDIDATES_PER_NODE idle ranks of the lowest (seq, rank): the rules keep as
    many per PG and shard, so the node's others could never be named, and a PG with many members on a node (WORLD,
    tensor-parallel) writes a few series instead of one per member."""

    def __init__(self) -> None:
        self._by_pg: dict[tuple[str, str, str], list[tuple[int, int, dict[str, str]]]] = {}

    def add(self, rank: RankState, pg: PGState, labels: dict[str, str]) -> None:
        found = self._by_pg.setdefault((rank.job_id, pg.name, pg.desc), [])
        found.append((pg.last_enqueued, rank.rank, {**labels, n.L_HOSTNAME: rank.hostname}))

    def into(self, family: GaugeMetricFamily) -> None:
        for found in self._by_pg.values():
            for seq, _, labels in sorted(found, key=lambda c: (c[0], c[1]))[:IDLE_CANDIDATES_PER_NODE]:
                family.add_sample(family.name, labels, seq)


class _PGFacts:
    """A PG's static facts across this node's ranks (they agree unless a rank is mid-restart)."""

    __slots__ = ("backend", "ceiling", "size", "threshold", "timeout")

    def __init__(self) -> None:
        self.size = 0
        self.backend = ""
        self.timeout: float | None = None
        self.threshold: float | None = None
        self.ceiling: float | None = None

    def add(self, pg: PGState) -> None:
        self.size = max(self.size, pg.size)
        self.backend = self.backend or pg.backend
        if pg.timeout_seconds is not None:
            # The shortest is the one whose watchdog fires first.
            self.timeout = pg.timeout_seconds if self.timeout is None else min(self.timeout, pg.timeout_seconds)
        if pg.stuck_threshold_seconds is not None:
            learned = pg.stuck_threshold_seconds
            self.threshold = learned if self.threshold is None else min(self.threshold, learned)
        if pg.stuck_ceiling_seconds is not None:
            ceiling = pg.stuck_ceiling_seconds
            self.ceiling = ceiling if self.ceiling is None else min(self.ceiling, ceiling)


class SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], NodeSnapshot], nvlink_per_link: bool = False) -> None:
        self._snapshot = snapshot
        self._nvlink_per_link = nvlink_per_link

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        build = GaugeMetricFamily(n.BUILD_INFO, "frexporter build information.", labels=[n.L_VERSION])
        build.add_metric([__version__], 1)
        yield build
        poll = GaugeMetricFamily(n.POLL_TIMESTAMP_SECONDS, "Unix time, on this node's clock, of the poll that "
                                 "every other series here comes from; a node timestamp's age is this minus it.")
        poll.add_metric([], snap.time)
        yield poll
        yield from self._sources(snap)
        yield from self._ranks(snap)
        yield from self._pgs(snap)
        yield from self._collectives(snap)
        yield from self._verdicts(snap)
        if snap.gpus is not None:
            from frexporter.outputs.gpu_metrics import gpu_metric_families

            yield from gpu_metric_families(snap.gpus, nvlink_per_link=self._nvlink_per_link)

    @staticmethod
    def _sources(snap: NodeSnapshot) -> Iterator[Metric]:
        up = GaugeMetricFamily(n.SOURCE_UP, "1 when the source's last collection succeeded.",
                               labels=list(n.SOURCE_LABELS))
        duration = GaugeMetricFamily(n.SOURCE_DURATION_SECONDS, "Duration of the source's last collection.",
                                     labels=list(n.SOURCE_LABELS))
        errors = CounterMetricFamily(n.SOURCE_ERRORS_TOTAL, "Errors met by a source, by reason.",
                                     labels=list(n.SOURCE_ERROR_LABELS))
        success = GaugeMetricFamily(n.SOURCE_LAST_SUCCESS_TIMESTAMP_SECONDS,
                                    "Unix time of the source's last successful collection.",
                                    labels=list(n.SOURCE_LABELS))
        for src in snap.sources:
            up.add_metric([src.name], 1 if src.up else 0)
            duration.add_metric([src.name], src.duration_seconds)
            for reason, count in sorted(src.errors_total.items()):
                errors.add_metric([src.name, reason], count)
            if src.last_success is not None:
                success.add_metric([src.name], src.last_success)
        yield from (up, duration, errors, success)

    @staticmethod
    def _ranks(snap: NodeSnapshot) -> Iterator[Metric]:
        info = GaugeMetricFamily(n.RANK_INFO, "Identity of a local training rank.",
                                 labels=list(n.RANK_INFO_LABELS))
        up = GaugeMetricFamily(n.RANK_UP, "1 when the rank answered this poll (fresh heartbeat or live "
                               "worker server).", labels=list(n.RANK_LABELS))
        heartbeat = GaugeMetricFamily(n.RANK_HEARTBEAT_TIMESTAMP_SECONDS,
                                      "Unix time of the rank's last fresh snapshot; stale while up means "
                                      "its Python is wedged.", labels=list(n.RANK_LABELS))
        rec_errors = CounterMetricFamily(n.RANK_RECORDER_ERRORS_TOTAL,
                                         "Errors the in-rank recorder met, by reason.",
                                         labels=[*n.RANK_LABELS, n.L_REASON])
        activity = GaugeMetricFamily(n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS,
                                     "Unix time the rank's current activity began; `state` is what it is doing "
                                     f"({', '.join(ACTIVITY_STATES)}).",
                                     labels=list(n.RANK_ACTIVITY_LABELS))
        world = GaugeMetricFamily(n.JOB_WORLD_SIZE, "Ranks in the job, as its ranks on this node state it (the "
                                  "largest); absent before any of them knows.", labels=list(n.JOB_LABELS))
        worlds: dict[str, int] = {}
        for r in snap.ranks:
            key = [r.job_id, str(r.rank)]
            if r.world_size > 0:
                worlds[r.job_id] = max(worlds.get(r.job_id, 0), r.world_size)
            info.add_metric([r.job_id, str(r.rank), str(r.local_rank), str(r.world_size), r.hostname,
                             str(r.pid), r.torch_version, r.gpu_uuid], 1)
            up.add_metric(key, 1 if r.up else 0)
            if r.heartbeat is not None:
                heartbeat.add_metric(key, r.heartbeat)
            for reason, count in sorted(r.recorder_errors.items()):
                rec_errors.add_metric([*key, reason], count)
            if r.activity.since is not None:
                activity.add_metric([*key, r.activity.state], r.activity.since)
        for job_id, size in sorted(worlds.items()):
            world.add_metric([job_id], size)
        yield from (info, up, heartbeat, rec_errors, activity, world)

    @staticmethod
    def _pgs(snap: NodeSnapshot) -> Iterator[Metric]:
        labels = list(n.PG_LABELS)
        info = GaugeMetricFamily(n.PG_INFO, "A process group of this node's ranks, by cross-rank name.",
                                 labels=list(n.PG_INFO_LABELS))
        enq = GaugeMetricFamily(n.PG_LAST_ENQUEUED_SEQ, "Last collective enqueued (collective domain).",
                                labels=labels)
        started = GaugeMetricFamily(n.PG_LAST_STARTED_SEQ,
                                    "Last collective started on the device (NCCL with timing only).",
                                    labels=labels)
        done = GaugeMetricFamily(n.PG_LAST_COMPLETED_SEQ, "Last collective completed (collective domain).",
                                 labels=labels)
        inflight = GaugeMetricFamily(n.PG_INFLIGHT_COLLECTIVES, "Collectives enqueued and not completed.",
                                     labels=labels)
        oldest = GaugeMetricFamily(n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS,
                                   "Unix time the oldest in-flight collective was enqueued; only while the "
                                   "rank has a collective enqueued and not completed.", labels=labels)
        timeout = GaugeMetricFamily(n.PG_TIMEOUT_SECONDS, "Watchdog timeout of the process group (the "
                                    "shortest among this node's ranks).", labels=list(n.PG_STATIC_LABELS))
        threshold = GaugeMetricFamily(n.PG_STUCK_THRESHOLD_SECONDS,
                                      "Seconds a collective of the process group may wait before it counts as "
                                      "stuck, learned from its history (docs/detection.md).",
                                      labels=list(n.PG_STATIC_LABELS))
        ceiling = GaugeMetricFamily(n.PG_STUCK_CEILING_SECONDS,
                                    "Seconds a collective of the process group may wait on a culprit that is "
                                    "busy computing before it counts as stuck (--stuck-after, the learned "
                                    "threshold's ceiling).", labels=list(n.PG_STATIC_LABELS))
        progress = GaugeMetricFamily(n.PG_LAST_PROGRESS_TIMESTAMP_SECONDS,
                                     "Unix time the completed sequence last advanced (first seen: the newest "
                                     "completed collective's creation time, a lower bound).", labels=labels)
        straggler = GaugeMetricFamily(n.RANK_STRAGGLER_LATENESS_SECONDS,
                                      "Seconds the rank enqueues this PG's collectives after its first local peer, "
                                      "mean over recent collectives (slowest tenth left out); only where the node "
                                      "has several ranks of the PG.", labels=labels)
        wait = GaugeMetricFamily(n.RANK_COLLECTIVE_WAIT_SECONDS,
                                 "Seconds the rank waits inside this PG's collectives, mean over recent "
                                 "collectives (smallest and largest tenth left out), from its own node's clock: "
                                 "compares across nodes, the last arriver waits least; NCCL only, with "
                                 "--collective-waits.", labels=labels)
        arrival = GaugeMetricFamily(n.RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS,
                                    "Unix time the rank calls this PG's collectives, mean over the block of "
                                    "collectives every node picks for the current grid instant (stamped with its "
                                    "time): compares across nodes up to their clock offset, the last arriver calls "
                                    "latest; gloo (no completion recorded), with --collective-waits.", labels=labels)
        wait_start = GaugeMetricFamily(n.PG_WAIT_START_TIMESTAMP_SECONDS,
                                       "Unix time, on this node's clock, the rank's wait in the PG's oldest in-flight "
                                       "collective began; only while the rank is up and has waited "
                                       f"{WAIT_REPORT_SHARE:.0%} of the PG's stuck threshold.", labels=labels)
        wait_seq = GaugeMetricFamily(n.PG_WAIT_SEQ, "The collective seq that wait is on (the completed seq + 1); "
                                     "only beside its start.", labels=labels)
        wait_limit = GaugeMetricFamily(n.PG_WAIT_LIMIT_SECONDS,
                                       "The waiting rank's limits for the PG (`limit`: stuck, the learned threshold; "
                                       "ceiling, --stuck-after; timeout, the watchdog's); only beside a wait's start.",
                                       labels=list(n.PG_WAIT_LIMIT_LABELS))
        wait_size = GaugeMetricFamily(n.PG_WAIT_GROUP_SIZE, "Ranks in the PG the rank waits in; only beside a wait's "
                                      "start.", labels=labels)
        idle = GaugeMetricFamily(n.PG_IDLE_SEQ,
                                 "The last collective seq enqueued by a rank idle in the PG: none of its collectives "
                                 f"in flight, and its completed seq unchanged for {WAIT_REPORT_SHARE:.0%} of the PG's "
                                 "stuck threshold (or never advanced); per node and PG only the "
                                 f"{IDLE_CANDIDATES_PER_NODE} such ranks of the lowest seq: a desync's candidate "
                                 "culprits.", labels=list(n.PG_IDLE_LABELS))
        candidates = _IdleCandidates()
        # Kept for one release so queries written against the first name keep working (CHANGELOG.md).
        straggler_old = GaugeMetricFamily(n.RANK_STRAGGLER_SCORE_DEPRECATED,
                                          f"Deprecated, removed in the next release: use "
                                          f"{n.RANK_STRAGGLER_LATENESS_SECONDS} (the same value, in seconds).",
                                          labels=labels)
        static: dict[tuple[str, str, str], _PGFacts] = {}
        for r in snap.ranks:
            for pg in r.pgs:
                # One label dict per (rank, PG), shared by its samples in every family: add_metric would zip a
                # new one per sample, the bulk of a 64-rank render's collect time.
                key = dict(zip(labels, _pg_labels(r, pg), strict=True))
                facts = static.setdefault((r.job_id, pg.name, pg.desc), _PGFacts())
                facts.add(pg)
                enq.add_sample(enq.name, key, pg.last_enqueued)
                if pg.last_started >= 0:
                    started.add_sample(started.name, key, pg.last_started)
                done.add_sample(done.name, key, pg.last_completed)
                inflight.add_sample(inflight.name, key, pg.inflight_count)
                # Only while a collective is enqueued and not completed: read alone as "waits in a collective"
                # (a p2p op in flight is not one), never joining the seqs.
                flying = collective_wait_start(pg)
                if flying is not None:
                    oldest.add_sample(oldest.name, key, flying)
                start = reported_wait(r, pg, flying, snap.time)
                if reported_idle(pg, flying, snap.time):
                    candidates.add(r, pg, key)
                if start is not None:
                    wait_start.add_sample(wait_start.name, key, start)
                    wait_seq.add_sample(wait_seq.name, key, pg.last_completed + 1)
                    wait_size.add_sample(wait_size.name, key, pg.size)
                    for limit, seconds in ((n.WAIT_LIMIT_STUCK, pg.stuck_threshold_seconds),
                                           (n.WAIT_LIMIT_CEILING, pg.stuck_ceiling_seconds),
                                           (n.WAIT_LIMIT_TIMEOUT, pg.timeout_seconds)):
                        if seconds is not None:
                            wait_limit.add_sample(wait_limit.name, {**key, n.L_LIMIT: limit}, seconds)
                if pg.last_progress is not None:
                    progress.add_sample(progress.name, key, pg.last_progress)
                if pg.lateness_seconds is not None:
                    straggler.add_sample(straggler.name, key, pg.lateness_seconds)
                    straggler_old.add_sample(straggler_old.name, key, pg.lateness_seconds)
                if pg.wait_seconds is not None:
                    wait.add_sample(wait.name, key, pg.wait_seconds)
                if pg.arrival_timestamp is not None:
                    # Stamped with its grid instant's time, not the scrape's: Prometheus then holds the same
                    # instant of every node, however their scrapes are spread (sources/arrivals.py).
                    arrival.add_sample(arrival.name, key, pg.arrival_timestamp, timestamp=pg.arrival_stamp)
        for (job_id, name, desc), facts in static.items():
            info.add_metric([job_id, name, desc, str(facts.size), facts.backend], 1)
            if facts.timeout is not None:
                timeout.add_metric([job_id, name, desc], facts.timeout)
            if facts.threshold is not None:
                threshold.add_metric([job_id, name, desc], facts.threshold)
            if facts.ceiling is not None:
                ceiling.add_metric([job_id, name, desc], facts.ceiling)
        candidates.into(idle)
        yield from (info, enq, started, done, inflight, oldest, timeout, threshold, ceiling, progress, wait_start,
                    wait_seq, wait_limit, wait_size, idle, straggler, straggler_old, wait, arrival)

    @staticmethod
    def _collectives(snap: NodeSnapshot) -> Iterator[Metric]:
        per_rank = any(c.rank is not None for c in snap.collectives)
        labels = list(n.COLLECTIVE_RANK_LABELS if per_rank else n.COLLECTIVE_LABELS)
        durations = HistogramMetricFamily(
            n.COLLECTIVE_DURATION_SECONDS, "Duration of completed collectives from their CUDA start/end events "
            "(NCCL with TORCH_NCCL_ENABLE_TIMING=1 only; gloo records none).", labels=labels)
        sizes = CounterMetricFamily(n.COLLECTIVE_BYTES_TOTAL,
                                    "Bytes of the input tensors of completed collectives, as Flight Recorder "
                                    "records them (counted on deep reads, so it lags).", labels=labels)
        for c in snap.collectives:
            key = [c.job_id, c.pg, c.pg_desc, c.op] if not per_rank else [
                c.job_id, "" if c.rank is None else str(c.rank), c.pg, c.pg_desc, c.op]
            if c.duration_count:
                buckets = [*zip(_LE, c.bucket_counts, strict=True), ("+Inf", c.duration_count)]
                durations.add_metric(key, buckets=buckets, sum_value=c.duration_sum)
            sizes.add_metric(key, c.bytes)
        yield from (durations, sizes)

    @staticmethod
    def _verdicts(snap: NodeSnapshot) -> Iterator[Metric]:
        fam = GaugeMetricFamily(n.VERDICT, "1 per culprit rank of an open verdict.",
                                labels=list(n.VERDICT_LABELS))
        for v in snap.verdicts:
            for rank in v.ranks:
                # A culprit's state may change while the verdict stands (busy, then idle): a new series then,
                # which is why no rule keeps a `for:` on this family.
                act = v.activity.get(str(rank), UNKNOWN_ACTIVITY)
                head = act.headline()
                function = head[0][:n.MAX_FUNCTION_LABEL_CHARS] if head is not None else ""
                fam.add_metric([v.job_id, v.pg, v.pg_desc, str(rank), v.kind, v.op, str(v.seq), act.state, function],
                               1)
        yield fam
