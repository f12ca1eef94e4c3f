"""A wedged rank's stack from py-spy, end to end: a real gloo rank holds the GIL in C, torch's worker server runs
py-spy in it, and `frexporter serve --evidence-stacks` shows where that rank's main thread is."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from frexporter import naming as n
from frexporter.sources import pyspy
from tests.harness import REPO, Job, free_port, metrics, missing, require, wait_for


def pyspy_binary() -> str:
    """py-spy (a test dependency: pip puts it next to the interpreter, which need not be on PATH)."""
    found = shutil.which("py-spy", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                          os.environ.get("PATH", "")]))
    if not found:
        missing("py-spy is not installed (pip install -e '.[test]' brings it)")
    return found


def require_ptrace(binary: str) -> None:
    """torch's pyspy_dump runs py-spy as a child of the rank it reads: the same relation as here."""
    probe = subprocess.run([binary, "dump", "--nonblocking", "--pid", str(os.getpid())], capture_output=True,
                           timeout=60)
    require(probe.returncode == 0, "py-spy cannot read its parent process here (ptrace not permitted?): "
                                   + (probe.stdout + probe.stderr).decode(errors="replace")[-300:])


def wrapper_dir(tmp: Path, body: str) -> Path:
    """A directory holding a `py-spy` script: what the ranks' worker servers run (they find it on PATH)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    script = bin_dir / "py-spy"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return bin_dir


class Serve:
    """`frexporter serve` as a real process."""

    def __init__(self, spool: Path, *flags: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "frexporter", "serve", "--dir", str(spool), "--listen", f"127.0.0.1:{self.port}",
             "--poll-interval", "0.2", "--rank-timeout", "1", "--no-nvml", *flags],
            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def get(self, path: str) -> str | None:
        if self.proc.poll() is not None:
            pytest.fail(f"serve exited {self.proc.returncode}: {self.proc.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(self.base + path, timeout=10) as resp:
                return resp.read().decode()
        except (urllib.error.URLError, ConnectionError):
            return None  # not listening yet

    def rank(self, rank: int) -> dict[str, Any] | None:
        body = self.get("/api/v1/status")
        if body is None:
            return None
        return next((r for r in json.loads(body)["ranks"] if r["rank"] == rank), None)

    def errors(self) -> dict[str, float]:
        parsed = metrics(self.get("/metrics") or "")
        return {labels[n.L_REASON]: value for labels, value in parsed.get(n.SOURCE_ERRORS_TOTAL, [])
                if labels.get(n.L_SOURCE) == n.SOURCE_RANKS}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def serve() -> Iterator[Any]:
    started: list[Serve] = []

    def make(spool: Path, *flags: str) -> Serve:
        started.append(Serve(spool, *flags))
        return started[-1]

    yield make
    for s in started:
        s.stop()


def gil_job(job_factory: Any, bin_dir: Path, seconds: float) -> Job:
    job = job_factory("gil", 2, env={"JOB_GIL_SECONDS": str(seconds),
                                     "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"})
    job.wait_ready()
    return job


def test_wedged_rank_shows_py_spy_stack_of_the_function_holding_the_gil(job_factory, serve, tmp_path: Path) -> None:
    binary = pyspy_binary()
    require_ptrace(binary)
    calls = tmp_path / "calls"
    # The real py-spy, behind a script that counts its runs: the rate limit is seen from the rank's side.
    bin_dir = wrapper_dir(tmp_path, f'echo "$@" >> {calls}\nexec {binary} "$@"\n')
    job = gil_job(job_factory, bin_dir, seconds=12)
    # A wedge is a verdict after --stuck-after.
    exp = serve(job.spool, "--evidence-stacks", "--stuck-after", "2", "--stuck-floor", "1")
    wait_for(lambda: (r := exp.rank(0)) and r["status"] == "ok" and r["activity"]["frames_source"] == "recorder",
             timeout=30, what="rank 0 seen healthy, its stack from its own recorder")

    job.touch("wedge")
    job.wait_ready("wedged", ranks=[0], timeout=20)
    rank = wait_for(lambda: (r := exp.rank(0)) and r["activity"]["frames_source"] == "py-spy" and r,
                    timeout=10, what="rank 0's activity with py-spy's frames")
    activity = rank["activity"]
    assert rank["status"] == "unresponsive" and activity["state"] == "wedged"
    # Innermost first: the function inside whose C call the GIL is held, then the line that called it.
    functions = [(f["function"], f["file"], f["line"] > 0) for f in activity["frames"]]
    assert functions[:2] == [("hold_gil", "job.py", True), ("<module>", "job.py", True)], activity["frames"]

    verdict = wait_for(lambda: next((v for v in json.loads(exp.get("/api/v1/status") or "{}").get("verdicts", [])
                                     if v["kind"] == "rank_unresponsive" and v["ranks"] == [0]
                                     and v["activity"]["0"]["frames_source"] == "py-spy"), None),
                       timeout=10, what="the rank_unresponsive verdict with py-spy's stack")
    assert verdict["activity"]["0"]["frames"] == activity["frames"]
    assert "py-spy finds its main thread in hold_gil (job.py:" in verdict["summary"], verdict["summary"]
    page = exp.get("/") or ""
    # The line of hold_gil's usleep call, where py-spy finds the main thread (read, not spelled: job.py moves).
    source = (REPO / "tests" / "workers" / "job.py").read_text(encoding="utf-8").splitlines()
    usleep = next(i for i, line in enumerate(source, 1) if "libc.usleep(int(" in line)
    assert f"wedged in hold_gil (job.py:{usleep}) (py-spy)" in page
    job.wait_ready("unwedged", ranks=[0], timeout=30)
    # One run for the exporter's activity and one for the evidence bundle, over ~50 polls of a 12 s wedge.
    runs = calls.read_text().splitlines()
    assert 1 <= len(runs) <= 2, runs
    assert all("--nonblocking" in r for r in runs), runs
    wait_for(lambda: (r := exp.rank(0)) and r["status"] == "ok" and r["activity"]["frames_source"] == "recorder"
             and r["activity"]["state"] != "wedged", timeout=15, what="rank 0 sampling itself again")
    assert not {pyspy.REASON_INVALID, pyspy.REASON_FAILED} & set(exp.errors())


def test_garbage_from_a_real_worker_server_is_counted_and_the_last_own_sample_kept(job_factory, serve,
                                                                                   tmp_path: Path) -> None:
    # What the rank's worker server returns is whatever "py-spy" prints: here not UTF-8 and not py-spy's format.
    bin_dir = wrapper_dir(tmp_path, "printf 'Process \\377\\376 garbage\\n\\000\\033[31m'\n")
    job = gil_job(job_factory, bin_dir, seconds=6)
    exp = serve(job.spool, "--evidence-stacks")
    # Parked after its collectives, the rank samples its own stack (it makes no progress): wedge it after that.
    wait_for(lambda: (r := exp.rank(0)) and r["status"] == "ok" and r["activity"]["frames"], timeout=30,
             what="rank 0 seen healthy, with its own stack sampled")
    job.touch("wedge")
    job.wait_ready("wedged", ranks=[0], timeout=20)
    wait_for(lambda: exp.errors().get(pyspy.REASON_INVALID), timeout=10, what="the garbage counted")
    rank = exp.rank(0)
    assert rank["status"] == "unresponsive" and rank["activity"]["state"] == "wedged"
    # Its own last sample (full paths, as the recorder reports them) stands, marked as such.
    assert rank["activity"]["frames_source"] == "recorder"
    assert any(f["file"].endswith("/workers/job.py") for f in rank["activity"]["frames"]), rank["activity"]
    assert exp.errors()[pyspy.REASON_INVALID] == 1  # one fetch per wedge, not one per poll
