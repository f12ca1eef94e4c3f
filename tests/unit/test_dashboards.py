"""The Grafana dashboards in grafana/: committed JSON equals what grafana/generate.py
(the grafana/generator package) builds, the JSON loads into the Grafana 11.6 schema
(grafana-foundation-sdk), every query is PromQL that promtool parses, and every series
a query reads is one that frexporter exports, one of its recording rules, or Prometheus' own.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_dashboards.py."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from frexporter import naming
from frexporter.model import ACTIVITY_STATES
from tests.harness import REPO, require_module
from tests.rulefile import load_rules
from tests.shared.dashboards import all_exprs

# The SDK is dev tooling, pinned in the test extra.
require_module("grafana_foundation_sdk", "grafana-foundation-sdk (the test extra)")

from grafana_foundation_sdk.cog.encoder import JSONEncoder  # noqa: E402
from grafana_foundation_sdk.cog.plugins import register_default_plugins  # noqa: E402
from grafana_foundation_sdk.models import dashboard as mdash  # noqa: E402
from grafana_foundation_sdk.models import prometheus as mprom  # noqa: E402

from grafana import generate  # noqa: E402 (after the check: it imports the SDK)
from grafana.generator import panels, promql  # noqa: E402

GRAFANA = REPO / "grafana"
SCHEMA_VERSION = mdash.Dashboard().schema_version  # what the pinned SDK (Grafana 11.6) emits


def _load(uid: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((GRAFANA / generate.DASHBOARD_FILES[uid]).read_text(encoding="utf-8"))
    return data


def _committed() -> Iterator[tuple[str, dict[str, Any]]]:
    for uid in generate.DASHBOARD_FILES:
        yield uid, _load(uid)


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _strings(value: object) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


# --- drift ---------------------------------------------------------------------


def test_committed_json_is_what_the_generator_writes() -> None:
    problems = generate.check()
    assert not problems, "\n".join(problems) + "\nrun: python grafana/generate.py"


def test_generation_is_deterministic() -> None:
    first = {uid: generate.render(d) for uid, d in generate.build_dashboards().items()}
    second = {uid: generate.render(d) for uid, d in generate.build_dashboards().items()}
    assert first == second
    for text in first.values():
        assert text.endswith("}\n") and not text.endswith("\n\n")
        assert json.dumps(json.loads(text), sort_keys=True, indent=2, ensure_ascii=False) + "\n" == text


def test_check_reports_drift_missing_and_stale_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert generate.main(["--out", str(tmp_path)]) == 0
    assert generate.main(["--check", "--out", str(tmp_path)]) == 0

    job = tmp_path / generate.DASHBOARD_FILES[generate.UID_JOB]
    job.write_text(job.read_text(encoding="utf-8").replace('"frexporter / Job"', '"edited by hand"'), encoding="utf-8")
    (tmp_path / generate.DASHBOARD_FILES[generate.UID_RANK]).unlink()
    (tmp_path / "frexporter-old.json").write_text("{}\n", encoding="utf-8")
    capsys.readouterr()

    assert generate.main(["--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{job}: differs from the generator" in err
    assert '-  "title": "edited by hand",' in err and '+  "title": "frexporter / Job",' in err
    assert "frexporter-rank.json: missing" in err
    assert "frexporter-old.json: stale" in err
    assert "run `python grafana/generate.py`" in err

    # Regenerating repairs the generated files and leaves foreign ones alone.
    assert generate.main(["--out", str(tmp_path)]) == 0
    (tmp_path / "frexporter-old.json").unlink()
    assert generate.main(["--check", "--out", str(tmp_path)]) == 0


# --- Grafana schema ------------------------------------------------------------


@pytest.mark.parametrize("uid", list(generate.DASHBOARD_FILES))
def test_json_round_trips_through_the_grafana_11_6_schema(uid: str) -> None:
    register_default_plugins()
    data = _load(uid)
    model = mdash.Dashboard.from_json(data)
    assert json.loads(json.dumps(model, cls=JSONEncoder)) == data
    panels = [p for p in model.panels or [] if isinstance(p, mdash.Panel)]
    assert panels
    for panel in panels:
        assert panel.targets, panel.title
        # Registered plugins decode targets into typed Prometheus queries, not opaque dicts.
        assert all(isinstance(target, mprom.Dataquery) for target in panel.targets), panel.title


@pytest.mark.parametrize("uid", list(generate.DASHBOARD_FILES))
def test_dashboard_identity(uid: str) -> None:
    dashboard = _load(uid)
    assert dashboard["uid"] == uid
    assert dashboard["title"].startswith("frexporter / ")
    assert dashboard["tags"] == ["frexporter"]
    assert dashboard["schemaVersion"] == SCHEMA_VERSION == 41
    assert "id" not in dashboard  # an id would make imports overwrite an unrelated dashboard
    assert dashboard["description"]
    titles = [d["title"] for _, d in _committed()]
    assert len(set(titles)) == len(titles)


@pytest.mark.parametrize(
    ("uid", "names"),
    [
        ("frexporter-job", ["datasource", "job_id", "runbook_base"]),
        ("frexporter-pg", ["datasource", "job_id", "pg"]),
        ("frexporter-rank", ["datasource", "job_id", "rank"]),
    ],
)
def test_variables(uid: str, names: list[str]) -> None:
    variables = _load(uid)["templating"]["list"]
    assert [v["name"] for v in variables] == names
    datasource, *queries = [v for v in variables if v["name"] != generate.V_RUNBOOK_BASE]
    assert datasource["type"] == "datasource" and datasource["query"] == "prometheus"
    for variable in queries:
        assert variable["type"] == "query"
        assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert re.fullmatch(rf"label_values\(frexporter_\w+(\{{.*\}})?, {variable['name']}\)", variable["query"])
        assert variable["refresh"] == 2  # on time range change: jobs come and go


@pytest.mark.parametrize("uid", list(generate.DASHBOARD_FILES))
def test_panels_use_the_datasource_variable_and_do_not_overlap(uid: str) -> None:
    dashboard = _load(uid)
    ids = [panel["id"] for panel in _panels(dashboard)]
    assert len(set(ids)) == len(ids) and 0 not in ids
    # (dashboard uid, panel title) names a panel in all_panel_queries() and in promtool's errors.
    titles = [panel["title"] for panel in _panels(dashboard)]
    assert len(set(titles)) == len(titles), sorted(t for t in titles if titles.count(t) > 1)
    cells: dict[tuple[int, int], str] = {}
    for panel in _panels(dashboard):
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["title"] and panel["description"], panel
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert target["expr"].strip()
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), panel["title"]


_GROUPING = re.compile(r"^(?:clamp_min\()?(?:max|count) by \(([^()]*)\)")


@pytest.mark.parametrize("uid", list(generate.DASHBOARD_FILES))
def test_merged_tables_reduce_every_query_to_the_same_labels(uid: str) -> None:
    # Grafana's merge joins rows on equal label columns; a stray __name__ or
    # job_id column in one query would split each process group over several rows.
    for panel in _panels(_load(uid)):
        if not any(t["id"] == "merge" for t in panel.get("transformations", [])):
            continue
        groupings = set()
        for target in panel["targets"]:
            match = _GROUPING.match(target["expr"])
            assert match, f"{panel['title']} {target['refId']}: not a max or count by (...): {target['expr']}"
            assert target["format"] == "table" and target["instant"], panel["title"]
            groupings.add(match[1])
        assert len(groupings) == 1, f"{panel['title']}: {groupings}"


def _link_targets(dashboard: dict[str, Any]) -> set[str]:
    return {uid for text in _strings(dashboard["panels"]) for uid in re.findall(r"/d/([\w-]+)\?", text)}


def test_drill_down_links_job_to_pg_to_rank() -> None:
    assert _link_targets(_load(generate.UID_JOB)) >= {generate.UID_PG, generate.UID_RANK}
    assert _link_targets(_load(generate.UID_PG)) >= {generate.UID_RANK}
    assert _link_targets(_load(generate.UID_RANK)) >= {generate.UID_PG}
    for uid, dashboard in _committed():
        assert _link_targets(dashboard) <= set(generate.DASHBOARD_FILES), uid
        for text in _strings(dashboard["panels"]):
            if "/d/" in text:
                # The job and datasource travel with every drill-down; so does the time range.
                assert "${job_id:queryparam}" in text and "${datasource:queryparam}" in text, text
                assert "${__url_time_range}" in text, text
        (links,) = [link for link in dashboard["links"] if link["type"] == "dashboards"]
        assert links["tags"] == ["frexporter"] and links["includeVars"] and links["keepTime"]


def test_runbook_links_follow_the_rules_under_an_empty_base() -> None:
    """Alert names link to the path the canonical rules give as runbook_url, under the Runbook base URL
    variable, which ships empty: frexporter has no address, the Helm chart fills it in."""
    dashboard = _load(generate.UID_JOB)
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == generate.V_RUNBOOK_BASE]
    assert variable["type"] == "textbox" and variable["query"] == "" and variable["current"]["value"] == ""
    urls = {text for text in _strings(dashboard["panels"]) if "/docs/runbooks/" in text}
    assert urls == {"${runbook_base:raw}/docs/runbooks/${__data.fields.alertname}.md"}
    (url,) = urls
    alerts = [rule for group in load_rules()["groups"] for rule in group["rules"] if "alert" in rule]
    assert alerts
    for alert in alerts:
        linked = url.replace("${__data.fields.alertname}", alert["alert"])
        assert linked == "${runbook_base:raw}/" + alert["annotations"]["runbook_url"]
        assert (REPO / alert["annotations"]["runbook_url"]).is_file()


def _known_series() -> set[str]:
    exported = {
        v for v in vars(naming).values() if isinstance(v, str) and v.startswith(naming.PREFIX) and v != naming.PREFIX
    }
    recorded = {rule["record"] for group in load_rules()["groups"] for rule in group["rules"] if "record" in rule}
    return exported | recorded | promql.EXTERNAL_METRICS


def _is_known(name: str, known: set[str]) -> bool:
    if name in known:
        return True
    # A histogram is exposed as <name>_bucket/_count/_sum series.
    return any(name.endswith(suffix) and name[: -len(suffix)] in known for suffix in promql.HISTOGRAM_SUFFIXES)


def test_every_series_a_query_reads_is_exported_or_recorded() -> None:
    known = _known_series()
    for name, expr in all_exprs():
        names = generate.metric_names(expr)
        assert names or expr.endswith("or vector(0)"), f"{name}: no series found in {expr!r}"
        unknown = {metric for metric in names if not _is_known(metric, known)}
        assert not unknown, f"{name}: {sorted(unknown)} in {expr!r} are not in naming.py or the recording rules"


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('max by (rank) (time() - a_b{job_id="$job_id", pg="x y"})', {"a_b"}),
        ("rate(job_id_pg:x:min[$__rate_interval])", {"job_id_pg:x:min"}),
        ('count(up{job=~".*frexporter.*"} == 0) or vector(0)', {"up"}),
        ("histogram_quantile(0.99, sum by (le, op) (rate(h_bucket[1m])))", {"h_bucket"}),
        ("a * on (gpu_uuid) group_left (rank) max by (gpu_uuid, rank) (b)", {"a", "b"}),
        ("count by (world_size) (c) > bool 1e3 unless d offset 5m", {"c", "d"}),
        ('ALERTS{alertname=~"Frexporter.*", rank="sum(x)"}', {"ALERTS"}),
    ],
)
def test_metric_name_scan(expr: str, names: set[str]) -> None:
    assert generate.metric_names(expr) == names


def test_dashboards_cover_the_metrics_that_matter() -> None:
    used = {name for query in generate.panel_queries() for name in generate.metric_names(query.expr)}
    required = {
        naming.RANK_UP,
        naming.RANK_INFO,
        naming.RANK_HEARTBEAT_TIMESTAMP_SECONDS,
        naming.RANK_RECORDER_ERRORS_TOTAL,
        naming.PG_INFO,
        naming.PG_LAST_ENQUEUED_SEQ,
        naming.PG_LAST_COMPLETED_SEQ,
        naming.PG_INFLIGHT_COLLECTIVES,
        naming.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS,
        naming.PG_TIMEOUT_SECONDS,
        naming.VERDICT,
        naming.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS,
        naming.PG_STUCK_THRESHOLD_SECONDS,
        naming.PG_STUCK_CEILING_SECONDS,
        naming.SOURCE_UP,
        naming.COLLECTIVE_DURATION_SECONDS + "_bucket",
        naming.COLLECTIVE_BYTES_TOTAL,
        naming.GPU_UTILIZATION_RATIO,
        naming.GPU_MEMORY_USED_BYTES,
        naming.GPU_TEMPERATURE_CELSIUS,
        naming.GPU_POWER_WATTS,
        naming.GPU_THROTTLE_REASONS,
        naming.GPU_ECC_ERRORS_TOTAL,
        naming.GPU_XID_ERRORS_TOTAL,
        naming.GPU_NVLINK_ERRORS_TOTAL,
        promql.R_ENQUEUED_SKEW,
        promql.R_BUDGET_USED,
        promql.R_OLDEST_WAIT_AGE,
        promql.R_PG_RANKS_WAITING,
        promql.ALERTS,
    }
    assert required <= used, sorted(required - used)


def test_every_activity_state_has_its_own_number_and_colour() -> None:
    # A state added to the model without a style would show as a bare number or an uncoloured cell.
    style = generate.ACTIVITY_STYLE
    assert set(style) == set(ACTIVITY_STATES)
    assert len({code for code, _ in style.values()}) == len(style)
    for state, (code, color) in style.items():
        assert panels.ACTIVITY_MAPPING[0].options[str(code)].text == state
        assert panels.ACTIVITY_LABEL_MAPPING[0].options[state].color == color
    # The rank dashboard draws the state as a number: every state's series is read, with its own code.
    (expr,) = {q.expr for q in generate.panel_queries() if (q.dashboard_uid, q.panel_title) == (
        generate.UID_RANK, "Activity")}
    for state, (code, _) in style.items():
        assert f'state="{state}"}} + {code})' in expr, (state, expr)


# --- queries for end-to-end tests ----------------------------------------------


def test_all_panel_queries_lists_every_target_of_the_committed_json() -> None:
    from_json = [
        (uid, panel["title"], generate.substitute(target["expr"]))
        for uid, dashboard in _committed()
        for panel, target in generate.panel_targets(dashboard)
    ]
    assert generate.all_panel_queries() == from_json
    for _, _, expr in from_json:
        assert "$" not in expr, expr


def test_all_panel_queries_substitutes_the_given_variables() -> None:
    queries = generate.all_panel_queries({"job_id": "run-7", "pg": "3", "rank": "12", "__rate_interval": "30s"})
    exprs = "\n".join(expr for _, _, expr in queries)
    assert 'job_id="run-7"' in exprs and 'pg="3"' in exprs and 'rank="12"' in exprs and "[30s]" in exprs
    assert 'job_id="llm"' not in exprs
    assert generate.substitute('x{a="${job_id}"}[$__rate_interval]', {"job_id": "j"}) == 'x{a="j"}[1m]'
    with pytest.raises(KeyError, match="nope"):
        generate.substitute('x{a="$nope"}')


def test_all_panel_queries_filters_by_what_a_scenario_provides() -> None:
    everything = generate.all_panel_queries()
    assert generate.all_panel_queries(available=generate.Needs.ALL) == everything
    basic = generate.all_panel_queries(available=())
    # A plain healthy job without recording rules still has data on every dashboard.
    assert {uid for uid, _, _ in basic} == set(generate.DASHBOARD_FILES)
    assert not any("frexporter_gpu_" in expr or "job_id_pg:" in expr for _, _, expr in basic)
    cpu_hang = generate.all_panel_queries(
        available={generate.Needs.RULES, generate.Needs.INFLIGHT, generate.Needs.WAIT, generate.Needs.VERDICT,
                   generate.Needs.ALERT}
    )
    assert set(basic) < set(cpu_hang) < set(everything)
    assert not any("frexporter_gpu_" in expr for _, _, expr in cpu_hang)
    with pytest.raises(ValueError, match="unknown conditions"):
        generate.all_panel_queries(available={"gpus"})


def test_needs_follow_the_series_a_query_reads() -> None:
    for query in generate.panel_queries():
        names = generate.metric_names(query.expr)
        if query.expr.endswith("or vector(0)"):
            assert query.needs == frozenset(), query
            continue
        if any(name.startswith(naming.PREFIX + "gpu_") for name in names):
            assert generate.Needs.GPU in query.needs, query
        if any(":" in name for name in names):
            assert generate.Needs.RULES in query.needs, query
        if naming.VERDICT in names:
            assert generate.Needs.VERDICT in query.needs, query
        if naming.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS in names:
            assert generate.Needs.INFLIGHT in query.needs, query
        if names & {promql.R_OLDEST_WAIT_AGE, promql.R_PG_RANKS_WAITING, promql.R_BUDGET_USED}:
            # Records of the waits: none while every collective is younger than half its stuck threshold.
            assert generate.Needs.WAIT in query.needs, query
        assert query.needs <= generate.Needs.ALL, query
