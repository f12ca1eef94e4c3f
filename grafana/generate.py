#!/usr/bin/env python3
"""Generate frexporter's Grafana dashboards, or check the committed JSON for drift.

    python grafana/generate.py            # (re)write grafana/frexporter-*.json
    python grafana/generate.py --check    # exit 1 with a diff when they differ from this code

The JSON files are build outputs committed for users and the Helm chart
(``scripts/sync_chart.py`` copies them); this module is their only source.
Every metric name comes from ``frexporter.naming`` and every aggregate from a
recording rule in ``frexporter/rules/frexporter.rules.yml``, so a rename breaks
the generator or its tests instead of silently emptying a panel.

Queries are registered as panels are built, each with the conditions under
which it returns data (``Needs``). ``all_panel_queries()`` hands them, with the
dashboard variables substituted, to tests that check them with promtool or run
them against a real Prometheus scraping a real job.

Dev tooling only: needs ``grafana-foundation-sdk==1769699379!11.6.0`` (the
Grafana 11.6 build, schemaVersion 41), which is not a runtime dependency.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

REPO = Path(__file__).resolve().parents[1]
# Run as a script from a checkout, frexporter need not be installed; its
# names must come from this tree, never from another installed copy.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from grafana_foundation_sdk.builders import common as bcommon  # noqa: E402
from grafana_foundation_sdk.builders import dashboard as bdash  # noqa: E402
from grafana_foundation_sdk.builders import prometheus as bprom  # noqa: E402
from grafana_foundation_sdk.builders import stat as bstat  # noqa: E402
from grafana_foundation_sdk.builders import statetimeline as bstate  # noqa: E402
from grafana_foundation_sdk.builders import table as btable  # noqa: E402
from grafana_foundation_sdk.builders import timeseries as bts  # noqa: E402
from grafana_foundation_sdk.cog.encoder import JSONEncoder  # noqa: E402
from grafana_foundation_sdk.models import common as mcommon  # noqa: E402
from grafana_foundation_sdk.models import dashboard as mdash  # noqa: E402
from grafana_foundation_sdk.models import prometheus as mprom  # noqa: E402

from frexporter import naming as n  # noqa: E402
from frexporter.model import (  # noqa: E402
    ACTIVITY_BUSY,
    ACTIVITY_GONE,
    ACTIVITY_IDLE,
    ACTIVITY_IN_COLLECTIVE,
    ACTIVITY_UNKNOWN,
    ACTIVITY_WEDGED,
)

if TYPE_CHECKING:
    from typing import Self

__all__ = [
    "DASHBOARD_FILES",
    "OUT_DIR",
    "SAMPLE_VARIABLES",
    "Needs",
    "PanelQuery",
    "all_panel_queries",
    "build_dashboards",
    "check",
    "main",
    "metric_names",
    "panel_queries",
    "panel_targets",
    "render",
    "substitute",
    "variable_selectors",
    "write",
]

OUT_DIR = REPO / "grafana"
TAGS = ["frexporter"]
# Where an alert's runbook lives, relative to the repository root: the canonical rules' runbook_url says the
# same (tests/test_dashboards.py checks). The Active alerts table links to it under the dashboard variable
# below, which the Helm chart fills from prometheusRule.runbookBaseURL; frexporter has no address of its own.
RUNBOOK_PATH = "docs/runbooks/{}.md"
V_RUNBOOK_BASE = "runbook_base"

UID_JOB = "frexporter-job"
UID_PG = "frexporter-pg"
UID_RANK = "frexporter-rank"
DASHBOARD_FILES = {
    UID_JOB: "frexporter-job.json",
    UID_PG: "frexporter-pg.json",
    UID_RANK: "frexporter-rank.json",
}

# Dashboard variables are named after the labels they select on, so that
# Grafana's "include variables" links and ${var:queryparam} carry over.
V_DATASOURCE = "datasource"
V_JOB = n.L_JOB_ID
V_PG = n.L_PG
V_RANK = n.L_RANK

# Values that make every query a valid, data-returning PromQL expression for a
# job like tests/golden/metrics.txt; callers override what their job differs in.
SAMPLE_VARIABLES: dict[str, str] = {
    V_DATASOURCE: "prometheus",
    V_JOB: "llm",
    V_PG: "0",
    V_RANK: "0",
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "1h",
}

DATASOURCE = mdash.DataSourceRef(type_val="prometheus", uid="${" + V_DATASOURCE + "}")


class Needs:
    """Conditions under which a query returns data, beyond a running job being scraped.

    A test that runs every query against a real Prometheus passes the
    conditions its scenario meets and asserts data only for those queries.
    """

    RULES = "recording_rules"  # frexporter.rules.yml is loaded into Prometheus
    INFLIGHT = "inflight"  # some rank has a collective in flight (e.g. a hang)
    VERDICT = "verdict"  # the exporter has an open verdict
    ALERT = "alert"  # a Frexporter* alert is pending or firing
    GPU = "gpu"  # NVML is on and the ranks report a GPU uuid
    XID = "xid"  # a GPU raised an Xid since the exporter started
    NCCL_TIMING = "nccl_timing"  # NCCL with TORCH_NCCL_ENABLE_TIMING=1 (started seq)
    COLLECTIVE_METRICS = "collective_metrics"  # duration histogram and byte counters are exported
    RECORDER_ERRORS = "recorder_errors"  # a rank's recorder met an error
    SCRAPE_JOB = "frexporter_scrape_job"  # the Prometheus scrape job name contains "frexporter"

    ALL = frozenset(
        {RULES, INFLIGHT, VERDICT, ALERT, GPU, XID, NCCL_TIMING, COLLECTIVE_METRICS, RECORDER_ERRORS, SCRAPE_JOB}
    )


# ---------------------------------------------------------------------------
# PromQL vocabulary


def _rule(level: str, metric: str, agg: str) -> str:
    """A recording rule name as frexporter.rules.yml spells it (level:metric:operation)."""
    return f"{level}:{metric}:{agg}"


_JOB_PG = f"{n.L_JOB_ID}_{n.L_PG}"
R_ENQUEUED_MAX = _rule(_JOB_PG, n.PG_LAST_ENQUEUED_SEQ, "max")
R_ENQUEUED_SKEW = _rule(_JOB_PG, n.PG_LAST_ENQUEUED_SEQ, "skew")
R_COMPLETED_MIN = _rule(_JOB_PG, n.PG_LAST_COMPLETED_SEQ, "min")
R_COMPLETED_SKEW = _rule(_JOB_PG, n.PG_LAST_COMPLETED_SEQ, "skew")
R_PG_RANKS = _rule(_JOB_PG, n.PREFIX + "pg_ranks", "count")
R_PG_RANKS_INFLIGHT = _rule(_JOB_PG, n.PREFIX + "pg_ranks_inflight", "count")
R_OLDEST_INFLIGHT_AGE = _rule(_JOB_PG, n.PREFIX + "pg_oldest_inflight_age_seconds", "max")
R_BUDGET_USED = _rule(_JOB_PG, n.PREFIX + "pg_watchdog_budget_used_ratio", "max")
R_RANKS_UP_SUM = _rule(n.L_JOB_ID, n.RANK_UP, "sum")
R_RANKS_UP_COUNT = _rule(n.L_JOB_ID, n.RANK_UP, "count")
R_HEARTBEAT_AGE_MAX = _rule(n.L_JOB_ID, n.PREFIX + "rank_heartbeat_age_seconds", "max")

# Prometheus' own series (not frexporter's); the only other names a query may use.
ALERTS = "ALERTS"
UP = "up"
EXTERNAL_METRICS = frozenset({ALERTS, UP})
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")

# Condition each series needs to exist (see Needs). Unlisted series exist
# whenever a job is being scraped.
_NEEDS_BY_METRIC: dict[str, frozenset[str]] = {
    n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS: frozenset({Needs.INFLIGHT}),
    R_PG_RANKS_INFLIGHT: frozenset({Needs.RULES, Needs.INFLIGHT}),
    R_OLDEST_INFLIGHT_AGE: frozenset({Needs.RULES, Needs.INFLIGHT}),
    R_BUDGET_USED: frozenset({Needs.RULES, Needs.INFLIGHT}),
    n.VERDICT: frozenset({Needs.VERDICT}),
    ALERTS: frozenset({Needs.ALERT}),
    UP: frozenset({Needs.SCRAPE_JOB}),
    n.PG_LAST_STARTED_SEQ: frozenset({Needs.NCCL_TIMING}),
    n.COLLECTIVE_DURATION_SECONDS + "_bucket": frozenset({Needs.COLLECTIVE_METRICS}),
    n.COLLECTIVE_BYTES_TOTAL: frozenset({Needs.COLLECTIVE_METRICS}),
    n.RANK_RECORDER_ERRORS_TOTAL: frozenset({Needs.RECORDER_ERRORS}),
    n.GPU_XID_ERRORS_TOTAL: frozenset({Needs.GPU, Needs.XID}),
}


def _var(name: str) -> str:
    return "$" + name


def _eq(label: str, value: str | None = None) -> str:
    """``label="$label"``: a matcher on the dashboard variable named after the label."""
    return f'{label}="{_var(label) if value is None else value}"'


def _sel(metric: str, *matchers: str) -> str:
    return f"{metric}{{{', '.join(matchers)}}}" if matchers else metric


def _by(*labels: str) -> str:
    return f"by ({', '.join(labels)})"


def _rate(expr: str) -> str:
    return f"rate({expr}[{_var('__rate_interval')}])"


def _increase(expr: str) -> str:
    return f"increase({expr}[{_var('__rate_interval')}])"


JOB = _eq(n.L_JOB_ID)
PG = (JOB, _eq(n.L_PG))
RANK = (JOB, _eq(n.L_RANK))
PG_KEY = (n.L_JOB_ID, n.L_PG, n.L_PG_DESC)
HAS_GPU = f'{n.L_GPU_UUID}!=""'
FREXPORTER_SCRAPE_JOB = 'job=~".*frexporter.*"'  # the convention FrexporterExporterDown relies on
FREXPORTER_ALERTS = 'alertname=~"Frexporter.*"'
# Exporter-wide alerts (ExporterDown, SourceDown) have no job_id: show them
# with the job's own, since they can hide its ranks.
ALERTS_OF_JOB = (FREXPORTER_ALERTS, f'{n.L_JOB_ID}=~"{_var(V_JOB)}|"')
FIRING = 'alertstate="firing"'


def _age(timestamp: str) -> str:
    return f"time() - {timestamp}"


# Each activity state (label `state` of frexporter_rank_activity_since_timestamp_seconds): a number, for panels
# that draw the state as a value (PromQL values are numbers), and a colour. Red: a rank its peers may be
# waiting on that is not working towards them; orange: computing (the desync rule holds it to the ceiling);
# blue: waiting in a collective itself. On a disagreement between exporters the higher number is shown.
ACTIVITY_STYLE: dict[str, tuple[int, str]] = {
    ACTIVITY_UNKNOWN: (0, "gray"),
    ACTIVITY_IN_COLLECTIVE: (1, "blue"),
    ACTIVITY_BUSY: (2, "orange"),
    ACTIVITY_IDLE: (3, "light-red"),
    ACTIVITY_WEDGED: (4, "red"),
    ACTIVITY_GONE: (5, "dark-red"),
}


def _activity_code(*matchers: str) -> str:
    """The selected rank's activity as one number (ACTIVITY_STYLE), for a stat or a state timeline."""
    codes = " or ".join(
        f"(0 * {_sel(n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS, *matchers, _eq(n.L_STATE, state))} + {code})"
        for state, (code, _) in ACTIVITY_STYLE.items()
    )
    return f"max({codes})"


def _activity_age(*matchers: str) -> str:
    """Seconds each selected rank has been in its current activity; one series per (job_id, rank), with `state`.

    bottomk keeps the freshest where two exporters report the rank, so that a join on it stays one-to-one.
    """
    age = _age(_sel(n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS, *matchers))
    return f"bottomk {_by(n.L_JOB_ID, n.L_RANK)} (1, {age})"


def _or_zero(expr: str) -> str:
    # A count of nothing is no data in PromQL; on-call wants a green 0.
    return f"{expr} or vector(0)"


def _timeout(*matchers: str) -> str:
    """The PG's watchdog timeout, one series per PG: exported per node, without a rank; the shortest wins."""
    return f"min {_by(*PG_KEY)} ({_sel(n.PG_TIMEOUT_SECONDS, *matchers)})"


def _budget_left(*matchers: str) -> str:
    """Per rank (the in-flight side's labels): timeout minus the age of its oldest in-flight collective."""
    age = _age(_sel(n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS, *matchers))
    return f"{_timeout(*matchers)} - on ({', '.join(PG_KEY)}) group_right () ({age})"


def _pg_behind(group_matchers: Sequence[str], rank_matchers: Sequence[str], by: Sequence[str]) -> str:
    """How many collectives each selected rank trails its PG's furthest rank by.

    The left side is one series per PG (recording rule); the right side may
    carry duplicates from several exporters, hence group_right. The rule is
    evaluated apart from the scrape, so a rank sampled after it can be ahead
    for one evaluation: clamped, since "behind by -1" reads like a bug.
    """
    group_side = _sel(R_ENQUEUED_MAX, *group_matchers)
    rank_side = _sel(n.PG_LAST_ENQUEUED_SEQ, *rank_matchers)
    joined = f"{group_side} - on ({', '.join(PG_KEY)}) group_right () {rank_side}"
    return f"clamp_min(max {_by(*by)} ({joined}), 0)"


def _gpus_of(*rank_matchers: str) -> str:
    """One series per GPU uuid used by the selected ranks, value 1.

    max by (gpu_uuid) makes the side unique even when ranks share a GPU or two
    exporters report the same rank, so the join below never hits many-to-many.
    """
    return f"max {_by(n.L_GPU_UUID)} ({_sel(n.RANK_INFO, *rank_matchers, HAS_GPU)})"


def _on_gpus(gpu_expr: str, *rank_matchers: str, keep: Sequence[str] = ()) -> str:
    """``gpu_expr`` restricted to the selected ranks' GPUs: rank_info joined on gpu_uuid.

    Deduplicated per (gpu_uuid, keep) first: in sidecar mode every pod's
    exporter may read the same GPU.
    """
    deduped = f"max {_by(n.L_GPU_UUID, *keep)} ({gpu_expr})"
    return f"{deduped} * on ({n.L_GPU_UUID}) group_left () {_gpus_of(*rank_matchers)}"


def _per_rank_gpu(per_gpu_expr: str, *rank_matchers: str) -> str:
    """One value per rank from its GPU; ``per_gpu_expr`` must be unique per gpu_uuid.

    The rank map is the "many" side, so ranks that share a GPU (gloo ranks
    reporting the same visible device) still join.
    """
    ranks = f"max {_by(n.L_GPU_UUID, n.L_RANK)} ({_sel(n.RANK_INFO, *rank_matchers, HAS_GPU)})"
    return f"max {_by(n.L_RANK)} ({ranks} * on ({n.L_GPU_UUID}) group_left () {per_gpu_expr})"


# ---------------------------------------------------------------------------
# Query registry


@dataclass(frozen=True)
class PanelQuery:
    """One target of one panel, as it sits in the dashboard JSON."""

    dashboard_uid: str
    panel_title: str
    ref_id: str
    expr: str  # with Grafana variables ($job_id, $__rate_interval, ...)
    instant: bool
    needs: frozenset[str]


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""
    ref_id: str = ""  # assigned A, B, ... in panel order when empty
    column: str = ""  # table column title for the value of this query
    instant: bool = False
    needs: frozenset[str] | None = None  # None: derived from the metric names


_STRING = re.compile(r'"(?:\\.|[^"\\])*"' + r"|'(?:\\.|[^'\\])*'" + r"|`[^`]*`")
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w:.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")
_KEYWORDS = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
    # Aggregation operators may be followed by "by (...)" instead of "(".
    | {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk"}
    | {"quantile", "inf", "nan", "Inf", "NaN"}
)


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (a lexical scan, enough for these dashboards).

    Strings, label matchers, ranges and grouping label lists are removed
    first; what is left that is neither a function call nor a keyword is a
    metric name.
    """
    text = _STRING.sub('""', expr)
    text = _BRACES.sub("{}", text)
    text = _BRACKETS.sub("[]", text)
    text = _LABEL_LIST.sub(r"\1 ()", text)
    names = set()
    for match in _IDENT.finditer(text):
        name, call = match.group(1), match.group(2)
        if call is None and name not in _KEYWORDS:
            names.add(name)
    return names


def _derived_needs(expr: str) -> frozenset[str]:
    needs: set[str] = set()
    for name in metric_names(expr):
        needs |= _NEEDS_BY_METRIC.get(name, frozenset())
        if ":" in name:
            needs.add(Needs.RULES)
        if name.startswith(n.PREFIX + "gpu_"):
            needs.add(Needs.GPU)
    return frozenset(needs)


_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def substitute(expr: str, variables: Mapping[str, str] | None = None) -> str:
    """``expr`` with Grafana variables replaced by ``variables`` over ``SAMPLE_VARIABLES``.

    Raises ``KeyError`` for a variable neither provides, so a new variable
    cannot slip into a query that no test knows how to run.
    """
    values = {**SAMPLE_VARIABLES, **(variables or {})}

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"no value for dashboard variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(replace, expr)


# ---------------------------------------------------------------------------
# Panel helpers


class _Panel(Protocol):
    """What every SDK panel builder offers (they share no base class)."""

    def build(self) -> mdash.Panel: ...
    def title(self, title: str) -> Self: ...
    def description(self, description: str) -> Self: ...
    def id(self, id_val: int) -> Self: ...
    def datasource(self, datasource: mdash.DataSourceRef) -> Self: ...
    def targets(self, targets: list[Any]) -> Self: ...
    def height(self, h: int) -> Self: ...
    def span(self, w: int) -> Self: ...
    def with_transformation(self, transformation: mdash.DataTransformerConfig) -> Self: ...


def _thresholds(*steps: tuple[float | None, str]) -> bdash.ThresholdsConfig:
    return (
        bdash.ThresholdsConfig()
        .mode(mdash.ThresholdsMode.ABSOLUTE)
        .steps([mdash.Threshold(value=value, color=color) for value, color in steps])
    )


GREEN_ONLY = _thresholds((None, "green"))
# Fractions of the watchdog timeout: FrexporterWatchdogBudget fires by 0.5.
BUDGET_STEPS = _thresholds((None, "green"), (0.25, "orange"), (0.5, "red"))
# Seconds: the heartbeat is written every second; FrexporterRankUnresponsive fires after 60 s.
HEARTBEAT_STEPS = _thresholds((None, "green"), (10, "orange"), (60, "red"))
ANY_IS_BAD = _thresholds((None, "green"), (1, "red"))


def _mapping(values: Mapping[str, tuple[str, str]]) -> list[mdash.ValueMapping]:
    """Value mappings from ``{value: (text, color)}``."""
    options = {value: mdash.ValueMappingResult(text=text, color=color) for value, (text, color) in values.items()}
    return [mdash.ValueMap(options=options)]


UP_MAPPING = _mapping({"0": ("DOWN", "red"), "1": ("UP", "green")})
ACTIVITY_MAPPING = _mapping({str(code): (state, color) for state, (code, color) in ACTIVITY_STYLE.items()})
ACTIVITY_LABEL_MAPPING = _mapping({state: (state, color) for state, (_, color) in ACTIVITY_STYLE.items()})
# A neutral colour for durations that are neither good nor bad by themselves.
NEUTRAL = _thresholds((None, "text"))
LOST_MAPPING = _mapping({"0": ("OK", "green"), "1": ("LOST", "red")})
THROTTLE_MAPPING = _mapping({"0": ("ok", "green"), "1": ("throttled", "orange")})


def _url(uid: str, *params: str) -> str:
    """A link into another frexporter dashboard that keeps the datasource, job and time range."""
    query = "&".join(["${" + V_DATASOURCE + ":queryparam}", "${" + V_JOB + ":queryparam}", *params])
    return f"/d/{uid}?{query}&${{__url_time_range}}"


def _link(title: str, url: str) -> bdash.DashboardLink:
    return bdash.DashboardLink(title).url(url)


def _series_link_pg() -> bdash.DashboardLink:
    return _link(
        "Process group ${__field.labels.pg_desc} (${__field.labels.pg})", _url(UID_PG, "var-pg=${__field.labels.pg}")
    )


def _series_link_rank() -> bdash.DashboardLink:
    return _link("Rank ${__field.labels.rank}", _url(UID_RANK, "var-rank=${__field.labels.rank}"))


def _cell_links(column: str) -> list[mdash.DynamicConfigValue]:
    """Table-cell data links for a ``pg``, ``rank`` or ``alertname`` column."""
    cell = "${__data.fields." + column + "}"
    if column == n.L_PG:
        link = {"title": f"Process group {cell}", "url": _url(UID_PG, f"var-pg={cell}")}
    elif column == n.L_RANK:
        link = {"title": f"Rank {cell}", "url": _url(UID_RANK, f"var-rank={cell}")}
    elif column == "alertname":
        # :raw, since the base is a URL prefix: percent-encoding it would break the link.
        url = "${" + V_RUNBOOK_BASE + ":raw}/" + RUNBOOK_PATH.format(cell)
        link = {"title": f"Runbook for {cell}", "url": url, "targetBlank": True}
    else:
        raise ValueError(f"no drill-down for column {column!r}")
    return [mdash.DynamicConfigValue(id_val="links", value=[link])]


def _legend(*, table: bool = False, calcs: Sequence[str] = ()) -> bcommon.VizLegendOptions:
    legend = bcommon.VizLegendOptions().show_legend(True).calcs(list(calcs))
    if table:
        return legend.display_mode(mcommon.LegendDisplayMode.TABLE).placement(mcommon.LegendPlacement.RIGHT)
    return legend.display_mode(mcommon.LegendDisplayMode.LIST).placement(mcommon.LegendPlacement.BOTTOM)


def _timeseries(
    *,
    unit: str = "none",
    decimals: int | None = None,
    min_val: float | None = 0,
    max_val: float | None = None,
    stepped: bool = False,
    thresholds: bdash.ThresholdsConfig | None = None,
    links: Sequence[bdash.DashboardLink] = (),
    legend_calcs: Sequence[str] = ("lastNotNull", "max"),
) -> bts.Panel:
    panel = (
        bts.Panel()
        .unit(unit)
        .legend(_legend(table=True, calcs=legend_calcs))
        .tooltip(bcommon.VizTooltipOptions().mode(mcommon.TooltipDisplayMode.MULTI).sort(mcommon.SortOrder.DESCENDING))
        .fill_opacity(0)
        .line_width(1)
        .span_nulls(False)
    )
    if decimals is not None:
        panel = panel.decimals(decimals)
    if min_val is not None:
        panel = panel.min(min_val)
    if max_val is not None:
        panel = panel.max(max_val)
    if stepped:
        # Sequence numbers and 0/1 states jump; interpolating them invents values.
        panel = panel.line_interpolation(mcommon.LineInterpolation.STEP_AFTER)
    if thresholds is not None:
        panel = panel.thresholds(thresholds).thresholds_style(
            bcommon.GraphThresholdsStyleConfig().mode(mcommon.GraphThresholdsStyleMode.DASHED)
        )
    if links:
        panel = panel.data_links(list(links))
    return panel


def _dashed(panel: bts.Panel, colors: Mapping[str, str]) -> bts.Panel:
    """Draw the series of these legends as dashed reference lines in a fixed colour (thresholds, limits)."""
    for legend, color in colors.items():
        panel = panel.override_by_name(legend, [
            mdash.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}),
            mdash.DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": color}),
            # The panel's drill-down links name a series' rank or group; a reference line has neither.
            mdash.DynamicConfigValue(id_val="links", value=[]),
        ])
    return panel


def _stat(
    *,
    unit: str = "none",
    thresholds: bdash.ThresholdsConfig = GREEN_ONLY,
    mappings: list[mdash.ValueMapping] | None = None,
    no_value: str | None = None,
    text_mode: mcommon.BigValueTextMode = mcommon.BigValueTextMode.AUTO,
    decimals: int | None = None,
) -> bstat.Panel:
    panel = (
        bstat.Panel()
        .unit(unit)
        .thresholds(thresholds)
        .color_mode(mcommon.BigValueColorMode.VALUE)
        .graph_mode(mcommon.BigValueGraphMode.NONE)
        .text_mode(text_mode)
        .reduce_options(bcommon.ReduceDataOptions().values(False).calcs(["lastNotNull"]))
        .height(4)
    )
    if mappings is not None:
        panel = panel.mappings(mappings)
    if no_value is not None:
        panel = panel.no_value(no_value)
    if decimals is not None:
        panel = panel.decimals(decimals)
    return panel


def _table(
    *,
    links: Sequence[str] = (),
    units: Mapping[str, str] | None = None,
    sort_by: str | None = None,
    merge: bool = False,
    no_value: str | None = None,
    mappings: Mapping[str, list[mdash.ValueMapping]] | None = None,
    colored: Collection[str] = (),
) -> btable.Panel:
    """A table of instant queries: label columns plus one value column per query.

    Columns are named (and hidden) by ``_Board.panel``, which knows the queries. ``mappings`` show a
    column's values as text (and colour); the ``colored`` columns paint their cells in that colour.
    """
    panel = btable.Panel().cell_height(mcommon.TableCellHeight.SM).filterable(True)
    if merge:
        # Several instant queries keyed by the same labels become one row per key.
        panel = panel.with_transformation(mdash.DataTransformerConfig(id_val="merge", options={}))
    # One override per column, so that a column's settings sit together in the JSON.
    properties: dict[str, list[mdash.DynamicConfigValue]] = {}
    for column in links:
        properties.setdefault(column, []).extend(_cell_links(column))
    for column, unit in (units or {}).items():
        properties.setdefault(column, []).append(mdash.DynamicConfigValue(id_val="unit", value=unit))
    for column, column_mappings in (mappings or {}).items():
        properties.setdefault(column, []).append(mdash.DynamicConfigValue(id_val="mappings", value=column_mappings))
    for column in colored:
        cell = {"type": "color-background", "mode": "basic"}
        properties.setdefault(column, []).append(mdash.DynamicConfigValue(id_val="custom.cellOptions", value=cell))
    for column, values in properties.items():
        panel = panel.override_by_name(column, values)
    if sort_by is not None:
        panel = panel.sort_by([bcommon.TableSortByFieldState().display_name(sort_by).desc(True)])
    if no_value is not None:
        panel = panel.no_value(no_value)
    return panel


def _state_timeline(mappings: list[mdash.ValueMapping]) -> bstate.Panel:
    return (
        bstate.Panel()
        .mappings(mappings)
        .thresholds(GREEN_ONLY)
        .show_value(mcommon.VisibilityMode.NEVER)
        .merge_values(True)
        .legend(_legend())
        # Grafana's own defaults, spelled out so the JSON round-trips through the SDK unchanged.
        .fill_opacity(70)
        .line_width(0)
    )


class _Board:
    """A dashboard under construction that numbers its panels and records every query."""

    def __init__(self, uid: str, title: str, description: str,
                 variables: Iterable[bdash.QueryVariable | bdash.TextBoxVariable]) -> None:
        self.uid = uid
        self.queries: list[PanelQuery] = []
        self._next_id = 1
        self.builder = (
            bdash.Dashboard(title)
            .uid(uid)
            .description(description)
            .tags(TAGS)
            .editable()
            .time("now-1h", "now")
            .refresh("30s")
            .timezone("browser")
            .tooltip(mdash.DashboardCursorSync.CROSSHAIR)
            .link(
                bdash.DashboardLink("frexporter")
                .type(mdash.DashboardLinkType.DASHBOARDS)
                .tags(TAGS)
                .as_dropdown(True)
                .include_vars(True)
                .keep_time(True)
            )
            .with_variable(bdash.DatasourceVariable(V_DATASOURCE).label("Prometheus").type("prometheus"))
        )
        for variable in variables:
            self.builder = self.builder.with_variable(variable)

    def _id(self) -> int:
        value = self._next_id
        self._next_id += 1
        return value

    def row(self, title: str) -> None:
        self.builder = self.builder.with_row(bdash.Row(title).id(self._id()))

    def panel(
        self,
        panel: _Panel,
        title: str,
        description: str,
        targets: Sequence[Target],
        *,
        width: int,
        height: int | None = None,
        table: bool = False,
        hide: Sequence[str] = (),
    ) -> None:
        """Add a panel; ``table``: instant rows, Time and ``hide`` columns dropped, values named by ``column``."""
        built_targets = []
        renames: dict[str, str] = {}
        for index, target in enumerate(targets):
            ref_id = target.ref_id or chr(ord("A") + index)
            query = bprom.Dataquery().expr(target.expr).ref_id(ref_id).datasource(DATASOURCE)
            if target.legend:
                query = query.legend_format(target.legend)
            query = query.instant() if target.instant else query.range()
            if table:
                query = query.format(mprom.PromQueryFormat.TABLE)
            if target.column:
                # Grafana names the value of a lone table query "Value", of several "Value #<refId>".
                renames["Value" if len(targets) == 1 else f"Value #{ref_id}"] = target.column
            built_targets.append(query)
            needs = _derived_needs(target.expr) if target.needs is None else target.needs
            self.queries.append(PanelQuery(self.uid, title, ref_id, target.expr, target.instant, needs))
        panel = panel.title(title).description(description).id(self._id()).datasource(DATASOURCE)
        panel = panel.targets(built_targets).span(width)
        if height is not None:
            panel = panel.height(height)
        if table:
            organize = {"excludeByName": dict.fromkeys(["Time", "__name__", *hide], True), "renameByName": renames}
            panel = panel.with_transformation(mdash.DataTransformerConfig(id_val="organize", options=organize))
        self.builder = self.builder.with_panel(panel)

    def build(self) -> dict[str, Any]:
        encoded: dict[str, Any] = json.loads(json.dumps(self.builder.build(), cls=JSONEncoder))
        return encoded


def _query_variable(name: str, label: str, selector: str, sort: mdash.VariableSort) -> bdash.QueryVariable:
    return (
        bdash.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(f"label_values({selector}, {name})")
        .refresh(mdash.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(sort)
    )


def _job_variable() -> bdash.QueryVariable:
    return _query_variable(V_JOB, "Job", n.RANK_INFO, mdash.VariableSort.ALPHABETICAL_ASC)


def _runbook_base_variable() -> bdash.TextBoxVariable:
    """The URL the repository's files are served under, e.g. https://github.com/ORG/frexporter/blob/v0.1.0:
    empty here (no address is made up); set it in the dashboard settings or through the Helm chart."""
    empty = mdash.VariableOption(selected=True, text="", value="")
    return (
        bdash.TextBoxVariable(V_RUNBOOK_BASE)
        .label("Runbook base URL")
        .description("URL of a frexporter source tree, e.g. https://github.com/ORG/frexporter/blob/v0.1.0: alert "
                     "names in Active alerts link to docs/runbooks/ALERT.md under it. The Helm chart sets it from "
                     "prometheusRule.runbookBaseURL.")
        .default_value("")
        .current(empty)
        .options([empty])
    )


def _pg_variable() -> bdash.QueryVariable:
    return _query_variable(V_PG, "Process group", _sel(n.PG_INFO, JOB), mdash.VariableSort.NATURAL_ASC)


def _rank_variable() -> bdash.QueryVariable:
    return _query_variable(V_RANK, "Rank", _sel(n.RANK_INFO, JOB), mdash.VariableSort.NATURAL_ASC)


_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.*),\s*(?P<label>\w+)\)$")


def variable_selectors(dashboard: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(variable name, series selector) of every ``label_values`` query variable of a dashboard JSON."""
    result = []
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        match = _LABEL_VALUES.match(str(variable["query"]))
        if match is None:
            raise ValueError(f"variable {variable['name']} is not a label_values() query: {variable['query']!r}")
        result.append((variable["name"], match["selector"]))
    return result


# ---------------------------------------------------------------------------
# Dashboards

_PG_LEGEND = "{{pg_desc}} (pg {{pg}})"
LEGEND_LEARNED = "learned threshold"
LEGEND_CEILING = "busy culprit ceiling"
_RANK_LEGEND = "rank {{rank}}"


def _job_dashboard() -> _Board:
    b = _Board(
        UID_JOB,
        "frexporter / Job",
        "Is this distributed PyTorch job making progress, and if not: which process group, which rank, "
        "how long until the watchdog kills it. Drill down to a process group or a rank from any table or series.",
        [_job_variable(), _runbook_base_variable()],
    )
    w = 3
    b.row("Health")
    b.panel(
        _stat(decimals=0),
        "Ranks up",
        "Ranks whose process answered the exporter's last poll (frexporter_rank_up summed over the job).",
        [Target(_sel(R_RANKS_UP_SUM, JOB), instant=True)],
        width=w,
    )
    b.panel(
        _stat(thresholds=ANY_IS_BAD, decimals=0),
        "Ranks down",
        "Ranks reported but not answering: dead pid or a socket that stopped answering. Any rank down dooms "
        "the job at its next collective with that rank (FrexporterRankDown).",
        [Target(_or_zero(f"count({_sel(n.RANK_UP, JOB)} == 0)"), instant=True, needs=frozenset())],
        width=w,
    )
    b.panel(
        _stat(text_mode=mcommon.BigValueTextMode.VALUE_AND_NAME, decimals=0),
        "Ranks reporting / world size",
        "Ranks that some exporter reports (value), by the world size they claim (name). Fewer than the world size: "
        "a node's exporter is down or not scraped, and its ranks are invisible here.",
        [
            Target(
                f"count {_by(n.L_WORLD_SIZE)} ({_sel(n.RANK_INFO, JOB)})",
                legend="world size {{world_size}}",
                instant=True,
            )
        ],
        width=w,
    )
    b.panel(
        _stat(decimals=0),
        "Process groups",
        "Process groups of the job, by cross-rank name (the default group, TP/PP/DP subgroups, ...).",
        [Target(f"count({_sel(R_PG_RANKS, JOB)})", instant=True)],
        width=w,
    )
    b.panel(
        _stat(thresholds=ANY_IS_BAD, decimals=0),
        "Ranks named by verdicts",
        "Culprit ranks named by the exporters' verdict engine right now (see Open verdicts below).",
        [Target(_or_zero(f"count({_sel(n.VERDICT, JOB)})"), instant=True, needs=frozenset())],
        width=w,
    )
    b.panel(
        _stat(thresholds=ANY_IS_BAD, decimals=0),
        "Firing alerts",
        "Frexporter alerts firing for this job, plus exporter-wide ones (exporter or source down).",
        [Target(_or_zero(f"count({_sel(ALERTS, *ALERTS_OF_JOB, FIRING)})"), instant=True, needs=frozenset())],
        width=w,
    )
    b.panel(
        _stat(unit="percentunit", thresholds=BUDGET_STEPS, no_value="nothing in flight"),
        "Worst watchdog budget used",
        "Largest share of the watchdog timeout used by an in-flight collective, over all process groups. "
        "The watchdog aborts the job at 100%; FrexporterWatchdogBudget pages by 50%.",
        [Target(f"max({_sel(R_BUDGET_USED, JOB)})", instant=True)],
        width=w,
    )
    b.panel(
        _stat(unit="s", thresholds=HEARTBEAT_STEPS),
        "Oldest heartbeat",
        "Age of the stalest rank heartbeat. The heartbeat is written from Python every second: a large age on a "
        "rank that is up means its interpreter is wedged (FrexporterRankUnresponsive).",
        [Target(_sel(R_HEARTBEAT_AGE_MAX, JOB), instant=True)],
        width=w,
    )

    b.row("Verdicts and alerts")
    verdict_key = (n.L_KIND, n.L_RANK, n.L_PG, n.L_PG_DESC, n.L_OP, n.L_SEQ, n.L_CULPRIT_FUNCTION)
    # The culprit's activity joined on; a culprit no exporter reports activity for (absent, its node's
    # exporter gone) keeps its row, as "unknown" for an unknown time (NaN, shown as a dash).
    with_activity = (
        f"max {_by(*verdict_key, n.L_STATE)} ({_sel(n.VERDICT, JOB)} * on ({n.L_JOB_ID}, {n.L_RANK}) "
        f"group_left ({n.L_STATE}) {_activity_age(JOB)})"
    )
    without_activity = (
        f'label_replace(max {_by(*verdict_key)} ({_sel(n.VERDICT, JOB)} unless on ({n.L_JOB_ID}, {n.L_RANK}) '
        f'{_sel(n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS, JOB)}) * NaN, "{n.L_STATE}", "{ACTIVITY_UNKNOWN}", "", "")'
    )
    b.panel(
        _table(
            links=(n.L_RANK, n.L_PG),
            no_value="No open verdicts",
            units={"for": "s"},
            mappings={
                n.L_STATE: ACTIVITY_LABEL_MAPPING,
                "for": [mdash.SpecialValueMap(options=mdash.DashboardSpecialValueMapOptions(
                    match=mdash.SpecialValueMatch.NA_N, result=mdash.ValueMappingResult(text="-")))],
            },
            colored=(n.L_STATE,),
        ),
        "Open verdicts",
        "One row per culprit rank: kind (missing_rank, mismatch, stalled, rank_down, rank_unresponsive, straggler), "
        "the process group and the collective (op, seq), the function the rank is in, and what it is doing now and "
        "for how long: in_collective (waiting in another collective), busy (computing: FrexporterCollectiveDesync "
        "waits for the ceiling and fires as info), idle, wedged (Python stopped), gone (process dead), unknown. "
        "Click a rank or a process group to drill down; GET /api/v1/status on the exporter has the one-sentence "
        "summary.",
        [Target(f"{with_activity} or {without_activity}", instant=True, column="for")],
        width=14,
        height=8,
        table=True,
    )
    b.panel(
        _table(links=("alertname",), no_value="No Frexporter alerts"),
        "Active alerts",
        "Frexporter alerts pending or firing for this job or its exporters. Click an alert name for its runbook, "
        "under the Runbook base URL variable (set it in the dashboard settings, or through the Helm chart).",
        [
            Target(
                f"max {_by('alertname', 'alertstate', 'severity', n.L_PG, n.L_RANK, n.L_SOURCE, 'instance')} "
                f"({_sel(ALERTS, *ALERTS_OF_JOB)})",
                instant=True,
            )
        ],
        width=10,
        height=8,
        table=True,
        hide=("Value",),
    )

    b.row("Progress")
    b.panel(
        _timeseries(unit="ops", links=[_series_link_pg()]),
        "Progress per process group",
        "Collectives per second completed by the slowest rank of each process group. A group at zero while "
        "others advance is stuck (or idle by design, e.g. a pipeline group between micro-batches).",
        [Target(_rate(_sel(R_COMPLETED_MIN, JOB)), legend=_PG_LEGEND)],
        width=12,
        height=8,
    )
    b.panel(
        _timeseries(decimals=0, stepped=True, links=[_series_link_pg()]),
        "Sequence skew per process group",
        "Collectives the furthest-ahead rank has enqueued beyond the furthest-behind one. Healthy jobs show 0 or "
        "1 (ranks enqueue asynchronously); a skew that stays above 0 while progress is flat means a rank has not "
        "joined the collective its peers wait on (FrexporterCollectiveDesync).",
        [Target(_sel(R_ENQUEUED_SKEW, JOB), legend=_PG_LEGEND)],
        width=12,
        height=8,
    )
    # Merged tables join rows on their label columns, so every query is reduced
    # to exactly (pg, pg_desc): no __name__ or job_id to keep rows apart.
    by_pg = (n.L_PG, n.L_PG_DESC)

    def per_pg(rule: str) -> str:
        return f"max {_by(*by_pg)} ({_sel(rule, JOB)})"

    b.panel(
        _table(
            merge=True,
            links=(n.L_PG,),
            units={"oldest in flight": "s", "budget used": "percentunit"},
            sort_by="skew",
        ),
        "Process group status",
        "Every process group of the job now: ranks reporting and with work in flight, the slowest rank's completed "
        "sequence, the furthest rank's enqueued sequence, the skew of enqueued sequences across ranks, the oldest "
        "in-flight collective and the watchdog budget it used. Click a group to see its ranks.",
        [
            Target(per_pg(R_PG_RANKS), instant=True, column="ranks"),
            Target(per_pg(R_PG_RANKS_INFLIGHT), instant=True, column="ranks in flight"),
            Target(per_pg(R_COMPLETED_MIN), instant=True, column="min completed"),
            Target(per_pg(R_ENQUEUED_MAX), instant=True, column="max enqueued"),
            Target(per_pg(R_ENQUEUED_SKEW), instant=True, column="skew"),
            Target(per_pg(R_OLDEST_INFLIGHT_AGE), instant=True, column="oldest in flight"),
            Target(per_pg(R_BUDGET_USED), instant=True, column="budget used"),
        ],
        width=24,
        height=8,
        table=True,
    )

    b.row("Watchdog")
    b.panel(
        _timeseries(unit="percentunit", max_val=1, thresholds=BUDGET_STEPS, links=[_series_link_pg()]),
        "Watchdog budget used per process group",
        "Share of the watchdog timeout used by each group's oldest in-flight collective (worst rank). Healthy jobs "
        "stay near 0; a climbing line is a hang heading for the watchdog abort at 100%.",
        [Target(_sel(R_BUDGET_USED, JOB), legend=_PG_LEGEND)],
        width=8,
        height=8,
    )
    b.panel(
        _timeseries(unit="s", links=[_series_link_pg()], legend_calcs=("lastNotNull", "min")),
        "Watchdog time left per process group",
        "Seconds until the watchdog aborts the job, per group: timeout minus the age of the oldest in-flight "
        "collective, on the rank closest to it. Time left to grab stacks (py-spy) or checkpoint-and-kill.",
        [Target(f"min {_by(n.L_PG, n.L_PG_DESC)} ({_budget_left(JOB)})", legend=_PG_LEGEND)],
        width=8,
        height=8,
    )
    b.panel(
        _timeseries(unit="s", links=[_series_link_pg()]),
        "Oldest in-flight collective per process group",
        "Age of the oldest collective enqueued and not completed on any rank of each group. Short spikes are "
        "normal; a line that keeps rising is a hang.",
        [Target(_sel(R_OLDEST_INFLIGHT_AGE, JOB), legend=_PG_LEGEND)],
        width=8,
        height=8,
    )

    b.row("Exporters and GPUs")
    b.panel(
        _state_timeline(UP_MAPPING),
        "Exporter sources up",
        "Each exporter that reports a rank of this job, per source (ranks: spool directory and sockets; nvml: "
        "GPUs). A source down means missing or stale metrics from that node (FrexporterSourceDown).",
        [
            Target(
                f"max {_by('instance', n.L_SOURCE)} ({n.SOURCE_UP} * on (instance) group_left () "
                f"max {_by('instance')} ({_sel(n.RANK_INFO, JOB)}))",
                legend="{{instance}} {{source}}",
            )
        ],
        width=12,
        height=8,
    )
    b.panel(
        _stat(thresholds=ANY_IS_BAD, decimals=0),
        "Exporters down (all)",
        "frexporter scrape targets Prometheus cannot reach, cluster-wide (a down exporter cannot say which job "
        "it served). Assumes the scrape job name contains 'frexporter'.",
        [Target(_or_zero(f"count({_sel(UP, FREXPORTER_SCRAPE_JOB)} == 0)"), instant=True, needs=frozenset())],
        width=4,
        height=8,
    )
    b.panel(
        _timeseries(decimals=0, links=[_series_link_rank()]),
        "GPU Xid events by rank",
        "Xid events (all codes) on each rank's GPU per rate interval. An Xid next to a hang usually is the cause: "
        "see the rank's dashboard for the codes.",
        [
            Target(
                _per_rank_gpu(
                    f"sum {_by(n.L_GPU_UUID)} (max {_by(n.L_GPU_UUID, n.L_XID)} ({_increase(n.GPU_XID_ERRORS_TOTAL)}))",
                    JOB,
                ),
                legend=_RANK_LEGEND,
            )
        ],
        width=4,
        height=8,
    )
    b.panel(
        _timeseries(decimals=0),
        "GPUs throttled by reason",
        "How many of the job's GPUs are held down by power or thermal limits or a hardware slowdown. "
        "One throttled GPU slows every collective of its groups: a straggler, not a hang.",
        [
            Target(
                f"sum {_by(n.L_REASON)} ({_on_gpus(n.GPU_THROTTLE_REASONS, JOB, keep=(n.L_REASON,))})",
                legend="{{reason}}",
            )
        ],
        width=4,
        height=8,
    )
    return b


def _pg_dashboard() -> _Board:
    b = _Board(
        UID_PG,
        "frexporter / Process group",
        "One process group of a job, rank by rank: who is behind, what is in flight and for how long, "
        "and how much of the watchdog timeout is left. Click a rank's series to open its dashboard.",
        [_job_variable(), _pg_variable()],
    )
    w = 3
    b.row("Process group $pg")
    b.panel(
        _stat(text_mode=mcommon.BigValueTextMode.NAME),
        "Size and backend",
        "Ranks in the group and its backend, as torch.distributed created it.",
        [
            Target(
                f"max {_by(n.L_PG_DESC, n.L_SIZE, n.L_BACKEND)} ({_sel(n.PG_INFO, *PG)})",
                legend="{{pg_desc}}: {{size}} ranks, {{backend}}",
                instant=True,
            )
        ],
        width=6,
    )
    b.panel(
        _stat(decimals=0),
        "Ranks reporting",
        "Ranks of this group some exporter reports; fewer than the size means ranks on an unscraped node.",
        [Target(_sel(R_PG_RANKS, *PG), instant=True)],
        width=w,
    )
    b.panel(
        _stat(decimals=0, no_value="0"),
        "Ranks in flight",
        "Ranks with a collective enqueued and not completed.",
        [Target(_sel(R_PG_RANKS_INFLIGHT, *PG), instant=True)],
        width=w,
    )
    b.panel(
        _stat(decimals=0, thresholds=_thresholds((None, "green"), (2, "orange"))),
        "Sequence skew",
        "Collectives between the furthest-ahead and furthest-behind rank (enqueued). 0 or 1 is healthy.",
        [Target(_sel(R_ENQUEUED_SKEW, *PG), instant=True)],
        width=w,
    )
    b.panel(
        _stat(unit="s"),
        "Watchdog timeout",
        "The group's watchdog timeout (NCCL default 10 min, gloo 30 min).",
        [Target(f"min({_sel(n.PG_TIMEOUT_SECONDS, *PG)})", instant=True)],
        width=w,
    )
    b.panel(
        _stat(unit="percentunit", thresholds=BUDGET_STEPS, no_value="nothing in flight"),
        "Budget used",
        "Share of the watchdog timeout used by the oldest in-flight collective.",
        [Target(_sel(R_BUDGET_USED, *PG), instant=True)],
        width=w,
    )
    b.panel(
        _stat(thresholds=ANY_IS_BAD, decimals=0),
        "Open verdicts",
        "Culprit ranks the verdict engine names in this group now.",
        [Target(_or_zero(f"count({_sel(n.VERDICT, *PG)})"), instant=True, needs=frozenset())],
        width=w,
    )

    b.row("Sequences")
    b.panel(
        _timeseries(decimals=0, min_val=None, stepped=True, links=[_series_link_rank()]),
        "Last enqueued collective per rank",
        "Newest collective (collective domain: send/recv excluded) each rank has issued. The rank whose line "
        "stops below the others is the one the rest wait for.",
        [Target(f"max {_by(n.L_RANK)} ({_sel(n.PG_LAST_ENQUEUED_SEQ, *PG)})", legend=_RANK_LEGEND)],
        width=12,
        height=9,
    )
    b.panel(
        _timeseries(decimals=0, min_val=None, stepped=True, links=[_series_link_rank()]),
        "Last completed collective per rank",
        "Newest collective each rank has seen complete. All lines flat: nothing completes (a stall, or a rank "
        "missing). Lines flat at different heights: the lower ranks are stuck.",
        [Target(f"max {_by(n.L_RANK)} ({_sel(n.PG_LAST_COMPLETED_SEQ, *PG)})", legend=_RANK_LEGEND)],
        width=12,
        height=9,
    )
    b.panel(
        _table(links=(n.L_RANK,), sort_by="behind by"),
        "Ranks behind the furthest rank",
        "Collectives each rank trails the group's furthest-ahead rank by (enqueued). Sorted worst first: during a "
        "desync the top row is the culprit.",
        [Target(_pg_behind(PG, PG, by=(n.L_RANK,)), instant=True, column="behind by")],
        width=8,
        height=9,
        table=True,
    )
    b.panel(
        _timeseries(decimals=0, min_val=None, stepped=True, links=[_series_link_rank()]),
        "Last started collective per rank (NCCL)",
        "Newest collective whose kernel started on the GPU. NCCL with TORCH_NCCL_ENABLE_TIMING=1 only; empty on "
        "gloo. Enqueued but not started: the GPU is busy with something before it.",
        [Target(f"max {_by(n.L_RANK)} ({_sel(n.PG_LAST_STARTED_SEQ, *PG)})", legend=_RANK_LEGEND)],
        width=16,
        height=9,
    )

    b.row("In flight and watchdog")
    b.panel(
        _timeseries(decimals=0, stepped=True, links=[_series_link_rank()]),
        "Collectives in flight per rank",
        "Collectives enqueued and not completed. Peers of a missing rank sit at 1 or more; the missing rank at 0.",
        [Target(f"max {_by(n.L_RANK)} ({_sel(n.PG_INFLIGHT_COLLECTIVES, *PG)})", legend=_RANK_LEGEND)],
        width=8,
        height=8,
    )
    # Per node, without a rank; the lowest is the one the exporters judge by.
    learned = Target(f"min({_sel(n.PG_STUCK_THRESHOLD_SECONDS, *PG)})", legend=LEGEND_LEARNED)
    ceiling = Target(f"min({_sel(n.PG_STUCK_CEILING_SECONDS, *PG)})", legend=LEGEND_CEILING)
    b.panel(
        _dashed(_timeseries(unit="s", links=[_series_link_rank()]), {LEGEND_LEARNED: "red", LEGEND_CEILING: "orange"}),
        "Oldest in-flight age per rank",
        "How long each rank's oldest in-flight collective has waited. Only ranks with work in flight have a line. "
        "Dashed: the group's stuck threshold learned from its history (a wait past it on an idle, wedged, gone or "
        "blocked culprit is a hang) and the ceiling a wait on a busy culprit gets (--stuck-after).",
        [
            Target(
                f"max {_by(n.L_RANK)} ({_age(_sel(n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS, *PG))})",
                legend=_RANK_LEGEND,
            ),
            learned,
            ceiling,
        ],
        width=8,
        height=8,
    )
    b.panel(
        _timeseries(unit="s", links=[_series_link_rank()], legend_calcs=("lastNotNull", "min")),
        "Watchdog time left per rank",
        "Timeout minus the age of the rank's oldest in-flight collective: when this reaches 0 the rank's watchdog "
        "aborts the process group.",
        [Target(f"min {_by(n.L_RANK)} ({_budget_left(*PG)})", legend=_RANK_LEGEND)],
        width=8,
        height=8,
    )
    b.panel(
        _timeseries(unit="s", links=[_series_link_rank()]),
        "Time since last progress per rank",
        "Since each rank last saw its completed sequence advance. Grows on every rank of an idle group too; "
        "read it together with the in-flight panels.",
        [Target(f"max {_by(n.L_RANK)} ({_age(_sel(n.PG_LAST_PROGRESS_TIMESTAMP_SECONDS, *PG))})", legend=_RANK_LEGEND)],
        width=18,
        height=8,
    )
    b.panel(
        _stat(unit="s", text_mode=mcommon.BigValueTextMode.VALUE_AND_NAME),
        "Stuck after",
        "How long a collective of this group may wait before the exporters call it stuck: the threshold learned "
        "from the group's history, where the culprit is idle, wedged, gone or blocked elsewhere, and the ceiling "
        "(--stuck-after) where the culprit is busy computing (FrexporterCollectiveDesync then fires as info).",
        [
            Target(learned.expr, legend=learned.legend, instant=True),
            Target(ceiling.expr, legend=ceiling.legend, instant=True),
        ],
        width=6,
        height=8,
    )

    b.row("Collective performance")
    buckets = _sel(n.COLLECTIVE_DURATION_SECONDS + "_bucket", *PG)
    b.panel(
        _timeseries(unit="s"),
        "Collective duration by op",
        "Median and 99th percentile of completed collectives' durations, by op (NCCL with timing; gloo reports "
        "no durations). A p99 far above the median at a steady rate points at a straggler.",
        [
            Target(
                f"histogram_quantile({q}, sum {_by('le', n.L_OP)} ({_rate(buckets)}))",
                legend=f"{{{{op}}}} p{round(q * 100)}",
            )
            for q in (0.5, 0.99)
        ],
        width=12,
        height=8,
    )
    b.panel(
        _timeseries(unit="Bps"),
        "Collective bytes by op",
        "Bytes moved by this group's collectives per second, by op, summed over the reporting exporters.",
        [Target(f"sum {_by(n.L_OP)} ({_rate(_sel(n.COLLECTIVE_BYTES_TOTAL, *PG))})", legend="{{op}}")],
        width=12,
        height=8,
    )
    return b


IDENTITY_LABELS = (n.L_HOSTNAME, n.L_LOCAL_RANK, n.L_PID, n.L_WORLD_SIZE, n.L_TORCH_VERSION, n.L_GPU_UUID, "instance")


def _rank_dashboard() -> _Board:
    b = _Board(
        UID_RANK,
        "frexporter / Rank",
        "One rank of a job: is its process up and its Python running, where it stands in each of its process "
        "groups, and the health of its GPU.",
        [_job_variable(), _rank_variable()],
    )
    b.row("Rank $rank")
    b.panel(
        _stat(mappings=UP_MAPPING, thresholds=_thresholds((None, "red"), (1, "green")), no_value="not reported"),
        "Up",
        "Whether the rank's process answered the exporter's last poll (fresh heartbeat or live worker socket).",
        [Target(f"max({_sel(n.RANK_UP, *RANK)})", instant=True)],
        width=3,
    )
    b.panel(
        _stat(unit="s", thresholds=HEARTBEAT_STEPS),
        "Heartbeat age",
        "Since the rank's Python last wrote a snapshot (every second). Large while up: its interpreter is "
        "wedged (GIL held by native code, a deadlock); grab its stack with py-spy.",
        [Target(f"max({_age(_sel(n.RANK_HEARTBEAT_TIMESTAMP_SECONDS, *RANK))})", instant=True)],
        width=3,
    )
    b.panel(
        _stat(thresholds=ANY_IS_BAD, decimals=0),
        "Open verdicts",
        "Verdicts naming this rank as a culprit now; the job dashboard's table has the details.",
        [Target(_or_zero(f"count({_sel(n.VERDICT, *RANK)})"), instant=True, needs=frozenset())],
        width=3,
    )
    b.panel(
        _table(),
        "Identity",
        "Where the rank runs: host, local rank, pid, torch version, GPU uuid, and the exporter that reports it.",
        [
            Target(
                f"max {_by(*IDENTITY_LABELS)} ({_sel(n.RANK_INFO, *RANK)})",
                instant=True,
            )
        ],
        width=15,
        height=4,
        table=True,
        hide=("Value",),
    )
    b.panel(
        _stat(mappings=ACTIVITY_MAPPING, no_value="not reported"),
        "Activity",
        "What the rank is doing now: in_collective (waiting in a torch.distributed call), busy (computing outside "
        "collectives), idle (sleeping, blocked in I/O, a queue or a lock), wedged (its Python stopped answering), "
        "gone (its process is dead), unknown (no stack: the rank keeps completing collectives, or sampling is "
        "off). A culprit that is busy gets its peers' "
        "patience up to the ceiling (--stuck-after) before FrexporterCollectiveDesync fires, as info.",
        [Target(_activity_code(*RANK), instant=True)],
        width=3,
        height=5,
    )
    b.panel(
        _stat(unit="s", thresholds=NEUTRAL),
        "In this activity for",
        "Since the rank entered its current activity in the same function: a rank idle or busy for minutes while "
        "its peers wait is where the job stands.",
        [Target(f"min({_age(_sel(n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS, *RANK))})", instant=True)],
        width=3,
        height=5,
    )
    b.panel(
        _state_timeline(ACTIVITY_MAPPING),
        "Activity over time",
        "The rank's activity over time: when it left its collectives, for what (busy computing, idle), and "
        "whether it wedged or died.",
        [Target(_activity_code(*RANK), legend="activity")],
        width=18,
        height=5,
    )

    b.row("Process groups of rank $rank")
    by_pg = (n.L_PG, n.L_PG_DESC)
    pg_of_rank = f"and on ({', '.join(PG_KEY)}) {_sel(n.PG_LAST_ENQUEUED_SEQ, *RANK)}"
    b.panel(
        _table(
            merge=True,
            links=(n.L_PG,),
            units={"oldest in flight": "s", "timeout": "s"},
            sort_by="behind by",
        ),
        "Process groups",
        "Each group this rank belongs to: its enqueued and completed sequence, the group's furthest enqueued "
        "sequence, how far this rank trails it, what it has in flight and since when. Click a group to compare "
        "with its other ranks.",
        [
            Target(f"max {_by(*by_pg)} ({_sel(n.PG_LAST_ENQUEUED_SEQ, *RANK)})", instant=True, column="enqueued"),
            Target(f"max {_by(*by_pg)} ({_sel(n.PG_LAST_COMPLETED_SEQ, *RANK)})", instant=True, column="completed"),
            Target(
                f"max {_by(*by_pg)} ({_sel(R_ENQUEUED_MAX, JOB)} {pg_of_rank})",
                instant=True,
                column="group max enqueued",
            ),
            Target(_pg_behind((JOB,), RANK, by=by_pg), instant=True, column="behind by"),
            Target(f"max {_by(*by_pg)} ({_sel(n.PG_INFLIGHT_COLLECTIVES, *RANK)})", instant=True, column="in flight"),
            Target(
                f"max {_by(*by_pg)} ({_age(_sel(n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS, *RANK))})",
                instant=True,
                column="oldest in flight",
            ),
            Target(f"max {_by(*by_pg)} ({_timeout(JOB)} {pg_of_rank})", instant=True, column="timeout"),
        ],
        width=24,
        height=7,
        table=True,
    )
    b.panel(
        _timeseries(decimals=0, min_val=None, stepped=True, links=[_series_link_pg()]),
        "Completed collectives per process group",
        "This rank's last completed sequence in each of its groups. A flat line in one group: that group is where "
        "the rank is stuck.",
        [Target(f"max {_by(*by_pg)} ({_sel(n.PG_LAST_COMPLETED_SEQ, *RANK)})", legend=_PG_LEGEND)],
        width=8,
        height=8,
    )
    b.panel(
        _timeseries(decimals=0, stepped=True, links=[_series_link_pg()]),
        "Behind the group's furthest rank",
        "Collectives this rank trails the furthest-ahead rank of each group by. Persistently above 0: this rank "
        "has not joined what its peers wait on.",
        [Target(_pg_behind((JOB,), RANK, by=by_pg), legend=_PG_LEGEND)],
        width=8,
        height=8,
    )
    b.panel(
        _timeseries(unit="s", links=[_series_link_pg()]),
        "Oldest in-flight age per process group",
        "How long this rank's oldest in-flight collective has waited, per group.",
        [
            Target(
                f"max {_by(*by_pg)} ({_age(_sel(n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS, *RANK))})",
                legend=_PG_LEGEND,
            )
        ],
        width=8,
        height=8,
    )
    b.panel(
        _timeseries(unit="s", thresholds=HEARTBEAT_STEPS),
        "Heartbeat age over time",
        "Seconds since the rank's last snapshot. A sawtooth up to the snapshot interval is healthy.",
        [Target(f"max({_age(_sel(n.RANK_HEARTBEAT_TIMESTAMP_SECONDS, *RANK))})", legend="heartbeat age")],
        width=8,
        height=7,
    )
    b.panel(
        _state_timeline(UP_MAPPING),
        "Up over time",
        "The rank's up state over time: when it died or stopped answering.",
        [Target(f"max({_sel(n.RANK_UP, *RANK)})", legend="up")],
        width=8,
        height=7,
    )
    b.panel(
        _timeseries(decimals=0),
        "Recorder errors",
        "Errors the in-rank recorder met per rate interval, by reason (it degrades instead of raising into "
        "training; persistent errors mean stale or missing data for this rank).",
        [
            Target(
                f"sum {_by(n.L_REASON)} ({_increase(_sel(n.RANK_RECORDER_ERRORS_TOTAL, *RANK))})", legend="{{reason}}"
            )
        ],
        width=8,
        height=7,
    )

    b.row("GPU of rank $rank")
    gpu_legend = "{{gpu_uuid}}"
    b.panel(
        _stat(mappings=LOST_MAPPING, thresholds=_thresholds((None, "green"), (1, "red")), no_value="no GPU"),
        "GPU lost",
        "NVML reports the GPU fallen off the bus: the rank cannot make progress; drain the node.",
        [Target(_on_gpus(n.GPU_LOST, *RANK), instant=True)],
        width=4,
        height=7,
    )
    b.panel(
        _timeseries(unit="percentunit", max_val=1),
        "GPU utilization",
        "Share of time a kernel ran. During a hang NCCL kernels spin at 100% on waiting ranks; 0% on a rank "
        "means it never launched the collective.",
        [Target(_on_gpus(n.GPU_UTILIZATION_RATIO, *RANK), legend=gpu_legend)],
        width=10,
        height=7,
    )
    b.panel(
        _timeseries(unit="bytes"),
        "GPU memory",
        "Device memory used and total.",
        [
            Target(_on_gpus(n.GPU_MEMORY_USED_BYTES, *RANK), legend="used"),
            Target(_on_gpus(n.GPU_MEMORY_TOTAL_BYTES, *RANK), legend="total"),
        ],
        width=10,
        height=7,
    )
    b.panel(
        _timeseries(unit="celsius"),
        "GPU temperature",
        "Core temperature. Thermal slowdown shows in the throttle panel.",
        [Target(_on_gpus(n.GPU_TEMPERATURE_CELSIUS, *RANK), legend=gpu_legend)],
        width=8,
        height=7,
    )
    b.panel(
        _timeseries(unit="watt"),
        "GPU power",
        "Board power draw.",
        [Target(_on_gpus(n.GPU_POWER_WATTS, *RANK), legend=gpu_legend)],
        width=8,
        height=7,
    )
    b.panel(
        _state_timeline(THROTTLE_MAPPING),
        "GPU throttle reasons",
        "Clocks held down by something other than the workload: power cap or brake, thermal or hardware "
        "slowdown. A throttled GPU makes its rank a straggler for every group it is in.",
        [Target(_on_gpus(n.GPU_THROTTLE_REASONS, *RANK, keep=(n.L_REASON,)), legend="{{reason}}")],
        width=8,
        height=7,
    )
    b.panel(
        _timeseries(decimals=0),
        "GPU ECC errors",
        "ECC errors per rate interval, corrected and uncorrected. Uncorrected errors crash or corrupt the job.",
        [Target(_on_gpus(_increase(n.GPU_ECC_ERRORS_TOTAL), *RANK, keep=(n.L_TYPE,)), legend="{{type}}")],
        width=8,
        height=7,
    )
    b.panel(
        _timeseries(decimals=0),
        "GPU Xid events",
        "Xid events per rate interval by code (e.g. 79: fallen off the bus, 48: double-bit ECC, 63/64: row "
        "remapping, 74: NVLink, 13/31/43: application faults).",
        [Target(_on_gpus(_increase(n.GPU_XID_ERRORS_TOTAL), *RANK, keep=(n.L_XID,)), legend="Xid {{xid}}")],
        width=8,
        height=7,
    )
    b.panel(
        _timeseries(decimals=0),
        "GPU NVLink errors",
        "NVLink data-link errors per rate interval, by type, summed over links. Rising replay or recovery "
        "counts slow NCCL collectives; CRC errors point at a bad link.",
        [Target(_on_gpus(_increase(n.GPU_NVLINK_ERRORS_TOTAL), *RANK, keep=(n.L_TYPE,)), legend="{{type}}")],
        width=8,
        height=7,
    )
    return b


_BOARDS = (_job_dashboard, _pg_dashboard, _rank_dashboard)


def _build() -> list[_Board]:
    return [make() for make in _BOARDS]


def build_dashboards() -> dict[str, dict[str, Any]]:
    """Dashboard JSON by uid."""
    return {board.uid: board.build() for board in _build()}


def panel_queries() -> list[PanelQuery]:
    """Every panel target of every dashboard, with its raw expression and data conditions."""
    return [query for board in _build() for query in board.queries]


def all_panel_queries(
    variables: Mapping[str, str] | None = None, *, available: Collection[str] | None = None
) -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, expr) for every panel target, variables substituted.

    ``variables`` overrides ``SAMPLE_VARIABLES`` (e.g. ``{"job_id": "job", "rank": "1"}``).
    ``available``: the ``Needs`` conditions a scenario meets; when given, only
    queries that should return data under them are listed. An end-to-end test
    runs these against Prometheus and asserts each returns at least one series.
    """
    allowed = None if available is None else frozenset(available)
    unknown = (allowed or frozenset()) - Needs.ALL
    if unknown:
        raise ValueError(f"unknown conditions {sorted(unknown)}; known: {sorted(Needs.ALL)}")
    return [
        (query.dashboard_uid, query.panel_title, substitute(query.expr, variables))
        for query in panel_queries()
        if allowed is None or query.needs <= allowed
    ]


# ---------------------------------------------------------------------------
# Files


def render(dashboard: Mapping[str, Any]) -> str:
    """The committed form: sorted keys, 2-space indent, trailing newline."""
    return json.dumps(dashboard, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def _rendered() -> dict[str, str]:
    return {DASHBOARD_FILES[uid]: render(dashboard) for uid, dashboard in build_dashboards().items()}


def write(out_dir: Path = OUT_DIR) -> list[Path]:
    """Write every dashboard; returns the files whose content changed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    changed = []
    for name, text in _rendered().items():
        path = out_dir / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            changed.append(path)
    return changed


def check(out_dir: Path = OUT_DIR, *, max_diff_lines: int = 60) -> list[str]:
    """Problems with the committed dashboards: missing, differing (with a diff) or stale files."""
    problems = []
    expected = _rendered()
    for name, text in expected.items():
        path = out_dir / name
        if not path.exists():
            problems.append(f"{path}: missing")
            continue
        committed = path.read_text(encoding="utf-8")
        if committed != text:
            diff = list(
                difflib.unified_diff(
                    committed.splitlines(), text.splitlines(), f"{name} (committed)", f"{name} (generated)", lineterm=""
                )
            )
            shown = diff[:max_diff_lines]
            if len(diff) > max_diff_lines:
                shown.append(f"... {len(diff) - max_diff_lines} more diff lines")
            problems.append(f"{path}: differs from the generator\n" + "\n".join(shown))
    for path in sorted(out_dir.glob("frexporter-*.json")):
        if path.name not in expected:
            problems.append(f"{path}: stale, no dashboard generates it")
    return problems


def panel_targets(dashboard: Mapping[str, Any]) -> Iterator[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    for panel in dashboard.get("panels", []):
        for nested in panel.get("panels", []):
            yield from ((nested, target) for target in nested.get("targets", []))
        for target in panel.get("targets", []):
            yield panel, target


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the committed JSON drifted")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="directory of the dashboard JSON (default: grafana/)")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.out)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print("dashboards are out of date: run `python grafana/generate.py` and commit the result", file=sys.stderr)
            return 1
        print(f"{len(DASHBOARD_FILES)} dashboards up to date")
        return 0
    changed = write(args.out)
    for path in changed:
        print(f"wrote {path}")
    if not changed:
        print(f"{len(DASHBOARD_FILES)} dashboards already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
