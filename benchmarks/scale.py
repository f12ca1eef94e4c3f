"""The shipped rules and ``analyze --prometheus`` at cluster scale, by simulation in a real Prometheus.

1. Capacity: a real ``/metrics`` of one node (8 ranks x 8 PGs from tests/spoolgen, 8 fake GPUs, after
   the ranks made progress) is counted: series per rank, per PG, per GPU, per node, per 1k-GPU job.
2. Simulation: that exposition is the template for every node of an N-node job (8 ranks per node,
   global rank = node x 8 + local rank), written as OpenMetrics with timestamps: a healthy job whose
   seqs advance every 15 s step, then one desync: from ``desync_at`` on, every rank but the culprit has
   enqueued collective S+1 of one PG and waits in it, the culprit never enqueued it, and all other PGs
   stop. ``promtool tsdb create-blocks-from openmetrics`` turns it into TSDB blocks.
3. Prometheus 2.42 starts on those blocks with ``frexporter.rules.render_rules()``; every alert and
   recording rule expression is timed through ``/api/v1/query`` (``stats=all``) at the evaluation time,
   and the alerts' answers are checked (the desync alert must name exactly the culprit). Meanwhile the
   rule manager runs at a 1 h interval, so that it does not evaluate the same expressions on the same
   cores; afterwards it is reloaded at the shipped 15 s and its own per-group evaluation times and
   missed iterations are read from ``/api/v1/rules`` and its ``/metrics``.
4. ``frexporter.analysis.report.from_prometheus`` (what ``frexporter analyze --prometheus`` runs) is
   timed and must name the culprit; the CLI is timed too.

The series must still be live when ``analyze`` reads them at wall-clock time, so the simulated data runs
from ``history`` seconds before generation to ``margin`` seconds after it (enough for block creation,
start-up and analyze; values are frozen after the desync, so the later samples only keep the series
fresh, as scrapes would, and all but heartbeats and ``up`` are written every 3 minutes there). The rules
are evaluated afterwards at the fixed time Prometheus became ready (the API's ``time`` parameter).
Prometheus cannot append recording-rule results before the end of the imported blocks, so its own rule
manager logs "out of bounds", and rules that read recorded series are timed with those series' own
expressions inlined.

Run by hand: ``python -m benchmarks.scale --nodes 1024`` (the full 8192-rank job), or smaller with
``--nodes``; ``--extrapolate-to 1024`` prints the linear extrapolation of a smaller run, labelled so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.rulefile import render_rules

REPO = Path(__file__).resolve().parent.parent
JOB = "scale"
RULE_INTERVAL = "15s"  # the shipped evaluation interval
RANKS_PER_NODE = 8
PGS = 8
GPUS_PER_NODE = 8
STEP = 15.0
LAGGING_PG = "3"
# Series Prometheus adds per scrape target (up, scrape_duration_seconds, scrape_samples_scraped,
# scrape_samples_post_metric_relabeling, scrape_series_added).
SCRAPE_SERIES_PER_TARGET = 5
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


# ---------------------------------------------------------------------------------------- the template


@dataclass(frozen=True)
class Series:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


def real_exposition(ranks: int = RANKS_PER_NODE, pgs: int = PGS, gpus: int = GPUS_PER_NODE) -> str:
    """``/metrics`` of one node as the exporter serves it, after its ranks made progress."""
    from frexporter.app import App
    from frexporter.exporter import Exporter
    from frexporter.sources.nvml import NvmlSource
    from frexporter.sources.ranks import RanksConfig, RanksSource
    from frexporter.web.server import MetricsServer
    from tests import spoolgen
    from tests.fakes.gpu import FakeGpu, FakeGpuBackend

    directory = Path(tempfile.mkdtemp(prefix="frexporter-scale-"))
    try:
        for r in range(ranks):
            spoolgen.write_rank(directory, JOB, r, pgs=pgs, world=ranks, seq=10)
        source = RanksSource(RanksConfig(directory=str(directory)))
        backend = FakeGpuBackend([FakeGpu(uuid=f"GPU-{i:04d}") for i in range(gpus)])
        exporter = Exporter([(source, 0.0), (NvmlSource(backend), 0.0)], poll_interval=1.0)
        exporter.poll_once()
        # A second snapshot with progress: the steady state also has last-progress timestamps.
        for r in range(ranks):
            spoolgen.refresh(directory, JOB, r, counter=2, pgs=pgs, seq=11)
        exporter.poll_once()
        app = App(exporter=exporter, server=MetricsServer(exporter, "127.0.0.1", 0))
        app.server.start()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{app.port}/metrics", timeout=10) as resp:
                return resp.read().decode()
        finally:
            app.server.stop()
            source.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def parse_exposition(text: str) -> list[Series]:
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"unparsed exposition line: {line!r}")
        labels = tuple(_LABEL.findall(m.group(2) or ""))
        out.append(Series(m.group(1), labels, float(m.group(3))))
    return out


def classify(series: list[Series]) -> dict[str, list[Series]]:
    """Per rank (``rank`` label), per GPU (``gpu`` label), per node (the rest)."""
    out: dict[str, list[Series]] = {"rank": [], "gpu": [], "node": []}
    for s in series:
        out["rank" if s.label("rank") is not None else "gpu" if s.label("gpu") is not None else "node"].append(s)
    return out


def capacity(series: list[Series], pgs: int = PGS) -> dict[str, Any]:
    from frexporter.model import DURATION_BUCKETS

    groups = classify(series)
    per_pg = [s for s in groups["rank"] if s.label("pg") is not None]
    per_rank = len(groups["rank"]) / RANKS_PER_NODE
    per_gpu = len(groups["gpu"]) / GPUS_PER_NODE
    per_node = len(series) + SCRAPE_SERIES_PER_TARGET
    # Present only some of the time, so absent from the template; counted here as their worst case.
    inflight_extra = 1  # frexporter_pg_oldest_inflight_start_timestamp_seconds while a collective waits
    nccl_timing_extra = 1  # frexporter_pg_last_started_seq with TORCH_NCCL_ENABLE_TIMING=1
    histogram_per_op = len(DURATION_BUCKETS) + 1 + 2 + 1  # buckets, +Inf, _sum and _count, bytes counter
    nodes_per_1k_gpus = math.ceil(1000 / GPUS_PER_NODE)
    return {
        "template": f"{RANKS_PER_NODE} ranks x {pgs} PGs + {GPUS_PER_NODE} GPUs",
        "per_pg_per_rank": len(per_pg) / (RANKS_PER_NODE * pgs),
        "per_rank": per_rank,
        "per_rank_worst": per_rank + pgs * (inflight_extra + nccl_timing_extra),
        "per_gpu": per_gpu,
        "per_node": per_node,
        "per_node_breakdown": {"rank": len(groups["rank"]), "gpu": len(groups["gpu"]),
                               "node": len(groups["node"]), "scrape": SCRAPE_SERIES_PER_TARGET},
        "collective_histogram_per_node_per_pg_op": histogram_per_op,
        "per_1k_gpu_job": per_node * nodes_per_1k_gpus,
        "per_1k_gpu_job_worst": (per_node + RANKS_PER_NODE * pgs * (inflight_extra + nccl_timing_extra))
                                * nodes_per_1k_gpus,
        "per_8192_rank_job": per_node * 8192 // RANKS_PER_NODE,
        "by_metric": dict(Counter(s.name for s in series).most_common()),
    }


# ---------------------------------------------------------------------------------------- the simulation


# Series sampled every step after generation too; the rest (frozen since the desync) every
# MARGIN_EVERY steps there (3 minutes), which keeps them inside Prometheus' 5-minute lookback at a
# fraction of the cost.
LIVE_SERIES = frozenset({"frexporter_rank_heartbeat_timestamp_seconds", "frexporter_rank_up", "up"})
MARGIN_EVERY = 12


@dataclass
class Scenario:
    nodes: int
    start: float
    desync_at: float
    generated: float
    end: float
    culprit: int
    times: list[float] = field(default_factory=list)
    sparse_times: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = int((self.end - self.start) // STEP)
        self.times = [self.start + i * STEP for i in range(n + 1)]
        self.sparse_times = [t for i, t in enumerate(self.times) if t <= self.generated or i % MARGIN_EVERY == 0]

    @property
    def world(self) -> int:
        return self.nodes * RANKS_PER_NODE


def _fmt_labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def _seq_at(t: float, sc: Scenario) -> int:
    """A healthy job's collective seq at time t: 10 collectives per 15 s step, frozen at the desync."""
    return 1000 + 10 * int((min(t, sc.desync_at) - sc.start) // STEP)


def write_openmetrics(path: Path, template: list[Series], sc: Scenario) -> dict[str, int]:
    """Every node's series over the scenario's time range, family by family, each series in time order."""
    groups = classify(template)
    local_ranks = sorted({int(s.label("rank") or 0) for s in groups["rank"]})
    families: dict[str, list[Series]] = {}
    for s in template:
        families.setdefault(s.name, []).append(s)
    families.setdefault("up", [])
    stuck = _seq_at(sc.desync_at, sc)  # S: completed everywhere; S + 1 is the collective the culprit skips
    after = [t for t in sc.sparse_times if t >= sc.desync_at]
    counts = {"series": 0, "samples": 0}
    with open(path, "w", buffering=1 << 22) as f:
        for name in sorted(families):
            f.write(f"# TYPE {name} gauge\n")
            if name == "up":
                for node in range(sc.nodes):
                    _emit(f, name, {"instance": _instance(node), "job": "frexporter"}, sc.times, lambda t: 1.0,
                          counts)
                continue
            times = sc.times if name in LIVE_SERIES else sc.sparse_times
            if name == "frexporter_pg_oldest_inflight_start_timestamp_seconds":
                continue  # written below: it exists only while something waits
            for s in families[name]:
                for node in range(sc.nodes):
                    if s.label("rank") is not None:
                        local = int(s.label("rank") or 0)
                        rank = node * RANKS_PER_NODE + local_ranks.index(local)
                        labels = _rank_labels(s, node, rank, sc)
                        _emit(f, name, labels, times, _rank_value(s, rank, stuck, sc), counts)
                    else:
                        _emit(f, name, _node_labels(s, node), times, lambda t, v=s.value: v, counts)
        name = "frexporter_pg_oldest_inflight_start_timestamp_seconds"
        f.write(f"# TYPE {name} gauge\n")
        pg_series = [s for s in families["frexporter_pg_last_enqueued_seq"] if s.label("pg") == LAGGING_PG]
        for s in pg_series:
            for node in range(sc.nodes):
                rank = node * RANKS_PER_NODE + local_ranks.index(int(s.label("rank") or 0))
                if rank != sc.culprit:
                    _emit(f, name, _rank_labels(s, node, rank, sc), after, lambda t: sc.desync_at, counts)
        f.write("# EOF\n")
    return counts


def _instance(node: int) -> str:
    return f"node-{node:04d}:9464"


def _node_labels(s: Series, node: int) -> dict[str, str]:
    labels = dict(s.labels)
    if "gpu_uuid" in labels:
        labels["gpu_uuid"] = f"GPU-{node:04d}-{labels.get('gpu', '0')}"
    return {**labels, "instance": _instance(node), "job": "frexporter"}


def _rank_labels(s: Series, node: int, rank: int, sc: Scenario) -> dict[str, str]:
    labels = dict(s.labels)
    labels["job_id"] = JOB
    labels["rank"] = str(rank)
    for key, value in (("local_rank", str(rank % RANKS_PER_NODE)), ("hostname", f"node-{node:04d}"),
                       ("pid", str(100000 + rank)), ("world_size", str(sc.world)),
                       ("gpu_uuid", f"GPU-{node:04d}-{rank % RANKS_PER_NODE}")):
        if key in labels:
            labels[key] = value
    return {**labels, "instance": _instance(node), "job": "frexporter"}


def _rank_value(s: Series, rank: int, stuck: int, sc: Scenario) -> Any:
    lagging = s.label("pg") == LAGGING_PG
    waiting = lagging and rank != sc.culprit

    def enqueued(t: float) -> float:
        return float(stuck + 1 if waiting and t >= sc.desync_at else _seq_at(t, sc))

    def completed(t: float) -> float:
        return float(_seq_at(t, sc))

    if s.name == "frexporter_pg_last_enqueued_seq":
        return enqueued
    if s.name == "frexporter_pg_last_completed_seq":
        return completed
    if s.name == "frexporter_pg_inflight_collectives":
        return lambda t: enqueued(t) - completed(t)
    if s.name == "frexporter_pg_last_progress_timestamp_seconds":
        return lambda t: min(t, sc.desync_at)
    if s.name == "frexporter_rank_heartbeat_timestamp_seconds":
        return lambda t: t - 0.5  # a snapshot written half a second before each scrape
    return lambda t, v=s.value: v


def _emit(f: Any, name: str, labels: dict[str, str], times: list[float], value: Any, counts: dict[str, int]) -> None:
    prefix = name + _fmt_labels(labels) + " "
    f.write("".join(f"{prefix}{value(t):.17g} {t:.3f}\n" for t in times))
    counts["series"] += 1
    counts["samples"] += len(times)


# ---------------------------------------------------------------------------------------- Prometheus


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 600.0) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:  # Prometheus says why in the body (a bad query: status "error")
        return json.loads(e.read() or b"{}")


def instant(base: str, expr: str, at: float) -> tuple[dict[str, Any], float]:
    url = base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}", "stats": "all"})
    started = time.perf_counter()
    doc = _get(url)
    return doc, time.perf_counter() - started


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run(nodes: int, history: float, margin: float, repeats: int, keep: bool) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="frexporter-scale-"))
    report: dict[str, Any] = {"nodes": nodes, "ranks": nodes * RANKS_PER_NODE, "pgs": PGS, "step_s": STEP,
                              "history_s": history, "margin_s": margin, "cpus": os.cpu_count()}
    prometheus: subprocess.Popen[bytes] | None = None
    try:
        template = parse_exposition(real_exposition())
        report["capacity"] = capacity(template)
        generated = time.time()
        sc = Scenario(nodes=nodes, start=generated - history, desync_at=generated - history / 2, generated=generated,
                      end=generated + margin, culprit=(nodes * RANKS_PER_NODE) // 2 + 5)
        report["culprit"] = {"rank": sc.culprit, "pg": LAGGING_PG}
        om = work / "data.om"
        t0 = time.monotonic()
        counts = write_openmetrics(om, template, sc)
        report["generate_s"] = round(time.monotonic() - t0, 1)
        report.update({"series_generated": counts["series"], "samples_generated": counts["samples"],
                       "openmetrics_mb": round(om.stat().st_size / 2**20, 1), "steps": len(sc.times)})
        data = work / "tsdb"
        t0 = time.monotonic()
        subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(om), str(data)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        report["create_blocks_s"] = round(time.monotonic() - t0, 1)
        if not keep:
            om.unlink()
        rules = work / "frexporter.rules.yml"
        rules.write_text(render_rules())
        config = work / "prometheus.yml"
        # The rule manager is held at a 1 h interval while the query API is timed (at 15 s it would evaluate
        # the same expressions concurrently on the same cores), then reloaded at 15 s for its own timings.
        write_config(config, rules, "1h")
        subprocess.run(["promtool", "check", "config", str(config)], check=True, stdout=subprocess.DEVNULL)
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        prometheus = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={data}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=30d", "--log.level=error",
             "--web.enable-lifecycle"],
            stdout=subprocess.DEVNULL, stderr=open(work / "prometheus.log", "wb"))  # noqa: SIM115 - lives with it
        _wait_ready(base, prometheus)
        report["prometheus_ready_s"] = round(time.monotonic() - t0, 1)
        at = time.time()
        if at > sc.end:
            raise RuntimeError(f"the pipeline took {at - generated:.0f}s, beyond the {margin:.0f}s margin: "
                               "rerun with a larger --margin")
        report["eval_time_after_desync_s"] = round(at - sc.desync_at, 1)
        report["evaluated_at"] = at
        # analyze reads the live series at the wall-clock time, so it goes first; the rules are then
        # evaluated at the fixed time ``at`` through the API's time parameter, however long they take.
        report["analyze"] = time_analyze([base], JOB, [("missing_rank", LAGGING_PG, [sc.culprit])], 60.0)
        if time.time() > sc.end:
            raise RuntimeError("analyze ran past the simulated data: rerun with a larger --margin")
        report["series_in_prometheus"] = int(float(
            instant(base, 'count({__name__=~".+"})', at)[0]["data"]["result"][0]["value"][1]))
        report["rules"] = evaluate_rules(base, at, repeats, sc)
        write_config(config, rules, RULE_INTERVAL)
        report["rule_manager"] = rule_manager_timings(base)
        report["prometheus_rss_mb"] = round(_rss_mb(prometheus.pid), 1)
        return report
    finally:
        if prometheus is not None:
            prometheus.terminate()
            try:
                prometheus.wait(timeout=60)
            except subprocess.TimeoutExpired:
                prometheus.kill()
                prometheus.wait()
        if keep:
            report["workdir"] = str(work)
        else:
            shutil.rmtree(work, ignore_errors=True)


def write_config(path: Path, rules: Path, evaluation_interval: str) -> None:
    path.write_text(yaml.safe_dump({"global": {"scrape_interval": "15s", "evaluation_interval": evaluation_interval},
                                    "rule_files": [str(rules)]}))


def _prometheus_metric(base: str, name: str) -> dict[str, float]:
    """One metric family from Prometheus' own /metrics, by its ``rule_group`` label."""
    with urllib.request.urlopen(base + "/metrics", timeout=60) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            group = re.search(r'rule_group="[^"]*;([^"]*)"', line)
            out[group.group(1) if group else line] = float(line.rsplit(" ", 1)[1])
    return out


def rule_manager_timings(base: str, rounds: int = 2, timeout: float = 600.0) -> dict[str, Any]:
    """Prometheus' own evaluation of the rule groups at the shipped 15 s interval (groups run in
    parallel; a group slower than the interval skips iterations): after ``rounds`` evaluations of each."""
    reloaded = time.time()
    with urllib.request.urlopen(urllib.request.Request(base + "/-/reload", method="POST"), timeout=60):
        pass
    deadline = time.monotonic() + timeout
    seen: dict[str, set[str]] = {}
    groups: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        groups = _get(base + "/api/v1/rules")["data"]["groups"]
        for g in groups:
            if g["lastEvaluation"] and _rfc3339(g["lastEvaluation"]) > reloaded:
                seen.setdefault(g["name"], set()).add(g["lastEvaluation"])
        if groups and all(len(seen.get(g["name"], ())) >= rounds for g in groups):
            break
        time.sleep(1.0)
    missed = _prometheus_metric(base, "prometheus_rule_group_iterations_missed_total")
    return {
        "interval_s": 15.0,
        "rounds_seen": {name: len(v) for name, v in seen.items()},
        "groups": [{"group": g["name"], "evaluation_ms": round(g["evaluationTime"] * 1e3, 1),
                    "iterations_missed": missed.get(g["name"], 0.0),
                    "rules": {r["name"]: round(r["evaluationTime"] * 1e3, 1) for r in g["rules"]}}
                   for g in groups],
    }


def _rfc3339(text: str) -> float:
    """Prometheus' RFC 3339 timestamps (nanosecond fractions, Z or an offset) as unix seconds."""
    from datetime import datetime

    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$", text)
    if m is None:
        raise ValueError(f"not an RFC 3339 time: {text!r}")
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    whole = datetime.fromisoformat(m.group(1) + zone).timestamp()
    return whole + float(m.group(2) or 0.0)


def _wait_ready(base: str, proc: subprocess.Popen[bytes], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/-/ready", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("prometheus not ready in time")


def _inline_records(expr: str, records: dict[str, str]) -> tuple[str, bool]:
    """``expr`` with every recording rule it reads replaced by that rule's own expression: recorded series
    cannot be written before the end of the imported blocks, so the query computes them itself."""
    inlined = False
    # Until none is left: a recording rule may read another one (the straggler lag reads the median).
    while any(re.search(rf"(?<![\w:]){re.escape(name)}(?![\w:])", expr) for name in records):
        expr = _inline_once(expr, records)
        inlined = True
    return expr, inlined


def _inline_once(expr: str, records: dict[str, str]) -> str:
    for name, body in records.items():
        pattern = re.compile(rf"(?<![\w:]){re.escape(name)}(?![\w:])")
        if pattern.search(expr):
            # "group_left NAME" would read as "group_left (labels...)" once NAME is a parenthesised expression:
            # give such a modifier its empty label list first.
            expr = re.sub(rf"\b(group_(?:left|right))(\s+)(?={re.escape(name)}(?![\w:]))", r"\1 ()\2", expr)
            # A range over a recorded series becomes a subquery at the rules' evaluation interval.
            expr = re.sub(rf"(?<![\w:]){re.escape(name)}\[(\w+)\]",
                          lambda m, b=body: f"({b.strip()})[{m[1]}:{RULE_INTERVAL}]", expr)
            expr = pattern.sub(lambda _m, b=body: f"({b.strip()})", expr)
    return expr


def evaluate_rules(base: str, at: float, repeats: int, sc: Scenario) -> list[dict[str, Any]]:
    out = []
    groups = yaml.safe_load(render_rules())["groups"]
    # A record's PromQL comments ("# @scale") would swallow what follows it once inlined on one line.
    records = {r["record"]: re.sub(r"\s#[^\n]*", "", r["expr"]) for g in groups for r in g["rules"] if "record" in r}
    for group in groups:
        for rule in group["rules"]:
            name = rule.get("alert") or rule.get("record")
            expr, inlined = _inline_records(rule["expr"], records)
            walls, evals, result = [], [], []
            for _ in range(repeats):
                doc, wall = instant(base, expr, at)
                if doc.get("status") != "success":
                    raise RuntimeError(f"{name}: {doc}")
                walls.append(wall)
                timings = doc["data"].get("stats", {}).get("timings", {})
                evals.append(float(timings.get("evalTotalTime", wall)))
                result = doc["data"]["result"]
            row: dict[str, Any] = {
                "group": group["name"], "rule": name, "kind": "alert" if "alert" in rule else "record",
                "results": len(result), "wall_ms_median": round(statistics.median(walls) * 1e3, 1),
                "eval_ms_median": round(statistics.median(evals) * 1e3, 1), "wall_ms_first": round(walls[0] * 1e3, 1),
                "inlined_records": inlined,
            }
            if "alert" in rule:
                named = sorted((r["metric"].get("rank", ""), r["metric"].get("pg", "")) for r in result)
                row["names"] = named
                row["correct"] = named == _expected_alert(name, at, sc)
            out.append(row)
    return out


def _expected_alert(name: str, at: float, sc: Scenario) -> list[tuple[str, str]]:
    """What each alert expression must return at ``at``: only the desync, and its budget once it is late."""
    if name == "FrexporterCollectiveDesync":
        return [(str(sc.culprit), LAGGING_PG)]
    # The lagging PG's watchdog timeout in the template is 600 s; the alert's condition turns true at
    # 0.5 T - 30 s of waiting.
    if name == "FrexporterWatchdogBudget" and at - sc.desync_at >= 0.5 * 600 - 30:
        return [("", LAGGING_PG)]
    return []


def time_analyze(urls: list[str], job: str, expected: list[tuple[str, str, list[int]]],
                 stuck_after: float | None = None) -> dict[str, Any]:
    """``frexporter analyze --prometheus`` over ``urls`` as a CLI, then in this process
    (``report.from_prometheus``), then in this process reading every PG's series (as a hang spread into every PG
    makes it read): wall times, verdicts, and whether all are exactly ``expected`` (kind, PG, ranks). The CLI
    first: the in-process analysis holds this process's GIL, which a simulation serving scrapes
    from a thread of it (benchmarks/scale_live.py) needs; at 32,768 ranks the scrapes it delays time out."""
    from frexporter.postmortem import report as analysis_report

    argv = [sys.executable, "-m", "frexporter", "analyze", "--job-id", job, "--json"]
    for url in urls:
        argv += ["--prometheus", url]
    if stuck_after is not None:
        argv += ["--stuck-after", f"{stuck_after:g}"]
    t0 = time.perf_counter()
    cli = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                         timeout=1800)
    cli_s = time.perf_counter() - t0
    cli_named = sorted((v["kind"], v["pg"], v["ranks"]) for v in json.loads(cli.stdout or "[]"))
    t0 = time.perf_counter()
    rep = analysis_report.from_prometheus(urls, job, stuck_after)
    in_process = time.perf_counter() - t0
    named = sorted((v.kind, v.pg, list(v.ranks)) for v in rep.verdicts)
    t0 = time.perf_counter()
    every = analysis_report.from_prometheus(urls, job, stuck_after, narrow=False)
    every_pg_s = time.perf_counter() - t0
    every_named = sorted((v.kind, v.pg, list(v.ranks)) for v in every.verdicts)
    return {"in_process_s": round(in_process, 2), "cli_s": round(cli_s, 2), "every_pg_s": round(every_pg_s, 2),
            "ranks_seen": len(rep.ranks), "pgs_read": len({(r.job_id, pg.name) for r in rep.ranks for pg in r.pgs}),
            "pgs_idle": rep.unread_pgs, "verdicts": named[:5], "cli_verdicts": cli_named[:5],
            "cli_error": cli.stderr[-500:] if cli.returncode else "",
            "correct": named == expected and cli_named == named and every_named == named}


# ---------------------------------------------------------------------------------------- report


def print_report(r: dict[str, Any], extrapolate_to: int | None) -> None:
    cap = r["capacity"]
    print(f"Capacity (measured from a real /metrics of {cap['template']}; scrape series added by Prometheus):")
    print(f"  per PG per rank {cap['per_pg_per_rank']:.0f}   per rank {cap['per_rank']:.0f} (worst case "
          f"{cap['per_rank_worst']:.0f}: +1 per PG in flight, +1 per PG with NCCL timing)   per GPU "
          f"{cap['per_gpu']:.0f}")
    b = cap["per_node_breakdown"]
    print(f"  per node {cap['per_node']} (ranks {b['rank']}, GPUs {b['gpu']}, node {b['node']}, scrape "
          f"{b['scrape']}); + {cap['collective_histogram_per_node_per_pg_op']} per (PG, op) once collective "
          "durations are observed")
    print(f"  per 1k-GPU job (125 nodes) {cap['per_1k_gpu_job']:,} (worst case {cap['per_1k_gpu_job_worst']:,})"
          f"   per 8192-rank job {cap['per_8192_rank_job']:,}")
    print(f"\nSimulation: {r['nodes']} nodes x {RANKS_PER_NODE} ranks = {r['ranks']} ranks x {PGS} PGs, "
          f"{r['steps']} steps of {STEP:.0f} s ({r['history_s']:.0f} s history + {r['margin_s']:.0f} s margin), "
          f"{r['cpus']} CPUs")
    print(f"  generated {r['series_generated']:,} series, {r['samples_generated']:,} samples, "
          f"{r['openmetrics_mb']} MB OpenMetrics in {r['generate_s']} s; promtool create-blocks "
          f"{r['create_blocks_s']} s; Prometheus ready in {r['prometheus_ready_s']} s, RSS {r['prometheus_rss_mb']} MB")
    print(f"  series live in Prometheus at the evaluation time: {r['series_in_prometheus']:,}; culprit rank "
          f"{r['culprit']['rank']} in PG {r['culprit']['pg']}, evaluated {r['eval_time_after_desync_s']} s after "
          "the desync")
    print(f"\n  {'rule':<58} {'kind':<6} {'results':>7} {'eval ms':>8} {'wall ms':>8} {'1st wall':>8}  check")
    for row in r["rules"]:
        check = "" if "correct" not in row else ("ok" if row["correct"] else "WRONG")
        if "names" in row:
            check += f" names {row['names'][:3]}"
        rule = row["rule"] + (" (records inlined)" if row["inlined_records"] else "")
        print(f"  {rule:<58} {row['kind']:<6} {row['results']:>7} {row['eval_ms_median']:>8} "
              f"{row['wall_ms_median']:>8} {row['wall_ms_first']:>8}  {check}")
    total = sum(row["eval_ms_median"] for row in r["rules"])
    print(f"  all rules together: {total:.0f} ms of query evaluation per evaluation round")
    rm = r.get("rule_manager")
    if rm:
        print(f"\n  Prometheus' own rule manager at the shipped {rm['interval_s']:.0f} s interval (groups in "
              f"parallel), after {min(rm['rounds_seen'].values(), default=0)} rounds:")
        for g in rm["groups"]:
            slow = "  SLOWER THAN THE INTERVAL" if g["evaluation_ms"] > rm["interval_s"] * 1e3 else ""
            print(f"    {g['group']:<26} {g['evaluation_ms']:>9.1f} ms per round, iterations missed "
                  f"{g['iterations_missed']:.0f}{slow}")
    a = r["analyze"]
    print(f"\n  analyze --prometheus: {a['in_process_s']} s in process (from_prometheus), {a['cli_s']} s as a CLI; "
          f"{a['ranks_seen']} ranks; verdicts {a['verdicts']} -> {'culprit named' if a['correct'] else 'WRONG'}")
    if extrapolate_to and extrapolate_to != r["nodes"]:
        f = extrapolate_to / r["nodes"]
        print(f"\nEXTRAPOLATED (linear in series, x{f:g}) to {extrapolate_to} nodes = "
              f"{extrapolate_to * RANKS_PER_NODE} ranks; not measured:")
        print(f"  series ~{r['series_generated'] * f:,.0f}; all rules ~{total * f / 1e3:.1f} s per round; "
              f"analyze ~{a['in_process_s'] * f:.0f} s; blocks ~{r['create_blocks_s'] * f:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1024)
    parser.add_argument("--history", type=float, default=180.0, help="seconds of data before generation")
    parser.add_argument("--margin", type=float, default=900.0,
                        help="seconds of data after generation: must cover block creation, start-up and analyze")
    parser.add_argument("--repeats", type=int, default=3, help="queries per rule (median reported)")
    parser.add_argument("--extrapolate-to", type=int, default=None, metavar="NODES")
    parser.add_argument("--capacity-only", action="store_true")
    parser.add_argument("--pgs", type=int, default=PGS, help="PGs per rank for --capacity-only (default %(default)s)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.capacity_only:
        print(json.dumps(capacity(parse_exposition(real_exposition(pgs=args.pgs)), args.pgs), indent=1))
        return 0
    r = run(args.nodes, args.history, args.margin, args.repeats, args.keep)
    if args.json:
        print(json.dumps(r, indent=1))
    else:
        print_report(r, args.extrapolate_to)
    ok = r["analyze"]["correct"] and all(row.get("correct", True) for row in r["rules"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
