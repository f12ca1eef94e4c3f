"""Every source has a deadline (``--source-timeout``): a source whose call hangs is down (``timeout``, counted once
per call), its last reading is served stale, the poll goes on with the others, and the hung call is abandoned
on its one worker thread, never asked again until it returns.

Fakes of NVML that block forever or raise (``tests/fakes/gpu.py``'s ``Hang``); one that blocks for a while, and
real gloo jobs beside each kind of NVML, are in tests/e2e/test_source_deadline.py.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from frexporter import cli, reasons, spool
from frexporter import naming as n
from frexporter.analysis import VerdictConfig, make_analyzer
from frexporter.app import App, ServeConfig, build_app
from frexporter.exporter import Exporter
from frexporter.model import NodeSnapshot
from frexporter.outputs.api import health_text
from frexporter.sources.nvml import GpuBackendError
from frexporter.sources.thresholds import ThresholdConfig
from tests import spoolgen
from tests.fakes.gpu import FakeGpu, FakeGpuBackend, Hang
from tests.fakes.node import Node, raw
from tests.harness import metrics, sample, wait_for
from tests.shared.source_deadline import Ticker, nvml, source_threads, status, timed_poll

TIMEOUT = 0.5  # the source timeout of these tests; a poll that does not wait for a hung source is far quicker
STUCK_AFTER = 5.0


@pytest.fixture
def exporters() -> Iterator[list[tuple[Exporter, Hang]]]:
    made: list[tuple[Exporter, Hang]] = []
    yield made
    for exporter, hang in made:
        hang.release()  # the abandoned call returns, and its worker ends
        exporter.stop()


# ---------------------------------------------------------------- a source that never answers


def _stuck_ranks(node: Node) -> None:
    """Rank 0 waits in all_reduce #2 from now on; rank 1 never joins it."""
    node.rings[0] = [raw(0, 1), raw(1, 2, created=node.now, retired=False)]
    node.rings[1] = [raw(0, 1)]


def _poll(node: Node) -> tuple[NodeSnapshot, float]:
    node.now += 1.0
    node.counter += 1
    for r in (0, 1):  # the ranks' own pg_status: rank 0 has #2 in flight, rank 1 finished #1
        pg_status = {"0": {"last_enqueued_collective": 2 - r, "last_started_collective": -1,
                           "last_completed_collective": 1}}
        snap = spoolgen.snapshot(node.pids[r], counter=node.counter, when=node.now, status={"fr": pg_status})
        spool.write_json_atomic(str(node.dir / (spool.rank_stem("job", r) + spool.SNAPSHOT_SUFFIX)), snap)
    return timed_poll(node.exporter)


def test_nvml_hung_for_good_is_abandoned_while_ranks_and_verdicts_flow(node_factory, exporters) -> None:
    node = node_factory(2, thresholds=ThresholdConfig(ceiling=STUCK_AFTER))
    hang = Hang(after=1)  # one good reading, then the driver hangs in every call
    source, backend = nvml(hang)
    node.exporter = Exporter([(node.source, 1.0), (source, 1.0)], clock=lambda: node.now, hostname="node-a",
                             analyzer=make_analyzer(VerdictConfig(stuck_after=STUCK_AFTER)), source_timeout=TIMEOUT)
    exporters.append((node.exporter, hang))
    first, _ = _poll(node)
    assert status(first).up and first.gpus is not None and len(first.gpus.gpus) == 2
    assert health_text(first) == "ok\n"
    _stuck_ranks(node)

    hung, waited = _poll(node)  # NVML is asked and hangs: this one poll waits for its deadline
    assert waited >= TIMEOUT
    nv = status(hung)
    assert (nv.up, nv.reason, nv.stale, nv.errors_total) == (False, reasons.TIMEOUT, True, {reasons.TIMEOUT: 1})
    assert nv.last_success == first.time and hung.gpus is first.gpus  # the last good reading, served stale
    assert status(hung, n.SOURCE_RANKS).up and len(hung.ranks) == 2
    threads = source_threads()
    ranks_worker = node.exporter._tracks[0].worker

    verdict_at = None
    for i in range(40):
        snap, took = _poll(node)
        assert took < TIMEOUT, f"poll {i} waited {took:.2f}s for the hung source"
        assert status(snap, n.SOURCE_RANKS).up and len(snap.ranks) == 2
        if snap.verdicts and verdict_at is None:
            verdict_at = snap.time
    # On the schedule of a node without NVML: the rank is named once its wait passes the threshold.
    (v,) = snap.verdicts
    assert (v.kind, v.ranks) == ("missing_rank", (1,))
    assert verdict_at is not None and verdict_at - hung.time <= STUCK_AFTER + 2
    nv = status(snap)
    assert (nv.up, nv.stale, nv.errors_total) == (False, True, {reasons.TIMEOUT: 1})  # counted once, not per poll
    assert hang.entered == 1 and hang.inside == 1  # never asked again while its call hangs
    assert source_threads() <= threads and node.exporter._tracks[0].worker is ranks_worker  # no thread per poll
    assert health_text(snap).splitlines() == [
        "degraded: nvml", f"nvml: down (timeout), serving its reading from {snap.time - first.time:.0f}s ago"]
    parsed = metrics(_render(snap))
    assert sample(parsed, n.SOURCE_UP, source="nvml") == 0
    assert sample(parsed, n.SOURCE_ERRORS_TOTAL, source="nvml", reason="timeout") == 1
    assert sample(parsed, n.SOURCE_LAST_SUCCESS_TIMESTAMP_SECONDS, source="nvml") == first.time

    hang.release()  # the driver comes back: the late answer is taken, then the next call answers on time

    def fresh() -> NodeSnapshot | None:
        snap = _poll(node)[0]
        return None if status(snap).stale else snap

    late = wait_for(fresh, timeout=10, what="the late answer taken")
    assert status(late).last_success == late.time and late.gpus is not first.gpus
    wait_for(lambda: status(_poll(node)[0]).up, timeout=10, what="nvml up again")
    assert backend.violations == []


def _render(snapshot: NodeSnapshot) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    from frexporter.outputs.snapshot_metrics import SnapshotCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snapshot))
    return generate_latest(registry).decode()


def test_hung_from_the_first_call_serves_no_gpus_and_no_thread_per_poll(exporters) -> None:
    hang = Hang()
    source, _ = nvml(hang)
    ranks = Ticker()
    exporter = Exporter([(ranks, 0.0), (source, 0.0)], poll_interval=0.05, source_timeout=TIMEOUT)
    exporters.append((exporter, hang))
    snap, waited = timed_poll(exporter)
    assert waited >= TIMEOUT and snap.gpus is None
    nv = status(snap)
    assert (nv.up, nv.reason, nv.stale, nv.last_success) == (False, reasons.TIMEOUT, False, None)
    assert health_text(snap) == "degraded: nvml\nnvml: down (timeout)\n"
    threads = threading.active_count()
    for _ in range(200):
        snap, took = timed_poll(exporter)
        assert took < TIMEOUT
    assert ranks.calls == 201 and hang.entered == 1
    assert status(snap).errors_total == {reasons.TIMEOUT: 1}
    assert threading.active_count() <= threads  # 200 polls of a hung source: not one more thread


# ---------------------------------------------------------------- a source that fails at once


def test_nvml_that_raises_is_down_with_its_reason_and_holds_no_poll(exporters) -> None:
    hang = Hang(seconds=0, raises=GpuBackendError(reasons.NO_PERMISSION, "Insufficient Permissions"))
    source, _ = nvml(hang)
    ranks = Ticker()
    exporter = Exporter([(ranks, 0.0), (source, 0.0)], poll_interval=0.05, source_timeout=TIMEOUT)
    exporters.append((exporter, hang))
    for _ in range(20):
        snap, took = timed_poll(exporter)
        assert took < TIMEOUT
    nv = status(snap)
    assert (nv.up, nv.reason, nv.stale) == (False, reasons.NO_PERMISSION, False)
    assert reasons.TIMEOUT not in nv.errors_total and nv.errors_total[reasons.NO_PERMISSION] == 20
    assert snap.gpus is None and ranks.calls == 20
    assert health_text(snap) == "degraded: nvml\nnvml: down (no_permission)\n"


# ---------------------------------------------------------------- the poll and the workers


def test_sources_are_asked_at_once_so_a_poll_takes_the_slowest_not_the_sum(exporters) -> None:
    slow = 0.3
    a, b, c = Ticker("a", slow), Ticker("b", slow), Ticker("c", slow)
    exporter = Exporter([(a, 0.0), (b, 0.0), (c, 0.0)], source_timeout=10 * slow)
    exporters.append((exporter, Hang()))
    snap, took = timed_poll(exporter)
    assert all(s.up for s in snap.sources) and (a.calls, b.calls, c.calls) == (1, 1, 1)
    assert slow <= took < 2.5 * slow  # 3 x 0.4 s one after another would be 1.2 s


def test_stop_does_not_wait_for_a_hung_source_and_its_worker_closes_it_after() -> None:
    hang = Hang()
    source, backend = nvml(hang)
    ranks = Ticker()
    exporter = Exporter([(ranks, 0.0), (source, 0.0)], poll_interval=0.05, source_timeout=TIMEOUT)
    exporter.start()
    wait_for(lambda: exporter.polls and status(exporter.snapshot).reason == reasons.TIMEOUT, timeout=10,
             what="nvml timed out")
    started = time.monotonic()
    exporter.stop()
    assert time.monotonic() - started < TIMEOUT  # neither the poll nor close() waited for the hung call
    assert ranks.closed and backend.calls["shutdown"] == 0
    hang.release()
    wait_for(lambda: backend.calls["shutdown"] == 1, timeout=10, what="the hung source closed once its call returned")


def test_source_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="source timeout must be positive"):
        Exporter([], source_timeout=0.0)
    with pytest.raises(ValueError, match="source timeout must be positive"):
        Exporter([], timeouts={n.SOURCE_NVML: -1.0})


# ---------------------------------------------------------------- the wired exporter: flag, config, /healthz


def test_source_timeout_flag_and_each_source_deadline(tmp_path: Path) -> None:
    args = cli.build_parser().parse_args(["serve", "--dir", str(tmp_path)])
    assert cli.serve_config(args).source_timeout == ServeConfig(str(tmp_path)).source_timeout
    args = cli.build_parser().parse_args(["serve", "--dir", str(tmp_path), "--source-timeout", "7.5",
                                          "--rank-timeout", "3"])
    app = build_app(dataclasses.replace(cli.serve_config(args), host="127.0.0.1", port=0, evidence_dir=""))
    try:
        deadlines = {t.source.name: t.deadline for t in app.exporter._tracks}
    finally:
        app.stop()
    # The ranks source may wait --rank-timeout for wedged ranks before its own work: its deadline allows for it.
    assert deadlines == {n.SOURCE_RANKS: 3 + 7.5, n.SOURCE_NVML: 7.5}


def test_healthz_answers_at_once_and_names_the_hung_source(spool_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hang = Hang()
    backend = FakeGpuBackend([FakeGpu("GPU-0")], chaos=hang)
    monkeypatch.setattr("frexporter.sources.nvml.source.PynvmlBackend", lambda: backend)
    app: App = build_app(ServeConfig(str(spool_dir), poll_interval=0.1, rank_timeout=0.2, source_timeout=TIMEOUT,
                                     sources=(n.SOURCE_RANKS, n.SOURCE_NVML), evidence_dir=""))
    try:
        started = time.monotonic()
        app.start()  # its first poll waits for NVML's deadline, once
        assert time.monotonic() - started < TIMEOUT + 5
        base = f"http://127.0.0.1:{app.port}"
        for _ in range(5):
            started = time.monotonic()
            with urllib.request.urlopen(base + "/healthz", timeout=2) as resp:
                assert resp.status == 200  # the exporter works: a restart would not mend the GPU
                body = resp.read().decode()
            assert time.monotonic() - started < 2
            assert body.splitlines() == ["degraded: nvml", "nvml: down (timeout)"]
        with urllib.request.urlopen(base + "/api/v1/status", timeout=2) as resp:
            sources = {s["source"]: s for s in json.loads(resp.read())["sources"]}
        assert sources["nvml"]["reason"] == "timeout" and not sources["nvml"]["up"]
        assert sources["ranks"]["up"] and sources["ranks"]["reason"] == ""
        polls = app.exporter.polls
        wait_for(lambda: app.exporter.polls >= polls + 3, timeout=10, what="polls go on")
        assert hang.entered == 1
    finally:
        hang.release()
        app.stop()
