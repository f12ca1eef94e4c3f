"""Adaptive stuck thresholds: each process group's normal wait, learned from the job's own history.

A steady job whose collectives complete every 100 ms does not need a minute to know that a rank sleeping on
an empty queue is stuck; a job with legitimate long pauses needs the minute. So the ranks source feeds every
PG's history here, once per poll, and each PG gets

    threshold = min(ceiling, max(floor, multiple x quantile(samples)))

where the samples are the seconds between two observed advances of a rank's completed sequence (the gap,
measured on the monotonic clock, so a wall-clock step adds nothing) and the ages in-flight collectives had
when they were seen to complete. A PG with fewer than ``min_samples`` samples (cold start) gets the ceiling
(``--stuck-after``); the floor holds whatever the history says, so one sample, or a thousand tiny ones, never
makes a threshold shorter than the floor. See docs/detection.md.

A PG's history before the exporter watched it (a restart of the exporter in the middle of a hang, or a job
that was running before it) is in its ranks' Flight Recorder rings: ``history_samples`` replays one ring as
the live learner would have watched it, and ``ThresholdLearner.seed`` takes each rank's replay once.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from frexporter import defaults
from frexporter.fr.trace import FrEntry
from frexporter.spool import NATIVE_NCCL_BACKENDS

PGKey = tuple[str, str]  # (job_id, pg name)


@dataclass(frozen=True)
class ThresholdConfig:
    ceiling: float = defaults.STUCK_AFTER
    floor: float = defaults.STUCK_FLOOR
    multiple: float = defaults.STUCK_MULTIPLE
    quantile: float = defaults.STUCK_QUANTILE
    min_samples: int = defaults.STUCK_MIN_SAMPLES
    history: int = defaults.STUCK_HISTORY


def quantile(samples: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank, so always an observed value) of non-empty ``samples``."""
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[index]


def stuck_threshold(samples: Sequence[float], config: ThresholdConfig) -> float:
    """Seconds a collective of a PG with this history may wait before it counts as stuck (pure)."""
    ceiling = config.ceiling
    floor = min(config.floor, ceiling)  # a ceiling set below the floor wins: the user asked for it
    usable = [s for s in samples if math.isfinite(s) and s >= 0.0]
    if len(usable) < max(1, config.min_samples):
        return ceiling
    learned = config.multiple * quantile(usable, config.quantile)
    if not math.isfinite(learned):
        return ceiling
    return min(ceiling, max(floor, learned))


def _settled(entry: FrEntry) -> bool:
    """Whether an entry completed (as ``EntryCursor`` counts it): stock NCCL's only when it says so (retired
    without completing: timed out or aborted); every other backend's once it is completed or retired."""
    if entry.backend in NATIVE_NCCL_BACKENDS:
        return entry.state == "completed"
    return entry.done


def history_samples(entries: Iterable[FrEntry], period: float, until: float | None = None, lag: float = 0.0
                    ) -> tuple[float, ...]:
    """The samples the live learner would have taken of one PG, had it watched the history in ``entries`` (one
    recorder's ring of one rank, this PG's entries), polling every ``period`` seconds and reading counters up
    to ``lag`` seconds old; pure. Never shorter than the live learner's, within a poll's jitter.

    The live learner sees a PG's completed sequence advance at most once per poll (or per deep read, where
    only deep reads move it: the caller passes that spacing), so it learns gaps that are multiples of its
    period, one per poll that saw an advance, never one per collective: a replay on the same grid gives the
    same samples, where the raw spacing of the entries (a collective every 100 ms) would give shorter ones,
    and weight a rare pause less than the live learner does. The counters it reads are the rank's last
    snapshot's, up to a snapshot interval old (``lag``), whose grid drifts against the poll's: a gap it sees can
    be that much longer, so each sample is. Each replayed poll gives one sample: the gap since the last
    replayed advance, or, where longer, the age at that poll of a collective it saw complete (the live
    learner's wait samples; it takes them from fewer collectives, so this is never less). Completion times:
    NCCL's own (``time_discovered_completed_ns``, its watchdog's, which also moves the counters the live
    learner reads); otherwise (gloo records none) the creation of the PG's next collective, when a rank that
    waits for each collective has returned from it: an upper bound, so gaps keep their lengths and waits are
    never shorter than they were.

    The replay ends before the first collective not complete: the wait in progress (a hang's own) is never a
    sample; and at ``until`` (FR's wall clock), where the live learner began watching the rank's PG (what it
    saw itself must not count twice). Like the live learner's first sight, the first replayed completion is no
    sample. Times are FR's wall clock: a step back is dropped (``ThresholdLearner.observe``), a step forward
    can only lengthen a gap (a longer threshold, never a shorter one).
    """
    if not (period > 0.0 and math.isfinite(period) and lag >= 0.0 and math.isfinite(lag)):
        return ()
    # seq -> [creation of its first entry, completion of its last (0: some entry has none), all settled]:
    # coalesced entries share one seq, done when all are, arrived with the first (ns, FR's clock)
    by_seq: dict[int, list[int]] = {}
    for entry in entries:
        seq = entry.collective_seq_id
        if entry.is_p2p or seq <= 0 or entry.time_created_ns <= 0:
            continue
        settled = int(_settled(entry))
        found = by_seq.get(seq)
        if found is None:
            by_seq[seq] = [entry.time_created_ns, entry.time_discovered_completed_ns, settled]
        else:
            found[0] = min(found[0], entry.time_created_ns)
            completed_ns = entry.time_discovered_completed_ns
            found[1] = max(found[1], completed_ns) if found[1] and completed_ns else 0
            found[2] &= settled
    seqs = sorted(by_seq)
    events: list[tuple[float, float]] = []  # (completed, created) of each completed collective, in seq order
    for i, seq in enumerate(seqs):
        created_ns, completed_ns, settled = by_seq[seq]
        if not settled:
            break
        created = created_ns / 1e9
        if completed_ns:
            completed = max(created, completed_ns / 1e9)
        elif i + 1 < len(seqs):
            completed = max(created, by_seq[seqs[i + 1]][0] / 1e9)
        else:
            break  # the newest, with nothing after it to bound when it completed
        if until is not None and completed > until:
            break
        events.append((completed, created))
    if len(events) < 2:
        return ()
    events.sort()
    start = events[0][0]
    polls: dict[int, float] = {}  # replayed poll (index from the first completion) -> the oldest creation seen
    for completed, created in events:
        index = math.ceil((completed - start) / period - 1e-6)  # one on the grid is seen by that poll
        polls[index] = min(created, polls.get(index, created))
    samples = []
    last = 0
    for index in sorted(polls):
        if index <= 0:
            continue  # the first sight
        at = start + index * period
        samples.append(max(at - (start + last * period), at - polls[index]) + lag)
        last = index
    return tuple(samples)


class ThresholdLearner:
    """Per-PG sample windows, fed by the ranks source each poll; forgets a PG as soon as no rank lists it."""

    def __init__(self, config: ThresholdConfig) -> None:
        self.config = config
        self._samples: dict[PGKey, deque[float]] = {}
        self._cache: dict[PGKey, tuple[float, float | None]] = {}

    def seed(self, key: PGKey, samples: Sequence[float]) -> None:
        """One rank's history of the PG from before the live learner watched it (``history_samples`` of the
        rank's first deep read), as the live learner would have sampled it: so a restarted exporter does not
        fall back to the cold start. The caller hands each rank's history once, cut where the live learner began
        watching that rank's PG (it takes its own samples from then on). Placed before the live samples, as the
        older: the window keeps the newest."""
        usable = [s for s in samples if math.isfinite(s) and s >= 0.0]
        if usable:
            live = self._samples.get(key, ())
            self._samples[key] = deque([*usable, *live], maxlen=max(1, self.config.history))
            self._cache.pop(key, None)

    def observe(self, key: PGKey, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0.0:
            return  # a counter reset or a bad clock reading is no evidence of anything
        window = self._samples.get(key)
        if window is None:
            window = self._samples[key] = deque(maxlen=max(1, self.config.history))
        window.append(seconds)
        self._cache.pop(key, None)

    def normal_wait(self, key: PGKey) -> float | None:
        """The PG's normal wait (the learned quantile of its samples); None until ``min_samples`` were seen."""
        return self._learned(key)[1]

    def threshold(self, key: PGKey) -> float:
        return self._learned(key)[0]

    def _learned(self, key: PGKey) -> tuple[float, float | None]:
        """(threshold, normal wait), sorted once per PG per change of its samples: every rank of the PG asks
        both on every poll (1,024 asks a poll at 64 ranks x 16 PGs)."""
        found = self._cache.get(key)
        if found is None:
            samples = self._samples.get(key, ())
            usable = [s for s in samples if math.isfinite(s) and s >= 0.0]
            normal = quantile(usable, self.config.quantile) if len(usable) >= max(1, self.config.min_samples) else None
            found = self._cache[key] = (stuck_threshold(samples, self.config), normal)
        return found

    def samples(self, key: PGKey) -> int:
        return len(self._samples.get(key, ()))

    def retain(self, live: Iterable[PGKey]) -> None:
        """Drop the history of every PG not in ``live`` (destroyed, or its job gone)."""
        keep = set(live)
        for key in [k for k in self._samples if k not in keep]:
            del self._samples[key]
            self._cache.pop(key, None)
