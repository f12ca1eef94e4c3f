"""Test harness: real multi-process gloo jobs, an in-process exporter, and deadline polling."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "workers" / "job.py"
T = TypeVar("T")


def require_tool(name: str) -> str:
    """Path of an external tool; skip without it, fail instead when CI demands every tool."""
    path = shutil.which(name)
    if path:
        return path
    if os.environ.get("FREXPORTER_REQUIRE_TOOLS") == "1":
        pytest.fail(f"{name} is required (FREXPORTER_REQUIRE_TOOLS=1) but not on PATH")
    pytest.skip(f"{name} not installed")


def wait_for(predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.05, what: str = "") -> T:
    """Poll until predicate returns something truthy; fail with the last value at the deadline."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = predicate()
        except AssertionError as e:
            last = e
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}: last={last!r}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Job:
    """World-size processes running tests/workers/job.py SCENARIO with the recorder installed."""

    def __init__(self, tmp: Path, scenario: str, world: int, job_id: str = "job",
                 env: dict[str, str] | None = None) -> None:
        self.scenario = scenario
        self.world = world
        self.job_id = job_id
        self.spool = tmp / "spool"
        self.control = tmp / "control"
        self.control.mkdir(parents=True, exist_ok=True)
        self.extra_env = env or {}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def start(self) -> Job:
        port = free_port()
        env = dict(os.environ)
        env.update({
            "FREXPORTER_DIR": str(self.spool),
            "FREXPORTER_JOB_ID": self.job_id,
            "FREXPORTER_SNAPSHOT_INTERVAL": "0.2",
            "PYTHONPATH": str(REPO),
            "JOB_MAX_LIFETIME": "240",
            "OMP_NUM_THREADS": "1",
        })
        env.update(self.extra_env)
        for rank in range(self.world):
            log = self.control / f"rank{rank}.log"
            self.logs.append(log)
            with open(log, "wb") as out:
                self.procs.append(subprocess.Popen(
                    [sys.executable, str(WORKER), self.scenario, str(rank), str(self.world), str(port),
                     str(self.control)], env=env, stdout=out, stderr=subprocess.STDOUT))
        return self

    def marker(self, rank: int, tag: str = "ready") -> Path:
        return self.control / f"rank{rank}.{tag}"

    def wait_ready(self, tag: str = "ready", ranks: list[int] | None = None, timeout: float = 90.0) -> None:
        ranks = list(range(self.world)) if ranks is None else ranks

        def check() -> bool:
            for rank in ranks:
                code = self.procs[rank].poll()
                if code is not None and not self.marker(rank, tag).exists():
                    raise RuntimeError(f"rank {rank} exited {code} before {tag}:\n{self.log(rank)}")
            return all(self.marker(r, tag).exists() for r in ranks)

        wait_for(check, timeout=timeout, what=f"ranks {ranks} {tag}")

    def touch(self, name: str) -> None:
        (self.control / name).write_text("1")

    def log(self, rank: int) -> str:
        try:
            return self.logs[rank].read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        self.touch("stop")
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait()


def metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def sample(parsed: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float | None:
    for sample_labels, value in parsed.get(name, []):
        if all(sample_labels.get(k) == v for k, v in labels.items()):
            return value
    return None
