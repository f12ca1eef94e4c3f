"""The query registry: what a panel target is, which data conditions it needs, and how tests read queries back.

Queries are registered as panels are built, each with the conditions under which it returns data (``Needs``),
derived from the metric names it reads unless a target says otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from frexporter import naming as n

from .constants import SAMPLE_VARIABLES
from .promql import (
    ALERTS,
    R_ARRIVAL_LAG,
    R_ARRIVAL_LOSS,
    R_ARRIVAL_MEDIAN,
    R_BUDGET_USED,
    R_OLDEST_WAIT_AGE,
    R_PG_RANKS_WAITING,
    R_WAIT_LAG,
    R_WAIT_LOSS,
    R_WAIT_MEDIAN,
    UP,
)


class Needs:
    """Conditions under which a query returns data, beyond a running job being scraped.

    A test that runs every query against a real Prometheus passes the
    conditions its scenario meets and asserts data only for those queries.
    """

    RULES = "recording_rules"  # frexporter.rules.yml is loaded into Prometheus
    INFLIGHT = "inflight"  # some rank has a collective in flight (e.g. a hang)
    WAIT = "wait"  # some rank has had one in flight for half its PG's stuck threshold (a hang)
    VERDICT = "verdict"  # the exporter has an open verdict
    ALERT = "alert"  # a Frexporter* alert is pending or firing
    GPU = "gpu"  # NVML is on and the ranks report a GPU uuid
    XID = "xid"  # a GPU raised an Xid since the exporter started
    NCCL_TIMING = "nccl_timing"  # NCCL with TORCH_NCCL_ENABLE_TIMING=1 (started seq)
    COLLECTIVE_METRICS = "collective_metrics"  # duration histogram and byte counters are exported
    RECORDER_ERRORS = "recorder_errors"  # a rank's recorder met an error
    SCRAPE_JOB = "frexporter_scrape_job"  # the Prometheus scrape job name contains "frexporter"
    # serve --collective-waits on a PG of 3+ ranks: waits on NCCL, arrivals on gloo
    COLLECTIVE_WAITS = "collective_waits"

    ALL = frozenset(
        {RULES, INFLIGHT, WAIT, VERDICT, ALERT, GPU, XID, NCCL_TIMING, COLLECTIVE_METRICS, RECORDER_ERRORS, SCRAPE_JOB,
         COLLECTIVE_WAITS}
    )


# Condition each series needs to exist (see Needs). Unlisted series exist
# whenever a job is being scraped.
_NEEDS_BY_METRIC: dict[str, frozenset[str]] = {
    n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS: frozenset({Needs.INFLIGHT}),
    R_PG_RANKS_WAITING: frozenset({Needs.RULES, Needs.WAIT}),
    R_OLDEST_WAIT_AGE: frozenset({Needs.RULES, Needs.WAIT}),
    R_BUDGET_USED: frozenset({Needs.RULES, Needs.WAIT}),
    n.VERDICT: frozenset({Needs.VERDICT}),
    ALERTS: frozenset({Needs.ALERT}),
    UP: frozenset({Needs.SCRAPE_JOB}),
    n.PG_LAST_STARTED_SEQ: frozenset({Needs.NCCL_TIMING}),
    n.COLLECTIVE_DURATION_SECONDS + "_bucket": frozenset({Needs.COLLECTIVE_METRICS}),
    n.COLLECTIVE_BYTES_TOTAL: frozenset({Needs.COLLECTIVE_METRICS}),
    n.RANK_RECORDER_ERRORS_TOTAL: frozenset({Needs.RECORDER_ERRORS}),
    n.GPU_XID_ERRORS_TOTAL: frozenset({Needs.GPU, Needs.XID}),
    n.RANK_COLLECTIVE_WAIT_SECONDS: frozenset({Needs.COLLECTIVE_WAITS}),
    R_WAIT_MEDIAN: frozenset({Needs.RULES, Needs.COLLECTIVE_WAITS}),
    R_WAIT_LAG: frozenset({Needs.RULES, Needs.COLLECTIVE_WAITS}),
    R_WAIT_LOSS: frozenset({Needs.RULES, Needs.COLLECTIVE_WAITS}),
    n.RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS: frozenset({Needs.COLLECTIVE_WAITS}),
    R_ARRIVAL_MEDIAN: frozenset({Needs.RULES, Needs.COLLECTIVE_WAITS}),
    R_ARRIVAL_LAG: frozenset({Needs.RULES, Needs.COLLECTIVE_WAITS}),
    R_ARRIVAL_LOSS: frozenset({Needs.RULES, Needs.COLLECTIVE_WAITS}),
}


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


def derived_needs(expr: str) -> frozenset[str]:
    """The ``Needs`` of a query, from the series it reads: recording rules, GPU metrics, ``_NEEDS_BY_METRIC``."""
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


def panel_targets(dashboard: Mapping[str, Any]) -> Iterator[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """(panel, target) for every query target of a dashboard JSON, those of panels nested in rows included."""
    for panel in dashboard.get("panels", []):
        for nested in panel.get("panels", []):
            yield from ((nested, target) for target in nested.get("targets", []))
        for target in panel.get("targets", []):
            yield panel, target
