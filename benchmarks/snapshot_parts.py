"""Where a snapshot's GIL goes, part by part, from cold caches.

Run by hand: ``python -m benchmarks.snapshot_parts [--seconds 40] [--stack-depth 32]``.

``benchmarks.recorder_costs`` gives the GIL a whole snapshot holds; its parts back to back with warm caches
take a tenth of that, so the whole is mostly caches refilled once a second. This benchmark says which part
costs what in that state. One gloo rank (world 1, FR on, recorder installed, its own thread parked) whose main
thread spins in Python under a stack ``--stack-depth`` frames deep, as a computing rank's would; every 0.1 s a
probe thread wakes and, in turn, either runs the recorder's own bound snapshot (the whole) or the same steps one
by one, timing each: torch's status call, the process's CPU time, the training thread's frames
(``sys._current_frames``), the stack sample, the bytes format and the mapped file's update (its CRC, header and
payload copy). Nothing in them releases the GIL, so each time is GIL held. Printed: median and p90 per
part, in microseconds. The parts add up to more than the whole: each pays the first touch of its own code.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._recorder_common import free_port
from frexporter.spool import MAX_STACK_FRAMES

RANK = r"""
import json, os, statistics, sys, threading, time
port, seconds, depth = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
from frexporter.recorder import install
pub = install()
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
t = torch.ones(256)
for _ in range(3000):  # FR entries in the ring, as in a running job
    dist.all_reduce(t)
deadline = time.time() + 30
while pub._snapshot is None and time.time() < deadline:  # bound by the tick that identifies the rank
    pub.tick()  # its own thread may be in its long wait (no torch yet when it started)
    time.sleep(0.01)
whole = pub._snapshot
assert whole is not None, "the recorder did not reach its steady state"
dump, stack, fmt = pub._status.dumpers[0], pub._sample_stack, pub._format
update = pub._map.updater()
frames, main_id, pc = sys._current_frames, threading.main_thread().ident, time.perf_counter_ns
names = ("status call", "cpu time", "current frames", "stack sample", "format", "map update")
parts = {name: [] for name in names}
parts["whole snapshot"] = []
sizes = []
stop = threading.Event()

def probe():
    n = 0
    while not stop.wait(0.1):
        n += 1
        if n % 2:
            a = pc(); whole(); parts["whole snapshot"].append(pc() - a)
            continue
        stamps = [pc()]
        raw = dump(False); stamps.append(pc())
        cpu = time.process_time_ns(); stamps.append(pc())
        frames().get(main_id); stamps.append(pc())
        sample = stack(); stamps.append(pc())
        payload = fmt % (n, time.time_ns(), cpu, sample, raw); stamps.append(pc())
        sizes.append(len(payload))
        update(payload); stamps.append(pc())
        for name, a, b in zip(names, stamps, stamps[1:]):
            parts[name].append(b - a)

def spin(d):
    if d > 0:
        return spin(d - 1)
    end, x = time.time() + seconds, 0
    while time.time() < end:
        for _ in range(1000):
            x += 1

thread = threading.Thread(target=probe, daemon=True)
thread.start()
spin(depth)
stop.set()
thread.join()
out = {}
for name, values in parts.items():
    values = sorted(values[2:])  # the first wake-ups warm what only the first touch pays
    out[name] = {"n": len(values), "median_us": statistics.median(values) / 1e3,
                 "p90_us": values[int(len(values) * 0.9)] / 1e3}
out["payload_bytes"] = max(sizes, default=0)
print(json.dumps(out))
dist.destroy_process_group()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=40.0, help="how long the training thread spins")
    parser.add_argument("--stack-depth", type=int, default=MAX_STACK_FRAMES,
                        help=f"frames under the spinning loop (the sampler keeps at most {MAX_STACK_FRAMES})")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="frexporter-parts-") as tmp:
        env = {**os.environ, "FREXPORTER_DIR": str(Path(tmp) / "spool"), "FREXPORTER_JOB_ID": "parts",
               "FREXPORTER_STACKS": "1",
               # The recorder's own thread snapshots when it identifies the rank, then once a minute (its longest
               # interval); the probe takes the snapshots in between.
               "FREXPORTER_SNAPSHOT_INTERVAL": "1000", "TORCH_FR_BUFFER_SIZE": "2000", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(Path(__file__).parent.parent)}
        done = subprocess.run([sys.executable, "-c", RANK, str(free_port()), str(args.seconds), str(args.stack_depth)],
                              env=env, capture_output=True, text=True, timeout=args.seconds + 120)
    if done.returncode != 0:
        raise SystemExit(f"the rank failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"a snapshot's parts from cold caches, the training thread spinning {args.stack_depth} frames deep "
          f"(payload {result.pop('payload_bytes')} bytes):")
    for name, r in result.items():
        print(f"  {name:15s} median {r['median_us']:7.1f} us   p90 {r['p90_us']:7.1f} us   ({r['n']} samples)")


if __name__ == "__main__":
    main()
