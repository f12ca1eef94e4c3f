"""Recorder overhead on a collective-heavy gloo loop: Flight Recorder alone vs FR + frexporter recorder.

Run by hand: ``python -m benchmarks.recorder_overhead [--pairs 5] [--steps 3000]``. Each run is a fresh
2-rank gloo job doing small all_reduces back to back (the worst case: no compute to hide behind).
Runs alternate A (FR on via TORCH_FR_BUFFER_SIZE, no recorder) and B (FR + ``recorder.install()``)
so that machine noise hits both alike. The recorder's snapshot thread is also timed from inside
rank 0: the thread's user CPU time per snapshot bounds the GIL it holds (syscalls release it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._recorder_common import free_port

RANK = r"""
import json, os, sys, time
mode, rank, port, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
world = int(sys.argv[6])
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
ticks = []
if mode == "B":
    from frexporter.recorder import install
    pub = install()
    original = pub.tick
    def timed_tick():
        w = time.perf_counter()
        original()
        ticks.append(time.perf_counter() - w)
    pub.tick = timed_tick
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
t = torch.ones(256)
for _ in range(300):
    dist.all_reduce(t)
if mode == "B":
    # Steady state: the recorder's one-time start (worker server, manifest) is not what we measure.
    deadline = time.time() + 30
    while pub._counter < 2 and time.time() < deadline:
        time.sleep(0.01)
dist.barrier()
import resource
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
start, cpu0 = time.perf_counter(), cpu()
for _ in range(steps):
    dist.all_reduce(t)
elapsed, cpu_used = time.perf_counter() - start, cpu() - cpu0
parts = {}
if rank == 0 and mode == "B":
    # The snapshot's GIL-holding parts, timed on their own with thread CPU time.
    from benchmarks._recorder_common import snapshot_gil_parts
    parts = snapshot_gil_parts()
if rank == 0:
    with open(out, "w") as f:
        json.dump({"step_us": elapsed / steps * 1e6, "cpu_us": cpu_used / steps * 1e6, "ticks": ticks[2:],
                   "parts": parts}, f)
dist.barrier()
dist.destroy_process_group()
"""


def run(mode: str, steps: int, workdir: Path, interval: float, world: int = 2) -> dict:
    out = workdir / f"{mode}-{os.urandom(4).hex()}.json"
    env = {**os.environ, "FREXPORTER_DIR": str(workdir / "spool"), "FREXPORTER_SNAPSHOT_INTERVAL": str(interval),
           "PYTHONPATH": str(Path(__file__).parent.parent), "OMP_NUM_THREADS": "1"}
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", RANK, mode, str(r), port, str(steps), str(out), str(world)],
                              env=env) for r in range(world)]
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise SystemExit(f"rank exited with {p.returncode}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--interval", type=float, default=1.0, help="recorder snapshot interval (default 1 s)")
    parser.add_argument("--world", type=int, default=2, help="ranks per job (1 needs a single core)")
    args = parser.parse_args()
    a_steps, b_steps, ticks, parts = [], [], [], []
    a_cpu, b_cpu = [], []
    for i in range(args.pairs):
        for mode in ("A", "B") if i % 2 == 0 else ("B", "A"):
            with tempfile.TemporaryDirectory(prefix="frexporter-overhead-") as workdir:
                result = run(mode, args.steps, Path(workdir), args.interval, args.world)
            (a_steps if mode == "A" else b_steps).append(result["step_us"])
            (a_cpu if mode == "A" else b_cpu).append(result["cpu_us"])
            ticks.extend(result["ticks"])
            if result["parts"]:
                parts.append(result["parts"])
            print(f"run {i + 1}/{args.pairs} {mode}: {result['step_us']:.1f} us/all_reduce, "
                  f"{result['cpu_us']:.1f} us CPU", flush=True)
    a, b = statistics.median(a_steps), statistics.median(b_steps)
    print()
    print(f"FR alone (A):         median {a:8.1f} us per all_reduce over {args.pairs} runs")
    print(f"FR + recorder (B):    median {b:8.1f} us per all_reduce over {args.pairs} runs")
    print(f"ratio B/A:            {b / a:.4f}  ({(b / a - 1) * 100:+.2f}%; budget < +0.5%)")
    # Each pair ran back to back: its own ratio cancels the slow drift of a busy machine.
    paired = statistics.median(bb / aa for aa, bb in zip(a_steps, b_steps, strict=True))
    spread = (max(a_steps) - min(a_steps)) / a * 100
    print(f"paired ratio median:  {paired:.4f}  (run-to-run spread of A alone: {spread:.1f}%)")
    ca, cb = statistics.median(a_cpu), statistics.median(b_cpu)
    print(f"rank-0 CPU per all_reduce (all threads): A {ca:.1f} us, B {cb:.1f} us, ratio {cb / ca:.4f} "
          "(less sensitive to scheduling noise than wall time)")
    if ticks:
        wall = sorted(t * 1e3 for t in ticks)
        print(f"snapshots timed:      {len(ticks)} at a {args.interval:g} s interval; wall per snapshot median "
              f"{statistics.median(wall):.3f} ms, max {wall[-1]:.3f} ms (includes waiting for the GIL)")
    if parts:
        read = statistics.median(p["read_status_us"] for p in parts)
        write = statistics.median(p["write_snapshot_us"] for p in parts)
        print(f"GIL held per snapshot: {read + write:.1f} us (read torch's status {read:.1f} + update the mapped "
              f"file {write:.1f}; no syscall inside); budget < 200 us. benchmarks.recorder_costs probes what a "
              "snapshot takes from a thread that wants the GIL all the time.")

if __name__ == "__main__":
    main()
