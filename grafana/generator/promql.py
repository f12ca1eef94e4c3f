"""PromQL vocabulary: recording rule names, matchers on the dashboard variables, and the expressions panels share.

Every metric name comes from ``frexporter.naming`` and every aggregate from a recording rule in
``frexporter/rules/frexporter.rules.yml``, so a rename breaks the generator or its tests instead of silently
emptying a panel.
"""

from __future__ import annotations

from collections.abc import Sequence

from frexporter import naming as n
from frexporter.model import (
    ACTIVITY_BUSY,
    ACTIVITY_GONE,
    ACTIVITY_GPU_WAIT,
    ACTIVITY_IDLE,
    ACTIVITY_IN_COLLECTIVE,
    ACTIVITY_UNKNOWN,
    ACTIVITY_WEDGED,
)

from .constants import V_JOB


def _rule(level: str, metric: str, agg: str) -> str:
    """A recording rule name as frexporter.rules.yml spells it (level:metric:operation)."""
    return f"{level}:{metric}:{agg}"


_JOB_PG = f"{n.L_JOB_ID}_{n.L_PG}"
R_ENQUEUED_MAX = _rule(_JOB_PG, n.PG_LAST_ENQUEUED_SEQ, "max")
R_ENQUEUED_MIN = _rule(_JOB_PG, n.PG_LAST_ENQUEUED_SEQ, "min")
R_ENQUEUED_SKEW = _rule(_JOB_PG, n.PG_LAST_ENQUEUED_SEQ, "skew")
R_PG_RANKS_WAITING = _rule(_JOB_PG, n.PREFIX + "pg_ranks_waiting", "count")
R_OLDEST_WAIT_AGE = _rule(_JOB_PG, n.PREFIX + "pg_wait_age_seconds", "max")
R_BUDGET_USED = _rule(_JOB_PG, n.PREFIX + "pg_watchdog_budget_used_ratio", "max")
_JOB_PG_RANK = f"{n.L_JOB_ID}_{n.L_PG}_{n.L_RANK}"
R_WAIT_MEDIAN = _rule(_JOB_PG, n.RANK_COLLECTIVE_WAIT_SECONDS, "median")
R_WAIT_LAG = _rule(_JOB_PG_RANK, n.RANK_COLLECTIVE_WAIT_SECONDS, "lag")
R_WAIT_LOSS = _rule(_JOB_PG_RANK, n.RANK_COLLECTIVE_WAIT_SECONDS, "loss_ratio")
R_ARRIVAL_MEDIAN = _rule(_JOB_PG, n.RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS, "median")
R_ARRIVAL_LAG = _rule(_JOB_PG_RANK, n.RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS, "lag")
R_ARRIVAL_LOSS = _rule(_JOB_PG_RANK, n.RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS, "loss_ratio")

# Prometheus' own series (not frexporter's); the only other names a query may use.
ALERTS = "ALERTS"
UP = "up"
EXTERNAL_METRICS = frozenset({ALERTS, UP})
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def var(name: str) -> str:
    return "$" + name


def eq(label: str, value: str | None = None) -> str:
    """``label="$label"``: a matcher on the dashboard variable named after the label."""
    return f'{label}="{var(label) if value is None else value}"'


def sel(metric: str, *matchers: str) -> str:
    return f"{metric}{{{', '.join(matchers)}}}" if matchers else metric


def by(*labels: str) -> str:
    return f"by ({', '.join(labels)})"


def rate(expr: str) -> str:
    return f"rate({expr}[{var('__rate_interval')}])"


def increase(expr: str) -> str:
    return f"increase({expr}[{var('__rate_interval')}])"


JOB = eq(n.L_JOB_ID)
PG = (JOB, eq(n.L_PG))
RANK = (JOB, eq(n.L_RANK))
PG_KEY = (n.L_JOB_ID, n.L_PG, n.L_PG_DESC)
HAS_GPU = f'{n.L_GPU_UUID}!=""'
FREXPORTER_SCRAPE_JOB = 'job=~".*frexporter.*"'  # the convention FrexporterExporterDown relies on
FREXPORTER_ALERTS = 'alertname=~"Frexporter.*"'
# Exporter-wide alerts (ExporterDown, SourceDown) have no job_id: show them
# with the job's own, since they can hide its ranks.
ALERTS_OF_JOB = (FREXPORTER_ALERTS, f'{n.L_JOB_ID}=~"{var(V_JOB)}|"')
FIRING = 'alertstate="firing"'


def age(timestamp: str) -> str:
    """Seconds since a node's ``timestamp``, on that node's own clock (as the rules take every age: a node whose
    clock is off shows true ages): its exporter's last poll time, plus the time since that scrape, minus it; an
    exporter without the poll series (older) falls back to Prometheus' clock."""
    poll = n.POLL_TIMESTAMP_SECONDS
    return (f"(max by (job, instance) ({poll} + time() - timestamp({poll}) or on (job, instance) 0 * up + time()) "
            f"- on (job, instance) group_right () {timestamp})")


# Each activity state (label `state` of frexporter_rank_activity_since_timestamp_seconds): a number, for panels
# that draw the state as a value (PromQL values are numbers), and a colour. Red: a rank its peers may be
# waiting on that is not working towards them; orange: computing (the desync rule holds it to the ceiling);
# blue: waiting in a collective itself; purple: waiting on its own GPU (a hung kernel is a hang: no hold). On a
# disagreement between exporters the higher number is shown.
ACTIVITY_STYLE: dict[str, tuple[int, str]] = {
    ACTIVITY_UNKNOWN: (0, "gray"),
    ACTIVITY_IN_COLLECTIVE: (1, "blue"),
    ACTIVITY_GPU_WAIT: (2, "purple"),
    ACTIVITY_BUSY: (3, "orange"),
    ACTIVITY_IDLE: (4, "light-red"),
    ACTIVITY_WEDGED: (5, "red"),
    ACTIVITY_GONE: (6, "dark-red"),
}


def activity_code(*matchers: str) -> str:
    """The selected rank's activity as one number (ACTIVITY_STYLE), for a stat or a state timeline."""
    codes = " or ".join(
        f"(0 * {sel(n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS, *matchers, eq(n.L_STATE, state))} + {code})"
        for state, (code, _) in ACTIVITY_STYLE.items()
    )
    return f"max({codes})"


def activity_age(*matchers: str) -> str:
    """Seconds each selected rank has been in its current activity; one series per (job_id, rank), with `state`.

    bottomk keeps the freshest where two exporters report the rank, so that a join on it stays one-to-one.
    """
    since = age(sel(n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS, *matchers))
    return f"bottomk {by(n.L_JOB_ID, n.L_RANK)} (1, {since})"


def or_zero(expr: str) -> str:
    # A count of nothing is no data in PromQL; on-call wants a green 0.
    return f"{expr} or vector(0)"


def pg_timeout(*matchers: str) -> str:
    """The PG's watchdog timeout, one series per PG: exported per node, without a rank; the shortest wins."""
    return f"min {by(*PG_KEY)} ({sel(n.PG_TIMEOUT_SECONDS, *matchers)})"


def budget_left(*matchers: str) -> str:
    """Per rank (the in-flight side's labels): timeout minus the age of its oldest in-flight collective."""
    waited = age(sel(n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS, *matchers))
    return f"{pg_timeout(*matchers)} - on ({', '.join(PG_KEY)}) group_right () ({waited})"


def pg_behind(group_matchers: Sequence[str], rank_matchers: Sequence[str], group_by: Sequence[str]) -> str:
    """How many collectives each selected rank trails its PG's furthest rank by.

    The left side is one series per PG (recording rule); the right side may
    carry duplicates from several exporters, hence group_right. The rule is
    evaluated apart from the scrape, so a rank sampled after it can be ahead
    for one evaluation: clamped, since "behind by -1" reads like a bug.
    """
    group_side = sel(R_ENQUEUED_MAX, *group_matchers)
    rank_side = sel(n.PG_LAST_ENQUEUED_SEQ, *rank_matchers)
    joined = f"{group_side} - on ({', '.join(PG_KEY)}) group_right () {rank_side}"
    return f"clamp_min(max {by(*group_by)} ({joined}), 0)"


def gpus_of(*rank_matchers: str) -> str:
    """One series per GPU uuid used by the selected ranks, value 1.

    max by (gpu_uuid) makes the side unique even when ranks share a GPU or two
    exporters report the same rank, so the join below never hits many-to-many.
    """
    return f"max {by(n.L_GPU_UUID)} ({sel(n.RANK_INFO, *rank_matchers, HAS_GPU)})"


def on_gpus(gpu_expr: str, *rank_matchers: str, keep: Sequence[str] = ()) -> str:
    """``gpu_expr`` restricted to the selected ranks' GPUs: rank_info joined on gpu_uuid.

    Deduplicated per (gpu_uuid, keep) first: in sidecar mode every pod's
    exporter may read the same GPU.
    """
    deduped = f"max {by(n.L_GPU_UUID, *keep)} ({gpu_expr})"
    return f"{deduped} * on ({n.L_GPU_UUID}) group_left () {gpus_of(*rank_matchers)}"


def per_rank_gpu(per_gpu_expr: str, *rank_matchers: str) -> str:
    """One value per rank from its GPU; ``per_gpu_expr`` must be unique per gpu_uuid.

    The rank map is the "many" side, so ranks that share a GPU (gloo ranks
    reporting the same visible device) still join.
    """
    ranks = f"max {by(n.L_GPU_UUID, n.L_RANK)} ({sel(n.RANK_INFO, *rank_matchers, HAS_GPU)})"
    return f"max {by(n.L_RANK)} ({ranks} * on ({n.L_GPU_UUID}) group_left () {per_gpu_expr})"
