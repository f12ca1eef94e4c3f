"""Synthetic rank states for the verdict engine: ranks at a collective of their process groups, in flight or
idle, as a node's exporter sees them at ``NOW``."""

from __future__ import annotations

from frexporter.analysis import VerdictConfig
from frexporter.model import RANK_OK, InflightCollective, PGState, RankState

NOW = 1_800_000_000.0
TP = "2c4f9ab1e0d3"  # a hashed subgroup name, shown shortened as 2c4f…
NODE = VerdictConfig(stuck_after=60.0)


def entry(seq: int, age: float, op: str = "all_reduce", timeout: float | None = 600.0,
          ins: tuple[tuple[int, ...], ...] = ((4,),), outs: tuple[tuple[int, ...], ...] | None = None,
          dtype: str = "Float", out_dtype: str | None = None) -> InflightCollective:
    return InflightCollective(seq=seq, op=op, created=NOW - age, timeout_seconds=timeout,
                              input_sizes=ins, input_dtypes=(dtype,),
                              output_sizes=ins if outs is None else outs, output_dtypes=(out_dtype or dtype,))


def pg(name: str, ranks: tuple[int, ...], enqueued: int, completed: int,
       inflight: tuple[InflightCollective, ...] = (), desc: str = "", exact: bool = True,
       has_p2p: bool = False) -> PGState:
    return PGState(name=name, desc=desc, ranks=ranks, backend="nccl", last_enqueued=enqueued, last_started=-1,
                   last_completed=completed, inflight=inflight, inflight_count=max(0, enqueued - completed),
                   timeout_seconds=600.0, last_progress=NOW - 3600, exact=exact, has_p2p=has_p2p)


def waiting(name: str, ranks: tuple[int, ...], seq: int, age: float, desc: str = "", **kw: object) -> PGState:
    """A rank in flight at ``seq`` (everything before it completed)."""
    return pg(name, ranks, seq, seq - 1, (entry(seq, age, **kw),), desc=desc)  # type: ignore[arg-type]


def idle(name: str, ranks: tuple[int, ...], seq: int, desc: str = "") -> PGState:
    """A rank that completed everything up to ``seq`` and enqueued nothing since."""
    return pg(name, ranks, seq, seq, desc=desc)


def rank(r: int, *pgs: PGState, status: str = RANK_OK, heartbeat_age: float = 1.0, job: str = "job",
         socket_alive: bool | None = True, last_deep_read: float | None = None) -> RankState:
    return RankState(job_id=job, rank=r, local_rank=r % 4, world_size=8, hostname=f"node{r // 4}", pid=1000 + r,
                     torch_version="2.13.0", gpu_uuid=f"GPU-{r}", status=status, heartbeat=NOW - heartbeat_age,
                     heartbeat_age=heartbeat_age, socket_alive=socket_alive, pgs=pgs, last_deep_read=last_deep_read)


WORLD4 = (0, 1, 2, 3)


def tp_missing_rank_3(age: float = 95.0) -> list[RankState]:
    waiters = [rank(r, waiting(TP, WORLD4, 42, age, desc="tp")) for r in (0, 1, 2)]
    return [*waiters, rank(3, idle(TP, WORLD4, 41, desc="tp"))]
