"""Recorder overhead by accounting: every way the recorder can take time from a training thread, measured alone.

Run by hand: ``python -m benchmarks.recorder_costs [--seconds 20] [--deep-every 0.25]``.

Wall-clock A/B runs (``benchmarks.recorder_overhead``, ``benchmarks.recorder_windows``) print the ratio the
budget is stated in, but on a shared VM whose speed moves by tens of percent between seconds they cannot
resolve 0.5 %. The recorder only touches training through these channels, each measured here in one
gloo rank (world 1, small all_reduces back to back, FR on, recorder installed):

1. The GIL its snapshot thread takes: the main thread spins in Python (it wants the GIL all the time)
   and records every gap between its iterations. Printed: the gaps inside the tick (the GIL the recorder's
   thread held); the gaps in the tick's window padded by 0.5 ms each side (the hand-offs too: the busy thread
   waits while the GIL travels to the waking thread and back); and the same padded figure for a thread that
   wakes the same way and does nothing, the floor any Python thread costs on this machine. The parts alone
   (reading torch's status, updating the mapped file) are timed too, back to back with warm caches.
2. The CPU its snapshot thread uses (GIL or not): it matters only on a node whose cores are all busy.
3. A deep read by the exporter (its ``fr_trace_json`` request, answered by torch's C++ worker server
   without the GIL, every ``deep_interval`` = 15 s on a busy job): the rank's CPU to answer it, and the
   time it takes from the training thread (Flight Recorder's lock, held while torch copies the ring;
   CPU contention): how much longer the longest training step of a read's span is than that of a
   same-length span between reads.

The bound printed at the end is what these cost per second of training at the default schedule
(one snapshot a second, one deep read per 15 s), against the 0.5 % budget.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._recorder_common import free_port

RANK = r"""
import json, os, sys, threading, time
port, seconds, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
from frexporter.recorder import install
pub = install()
tick_cpu = []
original = pub.tick
def timed_tick():
    c = time.thread_time()
    original()
    tick_cpu.append(time.thread_time() - c)
pub.tick = timed_tick
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
t = torch.ones(256)
for _ in range(3000):  # fill the FR ring (2000 entries): deep reads below return a full buffer
    dist.all_reduce(t)
deadline = time.time() + 30
while pub._counter < 2 and time.time() < deadline:
    time.sleep(0.01)

# Phase 0: the GIL a snapshot takes from a thread that wants it all the time. This thread spins in Python
# and notes every gap between its iterations; the gaps that fall inside a snapshot are the GIL the
# recorder's thread held (its Python parts, and the hand-offs around its syscalls).
spans = []
inner = pub.tick
def spanned_tick():
    a = time.perf_counter()
    inner()
    spans.append((a, time.perf_counter()))
pub.tick = spanned_tick
interval, pub.interval = pub.interval, 0.1
# Beside it, a thread that wakes the same way (a lock wait with a timeout) and does nothing: what handing the
# GIL to any Python thread and back costs on this machine, the floor under the snapshot's figure.
noop_spans, noop_stop = [], threading.Lock()
noop_stop.acquire()
def noop():
    while True:
        a = time.perf_counter()
        noop_spans.append((a, time.perf_counter()))
        if noop_stop.acquire(True, 0.1137):  # a period of its own: the two drift through each other quickly
            break
noop_thread = threading.Thread(target=noop, daemon=True)
noop_thread.start()
gaps = []
pc = time.perf_counter
end = pc() + float(sys.argv[4])
last = pc()
while last < end:
    now = pc()
    if now - last > 2e-6:
        gaps.append((last, now))
    last = now
pub.tick, pub.interval = inner, interval
noop_stop.release()
noop_thread.join()
def in_gaps(a, b):
    return sum(max(0.0, min(b, g1) - max(a, g0)) for g0, g1 in gaps if g1 > a and g0 < b)
# Padded: the thread takes the GIL when it wakes, a little before the tick starts, and gives it back when it
# waits again, a little after.
PAD = 0.0005
def apart(mine, others):
    # Wake-ups of one thread that the other's did not come near (the two timers drift through each other).
    return [(a, b) for a, b in mine if all(b2 < a - 0.005 or a2 > b + 0.005 for a2, b2 in others)]
ticks, noops = apart(spans[1:-1], noop_spans), apart(noop_spans[1:-1], spans)
taken = [in_gaps(a - PAD, b + PAD) for a, b in ticks]
held = [in_gaps(a, b) for a, b in ticks]
floor = [in_gaps(a - PAD, b + PAD) for a, b in noops]
# The same lengths a quarter interval away from any wake-up: what the VM and interpreter take anyway.
control = [in_gaps(a + 0.025 - PAD, b + 0.025 + PAD) for a, b in ticks]
sys.stdout.write("ready\n"); sys.stdout.flush()

# Phase 1: the parent deep-reads while this thread sleeps: the process's CPU is the server's answer.
line = sys.stdin.readline()
while line.startswith("cpu"):
    c = time.process_time()
    sys.stdout.write("go\n"); sys.stdout.flush()
    sys.stdin.readline()  # the parent's read finished
    sys.stdout.write(json.dumps(time.process_time() - c) + "\n"); sys.stdout.flush()
    line = sys.stdin.readline()

# Phase 2: a tight loop timing every step; the parent deep-reads at known monotonic times meanwhile.
steps = []
stamp = time.perf_counter_ns
end = time.perf_counter() + seconds
while time.perf_counter() < end:
    a = stamp()
    dist.all_reduce(t)
    steps.append((a, stamp() - a))
from benchmarks._recorder_common import snapshot_gil_parts
gil = snapshot_gil_parts()
with open(out, "w") as f:
    json.dump({"steps": steps, "tick_cpu": tick_cpu[2:], "gil": gil, "gil_taken": taken,
               "gil_held": held, "gil_floor": floor, "gil_control": control}, f)
sys.stdout.write("done\n"); sys.stdout.flush()
dist.destroy_process_group()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the timed training loop")
    parser.add_argument("--deep-every", type=float, default=0.25,
                        help="seconds between deep reads during the loop (many, for a stable mean)")
    parser.add_argument("--gil-seconds", type=float, default=10.0,
                        help="length of the GIL probe (snapshots every 0.1 s meanwhile)")
    parser.add_argument("--cpu-reads", type=int, default=20, help="deep reads for the rank-side CPU figure")
    parser.add_argument("--interval", type=float, default=1.0, help="snapshot interval (the default: 1 s)")
    parser.add_argument("--deep-interval", type=float, default=15.0,
                        help="the exporter's deep-read spacing on a busy job, for the bound (default 15 s)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from frexporter.sources import worker_client
    from frexporter.sources.ranks import DEEP_HANDLERS
    from frexporter.spool import RECORDER_FR

    handler, query = DEEP_HANDLERS[RECORDER_FR]
    workdir = Path(tempfile.mkdtemp(prefix="frexporter-costs-"))
    spool_dir = workdir / "spool"
    out = workdir / "rank.json"
    env = {**os.environ, "FREXPORTER_DIR": str(spool_dir), "FREXPORTER_SNAPSHOT_INTERVAL": str(args.interval),
           "FREXPORTER_JOB_ID": "costs", "PYTHONPATH": str(Path(__file__).parent.parent), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", RANK, str(free_port()), str(args.seconds), str(out),
                             str(args.gil_seconds)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit("the rank did not start")
        sock = next(iter(sorted(spool_dir.glob("*.sock"))))
        entries = len(worker_client.post_json(str(sock), handler, 10.0, query).get("entries", []))

        rank_cpu, client = [], []
        for _ in range(args.cpu_reads):
            proc.stdin.write("cpu\n")
            proc.stdin.flush()
            proc.stdout.readline()
            c = time.perf_counter()
            worker_client.post_json(str(sock), handler, 10.0, query)
            client.append(time.perf_counter() - c)
            proc.stdin.write("\n")
            proc.stdin.flush()
            rank_cpu.append(json.loads(proc.stdout.readline()))
        proc.stdin.write("loop\n")
        proc.stdin.flush()

        reads: list[tuple[int, int]] = []
        end = time.perf_counter() + args.seconds
        next_at = time.perf_counter() + args.deep_every
        while time.perf_counter() < end - args.deep_every:
            time.sleep(max(0.0, next_at - time.perf_counter()))
            a = time.perf_counter_ns()
            worker_client.post_json(str(sock), handler, 10.0, query)
            reads.append((a, time.perf_counter_ns()))
            next_at += args.deep_every
        if proc.stdout.readline().strip() != "done":
            raise SystemExit("the rank did not finish")
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    result = json.loads(out.read_text())
    report = analyse(result, reads, rank_cpu, client, entries, args)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print_report(report, args)


def analyse(result: dict, reads: list[tuple[int, int]], rank_cpu: list[float], client: list[float], entries: int,
            args: argparse.Namespace) -> dict[str, float]:
    steps: list[tuple[int, int]] = [tuple(s) for s in result["steps"]]
    median_step = statistics.median(d for _, d in steps)

    def overlapping(windows: list[tuple[int, int]]) -> list[list[int]]:
        # The durations of the training steps that overlap each window.
        out, i = [], 0
        for lo, hi in windows:
            while i < len(steps) and steps[i][0] + steps[i][1] < lo:
                i += 1
            j = i
            while j < len(steps) and steps[j][0] <= hi:
                j += 1
            out.append([d for _, d in steps[i:j]])
        return out

    def excess(windows: list[tuple[int, int]]) -> list[float]:
        # Time the training thread lost in each window: its steps' time beyond the median step.
        return [sum(d - median_step for d in ds) / 1e9 for ds in overlapping(windows)]

    def longest(windows: list[tuple[int, int]]) -> float:
        # A lock held for L delays one step by about L: the longest step per window, typical over windows.
        return statistics.median(max(ds, default=0) for ds in overlapping(windows)) / 1e9

    # Controls: the same lengths, halfway between two reads (no read in progress there).
    controls = []
    for (a0, b0), (a1, _) in itertools.pairwise(reads):
        mid = (b0 + a1) // 2
        half = (b0 - a0) // 2
        controls.append((mid - half, mid + half))
    during, control = excess(reads[:len(controls)]), excess(controls)
    stall = statistics.fmean(during) - statistics.fmean(control)
    longest_during, longest_control = longest(reads[:len(controls)]), longest(controls)
    gil_parts = result["gil"]["read_status_us"] + result["gil"]["write_snapshot_us"]
    taken = sorted(t * 1e6 for t in result["gil_taken"])
    gil_control = statistics.median(t * 1e6 for t in result["gil_control"])
    gil = max(0.0, statistics.median(taken) - gil_control)
    # Any Python thread that wakes takes the GIL this long from a busy one (two thread switches); what the
    # snapshot adds on top of it is its own doing.
    floor = max(0.0, statistics.median(t * 1e6 for t in result["gil_floor"]) - gil_control)
    # A lock held for L delays the training step that needs it by about L: estimated by how much longer the
    # longest step of a read's span is than that of a same-length span without a read. (The summed excess
    # is printed too; on a noisy VM it is dominated by the VM.)
    lock_stall = max(0.0, longest_during - longest_control)
    tick_cpu = statistics.median(result["tick_cpu"]) * 1e6
    deep_cpu = statistics.median(rank_cpu) * 1e3
    per_second_thread = gil * 1e-6 / args.interval + lock_stall / args.deep_interval
    per_second_cores = tick_cpu * 1e-6 / args.interval + deep_cpu * 1e-3 / args.deep_interval
    return {
        "all_reduce_median_us": median_step / 1e3,
        "steps": len(steps),
        "fr_entries_per_deep_read": entries,
        "snapshot_gil_us": gil,
        "snapshot_gil_raw_us": statistics.median(taken),
        "snapshot_gil_control_us": gil_control,
        "snapshot_gil_p90_us": taken[int(0.9 * (len(taken) - 1))] if taken else 0.0,
        "snapshot_gil_probed": len(taken),
        "snapshot_gil_python_parts_us": gil_parts,
        "snapshot_gil_held_us": statistics.median(t * 1e6 for t in result["gil_held"]),
        "wakeup_gil_floor_us": floor,
        "wakeups_probed": len(result["gil_floor"]),
        "snapshot_gil_beyond_floor_us": max(0.0, gil - floor),
        "deep_read_lock_stall_ms": lock_stall * 1e3,
        "snapshot_thread_cpu_us": tick_cpu,
        "snapshots_timed": len(result["tick_cpu"]),
        "deep_read_rank_cpu_ms": deep_cpu,
        "deep_read_client_ms": statistics.median(client) * 1e3,
        "deep_read_duration_ms": statistics.median((b - a) / 1e6 for a, b in reads),
        "deep_reads_in_loop": len(reads),
        "stall_per_deep_read_ms": stall * 1e3,
        "stall_during_reads_ms": statistics.fmean(during) * 1e3,
        "stall_between_reads_ms": statistics.fmean(control) * 1e3,
        "longest_step_during_reads_ms": longest_during * 1e3,
        "longest_step_between_reads_ms": longest_control * 1e3,
        "bound_training_thread_pct": per_second_thread * 100,
        "bound_with_busy_cores_pct": (per_second_thread + per_second_cores) * 100,
    }


def print_report(r: dict[str, float], args: argparse.Namespace) -> None:
    print(f"training loop: {r['steps']} all_reduces, median {r['all_reduce_median_us']:.1f} us")
    print(f"1. GIL held per snapshot (inside the tick): {r['snapshot_gil_held_us']:.1f} us (budget < 200 us), median "
          f"over {r['snapshot_gil_probed']} snapshots;")
    print(f"   taken from a Python-busy thread, hand-offs included: {r['snapshot_gil_us']:.1f} us (median "
          f"{r['snapshot_gil_raw_us']:.1f} us of gaps in the padded window, p90 {r['snapshot_gil_p90_us']:.1f}, less "
          f"{r['snapshot_gil_control_us']:.1f} us in the same length without one);")
    print(f"   a thread that wakes the same way and does nothing takes {r['wakeup_gil_floor_us']:.1f} us of that "
          f"({r['wakeups_probed']} wake-ups: the GIL hand-off to any Python thread and back), leaving "
          f"{r['snapshot_gil_beyond_floor_us']:.1f} us to the snapshot;")
    print(f"   the snapshot's parts alone (thread CPU, no other thread): {r['snapshot_gil_python_parts_us']:.1f} us")
    print(f"2. snapshot thread CPU:          {r['snapshot_thread_cpu_us']:8.1f} us per snapshot "
          f"(median of {r['snapshots_timed']}; syscalls included)")
    print(f"3. deep read of {r['fr_entries_per_deep_read']} FR entries: rank CPU {r['deep_read_rank_cpu_ms']:.2f} ms, "
          f"read {r['deep_read_duration_ms']:.1f} ms end to end")
    print(f"   training-thread time lost per deep read: {r['stall_per_deep_read_ms']:+.3f} ms "
          f"({r['stall_during_reads_ms']:.3f} ms during reads vs {r['stall_between_reads_ms']:.3f} ms between, "
          f"{r['deep_reads_in_loop']} reads)")
    print(f"   longest training step per read, median over reads: {r['longest_step_during_reads_ms']:.3f} ms "
          f"(same-length stretches between reads: {r['longest_step_between_reads_ms']:.3f} ms): "
          f"stall {r['deep_read_lock_stall_ms']:.3f} ms per read")
    print(f"bound at one snapshot per {args.interval:g} s and one deep read per {args.deep_interval:g} s:")
    print(f"   training thread (GIL + deep-read stall): {r['bound_training_thread_pct']:.4f} % of its time")
    print(f"   plus the recorder's and server's CPU if every core is busy: {r['bound_with_busy_cores_pct']:.4f} %"
          "  (budget < 0.5 %)")


if __name__ == "__main__":
    main()
