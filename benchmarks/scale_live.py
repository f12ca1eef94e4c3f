"""The shipped rules at scale, live: real Prometheus servers scraping a simulated fleet, in either rule layout.

benchmarks/scale.py times each rule as a query on backfilled blocks; this one runs the deployment as it would run:
tests/fleet.py serves N nodes (8 ranks each, 4 PGs per rank: WORLD, the node's tensor-parallel group, a pipeline
and a data-parallel group) from one real node's /metrics, and ``--layout single`` (one Prometheus, the canonical
rules) or ``--layout tiered`` (``--shards`` K shard Prometheus splitting the nodes by hashmod with the shard tier,
one global Prometheus federating them with the global tier) scrapes and evaluates it at the shipped 15 s intervals
and timings (``--interval``, ``--scale`` change them).

1. Healthy: until every rule group of every Prometheus has evaluated ``--rounds`` rounds after one warm-up round.
   Reported per Prometheus: head series, RSS, CPU per round, and each group's evaluation time per round (its own
   ``evaluationTime`` in /api/v1/rules, mean and max over those rounds) and missed iterations; and its heaviest
   rules by their own ``evaluationTime`` (the rules of a group run one after another, so they add up to it).
2. ``--alone`` (tiered): the same, for each Prometheus in turn while the others' rules are paused (reloaded with a
   1-day evaluation interval; they keep scraping and federating, and the global federates the shards' last
   exports, so its input keeps its size): the shards share this machine's cores, so each tier's rule time is
   reported measured alone as well as together.
   ``--floor``: the same, for each Prometheus that scrapes the ranks, with its rules replaced by one group that
   reads once each series family the rules read (``count(name)``): the least any rules that alert on those series
   can read in a round, whatever their joins. Then its own rules are back for the steps below.
3. A desync in a data-parallel group whose culprit is on another shard than most of its waiters: until
   FrexporterCollectiveDesync fires on the tier that fires it (the single or the global Prometheus) or a deadline
   passes. Checked: it names exactly the culprit rank and PG, and no desync was pending or firing before the fault.

4. ``frexporter analyze --prometheus`` (in process and as the CLI) over the servers that hold the ranks' series:
   the one Prometheus, or every shard (``--prometheus`` repeated); timed while their rules run and again with
   every rule paused. Checked: it names exactly the culprit. ``--analyze-only`` pauses every rule from the start
   and runs only the desync and this step: for a size whose rule rounds overrun this machine.

The fleet server is one Python thread of this process; its CPU per round is reported so that the reader sees
what the simulation costs next to Prometheus. Everything runs on this machine's CPUs, which the report states.

``--quiet pp``: the pipeline groups run no collective (they only send and receive, as on a real pipeline), so
their ranks are idle all along and every node writes them as idle ranks (``frexporter_pg_idle_seq``), the
desync candidates' cost in a job that has such PGs; the default job runs collectives in every PG and writes none.

Run: ``python -m benchmarks.scale_live --nodes 16 --layout tiered --shards 2 --rounds 2`` (a few minutes);
``--json`` for the numbers. Exit status 1 when the alert or the analysis was wrong, missing, or a rule failed to
evaluate.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks.scale import real_exposition, time_analyze
from frexporter.defaults import WAIT_REPORT_SHARE
from scripts.rule_tiers import exporter_inputs
from tests.fleet import (
    JOB_ID,
    RANKS_PER_NODE,
    FakeFleet,
    PromLayout,
    PromServer,
    cross_shard_desync,
    ever_alerted,
    layout_factory,
    prometheus_binary,
    running,
    shard_of,
)
from tests.promstack import parse_rfc3339
from tests.rulefile import alert_for, load_rules

DESYNC = "FrexporterCollectiveDesync"
HEAVIEST_RULES = 12  # the rules each Prometheus reports by their own evaluationTime
HUNG_HEAVIEST_RULES = 4  # the same during the hang, which the waits and idle ranks make costlier
WARMUP_ROUNDS = 1  # the first evaluation after a start or a reload: cold caches, or overlapping a paused group
PAUSED_INTERVAL = "1d"  # a group's next evaluation lands a day away (its offset in the interval): paused
FLOOR_GROUP = "floor"


# ---------------------------------------------------------------------------------------- watching the rules


@dataclass
class Watcher:
    """Polls every Prometheus of a layout: each rule group's evaluations (lastEvaluation -> evaluationTime, so a
    poll at least every third of an interval misses none), rule errors, and desync alerts on the alerting tier."""

    layout: PromLayout
    poll_s: float
    evaluations: dict[tuple[str, str], dict[float, float]] = field(default_factory=dict)
    rule_evaluations: dict[tuple[str, str], dict[float, float]] = field(default_factory=dict)  # (server, rule)
    errors: dict[str, str] = field(default_factory=dict)
    desyncs: dict[tuple[str, str, str], float] = field(default_factory=dict)  # (rank, pg, state) -> first seen

    def poll(self) -> None:
        for server in self.layout.servers:
            if server.running:
                self._poll_rules(server)
        for alert in self.layout.alerting.alerts(alertname=DESYNC, job_id=JOB_ID):
            key = (alert["labels"].get("rank", ""), alert["labels"].get("pg", ""), alert["state"])
            self.desyncs.setdefault(key, time.time())

    def _poll_rules(self, server: PromServer) -> None:
        for group in server.rule_groups():
            last = group.get("lastEvaluation") or ""
            if last and not last.startswith("0001"):  # Go's zero time: not evaluated yet
                self.evaluations.setdefault((server.name, group["name"]), {})[parse_rfc3339(last)] = float(
                    group["evaluationTime"])
            for rule in group["rules"]:
                when = rule.get("lastEvaluation") or ""
                if when and not when.startswith("0001"):
                    self.rule_evaluations.setdefault((server.name, f"{group['name']}/{rule['name']}"), {})[
                        parse_rfc3339(when)] = float(rule.get("evaluationTime", 0.0))
                if rule.get("health") == "err":
                    self.errors[f"{server.name}/{group['name']}/{rule['name']}"] = rule.get("lastError", "")

    def rounds(self, server: str, since: float, until: float = float("inf")) -> dict[str, list[float]]:
        """Per group of ``server``, the evaluation times (s) of its evaluations in (since, until], in order."""
        out: dict[str, list[float]] = {}
        for (name, group), evals in sorted(self.evaluations.items()):
            if name == server:
                out[group] = [evals[t] for t in sorted(evals) if since < t <= until]
        return out

    def heaviest_rules(self, server: str, since: float, until: float, top: int) -> dict[str, dict[str, Any]]:
        """The ``top`` rules of ``server`` by mean evaluation time over their evaluations in (since, until]."""
        stats = {rule: _stats([evals[t] for t in sorted(evals) if since < t <= until])
                 for (name, rule), evals in self.rule_evaluations.items() if name == server}
        ranked = sorted((r for r in stats.items() if r[1]["mean_ms"] is not None), key=lambda r: -r[1]["mean_ms"])
        return dict(ranked[:top])

    def until(self, done: Callable[[], bool], deadline: float) -> bool:
        """Polls until ``done()`` or the deadline (monotonic); whether it was done."""
        while True:
            self.poll()
            if done():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(self.poll_s)


def _enough(watcher: Watcher, servers: list[PromServer], since: float, rounds: int) -> Callable[[], bool]:
    def done() -> bool:
        for server in servers:
            groups = watcher.rounds(server.name, since)
            if not groups or any(len(v) < WARMUP_ROUNDS + rounds for v in groups.values()):
                return False
        return True

    return done


def _stats(evals: list[float]) -> dict[str, Any]:
    kept = evals[WARMUP_ROUNDS:]
    if not kept:
        return {"rounds": 0, "mean_ms": None, "max_ms": None}
    return {"rounds": len(kept), "mean_ms": round(statistics.mean(kept) * 1e3, 1), "max_ms": round(max(kept) * 1e3, 1)}


def _fault_stats(evals: list[float]) -> dict[str, Any]:
    """_stats of a fault's rounds: every one counts (no warm-up: the rules have run all along)."""
    if not evals:
        return {"rounds": 0, "mean_ms": None, "max_ms": None}
    return {"rounds": len(evals), "mean_ms": round(statistics.mean(evals) * 1e3, 1),
            "max_ms": round(max(evals) * 1e3, 1)}


# ---------------------------------------------------------------------------------------- phases


@dataclass
class Costs:
    """CPU of every process over a phase."""

    started: float
    fleet_cpu: float
    fleet_requests: int
    server_cpu: dict[str, float]

    @classmethod
    def now(cls, fleet: FakeFleet, layout: PromLayout) -> Costs:
        return cls(time.time(), fleet.cpu_seconds(), fleet.requests, {s.name: s.cpu_seconds() for s in layout.servers})


def together(watcher: Watcher, fleet: FakeFleet, interval: float, rounds: int, timeout: float) -> dict[str, Any]:
    layout = watcher.layout
    start = Costs.now(fleet, layout)
    complete = watcher.until(_enough(watcher, layout.servers, start.started, rounds), time.monotonic() + timeout)
    end = Costs.now(fleet, layout)
    per_round = interval / max(end.started - start.started, 1e-9)  # a phase's CPU seconds times this: per round
    missed = {s.name: s.iterations_missed() for s in layout.servers}
    servers = {}
    for s in layout.servers:
        groups = watcher.rounds(s.name, start.started, end.started)
        intervals = {g["name"]: float(g.get("interval") or interval) for g in s.rule_groups()}
        stats = {g: _stats(v) for g, v in groups.items()}
        # Every group's time per `interval`: a group of a longer interval (the dashboards' minute) by its share.
        all_groups = sum(v["mean_ms"] * interval / intervals.get(g, interval) for g, v in stats.items()
                         if v["mean_ms"] is not None)
        servers[s.name] = {
            "all_groups_ms_per_round": round(all_groups, 1),
            "targets": len(layout.nodes_of(s)) if s is not layout.global_ else len(layout.shards),
            "head_series": s.head_series(), "rss_mb": round(s.rss_mb(), 1),
            "cpu_s_per_round": round((end.server_cpu[s.name] - start.server_cpu[s.name]) * per_round, 3),
            "groups": {g: {**stats[g], "iterations_missed": missed[s.name].get(g, 0.0)} for g in groups},
            "heaviest_rules": watcher.heaviest_rules(s.name, start.started, end.started, HEAVIEST_RULES),
        }
    requests = end.fleet_requests - start.fleet_requests
    fleet_cpu = end.fleet_cpu - start.fleet_cpu
    return {
        "complete": complete, "wall_s": round(end.started - start.started, 1), "servers": servers,
        "fleet": {"cpu_s_per_round": round(fleet_cpu * per_round, 3),
                  "scrapes_per_round": round(requests * per_round, 1),
                  "cpu_ms_per_scrape": round(fleet_cpu / requests * 1e3, 2) if requests else None},
    }


def alone(watcher: Watcher, interval: float, rounds: int, timeout: float) -> dict[str, Any]:
    """Each Prometheus' rule groups with every other's rules paused, in turn."""
    layout = watcher.layout
    out: dict[str, Any] = {}
    for server in layout.servers:
        others = [s for s in layout.servers if s is not server]
        for other in others:
            other.reload(PAUSED_INTERVAL)
        since = time.time()
        try:
            complete = watcher.until(_enough(watcher, [server], since, rounds), time.monotonic() + timeout)
            until = time.time()
            # Whether a paused group evaluated anyway (its offset in the day fell in the window): said, not hidden.
            leaked = sorted(f"{o.name}/{g}" for o in others for g, v in watcher.rounds(o.name, since, until).items()
                            if v)
            out[server.name] = {"complete": complete, "others_evaluated": leaked,
                                "groups": {g: _stats(v) for g, v in watcher.rounds(server.name, since, until).items()}}
        finally:
            for other in others:
                other.reload()
    return out


def floor_rules(families: list[str]) -> str:
    """One rule group that reads each of ``families`` (those the rules read: ``exporter_inputs``) once, with
    ``count``: less than any rules that alert on those series can read in a round, whatever their joins."""
    rules = [{"record": f"floor:{name}:count", "expr": f"count({name})"} for name in families]
    return yaml.safe_dump({"groups": [{"name": FLOOR_GROUP, "rules": rules}]}, sort_keys=False)


def floor(watcher: Watcher, server: PromServer, scale: float, rounds: int, timeout: float) -> dict[str, Any]:
    """The floor group (``floor_rules``) in place of ``server``'s rules for ``rounds`` rounds, then its own back."""
    shipped = server.rules_path.read_text(encoding="utf-8")
    families = exporter_inputs(load_rules(scale))
    server.rules_path.write_text(floor_rules(families), encoding="utf-8")
    server.reload()
    since = time.time()
    try:
        complete = watcher.until(
            lambda: len(watcher.rounds(server.name, since).get(FLOOR_GROUP, [])) >= WARMUP_ROUNDS + rounds,
            time.monotonic() + timeout)
        until = time.time()
        return {"complete": complete, "families": len(families),
                "round": _stats(watcher.rounds(server.name, since, until).get(FLOOR_GROUP, [])),
                "reads": watcher.heaviest_rules(server.name, since, until, len(families))}
    finally:
        server.rules_path.write_text(shipped, encoding="utf-8")
        server.reload()


def desync(watcher: Watcher, fleet: FakeFleet, culprit: int, pg: str, since: float, timeout: float) -> dict[str, Any]:
    """Injects the fault and waits for the alert; ``since``: when the layout started (ALERTS before the fault since
    then are false desyncs, including any between two polls)."""
    layout = watcher.layout
    watcher.poll()
    before = sorted({f"{a.get('rank')}/{a.get('pg')}/{a.get('alertstate')}"
                     for a in ever_alerted(layout.alerting, DESYNC, since)}
                    | {f"{rank}/{p}/{state}" for rank, p, state in watcher.desyncs})
    fault = fleet.desync(culprit, pg)
    fired = watcher.until(lambda: any(state == "firing" for (_, _, state) in watcher.desyncs),
                          time.monotonic() + timeout)
    # The rounds of the hang, once the exporters write its waits and idle ranks (a hang's idle ranks are every
    # stopped rank's, a few per node and PG, where a healthy job has none): what the rules cost while it lasts.
    hung = fault.at + WAIT_REPORT_SHARE * fleet.stuck_threshold_s
    now = time.time()
    during = {s.name: {g: _fault_stats(v) for g, v in watcher.rounds(s.name, hung, now).items()}
              for s in layout.servers}
    during_rules = {s.name: watcher.heaviest_rules(s.name, hung, now, HUNG_HEAVIEST_RULES) for s in layout.servers}
    seen = {f"{rank}/{p}/{state}": round(t - fault.at, 1) for (rank, p, state), t in watcher.desyncs.items()
            if t >= fault.at}
    after = ever_alerted(layout.alerting, DESYNC, fault.at)
    named = sorted({(a.get("rank", ""), a.get("pg", "")) for a in after if a.get("job_id") == JOB_ID})
    home = shard_of(fleet.topo.node_of(culprit), len(layout.shards)) if layout.shards else None
    waiters = [m for m in fleet.topo.members(pg) if m != culprit]
    return {
        "culprit": culprit, "pg": pg, "culprit_node": fleet.topo.node_of(culprit), "culprit_shard": home,
        "waiters": len(waiters),
        "waiters_on_culprit_shard": sum(shard_of(fleet.topo.node_of(w), len(layout.shards)) == home
                                        for w in waiters) if layout.shards else None,
        "tier": layout.alerting.name, "fired": fired, "first_seen_s": seen, "named": named, "hung_rounds": during,
        "hung_heaviest_rules": during_rules,
        "correct": fired and named == [(str(culprit), pg)],
        "false_before_fault": before,
    }


# ---------------------------------------------------------------------------------------- the run


def _raw_servers(layout: PromLayout) -> list[PromServer]:
    """The servers that hold the ranks' own series: the shards, or the one Prometheus."""
    return layout.shards or [layout.alerting]


def _holds_every_rank(layout: PromLayout) -> Callable[[], bool]:
    """Whether the servers that hold the ranks' series hold every rank of the fleet now (a scrape that failed
    marks its node's series stale until the next one succeeds)."""
    raw = _raw_servers(layout)

    def every_rank() -> bool:
        held = sum(s.value(f'count(frexporter_rank_up{{job_id="{JOB_ID}"}})') or 0 for s in raw)
        return held == layout.fleet.topo.world

    return every_rank


def analyze(layout: PromLayout, culprit: int, pg: str, busy: bool = True, timeout: float = 600.0) -> dict[str, Any]:
    """``frexporter analyze --prometheus`` over the servers that hold the ranks' series, while their rules run
    (``busy``) and with every rule paused (as on servers of its own). The in-process analysis holds this process'
    GIL, which the fleet's thread needs to answer scrapes: before the second, the servers hold every rank again."""
    urls = [s.url for s in _raw_servers(layout)]
    expected = [("missing_rank", pg, [culprit])]
    out: dict[str, Any] = {"servers": len(urls)}
    if busy:
        out["busy"] = time_analyze(urls, JOB_ID, expected)
    for server in layout.servers:
        server.reload(PAUSED_INTERVAL)
    try:
        waited = time.monotonic()
        Watcher(layout, poll_s=2.0).until(_holds_every_rank(layout), time.monotonic() + timeout)
        out["rules_paused_wait_s"] = round(time.monotonic() - waited, 1)
        out["rules_paused"] = time_analyze(urls, JOB_ID, expected)
    finally:
        for server in layout.servers:
            server.reload()
    return out


def analyze_only(layout: PromLayout, fleet: FakeFleet, culprit: int, pg: str, interval: float,
                 timeout: float, cascade: bool = False) -> dict[str, Any]:
    """Only the analysis, with every rule paused from the start (a size whose rules overrun this machine): once
    the servers hold every rank, the desync, then the analysis once its waiters have waited the stuck threshold
    and been scraped so."""
    for server in layout.servers:
        server.reload(PAUSED_INTERVAL)
    watcher = Watcher(layout, poll_s=min(2.0, interval / 4))
    if not watcher.until(_holds_every_rank(layout), time.monotonic() + timeout):
        raise RuntimeError(f"the servers never held all {fleet.topo.world} ranks")
    fault = fleet.desync(culprit, pg, cascade)
    waited = fault.at + fleet.stuck_threshold_s + 2 * interval
    watcher.until(lambda: time.time() > waited, time.monotonic() + fleet.stuck_threshold_s + 3 * interval)
    return analyze(layout, culprit, pg, busy=False)


def prometheus_version() -> str:
    out = subprocess.run([prometheus_binary(), "--version"], capture_output=True, text=True, timeout=30, check=False)
    return (out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else "unknown"


def run(args: argparse.Namespace) -> dict[str, Any]:
    shards = args.shards if args.layout == "tiered" else 0
    workdir = Path(tempfile.mkdtemp(prefix="frexporter-scale-live-"))
    t0 = time.monotonic()
    template = real_exposition()
    fleet = FakeFleet(args.nodes, pp=args.pp, scale=args.scale, template=template, quiet=args.quiet)
    culprit, pg = cross_shard_desync(fleet.topo, max(args.shards, 1))
    report: dict[str, Any] = {
        "nodes": args.nodes, "ranks": fleet.topo.world, "pp": fleet.topo.pp, "dp": fleet.topo.replicas,
        "layout": args.layout, "shards": shards, "interval_s": args.interval, "scale": args.scale,
        "rounds": args.rounds, "cpus": os.cpu_count(), "cpu_affinity": len(os.sched_getaffinity(0)),
        "prometheus": prometheus_version(), "fleet_setup_s": round(time.monotonic() - t0, 1),
        "stuck_threshold_s": fleet.stuck_threshold_s, "quiet": sorted(args.quiet),
    }
    round_timeout = (WARMUP_ROUNDS + args.rounds + 4) * args.interval * 3 + 120
    make = layout_factory(args.layout, fleet, workdir, max(args.shards, 1), args.interval, args.scale)
    try:
        started = time.time()
        with running(fleet, make) as (layout,):
            if args.analyze_only:
                report["analyze"] = analyze_only(layout, fleet, culprit, pg, args.interval, round_timeout,
                                                 args.cascade)
                return report
            watcher = Watcher(layout, poll_s=min(2.0, args.interval / 4))
            t1 = time.monotonic()
            if not watcher.until(layout.complete, time.monotonic() + round_timeout):
                raise RuntimeError(f"the {args.layout} layout never saw all {fleet.topo.world} ranks")
            report["ready_s"] = round(time.monotonic() - t1, 1)
            report["together"] = together(watcher, fleet, args.interval, args.rounds, round_timeout)
            if args.alone and len(layout.servers) > 1:  # one Prometheus: alone is together
                report["alone"] = alone(watcher, args.interval, args.rounds, round_timeout)
            if args.floor:
                report["floor"] = {s.name: floor(watcher, s, args.scale, args.rounds, round_timeout)
                                   for s in _raw_servers(layout)}
            # The threshold, the alert's "for", then scrapes, evaluations and federation: 10 intervals.
            timeout = args.desync_timeout or (fleet.stuck_threshold_s + alert_for(DESYNC, args.scale)
                                              + 10 * args.interval)
            report["desync"] = desync(watcher, fleet, culprit, pg, started, timeout)
            report["analyze"] = analyze(layout, culprit, pg)
            report["rule_errors"] = watcher.errors
    finally:
        if args.keep:
            report["workdir"] = str(workdir)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return report


# ---------------------------------------------------------------------------------------- report


def _ms(stats: dict[str, Any] | None) -> str:
    if not stats or stats.get("mean_ms") is None:
        return "-"
    return f"{stats['mean_ms']:.1f} / {stats['max_ms']:.1f} ({stats['rounds']})"


def print_report(r: dict[str, Any]) -> None:
    tiers = f"{r['shards']} shards + global" if r["layout"] == "tiered" else "one Prometheus"
    print(f"Live: {r['nodes']} nodes x {RANKS_PER_NODE} ranks = {r['ranks']} ranks, 4 PGs per rank (WORLD, TP 8, "
          f"PP {r['pp']} stages, DP {r['dp']}); layout {r['layout']} ({tiers})")
    if r.get("quiet"):
        print(f"Quiet PG kinds (no collective, their ranks idle in every state): {', '.join(r['quiet'])}")
    print(f"Measured on this machine: {r['cpus']} CPUs ({r['cpu_affinity']} usable), {r['prometheus']}; scrape and "
          f"evaluation every {r['interval_s']:g} s, rules and fleet thresholds at scale {r['scale']:g} (stuck "
          f"threshold {r['stuck_threshold_s']:g} s). Every Prometheus and the fleet server share these CPUs.")
    if "together" in r:
        _print_rules(r)
    a = r["analyze"]
    print(f"\n  frexporter analyze --prometheus over {a['servers']} server(s) holding the ranks' series:")
    paused = "their rules paused" + (f" (once they held every rank again, {a['rules_paused_wait_s']:g} s later)"
                                     if "rules_paused_wait_s" in a else "")
    for when, label in (("busy", "their rules running"), ("rules_paused", paused)):
        if when in a:
            t = a[when]
            print(f"    {label}: {t['cli_s']:.2f} s as a CLI, {t['in_process_s']:.2f} s in process; {t['ranks_seen']} "
                  f"ranks, {t['pgs_read']} active PGs read, {t['pgs_idle']} idle; reading every PG: "
                  f"{t['every_pg_s']:.2f} s in process; verdicts {t['verdicts']} -> "
                  f"{'culprit named' if t['correct'] else 'WRONG'}")
    if r.get("rule_errors"):
        print(f"  RULE ERRORS: {r['rule_errors']}")


def _print_rules(r: dict[str, Any]) -> None:
    print("Rule time: each group's own evaluationTime (/api/v1/rules) per round, mean / max (rounds) after "
          f"{WARMUP_ROUNDS} warm-up round; the groups of one Prometheus run concurrently.")
    t = r["together"]
    if not t["complete"]:
        print("  NOTE: not every group reached the rounds asked for before the deadline (see rounds)")
    alone_r = r.get("alone", {})
    print(f"\n  {'Prometheus':<10} {'targets':>7} {'head series':>11} {'RSS MB':>7} {'CPU s/round':>11}  "
          f"{'rule group':<30} {'together ms':>22} {'alone ms':>22} {'missed':>6}")
    for name, s in t["servers"].items():
        first = True
        for group, g in s["groups"].items():
            head = (f"{name:<10} {s['targets']:>7} {s['head_series']:>11,} {s['rss_mb']:>7.1f} "
                    f"{s['cpu_s_per_round']:>11.3f}") if first else " " * 50
            solo = alone_r.get(name, {}).get("groups", {}).get(group)
            print(f"  {head}  {group:<30} {_ms(g):>22} {_ms(solo):>22} {g['iterations_missed']:>6.0f}")
            first = False
    for name, s in t["servers"].items():
        if "all_groups_ms_per_round" in s:
            print(f"  {name}: all groups {s['all_groups_ms_per_round']:.0f} ms per {r['interval_s']:g} s round "
                  f"(a group of a longer interval counted by its share of it)")
    for name, s in t["servers"].items():
        heavy = s.get("heaviest_rules") or {}
        if heavy:
            print(f"\n  {name}: its {len(heavy)} heaviest rules, mean / max ms per evaluation (rounds):")
            for rule, stats in heavy.items():
                print(f"    {_ms(stats):>22}  {rule}")
    for name, fl in r.get("floor", {}).items():
        print(f"\n  {name}, floor: one group reading each of the {fl['families']} series families the rules read, "
              f"once, with count: {_ms(fl['round'])} ms per round" + ("" if fl["complete"] else " (INCOMPLETE)"))
        for rule, stats in fl["reads"].items():
            print(f"    {_ms(stats):>22}  {rule}")
    for name, a in alone_r.items():
        if a["others_evaluated"]:
            print(f"  NOTE: while {name} ran alone, paused groups evaluated anyway: {', '.join(a['others_evaluated'])}")
    if alone_r:
        print("  alone: the other Prometheus' rules paused (1-day interval); they still scrape and federate.")
    f = t["fleet"]
    print(f"\n  Fleet server (one Python thread, the simulation's own cost): {f['cpu_s_per_round']:.3f} CPU s per "
          f"round, {f['scrapes_per_round']:g} scrapes per round, {f['cpu_ms_per_scrape']} ms per scrape")
    d = r["desync"]
    where = f", shard {d['culprit_shard']} ({d['waiters_on_culprit_shard']} of its {d['waiters']} waiters there)" \
        if d["culprit_shard"] is not None else f" ({d['waiters']} waiters)"
    print(f"\n  Desync: culprit rank {d['culprit']} on node {d['culprit_node']}{where}, PG {d['pg']}; "
          f"on {d['tier']}: " + ("fired" if d["fired"] else "DID NOT FIRE before the deadline"))
    print(f"    first seen (s after the fault): {d['first_seen_s'] or 'nothing'}")
    print(f"    named {d['named']} -> {'exactly the culprit' if d['correct'] else 'WRONG'}; desyncs before the "
          f"fault: {d['false_before_fault'] or 'none'}")
    for name, groups in d.get("hung_rounds", {}).items():
        print(f"    {name} while hung (waits and idle ranks written), ms mean / max (rounds): "
              + ", ".join(f"{g} {_ms(v)}" for g, v in groups.items()))
    for name, heavy in d.get("hung_heaviest_rules", {}).items():
        print(f"    {name} while hung, its {len(heavy)} heaviest rules, mean / max ms per evaluation (rounds): "
              + ", ".join(f"{rule} {_ms(stats)}" for rule, stats in heavy.items()))


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulated fleet's size, the rounds measured, the intervals and --json (also benchmarks/scale_vm.py)."""
    parser.add_argument("--nodes", type=int, default=16, help=f"nodes of {RANKS_PER_NODE} ranks (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=4, help=f"rule rounds measured after {WARMUP_ROUNDS} warm-up")
    parser.add_argument("--interval", type=float, default=15.0, help="scrape and evaluation interval, seconds")
    parser.add_argument("--json", action="store_true", help="the numbers as JSON")


def emit(report: dict[str, Any], as_json: bool, printer: Callable[[dict[str, Any]], None]) -> None:
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        printer(report)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fleet_arguments(parser)
    parser.add_argument("--layout", choices=("single", "tiered"), default="single")
    parser.add_argument("--shards", type=int, default=2, help="shard Prometheus of the tiered layout")
    parser.add_argument("--pp", type=int, default=0, help="pipeline stages (default min(8, nodes)); DP = nodes / pp")
    parser.add_argument("--scale", type=float, default=1.0, help="rule timings and fleet thresholds times this")
    parser.add_argument("--alone", action="store_true", help="also time each Prometheus' rules with the others paused")
    parser.add_argument("--floor", action="store_true",
                        help="also time, in place of the rules of each Prometheus that scrapes the ranks, one group "
                             "reading once each series family the rules read (their floor)")
    parser.add_argument("--desync-timeout", type=float, default=0.0, help="seconds to wait for the alert")
    parser.add_argument("--analyze-only", action="store_true",
                        help="rules paused from the start; only time analyze after a desync (a size too large for "
                             "this machine's rule rounds)")
    parser.add_argument("--cascade", action="store_true",
                        help="with --analyze-only: the hang spreads into the tensor-parallel group of every waiter "
                             "(their nodes' other ranks wait in it), as on a real job")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (configs, logs, TSDBs)")
    parser.add_argument("--quiet", action="append", default=[], choices=("world", "tp", "pp", "dp"),
                        help="a PG kind that runs no collective (a pipeline group that only sends and receives): "
                             "its ranks are idle in every state, as their exporters write them; repeatable")
    args = parser.parse_args(argv)
    report = run(args)
    emit(report, args.json, print_report)
    analyzed = all(report["analyze"][key]["correct"] for key in ("busy", "rules_paused") if key in report["analyze"])
    if args.analyze_only:
        return 0 if analyzed else 1
    d = report["desync"]
    return 0 if analyzed and d["correct"] and not d["false_before_fault"] and not report["rule_errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
