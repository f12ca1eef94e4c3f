"""Smoke test of the real NVML path; run on a GPU machine.

    python -m benchmarks.gpu_smoke [--polls 20] [--interval 0.5] [--per-link]   # from the repo root

Reads every GPU through ``PynvmlBackend``, prints the GPU families as
Prometheus text, the series count per GPU, and how long ``collect()`` and
rendering take (the exporter's CPU budget is 2% of a core at a 1 s poll).
Exits 1 when NVML is unavailable, 2 when a reading had field errors.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from frexporter import naming as n
from frexporter.outputs.gpu_metrics import gpu_metric_families
from frexporter.sources.base import SourceError
from frexporter.sources.nvml import GpuReading, NvmlSource, PynvmlBackend


class _Collector:
    def __init__(self, reading: GpuReading, per_link: bool) -> None:
        self.reading, self.per_link = reading, per_link

    def collect(self) -> Iterator[Metric]:
        yield from gpu_metric_families(self.reading, nvlink_per_link=self.per_link)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--polls", type=int, default=20)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--per-link", action="store_true", help="NVLink errors per link, not summed")
    args = parser.parse_args()

    source = NvmlSource(PynvmlBackend())
    collect_ms: list[float] = []
    cpu_ms: list[float] = []
    reading: GpuReading | None = None
    try:
        for poll in range(max(1, args.polls)):
            if poll:
                time.sleep(args.interval)  # pacing a real poll loop, not a test wait
            wall, cpu = time.perf_counter(), time.process_time()
            reading = source.collect()
            collect_ms.append((time.perf_counter() - wall) * 1e3)
            cpu_ms.append((time.process_time() - cpu) * 1e3)
    except SourceError as exc:
        print(f"NVML unavailable: reason={exc.reason}: {exc}", file=sys.stderr)
        return 1
    finally:
        source.close()
    assert reading is not None

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(reading, args.per_link))
    started = time.perf_counter()
    text = generate_latest(registry).decode()
    render_ms = (time.perf_counter() - started) * 1e3
    print(text)

    per_gpu = Counter(
        sample.labels[n.L_GPU]
        for family in gpu_metric_families(reading, nvlink_per_link=args.per_link)
        for sample in family.samples
    )
    print(f"# driver {reading.driver_version}, {len(reading.gpus)} GPUs", file=sys.stderr)
    for gpu in reading.gpus:
        state = "LOST" if gpu.lost else "ok"
        print(
            f"#   gpu {gpu.index} {gpu.uuid} {gpu.name}: {state}, {per_gpu[str(gpu.index)]} series",
            file=sys.stderr,
        )
    print(
        f"# collect(): median {statistics.median(collect_ms):.2f} ms wall, "
        f"{statistics.median(cpu_ms):.2f} ms CPU, max {max(collect_ms):.2f} ms over {len(collect_ms)} polls "
        f"(first, with init: {collect_ms[0]:.2f} ms); render {render_ms:.2f} ms",
        file=sys.stderr,
    )
    if reading.field_errors:
        print(f"# field errors: {dict(reading.field_errors)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
