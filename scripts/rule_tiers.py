#!/usr/bin/env python3
"""Split the canonical rules into a shard tier and a global tier (docs/scale.md, "Tiers").

The canonical ``frexporter/rules/frexporter.rules.yml`` is the single-Prometheus layout: every group holds its
shard-tier rules first and its global-tier rules after them, so one Prometheus evaluates both in one pass with
no lag. For a job that outgrows one Prometheus the same rules run in two tiers:

- **shard**: on each Prometheus that scrapes part of the nodes. Every rule that reads an exporter's series (or
  a per-rank record built from them): the per-rank alerts, and the small per-(job, PG) exports whose level ends
  in ``_shard`` (``job_id_pg_shard:``, ``job_id_pg_rank_shard:``, ``job_id_shard:``).
- **global**: on the Prometheus that federates the shards' exports (each shard sets the external label
  ``shard``). Every rule that reads only exports and global records: the cross-node alerts and the dashboards'
  aggregates.

A rule's tier follows from what it reads, so the split needs no list kept beside the rules; a rule of the
global tier that read an exporter's series, or an export that read a global record, fails the split.

``python scripts/rule_tiers.py`` writes ``frexporter/rules/frexporter.{shard,global}.rules.yml``; ``--check``
changes nothing and exits 1 when they differ from what the canonical file gives; ``--federate`` prints the
``match[]`` selectors the global tier's federation job needs.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
RULES_DIR = Path("frexporter/rules")
SHARD, GLOBAL = "shard", "global"
TIERS = (SHARD, GLOBAL)
TIER_FILES = {tier: RULES_DIR / f"frexporter.{tier}.rules.yml" for tier in TIERS}
# A recording rule whose level ends in "_shard" is a shard's export, read by the global tier.
EXPORT = re.compile(r"^\w+_shard:\w+:\w+$")
# What the global tier reads from the shards: their exports, and the exporters' open verdicts (few: one per
# culprit), which the desync notification quotes for the culprit's op.
FEDERATE_MATCH = ('{__name__=~".+_shard:.+"}', '{__name__="frexporter_verdict"}')
# The federation job must not honor the shards' sample timestamps: Prometheus writes no staleness marker for a series
# scraped with its own timestamp, so with the default (true) an export a shard stops recording (a candidate whose
# culprit_state changed) stays on the global for the 5-minute lookback beside its successor, and the desync alert
# fails to evaluate ("many-to-many matching not allowed"); a down shard's exports stay as long. Measured by
# tests/e2e/test_tiers_live.py. With false, the global stamps each scrape itself and what leaves /federate, or a
# shard whose scrape fails, goes stale at once. A shard that falls behind is told apart by the values it records
# (the candidates' recording time), not by timestamps.
FEDERATE_HONOR_TIMESTAMPS = False
SHARD_LABEL = "shard"
GLOBAL_GROUP_SUFFIX = "-global"
_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


class TierError(ValueError):
    """The rules cannot be split: a rule reads across the tiers the wrong way."""


def _reads(expr: str) -> set[str]:
    without_comments = re.sub(r"#[^\n]*", "", expr)
    without_strings = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', "", without_comments)
    return set(_NAME.findall(without_strings))


def _raw(reads: set[str], recorded: set[str]) -> set[str]:
    """The exporters' series (and ``up``) among the names an expression reads: those no rule records."""
    return {n for n in reads if n.startswith("frexporter_") or n == "up"} - recorded


def exporter_inputs(doc: dict[str, Any]) -> list[str]:
    """Every series family of the exporters (and ``up``) that some rule of ``doc`` reads, sorted."""
    rules = [r for g in doc["groups"] for r in g["rules"]]
    recorded = {r["record"] for r in rules if "record" in r}
    return sorted(set().union(*(_raw(_reads(r["expr"]), recorded) for r in rules)))


def classify(doc: dict[str, Any]) -> dict[str, str]:
    """Each rule's tier, by name (alerts and records), in the file's order.

    Shard: reads an exporter's series (any name that no rule records, such as ``frexporter_rank_up`` or ``up``)
    or a shard-tier record that is not an export, or is an export itself. Global: reads only exports and global
    records.
    """
    rules = [r for g in doc["groups"] for r in g["rules"]]
    recorded = {r["record"] for r in rules if "record" in r}
    tiers: dict[str, str] = {}
    for rule in rules:
        name = rule.get("record") or rule["alert"]
        reads = _reads(rule["expr"])
        raw = _raw(reads, recorded)
        records = reads & recorded
        unknown = [r for r in records if r not in tiers and not EXPORT.match(r)]
        if unknown:
            raise TierError(f"{name} reads {sorted(unknown)} before they are recorded")
        local = {r for r in records if tiers.get(r) == SHARD and not EXPORT.match(r)}
        export = "record" in rule and bool(EXPORT.match(name))
        tier = SHARD if raw or local or export else GLOBAL
        if tier == SHARD and any(tiers.get(r) == GLOBAL for r in records):
            raise TierError(f"{name} is a shard's rule (it reads the exporters' series or is named as an export) "
                            "but reads a global record: it fits no tier")
        tiers[name] = tier
    return tiers


def split(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The shard tier's and the global tier's rule files, each group keeping its rules' order."""
    tiers = classify(doc)
    out: dict[str, dict[str, Any]] = {tier: {"groups": []} for tier in TIERS}
    for group in doc["groups"]:
        for tier in TIERS:
            rules = [r for r in group["rules"] if tiers[r.get("record") or r["alert"]] == tier]
            if rules:
                name = group["name"] + (GLOBAL_GROUP_SUFFIX if tier == GLOBAL else "")
                out[tier]["groups"].append({**{k: v for k, v in group.items() if k != "rules"}, "name": name,
                                            "rules": rules})
    return out


class _BlockDumper(yaml.SafeDumper):
    """Writes multi-line expressions as literal blocks, so the generated files read like the canonical one."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_BlockDumper.add_representer(str, _represent_str)


def dump(doc: dict[str, Any]) -> str:
    """A rule file's text, multi-line expressions as literal blocks (tests/rulefile.py renders scaled rules so too)."""
    return yaml.dump(doc, Dumper=_BlockDumper, sort_keys=False, width=1000)

_HEADER = {
    SHARD: "# frexporter: the shard tier of the rules, for each Prometheus that scrapes part of the nodes.\n"
           "# It pages on per-rank alerts and records the per-(job, PG) exports (level *_shard) that the\n"
           "# global tier federates. Set the external label shard: <a name unique per shard>.\n",
    GLOBAL: "# frexporter: the global tier of the rules, for the Prometheus that federates every shard's\n"
            "# exports (match[] " + " and ".join(FEDERATE_MATCH) + ",\n"
            "# honor_labels: true, honor_timestamps: false).\n"
            "# It pages on the cross-node alerts with the same labels as the single-Prometheus rules.\n",
}


def render(doc: dict[str, Any], tier: str) -> str:
    """One tier's rule file, with a header saying where it comes from."""
    body = dump(split(doc)[tier])
    return (_HEADER[tier] + "# Generated from frexporter.rules.yml by scripts/rule_tiers.py: edit that file, then\n"
            "# run the script (docs/scale.md, \"Tiers\").\n" + body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if a tier file differs; change nothing")
    parser.add_argument("--federate", action="store_true", help="print the global tier's match[] selectors")
    args = parser.parse_args(argv)
    if args.federate:
        print("\n".join(FEDERATE_MATCH))
        return 0
    doc = yaml.safe_load((REPO / RULES_DIR / "frexporter.rules.yml").read_text(encoding="utf-8"))
    try:
        wanted = {tier: render(doc, tier) for tier in TIERS}
    except TierError as e:
        print(f"rule_tiers: {e}", file=sys.stderr)
        return 1
    drifted = []
    for tier, text in wanted.items():
        path = REPO / TIER_FILES[tier]
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            drifted.append(TIER_FILES[tier])
            if not args.check:
                path.write_text(text, encoding="utf-8")
    for path in drifted:
        print(f"rule_tiers: {path} {'differs; run python scripts/rule_tiers.py' if args.check else 'updated'}",
              file=sys.stderr)
    return 1 if args.check and drifted else 0


if __name__ == "__main__":
    sys.exit(main())
