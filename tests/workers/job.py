"""A real gloo rank for the tests: runs a scenario, then idles until told to stop.

Usage: python job.py SCENARIO RANK WORLD PORT CONTROL_DIR
The test drives it through files in CONTROL_DIR (``stop``), and reads ``rank<R>.ready``
once the scenario's collectives are done. The rank never decides when the test is over.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from datetime import timedelta

scenario, rank, world, port, control = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]

if os.environ.get("JOB_INSTALL", "1") == "1":
    from frexporter.recorder import install

    install()

import torch
import torch.distributed as dist

timeout = timedelta(seconds=float(os.environ.get("JOB_TIMEOUT", "120")))
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=timeout)
t = torch.ones(4)


def ready(tag: str = "ready") -> None:
    path = os.path.join(control, f"rank{rank}.{tag}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def idle() -> None:
    deadline = time.monotonic() + float(os.environ.get("JOB_MAX_LIFETIME", "300"))
    while not os.path.exists(os.path.join(control, "stop")) and time.monotonic() < deadline:
        time.sleep(0.05)


def hold_gil(seconds: float) -> None:
    # A C call that keeps the GIL: Python threads (the recorder's) cannot run meanwhile.
    libc = ctypes.PyDLL(None)
    libc.usleep.argtypes = [ctypes.c_uint]
    libc.usleep(int(seconds * 1e6))


if scenario == "counts":
    # world: 5 collectives; pair (0,1): 3; local-sync subgroup over the odd/even ranks: 2
    # The local-sync group first: torch names it from len(pg_names), which must agree across its ranks.
    evens = [r for r in range(world) if r % 2 == 0]
    odds = [r for r in range(world) if r % 2 == 1]
    mine = evens if rank % 2 == 0 else odds
    local = dist.new_group(mine, use_local_synchronization=True, group_desc="parity")
    pair = dist.new_group([0, 1], group_desc="pair01")
    for _ in range(5):
        dist.all_reduce(t)
    if rank in (0, 1):
        for _ in range(3):
            dist.all_reduce(t, group=pair)
    for _ in range(2):
        dist.all_reduce(t, group=local)
    ready()
    idle()
elif scenario == "p2p":
    # pipeline-style: ranks send to the next and receive from the previous, interleaved with collectives
    for step in range(4):
        if rank > 0:
            dist.recv(t, src=rank - 1)
        if rank < world - 1:
            dist.send(t, dst=rank + 1)
        if rank == 0 and step % 2 == 0:
            dist.send(t, dst=world - 1)
        if rank == world - 1 and step % 2 == 0:
            dist.recv(t, src=0)
        dist.all_reduce(t)
    ready()
    idle()
elif scenario == "blocked":
    # rank 0 enters an all_reduce that rank 1 never joins
    for _ in range(3):
        dist.all_reduce(t)
    if rank == 0:
        ready()
        dist.all_reduce(t)
    else:
        ready()
    idle()
elif scenario == "gil":
    for _ in range(2):
        dist.all_reduce(t)
    ready()
    if rank == 0:
        while not os.path.exists(os.path.join(control, "wedge")):
            time.sleep(0.02)
        ready("wedged")
        hold_gil(float(os.environ.get("JOB_GIL_SECONDS", "8")))
        ready("unwedged")
    idle()
elif scenario == "kill":
    for _ in range(2):
        dist.all_reduce(t)
    ready()
    if rank == 1:
        while not os.path.exists(os.path.join(control, "kill")):
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)
    idle()
else:
    raise SystemExit(f"unknown scenario {scenario}")

os._exit(0)  # skip destroy_process_group: peers may be gone or blocked, which is the point
