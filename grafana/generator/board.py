"""``Board``: a dashboard under construction, which numbers its panels and registers every query; and the
dashboard variables (job, process group, rank, runbook base URL)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from grafana_foundation_sdk.builders import dashboard as bdash
from grafana_foundation_sdk.builders import prometheus as bprom
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as mdash
from grafana_foundation_sdk.models import prometheus as mprom

from frexporter import naming as n

from .constants import DATASOURCE, TAGS, V_DATASOURCE, V_JOB, V_PG, V_RANK, V_RUNBOOK_BASE
from .panels import SdkPanel
from .promql import JOB, sel
from .queries import PanelQuery, Target, derived_needs


class Board:
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
        panel: SdkPanel,
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
            needs = derived_needs(target.expr) if target.needs is None else target.needs
            self.queries.append(PanelQuery(self.uid, title, ref_id, target.expr, target.instant, needs))
        panel = panel.title(title).description(description).id(self._id()).datasource(DATASOURCE)
        panel = panel.targets(built_targets).span(width)
        if height is not None:
            panel = panel.height(height)
        if table:
            organize = {"excludeByName": dict.fromkeys(["Time", "__name__", *hide], True), "renameByName": renames}
            panel = panel.with_transformation(mdash.DataTransformerConfig(id_val="organize", options=organize))
        self.builder = self.builder.with_panel(panel)

    def value(
        self,
        panel: SdkPanel,
        title: str,
        description: str,
        expr: str,
        *,
        width: int,
        height: int | None = None,
        needs: frozenset[str] | None = None,
    ) -> None:
        """Add a panel of one instant query: the shape of every stat that shows a current value."""
        self.panel(panel, title, description, [Target(expr, instant=True, needs=needs)], width=width, height=height)

    def series(
        self, panel: SdkPanel, title: str, description: str, expr: str, *, legend: str, width: int, height: int
    ) -> None:
        """Add a panel of one range query, a line per series named by ``legend``."""
        self.panel(panel, title, description, [Target(expr, legend=legend)], width=width, height=height)

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


def job_variable() -> bdash.QueryVariable:
    return _query_variable(V_JOB, "Job", n.RANK_INFO, mdash.VariableSort.ALPHABETICAL_ASC)


def runbook_base_variable() -> bdash.TextBoxVariable:
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


def pg_variable() -> bdash.QueryVariable:
    return _query_variable(V_PG, "Process group", sel(n.PG_INFO, JOB), mdash.VariableSort.NATURAL_ASC)


def rank_variable() -> bdash.QueryVariable:
    return _query_variable(V_RANK, "Rank", sel(n.RANK_INFO, JOB), mdash.VariableSort.NATURAL_ASC)
