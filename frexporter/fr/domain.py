"""From torch's raw ``pg_status`` and FR entries to collective-domain progress (pure).

torch's ``pg_status`` counts in mixed domains: gloo counts every op including
send/recv (``op_id``), NCCL switches between its collective and p2p counters. Two
healthy ranks of a PG with p2p traffic therefore show different raw numbers. FR
entries carry ``collective_seq_id``, which is comparable across ranks; this module
derives the collective-domain values from them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from frexporter.fr.trace import FrDump, FrEntry
from frexporter.model import InflightCollective
from frexporter.spool import RawPGStatus


@dataclass(frozen=True)
class DeepView:
    """One local pg id as seen by one deep FR read."""

    pg_id: int
    name: str
    desc: str
    raw: RawPGStatus
    enqueued: int
    started: int
    completed: int
    inflight: tuple[InflightCollective, ...]
    has_p2p: bool
    timeout_seconds: float | None
    known: bool  # False when no entry of this pg was left in the ring: values are the raw ones
    # Creation time of the newest completed collective: completion came no earlier. FR records no completion
    # time for gloo, so this is what a freshly started exporter can say about the last progress.
    completed_created: float | None = None
    # The backend of its newest entry, as FR names it (``nccl``, ``gloo``, ``nccl2``); "" when unknown.
    backend: str = ""
    # Whether torch's raw ``last_completed_collective`` moves for this pg. The counters of a backend torch 2.15's
    # FlightRecorderHook records without a completion hook never do (its entries are retired at issue, never
    # "completed"): there the entries tell completion, and the raw counters never may.
    raw_completes: bool = True


def inflight_collective(entry: FrEntry) -> InflightCollective:
    """An FR entry as the model's collective (for the live view and for dumps alike)."""
    return InflightCollective(
        seq=entry.collective_seq_id,
        op=entry.op,
        created=entry.time_created_ns / 1e9,
        timeout_seconds=entry.timeout_ms / 1000.0 if entry.timeout_ms else None,
        input_sizes=entry.input_sizes,
        input_dtypes=entry.input_dtypes,
        output_sizes=entry.output_sizes,
        output_dtypes=entry.output_dtypes,
    )


def translate(dump: FrDump) -> dict[int, DeepView]:
    """Collective-domain progress for every local pg id in one dump."""
    by_pg: dict[int, list[FrEntry]] = defaultdict(list)
    for entry in dump.entries:
        by_pg[entry.pg_id].append(entry)
    views: dict[int, DeepView] = {}
    for pg_id in set(dump.pg_status) | set(by_pg):
        entries = sorted(by_pg.get(pg_id, ()), key=lambda e: e.record_id)
        raw = dump.pg_status.get(pg_id, RawPGStatus(-1, -1, -1))
        name = entries[-1].pg_name if entries else ""
        desc = entries[-1].pg_desc if entries else ""
        collectives = [e for e in entries if not e.is_p2p]
        timeouts = [e.timeout_ms for e in entries if e.timeout_ms]
        timeout = timeouts[-1] / 1000.0 if timeouts else None
        if not collectives:
            views[pg_id] = DeepView(pg_id, name, desc, raw, raw.enqueued, raw.started, raw.completed, (),
                                    any(e.is_p2p for e in entries), timeout, known=False,
                                    backend=entries[-1].backend if entries else "")
            continue
        enqueued = max(e.collective_seq_id for e in collectives)
        pending = sorted((e for e in collectives if not e.done), key=lambda e: e.collective_seq_id)
        completed = pending[0].collective_seq_id - 1 if pending else enqueued
        started = -1
        if raw.started >= 0:  # only NCCL with timing knows "started"
            started_seqs = [e.collective_seq_id for e in collectives if e.state in ("started", "completed")]
            started = max(started_seqs) if started_seqs else raw.started
        has_p2p = any(e.is_p2p for e in entries) or raw.enqueued != enqueued
        # A collective retired while the counter says none ever completed: a counter this backend does not keep
        # (or, at most once, a read that fell between a retirement and the counter's update: then the values
        # come from this read, until the next one). Retired, not merely "completed": stock NCCL's entries are
        # completed a moment before its watchdog moves the counter, then retires them.
        raw_completes = raw.completed >= 0 or not any(e.retired for e in collectives)
        views[pg_id] = DeepView(
            pg_id=pg_id,
            name=name,
            desc=desc,
            raw=raw,
            enqueued=enqueued,
            started=started,
            completed=completed,
            inflight=tuple(inflight_collective(e) for e in pending),
            has_p2p=has_p2p,
            timeout_seconds=timeout,
            known=True,
            completed_created=max((e.time_created_ns / 1e9 for e in collectives
                                   if e.done and e.collective_seq_id <= completed), default=None),
            backend=entries[-1].backend,
            raw_completes=raw_completes,
        )
    return views
