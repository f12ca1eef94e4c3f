"""scripts/rule_tiers.py: which tier each rule runs in, and that the generated tier files are current.

promtool runs the tiers in tests/e2e/test_rule_tiers.py."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from frexporter import naming
from scripts import rule_tiers
from tests.harness import REPO
from tests.rulefile import load_rules

# Alerts that read one node's series: they page from each shard. The rest need every node's ranks.
PER_NODE_ALERTS = {"FrexporterRankDown", "FrexporterRankUnresponsive", "FrexporterExporterDown",
                   "FrexporterSourceDown"}


def _rules(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for g in doc["groups"] for r in g["rules"]]


def test_generated_tier_files_are_current() -> None:
    assert rule_tiers.main(["--check"]) == 0, "run python scripts/rule_tiers.py"


def test_each_alert_runs_in_its_tier() -> None:
    tiers = rule_tiers.classify(load_rules())
    alerts = {r["alert"] for r in _rules(load_rules()) if "alert" in r}
    assert {a for a in alerts if tiers[a] == rule_tiers.SHARD} == PER_NODE_ALERTS
    assert {a for a in alerts if tiers[a] == rule_tiers.GLOBAL} == alerts - PER_NODE_ALERTS


def test_the_split_keeps_every_rule_once_and_in_order() -> None:
    doc = load_rules()
    parts = rule_tiers.split(doc)
    names = [r.get("record") or r["alert"] for r in _rules(doc)]
    for tier, part in parts.items():
        got = [r.get("record") or r["alert"] for r in _rules(part)]
        assert got == [n for n in names if rule_tiers.classify(doc)[n] == tier]
    assert sorted(n for p in parts.values() for n in (r.get("record") or r["alert"] for r in _rules(p))) == \
        sorted(names)


def test_the_global_tier_reads_only_what_federation_brings_and_its_own_records() -> None:
    parts = rule_tiers.split(load_rules())
    own = {r["record"] for r in _rules(parts[rule_tiers.GLOBAL]) if "record" in r}
    federated = re.compile(r"^\w+_shard:\w+:\w+$|^" + re.escape(naming.VERDICT) + "$")
    for rule in _rules(parts[rule_tiers.GLOBAL]):
        texts = [rule["expr"], *rule.get("annotations", {}).values()]
        for text in texts:
            names = set(re.findall(r"(?<![\w:])(?:\w+:\w+:\w+|frexporter_\w+|up)(?![\w:(])", text))
            assert all(n in own or federated.match(n) for n in names), (rule.get("alert") or rule["record"],
                                                                          names)


def test_federation_matches_every_export_and_no_exporter_series() -> None:
    exports = {r["record"] for r in _rules(load_rules()) if r.get("record", "").split(":")[0].endswith("_shard")}
    assert exports
    by_name = re.compile(r'__name__=~"(.+)"')
    pattern = next(by_name.search(m)[1] for m in rule_tiers.FEDERATE_MATCH if by_name.search(m))
    assert all(re.fullmatch(pattern, e) for e in exports)
    metrics = {v for v in vars(naming).values() if isinstance(v, str) and v.startswith(naming.PREFIX)}
    assert not any(re.fullmatch(pattern, m) for m in metrics)


@pytest.mark.parametrize(("expr", "why"), [
    # An exporter's series joined with a global record (a global rule reading what only shards hold), and a
    # shard export read from a global record.
    ("frexporter_pg_last_enqueued_seq - on (job_id, pg, pg_desc) group_left "
     "job_id_pg:frexporter_pg_last_enqueued_seq:max", "fits no tier"),
    ("max by (job_id, pg, pg_desc) (job_id_pg:frexporter_pg_last_enqueued_seq:max)", "fits no tier"),
])
def test_a_rule_across_the_tiers_the_wrong_way_is_refused(expr: str, why: str) -> None:
    doc = yaml.safe_load(yaml.safe_dump(load_rules()))
    metric = "frexporter_pg_last_enqueued_seq"
    name = f"job_id_pg:{metric}:bad" if expr.startswith(metric) else f"job_id_pg_shard:{metric}:bad"
    doc["groups"][-1]["rules"].append({"record": name, "expr": expr})
    with pytest.raises(rule_tiers.TierError, match=why):
        rule_tiers.classify(doc)


def test_the_tier_files_say_they_are_generated() -> None:
    for path in rule_tiers.TIER_FILES.values():
        assert "Generated from frexporter.rules.yml by scripts/rule_tiers.py" in (REPO / path).read_text()


def test_exporter_inputs_are_the_exporters_series_the_rules_read_and_no_record() -> None:
    doc = {"groups": [{"name": "g", "rules": [
        {"record": "job_id:frexporter_rank_up:sum", "expr": "sum by (job_id) (frexporter_rank_up)"},
        {"alert": "A", "expr": 'job_id:frexporter_rank_up:sum < 1 and on () up{job="x"}  # frexporter_in_comment'},
        {"alert": "B", "expr": 'label_replace(frexporter_rank_info, "a", "frexporter_in_string", "", "")'},
    ]}]}
    assert rule_tiers.exporter_inputs(doc) == ["frexporter_rank_info", "frexporter_rank_up", "up"]
    shipped = rule_tiers.exporter_inputs(load_rules())
    metrics = {v for v in vars(naming).values() if isinstance(v, str) and v.startswith(naming.PREFIX)}
    assert set(shipped) - {"up"} <= metrics
    assert {naming.PG_LAST_ENQUEUED_SEQ, naming.RANK_UP} <= set(shipped)
    # Only the shard tier reads them: the global tier reads exports.
    assert rule_tiers.exporter_inputs(rule_tiers.split(load_rules())[rule_tiers.GLOBAL]) == []
