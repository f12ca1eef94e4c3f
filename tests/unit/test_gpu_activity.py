"""A waiting rank is not busy: the CUDA probe (through a fake torch.cuda), the activity it feeds, the busy hold."""

from __future__ import annotations

import re
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from frexporter import reasons
from frexporter.model import (
    ACTIVITY_BUSY,
    ACTIVITY_GPU_WAIT,
    ACTIVITY_IDLE,
    ACTIVITY_IN_COLLECTIVE,
    ACTIVITY_WAITING,
    RANK_OK,
    Activity,
    InflightCollective,
    PGState,
)
from frexporter.recorder import cuda_probe
from frexporter.recorder.cuda_probe import CudaProbe, rank_device
from frexporter.sources import rank_activity
from frexporter.sources.rank_activity import GPU_WAIT_AFTER, IN_COLLECTIVE_AFTER, classify, next_activity
from frexporter.spool import parse_snapshot
from tests.harness import wait_for
from tests.rulefile import DESYNC_CANDIDATES, load_rules

USER = (("train_step", "/home/me/train.py", 14),)
DIST = (("all_reduce", "/x/site-packages/torch/distributed/distributed_c10d.py", 2500), *USER)


class FakeCuda:
    """torch.cuda at its boundary: initialized or not, memory per device, a default stream per device whose
    ``query()`` answers ``done`` (or raises, hangs, answers garbage). Records every call."""

    def __init__(self, initialized: bool = True, reserved: tuple[int, ...] = (1 << 20,), done: Any = True) -> None:
        self.initialized = initialized
        self.reserved = reserved
        self.done = done
        self.calls: list[str] = []
        self.release = threading.Event()

    def is_initialized(self) -> bool:
        self.calls.append("is_initialized")
        return self.initialized

    def device_count(self) -> int:
        self.calls.append("device_count")
        return len(self.reserved)

    def memory_reserved(self, device: int) -> int:
        self.calls.append(f"memory_reserved({device})")
        return self.reserved[device]

    def get_device_properties(self, device: int) -> Any:
        return SimpleNamespace(uuid=f"uuid-of-{device}")

    def default_stream(self, device: int) -> Any:
        self.calls.append(f"default_stream({device})")
        fake = self

        class Stream:
            def query(self) -> Any:
                if fake.done == "hang":
                    fake.release.wait(30)
                    return True
                if isinstance(fake.done, BaseException):
                    raise fake.done
                return fake.done

        return Stream()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _probe(cuda: FakeCuda, clock: Clock | None = None, **kw: Any) -> tuple[CudaProbe, list[str]]:
    errors: list[str] = []
    probe = CudaProbe(lambda reason, e: errors.append(reason), cuda=lambda: cuda, environ={},
                      clock=clock or Clock(), **kw)
    return probe, errors


def _answer(probe: CudaProbe, clock: Clock | None = None) -> bytes:
    """Ask on each call (the snapshot does once a second) until an answer comes back."""
    def ask() -> bytes:
        if clock is not None:
            clock.now += 0.5
        return probe.sample(True)

    return wait_for(ask, timeout=10, what="a probe answer")


# ---------------------------------------------------------------- the probe (in the rank)


def test_frozen_stack_with_pending_work_reports_device_and_growing_wait() -> None:
    cuda, clock = FakeCuda(done=False), Clock()
    probe, errors = _probe(cuda, clock)
    first = _answer(probe, clock)
    device, ms = (int(v) for v in first.split(b","))
    assert device == 0
    clock.now += 3.0
    later = int(probe.sample(True).split(b",")[1])
    assert later >= ms + 3000
    assert not errors
    probe.close()


def test_frozen_stack_with_idle_stream_reports_nothing() -> None:
    cuda = FakeCuda(done=True)
    probe, errors = _probe(cuda)
    probe.sample(True)
    wait_for(lambda: "default_stream(0)" in cuda.calls, timeout=10, what="a query")
    assert all(probe.sample(True) == b"" for _ in range(5))
    assert not errors
    probe.close()


def test_moving_stack_asks_nothing() -> None:
    cuda = FakeCuda(done=False)
    probe, _ = _probe(cuda)
    assert all(probe.sample(False) == b"" for _ in range(5))
    assert cuda.calls == []  # not even is_initialized: a progressing rank pays nothing


def test_a_rank_that_never_touched_cuda_gets_no_context() -> None:
    """Not initialized: no thread, no device question, no stream query (each could create a context)."""
    cuda = FakeCuda(initialized=False, done=False)
    probe, errors = _probe(cuda)
    assert all(probe.sample(True) == b"" for _ in range(5))
    assert set(cuda.calls) == {"is_initialized"}
    assert probe._thread is None and not errors
    assert cuda_probe.cuda_ready(None) is False  # no torch.cuda imported at all


def test_no_memory_on_any_device_means_no_query() -> None:
    cuda = FakeCuda(reserved=(0, 0), done=False)
    probe, _ = _probe(cuda)
    probe.sample(True)
    wait_for(lambda: "memory_reserved(1)" in cuda.calls, timeout=10, what="the device question")
    assert all(probe.sample(True) == b"" for _ in range(3))
    assert not any(c.startswith("default_stream") for c in cuda.calls)
    probe.close()


@pytest.mark.parametrize(("reserved", "local_rank", "device"), [
    ((0, 5, 0, 0), "", 1),  # the one device it holds memory on (CUDA_VISIBLE_DEVICES numbering)
    ((5, 5, 5, 5), "2", 2),  # several: LOCAL_RANK decides
    ((5, 0, 5, 0), "1", 0),  # LOCAL_RANK names a device it never used: the lowest used one
    ((5, 5), "x", 0),
    ((0, 0), "0", None),
])
def test_rank_device(reserved: tuple[int, ...], local_rank: str, device: int | None) -> None:
    assert rank_device(FakeCuda(reserved=reserved), {"LOCAL_RANK": local_rank}) == device


def test_a_query_that_raises_is_counted_and_turns_the_probe_off() -> None:
    cuda = FakeCuda(done=RuntimeError("CUDA error: an illegal memory access"))
    probe, errors = _probe(cuda)

    def off() -> bool:
        probe.sample(True)
        return probe.off
    wait_for(off, timeout=10, what="the probe off")
    probe.sample(True)  # errors raised on the query thread are counted on the recorder's
    assert errors == [reasons.CUDA_PROBE] * cuda_probe.MAX_FAILURES
    assert probe.sample(True) == b""


def test_a_query_that_answers_garbage_turns_the_probe_off() -> None:
    cuda = FakeCuda(done="yes")
    probe, errors = _probe(cuda)

    def off() -> bool:
        probe.sample(True)
        return probe.off
    wait_for(off, timeout=10, what="the probe off")
    probe.sample(True)
    assert errors == [reasons.CUDA_PROBE]


def test_a_query_that_hangs_never_blocks_the_snapshot() -> None:
    cuda, clock = FakeCuda(done="hang"), Clock()
    probe, errors = _probe(cuda, clock, deadline=5.0)
    probe.sample(True)
    wait_for(lambda: probe._asked_at is not None, timeout=10, what="a query under way")
    assert probe.sample(True) == b""  # returns at once while the query hangs
    clock.now += 6.0
    assert probe.sample(True) == b"" and probe.off
    assert errors == [reasons.CUDA_PROBE]
    cuda.release.set()


def test_sample_never_raises() -> None:
    def broken() -> Any:
        raise ImportError("torch.cuda half imported")

    errors: list[str] = []
    probe = CudaProbe(lambda reason, e: errors.append(reason), cuda=broken, environ={})
    assert probe.sample(True) == b""
    assert probe.sample(False) == b""


# ---------------------------------------------------------------- the snapshot field


@pytest.mark.parametrize(("raw", "expected", "dropped"), [
    ([0, 2500], (0, 2.5), False),
    ([], None, False),
    (None, None, False),
    ([0], None, True),
    ([0, -1], None, True),
    ([0, True], None, True),
    ([-1, 5], None, True),
    ("0,5", None, True),
    ([0, 10 ** 15], None, True),
])
def test_snapshot_gpu_wait(raw: Any, expected: Any, dropped: bool) -> None:
    obj: dict[str, Any] = {"format": "frexporter.snapshot/1", "pid": 1, "time": 1.0, "status": {}}
    if raw is not None:
        obj["gpu_wait"] = raw
    snap = parse_snapshot(obj)
    assert snap.gpu_wait == expected
    assert bool([p for p in snap.problems if p[0] == reasons.SNAPSHOT_FIELD_INVALID]) == dropped


# ---------------------------------------------------------------- the activity (in the exporter)


def _pg(created: float | None, normal: float | None = None, inflight: int = 1) -> PGState:
    entries = (InflightCollective(seq=5, op="all_reduce", created=created, timeout_seconds=600.0),) if created else ()
    return PGState(name="0", desc="default_pg", ranks=(0, 1), backend="nccl", last_enqueued=5, last_started=5,
                   last_completed=5 - inflight, inflight=entries, inflight_count=inflight, timeout_seconds=600.0,
                   last_progress=None, exact=True, has_p2p=False, normal_wait_seconds=normal)


def test_own_collective_wait_needs_the_pgs_normal_wait_and_at_least_the_floor() -> None:
    now = 1000.0
    assert rank_activity.own_collective_wait([_pg(now - 1.0)], now) is None  # under IN_COLLECTIVE_AFTER
    assert rank_activity.own_collective_wait([_pg(now - 3.0)], now) == pytest.approx(3.0 - IN_COLLECTIVE_AFTER)
    assert rank_activity.own_collective_wait([_pg(now - 3.0, normal=5.0)], now) is None  # a normal wait for it
    assert rank_activity.own_collective_wait([_pg(now - 8.0, normal=5.0)], now) == pytest.approx(3.0)
    assert rank_activity.own_collective_wait([_pg(None)], now) is None  # no deep read yet: no age
    assert rank_activity.own_collective_wait([_pg(now - 9.0, inflight=0)], now) is None


@pytest.mark.parametrize(("frames", "cpu", "own_wait", "gpu_wait", "state"), [
    (USER, 100.0, 1.0, None, ACTIVITY_IN_COLLECTIVE),  # NCCL: outside the call, own collective in flight
    ((), None, 1.0, None, ACTIVITY_IN_COLLECTIVE),  # whatever its Python shows
    (USER, 100.0, None, GPU_WAIT_AFTER, ACTIVITY_GPU_WAIT),  # frozen, GPU pending: the spin wait
    (USER, 100.0, None, GPU_WAIT_AFTER - 0.5, ACTIVITY_BUSY),  # not long enough yet
    (USER, 100.0, None, None, ACTIVITY_BUSY),  # frozen with an idle GPU, or moving: computing
    (USER, 2.0, None, None, ACTIVITY_IDLE),  # unchanged
    (DIST, 100.0, None, None, ACTIVITY_IN_COLLECTIVE),  # gloo's way, unchanged
])
def test_classify(frames: Any, cpu: float | None, own_wait: float | None, gpu_wait: float | None,
                  state: str) -> None:
    assert classify(RANK_OK, frames, cpu, inflight=True, own_wait=own_wait, gpu_wait=gpu_wait) == state


def test_waiting_ends_the_busy_hold_at_once() -> None:
    """From a busy steady state (a healthy GPU rank spins at 100 % CPU), a wait on the GPU or on its own
    collective gets the learned threshold at once; computing, idle or gone a moment after busy is still held."""
    busy = next_activity(None, RANK_OK, USER, 100.0, False, now=10.0)
    assert busy.state == ACTIVITY_BUSY and busy.held_busy(10.0)
    gpu = next_activity(busy, RANK_OK, USER, 100.0, False, now=12.0, gpu_wait=GPU_WAIT_AFTER)
    assert gpu.state == ACTIVITY_GPU_WAIT and gpu.last_busy == 10.0 and not gpu.held_busy(12.0)
    own = next_activity(busy, RANK_OK, USER, 100.0, True, now=12.0, own_wait=0.5)
    assert own.state == ACTIVITY_IN_COLLECTIVE and not own.held_busy(12.0)
    idle = next_activity(busy, RANK_OK, USER, 1.0, False, now=12.0)
    assert idle.state == ACTIVITY_IDLE and idle.held_busy(12.0)  # hovering at the busy line: held, as before


def test_prometheus_view_activity_ends_the_hold_too() -> None:
    """analyze --prometheus builds Activity(state, last_busy) from the series: the same rule."""
    assert not Activity(state=ACTIVITY_GPU_WAIT, last_busy=99.0).held_busy(100.0)
    assert Activity(state=ACTIVITY_IDLE, last_busy=99.0).held_busy(100.0)


def test_the_rules_waiting_states_are_the_models() -> None:
    # The culprit's activity is judged where its series are, in the shard tier's candidate record.
    desync = next(rule for group in load_rules(1.0)["groups"] for rule in group["rules"]
                  if rule.get("record") == DESYNC_CANDIDATES)
    found = re.findall(r'\{state[=!]~"([^"]+)"\}', desync["expr"])
    assert found and all(set(f.split("|")) == set(ACTIVITY_WAITING) for f in found), found
