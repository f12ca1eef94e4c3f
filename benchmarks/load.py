"""Scrape load on one exporter: many concurrent scrapers with keep-alive connections against ``/metrics``.

A ``frexporter serve`` subprocess (the process that ships, not an in-process app) polls a synthetic spool
directory of 64 ranks x a few PGs, which a writer process keeps fresh the way live ranks do (one snapshot
per rank per second). Scraper processes, each running a share of the scraper threads, hold one HTTP/1.1
keep-alive connection per thread and scrape in a closed loop for the whole window. Reported: requests,
errors (any non-200, short body or connection failure; must be 0), latency percentiles, and the
exporter's CPU and resident memory during the window.

Run by hand: ``python -m benchmarks.load [--scrapers 50 --seconds 60 --ranks 64 --pgs 4]``.
Scrapers run in a few processes so that the client side's own GIL does not become the measured latency;
on a small machine the exporter, the writer and the scrapers share the cores, which the report states.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from frexporter import defaults
from tests import spoolgen

REPO = Path(__file__).resolve().parent.parent
JOB = "load"
# What Prometheus 2.42 sends: OpenMetrics preferred, classic text accepted.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")

WRITER = """
import sys, time
from pathlib import Path
from tests import spoolgen
directory, ranks, pgs = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
counter = 1
while True:
    counter += 1
    for r in range(ranks):
        spoolgen.refresh(directory, "load", r, counter, pgs=pgs, seq=counter)
    time.sleep(1.0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _proc_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _scraper_thread(port: int, path: str, accept: str, deadline: float, out: dict[str, Any]) -> None:
    latencies: list[float] = []
    errors: dict[str, int] = {}
    reconnects = 0
    conn: http.client.HTTPConnection | None = None
    while time.monotonic() < deadline:
        if conn is None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        started = time.perf_counter()
        try:
            conn.request("GET", path, headers={"Accept": accept})
            resp = conn.getresponse()
            body = resp.read()
            elapsed = time.perf_counter() - started
            length = resp.getheader("Content-Length")
            if resp.status != 200:
                errors[f"http_{resp.status}"] = errors.get(f"http_{resp.status}", 0) + 1
            elif (length is not None and int(length) != len(body)) or b"frexporter_rank_up" not in body:
                errors["bad_body"] = errors.get("bad_body", 0) + 1
            else:
                latencies.append(elapsed)
            if resp.will_close:  # allowed, but each one costs a new connection: counted apart from errors
                conn.close()
                conn = None
                reconnects += 1
        except (OSError, http.client.HTTPException) as e:
            errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
            if conn is not None:
                conn.close()
            conn = None
    if conn is not None:
        conn.close()
    out["latencies"] = latencies
    out["errors"] = errors
    out["reconnects"] = reconnects


def _scraper_process(port: int, path: str, accept: str, threads: int, start_at: float, seconds: float,
                     results: Any) -> None:
    # Every process starts its clock at the same wall time, so all scrapers overlap for the full window.
    time.sleep(max(0.0, start_at - time.time()))
    deadline = time.monotonic() + seconds
    outs: list[dict[str, Any]] = [{} for _ in range(threads)]
    workers = [threading.Thread(target=_scraper_thread, args=(port, path, accept, deadline, outs[i]))
               for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    latencies = [x for o in outs for x in o.get("latencies", [])]
    errors: dict[str, int] = {}
    for o in outs:
        for k, v in o.get("errors", {}).items():
            errors[k] = errors.get(k, 0) + v
    results.put({"latencies": latencies, "errors": errors, "reconnects": sum(o.get("reconnects", 0) for o in outs)})


def _wait_ready(port: int, proc: subprocess.Popen[bytes], log_path: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"frexporter serve exited with {proc.returncode} (log: {log_path})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
                if b"frexporter_rank_up" in resp.read():
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError("frexporter serve did not serve rank metrics in time")


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


def run(ranks: int, pgs: int, scrapers: int, procs: int, seconds: float, poll_interval: float, path: str,
        accept: str) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="frexporter-load-"))
    for r in range(ranks):
        spoolgen.write_rank(directory, JOB, r, pgs=pgs, world=ranks)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(directory), str(ranks), str(pgs)], env=env,
                              stdin=subprocess.PIPE)
    port = _free_port()
    # A file, not a pipe: nobody reads the exporter's log during the run, and a full pipe would block it.
    log = open(directory.parent / f"{directory.name}.log", "wb")  # noqa: SIM115 - closed in finally
    exporter = subprocess.Popen(
        [sys.executable, "-m", "frexporter", "serve", "--dir", str(directory), "--listen", f"127.0.0.1:{port}",
         "--poll-interval", str(poll_interval), "--no-nvml", "--evidence-dir", "",
         # Room for every scraper: this measures serving them, not refusing them.
         "--web-max-connections", str(max(defaults.WEB_MAX_CONNECTIONS, scrapers + 16))],
        env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        _wait_ready(port, exporter, log.name)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            series = sum(1 for line in resp.read().decode().splitlines() if line and not line.startswith("#"))
        results: Any = mp.get_context("spawn").Queue()
        share = [scrapers // procs + (1 if i < scrapers % procs else 0) for i in range(procs)]
        start_at = time.time() + 3.0  # time for the spawned scraper processes to import and line up
        clients = [mp.get_context("spawn").Process(target=_scraper_process,
                                                   args=(port, path, accept, n, start_at, seconds, results))
                   for n in share if n]
        for c in clients:
            c.start()
        time.sleep(max(0.0, start_at - time.time()))
        cpu0, wall0 = _proc_cpu_seconds(exporter.pid), time.monotonic()
        rss_max = 0
        while time.monotonic() - wall0 < seconds:
            rss_max = max(rss_max, _proc_rss_bytes(exporter.pid))
            time.sleep(1.0)
        cpu = _proc_cpu_seconds(exporter.pid) - cpu0
        wall = time.monotonic() - wall0
        parts = [results.get(timeout=seconds + 120) for _ in clients]
        for c in clients:
            c.join(timeout=30)
        latencies = sorted(x for p in parts for x in p["latencies"])
        errors: dict[str, int] = {}
        for p in parts:
            for k, v in p["errors"].items():
                errors[k] = errors.get(k, 0) + v
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as resp:
            healthy_after = resp.status == 200
        return {
            "ranks": ranks, "pgs": pgs, "series": series, "scrapers": scrapers, "scraper_processes": len(clients),
            "seconds": seconds, "poll_interval": poll_interval, "path": path, "accept": accept,
            "cpus": os.cpu_count(), "requests": len(latencies) + sum(errors.values()),
            "ok": len(latencies), "errors": errors, "server_closed_connections": sum(p["reconnects"] for p in parts),
            "requests_per_second": round(len(latencies) / seconds, 1),
            "latency_ms": {"p50": round(_pct(latencies, 0.50) * 1e3, 2), "p90": round(_pct(latencies, 0.90) * 1e3, 2),
                           "p99": round(_pct(latencies, 0.99) * 1e3, 2),
                           "max": round(latencies[-1] * 1e3, 2) if latencies else None,
                           "mean": round(statistics.fmean(latencies) * 1e3, 2) if latencies else None},
            "exporter_cpu_cores": round(cpu / wall, 3), "exporter_rss_mb_max": round(rss_max / 2**20, 1),
            "healthz_after": healthy_after,
        }
    finally:
        exporter.terminate()
        try:
            exporter.wait(timeout=15)
        except subprocess.TimeoutExpired:
            exporter.kill()
            exporter.wait()
        writer.kill()
        writer.wait()
        log.close()
        shutil.rmtree(directory, ignore_errors=True)
        os.unlink(log.name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--pgs", type=int, default=4)
    parser.add_argument("--scrapers", type=int, default=50, help="concurrent keep-alive scraper threads")
    parser.add_argument("--procs", type=int, default=2, help="processes the scraper threads are spread over")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--poll-interval", type=float, default=1.0)
    parser.add_argument("--path", default="/metrics")
    parser.add_argument("--accept", default=PROMETHEUS_ACCEPT, help="Accept header (default: Prometheus 2.42's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    row = run(args.ranks, args.pgs, args.scrapers, args.procs, args.seconds, args.poll_interval, args.path,
              args.accept)
    if args.json:
        print(json.dumps(row, indent=1))
    else:
        lat = row["latency_ms"]
        print(f"{row['ranks']} ranks x {row['pgs']} PGs ({row['series']} series), {row['scrapers']} keep-alive "
              f"scrapers in {row['scraper_processes']} processes for {row['seconds']:.0f} s, poll "
              f"{row['poll_interval']} s, {row['cpus']} CPUs shared by exporter, writer and scrapers")
        print(f"requests {row['requests']}  ok {row['ok']}  errors {sum(row['errors'].values())} {row['errors']}  "
              f"{row['requests_per_second']} req/s  connections closed by the server "
              f"{row['server_closed_connections']}")
        print(f"latency ms: p50 {lat['p50']}  p90 {lat['p90']}  p99 {lat['p99']}  max {lat['max']}  "
              f"mean {lat['mean']}")
        print(f"exporter: {row['exporter_cpu_cores']} cores busy, RSS max {row['exporter_rss_mb_max']} MB, "
              f"/healthz after: {'200' if row['healthz_after'] else 'FAILED'}")
    return 0 if not row["errors"] and row["healthz_after"] else 1


if __name__ == "__main__":
    sys.exit(main())
