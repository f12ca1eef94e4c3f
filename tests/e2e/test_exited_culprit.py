"""Blame stays with the culprit on a real gloo job (issue 25, item 3): a rank that returns from its loop early and
exits cleanly while rank 0 waits for it in an all_reduce is named, rank_down, "exited while rank 0 waits in
all_reduce #4", and never the waiting rank 0.

Its unit tests (fake ranks, the pure rule, a full spool) are in tests/unit/test_exited_culprit.py."""

from __future__ import annotations

import json

from frexporter import naming as n
from frexporter import spool
from frexporter.analysis.kinds import RANK_DOWN_KIND
from frexporter.model import RANK_DOWN, RANK_OK, STATE_EXITING
from tests.harness import metrics, sample, wait_for

STEPS = 3  # all_reduces both ranks run; rank 0 then waits in #4, which rank 1 never joins


def test_rank_exiting_cleanly_while_its_peer_waits_is_named_never_the_waiter(job_factory, exporter_factory) -> None:
    job = job_factory("early_exit", 2, env={"JOB_TIMEOUT": "120", "JOB_STEPS": str(STEPS)})
    job.wait_ready()
    # Rank 1's goodbye is out (its exit then waits for "release"): state exiting, with its final counters.
    stem = spool.rank_stem("job", 1)

    def goodbye() -> spool.Snapshot | None:
        try:
            snap = spool.parse_snapshot(spool.read_snapshot_map(str(job.spool / (stem + spool.SNAPSHOT_MAP_SUFFIX))))
        except spool.SpoolError:
            return None
        return snap if snap.state == STATE_EXITING else None

    last = wait_for(goodbye, timeout=30, what="rank 1's goodbye snapshot")
    (counters,) = [status for statuses in last.status.values() for status in statuses.values()]
    assert (counters.enqueued, counters.completed) == (STEPS, STEPS)

    exp = exporter_factory(job.spool, stuck_after=2.0)
    verdict = wait_for(lambda: exp.snapshot.verdicts, timeout=20, what="a verdict")
    (v,) = verdict
    assert (v.kind, v.pg, v.ranks, v.waiting_ranks, v.seq, v.op) == (RANK_DOWN_KIND, "0", (1,), (0,), STEPS + 1,
                                                                    "all_reduce")
    assert f"exited while rank 0 waits in all_reduce #{STEPS + 1} on PG 'default_pg' (0)" in v.summary, v.summary
    # Past the stuck threshold, for as long as rank 0 waits: still rank 1, never "stalled" on rank 0.
    first = exp.snapshot.time
    wait_for(lambda: exp.snapshot.time - first >= 4.0, timeout=20, what="two stuck thresholds on")
    snap = exp.snapshot
    assert [(v.kind, v.ranks, v.waiting_ranks) for v in snap.verdicts] == [(RANK_DOWN_KIND, (1,), (0,))]
    assert {r.rank: (r.status, r.exited) for r in snap.ranks} == {0: (RANK_OK, False), 1: (RANK_DOWN, True)}
    parsed = metrics(exp.get("/metrics"))
    assert sample(parsed, n.RANK_UP, job_id="job", rank="1") == 0
    assert sample(parsed, n.VERDICT, job_id="job", rank="1", kind=RANK_DOWN_KIND, seq=str(STEPS + 1)) == 1
    assert sample(parsed, n.VERDICT, job_id="job", rank="0") is None
    (listed,) = [r for r in json.loads(exp.get("/api/v1/status"))["ranks"] if r["rank"] == 1]
    assert (listed["status"], listed["exited"]) == (RANK_DOWN, True)

    # Rank 1's process goes (with it its gloo connections): gloo aborts rank 0's wait, nobody waits any more, and
    # the exited rank leaves the view at once, its verdict with it.
    job.touch("release")
    wait_for(lambda: job.marker(0, "aborted").exists(), timeout=30, what="gloo aborting rank 0's wait")
    wait_for(lambda: [r.rank for r in exp.snapshot.ranks] == [0] and not exp.snapshot.verdicts, timeout=20,
             what="rank 1 dropped once nobody waits")
    assert job.procs[1].wait(timeout=30) == 0  # it was a clean exit
