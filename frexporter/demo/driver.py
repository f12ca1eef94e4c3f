"""Runs the demo: spawns the ranks, serves the exporter, prints what it sees, cleans everything up."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TextIO

from frexporter import defaults, naming
from frexporter.analysis.culprit_activity import describe
from frexporter.app import App, ServeConfig, build_app
from frexporter.demo.rank import HANG_RANK
from frexporter.model import NodeSnapshot

DEADLINE_SECONDS = 55.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _table(snap: NodeSnapshot) -> str:
    head = f"  {'rank':>4} {'status':<13} {'pg (desc)':<22} {'enqueued':>8} {'completed':>9} {'in flight':>9}"
    lines = [head + "  oldest in flight"]
    for r in snap.ranks:
        for pg in r.pgs:
            oldest = pg.oldest_inflight
            age = f"{oldest.op} #{oldest.seq}, {snap.time - oldest.created:4.1f}s" if (
                oldest and pg.inflight_count) else ""
            label = f"{pg.name[:8]} ({pg.desc})"
            lines.append(f"  {r.rank:>4} {r.status:<13} {label:<22} {pg.last_enqueued:>8} {pg.last_completed:>9} "
                         f"{pg.inflight_count:>9}  {age}")
    return "\n".join(lines)


def run_demo(ranks: int = defaults.DEMO_RANKS, keep: bool = False, stuck_after: float = 4.0,
             out: TextIO | None = None) -> int:
    out = out or sys.stdout
    if importlib.util.find_spec("torch") is None:
        print("frexporter demo: the demo's ranks need torch in this environment (pip install 'torch>=2.5')",
              file=sys.stderr)
        return 2
    if ranks < 2:
        print("frexporter demo: --ranks must be at least 2", file=sys.stderr)
        return 2
    t0 = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - t0:5.1f}s] {message}", file=out, flush=True)

    root = tempfile.mkdtemp(prefix="frexporter-demo-")
    spool, control = os.path.join(root, "spool"), os.path.join(root, "control")
    os.makedirs(control)
    env = dict(os.environ, FREXPORTER_DIR=spool, FREXPORTER_JOB_ID="demo", FREXPORTER_SNAPSHOT_INTERVAL="0.25",
               OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.dirname(os.path.dirname(os.path.dirname(__file__))), env.get("PYTHONPATH")) if p)
    os.makedirs(spool, mode=0o700)
    # The demo prints verdicts itself; the exporter's own log lines would say the same twice.
    for name in ("frexporter.outputs.verdict_events", "frexporter.outputs.evidence"):
        logging.getLogger(name).setLevel(logging.ERROR)
    app = build_app(ServeConfig(directory=spool, host="127.0.0.1", port=0, poll_interval=0.5,
                                stuck_after=stuck_after, sources=(naming.SOURCE_RANKS,), deep_interval=2.0))
    app.start()
    say(f"exporter listening on http://127.0.0.1:{app.port}/ (try /metrics and /api/v1/status)")
    port = _free_port()
    procs = [
        subprocess.Popen([sys.executable, "-m", "frexporter.demo.rank", str(r), str(ranks), str(port), control],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for r in range(ranks)
    ]
    say(f"started {ranks} gloo ranks on CPU with the recorder; rank {min(HANG_RANK, ranks - 1)} will skip one "
        "all_reduce on its pair group")
    culprit_ok = False
    injected_at: float | None = None
    try:
        culprit_ok = _watch(app, procs, control, ranks, say, t0)
        injected_at = _injected_time(control)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()
        app.stop()
        if keep:
            say(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    if injected_at is None:
        say("the hang was never injected: the ranks did not get that far")
    elif not keep and culprit_ok:
        say("(run with --keep to keep the spool directory and evidence; `frexporter analyze DIR` reads it)")
    say("done: culprit found" if culprit_ok else "done: culprit NOT found")
    return 0 if culprit_ok else 1


def _wait_for_evidence(app: App, say: Callable[[str], None]) -> None:
    events = app.events
    if events is None:
        return
    for future in list(events.captures):
        try:
            path = future.result(timeout=10)
        except Exception as e:  # evidence is a bonus; the verdict already stands
            say(f"evidence capture failed: {e}")
            continue
        if path:
            say(f"evidence (FR buffers of the PG's ranks, read without their GIL): {path}")


def _injected_time(control: str) -> float | None:
    try:
        with open(os.path.join(control, "injected")) as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _watch(app: App, procs: list[subprocess.Popen[bytes]], control: str, ranks: int,
           say: Callable[[str], None], t0: float) -> bool:
    expected = min(HANG_RANK, ranks - 1)
    announced_up = announced_hang = False
    last_table = 0.0
    last_view: list[tuple[int, str, str, int, int, int]] = []
    seen_verdicts: set[str] = set()
    while time.monotonic() - t0 < DEADLINE_SECONDS:
        for r, p in enumerate(procs):
            if p.poll() is not None and p.returncode != 0:
                err = p.stderr.read().decode(errors="replace")[-2000:] if p.stderr else ""
                say(f"rank {r} exited with {p.returncode}:\n{err}")
                return False
        snap = app.exporter.snapshot
        if not announced_up and len(snap.ranks) == ranks and all(r.pgs for r in snap.ranks):
            announced_up = True
            say(f"exporter sees all {ranks} ranks:\n{_table(snap)}")
        if not announced_hang and _injected_time(control) is not None:
            announced_hang = True
            say("hang injected")
        view = [(r.rank, r.status, pg.name, pg.last_enqueued, pg.last_completed, pg.inflight_count)
                for r in snap.ranks for pg in r.pgs]
        if announced_hang and view != last_view and time.monotonic() - last_table > 1.0:
            # Print when what the exporter shows changes: once the hang settles, it stops changing.
            last_table, last_view = time.monotonic(), view
            say(f"exporter view:\n{_table(snap)}")
        for v in snap.verdicts:
            key = f"{v.kind}/{v.pg}/{v.seq}/{v.ranks}"
            if key not in seen_verdicts:
                seen_verdicts.add(key)
                injected = _injected_time(control)
                after = f" ({snap.time - injected:.1f}s after the hang)" if injected else ""
                since = time.strftime("%H:%M:%S", time.localtime(v.since)) if v.since else "?"
                say(f"VERDICT{after}: {v.kind}, culprit rank(s) {','.join(map(str, v.ranks))}, PG {v.pg} "
                    f"({v.pg_desc}), {v.op} #{v.seq}, waiting since {since}")
                say(f"  {v.summary}")
                for rank, act in v.activity.items():
                    say(f"  culprit activity: {describe(int(rank), act, snap.time) or f'rank {rank} is {act.state}'}")
            if v.kind in ("missing_rank", "mismatch") and tuple(v.ranks) == (expected,):
                _wait_for_evidence(app, say)
                return True
        time.sleep(0.1)
    say("deadline reached")
    return False
