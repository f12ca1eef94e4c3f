"""Cross-node stragglers end to end: a real gloo job over two exporters, real Prometheus, the shipped rules.

    python -m benchmarks.straggler                   # rank 5 made 10 % and 30 % slow: time to FrexporterStraggler
    python -m benchmarks.straggler --soak 1800        # healthy: jitter, an evaluation pause, p2p: false alerts (0)
    python -m benchmarks.straggler --offsets          # node-b's clock 10 ms and 100 ms ahead: what that does

The job (tests/workers/job.py, scenario ``dp_straggler``) has 8 ranks; ranks 0-3 publish to one spool and ranks
4-7 to another, as two nodes, each read by its own ``frexporter serve --collective-waits`` (a subprocess), both
scraped by one Prometheus every 15 s with the shipped rules unscaled (tests/promstack.py at scale 1). Every
step each rank computes ``--step`` seconds, hands a tensor to its peer on the other node (p2p) and all_reduces on
WORLD, the data-parallel group, whose members sit on both nodes: gloo, so the signal is each rank's arrival
(frexporter_rank_collective_arrival_timestamp_seconds), not its wait.

A slowdown run waits until Prometheus has every rank's arrival and a minute of rates, checks that nothing
fires, then makes rank 5 compute a fixed share of a step longer every step, and times from the rank's first slow
step (its marker file) to Prometheus reporting FrexporterStraggler firing for rank 5. Any straggler alert on
another rank is reported as false. The soak runs a healthy job (every rank's compute varies randomly by up to
``--jitter`` of a step, rank 2 pauses ``--pause`` seconds every ``--pause-every`` steps, p2p every step) and
counts straggler alerts, pending and firing, and how often Prometheus had a lag for every rank (the signal was
there to be wrong). The offset runs shift node-b's arrivals by 10 ms and 100 ms (both nodes share this
machine's clock, so the offset is injected: node-b's exporter adds it to every arrival it reports) in a
healthy job and with rank 5 30 % slow.

Exit status 1 when a 30 % slowdown goes unnamed, the median time to name it is over the target (60 s), or a false
alert fires (soak, slowdowns).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frexporter import naming as n
from tests.harness import Job, wait_for
from tests.promstack import PromStack, running_stack

ALERT = "FrexporterStraggler"
WORLD = 8
VICTIM = 5  # on node-b
PAUSE_RANK = 2  # on node-a
INTERVAL_S = 15.0  # scrape and evaluation: the shipped setting
TARGET_S = 60.0  # named within this at 30 % (the target)
NAME_TIMEOUT_S = 240.0
WARM_S = 75.0  # arrivals in Prometheus, a full 1 m rate window, then a clean check
LAG = "job_id_pg_rank:" + n.RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS + ":lag"
MAD = "job_id_pg:" + n.RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS + ":mad"


@dataclass
class Setup:
    step: float
    jitter: float
    pause: float
    pause_every: int
    offset: float = 0.0
    lifetime: float = 900.0


@dataclass
class Seen:
    """What Prometheus reported about straggler alerts over a watch."""

    firing: dict[str, float] = field(default_factory=dict)  # rank -> unix time first seen firing
    pending: set[str] = field(default_factory=set)
    polls: int = 0
    polls_with_signal: int = 0  # every rank had a recorded lag
    lagless: Counter[int] = field(default_factory=Counter)  # polls by how many ranks had no lag
    evidence: list[str] = field(default_factory=list)  # what Prometheus held when an alert was pending or firing

    def watch(self, stack: PromStack, job_id: str) -> None:
        self.polls += 1
        alerts = stack.alerts(alertname=ALERT, job_id=job_id)
        for alert in alerts:
            rank = alert["labels"].get("rank", "?")
            if alert["state"] == "firing":
                self.firing.setdefault(rank, time.time())
            else:
                self.pending.add(rank)
        lags = {s["metric"]["rank"]: float(s["value"][1]) for s in stack.query(f'{LAG}{{job_id="{job_id}"}}')}
        self.lagless[WORLD - len(lags)] += 1
        if len(lags) == WORLD:
            self.polls_with_signal += 1
        if alerts and len(self.evidence) < 20:
            mad = stack.query(f'{MAD}{{job_id="{job_id}"}}')
            self.evidence.append(f"{time.strftime('%H:%M:%S')} {[a['labels'].get('rank') for a in alerts]} "
                                 f"lags_ms={ {r: round(v * 1000, 1) for r, v in sorted(lags.items())} } "
                                 f"mad_ms={[round(float(m['value'][1]) * 1000, 1) for m in mad]}")


def _exporter_child(spool: str, port: int, offset: float) -> int:
    """``serve --collective-waits`` for one node, its arrivals shifted by ``offset`` seconds (its clock)."""
    if offset:
        from frexporter.sources import arrivals

        original = arrivals.ArrivalTracker.arrival

        def shifted(self: arrivals.ArrivalTracker, *args: Any) -> tuple[float, float] | None:
            answer = original(self, *args)
            return None if answer is None else (answer[0] + offset, answer[1])

        arrivals.ArrivalTracker.arrival = shifted  # type: ignore[method-assign]
    from frexporter import cli

    return cli.main(["serve", "--dir", spool, "--listen", f"127.0.0.1:{port}", "--collective-waits",
                     "--no-source.nvml"])


@contextmanager
def _running(stack: PromStack, workdir: Path, job_id: str, setup: Setup, slow_fraction: float) -> Iterator[Job]:
    spools = (workdir / "node-a", workdir / "node-b")
    job = Job(workdir, "dp_straggler", WORLD, job_id=job_id, env={
        "JOB_STEP_SECONDS": f"{setup.step:g}", "JOB_JITTER": f"{setup.jitter:g}",
        "JOB_SLOW_FRACTION": f"{slow_fraction:g}", "JOB_VICTIM": str(VICTIM),
        "JOB_PAUSE_EVERY": str(setup.pause_every), "JOB_PAUSE_SECONDS": f"{setup.pause:g}",
        "JOB_PAUSE_RANK": str(PAUSE_RANK), "JOB_MAX_LIFETIME": f"{setup.lifetime:g}", "JOB_TIMEOUT": "600",
    }, rank_env={rank: {"FREXPORTER_DIR": str(spools[rank * 2 // WORLD])} for rank in range(WORLD)})
    exporters: list[subprocess.Popen[bytes]] = []
    try:
        job.start()
        job.wait_ready(timeout=120)
        since = time.time()
        for spool, port, offset in zip(spools, stack.exporter_ports, (0.0, setup.offset), strict=True):
            log = open(workdir / f"exporter-{port}.log", "wb")  # noqa: SIM115 (closed with the process)
            exporters.append(subprocess.Popen(
                [sys.executable, "-m", "benchmarks.straggler", "--exporter", str(spool), str(port), repr(offset)],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(Path.cwd())}))
        for port in stack.exporter_ports:
            stack.wait_target_up(since, timeout=60, port=port)
        wait_for(lambda: len(stack.query(f'{n.RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS}{{job_id="{job_id}"}}'))
                 == WORLD, timeout=120, interval=1.0, what="Prometheus has every rank's arrival")
        yield job
    finally:
        for proc in exporters:
            proc.terminate()
        for proc in exporters:
            proc.wait(timeout=30)
        job.stop()


def _settle(stack: PromStack, job_id: str, seconds: float) -> Seen:
    seen = Seen()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.watch(stack, job_id)
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
    return seen


def slowdown(stack: PromStack, workdir: Path, setup: Setup, fraction: float, tag: str,
             phase: float = 0.0) -> dict[str, Any]:
    """``phase``: seconds more to wait before the slowdown, so that runs start it at different points of the
    grid, scrape and evaluation cycles (which a run otherwise meets at the same point every time)."""
    job_id = f"straggler-{tag}"
    with _running(stack, workdir / tag, job_id, setup, fraction) as job:
        before = _settle(stack, job_id, WARM_S + phase)
        job.touch("slow")
        job.wait_ready("slow", ranks=[VICTIM], timeout=30)
        began = job.marker(VICTIM, "slow").stat().st_mtime
        seen = Seen()
        deadline = time.monotonic() + NAME_TIMEOUT_S
        while time.monotonic() < deadline and str(VICTIM) not in seen.firing:
            seen.watch(stack, job_id)
            time.sleep(1.0)
        named = seen.firing.get(str(VICTIM))
        lags = {s["metric"]["rank"]: float(s["value"][1]) for s in stack.query(f'{LAG}{{job_id="{job_id}"}}')}
    return {"case": tag, "slow": fraction, "offset_ms": setup.offset * 1000, "phase_s": round(phase, 1),
            "named_after_s": None if named is None else named - began,
            "false_before": sorted(before.firing), "others_firing": sorted(r for r in seen.firing if r != str(VICTIM)),
            "pending_others": sorted(r for r in seen.pending if r != str(VICTIM)), "lags_ms": {
                r: round(v * 1000, 1) for r, v in sorted(lags.items(), key=lambda kv: int(kv[0]))}}


def soak(stack: PromStack, workdir: Path, setup: Setup, seconds: float, tag: str = "soak") -> dict[str, Any]:
    job_id = f"straggler-{tag}"
    with _running(stack, workdir / tag, job_id, setup, 0.0):
        started = time.monotonic()
        seen = _settle(stack, job_id, seconds)
        elapsed = time.monotonic() - started
        peak = {s["metric"]["rank"]: round(float(s["value"][1]) * 1000, 1) for s in stack.query(
            f'max_over_time({LAG}{{job_id="{job_id}"}}[{round(seconds)}s])')}
    for line in seen.evidence:
        print(f"  [{tag}] {line}", flush=True)
    return {"case": tag, "seconds": round(elapsed), "offset_ms": setup.offset * 1000,
            "firing": sorted(seen.firing), "pending": sorted(seen.pending),
            "signal_share": round(seen.polls_with_signal / max(1, seen.polls), 3), "polls": seen.polls,
            "ranks_without_lag": dict(sorted(seen.lagless.items())),
            "peak_lag_ms": dict(sorted(peak.items(), key=lambda kv: int(kv[0])))}


def _print(row: dict[str, Any]) -> None:
    print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--soak", type=float, metavar="SECONDS", help="a healthy soak this long (>= 1800 to judge)")
    parser.add_argument("--offsets", action="store_true", help="node-b's clock 10 ms and 100 ms ahead")
    parser.add_argument("--step", type=float, default=0.5, help="seconds of compute per step (default 0.5)")
    parser.add_argument("--trials", type=int, default=3, help="slowdown runs at 30 %% (default 3), then one at 10 %%")
    parser.add_argument("--seed", type=int, default=1, help="of the slowdowns' start phases (default 1)")
    parser.add_argument("--jitter", type=float, default=0.1, help="soak: random extra compute, share of a step")
    parser.add_argument("--pause", type=float, default=5.0, help="soak: seconds rank 2 pauses (an evaluation)")
    parser.add_argument("--pause-every", type=int, default=200, help="soak: steps between pauses")
    parser.add_argument("--exporter", nargs=3, metavar=("SPOOL", "PORT", "OFFSET"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.exporter:
        return _exporter_child(args.exporter[0], int(args.exporter[1]), float(args.exporter[2]))
    failed = False
    with tempfile.TemporaryDirectory(prefix="frexporter-straggler-") as tmp, \
            running_stack(Path(tmp) / "stack", scale=1.0, interval=INTERVAL_S, exporters=2) as stack:
        print(f"8 gloo ranks on two exporters, step {args.step:g} s, scrape and evaluation every {INTERVAL_S:g} s, "
              f"shipped rules", flush=True)
        if args.soak:
            setup = Setup(args.step, args.jitter, args.pause, args.pause_every, lifetime=args.soak + 600)
            row = soak(stack, Path(tmp), setup, args.soak)
            _print(row)
            failed |= bool(row["firing"])
        elif args.offsets:
            for offset in (0.010, 0.100):
                setup = Setup(args.step, 0.02, 0.0, 0, offset=offset)
                _print(soak(stack, Path(tmp), setup, 180.0, tag=f"healthy-offset{offset * 1000:.0f}ms"))
                _print(slowdown(stack, Path(tmp), setup, 0.3, tag=f"slow30-offset{offset * 1000:.0f}ms"))
        else:
            named_30: list[float | None] = []
            phases = random.Random(args.seed)
            for trial, fraction in enumerate([0.3] * args.trials + [0.1]):
                setup = Setup(args.step, 0.02, 0.0, 0)
                row = slowdown(stack, Path(tmp), setup, fraction, tag=f"slow{fraction * 100:.0f}-{trial}",
                               phase=phases.uniform(0.0, INTERVAL_S))
                _print(row)
                failed |= bool(row["false_before"] or row["others_firing"])
                if fraction >= 0.3:
                    named_30.append(row["named_after_s"])
            found = sorted(t for t in named_30 if t is not None)
            print(f"30 %: named in {len(found)} of {len(named_30)} runs; seconds after the slowdown: "
                  + ", ".join(f"{t:.1f}" for t in found) + (f" (median {statistics.median(found):.1f})" if found
                                                             else ""), flush=True)
            failed |= len(found) < len(named_30) or statistics.median(found) > TARGET_S
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
