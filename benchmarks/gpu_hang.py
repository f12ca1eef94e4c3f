"""The hung-GPU scenario: four ranks on one GPU, one of them behind a kernel that never ends.

    python -m benchmarks.gpu_smoke --hung-gpu [--cpu-dry-run]

Four gloo ranks share GPU 0 (collectives on CPU tensors, compute on the GPU), each step a ~50 ms GPU kernel
and a ``.item()`` that waits for it: CUDA's spin wait keeps each rank at 100 % CPU, so a healthy rank is
``busy`` right before it hangs. Once the exporter (default ``serve`` flags, the ranks and NVML sources) has
learned the PG's threshold, rank 3 launches a kernel that never ends (``torch.cuda._sleep``) and reads a result
with ``.item()``; ranks 0-2 wait for it in their next all_reduce. The scenario prints how long the
``missing_rank [3]`` verdict took, the culprit's state (``gpu_wait`` expected), the learned threshold and the
verdict's summary, and what one CUDA probe query costs. It passes when the culprit is ``gpu_wait`` and the
verdict came within the learned threshold plus a few polls (not at the 60 s ceiling).

``--cpu-dry-run`` runs the same harness on CPU (the victim sleeps in Python instead: ``idle``), to check the
plumbing on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent
WORLD = 4
VICTIM = 3
STEP_SECONDS = 0.05
CLOCK_HZ = 1.5e9  # a rough SM clock for torch.cuda._sleep's cycles


def worker(spool: str, control: str, port: int, rank: int, cpu: bool) -> int:
    os.environ["FREXPORTER_DIR"] = spool
    from frexporter.recorder import install

    install()
    import torch
    import torch.distributed as dist

    if not cpu:
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    t = torch.ones(4)
    x = torch.ones(1024, device="cpu" if cpu else "cuda:0")
    Path(control, f"rank{rank}.ready").write_text(str(os.getpid()))
    hang, stop = Path(control, "hang"), Path(control, "stop")
    while not stop.exists():
        if cpu:
            end = time.perf_counter() + STEP_SECONDS
            while time.perf_counter() < end:  # compute in Python: busy
                pass
        else:
            torch.cuda._sleep(int(STEP_SECONDS * CLOCK_HZ))  # the step's GPU work
        t[0] = float(x[0].item())  # waits for it: CUDA's spin wait, 100 % CPU
        if rank == VICTIM and hang.exists():
            Path(control, "hung").write_text(str(time.time()))
            if cpu:
                time.sleep(3600)  # idle in Python: what a CPU can show of a rank that waits forever
            torch.cuda._sleep(1 << 60)  # a kernel that never ends (a hung GPU)
            x.sum().item()  # waits for it forever, spinning
        dist.all_reduce(t)
    return 0


def _wait(what: str, predicate: Callable[[], T | None], timeout: float) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:g}s")
        time.sleep(0.1)  # polling a condition with a deadline


def probe_check() -> list[str]:
    """The recorder's probe against the real torch.cuda: no context before the process touched CUDA, an answer
    while a kernel is pending, none once it is done; and what one stream query costs (its only CUDA call)."""
    import torch

    from frexporter.recorder.cuda_probe import CudaProbe

    errors: list[str] = []
    probe = CudaProbe(lambda reason, e: errors.append(f"{reason}: {e!r}"))
    before = [probe.sample(True) for _ in range(3)]
    out = [f"probe before CUDA init: answers {before}, torch.cuda.is_initialized() = {torch.cuda.is_initialized()} "
           "(must stay False: the probe creates no context)"]
    torch.cuda.set_device(0)
    torch.ones(1, device="cuda:0")
    stream = torch.cuda.default_stream(0)

    def per_call(n: int = 2000) -> float:
        start = time.perf_counter()
        for _ in range(n):
            stream.query()
        return (time.perf_counter() - start) / n * 1e6

    idle = statistics.median(per_call() for _ in range(5))
    torch.cuda._sleep(int(4 * CLOCK_HZ))
    pending = statistics.median(per_call() for _ in range(5))
    answer = _wait("a probe answer while a kernel is pending", lambda: probe.sample(True), 3)
    torch.cuda.synchronize()
    after = _wait("no answer once the kernel is done", lambda: [probe.sample(True) for _ in range(3)][-1] == b"", 3)
    probe.close()
    out.append(f"probe with a kernel pending: {answer!r}; after synchronize: empty={after}; errors {errors}")
    out.append(f"stream.query(): {idle:.2f} us idle, {pending:.2f} us with a kernel pending (median of 5 x 2000)")
    return out


def run(args: argparse.Namespace) -> int:
    from frexporter.analysis import MISSING_RANK
    from frexporter.app import ServeConfig, build_app

    if not args.cpu_dry_run:
        for line in probe_check():
            print(f"# {line}")
    work = Path(tempfile.mkdtemp(prefix="frexporter-gpu-hang-"))
    spool, control = work / "spool", work / "control"
    control.mkdir()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "FREXPORTER_JOB_ID": "gpu-hang", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    procs = []
    logs = []
    for rank in range(WORLD):
        log = open(work / f"rank{rank}.log", "wb")  # noqa: SIM115 (closed in finally)
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "benchmarks.gpu_smoke", "--hang-worker", str(spool), str(control), str(port),
             str(rank), "1" if args.cpu_dry_run else "0"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    app = build_app(ServeConfig(str(spool), port=0, sources=("ranks",) if args.cpu_dry_run else ("ranks", "nvml"),
                                evidence_dir=""))  # default flags otherwise
    app.start()
    started = time.monotonic()
    try:
        _wait("4 ranks ready", lambda: all((control / f"rank{r}.ready").exists() for r in range(WORLD)), 120)

        def learned() -> Any:
            pgs = [pg for r in app.exporter.snapshot.ranks for pg in r.pgs
                   if pg.stuck_threshold_seconds is not None and pg.stuck_ceiling_seconds is not None
                   and pg.stuck_threshold_seconds < pg.stuck_ceiling_seconds]
            return pgs[0] if pgs else None

        pg = _wait("a learned threshold", learned, 90)
        states = {r.rank: r.activity.state for r in app.exporter.snapshot.ranks}
        print(f"# steady after {time.monotonic() - started:.0f}s: threshold {pg.stuck_threshold_seconds:.1f}s "
              f"(ceiling {pg.stuck_ceiling_seconds:g}s); activity {states}")
        (control / "hang").write_text("1")
        hung_at = float(_wait("the hang", lambda: (control / "hung").exists() and (control / "hung").read_text(), 30))

        def verdict() -> Any:
            found = [v for v in app.exporter.snapshot.verdicts if v.kind == MISSING_RANK and VICTIM in v.ranks]
            return found[0] if found else None

        v = _wait("a missing_rank verdict for rank 3", verdict, 90)
        took = time.time() - hung_at
        culprit = v.activity.get(str(VICTIM))
        state = culprit.state if culprit is not None else "?"
        print(f"# verdict {v.kind} ranks={list(v.ranks)} {took:.1f}s after the fault; culprit state {state}; "
              f"threshold {pg.stuck_threshold_seconds:.1f}s")
        print(f"#   {v.summary}")
        print(f"#   details.gpu: {v.details.get('gpu')}")
        expected = "idle" if args.cpu_dry_run else "gpu_wait"
        ok = state == expected and took <= (pg.stuck_threshold_seconds or 60.0) + 10.0
        print(f"# {'PASS' if ok else 'FAIL'}: culprit {state} (expected {expected}), named in {took:.1f}s; "
              f"whole scenario {time.monotonic() - started:.0f}s")
        return 0 if ok else 4
    except TimeoutError as e:
        tails = "\n".join(f"--- rank {r}\n" + (work / f"rank{r}.log").read_text(errors="replace")[-1500:]
                          for r in range(WORLD))
        print(f"# FAIL: {e}\n{tails}", file=sys.stderr)
        return 4
    finally:
        (control / "stop").write_text("1")
        app.stop()
        for proc in procs:  # the victim never returns from its kernel: kill, do not wait for it
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
        for log in logs:
            log.close()
