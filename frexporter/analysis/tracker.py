"""Which verdicts appeared and which cleared between evaluations (explicit state, no I/O, no clock).

The exporter logs once when a verdict appears and once when it clears. A verdict
is keyed by (kind, job_id, pg, seq, culprit ranks): its age, waiting ranks and
summary change every poll without making it a new verdict. ``confirm_after``
holds a new key back until it has been seen that long (a one-poll blip is never
logged); ``clear_after`` keeps an active key until it has been absent that long
(a one-poll gap does not log a clear and a new appear).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from frexporter import defaults
from frexporter.analysis.verdicts import Verdict, verdict_sort_key

VerdictKey = tuple[str, str, str, int, tuple[int, ...]]


def verdict_key(verdict: Verdict) -> VerdictKey:
    return (verdict.kind, verdict.job_id, verdict.pg, verdict.seq, verdict.ranks)


@dataclass(frozen=True)
class TrackerUpdate:
    appeared: tuple[Verdict, ...]
    cleared: tuple[Verdict, ...]  # the last version seen of each
    active: tuple[Verdict, ...]  # confirmed and not cleared, latest version of each


@dataclass
class _Seen:
    verdict: Verdict
    first_seen: float
    last_seen: float


class VerdictTracker:
    def __init__(self, confirm_after: float = defaults.VERDICT_CONFIRM_AFTER, clear_after: float = 0.0) -> None:
        self.confirm_after = confirm_after
        self.clear_after = clear_after
        self._pending: dict[VerdictKey, _Seen] = {}
        self._active: dict[VerdictKey, _Seen] = {}

    @property
    def active(self) -> tuple[Verdict, ...]:
        return _ordered(s.verdict for s in self._active.values())

    def update(self, verdicts: Iterable[Verdict], now: float) -> TrackerUpdate:
        current = {verdict_key(v): v for v in verdicts}
        appeared = [v for key, v in current.items() if self._see(key, v, now)]
        # A pending key that vanished before it was confirmed was a blip: forget it silently.
        self._pending = {k: s for k, s in self._pending.items() if k in current}
        gone = [k for k, s in self._active.items() if k not in current and now - s.last_seen >= self.clear_after]
        cleared = [self._active.pop(k).verdict for k in gone]
        return TrackerUpdate(_ordered(appeared), _ordered(cleared), self.active)

    def _see(self, key: VerdictKey, verdict: Verdict, now: float) -> bool:
        """Record a sighting; True when it makes the key active."""
        active = self._active.get(key)
        if active is not None:
            active.verdict, active.last_seen = verdict, now
            return False
        seen = self._pending.setdefault(key, _Seen(verdict, now, now))
        seen.verdict, seen.last_seen = verdict, now
        if now - seen.first_seen < self.confirm_after:
            return False
        self._active[key] = self._pending.pop(key)
        return True


def _ordered(verdicts: Iterable[Verdict]) -> tuple[Verdict, ...]:
    return tuple(sorted(verdicts, key=verdict_sort_key))
