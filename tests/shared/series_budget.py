"""The reference node the per-rank series budget is counted on, and how its series are counted.

tests/unit/test_series_budget.py holds the budget (docs/architecture.md, Budgets); scripts/series_usage.py and
tests/unit/test_series_usage.py count the same node to say which of its series the alerts need (docs/scale.md).

The reference node is the one README's capacity numbers and docs/durations.md describe: 8 ranks, each in 8
process groups; WORLD and a tensor-parallel group are shared by the node's 8 ranks (so both carry the
straggler series), the other 6 (data- and pipeline-parallel groups) have one member per node. Steady state at
the default settings: gloo or NCCL without timing (no started seq), nothing in flight, no recorder errors, no
verdict. A series counts against a rank when it carries the ``rank`` label; the PG's static facts (info,
timeout) are per node, and GPUs have their own budget (tests/unit/test_nvml.py). A real node's exposition is
counted by ``python -m benchmarks.scale --capacity-only``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import replace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from frexporter import naming as n
from frexporter.analysis.kinds import MISSING_RANK
from frexporter.model import (
    ACTIVITY_IN_COLLECTIVE,
    DURATION_BUCKETS,
    RANK_OK,
    Activity,
    CollectiveStats,
    InflightCollective,
    NodeSnapshot,
    PGState,
    RankState,
    SourceStatus,
    Verdict,
)
from frexporter.outputs.snapshot_metrics import SnapshotCollector

RANKS_PER_NODE = 8
NODES = 4
SHARED_PGS = ("world", "tp")  # every local rank is a member: the node can compare their lateness
CROSS_NODE_PGS = ("dp", "pp", "cp", "ep", "dp_shard", "dp_replicate")  # one member per node
NOW = 1_700_000_000.0
JOB_ID = "llm"

# `frexporter serve` flags (off by default) that add per-rank series, for every_series_node.
COLLECTIVE_WAITS = "--collective-waits"
PER_RANK_DURATIONS = "--per-rank-durations"
OPT_IN_FLAGS = (COLLECTIVE_WAITS, PER_RANK_DURATIONS)


def _pg(name: str, members: tuple[int, ...], lateness: float | None) -> PGState:
    return PGState(name=name, desc=name, ranks=members, backend="cuda:nccl", last_enqueued=120,
                   last_started=-1, last_completed=120, inflight=(), inflight_count=0, timeout_seconds=600.0,
                   last_progress=NOW - 0.5, exact=True, has_p2p=False, lateness_seconds=lateness,
                   lateness_samples=0 if lateness is None else 200)


def reference_node(node: int = 1) -> NodeSnapshot:
    """Node ``node`` of a job of NODES nodes x RANKS_PER_NODE ranks, at steady state."""
    local = tuple(range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE))
    ranks = []
    for local_rank, rank in enumerate(local):
        pgs = [_pg(name, local, lateness=0.001 * local_rank) for name in SHARED_PGS]
        # A cross-node group holds this rank and its peers at the same local rank on the other nodes.
        peers = tuple(local_rank + i * RANKS_PER_NODE for i in range(NODES))
        pgs += [_pg(f"{name}{local_rank}", peers, lateness=None) for name in CROSS_NODE_PGS]
        ranks.append(RankState(job_id=JOB_ID, rank=rank, local_rank=local_rank, world_size=NODES * RANKS_PER_NODE,
                               hostname="node-1", pid=1000 + rank, torch_version="2.13.0", gpu_uuid=f"GPU-{rank}",
                               status=RANK_OK, heartbeat=NOW - 0.3, heartbeat_age=0.3, socket_alive=True,
                               pgs=tuple(pgs),
                               activity=Activity(state=ACTIVITY_IN_COLLECTIVE, frames=(), cpu_percent=100.0,
                                                 since=NOW - 0.2)))
    sources = (SourceStatus(name=n.SOURCE_RANKS, up=True, duration_seconds=0.002, errors_total={},
                            last_success=NOW),)
    return NodeSnapshot(time=NOW, hostname="node-1", ranks=tuple(ranks), sources=sources)


def every_series_node(opt_in: Collection[str] = ()) -> NodeSnapshot:
    """The reference node in a state where every per-rank series it can have is written: each PG but the last with
    NCCL timing (a started seq) and a collective in flight past its stuck threshold, the last idle past half its
    threshold (nothing in flight, an idle seq), a recorder error on each rank, a
    verdict naming them all, collective durations; plus the series of the serve flags in ``opt_in``
    (OPT_IN_FLAGS). Which metric names carry ``rank`` is read from its exposition; its counts mean nothing (no real
    node is in every state at once: both cross-node straggler signals, for instance)."""
    unknown = set(opt_in) - set(OPT_IN_FLAGS)
    if unknown:
        raise ValueError(f"not an opt-in flag of every_series_node: {sorted(unknown)}")
    waits = COLLECTIVE_WAITS in opt_in
    snap = reference_node()
    ranks = []
    collectives = []
    for r in snap.ranks:
        pgs = []
        *running, stopped = r.pgs
        for pg in running:
            inflight = (InflightCollective(seq=pg.last_completed + 1, op="allreduce", created=NOW - 40.0,
                                           timeout_seconds=pg.timeout_seconds),)
            pgs.append(replace(pg, last_enqueued=pg.last_completed + 1, last_started=pg.last_completed + 1,
                               inflight=inflight, inflight_count=1,
                               stuck_threshold_seconds=10.0, stuck_ceiling_seconds=60.0,  # waited past both
                               wait_seconds=0.01 if waits else None, wait_samples=200 if waits else 0,
                               arrival_timestamp=NOW - 1.0 if waits else None,
                               arrival_stamp=NOW - 1.0 if waits else None))
            # One per (PG, op) on the node, or per rank with --per-rank-durations.
            if PER_RANK_DURATIONS in opt_in or r is snap.ranks[0]:
                collectives.append(CollectiveStats(
                    job_id=r.job_id, pg=pg.name, pg_desc=pg.desc, op="allreduce",
                    rank=r.rank if PER_RANK_DURATIONS in opt_in else None,
                    bucket_counts=tuple(1 for _ in DURATION_BUCKETS), duration_sum=0.01, duration_count=1,
                    bytes=1024))
        pgs.append(replace(stopped, last_progress=NOW - 40.0, stuck_threshold_seconds=10.0,
                           stuck_ceiling_seconds=60.0))
        ranks.append(replace(r, pgs=tuple(pgs), recorder_errors={"snapshot_write": 1}))
    verdict = Verdict(kind=MISSING_RANK, job_id=JOB_ID, pg=SHARED_PGS[0], pg_desc=SHARED_PGS[0],
                      ranks=tuple(r.rank for r in snap.ranks), waiting_ranks=(), seq=121, op="allreduce",
                      since=NOW - 40.0, age_seconds=40.0, timeout_seconds=600.0, budget_used=40.0 / 600.0,
                      summary="every series")
    return replace(snap, ranks=tuple(ranks), verdicts=(verdict,), collectives=tuple(collectives))


def exposition(snapshot: NodeSnapshot) -> str:
    """The node's /metrics text, as prometheus_client writes it (text format 0.0.4)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snapshot))
    return generate_latest(registry).decode()


def rank_series(text: str) -> Counter[str]:
    """Rank-labelled series of an exposition by series name (``__name__``, what relabeling matches: a
    counter's ``_total``, a histogram's ``_bucket``, ``_count`` and ``_sum``)."""
    by_name: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if n.L_RANK in sample.labels:
                by_name[sample.name] += 1
    return by_name


def series_per_rank(snapshot: NodeSnapshot) -> tuple[float, Counter[str]]:
    """Mean rank-labelled series per local rank, and their count by metric family."""
    by_family: Counter[str] = Counter()
    for family in text_string_to_metric_families(exposition(snapshot)):
        by_family[family.name] += sum(1 for s in family.samples if n.L_RANK in s.labels)
    return sum(by_family.values()) / len(snapshot.ranks), by_family
