"""Exporter cost on synthetic spool directories: /metrics latency, resident memory, CPU per poll.

Run by hand: ``python -m benchmarks.exporter_bench [--seconds 20]``. Ranks are simulated by a
separate writer process that refreshes every rank's snapshot once per second (as live ranks do);
8 fake GPUs sit behind the NVML interface. The baseline row is the same exporter over an empty
spool directory, measured in the same run.

Fresh scrapes go round three requests, one per poll: no Accept header (text), Prometheus 2.42's Accept header
(served text 0.0.4 by frexporter's encoder: web/negotiation.py), and the same header with ``?format=openmetrics``
(prometheus_client's OpenMetrics encoder, which that header was served before).

Then, in-process on one snapshot per size: frexporter's text encoder against prometheus_client's
``generate_latest`` on the same registry, the render for Prometheus' Accept header before (prometheus_client's
negotiation: OpenMetrics) and after (frexporter's), runs interleaved, and what gzip costs per compression level
(``--encoders-only`` for this part alone).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from frexporter.app import App
from frexporter.exporter import Exporter
from frexporter.model import NodeSnapshot
from frexporter.outputs import exposition
from frexporter.outputs.snapshot_metrics import SnapshotCollector
from frexporter.sources.nvml import NvmlSource
from frexporter.sources.ranks import RanksConfig, RanksSource
from frexporter.web import negotiation
from frexporter.web.server import GZIP_LEVEL, MetricsServer
from tests import spoolgen
from tests.fakes.gpu import FakeGpu, FakeGpuBackend

GZIP_LEVELS = (1, GZIP_LEVEL, 9)
# What Prometheus 2.42 sends (tests/unit/test_negotiation.py).
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
# Fresh scrapes, one per poll in turn: (path, Accept header).
FRESH_REQUESTS = {
    "text": ("/metrics", ""),
    "prometheus": ("/metrics", PROMETHEUS_ACCEPT),  # text 0.0.4, frexporter's encoder
    "openmetrics": ("/metrics?format=openmetrics", PROMETHEUS_ACCEPT),  # what Prometheus got before
}

WRITER = """
import sys, time
from pathlib import Path
from tests import spoolgen
directory, ranks, pgs, seconds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
end = time.time() + seconds
counter = 1
while time.time() < end:
    counter += 1
    for r in range(ranks):
        spoolgen.refresh(directory, "bench", r, counter, pgs=pgs, seq=counter, mapped=True)
    time.sleep(1.0)
"""


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(ranks: int, pgs: int, gpus: int, seconds: float, fresh_scrapes: int = 30,
            rounds: int = 50) -> dict[str, float]:
    directory = Path(tempfile.mkdtemp(prefix="frexporter-bench-"))
    for r in range(ranks):
        spoolgen.write_rank(directory, "bench", r, pgs=pgs, world=max(ranks, 1), mapped=True)
    args = [str(directory), str(ranks), str(pgs), str(seconds * 2 + 5)]
    writer = subprocess.Popen([sys.executable, "-c", WRITER, *args],
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    source = RanksSource(RanksConfig(directory=str(directory), poll_interval=1.0))
    backend = FakeGpuBackend([FakeGpu(uuid=f"GPU-{i:04d}") for i in range(gpus)])
    exporter = Exporter([(source, 1.0), (NvmlSource(backend), 5.0)], poll_interval=1.0)
    app = App(exporter=exporter, server=MetricsServer(exporter, "127.0.0.1", 0))
    app.start()
    base = f"http://127.0.0.1:{app.port}"
    try:
        # CPU of the poll loop alone: no scrapes during this window.
        polls0, cpu0, wall0 = exporter.polls, time.process_time(), time.monotonic()
        time.sleep(seconds)
        cpu_share = (time.process_time() - cpu0) / (time.monotonic() - wall0)
        polls = exporter.polls - polls0
        def scrape(path: str = "/metrics", accept: str = "") -> tuple[float, bytes]:
            request = urllib.request.Request(base + path, headers={"Accept": accept} if accept else {})
            t = time.perf_counter()
            with urllib.request.urlopen(request, timeout=10) as resp:
                data = resp.read()
            return time.perf_counter() - t, data

        # Fresh: the first scrape after each poll renders the new snapshot (what a Prometheus scraping every
        # 15 s sees), one request of FRESH_REQUESTS per poll in turn (each poll's families are collected once, by
        # its first scrape). Repeated: scrapes of the same snapshot share its render (concurrent scrapers, HA
        # pairs).
        fresh_by: dict[str, list[float]] = {name: [] for name in FRESH_REQUESTS}
        for i in range(fresh_scrapes * len(FRESH_REQUESTS)):
            seen = exporter.polls
            deadline = time.monotonic() + 10
            while exporter.polls == seen and time.monotonic() < deadline:
                time.sleep(0.002)
            name = list(FRESH_REQUESTS)[i % len(FRESH_REQUESTS)]
            fresh_by[name].append(scrape(*FRESH_REQUESTS[name])[0])
        fresh = fresh_by["text"]
        latencies = []
        body = b""
        for _ in range(200):
            elapsed, body = scrape()
            latencies.append(elapsed)
        series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
        encoders = compare_encoders(exporter.snapshot, rounds) if rounds else {}
        return {
            **encoders,
            "ranks": ranks, "pgs": pgs, "gpus": gpus,
            "metrics_fresh_median_ms": statistics.median(fresh) * 1e3 if fresh else None,
            "metrics_fresh_max_ms": max(fresh) * 1e3 if fresh else None,
            **{f"metrics_fresh_{name}_median_ms": statistics.median(times) * 1e3 if times else None
               for name, times in fresh_by.items() if name != "text"},
            "metrics_median_ms": statistics.median(latencies) * 1e3,
            "metrics_p99_ms": sorted(latencies)[int(len(latencies) * 0.99) - 1] * 1e3,
            "rss_mb": rss_bytes() / 2**20,
            "poll_cpu_percent": cpu_share * 100,
            "polls": polls,
            "series": series,
        }
    finally:
        app.stop()
        writer.kill()
        writer.wait()
        shutil.rmtree(directory, ignore_errors=True)


def compare_encoders(snapshot: NodeSnapshot, rounds: int) -> dict[str, float]:
    """Median milliseconds per render of one snapshot: collect alone, frexporter's encoder, generate_latest and
    the OpenMetrics generate_latest, and the render for Prometheus' Accept header as prometheus_client chooses it
    (before: OpenMetrics) and as frexporter does (after: its text encoder), in interleaved rounds so that a busy
    machine slows all alike; then gzip."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snapshot))
    body = exposition.encode(registry)
    assert body == generate_latest(registry), "the encoders disagree"
    before, before_type = choose_encoder(PROMETHEUS_ACCEPT)
    after, after_type = negotiation.choose(PROMETHEUS_ACCEPT)
    assert before_type.startswith("application/openmetrics-text") and after_type == exposition.CONTENT_TYPE
    assert after(registry) == body, "Prometheus is not served the custom encoder's text"
    contenders = {
        "collect": lambda: list(registry.collect()),
        "custom": lambda: exposition.encode(registry),
        "generate_latest": lambda: generate_latest(registry),
        "openmetrics": lambda: generate_openmetrics(registry),
        "prometheus_before": lambda: before(registry),
        "prometheus_after": lambda: after(registry),
    }
    for level in GZIP_LEVELS:
        contenders[f"gzip{level}"] = lambda level=level: gzip.compress(body, level)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, run in contenders.items():
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    row = {f"{name}_ms": statistics.median(samples) * 1e3 for name, samples in times.items()}
    row["text_bytes"] = len(body)
    for level in GZIP_LEVELS:
        row[f"gzip{level}_bytes"] = len(gzip.compress(body, level))
    return row


def print_encoders(rows: list[dict[str, float]]) -> None:
    print(f"\n{'ranks':>5} {'pgs':>4} {'series':>7} {'collect':>9} {'custom':>9} {'generate_latest':>16} "
          f"{'ratio':>6} {'openmetrics':>12}   text body; gzip by level: ms, size")
    for row in rows:
        if "custom_ms" not in row:
            continue
        gz = "  ".join(f"{level}: {row[f'gzip{level}_ms']:.2f} ms {row[f'gzip{level}_bytes'] / 1024:.0f} KiB"
                       for level in GZIP_LEVELS)
        print(f"{row['ranks']:>5} {row['pgs']:>4} {row['series']:>7} {row['collect_ms']:>6.2f} ms "
              f"{row['custom_ms']:>6.2f} ms {row['generate_latest_ms']:>13.2f} ms "
              f"{row['generate_latest_ms'] / row['custom_ms']:>5.2f}x {row['openmetrics_ms']:>9.2f} ms   "
              f"{row['text_bytes'] / 1024:.0f} KiB; {gz}")
    print("in-process medians of interleaved rounds on the last snapshot of each run; custom and generate_latest "
          "include collect and give identical bytes (text 0.0.4); ratio = generate_latest / custom.")
    print(f"\n{'ranks':>5} {'pgs':>4} {'before (OpenMetrics)':>21} {'after (text)':>13} {'ratio':>6}   "
          "render for Prometheus 2.42's Accept header, in-process")
    for row in rows:
        if "prometheus_after_ms" not in row:
            continue
        before, after = row["prometheus_before_ms"], row["prometheus_after_ms"]
        print(f"{row['ranks']:>5} {row['pgs']:>4} {before:>18.2f} ms {after:>10.2f} ms {before / after:>5.2f}x")
    print("before: prometheus_client's negotiation (OpenMetrics, its encoder); after: frexporter's "
          "(web/negotiation.py: text 0.0.4, its encoder); ratio = before / after.")


def print_fresh_by_accept(rows: list[dict[str, float]]) -> None:
    print(f"\n{'ranks':>5} {'pgs':>4} {'no Accept':>10} {'Prometheus':>11} {'?format=openmetrics':>20} {'ratio':>6}   "
          "fresh /metrics medians over HTTP")
    for row in rows:
        if row.get("metrics_fresh_prometheus_median_ms") is None:
            continue
        prometheus, openmetrics = row["metrics_fresh_prometheus_median_ms"], row["metrics_fresh_openmetrics_median_ms"]
        print(f"{row['ranks']:>5} {row['pgs']:>4} {row['metrics_fresh_median_ms']:>7.2f} ms {prometheus:>8.2f} ms "
              f"{openmetrics:>17.2f} ms {openmetrics / prometheus:>5.2f}x")
    print("Prometheus: its 2.42 Accept header, served text 0.0.4 (after); ?format=openmetrics: the same header forced "
          "to OpenMetrics, what it was served before; ratio = before / after. One request per poll in turn.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0, help="poll-only window per configuration")
    parser.add_argument("--rounds", type=int, default=50, help="interleaved rounds of the encoder comparison")
    parser.add_argument("--encoders-only", action="store_true",
                        help="only the encoder comparison (a short run of the writer, no latency measurements)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.encoders_only:
        rows = [measure(ranks, 16, 8, 3.0, fresh_scrapes=0, rounds=args.rounds) for ranks in (8, 64)]
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            print_encoders(rows)
        return
    rows = [
        measure(0, 0, 0, args.seconds, rounds=0),
        measure(8, 16, 8, args.seconds, rounds=args.rounds),
        measure(64, 16, 8, args.seconds, rounds=args.rounds),
    ]
    base = rows[0]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'ranks':>5} {'pgs':>4} {'gpus':>4} {'series':>7} {'fresh median':>13} {'fresh max':>10} "
          f"{'vs empty':>9} {'repeat median':>14} {'p99':>9} {'RSS MB':>7} {'poll CPU %':>10}")
    for row in rows:
        print(f"{row['ranks']:>5} {row['pgs']:>4} {row['gpus']:>4} {row['series']:>7} "
              f"{row['metrics_fresh_median_ms']:>10.2f} ms {row['metrics_fresh_max_ms']:>7.2f} ms "
              f"{row['metrics_fresh_median_ms'] / base['metrics_fresh_median_ms']:>8.1f}x "
              f"{row['metrics_median_ms']:>11.2f} ms {row['metrics_p99_ms']:>6.2f} ms {row['rss_mb']:>7.1f} "
              f"{row['poll_cpu_percent']:>10.2f}")
    print("fresh: the first scrape after a poll (renders the new snapshot; what a 15 s scrape sees); repeat: "
          "scrapes of one snapshot, which share its render. Budgets: fresh median < 10 ms at 8 ranks x 16 PGs, "
          "< 50 ms at 64; RSS < 80 MB; poll CPU < 2 %.")
    print_fresh_by_accept(rows)
    print_encoders(rows)


if __name__ == "__main__":
    main()
