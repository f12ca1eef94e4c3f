"""Stragglers: a rank that, collective after collective, arrives well after its peers (pure).

The input is the per-rank lateness score the ranks source computes (``PGState.lateness_seconds``: mean
seconds it enqueued a PG's collectives after the PG's first local member did, over recent collectives).
A rank is a straggler of a PG when its score is above ``max(min_lateness, factor x median of its peers'
scores)`` over at least ``min_samples`` collectives. The floor keeps ordinary jitter (data loader, Python
GC, a rank that logs) quiet; comparing against the peers' median keeps a PG where everybody is a little
late for its own reasons quiet too.

The score is relative to the earliest *local* member, so it needs two or more ranks of the PG on one node;
a PG with one rank per node never yields a straggler here.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from frexporter.analysis.findings import RankKey
from frexporter.model import RANK_OK, PGState, RankState


@dataclass(frozen=True)
class StragglerConfig:
    min_lateness: float = 1.0  # seconds; below this nobody is a straggler
    factor: float = 3.0  # how many times the peers' median lateness a straggler must exceed
    min_samples: int = 20  # collectives the score must cover


@dataclass(frozen=True)
class Straggler:
    job_id: str
    pg: str
    pg_desc: str
    culprits: tuple[int, ...]
    peers: tuple[int, ...]  # the other ranks of the PG with a score: they wait for the culprits
    lateness: Mapping[int, float]  # every scored rank of the PG
    samples: Mapping[int, int]
    peer_median: float  # median score of the non-culprit ranks
    threshold: float  # the lowest culprit's threshold
    timeout_seconds: float | None


def find_stragglers(ranks: Mapping[RankKey, RankState], conditions: Mapping[RankKey, str],
                    config: StragglerConfig) -> list[Straggler]:
    """One ``Straggler`` per (job, PG) that has any, in (job, PG) order."""
    groups: dict[tuple[str, str, tuple[int, ...]], dict[int, PGState]] = {}
    for (job_id, rank), state in ranks.items():
        for pg in state.pgs:
            if pg.lateness_seconds is not None:
                groups.setdefault((job_id, pg.name, tuple(sorted(pg.ranks))), {})[rank] = pg
    out = []
    for (job_id, name, _), scored in sorted(groups.items()):
        if len(scored) < 2:
            continue
        lateness = {r: pg.lateness_seconds for r, pg in scored.items() if pg.lateness_seconds is not None}
        culprits, thresholds = [], []
        for r, pg in sorted(scored.items()):
            # A down or wedged rank has its own verdict; its score only describes the past.
            if conditions.get((job_id, r)) != RANK_OK or pg.lateness_samples < config.min_samples:
                continue
            threshold = max(config.min_lateness,
                            config.factor * statistics.median(v for p, v in lateness.items() if p != r))
            if lateness[r] > threshold:
                culprits.append(r)
                thresholds.append(threshold)
        if not culprits:
            continue
        peers = tuple(r for r in sorted(scored) if r not in culprits)
        any_pg = next(iter(scored.values()))
        out.append(Straggler(
            job_id=job_id, pg=name, pg_desc=next((pg.desc for pg in scored.values() if pg.desc), ""),
            culprits=tuple(culprits), peers=peers, lateness=lateness,
            samples={r: pg.lateness_samples for r, pg in scored.items()},
            peer_median=statistics.median(lateness[r] for r in peers) if peers else 0.0,
            threshold=min(thresholds), timeout_seconds=any_pg.timeout_seconds,
        ))
    return out


# The cross-node ranking, as frexporter.rules.yml's FrexporterStraggler and the PG dashboard take it from
# frexporter_rank_collective_wait_seconds (NCCL) and frexporter_rank_collective_arrival_timestamp_seconds (gloo)
# (tests/unit/test_collective_waits.py and test_arrival_ranking.py hold them to the rule's numbers).
WAIT_MAD_FACTOR = 4.0  # a straggler's lag exceeds this many median absolute deviations of the PG's lags
WAIT_MIN_LAG = 0.005  # seconds: and at least this much
WAIT_MIN_RANKS = 3  # ranks of the PG with a lag: two cannot say which one is off
SIGNAL_WAIT = "wait"  # ranked by waits inside collectives (NCCL)
SIGNAL_ARRIVAL = "arrival"  # ranked by arrival times at a block of collectives (gloo)
# A rank whose calls straddled a block boundary reports the neighbouring block of ARRIVAL_BLOCK collectives
# (frexporter/sources/arrivals.py, which this layer may not import: a test holds the two equal), a whole block
# away from its peers; the rule leaves out a rank more than half a block, this many collectives over the rank's
# collectives per second, from the PG's median.
ARRIVAL_HALF_BLOCK = 2.0
# Where no rate is known for a rank nor any peer of its PG (series scraped once in the last minute), a rank past
# this many seconds from the median is left out instead. A genuine lag is at most a collective's period (the peers
# wait it out in every collective), so at any PG of more than 1 collective a second this drops no real lag, and it
# drops a neighbouring block (4 collectives away) at any PG slower than 4 a second; at a faster PG a neighbouring
# block may stay in, at a slower one a real lag may go.
ARRIVAL_MAX_LAG = 1.0

PGKey = tuple[str, str]  # (job id, PG)
RatesByRank = Mapping[tuple[str, int, str], float]  # (job id, rank, PG) -> collectives a second


@dataclass(frozen=True)
class WaitLag:
    """One rank of a PG in the cross-node ranking, by ``signal``: ``lag`` is about how long each collective of
    the PG waits for the rank; ``straggler`` when the lag clears the robust margin.

    By waits (SIGNAL_WAIT, NCCL): ``wait`` is the rank's mean wait inside the PG's collectives and ``lag`` the
    PG's median wait minus it. By arrivals (SIGNAL_ARRIVAL, gloo): ``arrival`` is the rank's mean call time (unix
    seconds, its node's clock) over the PG's current block, ``lag`` it minus the PG's median, and ``wait`` None."""

    job_id: str
    pg: str
    pg_desc: str
    rank: int
    wait: float | None
    lag: float
    straggler: bool
    signal: str = SIGNAL_WAIT
    arrival: float | None = None


def _usable(value: float | None) -> bool:
    # Neither a wait nor a unix time is negative or no number; one such would move a median.
    return value is not None and math.isfinite(value) and value >= 0


def wait_ranking(ranks: Sequence[RankState], rates: RatesByRank | None = None) -> list[WaitLag]:
    """Every rank with a lag, per PG with at least WAIT_MIN_RANKS of them, last arriver (largest lag) first
    within its PG, PGs with a straggler first. A PG is ranked by its ranks' waits (``PGState.wait_seconds``)
    where any has one, else by their arrivals (``PGState.arrival_timestamp``); ``rates``: each rank's
    collectives a second in the PG, which says how far a neighbouring block of arrivals is (None: unknown). The
    rule additionally asks the lag to cost 5 % of the PG's time, for 15 s, which one instant cannot say: this is
    the ranking, not the alert."""
    waits: dict[PGKey, dict[int, tuple[float, str]]] = {}
    arrivals: dict[PGKey, dict[int, tuple[float, str]]] = {}
    for r in ranks:
        for pg in r.pgs:
            if pg.wait_seconds is not None and _usable(pg.wait_seconds):
                waits.setdefault((r.job_id, pg.name), {})[r.rank] = (pg.wait_seconds, pg.desc)
            elif pg.arrival_timestamp is not None and _usable(pg.arrival_timestamp):
                arrivals.setdefault((r.job_id, pg.name), {})[r.rank] = (pg.arrival_timestamp, pg.desc)
    groups: list[list[WaitLag]] = []
    for key in sorted(waits.keys() | arrivals.keys()):
        rows = _by_wait(key, waits[key]) if key in waits else _by_arrival(key, arrivals[key], rates or {})
        if rows:
            groups.append(sorted(rows, key=lambda row: (-row.lag, row.rank)))
    groups.sort(key=lambda rows: not any(row.straggler for row in rows))
    return [row for rows in groups for row in rows]


def _is_straggler(lag: float, mad: float) -> bool:
    return lag > WAIT_MAD_FACTOR * mad and lag > WAIT_MIN_LAG


def _by_wait(key: PGKey, waits: Mapping[int, tuple[float, str]]) -> list[WaitLag]:
    """The last arriver waits least: lag = the PG's median wait minus the rank's own."""
    if len(waits) < WAIT_MIN_RANKS:
        return []
    median = statistics.median(w for w, _ in waits.values())
    mad = statistics.median(abs(w - median) for w, _ in waits.values())
    return [WaitLag(job_id=key[0], pg=key[1], pg_desc=desc, rank=rank, wait=w, lag=median - w,
                    straggler=_is_straggler(median - w, mad))
            for rank, (w, desc) in waits.items()]


def _by_arrival(key: PGKey, arrivals: Mapping[int, tuple[float, str]], rates: RatesByRank) -> list[WaitLag]:
    """The last arriver calls latest: lag = the rank's arrival minus the PG's median, as the rule takes it: the
    median over every rank, a rank further than half a block from it left out, the MAD over those kept."""
    if len(arrivals) < WAIT_MIN_RANKS:
        return []
    job_id, pg = key
    median = statistics.median(a for a, _ in arrivals.values())
    # Ranks of a PG call the same collectives: a rank without a rate of its own (its series is younger) runs at
    # its peers'.
    known = [rate for rank in arrivals if (rate := rates.get((job_id, rank, pg))) is not None]
    peers = statistics.median(known) if known else None
    kept = {rank: (a - median, a, desc) for rank, (a, desc) in arrivals.items()
            if abs(a - median) <= _half_block_seconds(rates.get((job_id, rank, pg), peers))}
    if len(kept) < WAIT_MIN_RANKS:  # the rule counts the ranks with a lag
        return []
    mad = statistics.median(abs(lag) for lag, _, _ in kept.values())
    return [WaitLag(job_id=job_id, pg=pg, pg_desc=desc, rank=rank, wait=None, lag=lag,
                    straggler=_is_straggler(lag, mad), signal=SIGNAL_ARRIVAL, arrival=a)
            for rank, (lag, a, desc) in kept.items()]


def _half_block_seconds(rate: float | None) -> float:
    """Half a block of arrivals in seconds at ``rate`` collectives a second; at 0 (an idle PG) nothing is left out,
    as the rule's 2 / 0 is +Inf."""
    if rate is None or not math.isfinite(rate) or rate < 0:
        return ARRIVAL_MAX_LAG
    return math.inf if rate == 0 else ARRIVAL_HALF_BLOCK / rate
