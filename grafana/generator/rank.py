"""The rank dashboard: is one rank's process up and its Python running, where it stands in each of its process
groups, and the health of its GPU. One function per row, or per half of a full one."""

from __future__ import annotations

from frexporter import naming as n

from .board import Board, job_variable, rank_variable
from .constants import UID_RANK
from .panels import (
    ACTIVITY_MAPPING,
    ANY_IS_BAD,
    HEARTBEAT_STEPS,
    LOST_MAPPING,
    NEUTRAL,
    PG_LEGEND,
    THROTTLE_MAPPING,
    UP_MAPPING,
    SdkPanel,
    series_link_pg,
    stat,
    state_timeline,
    table,
    threshold_steps,
    timeseries,
)
from .promql import (
    JOB,
    PG_KEY,
    R_ENQUEUED_MAX,
    RANK,
    activity_code,
    age,
    by,
    increase,
    on_gpus,
    or_zero,
    pg_behind,
    pg_timeout,
    sel,
)
from .queries import Target

IDENTITY_LABELS = (n.L_HOSTNAME, n.L_LOCAL_RANK, n.L_PID, n.L_WORLD_SIZE, n.L_TORCH_VERSION, n.L_GPU_UUID, "instance")
# Merged tables join rows on their label columns: every per-group query is reduced to exactly these.
_BY_PG = (n.L_PG, n.L_PG_DESC)
_GPU_LEGEND = "{{gpu_uuid}}"


def rank_dashboard() -> Board:
    b = Board(
        UID_RANK,
        "frexporter / Rank",
        "One rank of a job: is its process up and its Python running, where it stands in each of its process "
        "groups, and the health of its GPU.",
        [job_variable(), rank_variable()],
    )
    _liveness(b)
    _activity(b)
    _process_groups(b)
    _process_health(b)
    _gpu(b)
    return b


def _liveness(b: Board) -> None:
    b.row("Rank $rank")
    b.value(
        stat(mappings=UP_MAPPING, thresholds=threshold_steps((None, "red"), (1, "green")), no_value="not reported"),
        "Up",
        "Whether the rank's process answered the exporter's last poll (fresh heartbeat or live worker socket).",
        f"max({sel(n.RANK_UP, *RANK)})",
        width=3,
    )
    b.value(
        stat(unit="s", thresholds=HEARTBEAT_STEPS),
        "Heartbeat age",
        "Since the rank's Python last wrote a snapshot (every second). Large while up: its interpreter is "
        "wedged (GIL held by native code, a deadlock); grab its stack with py-spy.",
        f"max({age(sel(n.RANK_HEARTBEAT_TIMESTAMP_SECONDS, *RANK))})",
        width=3,
    )
    b.value(
        stat(thresholds=ANY_IS_BAD, decimals=0),
        "Open verdicts",
        "Verdicts naming this rank as a culprit now; the job dashboard's table has the details.",
        or_zero(f"count({sel(n.VERDICT, *RANK)})"),
        width=3,
        needs=frozenset(),
    )
    b.panel(
        table(),
        "Identity",
        "Where the rank runs: host, local rank, pid, torch version, GPU uuid, and the exporter that reports it.",
        [Target(f"max {by(*IDENTITY_LABELS)} ({sel(n.RANK_INFO, *RANK)})", instant=True)],
        width=15,
        height=4,
        table=True,
        hide=("Value",),
    )


def _activity(b: Board) -> None:
    """The second line of the rank's row: what it is doing, for how long, and over time."""
    b.value(
        stat(mappings=ACTIVITY_MAPPING, no_value="not reported"),
        "Activity",
        "What the rank is doing now: in_collective (waiting in a torch.distributed call, or on its own collective in "
        "flight past its group's normal wait: NCCL), gpu_wait (its Python stands on one line while its GPU has work "
        "pending: CUDA's spin wait burns a core, but the rank waits), busy (computing outside "
        "collectives), idle (sleeping, blocked in I/O, a queue or a lock), wedged (its Python stopped answering), "
        "gone (its process is dead), unknown (no stack: the rank keeps completing collectives, or sampling is "
        "off). A culprit that is busy gets its peers' "
        "patience up to the ceiling (--stuck-after) before FrexporterCollectiveDesync fires, as info.",
        activity_code(*RANK),
        width=3,
        height=5,
    )
    b.value(
        stat(unit="s", thresholds=NEUTRAL),
        "In this activity for",
        "Since the rank entered its current activity in the same function: a rank idle or busy for minutes while "
        "its peers wait is where the job stands.",
        f"min({age(sel(n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS, *RANK))})",
        width=3,
        height=5,
    )
    b.series(
        state_timeline(ACTIVITY_MAPPING),
        "Activity over time",
        "The rank's activity over time: when it left its collectives, for what (busy computing, idle), and "
        "whether it wedged or died.",
        activity_code(*RANK),
        legend="activity",
        width=18,
        height=5,
    )


def _per_pg(expr: str) -> str:
    """``expr`` (of the selected rank) reduced to one series per process group."""
    return f"max {by(*_BY_PG)} ({expr})"


def _process_group_table(b: Board) -> None:
    # Group-wide series restricted to the groups this rank is in.
    pg_of_rank = f"and on ({', '.join(PG_KEY)}) {sel(n.PG_LAST_ENQUEUED_SEQ, *RANK)}"
    columns = {
        "enqueued": _per_pg(sel(n.PG_LAST_ENQUEUED_SEQ, *RANK)),
        "completed": _per_pg(sel(n.PG_LAST_COMPLETED_SEQ, *RANK)),
        "group max enqueued": _per_pg(f"{sel(R_ENQUEUED_MAX, JOB)} {pg_of_rank}"),
        "behind by": pg_behind((JOB,), RANK, group_by=_BY_PG),
        "in flight": _per_pg(sel(n.PG_INFLIGHT_COLLECTIVES, *RANK)),
        "oldest in flight": _per_pg(age(sel(n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS, *RANK))),
        "timeout": _per_pg(f"{pg_timeout(JOB)} {pg_of_rank}"),
    }
    b.panel(
        table(merge=True, links=(n.L_PG,), units={"oldest in flight": "s", "timeout": "s"}, sort_by="behind by"),
        "Process groups",
        "Each group this rank belongs to: its enqueued and completed sequence, the group's furthest enqueued "
        "sequence, how far this rank trails it, what it has in flight and since when. Click a group to compare "
        "with its other ranks.",
        [Target(expr, instant=True, column=column) for column, expr in columns.items()],
        width=24,
        height=7,
        table=True,
    )


def _process_groups(b: Board) -> None:
    b.row("Process groups of rank $rank")
    _process_group_table(b)
    b.series(
        timeseries(decimals=0, min_val=None, stepped=True, links=[series_link_pg()]),
        "Completed collectives per process group",
        "This rank's last completed sequence in each of its groups. A flat line in one group: that group is where "
        "the rank is stuck.",
        _per_pg(sel(n.PG_LAST_COMPLETED_SEQ, *RANK)),
        legend=PG_LEGEND,
        width=8,
        height=8,
    )
    b.series(
        timeseries(decimals=0, stepped=True, links=[series_link_pg()]),
        "Behind the group's furthest rank",
        "Collectives this rank trails the furthest-ahead rank of each group by. Persistently above 0: this rank "
        "has not joined what its peers wait on.",
        pg_behind((JOB,), RANK, group_by=_BY_PG),
        legend=PG_LEGEND,
        width=8,
        height=8,
    )
    b.series(
        timeseries(unit="s", links=[series_link_pg()]),
        "Oldest in-flight age per process group",
        "How long this rank's oldest in-flight collective has waited, per group.",
        _per_pg(age(sel(n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS, *RANK))),
        legend=PG_LEGEND,
        width=8,
        height=8,
    )


def _process_health(b: Board) -> None:
    """The rest of the process-group row: the rank's own heartbeat, up state and recorder over time."""
    b.series(
        timeseries(unit="s", thresholds=HEARTBEAT_STEPS),
        "Heartbeat age over time",
        "Seconds since the rank's last snapshot. A sawtooth up to the snapshot interval is healthy.",
        f"max({age(sel(n.RANK_HEARTBEAT_TIMESTAMP_SECONDS, *RANK))})",
        legend="heartbeat age",
        width=8,
        height=7,
    )
    b.series(
        state_timeline(UP_MAPPING),
        "Up over time",
        "The rank's up state over time: when it died or stopped answering.",
        f"max({sel(n.RANK_UP, *RANK)})",
        legend="up",
        width=8,
        height=7,
    )
    b.series(
        timeseries(decimals=0),
        "Recorder errors",
        "Errors the in-rank recorder met per rate interval, by reason (it degrades instead of raising into "
        "training; persistent errors mean stale or missing data for this rank).",
        f"sum {by(n.L_REASON)} ({increase(sel(n.RANK_RECORDER_ERRORS_TOTAL, *RANK))})",
        legend="{{reason}}",
        width=8,
        height=7,
    )


def _gpu_series(
    b: Board, panel: SdkPanel, title: str, description: str, gpu_expr: str, *, legend: str = _GPU_LEGEND,
    keep: tuple[str, ...] = (), width: int = 8,
) -> None:
    """A panel of one GPU series of the rank's GPU(s), split by ``keep`` labels (see ``on_gpus``)."""
    b.series(panel, title, description, on_gpus(gpu_expr, *RANK, keep=keep), legend=legend, width=width, height=7)


def _gpu(b: Board) -> None:
    b.row("GPU of rank $rank")
    b.value(
        stat(mappings=LOST_MAPPING, thresholds=threshold_steps((None, "green"), (1, "red")), no_value="no GPU"),
        "GPU lost",
        "NVML reports the GPU fallen off the bus: the rank cannot make progress; drain the node.",
        on_gpus(n.GPU_LOST, *RANK),
        width=4,
        height=7,
    )
    _gpu_series(
        b, timeseries(unit="percentunit", max_val=1), "GPU utilization",
        "Share of time a kernel ran. During a hang NCCL kernels spin at 100% on waiting ranks; 0% on a rank "
        "means it never launched the collective.",
        n.GPU_UTILIZATION_RATIO, width=10,
    )
    b.panel(
        timeseries(unit="bytes"),
        "GPU memory",
        "Device memory used and total.",
        [
            Target(on_gpus(n.GPU_MEMORY_USED_BYTES, *RANK), legend="used"),
            Target(on_gpus(n.GPU_MEMORY_TOTAL_BYTES, *RANK), legend="total"),
        ],
        width=10,
        height=7,
    )
    _gpu_series(
        b, timeseries(unit="celsius"), "GPU temperature",
        "Core temperature. Thermal slowdown shows in the throttle panel.", n.GPU_TEMPERATURE_CELSIUS,
    )
    _gpu_series(b, timeseries(unit="watt"), "GPU power", "Board power draw.", n.GPU_POWER_WATTS)
    _gpu_series(
        b, state_timeline(THROTTLE_MAPPING), "GPU throttle reasons",
        "Clocks held down by something other than the workload: power cap or brake, thermal or hardware "
        "slowdown. A throttled GPU makes its rank a straggler for every group it is in.",
        n.GPU_THROTTLE_REASONS, legend="{{reason}}", keep=(n.L_REASON,),
    )
    _gpu_series(
        b, timeseries(decimals=0), "GPU ECC errors",
        "ECC errors per rate interval, corrected and uncorrected. Uncorrected errors crash or corrupt the job.",
        increase(n.GPU_ECC_ERRORS_TOTAL), legend="{{type}}", keep=(n.L_TYPE,),
    )
    _gpu_series(
        b, timeseries(decimals=0), "GPU Xid events",
        "Xid events per rate interval by code (e.g. 79: fallen off the bus, 48: double-bit ECC, 63/64: row "
        "remapping, 74: NVLink, 13/31/43: application faults).",
        increase(n.GPU_XID_ERRORS_TOTAL), legend="Xid {{xid}}", keep=(n.L_XID,),
    )
    _gpu_series(
        b, timeseries(decimals=0), "GPU NVLink errors",
        "NVLink data-link errors per rate interval, by type, summed over links. Rising replay or recovery "
        "counts slow NCCL collectives; CRC errors point at a bad link.",
        increase(n.GPU_NVLINK_ERRORS_TOTAL), legend="{{type}}", keep=(n.L_TYPE,),
    )
