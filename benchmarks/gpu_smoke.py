"""Smoke test of the real GPU paths; run on a GPU machine.

    python -m benchmarks.gpu_smoke [--polls 20] [--interval 0.5] [--per-link]   # NVML only (from the repo root)
    python -m benchmarks.gpu_smoke --nccl [--nccl-only] [--steps 50] [--hang-seconds 8]
    python -m benchmarks.gpu_smoke --hung-gpu [--cpu-dry-run]   # 4 ranks on one GPU, one behind a hung kernel

NVML: reads every GPU through ``PynvmlBackend``, prints the GPU families as
Prometheus text, the series count per GPU and the recovery action the driver
asks for, and how long ``collect()`` and rendering take (the exporter's CPU
budget is 2% of a core at a 1 s poll). A field the driver or the GPU does not
have (the recovery action before driver 570) is absent, not a field error.

NCCL (``--nccl``): starts a one-rank NCCL job with the recorder installed and
``FREXPORTER_NCCL_TIMING=1`` (so FR entries carry ``duration_ms``), runs an
exporter over its spool directory, and prints what the exporter saw: the
collective duration histogram, the byte counter and the PG sequence numbers.
Then it injects a hang a one-rank group can have: ``torch.cuda._sleep`` on the
current stream before an all_reduce, so the NCCL kernel queues behind the sleep
and the collective stays in flight longer than a short ``--stuck-after``. The
exporter must show it as a ``stalled`` verdict (every member joined, none
completes) with the GPU's NVML facts attached, and clear it once the sleep ends.
``--cpu-dry-run`` runs the same harness on gloo/CPU (no hang: nothing to sleep
on) to check the plumbing on a machine without a GPU.

``--hung-gpu``: the scenario in ``benchmarks/gpu_hang.py`` (a rank waiting on its GPU is ``gpu_wait``, named
at the learned threshold); with ``--nccl`` or the NVML part it runs last.

Exit codes: 1 NVML unavailable, 2 a reading had field errors, 3 no CUDA or no
NCCL in this torch, 4 the NCCL job or the exporter did not show what it should.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from benchmarks import gpu_hang
from frexporter import naming as n
from frexporter.model import GpuReading, gpu_recovery_action_name
from frexporter.outputs.gpu_metrics import gpu_metric_families
from frexporter.sources.base import SourceError
from frexporter.sources.nvml import NvmlSource, PynvmlBackend


class _Collector:
    def __init__(self, reading: GpuReading, per_link: bool) -> None:
        self.reading, self.per_link = reading, per_link

    def collect(self) -> Iterator[Metric]:
        yield from gpu_metric_families(self.reading, nvlink_per_link=self.per_link)


def nvml_smoke(args: argparse.Namespace) -> int:
    source = NvmlSource(PynvmlBackend())
    collect_ms: list[float] = []
    cpu_ms: list[float] = []
    reading: GpuReading | None = None
    try:
        for poll in range(max(1, args.polls)):
            if poll:
                time.sleep(args.interval)  # pacing a real poll loop, not a test wait
            wall, cpu = time.perf_counter(), time.process_time()
            reading = source.read()
            collect_ms.append((time.perf_counter() - wall) * 1e3)
            cpu_ms.append((time.process_time() - cpu) * 1e3)
    except SourceError as exc:
        print(f"NVML unavailable: reason={exc.reason}: {exc}", file=sys.stderr)
        return 1
    finally:
        source.close()
    assert reading is not None

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(reading, args.per_link))
    started = time.perf_counter()
    text = generate_latest(registry).decode()
    render_ms = (time.perf_counter() - started) * 1e3
    print(text)

    per_gpu = Counter(
        sample.labels[n.L_GPU]
        for family in gpu_metric_families(reading, nvlink_per_link=args.per_link)
        for sample in family.samples
    )
    print(f"# driver {reading.driver_version}, {len(reading.gpus)} GPUs", file=sys.stderr)
    for gpu in reading.gpus:
        state = "LOST" if gpu.lost else "ok"
        recovery = "absent" if gpu.recovery_action is None else gpu_recovery_action_name(gpu.recovery_action)
        print(
            f"#   gpu {gpu.index} {gpu.uuid} {gpu.name}: {state}, {per_gpu[str(gpu.index)]} series, "
            f"recovery action {recovery}",
            file=sys.stderr,
        )
    print(
        f"# collect(): median {statistics.median(collect_ms):.2f} ms wall, "
        f"{statistics.median(cpu_ms):.2f} ms CPU, max {max(collect_ms):.2f} ms over {len(collect_ms)} polls "
        f"(first, with init: {collect_ms[0]:.2f} ms); render {render_ms:.2f} ms",
        file=sys.stderr,
    )
    if reading.field_errors:
        print(f"# field errors: {dict(reading.field_errors)}", file=sys.stderr)
        return 2
    return 0


# ---------------------------------------------------------------- NCCL job through recorder + exporter

T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent
METRIC_PREFIXES = (n.COLLECTIVE_DURATION_SECONDS, n.COLLECTIVE_BYTES_TOTAL, n.PG_LAST_ENQUEUED_SEQ,
                   n.PG_LAST_STARTED_SEQ, n.PG_LAST_COMPLETED_SEQ, n.PG_INFLIGHT_COLLECTIVES, n.VERDICT,
                   n.RANK_COLLECTIVE_WAIT_SECONDS)


def _cuda_problem(cpu: bool) -> str | None:
    """Why the NCCL part cannot run here, or None. Checked in this process so a GPU-less machine fails in
    seconds, before any job starts."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        return f"torch is not installed ({e})"
    if cpu:
        return None if dist.is_gloo_available() else "this torch has no gloo"
    if not torch.cuda.is_available():
        return f"CUDA is not available (torch {torch.__version__}, built for CUDA {torch.version.cuda})"
    if not dist.is_nccl_available():
        return f"this torch ({torch.__version__}) has no NCCL"
    return None


def _rank_worker(spool: str, control: str, port: int, steps: int, hang_seconds: float, cpu: bool) -> int:
    """The one rank: install the recorder, run ``steps`` all_reduces, then the injected hang on request."""
    os.environ["FREXPORTER_DIR"] = spool
    from frexporter.recorder import install

    install()  # before the first process group: FR on, and TORCH_NCCL_ENABLE_TIMING=1 from FREXPORTER_NCCL_TIMING
    import torch
    import torch.distributed as dist

    device = torch.device("cpu" if cpu else "cuda:0")
    if not cpu:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    t = torch.ones(1 << 20, device=device)  # 4 MiB of float32 per all_reduce
    for _ in range(steps):
        dist.all_reduce(t)
    if not cpu:
        torch.cuda.synchronize()
    Path(control, "ready").write_text(os.environ.get("TORCH_NCCL_ENABLE_TIMING", ""))
    while not Path(control, "hang").exists() and not Path(control, "stop").exists():
        time.sleep(0.05)
    if Path(control, "hang").exists() and not cpu:
        # ProcessGroupNCCL makes its stream wait for the current one: the all_reduce below cannot start (or
        # complete) before the sleep kernel ends, so FR shows it in flight for about hang_seconds.
        clock_hz = 1.5e9  # a rough SM clock; the printed timings say how long it really was
        torch.cuda._sleep(int(hang_seconds * clock_hz))
        dist.all_reduce(t)
        Path(control, "hung").write_text(str(time.time()))
        torch.cuda.synchronize()
        Path(control, "released").write_text(str(time.time()))
    while not Path(control, "stop").exists():
        time.sleep(0.05)
    os._exit(0)  # one-rank group, nothing to tear down that matters here


def _wait(what: str, predicate: Callable[[], T], timeout: float, proc: subprocess.Popen[bytes] | None = None) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the rank exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:g}s")
        time.sleep(0.1)  # polling a condition with a deadline, not a fixed wait


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def _print_metrics(text: str) -> None:
    for line in text.splitlines():
        if line.startswith(METRIC_PREFIXES):
            print("    " + line)


def nccl_smoke(args: argparse.Namespace) -> int:
    problem = _cuda_problem(args.cpu_dry_run)
    if problem:
        print(f"NCCL smoke not run: {problem}", file=sys.stderr)
        return 3
    from frexporter.analysis import STALLED
    from frexporter.app import ServeConfig, build_app
    from frexporter.model import DURATION_BUCKETS

    work = Path(tempfile.mkdtemp(prefix="frexporter-gpu-smoke-"))
    spool, control = work / "spool", work / "control"
    control.mkdir()
    env = {**os.environ, "FREXPORTER_NCCL_TIMING": "1", "FREXPORTER_JOB_ID": "gpu-smoke",
           "FREXPORTER_SNAPSHOT_INTERVAL": "0.2", "PYTHONPATH": str(REPO)}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(work / "rank0.log", "wb")  # noqa: SIM115 (closed in finally, after the process)
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_smoke", "--rank-worker", str(spool), str(control),
                             str(port), str(args.steps), str(args.hang_seconds), "1" if args.cpu_dry_run else "0"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    app = build_app(ServeConfig(str(spool), port=0, poll_interval=0.5, stuck_after=args.stuck_after, rank_timeout=2.0,
                                sources=("ranks",) if args.cpu_dry_run else ("ranks", "nvml"), deep_interval=1.0,
                                evidence_dir="", collective_waits=True))
    started = False
    try:
        _wait("rank ready", (control / "ready").exists, 120, proc)
        timing = (control / "ready").read_text()
        print(f"# rank ready: {args.steps} all_reduces of 4 MiB, TORCH_NCCL_ENABLE_TIMING={timing or 'unset'}")
        app.start()
        started = True

        def counted(every: bool) -> Any:
            stats = [c for c in app.exporter.snapshot.collectives if c.op == "all_reduce"]
            return stats if stats and (not every or stats[0].bytes >= args.steps * 4 * (1 << 20)) else None

        stats = _wait("all_reduces counted by the exporter", lambda: counted(False), 30)[0]
        try:
            # An entry read between its retirement and its duration waits for the next deep read, which an
            # idle rank only gets once its pg_status moves again: do not wait for that forever.
            stats = _wait("every all_reduce counted", lambda: counted(True), 10)[0]
        except TimeoutError:
            stats = counted(False)[0]
        print(f"# exporter saw: {stats.bytes} bytes, {stats.duration_count} durations, "
              f"sum {stats.duration_sum * 1e3:.3f} ms")
        if stats.duration_count:
            median_bucket = next(b for b, c in zip(DURATION_BUCKETS, stats.bucket_counts, strict=True)
                                 if c >= stats.duration_count / 2)
            print(f"#   mean {stats.duration_sum / stats.duration_count * 1e6:.1f} us, median <= {median_bucket} s")
        _print_metrics(_scrape(app.port))
        # torch writes durations "best-effort" (the watchdog may give up on one): some missing is a note, none
        # at all means timing was not on.
        ok = stats.bytes == args.steps * 4 * (1 << 20) and (args.cpu_dry_run or stats.duration_count > 0)
        if not ok:
            print("# FAIL: expected every all_reduce counted once"
                  + ("" if args.cpu_dry_run else " and durations (is TORCH_NCCL_ENABLE_TIMING honoured?)"),
                  file=sys.stderr)
        elif not args.cpu_dry_run and stats.duration_count < args.steps:
            print(f"# note: {args.steps - stats.duration_count} of {args.steps} all_reduces came without a duration")
        if args.cpu_dry_run:
            print("# cpu dry run: no hang injected (torch.cuda._sleep needs a GPU)")
            return 0 if ok else 4

        (control / "hang").write_text("1")
        hung_at = float(_wait("the hang to start", lambda: (control / "hung").exists() and
                              (control / "hung").read_text(), 30, proc))

        def stalled() -> Any:
            return [v for v in app.exporter.snapshot.verdicts if v.kind == STALLED]

        verdict = _wait("a stalled verdict", stalled, args.hang_seconds + 10, proc)[0]
        print(f"# verdict {time.time() - hung_at:.1f}s after the all_reduce was enqueued "
              f"(stuck-after {args.stuck_after:g}s): {verdict.kind} ranks={list(verdict.ranks)} seq={verdict.seq}")
        print(f"#   {verdict.summary}")
        print(f"#   details.gpu: {verdict.details.get('gpu')}")
        _print_metrics(_scrape(app.port))
        released = float(_wait("the sleep to end", lambda: (control / "released").exists() and
                               (control / "released").read_text(), args.hang_seconds * 4 + 30, proc))
        print(f"# the injected hang lasted {released - hung_at:.1f}s")
        _wait("the verdict to clear", lambda: not stalled(), 15, proc)
        print("# verdict cleared once the collective completed")
        return 0 if ok else 4
    except (TimeoutError, RuntimeError) as e:
        tail = (work / "rank0.log").read_text(errors="replace")[-3000:]
        print(f"# FAIL: {e}; rank log {work / 'rank0.log'}:\n{tail}", file=sys.stderr)
        return 4
    finally:
        (control / "stop").write_text("1")
        if started:
            app.stop()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--hang-worker":
        spool, control, port, rank, cpu = sys.argv[2:7]
        return gpu_hang.worker(spool, control, int(port), int(rank), cpu == "1")
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-worker":
        spool, control, port, steps, hang, cpu = sys.argv[2:8]
        return _rank_worker(spool, control, int(port), int(steps), float(hang), cpu == "1")
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--polls", type=int, default=20)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--per-link", action="store_true", help="NVLink errors per link, not summed")
    parser.add_argument("--nccl", action="store_true", help="also run the one-rank NCCL job through the exporter")
    parser.add_argument("--nccl-only", action="store_true", help="only the NCCL job (implies --nccl)")
    parser.add_argument("--cpu-dry-run", action="store_true", help="the NCCL harness on gloo/CPU, without the hang")
    parser.add_argument("--hung-gpu", action="store_true",
                        help="4 ranks on one GPU, one behind a kernel that never ends (benchmarks/gpu_hang.py)")
    parser.add_argument("--steps", type=int, default=50, help="all_reduces before the injected hang")
    parser.add_argument("--hang-seconds", type=float, default=8.0, help="how long the injected GPU sleep lasts")
    parser.add_argument("--stuck-after", type=float, default=2.0)
    args = parser.parse_args()
    if args.hung_gpu and not (args.nccl or args.nccl_only):
        if not args.cpu_dry_run:
            problem = _cuda_problem(False)
            if problem:
                print(f"hung-GPU scenario not run: {problem}", file=sys.stderr)
                return 3
        return gpu_hang.run(args)
    nccl = args.nccl or args.nccl_only or args.cpu_dry_run
    if nccl and args.stuck_after >= args.hang_seconds:
        parser.error("--stuck-after must be shorter than --hang-seconds, or the hang is never a verdict")
    code = 0 if args.nccl_only or args.cpu_dry_run else nvml_smoke(args)
    if nccl:
        code = code or nccl_smoke(args)
    if args.hung_gpu:
        code = code or gpu_hang.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
