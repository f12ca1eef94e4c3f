"""The job dashboard: is the job making progress, and if not, which process group, which rank, and how long
until the watchdog kills it. One function per row."""

from __future__ import annotations

from grafana_foundation_sdk.models import common as mcommon
from grafana_foundation_sdk.models import dashboard as mdash

from frexporter import naming as n
from frexporter.model import ACTIVITY_UNKNOWN

from .board import Board, job_variable, runbook_base_variable
from .constants import UID_JOB
from .panels import (
    ACTIVITY_LABEL_MAPPING,
    ANY_IS_BAD,
    BUDGET_STEPS,
    HEARTBEAT_STEPS,
    PG_LEGEND,
    RANK_LEGEND,
    UP_MAPPING,
    series_link_pg,
    series_link_rank,
    stat,
    state_timeline,
    table,
    timeseries,
)
from .promql import (
    ALERTS,
    ALERTS_OF_JOB,
    FIRING,
    FREXPORTER_SCRAPE_JOB,
    JOB,
    R_BUDGET_USED,
    R_ENQUEUED_MAX,
    R_ENQUEUED_MIN,
    R_ENQUEUED_SKEW,
    R_OLDEST_WAIT_AGE,
    R_PG_RANKS_WAITING,
    UP,
    activity_age,
    age,
    budget_left,
    by,
    increase,
    on_gpus,
    or_zero,
    per_rank_gpu,
    rate,
    sel,
)
from .queries import Target

# Merged tables join rows on their label columns, so every query is reduced
# to exactly (pg, pg_desc): no __name__ or job_id to keep rows apart.
_BY_PG = (n.L_PG, n.L_PG_DESC)


def job_dashboard() -> Board:
    b = Board(
        UID_JOB,
        "frexporter / Job",
        "Is this distributed PyTorch job making progress, and if not: which process group, which rank, "
        "how long until the watchdog kills it. Drill down to a process group or a rank from any table or series.",
        [job_variable(), runbook_base_variable()],
    )
    _health(b)
    _verdicts_and_alerts(b)
    _progress(b)
    _watchdog(b)
    _exporters_and_gpus(b)
    return b


def _health(b: Board) -> None:
    w = 3
    b.row("Health")
    b.value(
        stat(decimals=0),
        "Ranks up",
        "Ranks whose process answered the exporter's last poll (frexporter_rank_up summed over the job).",
        f"sum({sel(n.RANK_UP, JOB)})",
        width=w,
    )
    b.value(
        stat(thresholds=ANY_IS_BAD, decimals=0),
        "Ranks down",
        "Ranks reported but not answering: dead pid or a socket that stopped answering. Any rank down dooms "
        "the job at its next collective with that rank (FrexporterRankDown).",
        or_zero(f"count({sel(n.RANK_UP, JOB)} == 0)"),
        width=w,
        needs=frozenset(),
    )
    world_size = "world size {{world_size}}"
    b.panel(
        stat(text_mode=mcommon.BigValueTextMode.VALUE_AND_NAME, decimals=0),
        "Ranks reporting / world size",
        "Ranks that some exporter reports (value), by the world size they claim (name). Fewer than the world size: "
        "a node's exporter is down or not scraped, and its ranks are invisible here.",
        [Target(f"count {by(n.L_WORLD_SIZE)} ({sel(n.RANK_INFO, JOB)})", legend=world_size, instant=True)],
        width=w,
    )
    b.value(
        stat(decimals=0),
        "Process groups",
        "Process groups of the job, by cross-rank name (the default group, TP/PP/DP subgroups, ...).",
        f"count({sel(R_ENQUEUED_MAX, JOB)})",
        width=w,
    )
    b.value(
        stat(thresholds=ANY_IS_BAD, decimals=0),
        "Ranks named by verdicts",
        "Culprit ranks named by the exporters' verdict engine right now (see Open verdicts below).",
        or_zero(f"count({sel(n.VERDICT, JOB)})"),
        width=w,
        needs=frozenset(),
    )
    b.value(
        stat(thresholds=ANY_IS_BAD, decimals=0),
        "Firing alerts",
        "Frexporter alerts firing for this job, plus exporter-wide ones (exporter or source down).",
        or_zero(f"count({sel(ALERTS, *ALERTS_OF_JOB, FIRING)})"),
        width=w,
        needs=frozenset(),
    )
    b.value(
        stat(unit="percentunit", thresholds=BUDGET_STEPS, no_value="no rank waiting"),
        "Worst watchdog budget used",
        "Largest share of the watchdog timeout used by a waiting collective (in flight for half its group's stuck "
        "threshold or more), over all process groups. The watchdog aborts the job at 100%; "
        "FrexporterWatchdogBudget pages by 50%.",
        f"max({sel(R_BUDGET_USED, JOB)})",
        width=w,
    )
    b.value(
        stat(unit="s", thresholds=HEARTBEAT_STEPS),
        "Oldest heartbeat",
        "Age of the stalest rank heartbeat. The heartbeat is written from Python every second: a large age on a "
        "rank that is up means its interpreter is wedged (FrexporterRankUnresponsive).",
        f"max({age(sel(n.RANK_HEARTBEAT_TIMESTAMP_SECONDS, JOB))})",
        width=w,
    )


def _open_verdicts() -> str:
    """One row per culprit rank: the verdict's labels, the culprit's activity (`state`) and its age (value)."""
    verdict_key = (n.L_KIND, n.L_RANK, n.L_PG, n.L_PG_DESC, n.L_OP, n.L_SEQ, n.L_CULPRIT_FUNCTION)
    # The culprit's activity joined on; a culprit no exporter reports activity for (absent, its node's
    # exporter gone) keeps its row, as "unknown" for an unknown time (NaN, shown as a dash).
    with_activity = (
        f"max {by(*verdict_key, n.L_STATE)} ({sel(n.VERDICT, JOB)} * on ({n.L_JOB_ID}, {n.L_RANK}) "
        f"group_left ({n.L_STATE}) {activity_age(JOB)})"
    )
    without_activity = (
        f'label_replace(max {by(*verdict_key)} ({sel(n.VERDICT, JOB)} unless on ({n.L_JOB_ID}, {n.L_RANK}) '
        f'{sel(n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS, JOB)}) * NaN, "{n.L_STATE}", "{ACTIVITY_UNKNOWN}", "", "")'
    )
    return f"{with_activity} or {without_activity}"


def _verdicts_and_alerts(b: Board) -> None:
    b.row("Verdicts and alerts")
    nan_as_dash = mdash.SpecialValueMap(options=mdash.DashboardSpecialValueMapOptions(
        match=mdash.SpecialValueMatch.NA_N, result=mdash.ValueMappingResult(text="-")))
    b.panel(
        table(
            links=(n.L_RANK, n.L_PG),
            no_value="No open verdicts",
            units={"for": "s"},
            mappings={n.L_STATE: ACTIVITY_LABEL_MAPPING, "for": [nan_as_dash]},
            colored=(n.L_STATE,),
        ),
        "Open verdicts",
        "One row per culprit rank: kind (missing_rank, mismatch, stalled, rank_down, rank_unresponsive, straggler), "
        "the process group and the collective (op, seq), the function the rank is in, and what it is doing now and "
        "for how long: in_collective (waiting in another collective), gpu_wait (waiting on its GPU: a hung kernel "
        "is paged at the learned threshold), busy (computing: FrexporterCollectiveDesync "
        "waits for the ceiling and fires as info), idle, wedged (Python stopped), gone (process dead), unknown. "
        "Click a rank or a process group to drill down; GET /api/v1/status on the exporter has the one-sentence "
        "summary.",
        [Target(_open_verdicts(), instant=True, column="for")],
        width=14,
        height=8,
        table=True,
    )
    alert_labels = ("alertname", "alertstate", "severity", n.L_PG, n.L_RANK, n.L_SOURCE, "instance")
    b.panel(
        table(links=("alertname",), no_value="No Frexporter alerts"),
        "Active alerts",
        "Frexporter alerts pending or firing for this job or its exporters. Click an alert name for its runbook, "
        "under the Runbook base URL variable (set it in the dashboard settings, or through the Helm chart).",
        [Target(f"max {by(*alert_labels)} ({sel(ALERTS, *ALERTS_OF_JOB)})", instant=True)],
        width=10,
        height=8,
        table=True,
        hide=("Value",),
    )


def _per_pg(rule: str) -> str:
    return f"max {by(*_BY_PG)} ({sel(rule, JOB)})"


def _progress(b: Board) -> None:
    b.row("Progress")
    b.series(
        timeseries(unit="ops", links=[series_link_pg()]),
        "Progress per process group",
        "Collectives per second enqueued by the slowest rank of each process group. A group at zero while "
        "others advance is stuck (or idle by design, e.g. a pipeline group between micro-batches).",
        rate(sel(R_ENQUEUED_MIN, JOB)),
        legend=PG_LEGEND,
        width=12,
        height=8,
    )
    b.series(
        timeseries(decimals=0, stepped=True, links=[series_link_pg()]),
        "Sequence skew per process group",
        "Collectives the furthest-ahead rank has enqueued beyond the furthest-behind one. Healthy jobs show 0 or "
        "1 (ranks enqueue asynchronously); a skew that stays above 0 while progress is flat means a rank has not "
        "joined the collective its peers wait on (FrexporterCollectiveDesync).",
        sel(R_ENQUEUED_SKEW, JOB),
        legend=PG_LEGEND,
        width=12,
        height=8,
    )
    columns = {
        # Members reporting, read when the table loads: a current value, not worth a pass over every rank's
        # seqs each minute in the rules.
        "ranks": f"count {by(*_BY_PG)} ({sel(n.PG_LAST_ENQUEUED_SEQ, JOB)})",
        "ranks waiting": _per_pg(R_PG_RANKS_WAITING),
        "min enqueued": _per_pg(R_ENQUEUED_MIN),
        "max enqueued": _per_pg(R_ENQUEUED_MAX),
        "skew": _per_pg(R_ENQUEUED_SKEW),
        "oldest wait": _per_pg(R_OLDEST_WAIT_AGE),
        "budget used": _per_pg(R_BUDGET_USED),
    }
    b.panel(
        table(
            merge=True,
            links=(n.L_PG,),
            units={"oldest wait": "s", "budget used": "percentunit"},
            sort_by="skew",
        ),
        "Process group status",
        "Every process group of the job now: ranks reporting and waiting (a collective in flight for half the "
        "group's stuck threshold or more), the slowest and the furthest rank's enqueued sequence, their skew, the "
        "oldest wait and the watchdog budget it used. Click a group to see its ranks.",
        [Target(expr, instant=True, column=column) for column, expr in columns.items()],
        width=24,
        height=8,
        table=True,
    )


def _watchdog(b: Board) -> None:
    b.row("Watchdog")
    b.series(
        timeseries(unit="percentunit", max_val=1, thresholds=BUDGET_STEPS, links=[series_link_pg()]),
        "Watchdog budget used per process group",
        "Share of the watchdog timeout used by each group's oldest wait (a collective in flight for half the "
        "group's stuck threshold or more, worst rank). Healthy jobs draw no line; a climbing line is a hang "
        "heading for the watchdog abort at 100%.",
        sel(R_BUDGET_USED, JOB),
        legend=PG_LEGEND,
        width=8,
        height=8,
    )
    b.series(
        timeseries(unit="s", links=[series_link_pg()], legend_calcs=("lastNotNull", "min")),
        "Watchdog time left per process group",
        "Seconds until the watchdog aborts the job, per group: timeout minus the age of the oldest in-flight "
        "collective, on the rank closest to it. Time left to grab stacks (py-spy) or checkpoint-and-kill.",
        f"min {by(*_BY_PG)} ({budget_left(JOB)})",
        legend=PG_LEGEND,
        width=8,
        height=8,
    )
    b.series(
        timeseries(unit="s", links=[series_link_pg()]),
        "Oldest wait per process group",
        "Age of the oldest collective enqueued and not completed on any rank of each group, once it has been in "
        "flight for half the group's stuck threshold (shorter ones are a healthy job's). A line that keeps "
        "rising is a hang.",
        sel(R_OLDEST_WAIT_AGE, JOB),
        legend=PG_LEGEND,
        width=8,
        height=8,
    )


def _exporters_and_gpus(b: Board) -> None:
    b.row("Exporters and GPUs")
    b.series(
        state_timeline(UP_MAPPING),
        "Exporter sources up",
        "Each exporter that reports a rank of this job, per source (ranks: spool directory and sockets; nvml: "
        "GPUs). A source down means missing or stale metrics from that node (FrexporterSourceDown).",
        f"max {by('instance', n.L_SOURCE)} ({n.SOURCE_UP} * on (instance) group_left () "
        f"max {by('instance')} ({sel(n.RANK_INFO, JOB)}))",
        legend="{{instance}} {{source}}",
        width=12,
        height=8,
    )
    b.value(
        stat(thresholds=ANY_IS_BAD, decimals=0),
        "Exporters down (all)",
        "frexporter scrape targets Prometheus cannot reach, cluster-wide (a down exporter cannot say which job "
        "it served). Assumes the scrape job name contains 'frexporter'.",
        or_zero(f"count({sel(UP, FREXPORTER_SCRAPE_JOB)} == 0)"),
        width=4,
        height=8,
        needs=frozenset(),
    )
    xids_per_gpu = f"sum {by(n.L_GPU_UUID)} (max {by(n.L_GPU_UUID, n.L_XID)} ({increase(n.GPU_XID_ERRORS_TOTAL)}))"
    b.series(
        timeseries(decimals=0, links=[series_link_rank()]),
        "GPU Xid events by rank",
        "Xid events (all codes) on each rank's GPU per rate interval. An Xid next to a hang usually is the cause: "
        "see the rank's dashboard for the codes.",
        per_rank_gpu(xids_per_gpu, JOB),
        legend=RANK_LEGEND,
        width=4,
        height=8,
    )
    b.series(
        timeseries(decimals=0),
        "GPUs throttled by reason",
        "How many of the job's GPUs are held down by power or thermal limits or a hardware slowdown. "
        "One throttled GPU slows every collective of its groups: a straggler, not a hang.",
        f"sum {by(n.L_REASON)} ({on_gpus(n.GPU_THROTTLE_REASONS, JOB, keep=(n.L_REASON,))})",
        legend="{{reason}}",
        width=4,
        height=8,
    )
