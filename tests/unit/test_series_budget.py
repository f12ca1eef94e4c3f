"""The per-rank series budget (docs/architecture.md, Budgets): at most 40 series per rank at the defaults.

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

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from frexporter import naming as n
from frexporter.model import ACTIVITY_IN_COLLECTIVE, RANK_OK, Activity, NodeSnapshot, PGState, RankState, SourceStatus
from frexporter.outputs.snapshot_metrics import SnapshotCollector

SERIES_BUDGET_PER_RANK = 40
RANKS_PER_NODE = 8
NODES = 4
SHARED_PGS = ("world", "tp")  # every local rank is a member: the node can compare their lateness
CROSS_NODE_PGS = ("dp", "pp", "cp", "ep", "dp_shard", "dp_replicate")  # one member per node
NOW = 1_700_000_000.0


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
        ranks.append(RankState(job_id="llm", rank=rank, local_rank=local_rank, world_size=NODES * RANKS_PER_NODE,
                               hostname="node-1", pid=1000 + rank, torch_version="2.13.0", gpu_uuid=f"GPU-{rank}",
                               status=RANK_OK, heartbeat=NOW - 0.3, heartbeat_age=0.3, socket_alive=True,
                               pgs=tuple(pgs),
                               activity=Activity(state=ACTIVITY_IN_COLLECTIVE, frames=(), cpu_percent=100.0,
                                                 since=NOW - 0.2)))
    sources = (SourceStatus(name=n.SOURCE_RANKS, up=True, duration_seconds=0.002, errors_total={},
                            last_success=NOW),)
    return NodeSnapshot(time=NOW, hostname="node-1", ranks=tuple(ranks), sources=sources)


def series_per_rank(snapshot: NodeSnapshot) -> tuple[float, Counter[str]]:
    """Mean rank-labelled series per local rank, and their count by metric family."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snapshot))
    by_family: Counter[str] = Counter()
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        by_family[family.name] += sum(1 for s in family.samples if n.L_RANK in s.labels)
    return sum(by_family.values()) / len(snapshot.ranks), by_family


def test_reference_node_is_what_it_claims() -> None:
    snap = reference_node()
    assert len(snap.ranks) == RANKS_PER_NODE
    for rank in snap.ranks:
        assert len(rank.pgs) == len(SHARED_PGS) + len(CROSS_NODE_PGS) == 8
        shared = [pg for pg in rank.pgs if sum(1 for m in pg.ranks if m // RANKS_PER_NODE == 1) > 1]
        assert [pg.name for pg in shared] == list(SHARED_PGS)
        assert all(pg.lateness_seconds is not None for pg in shared)


def test_series_per_rank_within_budget() -> None:
    per_rank, by_family = series_per_rank(reference_node())
    assert by_family[n.RANK_STRAGGLER_LATENESS_SECONDS] == RANKS_PER_NODE * len(SHARED_PGS), by_family
    assert by_family[n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS] == RANKS_PER_NODE, by_family
    assert per_rank <= SERIES_BUDGET_PER_RANK, (
        f"{per_rank:g} series per rank over the budget of {SERIES_BUDGET_PER_RANK}: {dict(by_family)}")
