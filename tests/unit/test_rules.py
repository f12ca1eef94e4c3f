"""The canonical alert and recording rules: promtool's checks, its unit tests in
tests/rules/, the conventions every alert follows, and the timing scaler.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_rules.py."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import yaml

from frexporter import naming
from frexporter.model import BUSY_HOLD_SECONDS
from tests.harness import REPO
from tests.rulefile import (
    DESYNC_CANDIDATES,
    RULES_PATH,
    SCALE_MARKER,
    STUCK_WAIT,
    find_rule,
    load_rules,
    parse_duration,
    render_rules,
)
from tests.shared.rules import UNIT_TESTS, fixtures_of, shipped_alerts, shipped_rules

# Repository-relative: where the runbooks are served is the deployment's to say (the Helm chart prefixes
# prometheusRule.runbookBaseURL), so the canonical file names no address.
RUNBOOK_PATH = "docs/runbooks/{}.md"
SEVERITIES = {"info", "warning", "critical"}


def _recorded() -> set[str]:
    return {rule["record"] for rule in shipped_rules() if "record" in rule}


def test_unit_tests_load_the_shipped_rules() -> None:
    for test_file in UNIT_TESTS:
        spec = yaml.safe_load(test_file.read_text(encoding="utf-8"))
        resolved = [(test_file.parent / name).resolve() for name in spec["rule_files"]]
        assert resolved == [*fixtures_of(test_file, spec), RULES_PATH.resolve()], test_file


def test_every_alert_has_a_for_boundary_test() -> None:
    """Per alert, some test expects it firing at t and silent at t minus one
    evaluation interval, in the same input."""
    covered: set[str] = set()
    for test_file in UNIT_TESTS:
        spec = yaml.safe_load(test_file.read_text(encoding="utf-8"))
        step = parse_duration(spec["evaluation_interval"])
        for case in spec["tests"]:
            silent, firing = set(), set()
            for check in case.get("alert_rule_test", []):
                key = (check["alertname"], parse_duration(check["eval_time"]))
                (firing if check["exp_alerts"] else silent).add(key)
            covered |= {name for name, at in firing if (name, at - step) in silent}
    assert covered == {alert["alert"] for alert in shipped_alerts()}


def _naming_metrics() -> set[str]:
    return {
        value for value in vars(naming).values() if isinstance(value, str) and value.startswith(naming.PREFIX)
    }


def _promql_names(expr: str) -> set[str]:
    without_comments = re.sub(r"#[^\n]*", "", expr)
    without_strings = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', "", without_comments)
    return set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", without_strings))


def test_rules_reference_only_metrics_named_in_naming() -> None:
    known = _naming_metrics()
    recorded = _recorded()
    referenced: set[str] = set()
    for rule in shipped_rules():
        names = _promql_names(rule["expr"])
        # Only recording rules produce names with a colon.
        assert {n for n in names if ":" in n} <= recorded, rule
        referenced |= {n for n in names if n.startswith(naming.PREFIX)}
        for text in rule.get("annotations", {}).values():
            # The notifications' queries read raw series and recording rules (level:metric:operations).
            assert set(re.findall(r"\w+:\w+:\w+", text)) <= recorded, text
            referenced |= set(re.findall(r"(?<![\w:])" + naming.PREFIX + r"\w+(?![\w:])", text))
    assert referenced, "found no metric names: the scan is broken"
    assert naming.PG_LAST_ENQUEUED_SEQ in referenced
    assert referenced <= known, referenced - known


# The one way the rules read a node's clock (frexporter.rules.yml, "Clocks"): the node's clock at its last poll,
# advanced by Prometheus' time since that scrape, minus a timestamp of that node, joined on the exporter.
_NODE_AGE = re.compile(
    r"max by \(job, instance\) \(\s*" + re.escape(naming.POLL_TIMESTAMP_SECONDS) + r" \+ time\(\) - timestamp\("
    + re.escape(naming.POLL_TIMESTAMP_SECONDS) + r"\)\s+or on \(job, instance\)\s+0 \* up \+ time\(\)\s*\)"
    r"\s+- on \(job, instance\) group_right \(\) (?=frexporter_\w+_timestamp_seconds\b)")
# Prometheus' own time: recorded as a value (when a shard recorded its candidates), against such a value less an
# age (a shard's candidates older than the waits are left out), or less the time of a node's last scrape (a node not
# scraped lately is left out): no node clock in any.
_RECORDED_AT = re.compile(r"\+ time\(\)$|\(time\(\) - max by \([\w, ]+\) \(\w+:\w+:\w+\)\)"
                          r"|\(time\(\) - timestamp\(" + re.escape(naming.POLL_TIMESTAMP_SECONDS)
                          + r"\) > [\d.]+\)", re.M)
# When Prometheus scraped a node timestamp, against when it scraped that node's poll (or "up"): both are Prometheus'
# scrape times (a sample's, not its value), so no node clock is read.
_SCRAPED_WITH_ITS_NODE = re.compile(
    r"timestamp\((frexporter_\w+_timestamp_seconds)\)\s+< on \(job, instance\) group_left \(\)\s+max by \(job, "
    r"instance\) \(timestamp\(" + re.escape(naming.POLL_TIMESTAMP_SECONDS) + r"\) or on \(job, instance\) "
    r"timestamp\(up\)\)")
# Node timestamps the rules only test for presence or state, never read as a time.
_NOT_READ_AS_TIMES = {naming.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS}
# The one node timestamp compared across nodes on purpose: gloo's straggler signal, a rank's call time against its
# peers' (FrexporterStraggler), as right as the nodes' clocks agree (docs/durations.md, "Stragglers across nodes";
# tests/rules/straggler_test.yml shows a 100 ms offset over half the PG).
_COMPARED_ACROSS_NODES = {naming.RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS}


@pytest.mark.parametrize("rule", shipped_rules(), ids=lambda rule: rule.get("alert") or rule["record"])
def test_node_timestamps_are_only_aged_on_their_own_node_s_clock(rule: dict[str, Any]) -> None:
    """No rule compares a node's timestamp with Prometheus' time() or with another node's: each is aged on its own
    exporter's clock first (tests/rules/clock_skew_test.yml shows what that buys)."""
    texts = [re.sub(r"#[^\n]*", "", rule["expr"]), *rule.get("annotations", {}).values()]
    for text in texts:
        aged = {m.end() for m in _NODE_AGE.finditer(text)} | {m.start(1) for m in _SCRAPED_WITH_ITS_NODE.finditer(text)}
        assert "time()" not in _RECORDED_AT.sub("", _NODE_AGE.sub("", text)), text
        # Raw series only: a recording rule's name (level:metric:operations) holds its source's name.
        for m in re.finditer(r"(?<![\w:])frexporter_\w+_timestamp_seconds(?![\w:])", text):
            if m.group() == naming.POLL_TIMESTAMP_SECONDS or m.group() in _NOT_READ_AS_TIMES | _COMPARED_ACROSS_NODES:
                continue
            assert m.start() in aged, f"{m.group()} not aged on its node's clock at {m.start()}: {text}"


def test_recording_rules_follow_level_metric_operations() -> None:
    for name in _recorded():
        level, metric, operations = name.split(":")
        assert level and operations, name
        assert metric.startswith(naming.PREFIX), name


@pytest.mark.parametrize("alert", shipped_alerts(), ids=lambda alert: alert["alert"])
def test_alert_follows_conventions(alert: dict[str, Any]) -> None:
    name = alert["alert"]
    assert re.fullmatch(r"Frexporter[A-Z][A-Za-z]+", name)
    assert "for" in alert
    # A templated severity (FrexporterCollectiveDesync: info for a busy culprit) may only choose among them.
    severity = alert["labels"]["severity"]
    choices = set(re.findall(r"}}(\w+){{", severity)) if "{{" in severity else {severity}
    assert choices and choices <= SEVERITIES, severity
    annotations = alert["annotations"]
    assert annotations["summary"].strip()
    assert "$labels." in annotations["description"]
    assert annotations["runbook_url"] == RUNBOOK_PATH.format(name)
    runbook = REPO / annotations["runbook_url"]
    assert runbook.is_file(), runbook
    assert runbook.read_text(encoding="utf-8").startswith(f"# {name}\n")


def test_load_rules_scales_intervals_for_and_marked_literals_only() -> None:
    shipped, scaled = shipped_rules(), [r for g in load_rules(0.1)["groups"] for r in g["rules"]]
    marked = 0
    for before, after in zip(shipped, scaled, strict=True):
        if "for" in before:
            assert math.isclose(parse_duration(after["for"]), parse_duration(before["for"]) * 0.1)
        for line_before, line_after in zip(
            before["expr"].split("\n"), after["expr"].split("\n"), strict=True
        ):
            if SCALE_MARKER not in line_before:
                assert line_after == line_before
                continue
            marked += 1
            number = r"(\d+(?:\.\d+)?)\s*\)*\s*#"
            old = float(re.findall(number, line_before)[-1])
            new = float(re.findall(number, line_after)[-1])
            assert math.isclose(new, old * 0.1)
        untimed = {"for", "expr"}
        assert {k: v for k, v in after.items() if k not in untimed} == {
            k: v for k, v in before.items() if k not in untimed
        }
    assert marked >= 4
    # A group's own interval (the dashboards' minute) scales too; the others keep the server's.
    intervals = {g["name"]: g.get("interval") for g in load_rules(0.1)["groups"]}
    assert intervals["frexporter-dashboards"] == "6s"
    assert {name for name, every in intervals.items() if every} == {"frexporter-dashboards"}


def test_load_rules_scaled_desync_timing() -> None:
    desync = next(
        rule
        for group in load_rules(0.1)["groups"]
        for rule in group["rules"]
        if rule.get("alert") == "FrexporterCollectiveDesync"
    )
    ages = next(
        rule
        for group in load_rules(0.1)["groups"]
        for rule in group["rules"]
        if rule.get("record") == "job_id_pg_rank:frexporter_pg_wait_start_timestamp_seconds:age"
    )
    assert desync["for"] == "1500ms"
    assert re.search(r"> 4.5\)\s+# @scale", ages["expr"])  # a node unscraped for 45 s has no waits
    # No threshold of the rules' own: the waits carry each rank's.
    stuck = find_rule(STUCK_WAIT, 0.1)
    assert '{limit="stuck"}' in stuck["expr"] and SCALE_MARKER not in stuck["expr"], stuck["expr"]


def test_desync_busy_hold_is_the_model_s() -> None:
    """The alert's "busy within the last minute" is the node verdict's BUSY_HOLD_SECONDS (one answer)."""
    held = next(rule for rule in shipped_rules() if rule.get("record") == DESYNC_CANDIDATES)
    windows = set(re.findall(r'\{state="busy"\}\[(\w+)\]', held["expr"]))
    assert windows and {parse_duration(w) for w in windows} == {BUSY_HOLD_SECONDS}, windows


@pytest.mark.parametrize("scale", [0.0, -1.0, math.nan, math.inf])
def test_load_rules_rejects_bad_scale(scale: float) -> None:
    with pytest.raises(ValueError):
        load_rules(scale)


def test_render_rules_round_trips() -> None:
    assert yaml.safe_load(render_rules(0.1)) == load_rules(0.1)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("15s", 15.0), ("1m30s", 90.0), ("1500ms", 1.5), ("2h", 7200.0), ("1d", 86400.0)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "15", "1.5s", "s", "15 s"])
def test_parse_duration_rejects_non_durations(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)
