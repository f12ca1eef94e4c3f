"""A fixed node snapshot with every kind of series (ranks, PGs, collectives, a GPU, sources), its committed
exposition (tests/golden/metrics.txt), and the same snapshot with a verdict and every GPU reading."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from frexporter.analysis.verdicts import Verdict
from frexporter.model import (
    ACTIVITY_IDLE,
    RANK_OK,
    RANK_UNRESPONSIVE,
    Activity,
    CollectiveStats,
    EccErrors,
    GpuReading,
    GpuState,
    InflightCollective,
    NodeSnapshot,
    PGState,
    RankState,
    RemappedRows,
    SourceStatus,
)

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "metrics.txt"


def pg(name: str, desc: str, enq: int, done: int, inflight: tuple[InflightCollective, ...] = (),
       progress: float | None = 1700000000.0, lateness: float | None = None,
       wait: float | None = None, arrival: tuple[float, float] | None = None) -> PGState:
    return PGState(name=name, desc=desc, ranks=(0, 1), backend="cpu:gloo", last_enqueued=enq, last_started=-1,
                   last_completed=done, inflight=inflight, inflight_count=enq - done, timeout_seconds=1800.0,
                   last_progress=progress, exact=True, has_p2p=False, lateness_seconds=lateness,
                   lateness_samples=0 if lateness is None else 200,
                   wait_seconds=wait, wait_samples=0 if wait is None else 200,
                   arrival_timestamp=None if arrival is None else arrival[0],
                   arrival_stamp=None if arrival is None else arrival[1],
                   stuck_threshold_seconds=10.0 if name == "0" else None,
                   stuck_ceiling_seconds=60.0 if name == "0" else None)


def fixed_snapshot() -> NodeSnapshot:
    stuck = InflightCollective(seq=8, op="all_reduce", created=1700000100.5, timeout_seconds=1800.0,
                               input_sizes=((4,),), input_dtypes=("Float",))
    ranks = (
        RankState(job_id="llm", rank=0, local_rank=0, world_size=2, hostname="node-a", pid=101,
                  torch_version="2.13.0+cpu", gpu_uuid="GPU-aaaa", status=RANK_OK, heartbeat=1700000200.0,
                  heartbeat_age=0.2, socket_alive=None,
                  pgs=(pg("0", "default_pg", 8, 7, (stuck,)), pg("1", "tp", 3, 3, lateness=0.0, wait=0.0425)),
                  recorder_errors={"OSError": 2},
                  activity=Activity(state=ACTIVITY_IDLE, frames=(("wait_for_data", "train.py", 40),),
                                    cpu_percent=1.5, since=1700000180.0)),
        RankState(job_id="llm", rank=1, local_rank=1, world_size=2, hostname="node-a", pid=102,
                  torch_version="2.13.0+cpu", gpu_uuid="GPU-bbbb", status=RANK_UNRESPONSIVE,
                  heartbeat=1700000150.0, heartbeat_age=50.2, socket_alive=True,
                  pgs=(pg("0", "default_pg", 7, 7, progress=None,
                          arrival=(1700000175.125, 1700000181.0)),  # stamped with its grid instant's time
                       pg("1", "tp", 3, 3, lateness=1.25))),
    )
    # Per node (no rank label): an NCCL-timed all_reduce with durations, a gloo broadcast with bytes only.
    collectives = (
        CollectiveStats(job_id="llm", pg="0", pg_desc="default_pg", op="all_reduce", rank=None,
                        bucket_counts=(0, 0, 2, 5, 9, 10, 11, 11, 11, 11, 11, 11, 11), duration_sum=0.0625,
                        duration_count=11, bytes=4 * 1024 * 11),
        CollectiveStats(job_id="llm", pg="1", pg_desc="tp", op="broadcast", rank=None,
                        bucket_counts=(0,) * 13, duration_sum=0.0, duration_count=0, bytes=6 * 2),
    )
    gpus = GpuReading(timestamp=1700000200.0, driver_version="550.54.15", gpus=(
        GpuState(index=0, uuid="GPU-aaaa", name="NVIDIA H100", utilization_ratio=0.97, memory_used_bytes=1 << 30,
                 memory_total_bytes=80 << 30, temperature_celsius=61.0, power_watts=650.5, energy_joules=1.5e6,
                 ecc_errors=EccErrors(corrected=3, uncorrected=0), xid_errors={79: 1}, recovery_action=0),
    ))
    sources = (
        SourceStatus(name="ranks", up=True, duration_seconds=0.0015, errors_total={"corrupt": 1},
                     last_success=1700000200.0),
        SourceStatus(name="nvml", up=True, duration_seconds=0.004, errors_total={}, last_success=1700000200.0),
    )
    return NodeSnapshot(time=1700000200.0, hostname="node-a", ranks=ranks, sources=sources, gpus=gpus,
                        collectives=collectives)


def rich_snapshot() -> NodeSnapshot:
    """The golden snapshot plus a verdict and every GPU reading, so every metric family has samples."""
    snap = fixed_snapshot()
    gpu = replace(snap.gpus.gpus[0], sm_clock_hertz=1.98e9, memory_clock_hertz=2.619e9, throttle_reasons=0x04,
                  remapped_rows=RemappedRows(correctable=1, uncorrectable=0, pending=False, failure=False),
                  pcie_replays=5, nvlink_errors={(0, "replay"): 2, (1, "crc_flit"): 1})
    verdict = Verdict(kind="missing_rank", job_id="llm", pg="0", pg_desc="default_pg", ranks=(1,), waiting_ranks=(0,),
                      seq=8, op="all_reduce", since=1700000100.5, age_seconds=99.5, timeout_seconds=1800.0,
                      budget_used=99.5 / 1800.0, summary="rank 1 never joined all_reduce #8")
    return replace(snap, gpus=replace(snap.gpus, gpus=(gpu,)), verdicts=(verdict,))
