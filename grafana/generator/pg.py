"""The process-group dashboard: one group of a job rank by rank, who is behind, what is in flight and for how
long, and how much of the watchdog timeout is left. One function per row."""

from __future__ import annotations

from grafana_foundation_sdk.models import common as mcommon

from frexporter import naming as n

from .board import Board, job_variable, pg_variable
from .constants import UID_PG
from .panels import (
    ANY_IS_BAD,
    BUDGET_STEPS,
    RANK_LEGEND,
    dashed,
    series_link_rank,
    stat,
    table,
    threshold_steps,
    timeseries,
)
from .promql import (
    PG,
    R_ARRIVAL_LAG,
    R_ARRIVAL_LOSS,
    R_BUDGET_USED,
    R_ENQUEUED_SKEW,
    R_PG_RANKS_WAITING,
    R_WAIT_LAG,
    R_WAIT_LOSS,
    age,
    budget_left,
    by,
    or_zero,
    pg_behind,
    rate,
    sel,
)
from .queries import Target

LEGEND_LEARNED = "learned threshold"
LEGEND_CEILING = "busy culprit ceiling"
# Per node, without a rank; the lowest is the one the exporters judge by.
_LEARNED = Target(f"min({sel(n.PG_STUCK_THRESHOLD_SECONDS, *PG)})", legend=LEGEND_LEARNED)
_CEILING = Target(f"min({sel(n.PG_STUCK_CEILING_SECONDS, *PG)})", legend=LEGEND_CEILING)


def pg_dashboard() -> Board:
    b = Board(
        UID_PG,
        "frexporter / Process group",
        "One process group of a job, rank by rank: who is behind, what is in flight and for how long, "
        "and how much of the watchdog timeout is left. Click a rank's series to open its dashboard.",
        [job_variable(), pg_variable()],
    )
    _summary(b)
    _sequences(b)
    _in_flight_and_watchdog(b)
    _collective_performance(b)
    _stragglers(b)
    return b


def _per_rank(expr: str) -> str:
    """``expr`` (of the selected group) reduced to one series per rank."""
    return f"max {by(n.L_RANK)} ({expr})"


def _summary(b: Board) -> None:
    w = 3
    b.row("Process group $pg")
    b.panel(
        stat(text_mode=mcommon.BigValueTextMode.NAME),
        "Size and backend",
        "Ranks in the group and its backend, as torch.distributed created it.",
        [
            Target(
                f"max {by(n.L_PG_DESC, n.L_SIZE, n.L_BACKEND)} ({sel(n.PG_INFO, *PG)})",
                legend="{{pg_desc}}: {{size}} ranks, {{backend}}",
                instant=True,
            )
        ],
        width=6,
    )
    b.value(
        stat(decimals=0),
        "Ranks reporting",
        "Ranks of this group some exporter reports; fewer than the size means ranks on an unscraped node.",
        f"count({sel(n.PG_LAST_ENQUEUED_SEQ, *PG)})",
        width=w,
    )
    b.value(
        stat(decimals=0, no_value="0"),
        "Ranks waiting",
        "Ranks with a collective enqueued and not completed for half the group's stuck threshold or more.",
        sel(R_PG_RANKS_WAITING, *PG),
        width=w,
    )
    b.value(
        stat(decimals=0, thresholds=threshold_steps((None, "green"), (2, "orange"))),
        "Sequence skew",
        "Collectives between the furthest-ahead and furthest-behind rank (enqueued). 0 or 1 is healthy.",
        sel(R_ENQUEUED_SKEW, *PG),
        width=w,
    )
    b.value(
        stat(unit="s"),
        "Watchdog timeout",
        "The group's watchdog timeout (NCCL default 10 min, gloo 30 min).",
        f"min({sel(n.PG_TIMEOUT_SECONDS, *PG)})",
        width=w,
    )
    b.value(
        stat(unit="percentunit", thresholds=BUDGET_STEPS, no_value="no rank waiting"),
        "Budget used",
        "Share of the watchdog timeout used by the oldest wait (a collective in flight for half the group's stuck "
        "threshold or more).",
        sel(R_BUDGET_USED, *PG),
        width=w,
    )
    b.value(
        stat(thresholds=ANY_IS_BAD, decimals=0),
        "Open verdicts",
        "Culprit ranks the verdict engine names in this group now.",
        or_zero(f"count({sel(n.VERDICT, *PG)})"),
        width=w,
        needs=frozenset(),
    )


def _sequence(b: Board, title: str, description: str, metric: str, *, width: int) -> None:
    """A per-rank sequence number: a stepped line that may start anywhere (sequences do not start at 0)."""
    b.series(
        timeseries(decimals=0, min_val=None, stepped=True, links=[series_link_rank()]),
        title,
        description,
        _per_rank(sel(metric, *PG)),
        legend=RANK_LEGEND,
        width=width,
        height=9,
    )


def _sequences(b: Board) -> None:
    b.row("Sequences")
    _sequence(
        b,
        "Last enqueued collective per rank",
        "Newest collective (collective domain: send/recv excluded) each rank has issued. The rank whose line "
        "stops below the others is the one the rest wait for.",
        n.PG_LAST_ENQUEUED_SEQ,
        width=12,
    )
    _sequence(
        b,
        "Last completed collective per rank",
        "Newest collective each rank has seen complete. All lines flat: nothing completes (a stall, or a rank "
        "missing). Lines flat at different heights: the lower ranks are stuck.",
        n.PG_LAST_COMPLETED_SEQ,
        width=12,
    )
    b.panel(
        table(links=(n.L_RANK,), sort_by="behind by"),
        "Ranks behind the furthest rank",
        "Collectives each rank trails the group's furthest-ahead rank by (enqueued). Sorted worst first: during a "
        "desync the top row is the culprit.",
        [Target(pg_behind(PG, PG, group_by=(n.L_RANK,)), instant=True, column="behind by")],
        width=8,
        height=9,
        table=True,
    )
    _sequence(
        b,
        "Last started collective per rank (NCCL)",
        "Newest collective whose kernel started on the GPU. NCCL with TORCH_NCCL_ENABLE_TIMING=1 only; empty on "
        "gloo. Enqueued but not started: the GPU is busy with something before it.",
        n.PG_LAST_STARTED_SEQ,
        width=16,
    )


def _in_flight_and_watchdog(b: Board) -> None:
    b.row("In flight and watchdog")
    b.series(
        timeseries(decimals=0, stepped=True, links=[series_link_rank()]),
        "Collectives in flight per rank",
        "Collectives enqueued and not completed. Peers of a missing rank sit at 1 or more; the missing rank at 0.",
        _per_rank(sel(n.PG_INFLIGHT_COLLECTIVES, *PG)),
        legend=RANK_LEGEND,
        width=8,
        height=8,
    )
    b.panel(
        dashed(timeseries(unit="s", links=[series_link_rank()]), {LEGEND_LEARNED: "red", LEGEND_CEILING: "orange"}),
        "Oldest in-flight age per rank",
        "How long each rank's oldest in-flight collective has waited. Only ranks with work in flight have a line. "
        "Dashed: the group's stuck threshold learned from its history (a wait past it on an idle, wedged, gone or "
        "blocked culprit is a hang) and the ceiling a wait on a busy culprit gets (--stuck-after).",
        [
            Target(_per_rank(age(sel(n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS, *PG))), legend=RANK_LEGEND),
            _LEARNED,
            _CEILING,
        ],
        width=8,
        height=8,
    )
    b.series(
        timeseries(unit="s", links=[series_link_rank()], legend_calcs=("lastNotNull", "min")),
        "Watchdog time left per rank",
        "Timeout minus the age of the rank's oldest in-flight collective: when this reaches 0 the rank's watchdog "
        "aborts the process group.",
        f"min {by(n.L_RANK)} ({budget_left(*PG)})",
        legend=RANK_LEGEND,
        width=8,
        height=8,
    )
    b.series(
        timeseries(unit="s", links=[series_link_rank()]),
        "Time since last progress per rank",
        "Since each rank last saw its completed sequence advance. Grows on every rank of an idle group too; "
        "read it together with the in-flight panels.",
        _per_rank(age(sel(n.PG_LAST_PROGRESS_TIMESTAMP_SECONDS, *PG))),
        legend=RANK_LEGEND,
        width=18,
        height=8,
    )
    b.panel(
        stat(unit="s", text_mode=mcommon.BigValueTextMode.VALUE_AND_NAME),
        "Stuck after",
        "How long a collective of this group may wait before the exporters call it stuck: the threshold learned "
        "from the group's history, where the culprit is idle, wedged, gone or blocked elsewhere, and the ceiling "
        "(--stuck-after) where the culprit is busy computing (FrexporterCollectiveDesync then fires as info).",
        [Target(line.expr, legend=line.legend, instant=True) for line in (_LEARNED, _CEILING)],
        width=6,
        height=8,
    )


def _collective_performance(b: Board) -> None:
    b.row("Collective performance")
    buckets = sel(n.COLLECTIVE_DURATION_SECONDS + "_bucket", *PG)
    b.panel(
        timeseries(unit="s"),
        "Collective duration by op",
        "Median and 99th percentile of completed collectives' durations, by op (NCCL with timing; gloo reports "
        "no durations). A p99 far above the median at a steady rate points at a straggler.",
        [
            Target(
                f"histogram_quantile({q}, sum {by('le', n.L_OP)} ({rate(buckets)}))",
                legend=f"{{{{op}}}} p{round(q * 100)}",
            )
            for q in (0.5, 0.99)
        ],
        width=12,
        height=8,
    )
    b.series(
        timeseries(unit="Bps"),
        "Collective bytes by op",
        "Bytes moved by this group's collectives per second, by op, summed over the reporting exporters.",
        f"sum {by(n.L_OP)} ({rate(sel(n.COLLECTIVE_BYTES_TOTAL, *PG))})",
        legend="{{op}}",
        width=12,
        height=8,
    )


def _stragglers(b: Board) -> None:
    b.row("Stragglers across nodes")
    b.series(
        timeseries(unit="s", links=[series_link_rank()]),
        "Wait inside collectives per rank",
        "Each rank's mean wait inside this group's recent collectives, on its own node's clock (serve "
        "--collective-waits; NCCL only, gloo records no completion: see Arrival lag per rank). Collectives end "
        "together, so the rank that arrives last waits least: a line well below the others is a straggler its peers "
        "wait for.",
        _per_rank(sel(n.RANK_COLLECTIVE_WAIT_SECONDS, *PG)),
        legend=RANK_LEGEND,
        width=8,
        height=8,
    )
    # The arrivals themselves are unix times, a line per rank a few milliseconds apart on a scale of decades: only
    # their lag against the group's median shows anything.
    b.series(
        timeseries(unit="s", min_val=None, links=[series_link_rank()]),
        "Arrival lag per rank",
        "Each rank's arrival at this group's collectives minus the group's median, on the nodes' own clocks (serve "
        "--collective-waits; gloo, whose Flight Recorder records no completion). An arrival is the rank's mean call "
        "time over the block of 4 collectives every node picks for the same 5 s instant: a line well above the "
        "others is a straggler its peers wait for, exact up to the nodes' clock offset. A rank more than half a "
        "block from the median reports a neighbouring block and has no line then.",
        _per_rank(sel(R_ARRIVAL_LAG, *PG)),
        legend=RANK_LEGEND,
        width=8,
        height=8,
    )
    # A group has one signal or the other (NCCL waits, gloo arrivals), so either rule's lag fills the same column.
    b.panel(
        table(merge=True, links=(n.L_RANK,), units={"lag": "s", "loss": "percentunit"}, sort_by="lag",
              no_value="No waits (NCCL) or arrivals (gloo): --collective-waits is off"),
        "Straggler ranking",
        "Ranks by lag, last arriver first: about how long each collective waits for the rank, from its waits on "
        "NCCL (the group's median wait minus the rank's own) or its arrivals on gloo (its arrival minus the group's "
        "median), and the share of the peers' time that costs (loss). FrexporterStraggler names a rank whose lag "
        "stays over 4 median absolute deviations, 5 ms and 5 % for 15 s; frexporter analyze --prometheus ranks the "
        "same way.",
        [
            Target(_per_rank(f"{sel(R_WAIT_LAG, *PG)} or {sel(R_ARRIVAL_LAG, *PG)}"), instant=True, column="lag"),
            Target(_per_rank(f"{sel(R_WAIT_LOSS, *PG)} or {sel(R_ARRIVAL_LOSS, *PG)}"), instant=True, column="loss"),
        ],
        width=8,
        height=8,
        table=True,
    )
