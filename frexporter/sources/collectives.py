"""What the ranks source accumulates from FR entries across deep reads: durations, bytes, lateness.

A deep read returns the whole ring buffer, so the same entry shows up in many reads
and old ones fall out of the ring between reads. ``EntryCursor`` (one per rank
incarnation and recorder) hands each entry over once, when it has settled;
``CollectiveAccumulator`` sums them into per-node (or per-rank) histograms and byte
counters; ``LatenessTracker`` matches the same collective across the local ranks of
a PG and keeps, per rank, how late it enqueued it compared with the first one.

Everything here is plain state driven by the poll thread; no I/O, no clock.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from frexporter.fr.trace import FrEntry
from frexporter.model import DURATION_BUCKETS, CollectiveStats
from frexporter.spool import NATIVE_NCCL_BACKENDS

# Element size of torch's ScalarType names as FR writes them (``c10::toString``). Types that pack several
# values into a byte (Float4_e2m1fn_x2, QUInt4x2, sub-byte ints) are left out: their element counts in
# ``input_sizes`` do not translate into bytes without knowing the packing, and a wrong byte count is worse
# than none.
DTYPE_BYTES: Mapping[str, int] = {
    "Double": 8, "Long": 8, "ComplexFloat": 8, "UInt64": 8,
    "Float": 4, "Int": 4, "ComplexHalf": 4, "UInt32": 4, "QInt32": 4,
    "Half": 2, "BFloat16": 2, "Short": 2, "UInt16": 2, "Bits16": 2,
    "Byte": 1, "Char": 1, "Bool": 1, "QInt8": 1, "QUInt8": 1, "Bits8": 1,
    "Float8_e4m3fn": 1, "Float8_e5m2": 1, "Float8_e4m3fnuz": 1, "Float8_e5m2fnuz": 1, "Float8_e8m0fnu": 1,
    "ComplexDouble": 16,
}
MAX_OPS_PER_PG = 32  # op label values per (job, PG) before the rest fold into OTHER_OP
OTHER_OP = "other"
DEFAULT_WINDOW = 200  # collectives per rank the lateness score averages over
TRIM = 0.1  # share of the largest lateness samples left out of the score
MAX_PENDING = 4096  # collectives per PG waiting for their other local ranks' entries
LONE_PENDING = 64  # the same while the PG has only one known local member (cross-node PGs: most of them)


def op_label(entry: FrEntry) -> str:
    """``all_reduce``; p2p names lose their peers (``send 1->0`` -> ``send``) so the label stays bounded."""
    return entry.op.split(" ", 1)[0] or "unknown"


def entry_bytes(entry: FrEntry) -> int | None:
    """Bytes of the entry's input tensors, None when a dtype is unknown."""
    if not entry.input_sizes:
        return 0
    if not entry.input_dtypes:
        return None
    total = 0
    for i, shape in enumerate(entry.input_sizes):
        # FR lists one dtype per input; if it lists fewer, the last one stands for the rest.
        size = DTYPE_BYTES.get(entry.input_dtypes[min(i, len(entry.input_dtypes) - 1)])
        if size is None:
            return None
        total += math.prod(max(0, d) for d in shape) * size
    return total


@dataclass
class EntryCursor:
    """Which entries of one recorder of one rank incarnation were already handed over.

    ``record_id`` is monotonic per recorder, so "every id up to ``upto``" plus the few ids above it that
    settled out of order (NCCL completes PGs independently) is exact and small: ids above ``upto`` all lie
    in the ring, which bounds the set by the ring size.
    """

    nccl: bool
    upto: int = -1
    above: set[int] = field(default_factory=set)
    deferred: set[int] = field(default_factory=set)  # NCCL ids retired before their duration was written
    started: bool = False
    lateness_upto: int = -1  # every id up to this one was given to the lateness tracker

    def _settled(self, entry: FrEntry) -> bool | None:
        """True: count it; False: never count it; None: not yet."""
        if not self.nccl or entry.backend not in ("", *NATIVE_NCCL_BACKENDS):
            # Gloo's only completion signal is retirement (torch 2.15 also marks it completed). A gloo op
            # that timed out retires too: it is counted, there is no way to tell it apart. The same holds for
            # what torch 2.15's FlightRecorderHook records (nccl2, custom backends; named so in profiling_name)
            # wherever it lands: a backend without a completion hook has its entries retired at issue, never
            # "completed" and without a duration; one with it (nccl2) retires them completed, and leaves a
            # failed one unretired. Only stock NCCL retires a timed-out entry without completing it.
            return True if entry.retired or entry.state == "completed" else None
        if not entry.retired:
            return None  # the watchdog computes the duration when it retires the entry: wait for that
        if entry.state != "completed":
            return False  # retired without completing: timed out or aborted, it moved nothing
        if entry.duration_ms is None and entry.time_discovered_started_ns and entry.record_id not in self.deferred:
            # Timing is on (a start was seen) but torch writes the duration just after retiring, without
            # the lock: give it one more read before counting the entry without one.
            self.deferred.add(entry.record_id)
            return None
        self.deferred.discard(entry.record_id)
        return True

    def take(self, entries: Iterable[FrEntry]) -> tuple[list[FrEntry], list[FrEntry], int]:
        """(settled entries to count now, entries new to the lateness tracker, ids lost to ring wrap)."""
        ordered = sorted((e for e in entries if e.record_id >= 0), key=lambda e: e.record_id)
        if not ordered:
            return [], [], 0
        first, last = ordered[0].record_id, ordered[-1].record_id
        if self.started and last < self.upto:
            # Ids went backwards: the recorder was reset (reset_all). Everything in the ring is new.
            self.upto, self.lateness_upto = -1, -1
            self.above.clear()
            self.deferred.clear()
            self.started = False
        missed = 0
        if self.started and first > self.upto + 1:
            missed = first - self.upto - 1 - sum(1 for i in self.above if i < first)
        fresh = [e for e in ordered if e.record_id > self.lateness_upto]
        self.lateness_upto = max(self.lateness_upto, last)
        settled: list[FrEntry] = []
        waiting: int | None = None
        for entry in ordered:
            rid = entry.record_id
            if rid <= self.upto or rid in self.above:
                continue
            verdict = self._settled(entry)
            if verdict is None:
                waiting = rid if waiting is None else waiting
                continue
            if verdict:
                settled.append(entry)
            self.above.add(rid)
        self.upto = max(self.upto, waiting - 1 if waiting is not None else last)
        self.above = {i for i in self.above if i > self.upto}
        self.deferred = {i for i in self.deferred if i > self.upto}
        self.started = True
        return settled, fresh, max(0, missed)


@dataclass
class _Acc:
    buckets: list[int] = field(default_factory=lambda: [0] * len(DURATION_BUCKETS))
    duration_sum: float = 0.0
    duration_count: int = 0
    bytes: int = 0


StatsKey = tuple[str, str, int | None, str]  # job, pg, rank (None per node), op


class CollectiveAccumulator:
    """Cumulative durations and bytes; per node unless ``per_rank``. Survives rank restarts (the counters
    stay monotonic) and forgets a job once none of its ranks is left."""

    def __init__(self, per_rank: bool = False) -> None:
        self.per_rank = per_rank
        self._stats: dict[StatsKey, _Acc] = {}
        self._desc: dict[tuple[str, str], str] = {}
        self._ops: dict[tuple[str, str], set[str]] = {}
        self._cached: tuple[CollectiveStats, ...] | None = ()

    def add(self, job_id: str, rank: int, pg_desc: str, entry: FrEntry) -> None:
        pg = entry.pg_name
        size = entry_bytes(entry)
        duration = entry.duration_ms / 1000.0 if entry.duration_ms is not None and entry.duration_ms >= 0 else None
        if size is None and duration is None:
            return
        op = op_label(entry)
        ops = self._ops.setdefault((job_id, pg), set())
        if op not in ops:
            if len(ops) >= MAX_OPS_PER_PG:
                op = OTHER_OP
            ops.add(op)
        self._desc[(job_id, pg)] = pg_desc or self._desc.get((job_id, pg), "")
        acc = self._stats.setdefault((job_id, pg, rank if self.per_rank else None, op), _Acc())
        if size is not None:
            acc.bytes += size
        if duration is not None:
            index = bisect.bisect_left(DURATION_BUCKETS, duration)
            if index < len(DURATION_BUCKETS):
                acc.buckets[index] += 1
            acc.duration_sum += duration
            acc.duration_count += 1
        self._cached = None

    def forget_jobs(self, live_jobs: set[str]) -> None:
        gone = [k for k in self._stats if k[0] not in live_jobs]
        for key in gone:
            del self._stats[key]
        for pg_key in [k for k in self._desc if k[0] not in live_jobs]:
            self._desc.pop(pg_key, None)
            self._ops.pop(pg_key, None)
        if gone:
            self._cached = None

    def snapshot(self) -> tuple[CollectiveStats, ...]:
        if self._cached is None:
            out = []
            for (job_id, pg, rank, op), acc in sorted(self._stats.items(), key=lambda kv: (
                    kv[0][0], kv[0][1], -1 if kv[0][2] is None else kv[0][2], kv[0][3])):
                cumulative, running = [], 0
                for count in acc.buckets:
                    running += count
                    cumulative.append(running)
                out.append(CollectiveStats(job_id=job_id, pg=pg, pg_desc=self._desc.get((job_id, pg), ""), op=op,
                                           rank=rank, bucket_counts=tuple(cumulative),
                                           duration_sum=acc.duration_sum, duration_count=acc.duration_count,
                                           bytes=acc.bytes))
            self._cached = tuple(out)
        return self._cached


GroupKey = tuple[str, str, int, str]  # job, PG name, hash of its sorted global ranks, recorder


@dataclass
class _Group:
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid of the incarnation its entries came from
    pending: dict[int, dict[int, tuple[float, float | None]]] = field(default_factory=dict)  # seq -> rank -> ...
    reported: dict[int, int] = field(default_factory=dict)  # rank -> highest seq seen
    windows: dict[int, deque[float]] = field(default_factory=dict)


class LatenessTracker:
    """Per (job, PG, rank): how many seconds after the PG's first local member it enqueued each collective.

    ``time_created_ns`` is the wall clock of the node at the call, on the rank's own thread, so the local
    ranks of a PG compare directly. Members on other nodes are not seen: the score is relative to the
    earliest *local* member.
    """

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        self.window = max(1, window)
        self._groups: dict[GroupKey, _Group] = {}

    def observe(self, key: GroupKey, members: Mapping[int, int], rank: int, entries: Iterable[FrEntry]) -> None:
        """``members``: local rank -> pid of every local member of the PG known now (the observing rank
        included). Arrivals are kept until every member has reported the collective, so a member whose
        manifest shows up later still gets matched with what the others reported before."""
        if rank not in members:
            return
        group = self._groups.setdefault(key, _Group())
        if any(group.pids.get(r, pid) != pid for r, pid in members.items()):
            # A member restarted: sequence numbers of two incarnations must never be matched.
            group.pending.clear()
            group.reported.clear()
            group.windows.clear()
        group.pids.update(members)
        lone = len(members) < 2
        if lone:
            # Nothing can settle: keep only the newest arrivals (entries come in record order).
            entries = list(entries)[-LONE_PENDING:]
        for entry in entries:
            if entry.is_p2p or entry.collective_seq_id <= 0 or entry.time_created_ns <= 0:
                continue
            seq = entry.collective_seq_id
            created = entry.time_created_ns / 1e9
            timeout = entry.timeout_ms / 1000.0 if entry.timeout_ms else None
            at = group.pending.setdefault(seq, {})
            # Coalesced groups share one seq: the first entry is when the rank arrived.
            if rank not in at or created < at[rank][0]:
                at[rank] = (created, timeout)
            group.reported[rank] = max(group.reported.get(rank, 0), seq)
        if not lone:
            self._settle(group, tuple(members))
        # A PG with one local member (across nodes: the usual case) never settles anything; keep only enough
        # for a peer whose manifest lists the PG a little later.
        self._trim(group, LONE_PENDING if lone else MAX_PENDING)

    def _settle(self, group: _Group, members: tuple[int, ...]) -> None:
        keep = {}
        for seq in sorted(group.pending):
            at = group.pending[seq]
            if all(m in at for m in members):
                self._score(group, at)
            elif not any(m not in at and group.reported.get(m, 0) > seq for m in members):
                keep[seq] = at
            # else a member went past seq without it: its entry fell out of the ring before we read it.
        # A new dict: one that had a whole ring pending keeps its big table after deletions.
        group.pending = keep

    @staticmethod
    def _trim(group: _Group, limit: int) -> None:
        if len(group.pending) > limit:
            group.pending = dict(sorted(group.pending.items())[-limit:])

    def _score(self, group: _Group, at: Mapping[int, tuple[float, float | None]]) -> None:
        first = min(created for created, _ in at.values())
        spread = max(created for created, _ in at.values()) - first
        timeouts = [t for _, t in at.values() if t]
        # Ranks cannot join the same collective further apart than the watchdog lets one wait: a wider
        # spread means the entries belong to different incarnations, not to one slow rank.
        if timeouts and spread > min(timeouts):
            return
        for rank, (created, _) in at.items():
            window = group.windows.setdefault(rank, deque(maxlen=self.window))
            window.append(created - first)

    @property
    def scored(self) -> bool:
        """Whether any rank has a score yet: most nodes never match a collective, and then the per-poll
        lookups are skipped."""
        return any(group.windows for group in self._groups.values())

    def score(self, key: GroupKey, rank: int) -> tuple[float | None, int]:
        """(trimmed mean lateness in seconds, samples), (None, 0) without local peers or samples."""
        group = self._groups.get(key)
        window = group.windows.get(rank) if group is not None else None
        if not window:
            return None, 0
        ordered = sorted(window)
        keep = ordered[: len(ordered) - int(len(ordered) * TRIM)] or ordered
        return sum(keep) / len(keep), len(window)

    def forget(self, live: set[GroupKey]) -> None:
        for key in [k for k in self._groups if k not in live]:
            del self._groups[key]


MIN_WAIT_SAMPLES = 20  # collectives a rank's wait needs before it is exported: fewer say nothing stable
WAIT_TRIM = 0.1  # share of the smallest and of the largest waits left out of the mean, each
MAX_WAIT = 3600.0  # seconds: a longer "wait" without a timeout to bound it is a clock jump, not a wait


def entry_wait(entry: FrEntry) -> float | None:
    """Seconds the rank spent inside one completed collective, from its own node's clock only; None where FR
    does not say (gloo, torch 2.15's hook without completion, an entry not completed).

    With NCCL timing on, ``duration_ms`` (start to end event on the GPU: the kernel spins until the last peer
    joins); otherwise completion discovered by the watchdog minus the call (an upper bound: discovery adds the
    watchdog's poll delay, the same on every rank, and the rank's own GPU backlog at the call).
    """
    if entry.is_p2p or entry.collective_seq_id <= 0:
        return None
    if entry.duration_ms is not None:
        wait = entry.duration_ms / 1000.0
    elif entry.state == "completed" and entry.time_discovered_completed_ns > 0 and entry.time_created_ns > 0:
        wait = (entry.time_discovered_completed_ns - entry.time_created_ns) / 1e9
    else:
        return None
    bound = entry.timeout_ms / 1000.0 if entry.timeout_ms else MAX_WAIT
    # Negative or longer than the watchdog lets one wait: the wall clock jumped between the two readings.
    return wait if 0.0 <= wait <= bound else None


@dataclass
class _Waits:
    pid: int
    last_seq: int = 0
    window: deque[float] = field(default_factory=deque)
    score: float | None = None  # the window's trimmed mean, until the window changes (scores are asked every poll)


class WaitTracker:
    """Per (job, PG, rank): how long the rank waited inside each of its recent collectives of the PG.

    Each value is a difference of two readings of one node's clock (or a GPU duration), so the figures of
    ranks on different nodes compare in Prometheus with no cross-node clock error: the rank that arrives last
    waits least, its peers wait for it (docs/durations.md, "Stragglers across nodes"). The score is a mean with the
    smallest and the largest tenth left out, so one late collective (a checkpoint) or one clock jump moves it
    by nothing; fewer than ``min_samples`` collectives give no score.
    """

    def __init__(self, window: int = DEFAULT_WINDOW, min_samples: int = MIN_WAIT_SAMPLES) -> None:
        self.window = max(1, window)
        self.min_samples = max(1, min_samples)
        self._ranks: dict[tuple[GroupKey, int], _Waits] = {}

    def observe(self, key: GroupKey, rank: int, pid: int, entries: Iterable[FrEntry]) -> None:
        """Settled entries of one rank incarnation (``pid``), in record order."""
        waits = self._ranks.get((key, rank))
        if waits is None or waits.pid != pid:
            # A new rank or a restart: the last incarnation's waits say nothing about this one.
            waits = self._ranks[(key, rank)] = _Waits(pid=pid, window=deque(maxlen=self.window))
        for entry in entries:
            seq = entry.collective_seq_id
            if seq <= waits.last_seq:
                continue  # coalesced entries share a seq: the first one is the rank's wait
            wait = entry_wait(entry)
            if wait is None:
                continue
            waits.last_seq = seq
            waits.window.append(wait)
            waits.score = None

    def score(self, key: GroupKey, rank: int) -> tuple[float | None, int]:
        """(trimmed mean wait in seconds, samples); None before ``min_samples``."""
        waits = self._ranks.get((key, rank))
        if waits is None or not waits.window:
            return None, 0
        n = len(waits.window)
        if n < self.min_samples:
            return None, n
        if waits.score is None:
            ordered = sorted(waits.window)
            cut = int(n * WAIT_TRIM)
            keep = ordered[cut: n - cut] or ordered
            waits.score = sum(keep) / len(keep)
        return waits.score, n

    def forget(self, live: set[GroupKey]) -> None:
        for k in [k for k in self._ranks if k[0] not in live]:
            del self._ranks[k]
