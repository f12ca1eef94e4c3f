"""What both halves of test_nvml.py use: an NVML source over fake GPUs on a fake clock, a full reading of
eight GPUs, and its exposition."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from frexporter.model import GpuReading
from frexporter.outputs.gpu_metrics import gpu_metric_families
from frexporter.sources.nvml import NvmlSource
from tests.fakes.gpu import FakeGpu, FakeGpuBackend, full_nvlinks


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_source(backend: object, clock: FakeClock | None = None) -> NvmlSource:
    return NvmlSource(backend, clock=clock or FakeClock(), wall_clock=lambda: 1_700_000_000.0)  # type: ignore[arg-type]


def full_reading(gpus: int = 8) -> GpuReading:
    backend = FakeGpuBackend(
        [
            FakeGpu(f"GPU-{i:04d}", throttle_reasons=0xFFF, nvlink_errors=full_nvlinks(18, count=i))
            for i in range(gpus)
        ]
    )
    source = make_source(backend)
    for i in range(gpus):
        backend.inject_xid(i, 79)
        backend.inject_xid(i, 94)
    return source.read()


class _Collector:
    def __init__(self, reading: GpuReading) -> None:
        self.reading = reading

    def collect(self) -> Iterator[Metric]:
        yield from gpu_metric_families(self.reading)


def exposition(reading: GpuReading) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(reading))
    return generate_latest(registry)
