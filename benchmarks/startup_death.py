"""Start-up death: a rank SIGKILLed 0.5 s after init_process_group must give ``rank_down`` every time.

    python -m benchmarks.startup_death [--runs 20] [--kill-after 0.5] [--launcher-env]

Each run is a fresh 2-rank gloo job (tests/workers/job.py ``early_kill``) at the default 1 s snapshot
interval, watched by its own exporter; rank 1 kills itself ``--kill-after`` seconds after
init_process_group returned. Prints, per run, whether the exporter's verdicts named rank 1 ``rank_down``,
and how long after init_process_group returned the rank's full manifest was on disk; then the count
(``rank_down N of N``) and the cost of one identification check of the recorder (the 50 ms poll that runs
until the default process group exists). Exit status 1 unless every run gave the verdict.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from frexporter import spool
from frexporter.analysis.kinds import RANK_DOWN_KIND
from frexporter.app import ServeConfig, build_app
from tests.harness import Job, wait_for


def one_run(workdir: Path, kill_after: float, launcher_env: bool) -> tuple[bool, float | None]:
    job = Job(workdir, "early_kill", 2, launcher_env=launcher_env,
              env={"FREXPORTER_SNAPSHOT_INTERVAL": str(spool.DEFAULT_SNAPSHOT_INTERVAL),
                   "JOB_KILL_AFTER": str(kill_after)}).start()
    app = build_app(ServeConfig(directory=str(job.spool), host="127.0.0.1", port=0, poll_interval=0.2,
                                rank_timeout=1.0, sources=("ranks",), stuck_after=2.0, evidence_dir=""))
    app.start()
    try:
        def down() -> bool:
            return any(v.kind == RANK_DOWN_KIND and v.ranks == (1,) for v in app.exporter.snapshot.verdicts)

        try:
            wait_for(down, timeout=60, interval=0.1, what="rank_down of rank 1")
            found = True
        except AssertionError:
            found = False
        latency = None
        marker = job.marker(1, "init")
        manifest = job.spool / (spool.rank_stem(job.job_id, 1) + spool.MANIFEST_SUFFIX)
        if marker.exists() and manifest.exists():
            body = json.loads(manifest.read_text())
            if body.get("state", spool.STATE_RUNNING) == spool.STATE_RUNNING:
                latency = manifest.stat().st_mtime - marker.stat().st_mtime
        return found, latency
    finally:
        app.stop()
        job.stop()


def identify_check_cost(samples: int = 2000) -> float:
    """Microseconds of one recorder tick while torch.distributed is loaded and no process group exists."""
    import torch.distributed  # noqa: F401  (what a rank has loaded before init_process_group)

    from frexporter.recorder.publisher import Publisher

    with tempfile.TemporaryDirectory() as tmp:
        publisher = Publisher(tmp, "bench", spool.DEFAULT_SNAPSHOT_INTERVAL)
        times = []
        for _ in range(samples):
            t0 = time.perf_counter_ns()
            publisher.tick()
            times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--kill-after", type=float, default=0.5)
    parser.add_argument("--launcher-env", action="store_true", help="set torchrun's variables for the ranks")
    args = parser.parse_args()
    hits = 0
    latencies = []
    with tempfile.TemporaryDirectory(prefix="frexporter-startup-") as tmp:
        for i in range(args.runs):
            found, latency = one_run(Path(tmp) / f"run{i}", args.kill_after, args.launcher_env)
            hits += found
            if latency is not None:
                latencies.append(latency)
            shown = f"{latency * 1000:.0f} ms" if latency is not None else "n/a"
            print(f"run {i + 1:2d}: rank_down {'yes' if found else 'NO'}; manifest after init: {shown}", flush=True)
    print(f"rank_down {hits} of {args.runs} (kill {args.kill_after} s after init_process_group, snapshot interval "
          f"{spool.DEFAULT_SNAPSHOT_INTERVAL} s)")
    if latencies:
        print(f"full manifest after init_process_group returned: median {statistics.median(latencies) * 1000:.0f} ms,"
              f" max {max(latencies) * 1000:.0f} ms")
    print(f"identification check (every 50 ms until identified): median {identify_check_cost():.1f} us")
    return 0 if hits == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
