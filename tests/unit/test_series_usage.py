"""Which per-rank series the alerts need (scripts/series_usage.py), and docs/scale.md's recipe that drops the rest:
it never drops what an alert reads, it is the one the script generates, and it saves what the document says."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from frexporter import naming as n
from tests.harness import REPO, require_module
from tests.rulefile import load_rules
from tests.shared.series_budget import (
    OPT_IN_FLAGS,
    RANKS_PER_NODE,
    every_series_node,
    exposition,
    rank_series,
    reference_node,
)

# The dashboards' PromQL scan is dev tooling (grafana/generator), pinned in the test extra.
require_module("grafana_foundation_sdk", "grafana-foundation-sdk (the test extra)")

from scripts import series_usage as su  # noqa: E402 (after the check: it imports the generator)

DOC = REPO / "docs" / "scale.md"
GOLDEN = REPO / "tests" / "golden" / "metrics.txt"
_SAVES = re.compile(r"The (\w+) recipe saves (\d+) of (\d+) series per rank")


@pytest.fixture(scope="module")
def used() -> su.Usage:
    return su.usage()


@pytest.fixture(scope="module")
def rows(used: su.Usage) -> list[su.Row]:
    return su.table(used)


def _doc() -> str:
    return DOC.read_text(encoding="utf-8")


def _doc_block(check: str) -> Any:
    """The YAML of the fenced block right after ``<!-- check: NAME -->`` in docs/scale.md."""
    match = re.search(r"<!-- check: " + re.escape(check) + r" -->\n```yaml\n(.*?)\n```", _doc(), re.S)
    assert match, f"docs/scale.md has no yaml block marked {check!r}"
    return yaml.safe_load(match.group(1))


def _doc_relabelings() -> Iterator[tuple[str, dict[str, Any]]]:
    """(block, relabeling) of every recipe in docs/scale.md, keys as plain Prometheus spells them."""
    for check in ("relabel-prometheus", "relabel-prometheus-unused"):
        (job,) = _doc_block(check)["scrape_configs"]
        (relabel,) = job["metric_relabel_configs"]
        yield check, relabel
    (relabel,) = _doc_block("relabel-helm")["scrape"]["metricRelabelings"]
    # The Prometheus operator's RelabelConfig spells the same fields in camelCase.
    yield "relabel-helm", {"source_labels": relabel.pop("sourceLabels"), **relabel}


def _dropped(regex: str, name: str, labels: dict[str, str]) -> bool:
    """Prometheus' metric_relabel_configs drop: the source labels' values joined by ";", the regex anchored."""
    joined = ";".join([name, *(labels.get(label, "") for label in su.RELABEL_SOURCE_LABELS[1:])])
    return re.fullmatch(regex, joined) is not None


def _per_rank_after(text: str, regex: str | None) -> float:
    kept = sum(1 for family in text_string_to_metric_families(text) for s in family.samples
               if n.L_RANK in s.labels and (regex is None or not _dropped(regex, s.name, s.labels)))
    return kept / RANKS_PER_NODE


# --- (a) a recipe never drops what an alert reads ------------------------------------------------------------


@pytest.mark.parametrize("recipe", sorted(su.RECIPES))
def test_recipes_never_drop_what_an_alert_reads(used: su.Usage, rows: list[su.Row], recipe: str) -> None:
    regex = su.relabel_regex(su.recipe_names(rows, recipe))
    needed = used.alert_needs()
    assert n.PG_LAST_ENQUEUED_SEQ in needed and n.RANK_UP in needed
    for name in needed:
        assert not _dropped(regex, name, {n.L_RANK: "8"}), (recipe, name)
    # Every series an alert reads is still there after the recipe, on a node where every per-rank series is
    # written (the opt-in ones too).
    text = exposition(every_series_node(OPT_IN_FLAGS))
    before = rank_series(text)
    for name in needed & set(before):
        kept = [s for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == name and not _dropped(regex, s.name, s.labels)]
        assert len(kept) >= before[name], (recipe, name)


def test_no_dropped_name_occurs_in_an_alert_or_a_rule_it_reads(rows: list[su.Row]) -> None:
    """The same without the PromQL scan: a dropped name spelled anywhere in an alert (expression, annotations)
    or in a recording rule an alert reaches, by the rule's name, would be a miss of the scan."""
    all_rules = [rule for group in load_rules()["groups"] for rule in group["rules"]]
    texts = [yaml.safe_dump(rule) for rule in all_rules if "alert" in rule]
    records = {rule["record"]: rule["expr"] for rule in all_rules if "record" in rule}
    reached: set[str] = set()
    while True:
        new = {name for name in records if name not in reached and any(name in text for text in texts)}
        if not new:
            break
        reached |= new
        texts += [records[name] for name in new]
    assert "job_id_pg_rank:frexporter_pg_wait_start_timestamp_seconds:age" in reached
    for recipe in su.RECIPES:
        for name in su.recipe_names(rows, recipe):
            spelled = [t for t in texts if re.search(rf"(?<![\w:]){re.escape(name)}(?![\w:])", t)]
            assert not spelled, (recipe, name, spelled)


# --- (b) the document's recipe is the generated one ----------------------------------------------------------


def test_docs_recipes_are_the_generated_ones(rows: list[su.Row]) -> None:
    expected = {
        "relabel-prometheus": su.relabel_regex(su.recipe_names(rows, su.RECIPE_ALERTING)),
        "relabel-helm": su.relabel_regex(su.recipe_names(rows, su.RECIPE_ALERTING)),
        "relabel-prometheus-unused": su.relabel_regex(su.recipe_names(rows, su.RECIPE_UNUSED)),
    }
    for check, relabel in _doc_relabelings():
        assert relabel == {"source_labels": list(su.RELABEL_SOURCE_LABELS), "regex": expected[check],
                           "action": "drop"}, (check, "run: python scripts/series_usage.py --relabel")


def test_relabel_flag_prints_the_recipe(rows: list[su.Row], capsys: pytest.CaptureFixture[str]) -> None:
    assert su.main(["--relabel"]) == 0
    assert capsys.readouterr().out == su.relabel_regex(su.recipe_names(rows, su.RECIPE_ALERTING)) + "\n"
    assert su.main(["--relabel", su.RECIPE_UNUSED]) == 0
    assert capsys.readouterr().out == su.relabel_regex(su.recipe_names(rows, su.RECIPE_UNUSED)) + "\n"


def test_docs_tables_are_the_generated_ones(used: su.Usage) -> None:
    doc = _doc()
    for part in su.markdown(used):
        assert part in doc, f"docs/scale.md differs from the script; paste from: python scripts/series_usage.py " \
                            f"--markdown\nmissing:\n{part}"


# --- (c) the table -------------------------------------------------------------------------------------------


def test_table_says_who_needs_what(used: su.Usage, rows: list[su.Row]) -> None:
    by_name = {r.metric: r for r in rows}
    assert any(r.needed_by == su.ALERTS for r in rows)
    # Read by alert expressions, directly (rank down) or through a recording rule: the desync's culprits come
    # from the exporters' idle ranks, and the enqueued seqs only give the stragglers' collectives rate.
    assert by_name[n.PG_IDLE_SEQ].needed_by == su.ALERTS
    assert by_name[n.PG_IDLE_SEQ].alerts == ("FrexporterCollectiveDesync",)
    assert by_name[n.PG_LAST_ENQUEUED_SEQ].alerts == ("FrexporterStraggler",)
    assert "FrexporterRankDown" in by_name[n.RANK_UP].alerts
    # The alerts read the exporters' waits; every rank's in-flight start only the dashboards.
    assert by_name[n.PG_WAIT_START_TIMESTAMP_SECONDS].needed_by == su.ALERTS
    assert by_name[n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS].needed_by == su.DASHBOARDS
    # Only through the Straggler alert's recording rules (lag, loss ratio).
    assert by_name[n.RANK_COLLECTIVE_WAIT_SECONDS].alerts == ("FrexporterStraggler",)
    # Only in an alert's text (the desync notification names the culprit's op).
    assert by_name[n.VERDICT].alert_texts == ("FrexporterCollectiveDesync",) and not by_name[n.VERDICT].alerts
    assert by_name[n.VERDICT].needed_by == su.ALERTS
    # Drill-down only.
    inflight = by_name[n.PG_INFLIGHT_COLLECTIVES]
    assert inflight.needed_by == su.DASHBOARDS and inflight.per_rank == 8
    assert su.Panel("Process group", "Collectives in flight per rank") in inflight.panels
    assert by_name[n.PG_LAST_PROGRESS_TIMESTAMP_SECONDS].needed_by == su.DASHBOARDS
    # Nothing shipped reads the deprecated name.
    assert by_name[n.RANK_STRAGGLER_SCORE_DEPRECATED].needed_by == su.NEITHER
    # Opt-in series stay out of every recipe, whoever reads them.
    assert by_name[n.COLLECTIVE_BYTES_TOTAL].opt_in == "--per-rank-durations"
    assert all(not by_name[name].opt_in for recipe in su.RECIPES for name in su.recipe_names(rows, recipe))
    # The reference node's total is the budgeted one.
    assert sum(r.per_rank for r in rows) == 40
    # Recording rules: the wait ages feed alerts (through the shard exports) and the dashboards' waiting ranks,
    # which only the dashboards read.
    assert used.rules["job_id_pg_rank:frexporter_pg_wait_start_timestamp_seconds:age"] == su.ALERTS
    assert used.rules["job_id_pg:frexporter_pg_ranks_waiting:count"] == su.DASHBOARDS


def test_every_per_rank_series_is_in_the_table(rows: list[su.Row]) -> None:
    """Another source of names with a rank label: the golden exposition (tests/golden/metrics.txt)."""
    golden = rank_series(GOLDEN.read_text(encoding="utf-8"))
    assert golden
    assert set(golden) <= {r.metric for r in rows}


def test_comments_are_not_metrics() -> None:
    assert su._names('a > 60  # @scale\n and b{x="#y"}') == {"a", "b"}


# --- (d) the recipe saves what the document says ------------------------------------------------------------


def test_recipes_save_what_the_doc_says(rows: list[su.Row]) -> None:
    # Every statement of the number, in the generated summary and next to the recipe.
    statements = [(recipe, int(saved), int(total)) for recipe, saved, total in _SAVES.findall(_doc())]
    assert {recipe for recipe, _, _ in statements} == set(su.RECIPES), statements
    text = exposition(reference_node())
    before = _per_rank_after(text, None)
    for check, relabel in _doc_relabelings():
        recipe = su.RECIPE_UNUSED if check.endswith("-unused") else su.RECIPE_ALERTING
        after = _per_rank_after(text, relabel["regex"])
        for _, saved, total in (s for s in statements if s[0] == recipe):
            assert (before, before - after) == (total, saved), check
    assert before - _per_rank_after(text, su.relabel_regex(su.recipe_names(rows, su.RECIPE_ALERTING))) > 0
