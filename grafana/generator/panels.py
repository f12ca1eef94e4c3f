"""Panel builders over grafana-foundation-sdk: the timeseries, stat, table and state-timeline shapes the
dashboards share, their thresholds and value mappings, and drill-down links between the dashboards."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from grafana_foundation_sdk.builders import common as bcommon
from grafana_foundation_sdk.builders import dashboard as bdash
from grafana_foundation_sdk.builders import stat as bstat
from grafana_foundation_sdk.builders import statetimeline as bstate
from grafana_foundation_sdk.builders import table as btable
from grafana_foundation_sdk.builders import timeseries as bts
from grafana_foundation_sdk.models import common as mcommon
from grafana_foundation_sdk.models import dashboard as mdash

from frexporter import naming as n

from .constants import RUNBOOK_PATH, UID_PG, UID_RANK, V_DATASOURCE, V_JOB, V_RUNBOOK_BASE
from .promql import ACTIVITY_STYLE

if TYPE_CHECKING:
    from typing import Self

# Legends of per-group and per-rank series, shared by the dashboards.
PG_LEGEND = "{{pg_desc}} (pg {{pg}})"
RANK_LEGEND = "rank {{rank}}"


class SdkPanel(Protocol):
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


def threshold_steps(*steps: tuple[float | None, str]) -> bdash.ThresholdsConfig:
    return (
        bdash.ThresholdsConfig()
        .mode(mdash.ThresholdsMode.ABSOLUTE)
        .steps([mdash.Threshold(value=value, color=color) for value, color in steps])
    )


GREEN_ONLY = threshold_steps((None, "green"))
# Fractions of the watchdog timeout: FrexporterWatchdogBudget fires by 0.5.
BUDGET_STEPS = threshold_steps((None, "green"), (0.25, "orange"), (0.5, "red"))
# Seconds: the heartbeat is written every second; FrexporterRankUnresponsive fires after 60 s.
HEARTBEAT_STEPS = threshold_steps((None, "green"), (10, "orange"), (60, "red"))
ANY_IS_BAD = threshold_steps((None, "green"), (1, "red"))


def value_mapping(values: Mapping[str, tuple[str, str]]) -> list[mdash.ValueMapping]:
    """Value mappings from ``{value: (text, color)}``."""
    options = {value: mdash.ValueMappingResult(text=text, color=color) for value, (text, color) in values.items()}
    return [mdash.ValueMap(options=options)]


UP_MAPPING = value_mapping({"0": ("DOWN", "red"), "1": ("UP", "green")})
ACTIVITY_MAPPING = value_mapping({str(code): (state, color) for state, (code, color) in ACTIVITY_STYLE.items()})
ACTIVITY_LABEL_MAPPING = value_mapping({state: (state, color) for state, (_, color) in ACTIVITY_STYLE.items()})
# A neutral colour for durations that are neither good nor bad by themselves.
NEUTRAL = threshold_steps((None, "text"))
LOST_MAPPING = value_mapping({"0": ("OK", "green"), "1": ("LOST", "red")})
THROTTLE_MAPPING = value_mapping({"0": ("ok", "green"), "1": ("throttled", "orange")})


def dashboard_url(uid: str, *params: str) -> str:
    """A link into another frexporter dashboard that keeps the datasource, job and time range."""
    query = "&".join(["${" + V_DATASOURCE + ":queryparam}", "${" + V_JOB + ":queryparam}", *params])
    return f"/d/{uid}?{query}&${{__url_time_range}}"


def _link(title: str, url: str) -> bdash.DashboardLink:
    return bdash.DashboardLink(title).url(url)


def series_link_pg() -> bdash.DashboardLink:
    url = dashboard_url(UID_PG, "var-pg=${__field.labels.pg}")
    return _link("Process group ${__field.labels.pg_desc} (${__field.labels.pg})", url)


def series_link_rank() -> bdash.DashboardLink:
    return _link("Rank ${__field.labels.rank}", dashboard_url(UID_RANK, "var-rank=${__field.labels.rank}"))


def _cell_links(column: str) -> list[mdash.DynamicConfigValue]:
    """Table-cell data links for a ``pg``, ``rank`` or ``alertname`` column."""
    cell = "${__data.fields." + column + "}"
    if column == n.L_PG:
        link = {"title": f"Process group {cell}", "url": dashboard_url(UID_PG, f"var-pg={cell}")}
    elif column == n.L_RANK:
        link = {"title": f"Rank {cell}", "url": dashboard_url(UID_RANK, f"var-rank={cell}")}
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


def timeseries(
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


def dashed(panel: bts.Panel, colors: Mapping[str, str]) -> bts.Panel:
    """Draw the series of these legends as dashed reference lines in a fixed colour (thresholds, limits)."""
    for legend, color in colors.items():
        panel = panel.override_by_name(legend, [
            mdash.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}),
            mdash.DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": color}),
            # The panel's drill-down links name a series' rank or group; a reference line has neither.
            mdash.DynamicConfigValue(id_val="links", value=[]),
        ])
    return panel


def stat(
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


def table(
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

    Columns are named (and hidden) by ``Board.panel``, which knows the queries. ``mappings`` show a
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


def state_timeline(mappings: list[mdash.ValueMapping]) -> bstate.Panel:
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
