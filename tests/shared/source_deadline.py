"""What both halves of test_source_deadline.py use: a source that answers at once, an NVML source over fake GPUs
whose driver calls hang as ``Hang`` says, one source's status in a snapshot, and the source worker threads."""

from __future__ import annotations

import threading
import time

from frexporter import naming as n
from frexporter.exporter import Exporter
from frexporter.model import NodeSnapshot, SourceStatus
from frexporter.sources.base import Reading
from frexporter.sources.nvml import NvmlSource
from tests.fakes.gpu import FakeGpu, FakeGpuBackend, Hang


class Ticker:
    """A source that answers at once (or after ``delay``), counting its calls."""

    def __init__(self, name: str = n.SOURCE_RANKS, delay: float = 0.0) -> None:
        self.name = name
        self.delay = delay
        self.calls = 0
        self.closed = False

    def collect(self) -> Reading:
        self.calls += 1
        if self.delay:
            time.sleep(self.delay)  # the source's own slowness: the fault under test, not a wait of the test
        return Reading(ranks=())

    def close(self) -> None:
        self.closed = True


def nvml(hang: Hang) -> tuple[NvmlSource, FakeGpuBackend]:
    backend = FakeGpuBackend([FakeGpu("GPU-0"), FakeGpu("GPU-1")], chaos=hang)
    return NvmlSource(backend), backend


def status(snapshot: NodeSnapshot, name: str = n.SOURCE_NVML) -> SourceStatus:
    return next(s for s in snapshot.sources if s.name == name)


def source_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("frexporter-source-"))


def timed_poll(exporter: Exporter) -> tuple[NodeSnapshot, float]:
    started = time.monotonic()
    snap = exporter.poll_once()
    return snap, time.monotonic() - started
