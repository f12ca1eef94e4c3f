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

import statistics
from collections.abc import Mapping
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
# frexporter_rank_collective_wait_seconds (tests/unit/test_collective_waits.py holds them to the rule's numbers).
WAIT_MAD_FACTOR = 4.0  # a straggler's lag exceeds this many median absolute deviations of the PG's waits
WAIT_MIN_LAG = 0.005  # seconds: and at least this much
WAIT_MIN_RANKS = 3  # ranks of the PG with a wait: two cannot say which one is off


@dataclass(frozen=True)
class WaitLag:
    """One rank of a PG in the cross-node ranking: ``lag`` is the PG's median wait minus the rank's own, about
    how long each collective of the PG waits for it; ``straggler`` when the lag clears the robust margin."""

    job_id: str
    pg: str
    pg_desc: str
    rank: int
    wait: float
    lag: float
    straggler: bool


def wait_ranking(ranks: tuple[RankState, ...] | list[RankState]) -> list[WaitLag]:
    """Every rank with a wait (``PGState.wait_seconds``), per PG with at least WAIT_MIN_RANKS of them, last
    arriver (largest lag) first within its PG, PGs with a straggler first. The rule additionally asks the lag to
    cost 5 % of the PG's time for 5 minutes, which one instant cannot say: this is the ranking, not the alert."""
    by_pg: dict[tuple[str, str], dict[int, tuple[float, str]]] = {}
    for r in ranks:
        for pg in r.pgs:
            if pg.wait_seconds is not None and pg.wait_seconds == pg.wait_seconds and pg.wait_seconds >= 0:
                by_pg.setdefault((r.job_id, pg.name), {})[r.rank] = (pg.wait_seconds, pg.desc)
    groups: list[list[WaitLag]] = []
    for (job_id, name), waits in sorted(by_pg.items()):
        if len(waits) < WAIT_MIN_RANKS:
            continue
        median = statistics.median(w for w, _ in waits.values())
        mad = statistics.median(abs(w - median) for w, _ in waits.values())
        rows = [WaitLag(job_id=job_id, pg=name, pg_desc=desc, rank=rank, wait=w, lag=median - w,
                        straggler=median - w > WAIT_MAD_FACTOR * mad and median - w > WAIT_MIN_LAG)
                for rank, (w, desc) in waits.items()]
        groups.append(sorted(rows, key=lambda row: (-row.lag, row.rank)))
    groups.sort(key=lambda rows: not any(row.straggler for row in rows))
    return [row for rows in groups for row in rows]
