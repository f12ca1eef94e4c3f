"""The two rule tiers live: real shard and global Prometheus servers on a simulated fleet (tests/fleet.py).

8 nodes (64 ranks; 2 pipeline stages, so each data-parallel group spans 4 nodes), 2 shards that split the nodes
by ``hashmod`` and a global Prometheus that federates their exports, at 1 s intervals with the rules' timings and the
fleet's thresholds scaled by 0.1 (as tests/promstack.py does for one Prometheus). tests/e2e/test_rule_tiers.py holds
the tiers to promtool's unit tests; here they run as deployed, with scrapes, federation and its delays:

- a desync in a DP group whose culprit sits on the other shard than most of its waiters fires on the global tier
  for exactly that rank and PG, and nothing else fires for the job;
- the single layout fires the same alert, labels and summary as the tiered one, for the same fleet;
- a shard that goes down in a healthy run never makes the global tier name a culprit;
- a shard back from an outage never makes a false desync either: until it has scraped a node again it would evaluate
  the node's last samples from before the outage as current (a rank caught in flight then waits for the whole
  outage); the rules leave out a node last scraped over 45 s ago (scaled), which this test pinned as failing before;
- a straggler is named in its PGs by both layouts, the same alerts: in its data-parallel group, 2 of 4 members on
  each shard, the tiers take the median and MAD over the members the shards send (docs/scale.md).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from frexporter.postmortem import report
from tests.fleet import (
    FEDERATE_JOB,
    JOB_ID,
    SCRAPE_JOB,
    FakeFleet,
    PromLayout,
    PromServer,
    cross_shard_desync,
    desync_alerts,
    ever_alerted,
    layout_factory,
    running,
    shard_name,
    shard_of,
)
from tests.harness import hold, require_tool, wait_for
from tests.rulefile import alert_for

SCALE = 0.1
INTERVAL_S = 1.0
NODES = 8
PP = 2  # 2 pipeline stages of 4 nodes: a DP group has a rank on each of 4 nodes, over both shards
SHARDS = 2
DOWN_SHARD = 1
HINT = "Debian: apt-get install prometheus"
DESYNC = "FrexporterCollectiveDesync"
STALLED = "FrexporterCollectiveStalled"
STRAGGLER = "FrexporterStraggler"
# A rank this late at every collective: its peers lose lag x 6.7 collectives a second (scale 0.1) of their time.
STRAGGLER_LAG_S = 0.3
POLL_S = 0.2
READY_TIMEOUT_S = 45.0  # 3-4 Prometheus starting on two cores, then their first scrape (5 s) and federation
# Past the threshold and "for": a scrape, a shard evaluation, a federation scrape and a global evaluation, and as
# many again on a busy machine.
LAG_S = 8 * INTERVAL_S
HEALTHY_S = 3.0
# A shard down for this long: FrexporterCollectiveDesync's "for" (1.5 s) and FrexporterCollectiveStalled's (3 s)
# many times over, and the fleet's stuck threshold (6 s) three times.
DOWN_S = 20.0


@pytest.fixture(scope="module")
def prometheus() -> str:
    return require_tool("prometheus", HINT)


@dataclass(frozen=True)
class Desynced:
    fleet: FakeFleet
    tiered: PromLayout
    single: PromLayout
    culprit: int
    pg: str

    @property
    def fire_timeout(self) -> float:
        return self.fleet.stuck_threshold_s + alert_for(DESYNC, SCALE) + LAG_S

    @property
    def expected(self) -> dict[str, str]:
        return {"alertname": DESYNC, "job_id": JOB_ID, "pg": self.pg, "pg_desc": "dp", "rank": str(self.culprit),
                "culprit_state": "idle", "severity": "warning"}


@pytest.fixture(scope="module")
def desynced(prometheus: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Desynced]:
    """One fleet under both layouts at once (the same scrapes of the same nodes), hung by a desync once both have
    seen every rank."""
    workdir = tmp_path_factory.mktemp("tiers-live")
    fleet = FakeFleet(NODES, pp=PP, scale=SCALE)
    culprit, pg = cross_shard_desync(fleet.topo, SHARDS)
    with running(fleet, layout_factory("tiered", fleet, workdir / "tiered", SHARDS, INTERVAL_S, SCALE),
                 layout_factory("single", fleet, workdir / "single", SHARDS, INTERVAL_S, SCALE)) as (tiered, single):
        for layout in (tiered, single):
            layout.wait_complete(READY_TIMEOUT_S)
            assert not desync_alerts(layout.alerting), "a desync before the fault"
        fleet.desync(culprit, pg)
        yield Desynced(fleet, tiered, single, culprit, pg)


def _firing(server: PromServer) -> list[dict[str, Any]]:
    """The desync alerts of the job, once one fires (an AssertionError before: wait_for polls again)."""
    alerts = desync_alerts(server)
    assert any(a["state"] == "firing" for a in alerts), alerts
    return alerts


def _rule_errors(server: PromServer) -> list[str]:
    """Every rule whose last evaluation failed: a rule that errors fires nothing, which no alert check can tell
    from a rule that rightly stays quiet."""
    return [f"{g['name']}/{r['name']}: {r.get('lastError')}" for g in server.rule_groups() for r in g["rules"]
            if r.get("health") == "err"]


def _only_the_desync(layout: PromLayout, expected: dict[str, str]) -> None:
    found = [(server.name, a["labels"], a["state"]) for server in layout.servers for a in server.alerts(job_id=JOB_ID)]
    assert found == [(layout.alerting.name, expected, "firing")], found
    assert not [a for server in layout.servers for a in server.alerts(alertname=STALLED)]


def test_global_tier_names_the_culprit_of_a_desync_across_shards(desynced: Desynced) -> None:
    tiered = desynced.tiered
    alerts = wait_for(lambda: _firing(tiered.alerting), timeout=desynced.fire_timeout, interval=POLL_S,
                      what=f"{DESYNC} firing on the global tier")
    assert [a["labels"] for a in alerts] == [desynced.expected], alerts
    # The premise: most waiters on the other shard; and as the global saw it, the culprit's candidate record came
    # from its shard and waits from the other (Prometheus' hashmod agrees with shard_of's).
    topo = desynced.fleet.topo
    home = shard_name(shard_of(topo.node_of(desynced.culprit), SHARDS))
    waiters = [m for m in topo.members(desynced.pg) if m != desynced.culprit]
    assert 2 * sum(shard_name(shard_of(topo.node_of(w), SHARDS)) == home for w in waiters) < len(waiters)
    candidate = tiered.alerting.query(f'job_id_pg_rank_shard:frexporter_pg_idle_seq:bottomk'
                                      f'{{pg="{desynced.pg}",rank="{desynced.culprit}"}}')
    assert [s["metric"]["shard"] for s in candidate] == [home], candidate
    waits = tiered.alerting.query(f'job_id_pg_shard:frexporter_pg_wait_age_seconds:stuck_max'
                                  f'{{pg="{desynced.pg}"}}')
    assert {s["metric"]["shard"] for s in waits} - {home}, waits
    # Nothing else for the job on any tier, FrexporterCollectiveStalled least of all, for as long as its "for".
    hold(lambda: _only_the_desync(tiered, desynced.expected), seconds=alert_for(STALLED, SCALE) + 2 * INTERVAL_S,
         interval=POLL_S)
    for server in tiered.servers:
        assert not _rule_errors(server), server.name


def test_single_and_tiered_layouts_name_the_same_desync(desynced: Desynced) -> None:
    def both() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        return _firing(desynced.single.alerting), _firing(desynced.tiered.alerting)

    single, tiered = wait_for(both, timeout=desynced.fire_timeout, interval=POLL_S, what=f"{DESYNC} on both layouts")
    assert [a["labels"] for a in single] == [a["labels"] for a in tiered] == [desynced.expected]
    assert [a["annotations"]["summary"] for a in single] == [a["annotations"]["summary"] for a in tiered]
    assert not _rule_errors(desynced.single.alerting)


def _no_desync(server: PromServer) -> None:
    found = desync_alerts(server)
    assert not found, [(a["labels"]["rank"], a["labels"]["pg"], a["state"]) for a in found]


def _shard_gone(server: PromServer, shard: PromServer) -> bool:
    """Whether the global has noticed the shard is down: its federation target down, its exports gone."""
    address = shard.url.split("//", 1)[1]
    up = server.value(f'up{{job="{FEDERATE_JOB}",instance="{address}"}}')
    exports = server.value(f'count({{__name__=~".+_shard:.+",shard="{shard.name}"}})')
    assert (up, exports) == (0.0, None), (up, exports)
    return True


@contextmanager
def _healthy_tiers(workdir: Path) -> Iterator[tuple[FakeFleet, PromLayout]]:
    """A healthy fleet under the tiered layout, once the global tier has seen every rank."""
    fleet = FakeFleet(NODES, pp=PP, scale=SCALE)
    with running(fleet, layout_factory("tiered", fleet, workdir, SHARDS, INTERVAL_S, SCALE)) as (tiered,):
        tiered.wait_complete(READY_TIMEOUT_S)
        yield fleet, tiered


def test_a_shard_down_never_makes_a_false_desync(prometheus: str, tmp_path: Path) -> None:
    with _healthy_tiers(tmp_path) as (_, tiered):
        top = tiered.alerting
        started = time.time()
        hold(lambda: _no_desync(top), HEALTHY_S, interval=POLL_S)
        tiered.stop_shard(DOWN_SHARD)
        wait_for(lambda: _shard_gone(top, tiered.shards[DOWN_SHARD]), timeout=LAG_S, interval=POLL_S,
                 what="the global to notice the shard is down")
        hold(lambda: _no_desync(top), DOWN_S, interval=POLL_S)
        # And between the polls: every evaluation's ALERTS since the start.
        assert ever_alerted(top, DESYNC, started) == []
        assert not _rule_errors(top)


def _scraped_since(server: PromServer, since: float) -> bool:
    """Whether the server has scraped every one of its nodes after unix time ``since`` (each node's poll time is the
    time of the request)."""
    oldest = server.value(f'min(frexporter_poll_timestamp_seconds{{job="{SCRAPE_JOB}"}})')
    assert oldest is not None and oldest > since, oldest
    return True


def test_a_shard_back_from_an_outage_never_makes_a_false_desync(prometheus: str, tmp_path: Path) -> None:
    with _healthy_tiers(tmp_path) as (fleet, tiered):
        top, down = tiered.alerting, tiered.shards[DOWN_SHARD]
        parities = {node % 2 for node in tiered.nodes_of(down)}
        assert parities == {0, 1}, "the shard must hold nodes on both sides of the skew"
        started = time.time()
        # The shard's last samples before its outage: nodes one collective apart, as scrapes at different instants
        # of a healthy job see them (held until the shard has scraped every node so).
        skew = fleet.skew()
        wait_for(lambda: _scraped_since(down, skew.at), timeout=LAG_S, interval=POLL_S, what="the skew scraped")
        tiered.stop_shard(DOWN_SHARD)
        fleet.heal()
        # Down for longer than the stuck threshold: its last in-flight samples are that old on its return.
        hold(lambda: _no_desync(top), 2 * fleet.stuck_threshold_s, interval=POLL_S)
        tiered.start_shard(DOWN_SHARD)
        hold(lambda: _no_desync(top), alert_for(DESYNC, SCALE) + LAG_S, interval=POLL_S)
        assert ever_alerted(top, DESYNC, started) == []


def _stragglers(server: PromServer) -> dict[tuple[str, str], dict[str, str]]:
    """The firing FrexporterStraggler alerts of the job by (rank, PG): their labels."""
    return {(a["labels"]["rank"], a["labels"]["pg"]): a["labels"]
            for a in server.alerts(alertname=STRAGGLER, job_id=JOB_ID) if a["state"] == "firing"}


def test_a_straggler_is_named_alike_by_both_layouts(prometheus: str, tmp_path: Path) -> None:
    fleet = FakeFleet(NODES, pp=PP, scale=SCALE)
    topo = fleet.topo
    # A rank whose DP group spans both shards with most of its peers on the other one (as the desync's culprit
    # above): its own shard's median of that group is near its own wait, where the tiers' bounds are widest.
    slow, _ = cross_shard_desync(topo, SHARDS)
    # Its PGs of 3 ranks or more, which the alert judges: WORLD, its TP group (one node: one shard) and its DP group.
    judged = {pg.name: pg.desc for pg in topo.pgs(slow) if len(topo.members(pg.name)) >= 3}
    assert sorted(judged.values()) == ["default_pg", "dp", "tp"], judged
    with running(fleet, layout_factory("tiered", fleet, tmp_path / "tiered", SHARDS, INTERVAL_S, SCALE),
                 layout_factory("single", fleet, tmp_path / "single", SHARDS, INTERVAL_S, SCALE)) as (tiered, single):
        for layout in (tiered, single):
            layout.wait_complete(READY_TIMEOUT_S)
        started = time.time()
        fleet.straggle(slow, STRAGGLER_LAG_S)
        expected = {(str(slow), pg) for pg in judged}

        def named() -> tuple[dict[tuple[str, str], dict[str, str]], dict[tuple[str, str], dict[str, str]]]:
            one, tiers = _stragglers(single.alerting), _stragglers(tiered.alerting)
            assert set(one) == expected, sorted(one)
            assert set(tiers) == expected, sorted(tiers)
            return one, tiers

        # The rate of collectives the loss ratio needs (two evaluations of the PG's seq), "for", federation.
        one, tiers = wait_for(named, timeout=alert_for(STRAGGLER, SCALE) + 3 * LAG_S, interval=POLL_S,
                              what=f"{STRAGGLER} for rank {slow} on both layouts")
        # The same alerts, labels and all.
        assert tiers == one, (tiers, one)
        for layout in (single, tiered):
            assert {a.get("rank") for a in ever_alerted(layout.alerting, STRAGGLER, started)} == {str(slow)}
            assert not [e for server in layout.servers for e in _rule_errors(server)]
        # `frexporter analyze` over every shard ranks it in the same PGs: the ranks' own series, one median over all.
        found = report.from_prometheus([shard.url for shard in tiered.shards], JOB_ID)
        stragglers = {(str(w.rank), w.pg) for w in found.stragglers if w.straggler}
        assert stragglers == expected, sorted(stragglers)
