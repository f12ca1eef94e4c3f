"""When a rank arrives at a PG's collectives, on a schedule every node keeps without talking to the others.

The cross-node straggler signal where Flight Recorder has no completion (gloo): ``time_created_ns`` of a
collective is the node's wall clock when the rank called it, so the same collective's calls on two nodes compare
up to the nodes' clock offset (docs/durations.md, "Arrivals across nodes"). Prometheus scrapes nodes at
different instants, and a fast PG moves on by hundreds of collectives between two scrapes, so "the rank's last
call" would compare different collectives. Instead every node picks the same collectives by itself: each
``ARRIVAL_GRID`` seconds of wall clock is a grid instant; its block is the ``ARRIVAL_BLOCK`` collectives (by
sequence number, aligned to multiples of the block) around the first collective the rank called at or after the
instant; a rank's arrival is the mean call time over that block. Ranks of a PG pick the same block unless their
calls straddle a block boundary at the instant (their lateness plus the clock offset, out of a block's length):
the rule leaves out a rank whose arrival is half a block away from its peers'.

Prometheus must then compare the same instant of every node although it scrapes them at different moments: the
exporter reads every rank's ring ``ARRIVAL_READ_AFTER`` seconds after each instant (``read_point``; the ranks
source schedules those deep reads), reports the instant's block from ``ARRIVAL_DELAY`` seconds after it for one
grid period, and stamps the sample with that time (``sample_time``) rather than the scrape's. With a scrape at
least every grid period, every node's sample of an instant is in Prometheus one grid period after its stamp, and
the rule, reading the series ``offset`` one grid period, sees the same instant on every node.

A pause that every rank sees (an evaluation on one rank, which its peers wait out in the next collective; a
checkpoint) puts one long gap between two calls of every rank, next to the same block: a block with a gap longer
than ``PAUSE_GAPS`` times the rank's usual gap next to it is skipped, and so is a block not read yet; the rank's
last block (with its own stamp) then stands for up to ``ARRIVAL_HOLD`` grid periods.

Plain state driven by the poll thread; the poll's ``now`` comes in, no clock is read here.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from frexporter.fr.trace import FrEntry
from frexporter.sources.collectives import GroupKey

ARRIVAL_BLOCK = 4  # collectives per block; the rule's alignment margin reads it (frexporter.rules.yml)
ARRIVAL_GRID = 15.0  # seconds of wall clock between grid instants: at most the scrape interval (the rule's offset)
ARRIVAL_READ_AFTER = 3.0  # seconds after an instant every rank's ring is read: its block is over by then at 2/s
ARRIVAL_DELAY = 6.0  # seconds after its instant a block is reported and stamped: that read has settled
ARRIVAL_READ_SHARE = 0.008  # most of a rank's time the read points' deep reads may take (4 x deep_read_share)
ARRIVAL_HOLD = 3  # grid periods a rank's last block stands in for blocks skipped or not read yet
PAUSE_GAPS = 4.0  # a gap between calls this many times the usual one is a pause, not a step
GAP_HISTORY = 64  # calls before a block whose gaps make "the usual gap" (their median)
ARRIVAL_KEEP = 4096  # call times kept per rank and PG: back to the due instant up to ~100 collectives a second


@dataclass
class _Calls:
    pid: int
    seqs: list[int] = field(default_factory=list)  # ascending
    created: dict[int, float] = field(default_factory=dict)  # seq -> unix seconds of the call
    cached: tuple[float, tuple[float, float] | None] | None = None  # (grid instant due, its answer)
    last: tuple[float, float] | None = None  # (grid instant, arrival) of the newest block reported


def grid_instant(now: float) -> float:
    """The newest grid instant whose block is due at ``now``."""
    return math.floor((now - ARRIVAL_DELAY) / ARRIVAL_GRID) * ARRIVAL_GRID


def sample_time(instant: float) -> float:
    """The time an instant's arrival is stamped with: when it became due, the same on every node."""
    return instant + ARRIVAL_DELAY


def read_point(now: float) -> float:
    """The newest moment at or before ``now`` at which every rank's ring is to have been read (a grid instant
    plus ``ARRIVAL_READ_AFTER``): a rank last read before it is due a deep read."""
    return math.floor((now - ARRIVAL_READ_AFTER) / ARRIVAL_GRID) * ARRIVAL_GRID + ARRIVAL_READ_AFTER


class ArrivalTracker:
    """Per (job, PG, rank): the mean call time of the collectives of the current grid instant's block."""

    def __init__(self, keep: int = ARRIVAL_KEEP) -> None:
        self.keep = max(ARRIVAL_BLOCK * 4, keep)
        self._ranks: dict[tuple[GroupKey, int], _Calls] = {}

    def observe(self, key: GroupKey, rank: int, pid: int, entries: Iterable[FrEntry]) -> None:
        """Entries of one rank incarnation (``pid``) new since the last read, in record order."""
        calls = self._ranks.get((key, rank))
        if calls is None or calls.pid != pid:
            # A new rank or a restart: sequence numbers start over, the last incarnation's calls are another job.
            calls = self._ranks[(key, rank)] = _Calls(pid=pid)
        added = False
        for entry in entries:
            seq = entry.collective_seq_id
            if entry.is_p2p or seq <= 0 or entry.time_created_ns <= 0 or seq in calls.created:
                continue  # p2p has no common collective; coalesced entries share a seq: the first is the call
            calls.created[seq] = entry.time_created_ns / 1e9
            if calls.seqs and seq < calls.seqs[-1]:
                bisect.insort(calls.seqs, seq)
            else:
                calls.seqs.append(seq)
            added = True
        if added:
            calls.cached = None
            if len(calls.seqs) > self.keep:
                for old in calls.seqs[: len(calls.seqs) - self.keep]:
                    del calls.created[old]
                calls.seqs = calls.seqs[len(calls.seqs) - self.keep:]

    def arrival(self, key: GroupKey, rank: int, now: float) -> tuple[float, float] | None:
        """(unix seconds: the rank's mean call time over the block of the grid instant due at ``now``, the
        sample's stamp); an earlier instant's for up to ARRIVAL_HOLD grid periods where this one's block is
        skipped or not read; None when the rank has no call at or after the instant (an idle PG) either."""
        calls = self._ranks.get((key, rank))
        if calls is None or not calls.seqs:
            return None
        instant = grid_instant(now)
        if calls.cached is None or calls.cached[0] != instant:
            value = _block_mean(calls, instant)
            if value is not None:
                calls.last = (instant, value)
            answer = None
            if calls.last is not None and 0 <= instant - calls.last[0] <= ARRIVAL_HOLD * ARRIVAL_GRID:
                answer = (calls.last[1], sample_time(calls.last[0]))
            calls.cached = (instant, answer)
        return calls.cached[1]

    def forget(self, live: set[GroupKey]) -> None:
        for k in [k for k in self._ranks if k[0] not in live]:
            del self._ranks[k]


def _block_mean(calls: _Calls, instant: float) -> float | None:
    # Calls are in seq order and, on one rank's thread, in time order too (a clock step back breaks that for a
    # moment: the first call at or after the instant is then still one the rank made after it).
    first = next((s for s in calls.seqs if calls.created[s] >= instant), None)
    if first is None:
        return None
    if first > 1 and first - 1 not in calls.created:
        return None  # the calls just before the instant are gone (ring wrap, memory bound): first may not be first
    start = first - first % ARRIVAL_BLOCK
    times = [calls.created.get(s) for s in range(start, start + ARRIVAL_BLOCK)]
    if start == 0:
        times = times[1:]  # seqs start at 1: the first block is one short on every rank alike
    if any(t is None for t in times):
        return None  # a call fell out of the ring unread, or the block is not over yet
    if _paused(calls, start):
        return None
    return sum(t for t in times if t is not None) / len(times)


def _paused(calls: _Calls, start: int) -> bool:
    """Whether a gap between two calls from just before the block to just after it is a pause: PAUSE_GAPS times
    the median gap of the GAP_HISTORY calls before the block. The rank that paused has the long gap before its
    late call, its peers after theirs: both sides of the block's calls are looked at, so all skip the same one."""
    history = [calls.created.get(s) for s in range(max(1, start - GAP_HISTORY), start)]
    gaps = sorted(b - a for a, b in itertools.pairwise(history) if a is not None and b is not None)
    if len(gaps) < 8:
        return False  # too little history to say what is usual (a new rank): take the block
    usual = gaps[len(gaps) // 2]
    around = [calls.created.get(s) for s in range(start - 1, start + ARRIVAL_BLOCK + 1)]
    return any(b - a > PAUSE_GAPS * max(usual, 1e-3)
               for a, b in itertools.pairwise(around) if a is not None and b is not None)
