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
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from frexporter import defaults

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


class ThresholdLearner:
    """Per-PG sample windows, fed by the ranks source each poll; forgets a PG as soon as no rank lists it."""

    def __init__(self, config: ThresholdConfig) -> None:
        self.config = config
        self._samples: dict[PGKey, deque[float]] = {}
        self._cache: dict[PGKey, float] = {}

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
        usable = [s for s in self._samples.get(key, ()) if math.isfinite(s) and s >= 0.0]
        if len(usable) < max(1, self.config.min_samples):
            return None
        return quantile(usable, self.config.quantile)

    def threshold(self, key: PGKey) -> float:
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = stuck_threshold(self._samples.get(key, ()), self.config)
        return found

    def samples(self, key: PGKey) -> int:
        return len(self._samples.get(key, ()))

    def retain(self, live: Iterable[PGKey]) -> None:
        """Drop the history of every PG not in ``live`` (destroyed, or its job gone)."""
        keep = set(live)
        for key in [k for k in self._samples if k not in keep]:
            del self._samples[key]
            self._cache.pop(key, None)
