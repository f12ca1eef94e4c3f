"""Every source has a deadline, on real gloo jobs and over seconds: a hung NVML (forever, for 5 s at a time, or one
that fails at once) holds neither the ranks' readings nor their verdicts, nor /healthz.

The fast cases are in tests/unit/test_source_deadline.py.
"""

from __future__ import annotations

import itertools
import threading
import time
import urllib.request

import pytest

from frexporter import naming as n
from frexporter import reasons
from frexporter.exporter import Exporter
from frexporter.model import GpuReading
from frexporter.sources.nvml import GpuBackendError
from tests.fakes.gpu import FakeGpu, FakeGpuBackend, Hang
from tests.harness import wait_for
from tests.shared.source_deadline import Ticker, nvml, status, timed_poll

POLL = 0.2
SOURCE_TIMEOUT = 2.0  # 2 x the shipped poll interval, as the issue measured; above the rank timeout below
RANK_TIMEOUT = 1.0
STUCK_AFTER = 5.0  # the issue's --stuck-after 5: no verdict in 30 s before the deadline
VICTIM = 2


def test_nvml_that_blocks_for_a_while_is_down_but_never_holds_a_poll_again() -> None:
    timeout = 0.5
    block = 3 * timeout  # far past the deadline, yet it returns: scaled from the 5 s of the gloo test below
    hang = Hang(seconds=block)
    source, _ = nvml(hang)
    ranks = Ticker()
    exporter = Exporter([(ranks, 0.0), (source, 0.0)], poll_interval=0.05, source_timeout=timeout)
    try:
        snap, waited = timed_poll(exporter)
        assert waited >= timeout and not status(snap).up  # the first miss: this poll waited for the deadline
        readings: list[GpuReading] = []
        slow: list[float] = []
        up: list[bool] = []
        polls = 0

        def late_answers() -> bool:
            nonlocal snap, polls
            snap, took = timed_poll(exporter)
            polls += 1
            if took >= timeout:
                slow.append(took)
            up.append(status(snap).up)
            if snap.gpus is not None and (not readings or readings[-1] is not snap.gpus):
                readings.append(snap.gpus)
            return len(readings) >= 3

        wait_for(late_answers, timeout=10 * block, what="three late NVML answers")
        assert slow == []  # no poll waited again for a source that missed its deadline
        assert not any(up)  # an answer past the deadline is served, but the source is not up
        assert ranks.calls == polls + 1  # the ranks source answered every poll meanwhile
        nv = status(snap)
        assert nv.reason == reasons.TIMEOUT and not nv.stale  # its latest reading is the latest it gave
        # One timeout per call, past or in progress: never one per poll.
        assert nv.errors_total[reasons.TIMEOUT] in (hang.entered - 1, hang.entered)
        assert hang.inside <= 1  # one call at a time: one worker per source
        assert readings[0].timestamp < readings[1].timestamp < readings[2].timestamp
    finally:
        hang.release()
        exporter.stop()


KINDS = {
    "blocks-forever": lambda: Hang(),
    "blocks-5s": lambda: Hang(seconds=5.0),
    "raises": lambda: Hang(seconds=0, raises=GpuBackendError(reasons.GPU_LOST, "GPU is lost")),
}
DOWN_REASON = {"blocks-forever": reasons.TIMEOUT, "blocks-5s": reasons.TIMEOUT, "raises": reasons.DRIVER}


def _source_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("frexporter-source-")]


@pytest.mark.parametrize("kind", list(KINDS))
def test_ranks_and_verdicts_flow_while_nvml_hangs(job_factory, exporter_factory, monkeypatch: pytest.MonkeyPatch,
                                                  kind: str) -> None:
    """The issue's reproduction: a 3-rank gloo job whose rank 2 goes idle, ``--stuck-after 5``, and NVML hung."""
    hang = KINDS[kind]()
    backend = FakeGpuBackend([FakeGpu("GPU-0")], chaos=hang)
    monkeypatch.setattr("frexporter.sources.nvml.source.PynvmlBackend", lambda: backend)
    job = job_factory("steady", 3, env={"JOB_VICTIM": str(VICTIM)})
    job.wait_ready()
    before = _source_threads()
    try:
        started = time.monotonic()
        exp = exporter_factory(job.spool, sources=(n.SOURCE_RANKS, n.SOURCE_NVML), poll_interval=POLL,
                               rank_timeout=RANK_TIMEOUT, source_timeout=SOURCE_TIMEOUT, stuck_after=STUCK_AFTER,
                               evidence_dir="")
        assert time.monotonic() - started < SOURCE_TIMEOUT + 10  # the first poll waits for one deadline at most
        wait_for(lambda: len(exp.snapshot.ranks) == 3, timeout=20, what="three ranks")
        wait_for(lambda: status(exp.snapshot).reason == DOWN_REASON[kind], timeout=20, what=f"nvml down ({kind})")

        job.touch("idle")
        job.wait_ready("idled", ranks=[VICTIM])
        idled = time.monotonic()
        times: list[float] = []
        health: list[tuple[int, str, float]] = []

        def verdict() -> object:
            snap = exp.snapshot
            if not times or times[-1] != snap.time:
                times.append(snap.time)
            asked = time.monotonic()
            with urllib.request.urlopen(exp.base + "/healthz", timeout=2) as resp:
                health.append((resp.status, resp.read().decode(), time.monotonic() - asked))
            return [v for v in snap.verdicts if VICTIM in v.ranks]

        (v,) = wait_for(verdict, timeout=STUCK_AFTER + 20, interval=0.1, what=f"a verdict naming rank {VICTIM}")
        took = time.monotonic() - idled
        assert v.kind == "missing_rank" and v.ranks == (VICTIM,)
        # On schedule: within two polls of the threshold, give or take a loaded machine, as if there were no GPU.
        assert took <= STUCK_AFTER + 5, f"verdict {took:.1f}s after the rank went idle"
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert max(gaps, default=0.0) < SOURCE_TIMEOUT, f"a poll waited for NVML: gaps {gaps}"
        assert all(code == 200 and seconds < 2 for code, _, seconds in health)
        assert all(body.startswith("degraded: nvml\n") and f"nvml: down ({DOWN_REASON[kind]})" in body
                   for _, body, _ in health), health[-1]
        nv = status(exp.snapshot)
        assert not nv.up
        if kind == "blocks-forever":
            assert hang.entered == 1 and nv.errors_total == {reasons.TIMEOUT: 1}  # never asked again
        elif kind == "blocks-5s":
            assert hang.inside <= 1 and 1 <= nv.errors_total[reasons.TIMEOUT] <= hang.entered
        else:
            assert reasons.TIMEOUT not in nv.errors_total
        # One worker per source, however many polls: no thread per poll.
        mine = [t for t in _source_threads() if t not in before]
        assert len(mine) <= 2, mine
    finally:
        hang.release()
