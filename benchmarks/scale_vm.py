"""The shipped rules at scale on VictoriaMetrics: vmagent scraping a simulated fleet, victoria-metrics storing,
vmalert evaluating the canonical rules (the single layout), live, at the shipped 15 s intervals.

The VictoriaMetrics counterpart of ``benchmarks.scale_live --layout single`` (same fleet: tests/fleet.py, 8 ranks
per node, 4 PGs per rank from one real node's /metrics; same stack as tests/e2e/test_vmalert.py: tests/vmstack.py):

1. Healthy: until every rule group has evaluated ``--rounds`` rounds after one warm-up round. Reported: series in
   victoria-metrics, each process's RSS and CPU per round, and each group's time per round (vmalert's own
   ``vmalert_iteration_duration_seconds``: the queries it sends victoria-metrics and the writes back, in order),
   missed iterations and rule errors.
2. A desync in a data-parallel group: until vmalert fires FrexporterCollectiveDesync or a deadline passes.
   Checked: it names exactly the culprit rank and PG.

vmalert evaluates each rule as a query to victoria-metrics, which runs it on every core; victoria-metrics,
vmagent, vmalert and the fleet simulation share this machine's CPUs, which the report states.

Run: ``python -m benchmarks.scale_vm --nodes 16 --rounds 2`` (a few minutes); ``--json`` for the numbers. Exit
status 1 when the alert was wrong or missing, or a rule failed to evaluate.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.scale import real_exposition
from benchmarks.scale_live import WARMUP_ROUNDS, add_fleet_arguments, emit
from tests.fleet import JOB_ID, RANKS_PER_NODE, FakeFleet, cross_shard_desync, fleet_job, rss_mb, stat_cpu_seconds
from tests.rulefile import alert_for
from tests.vmstack import VmStack

DESYNC = "FrexporterCollectiveDesync"
PROCESSES = ("victoria-metrics", "vmagent", "vmalert")
# Where vmalert sends alerts: nowhere (vmalert 1.79 needs a notifier; the alerts are read from its API).
NO_NOTIFIER = "http://127.0.0.1:9"
_SAMPLE = re.compile(r'^(\w+)\{group="([^"]*)"[^}]*\} (\S+)$')


def vmalert_groups(stack: VmStack) -> dict[str, dict[str, float]]:
    """Per rule group: vmalert's iteration count, their duration's sum, missed iterations and rule errors."""
    with urllib.request.urlopen(f"{stack.alert_url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in ("vmalert_iteration_duration_seconds_count", "vmalert_iteration_duration_seconds_sum",
                                "vmalert_iteration_missed_total", "vmalert_recording_rules_error",
                                "vmalert_alerting_rules_error"):
            group = out.setdefault(m.group(2), {})
            group[m.group(1)] = group.get(m.group(1), 0.0) + float(m.group(3))
    return out


def _cpu(stack: VmStack) -> dict[str, float]:
    return {name: stat_cpu_seconds(f"/proc/{stack.pid(name)}/stat") for name in PROCESSES}


def _until(done: Callable[[], bool], timeout: float, poll: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


def healthy(stack: VmStack, fleet: FakeFleet, interval: float, rounds: int, timeout: float) -> dict[str, Any]:
    """Every group's time per round over ``rounds`` rounds after a warm-up one."""
    start_groups = vmalert_groups(stack)
    _until(lambda: all(g.get("vmalert_iteration_duration_seconds_count", 0)
                       >= start_groups.get(name, {}).get("vmalert_iteration_duration_seconds_count", 0) + WARMUP_ROUNDS
                       for name, g in vmalert_groups(stack).items()), timeout)
    t0, cpu0, fleet0, before = time.time(), _cpu(stack), fleet.cpu_seconds(), vmalert_groups(stack)
    complete = _until(lambda: all(g.get("vmalert_iteration_duration_seconds_count", 0)
                                  >= before.get(name, {}).get("vmalert_iteration_duration_seconds_count", 0) + rounds
                                  for name, g in vmalert_groups(stack).items()), timeout)
    t1, cpu1, fleet1, after = time.time(), _cpu(stack), fleet.cpu_seconds(), vmalert_groups(stack)
    per_round = interval / max(t1 - t0, 1e-9)
    groups = {}
    for name, g in sorted(after.items()):
        b = before.get(name, {})
        n = g.get("vmalert_iteration_duration_seconds_count", 0) - b.get("vmalert_iteration_duration_seconds_count", 0)
        spent = g.get("vmalert_iteration_duration_seconds_sum", 0) - b.get("vmalert_iteration_duration_seconds_sum", 0)
        # Per `interval` of the window, so a group of a longer interval (the dashboards' minute) counts its share.
        groups[name] = {"rounds": int(n), "mean_ms": round(spent / n * 1e3, 1) if n else None,
                        "ms_per_round": round(spent * per_round * 1e3, 1),
                        "missed": g.get("vmalert_iteration_missed_total", 0.0),
                        "rule_errors": g.get("vmalert_recording_rules_error", 0.0)
                        + g.get("vmalert_alerting_rules_error", 0.0)}
    series = stack.query(f'count({{__name__=~"frexporter_.+", job_id="{JOB_ID}"}})')
    return {
        "complete": complete, "wall_s": round(t1 - t0, 1), "groups": groups,
        "rules_per_round_s": round(sum(g["ms_per_round"] for g in groups.values()) / 1e3, 3),
        "job_series": int(float(series[0]["value"][1])) if series else 0,
        "rss_mb": {name: round(rss_mb(stack.pid(name)), 1) for name in PROCESSES},
        "cpu_s_per_round": {**{name: round((cpu1[name] - cpu0[name]) * per_round, 3) for name in PROCESSES},
                            "fleet": round((fleet1 - fleet0) * per_round, 3)},
    }


def desync(stack: VmStack, fleet: FakeFleet, culprit: int, pg: str, timeout: float) -> dict[str, Any]:
    before = stack.alerts(alertname=DESYNC, job_id=JOB_ID)
    fault = fleet.desync(culprit, pg)
    firing: list[dict[str, Any]] = []

    def fired() -> bool:
        firing[:] = [a for a in stack.alerts(alertname=DESYNC, job_id=JOB_ID) if a.get("state") == "firing"]
        return bool(firing)

    ok = _until(fired, timeout)
    named = sorted({(a["labels"].get("rank", ""), a["labels"].get("pg", "")) for a in firing})
    return {"culprit": culprit, "pg": pg, "waiters": len(fleet.topo.members(pg)) - 1, "fired": ok,
            "fired_after_s": round(time.time() - fault.at, 1) if ok else None, "named": named,
            "correct": ok and named == [(str(culprit), pg)], "before_fault": len(before)}


def vm_version() -> str:
    """The victoria-metrics package's version: Debian's build reports none itself (-version prints nothing)."""
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "victoria-metrics"], capture_output=True,
                             text=True, timeout=30, check=False)
    except OSError:
        return "unknown"
    return f"victoria-metrics {out.stdout.strip()} (Debian)" if out.returncode == 0 and out.stdout else "unknown"


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="frexporter-scale-vm-"))
    fleet = FakeFleet(args.nodes, scale=1.0, template=real_exposition())
    culprit, pg = cross_shard_desync(fleet.topo, 1)
    report: dict[str, Any] = {"nodes": args.nodes, "ranks": fleet.topo.world, "interval_s": args.interval,
                              "rounds": args.rounds, "cpus": os.cpu_count(), "victoria_metrics": vm_version()}
    timeout = (WARMUP_ROUNDS + args.rounds + 4) * args.interval * 3 + 120
    stack = VmStack(workdir, (), NO_NOTIFIER, scale=1.0, interval=args.interval, scrape_jobs=[fleet_job(fleet)])
    try:
        with fleet:
            stack.start()
            world = fleet.topo.world
            ready = _until(lambda: (r := stack.query(f'count(frexporter_rank_up{{job_id="{JOB_ID}"}})'))
                           and int(float(r[0]["value"][1])) == world, timeout)
            if not ready:
                raise RuntimeError(f"victoria-metrics never held all {world} ranks")
            report["healthy"] = healthy(stack, fleet, args.interval, args.rounds, timeout)
            report["desync"] = desync(stack, fleet, culprit, pg,
                                      fleet.stuck_threshold_s + alert_for(DESYNC, 1.0) + 10 * args.interval)
    finally:
        stack.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return report


def print_report(r: dict[str, Any]) -> None:
    h, d = r["healthy"], r["desync"]
    print(f"VictoriaMetrics, single layout: {r['nodes']} nodes x {RANKS_PER_NODE} ranks = {r['ranks']} ranks, 4 PGs "
          f"per rank; {r['victoria_metrics']}; {r['cpus']} CPUs shared by every process; scrape and evaluation every "
          f"{r['interval_s']:g} s")
    print(f"  job series in victoria-metrics {h['job_series']:,}; RSS MB {h['rss_mb']}; CPU s per round "
          f"{h['cpu_s_per_round']}")
    print(f"  vmalert time per round, mean over {r['rounds']} rounds after {WARMUP_ROUNDS} warm-up "
          f"(groups run concurrently): all groups {h['rules_per_round_s']:.3f} s per {r['interval_s']:g} s (each "
          f"group's time spent over the window, per {r['interval_s']:g} s)"
          + ("" if h["complete"] else " (NOTE: not every group reached the rounds asked for)"))
    for name, g in h["groups"].items():
        print(f"    {name:<28} {g['mean_ms']} ms ({g['rounds']} rounds), missed {g['missed']:g}, "
              f"rule errors {g['rule_errors']:g}")
    print(f"  desync: culprit rank {d['culprit']}, PG {d['pg']} ({d['waiters']} waiters): "
          + (f"fired {d['fired_after_s']} s after the fault, named {d['named']} -> "
             f"{'exactly the culprit' if d['correct'] else 'WRONG'}" if d["fired"] else "DID NOT FIRE"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fleet_arguments(parser)
    args = parser.parse_args(argv)
    report = run(args)
    emit(report, args.json, print_report)
    errors = sum(g["rule_errors"] for g in report["healthy"]["groups"].values())
    return 0 if report["desync"]["correct"] and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
