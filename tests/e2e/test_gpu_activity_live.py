"""A waiting rank is not busy, on real gloo ranks, from a busy steady state.

CUDA is faked at its boundary inside the ranks (tests/workers/job.py, scenario gpu_spin): the recorder's probe,
the spool, the exporter, the verdict and its patience are the real ones. The same scenario on a real GPU is
``benchmarks/gpu_smoke.py --hung-gpu``.
"""

from __future__ import annotations

import time

from frexporter.analysis import MISSING_RANK
from frexporter.model import ACTIVITY_BUSY, ACTIVITY_GPU_WAIT, ACTIVITY_IN_COLLECTIVE
from tests.harness import wait_for

# A steady job learns its threshold to the floor fast; the ceiling is far enough above it that a held
# (busy) culprit and one judged at the threshold cannot be mistaken for each other.
FLOOR, CEILING = 3.0, 40.0
EXPORTER = {"stuck_floor": FLOOR, "stuck_after": CEILING}


def _states_until(exporter, rank: int, predicate, timeout: float, what: str) -> tuple[list[str], object]:
    """The rank's activity states seen (in order, repeats collapsed) until ``predicate(snapshot)`` holds."""
    seen: list[str] = []

    def check():
        r = exporter.rank(rank)
        if r is not None and (not seen or seen[-1] != r.activity.state):
            seen.append(r.activity.state)
        return predicate(exporter.snapshot)

    found = wait_for(check, timeout=timeout, interval=0.05, what=what)
    return seen, found


def _learned(exporter) -> bool:
    return any(pg.stuck_threshold_seconds is not None and pg.stuck_threshold_seconds < CEILING
               for r in exporter.snapshot.ranks for pg in r.pgs)


def test_a_rank_waiting_on_its_gpu_is_named_at_the_learned_threshold(job_factory, exporter_factory) -> None:
    job = job_factory("gpu_spin", 2, env={"JOB_VICTIM": "1"})
    job.wait_ready()
    exporter = exporter_factory(job.spool, **EXPORTER)
    wait_for(lambda: _learned(exporter), timeout=60, what="a learned threshold")
    job.touch("gpu_hang")
    job.wait_ready("hung", ranks=[1])
    hung = time.monotonic()

    def verdict(snapshot):
        found = [v for v in snapshot.verdicts if v.kind == MISSING_RANK and 1 in v.ranks]
        return found[0] if found else None

    seen, v = _states_until(exporter, 1, verdict, timeout=CEILING, what="a missing_rank verdict on rank 1")
    took = time.monotonic() - hung
    # Spinning on one line at 100 % CPU, the rank reads busy until the probe has seen its GPU pending long
    # enough; then gpu_wait ends the busy hold at once: named at the threshold, not the ceiling.
    assert ACTIVITY_BUSY in seen and seen[-1] == ACTIVITY_GPU_WAIT, seen
    assert took < CEILING / 2, f"named {took:.1f}s after the fault: held like a busy rank ({seen})"
    assert v.activity["1"].state == ACTIVITY_GPU_WAIT
    assert "Rank 1 has been waiting on its GPU" in v.summary, v.summary
    rank1 = exporter.rank(1)
    assert rank1.gpu_uuid == "GPU-00000000-fake-0000-0000-000000000000"  # the rank's own device, named


def test_a_rank_spinning_on_its_own_async_collective_is_in_collective(job_factory, exporter_factory) -> None:
    job = job_factory("async_spin", 2, env={"JOB_VICTIM": "1"})
    job.wait_ready()
    exporter = exporter_factory(job.spool, **EXPORTER)
    wait_for(lambda: _learned(exporter), timeout=60, what="a learned threshold")
    job.touch("async_hang")
    job.wait_ready("hung", ranks=[1])

    def waiting(snapshot):
        r = next((r for r in snapshot.ranks if r.rank == 0), None)
        return r if r is not None and r.activity.state == ACTIVITY_IN_COLLECTIVE else None

    _, rank0 = _states_until(exporter, 0, waiting, timeout=30, what="rank 0 in_collective")
    # Its Python spins in the test's own frame, outside torch.distributed, at 100 % CPU: only its own
    # collective in flight past the PG's normal wait says it waits.
    frames = rank0.activity.frames
    assert frames and "torch/distributed" not in frames[0][1], frames
    assert (rank0.activity.cpu_percent or 0) > 50, rank0.activity
    assert any(pg.inflight_count > 0 for pg in rank0.pgs)

    def verdict(snapshot):
        found = [v for v in snapshot.verdicts if v.kind == MISSING_RANK and 1 in v.ranks]
        return found[0] if found else None

    v = wait_for(lambda: verdict(exporter.snapshot), timeout=CEILING, what="a missing_rank verdict on rank 1")
    assert 0 in v.waiting_ranks, v
