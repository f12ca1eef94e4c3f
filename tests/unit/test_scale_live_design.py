"""benchmarks/scale_live.py --design: a design's groups stand in for the shipped groups of the same name, and
nothing else of the shipped rules changes but the renames the design declares."""

from __future__ import annotations

import yaml

from benchmarks.scale_live import DESIGNS, design_rules
from tests.rulefile import load_rules


def test_the_waits_design_replaces_two_groups_adds_one_and_renames_the_stragglers_rate() -> None:
    path, renames = DESIGNS["waits"]
    shipped = load_rules(1.0)["groups"]
    design = load_rules(1.0, path)["groups"]
    measured = yaml.safe_load(design_rules("waits", 1.0))["groups"]
    assert [g["name"] for g in measured] == [g["name"] for g in shipped] + ["frexporter-dashboards"]
    by_name = {g["name"]: g for g in measured}
    assert [g["name"] for g in design] == ["frexporter-collectives", "frexporter-ranks", "frexporter-dashboards"]
    for group in design:
        assert by_name[group["name"]] == group
    # Every record the shipped rules make is still made (the dashboards read them), once.
    recorded = [r["record"] for g in measured for r in g["rules"] if "record" in r]
    assert len(recorded) == len(set(recorded))
    assert {r["record"] for g in shipped for r in g["rules"] if "record" in r} - set(recorded) <= {
        "job_id_pg_shard:frexporter_pg_last_completed_seq:stuck_next_max",
        "job_id_pg_shard:frexporter_pg_oldest_inflight_age_seconds:min",
        "job_id_pg_shard:frexporter_pg_oldest_inflight_age_seconds:stuck_wait_max",
        "job_id_pg_shard:frexporter_pg_oldest_inflight_age_seconds:wait_max",
        "job_id_pg_shard:frexporter_pg_stuck_threshold_seconds:min",
        "job_id_pg_shard:frexporter_pg_stuck_ceiling_seconds:min",
        "job_id_pg_rank_shard:frexporter_pg_oldest_inflight_age_seconds:bottomk_rank_max",
    }
    exprs = "\n".join(r["expr"] for g in measured for r in g["rules"])
    assert all(old not in exprs for old in renames)
    assert all(new in exprs for new in renames.values())
    # The design reads the waits and none of what it replaces.
    design_exprs = "\n".join(r["expr"] for r in design[0]["rules"])
    assert "frexporter_pg_wait_start_timestamp_seconds" in design_exprs
    for replaced in ("frexporter_pg_last_completed_seq", "frexporter_pg_oldest_inflight_start_timestamp_seconds",
                     "frexporter_pg_stuck_threshold_seconds"):
        assert replaced not in design_exprs
    # The groups it leaves in place are the shipped ones but for the renames.
    for group in shipped:
        if group["name"] not in {g["name"] for g in design}:
            assert len(by_name[group["name"]]["rules"]) == len(group["rules"])


def test_a_design_scales_its_timings_like_the_shipped_rules() -> None:
    fast = yaml.safe_load(design_rules("waits", 0.1))["groups"][0]["rules"]
    slow = yaml.safe_load(design_rules("waits", 1.0))["groups"][0]["rules"]
    def desync_for(rules: list[dict[str, str]]) -> str:
        return next(r for r in rules if r.get("alert") == "FrexporterCollectiveDesync")["for"]

    assert (desync_for(slow), desync_for(fast)) == ("15s", "1500ms")
