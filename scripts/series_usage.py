#!/usr/bin/env python3
"""Which of frexporter's per-rank series the shipped alerts need, which only the dashboards read, and which
nothing reads; the relabeling recipe that drops the rest (docs/scale.md, "Series: what alerting needs").

    python scripts/series_usage.py                    # the table, for a terminal
    python scripts/series_usage.py --markdown         # the generated parts of docs/scale.md
    python scripts/series_usage.py --relabel          # the recipe's regex: keep what the alerts need
    python scripts/series_usage.py --relabel unused   # the regex that drops only what nothing reads

Every consumer is read from what ships, never listed here by hand:

- alerts: the alerting rules of frexporter/rules/frexporter.rules.yml. An alert reads what its expression reads
  and what the queries of its annotations read (the notification's text), and through a recording rule what
  that rule reads, transitively;
- dashboards: the panels and variables of the generated grafana/*.json, through recording rules the same way;
- ``frexporter analyze --prometheus``: the queries it asks (frexporter.postmortem.promview.Query). Not part of
  the alerting path, but it reads Prometheus and loses what a recipe drops, so the table says which.

Series are those of the reference node the per-rank budget is counted on (tests/shared/series_budget.py),
named as Prometheus stores them (``__name__``: a counter's ``_total``, a histogram's ``_bucket``); a series is
per rank when it carries the ``rank`` label. Which names are per rank is read from that node's exposition in
a state where every per-rank series is written, with and without each opt-in flag of ``frexporter serve``.

Dev tooling: the dashboards' PromQL scan comes from grafana/generator (grafana-foundation-sdk, the test extra).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # from a checkout: this tree's rules, dashboards and exporter, never an installed copy
    sys.path.insert(0, str(REPO))

from frexporter import naming as n  # noqa: E402
from frexporter.postmortem.promview import Query  # noqa: E402
from grafana.generator.constants import DASHBOARD_FILES, OUT_DIR  # noqa: E402
from grafana.generator.queries import metric_names, panel_targets, variable_selectors  # noqa: E402
from tests.rulefile import load_rules  # noqa: E402
from tests.shared.series_budget import (  # noqa: E402
    OPT_IN_FLAGS,
    every_series_node,
    exposition,
    rank_series,
    reference_node,
)

ALERTS = "alerts"
DASHBOARDS = "dashboards"
NEITHER = "neither"

# Recipes: which per-rank series a recipe drops, by who needs them. "alerting" keeps only what the alerts
# need (the drill-down panels lose the rest); "unused" drops only what neither reads (nothing shipped loses
# anything). Series of an opt-in flag are never in a recipe: whoever turns the flag on wants them.
RECIPE_ALERTING = "alerting"
RECIPE_UNUSED = "unused"
RECIPES: dict[str, frozenset[str]] = {
    RECIPE_ALERTING: frozenset({DASHBOARDS, NEITHER}),
    RECIPE_UNUSED: frozenset({NEITHER}),
}
# What the recipe matches: the series name and its rank, joined by relabeling's default separator. A series
# without a rank (or with an empty one) never matches, so a name that is also exported per node keeps those.
RELABEL_SOURCE_LABELS = ("__name__", n.L_RANK)
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_DASHBOARD_PREFIX = "frexporter / "
# The PromQL of an annotation: the backquoted argument of a `query` template (`printf `...` ... | query`).
_TEMPLATE_QUERY = re.compile(r"`([^`]*)`")
# A PromQL comment (# to the end of the line) outside a string: the rule file's "# @scale" markers would read as
# a metric named "scale".
_STRING_OR_COMMENT = re.compile(r'("(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`)|#[^\n]*')


def _strip_comments(expr: str) -> str:
    return _STRING_OR_COMMENT.sub(lambda m: m.group(1) or "", expr)


def _names(expr: str) -> frozenset[str]:
    return frozenset(metric_names(_strip_comments(expr)))


# ------------------------------------------------------------------------------------------------ consumers


@dataclass(frozen=True, order=True)
class Panel:
    """A dashboard panel, or one of its variables (title ``$name``)."""

    dashboard: str  # its title without "frexporter / "
    title: str

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.title}"


@dataclass(frozen=True)
class Target:
    """One query of a panel: what it reads (recording rules resolved to the series they read)."""

    ref_id: str
    column: str  # the table column it fills, where the panel renames one; "" elsewhere
    reads: frozenset[str]


@dataclass(frozen=True)
class Usage:
    """What each consumer reads, recording rules resolved (transitively) to the series they read."""

    alert_exprs: Mapping[str, frozenset[str]]  # alert -> what its expression reads
    alert_texts: Mapping[str, frozenset[str]]  # alert -> what its annotations' queries read
    panels: Mapping[Panel, tuple[Target, ...]]
    analyze: frozenset[str]  # what `frexporter analyze --prometheus` reads
    rules: Mapping[str, str]  # recording rule -> ALERTS, DASHBOARDS or NEITHER (who reads it)

    def alerts_reading(self, metric: str) -> tuple[str, ...]:
        return tuple(sorted(a for a, reads in self.alert_exprs.items() if metric in reads))

    def alert_texts_reading(self, metric: str) -> tuple[str, ...]:
        return tuple(sorted(a for a, reads in self.alert_texts.items() if metric in reads))

    def panels_reading(self, metric: str) -> tuple[Panel, ...]:
        return tuple(sorted(p for p, targets in self.panels.items() if any(metric in t.reads for t in targets)))

    def alert_needs(self) -> frozenset[str]:
        return frozenset().union(*self.alert_exprs.values(), *self.alert_texts.values())


def _closure(names: Iterable[str], recorded: Mapping[str, frozenset[str]]) -> tuple[frozenset[str], frozenset[str]]:
    """(series, recording rules) that reading ``names`` reads: each recording rule replaced by what it reads."""
    series: set[str] = set()
    rules: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in recorded:
            if name not in rules:
                rules.add(name)
                todo.extend(recorded[name])
        else:
            series.add(name)
    return frozenset(series), frozenset(rules)


def _annotation_queries(rule: Mapping[str, Any]) -> Iterator[str]:
    """The PromQL an alert's annotations (and templated labels) query when it notifies."""
    for templates in (rule.get("annotations", {}), rule.get("labels", {})):
        for value in templates.values():
            yield from _TEMPLATE_QUERY.findall(str(value))


def load_dashboards(directory: Path = OUT_DIR) -> dict[str, dict[str, Any]]:
    """The committed dashboards' JSON, by uid."""
    return {uid: json.loads((directory / name).read_text(encoding="utf-8")) for uid, name in DASHBOARD_FILES.items()}


def _columns(panel: Mapping[str, Any]) -> dict[str, str]:
    """refId -> the column title a table panel gives its value (Grafana's organize transformation)."""
    columns: dict[str, str] = {}
    for transformation in panel.get("transformations", []):
        if transformation.get("id") == "organize":
            for field, title in transformation.get("options", {}).get("renameByName", {}).items():
                if field.startswith("Value #"):
                    columns[field.removeprefix("Value #")] = title
    return columns


def usage(rules: Mapping[str, Any] | None = None, dashboards: Mapping[str, Mapping[str, Any]] | None = None) -> Usage:
    """What the shipped rules and dashboards (or the ones given) read."""
    rules = load_rules() if rules is None else rules
    dashboards = load_dashboards() if dashboards is None else dashboards
    all_rules = [rule for group in rules["groups"] for rule in group["rules"]]
    recorded = {rule["record"]: _names(rule["expr"]) for rule in all_rules if "record" in rule}

    alert_exprs: dict[str, frozenset[str]] = {}
    alert_texts: dict[str, frozenset[str]] = {}
    alert_rules: set[str] = set()
    for rule in (r for r in all_rules if "alert" in r):
        series, via = _closure(_names(rule["expr"]), recorded)
        text_series, text_via = _closure(
            frozenset().union(*(_names(q) for q in _annotation_queries(rule))), recorded)
        alert_exprs[rule["alert"]] = series
        alert_texts[rule["alert"]] = text_series
        alert_rules |= via | text_via

    panels: dict[Panel, tuple[Target, ...]] = {}
    dashboard_rules: set[str] = set()
    for dashboard in dashboards.values():
        title = str(dashboard["title"]).removeprefix(_DASHBOARD_PREFIX)
        by_panel: dict[Panel, list[Target]] = {}
        for panel, target in panel_targets(dashboard):
            series, via = _closure(_names(str(target["expr"])), recorded)
            dashboard_rules |= via
            ref_id = str(target["refId"])
            by_panel.setdefault(Panel(title, str(panel["title"])), []).append(
                Target(ref_id, _columns(panel).get(ref_id, ""), series))
        for name, selector in variable_selectors(dashboard):
            series, via = _closure(_names(selector), recorded)
            dashboard_rules |= via
            by_panel[Panel(title, "$" + name)] = [Target("", "", series)]
        panels.update((p, tuple(t)) for p, t in by_panel.items())

    who = {rule: ALERTS if rule in alert_rules else DASHBOARDS if rule in dashboard_rules else NEITHER
           for rule in recorded}
    return Usage(alert_exprs, alert_texts, panels, frozenset(q.metric for q in Query), who)


# ------------------------------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Row:
    """One per-rank series name."""

    metric: str
    per_rank: float  # series per rank at the reference node (steady state, default flags)
    opt_in: str  # the `frexporter serve` flag that writes it; "" at the defaults
    alerts: tuple[str, ...]  # alerts whose expression reads it
    alert_texts: tuple[str, ...]  # alerts whose notification text queries it (and whose expression does not)
    panels: tuple[Panel, ...]
    analyze: bool  # `frexporter analyze --prometheus` reads it

    @property
    def needed_by(self) -> str:
        return ALERTS if self.alerts or self.alert_texts else DASHBOARDS if self.panels else NEITHER


def per_rank_metrics() -> dict[str, str]:
    """Every series name the exporter writes with a ``rank`` label -> the opt-in flag it needs ("": none)."""
    names = dict.fromkeys(rank_series(exposition(every_series_node())), "")
    for flag in OPT_IN_FLAGS:
        for name in rank_series(exposition(every_series_node((flag,)))):
            names.setdefault(name, flag)
    return names


def reference_counts() -> tuple[int, dict[str, float]]:
    """(ranks, series per rank by name) at the reference node."""
    snap = reference_node()
    return len(snap.ranks), {name: count / len(snap.ranks) for name, count in rank_series(exposition(snap)).items()}


def table(used: Usage | None = None) -> list[Row]:
    used = usage() if used is None else used
    _, counts = reference_counts()
    rows = []
    for metric, flag in per_rank_metrics().items():
        alerts = used.alerts_reading(metric)
        texts = tuple(a for a in used.alert_texts_reading(metric) if a not in alerts)
        rows.append(Row(metric, counts.get(metric, 0.0), flag, alerts, texts, used.panels_reading(metric),
                        metric in used.analyze))
    order = {ALERTS: 0, DASHBOARDS: 1, NEITHER: 2}
    return sorted(rows, key=lambda r: (order[r.needed_by], bool(r.opt_in), -r.per_rank, r.metric))


def recipe_names(rows: Iterable[Row], recipe: str = RECIPE_ALERTING) -> list[str]:
    """The per-rank series names a recipe drops."""
    drop = RECIPES[recipe]
    return sorted(r.metric for r in rows if r.needed_by in drop and not r.opt_in)


def relabel_regex(names: Sequence[str]) -> str:
    """The regex over RELABEL_SOURCE_LABELS that matches the per-rank series of ``names``."""
    if not names:
        raise ValueError("a recipe that drops nothing has no regex")
    for name in names:
        if not _METRIC_NAME.fullmatch(name):  # a name is used verbatim: no character may mean more
            raise ValueError(f"not a metric name: {name!r}")
    return f"({'|'.join(sorted(names))});.+"


def saved_per_rank(rows: Iterable[Row], recipe: str = RECIPE_ALERTING) -> float:
    """Series per rank a recipe drops at the reference node."""
    drop = set(recipe_names(rows, recipe))
    return sum(r.per_rank for r in rows if r.metric in drop)


@dataclass(frozen=True)
class Loss:
    """A panel a recipe empties, or the queries it loses."""

    panel: Panel
    lost: tuple[Target, ...]
    of: int  # the panel's queries

    @property
    def empty(self) -> bool:
        return len(self.lost) == self.of


def losses(used: Usage, dropped: Iterable[str]) -> list[Loss]:
    """The panels that lose a query to the dropped series: a query reading one returns nothing (or less)."""
    gone = frozenset(dropped)
    result = []
    for panel, targets in sorted(used.panels.items()):
        lost = tuple(t for t in targets if t.reads & gone)
        if lost:
            result.append(Loss(panel, lost, len(targets)))
    return result


# ------------------------------------------------------------------------------------------------- rendering


def _num(value: float) -> str:
    return f"{value:g}"


def _dashboards_cell(panels: Sequence[Panel]) -> str:
    counts: dict[str, int] = {}
    for panel in panels:
        counts[panel.dashboard] = counts.get(panel.dashboard, 0) + 1
    return ", ".join(f"{d} ({c})" for d, c in counts.items())


def _written(row: Row) -> str:
    if row.opt_in:
        return f"with `{row.opt_in}`"
    # Conditional: in a hang (in flight, verdicts), on a setting (NCCL timing) or an error; docs/scale.md says which.
    return "steady state" if row.per_rank else "conditional"


def markdown_table(rows: Sequence[Row]) -> str:
    lines = [
        "| Series | Per rank | Written | Alerts | Dashboards (panels) | `analyze --prometheus` | Needed by |",
        "|---|--:|---|---|---|:-:|---|",
    ]
    for r in rows:
        alerts = [*r.alerts, *(f"{a} (text)" for a in r.alert_texts)]
        lines.append(f"| `{r.metric}` | {_num(r.per_rank)} | {_written(r)} | {', '.join(alerts)} "
                     f"| {_dashboards_cell(r.panels)} | {'yes' if r.analyze else ''} "
                     f"| {'**alerts**' if r.needed_by == ALERTS else r.needed_by} |")
    return "\n".join(lines)


def markdown_summary(rows: Sequence[Row]) -> str:
    total = sum(r.per_rank for r in rows)
    by_need = {need: sum(r.per_rank for r in rows if r.needed_by == need) for need in (ALERTS, DASHBOARDS, NEITHER)}
    recipes = " ".join(
        f"The {recipe} recipe saves {_num(saved)} of {_num(total)} series per rank ({_num(total - saved)} left)."
        for recipe, saved in ((r, saved_per_rank(rows, r)) for r in RECIPES))
    return (f"At the reference node: {_num(total)} series per rank; the alerts need {_num(by_need[ALERTS])}, "
            f"only the dashboards read {_num(by_need[DASHBOARDS])}, nothing reads {_num(by_need[NEITHER])}. "
            + recipes)


def markdown_rules(used: Usage) -> str:
    lines = ["| Recording rule | Read by |", "|---|---|"]
    order = {ALERTS: 0, DASHBOARDS: 1, NEITHER: 2}
    for rule, who in sorted(used.rules.items(), key=lambda kv: (order[kv[1]], kv[0])):
        lines.append(f"| `{rule}` | {'**alerts**' if who == ALERTS else who} |")
    return "\n".join(lines)


def markdown_losses(used: Usage, rows: Sequence[Row], recipe: str = RECIPE_ALERTING) -> str:
    lines = []
    for loss in losses(used, recipe_names(rows, recipe)):
        if loss.empty:
            what = "empty"
        else:
            parts = [f'column "{t.column}"' if t.column else f"query {t.ref_id}" for t in loss.lost]
            what = f"loses {', '.join(parts)} ({len(loss.lost)} of {loss.of} queries)"
        reads = sorted(set().union(*(t.reads for t in loss.lost)) & set(recipe_names(rows, recipe)))
        lines.append(f"- {loss.panel}: {what} (`{'`, `'.join(reads)}`)")
    return "\n".join(lines)


def markdown(used: Usage | None = None) -> list[str]:
    """The generated parts of docs/scale.md, in the order the document has them."""
    used = usage() if used is None else used
    rows = table(used)
    return [markdown_table(rows), markdown_summary(rows), markdown_rules(used), markdown_losses(used, rows)]


def _text_table(rows: Sequence[Row]) -> str:
    header = ("metric", "per rank", "written", "alerts", "dashboards", "analyze", "needed by")
    body = [(r.metric, _num(r.per_rank), _written(r).replace("`", ""),
             ", ".join([*r.alerts, *(f"{a} (text)" for a in r.alert_texts)]) or "-",
             _dashboards_cell(r.panels) or "-", "yes" if r.analyze else "-", r.needed_by) for r in rows]
    widths = [max(len(line[i]) for line in (header, *body)) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
                     for line in (header, *body))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Which per-rank series the shipped alerts and dashboards read "
                                                 "(docs/scale.md).")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--markdown", action="store_true", help="print the generated parts of docs/scale.md")
    mode.add_argument("--relabel", nargs="?", const=RECIPE_ALERTING, choices=sorted(RECIPES),
                      help=f"print a recipe's regex over {', '.join(RELABEL_SOURCE_LABELS)} "
                           f"(default: {RECIPE_ALERTING})")
    args = parser.parse_args(argv)
    if args.relabel:
        print(relabel_regex(recipe_names(table(), args.relabel)))
        return 0
    used = usage()
    if args.markdown:
        print("\n\n".join(markdown(used)))
        return 0
    rows = table(used)
    print(_text_table(rows))
    print()
    print(markdown_summary(rows))
    for recipe in sorted(RECIPES):
        print(f"{recipe} recipe: {relabel_regex(recipe_names(rows, recipe))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
