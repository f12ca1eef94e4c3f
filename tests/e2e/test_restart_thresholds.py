"""An exporter restarted in the middle of a hang, on a real gloo job (issue 25, item 6): its verdict is back
within two polls of its first deep read, dated from Flight Recorder's own clock, against the threshold the
job's history says, not the cold-start ceiling.

The replay and the learner's seed alone, on fake ranks: tests/unit/test_threshold_history.py.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from typing import Any

from frexporter import naming as n
from frexporter import spool
from frexporter.app import ServeConfig, build_app
from frexporter.fr import trace
from frexporter.model import NodeSnapshot, PGState
from frexporter.sources import worker_handlers
from tests.harness import metrics, sample, wait_for

POLL = 0.2
FLOOR = 3.0  # the threshold a steady job learns (its steps take 0.1 s)
CEILING = 30.0  # --stuck-after: a restarted exporter that fell back to it would be silent for 30 s
VICTIM = 1
STEPS = 50  # steps the job makes before the hang: about 5 s


def _pg(snap: NodeSnapshot, rank: int = 0, pg: str = "0") -> PGState | None:
    for r in snap.ranks:
        if r.rank == rank:
            return next((p for p in r.pgs if p.name == pg), None)
    return None


def _threshold(snap: NodeSnapshot, pg: str = "0") -> float | None:
    """The PG's threshold as the verdict takes it: the shortest its ranks carry."""
    learned = [p.stuck_threshold_seconds for r in snap.ranks for p in r.pgs
               if p.name == pg and p.stuck_threshold_seconds is not None]
    return min(learned, default=None)


def _missing(snap: NodeSnapshot) -> list[Any]:
    return [v for v in snap.verdicts if v.kind == "missing_rank" and v.ranks == (VICTIM,)]


def _waiters_entry_created(spool_dir: Any) -> float:
    """The creation time (FR's clock) of rank 0's entry in flight on the default PG, read from its ring here."""
    stem = spool.rank_stem("job", 0)
    manifest = json.loads((spool_dir / (stem + spool.MANIFEST_SUFFIX)).read_text())
    body = worker_handlers.call(os.path.join(spool_dir, manifest["socket"]), worker_handlers.FR_TRACE, 10.0)
    dump = trace.parse_dump(json.loads(bytes(body)))
    (waiting,) = [e for e in dump.entries if e.pg_name == "0" and not e.is_p2p and not e.done]
    return waiting.time_created_ns / 1e9


def test_restart_during_a_hang_keeps_the_threshold_and_the_since(job_factory, exporter_factory) -> None:
    job = job_factory("steady", 2, env={"JOB_VICTIM": str(VICTIM), "JOB_TIMEOUT": "300"})
    job.wait_ready()
    first = exporter_factory(job.spool, poll_interval=POLL, stuck_floor=FLOOR, stuck_after=CEILING,
                             evidence_dir="")
    wait_for(lambda: _threshold(first.snapshot) == FLOOR, timeout=30, what="the floor learned")
    # A job some seconds into its training (its ring holds them all: 2000 entries are 100 s of this job).
    wait_for(lambda: (pg := _pg(first.snapshot)) is not None and pg.last_completed >= STEPS, timeout=60,
             what=f"{STEPS} steps")
    job.touch("idle")
    job.wait_ready("idled", ranks=[VICTIM])
    (before,) = wait_for(lambda: _missing(first.snapshot), timeout=CEILING, what="the first exporter's verdict")
    first.app.stop()  # in the middle of the hang

    polls: list[NodeSnapshot] = []
    app = build_app(ServeConfig(directory=str(job.spool), host="127.0.0.1", port=0, poll_interval=POLL,
                                rank_timeout=1.0, sources=(n.SOURCE_RANKS,), deep_interval=1.0,
                                stuck_floor=FLOOR, stuck_after=CEILING, evidence_dir=""))
    at: list[float] = []  # when each poll was published

    def listen(snap: NodeSnapshot) -> None:
        at.append(time.monotonic())
        polls.append(snap)

    app.exporter.poll_listeners.append(listen)
    started = time.monotonic()
    app.start()
    try:
        def read_twice() -> bool:
            read = [i for i, snap in enumerate(polls) if any(r.last_deep_read for r in snap.ranks if r.rank == 0)]
            return bool(read) and len(polls) >= read[0] + 2

        wait_for(read_twice, timeout=20, what="two polls from the first deep read of the waiting rank")
        first_read = next(i for i, snap in enumerate(polls) if any(r.last_deep_read for r in snap.ranks
                                                                    if r.rank == 0))
        back = next((i for i, snap in enumerate(polls) if _missing(snap)), None)
        thresholds = [_threshold(snap) for snap in polls[first_read:first_read + 2]]
        assert back is not None and back <= first_read + 1, (
            f"no verdict within two polls of the first deep read: thresholds {thresholds} (ceiling {CEILING})")
        (v,) = _missing(polls[back])
        threshold = _threshold(polls[back])
        assert threshold is not None and threshold < CEILING
        assert threshold == FLOOR  # what the job's history says, as the first exporter learned it live
        # Dated from FR's own clock, not from the exporter's start: the same wait as before the restart.
        created = _waiters_entry_created(job.spool)
        assert abs(v.since - created) < 0.005 and abs(before.since - created) < 0.005, (v.since, created)
        assert (v.seq, v.waiting_ranks) == (before.seq, before.waiting_ranks)
        parsed = metrics(app_get(app, "/metrics"))
        assert sample(parsed, n.VERDICT, rank=str(VICTIM), kind="missing_rank", seq=str(v.seq)) == 1
        print(f"\nverdict back at poll {back} (first deep read at poll {first_read}), {at[back] - started:.2f} s "
              f"after the new exporter's start; threshold {threshold:g} s (ceiling {CEILING:g} s); wait "
              f"{v.age_seconds:.1f} s")
    finally:
        app.stop()
        job.touch("stop")


def app_get(app: Any, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{app.port}{path}", timeout=10) as resp:
        return resp.read().decode()
