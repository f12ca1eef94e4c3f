"""A rank's process groups: torch's counters and the last deep read -> PGState, and the samples of each PG's
normal wait that its stuck threshold is learned from. Pure: no I/O, no clock (the caller passes ``now``, the
wall clock, and ``mono``, the monotonic clock); what carries from one poll to the next is a ``PGMemory`` in,
a new one out.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

from frexporter.fr.domain import DeepView
from frexporter.model import RANK_UNRESPONSIVE, InflightCollective, PGState
from frexporter.spool import RECORDER_NCCL, Manifest, PGEntry, RawPGStatus, Snapshot

Statuses = dict[str, dict[int, RawPGStatus]]  # recorder -> PG id -> torch's raw counters
Seen = Mapping[tuple[int, float], tuple[float, float]]  # (seq, created) -> (age when first seen, mono then)


@dataclass(frozen=True)
class PGMemory:
    """What one PG's state carries from one poll to the next."""

    last_completed: int | None = None
    last_progress: float | None = None  # wall clock of the last advance (exported)
    progress_mono: float | None = None  # the monotonic time of the last advance (or first sight): gap samples
    # (seq, created) of an in-flight entry -> its age in seconds and our monotonic time when first seen
    seen_inflight: Seen = field(default_factory=dict)
    # The wall clock of the first sight: the live learner samples the PG from then on, a replay of the rank's
    # FR ring (thresholds.history_samples) only what came before
    watched_since: float | None = None


def snapshot_statuses(snap: Snapshot | None) -> Statuses:
    if snap is None:
        return {}
    return {recorder: dict(statuses) for recorder, statuses in snap.status.items()}


def judged_statuses(status: str, snap: Snapshot | None, deep_raw: Statuses) -> Statuses:
    """The counters a rank's PGs are judged by: its snapshot's, or, while its Python is wedged and its C++ worker
    server answered a deep read, that read's (the fresh ones)."""
    if status == RANK_UNRESPONSIVE and deep_raw:
        return {recorder: dict(statuses) for recorder, statuses in deep_raw.items()}
    return snapshot_statuses(snap)


def predicted_name(manifest: Manifest, recorder: str, pg_id: int) -> str | None:
    for pg in manifest.process_groups:
        if pg.local_ids.get(recorder) == pg_id:
            return pg.name
    return None


def pg_name(learned_ids: Mapping[str, Mapping[int, str]], manifest: Manifest, recorder: str, pg_id: int
            ) -> str | None:
    """A PG's name: as a deep read told it, else as the manifest's table predicts it."""
    return learned_ids.get(recorder, {}).get(pg_id) or predicted_name(manifest, recorder, pg_id)


def choose(raw: Statuses, learned_ids: Mapping[str, Mapping[int, str]], manifest: Manifest,
           nccl_ids: Collection[tuple[str, int]] = ()) -> dict[str, tuple[str, int, RawPGStatus]]:
    """PG name -> (recorder, PG id, counters) of each named PG. NCCL's recorder is the one that sees GPU
    collectives: it is preferred where a PG has both, and so is any (recorder, PG id) in ``nccl_ids``, those a
    deep read found recorded by an NCCL-family backend elsewhere (torch 2.15's nccl2, whose entries torch's
    FlightRecorderHook writes to a recorder of its own: spool.is_nccl_backend)."""
    candidates = [(recorder, pg_id, status) for recorder in raw for pg_id, status in raw[recorder].items()]
    candidates.sort(key=lambda c: (c[0] != RECORDER_NCCL and (c[0], c[1]) not in nccl_ids,
                                   c[0] != RECORDER_NCCL))  # stable: each recorder's own order otherwise
    chosen: dict[str, tuple[str, int, RawPGStatus]] = {}
    for recorder, pg_id, status in candidates:
        name = pg_name(learned_ids, manifest, recorder, pg_id)
        if name is None or name in chosen:
            continue
        chosen[name] = (recorder, pg_id, status)
    return chosen


def pg_state(entry: PGEntry, recorder: str, status: RawPGStatus, deep: DeepView | None, has_p2p: bool,
             memory: PGMemory, now: float, mono: float) -> tuple[PGState, PGMemory]:
    """One PG's state from torch's counters ``status`` and the last deep read ``deep``, and the memory after it."""
    exact = True
    inflight: tuple[InflightCollective, ...] = ()
    if deep is not None and deep.known and deep.raw == status:
        enqueued, started, completed = deep.enqueued, deep.started, deep.completed
        inflight = deep.inflight
    elif not has_p2p and (deep is None or deep.raw_completes):
        enqueued, started, completed = status.enqueued, status.started, status.completed
        if deep is not None:
            inflight = tuple(c for c in deep.inflight if completed < c.seq <= enqueued)
    else:
        assert deep is not None
        enqueued, started, completed = deep.enqueued, deep.started, deep.completed
        exact = False
        # p2p traffic keeps torch's raw counters off the collective domain, and a backend that keeps no
        # completion counter (torch 2.15's FlightRecorderHook without a completion hook) leaves them
        # meaningless, so values stay as of the last deep read. Its in-flight entries are still in flight
        # only while nothing completed since: once the rank completes anything, reporting them would show a
        # finished collective waiting for ever longer (a phantom wait the desync alert would page on). Without
        # a completion counter, a rank that issued more since has issued those (they are retired at issue).
        moved = status.completed != deep.raw.completed if deep.raw_completes else status.enqueued != deep.raw.enqueued
        inflight = () if moved else deep.inflight
    inflight, seen = steady_ages(memory.seen_inflight, inflight, now, mono)
    last_progress = memory.last_progress
    if memory.last_completed is not None and completed != memory.last_completed:
        last_progress = now
    elif last_progress is None and deep is not None and deep.completed_created is not None and completed > 0:
        last_progress = min(now, deep.completed_created)  # first sight: a lower bound from FR
    timeout = entry.timeout_seconds
    if deep is not None and deep.timeout_seconds:
        timeout = deep.timeout_seconds
    desc = entry.desc or (deep.desc if deep is not None else "")
    state = PGState(
        name=entry.name,
        desc=desc,
        ranks=entry.ranks,
        backend=entry.backend or recorder,
        last_enqueued=enqueued,
        last_started=started,
        last_completed=completed,
        inflight=inflight,
        inflight_count=max(0, enqueued - completed) if exact or inflight else max(
            0, min(enqueued - completed, status.enqueued - status.completed)),
        timeout_seconds=timeout,
        last_progress=last_progress,
        exact=exact,
        has_p2p=has_p2p,
    )
    return state, replace(memory, last_completed=completed, last_progress=last_progress, seen_inflight=seen,
                          watched_since=now if memory.watched_since is None else memory.watched_since)


def steady_ages(seen: Seen, inflight: tuple[InflightCollective, ...], now: float, mono: float
                ) -> tuple[tuple[InflightCollective, ...], dict[tuple[int, float], tuple[float, float]]]:
    """In-flight entries whose ``created`` survives wall-clock jumps, and what was seen of them.

    FR stamps entries with the wall clock. From the first time we see an entry its age grows with the
    monotonic clock instead, and ``created`` is restated as ``now - age``: a clock stepped forward an hour
    must not make a 2-second-old collective look an hour old (a false verdict) or the reverse.
    """
    still: dict[tuple[int, float], tuple[float, float]] = {}
    out = []
    for entry in inflight:
        key = (entry.seq, entry.created)
        first = seen.get(key) or (max(0.0, now - entry.created), mono)
        still[key] = first
        created = now - (first[0] + max(0.0, mono - first[1]))
        out.append(entry if abs(created - entry.created) < 1e-3 else replace(entry, created=created))
    return tuple(out), still


def threshold_samples(before: PGMemory, completed: int, mono: float) -> tuple[tuple[float, ...], float]:
    """This poll's evidence of a PG's normal wait (seconds, in order), and the new ``progress_mono``.

    ``before``: the memory before this poll's state; ``completed``: this poll's completed sequence. Only a
    forward move of the completed sequence is a sample: a first sight or a counter that went back (the rank
    restarted) restarts the gap instead, so neither a restart's downtime nor a clock step is learned as a
    normal pause. The samples: the gap since the last advance, and the wait of each entry seen in flight that
    is now complete (its age when first seen plus the time since, at most).
    """
    prev = before.last_completed
    if prev is None or completed < prev or before.progress_mono is None:
        return (), mono
    if completed == prev:
        return (), before.progress_mono
    samples = [mono - before.progress_mono]
    for (seq, _created), (age, first_mono) in before.seen_inflight.items():
        if prev < seq <= completed:
            samples.append(age + max(0.0, mono - first_mono))
    return tuple(samples), mono
