"""The command line: serve as a real process, run with no code change, clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from frexporter import naming as n
from tests import spoolgen
from tests.harness import REPO, WORKER, Job, free_port, metrics, sample, wait_for

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def frexporter(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "frexporter", *args], capture_output=True, text=True, timeout=120,
                          env=ENV, **kw)  # type: ignore[call-overload]


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return 0, ""  # not listening yet


def test_serve_process_answers_every_endpoint_and_stops_on_sigterm(tmp_path: Path) -> None:
    spoolgen.write_rank(tmp_path, "job", 0, pgs=2)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "frexporter", "serve", "--dir", str(tmp_path), "--listen",
                             f"127.0.0.1:{port}", "--poll-interval", "0.2", "--no-nvml"], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_get(base + "/healthz")[0] == 200 if proc.poll() is None else pytest.fail(
            proc.stderr.read()), timeout=20, what="healthz")
        code, text = http_get(base + "/metrics")
        assert code == 200
        parsed = metrics(text)
        assert sample(parsed, n.PG_LAST_COMPLETED_SEQ, rank="0", pg_desc="pg1") == 10
        assert sample(parsed, n.BUILD_INFO) == 1
        code, body = http_get(base + "/api/v1/status")
        status = json.loads(body)
        assert code == 200 and status["ranks"][0]["rank"] == 0 and status["verdicts"] == []
        assert {"ranks", "process_groups", "verdicts"} <= set(status)
        code, page = http_get(base + "/")
        assert code == 200 and "frexporter on" in page
        assert http_get(base + "/nope")[0] == 404
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


def test_serve_rejects_bad_flags_with_a_clear_message() -> None:
    out = frexporter("serve", "--listen", "nonsense")
    assert out.returncode == 2 and "HOST:PORT" in out.stderr
    out = frexporter("serve", "--poll-interval", "-1")
    assert out.returncode == 2 and "must be > 0" in out.stderr
    out = frexporter("serve", "--poll-interval", "nan")
    assert out.returncode == 2 and "not a finite number" in out.stderr
    out = frexporter("serve", "--deep-interval", "-1")
    assert out.returncode == 2 and "must be >= 0" in out.stderr
    for value, message in (("0", "must be >= 1"), ("1.5", "is not a whole number")):
        out = frexporter("serve", "--web-max-connections", value)
        assert out.returncode == 2 and message in out.stderr, out.stderr


def test_serve_reports_a_busy_port(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        out = frexporter("serve", "--dir", str(tmp_path), "--listen", f"127.0.0.1:{s.getsockname()[1]}",
                         "--no-nvml")
    assert out.returncode == 1 and "cannot listen" in out.stderr


def test_help_and_version() -> None:
    out = frexporter("--help")
    assert out.returncode == 0 and "serve" in out.stdout and "demo" in out.stdout and "run" in out.stdout
    out = frexporter("--version")
    assert out.returncode == 0 and out.stdout.startswith("frexporter ")


def test_run_installs_the_recorder_without_code_change(tmp_path: Path) -> None:
    spool_dir, control = tmp_path / "spool", tmp_path / "control"
    control.mkdir()
    port = str(free_port())
    env = {**ENV, "JOB_INSTALL": "0", "JOB_MAX_LIFETIME": "60", "FREXPORTER_SNAPSHOT_INTERVAL": "0.2"}
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    procs = [subprocess.Popen([sys.executable, "-m", "frexporter", "run", "--dir", str(spool_dir), "--job-id",
                               "nocode", "--", sys.executable, str(WORKER), "counts", str(r), "2", port,
                               str(control)], env=env) for r in range(2)]
    try:
        def manifests() -> list[dict]:
            files = sorted(spool_dir.glob("*.manifest.json")) if spool_dir.exists() else []
            return [json.loads(f.read_text()) for f in files]

        found = wait_for(lambda: len(manifests()) == 2 and manifests(), timeout=60, what="two manifests")
        assert {m["job_id"] for m in found} == {"nocode"}
        assert all(m["fr_buffer_size"] == 2000 for m in found)  # Flight Recorder turned on by the wrapper
        wait_for(lambda: (control / "rank0.ready").exists(), timeout=60)
    finally:
        (control / "stop").write_text("1")
        for p in procs:
            assert p.wait(timeout=30) == 0


def python_without(modules: list[str], code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a process where ``modules`` cannot be imported, as if their packages were not installed."""
    block = ("import sys\n"
             f"for name in {modules!r}:\n"
             "    sys.modules[name] = None  # import raises ModuleNotFoundError, find_spec finds nothing\n")
    return subprocess.run([sys.executable, "-c", block + code, *args], capture_output=True, text=True, timeout=120,
                          env=ENV)


def without(modules: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI, ``frexporter ARGS``, without ``modules``."""
    return python_without(modules, "from frexporter.cli import main\nsys.exit(main(sys.argv[1:]))\n", *args)


def test_serve_without_the_serve_extra_names_the_pip_command(tmp_path: Path) -> None:
    out = without(["prometheus_client"], "serve", "--dir", str(tmp_path), "--listen", f"127.0.0.1:{free_port()}")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "frexporter: frexporter serve needs the 'serve' extra (prometheus_client is not installed): "
        "pip install 'frexporter[serve]'"]
    out = without(["prometheus_client"], "demo")
    assert out.returncode == 2 and out.stderr.strip().endswith("pip install 'frexporter[serve]'"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_otlp_endpoint_without_the_otlp_extra_names_the_pip_command(tmp_path: Path) -> None:
    out = without(["opentelemetry"], "serve", "--dir", str(tmp_path), "--listen", f"127.0.0.1:{free_port()}",
                  "--no-nvml", "--otlp-endpoint", "http://127.0.0.1:4318")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "frexporter: frexporter serve --otlp-endpoint needs the 'otlp' extra (opentelemetry.sdk is not installed): "
        "pip install 'frexporter[otlp]'"]
    # Without --otlp-endpoint the exporter runs, and nothing on its path imports OpenTelemetry.
    serve = ("from frexporter.app import ServeConfig, build_app\n"
             "app = build_app(ServeConfig(directory=sys.argv[1], port=0, sources=('ranks',), evidence_dir=''))\n"
             "app.start()\n"
             "app.stop()\n"
             "print(sorted(m for m, v in sys.modules.items() if v is not None and m.startswith('opentelemetry')))\n")
    out = python_without(["opentelemetry"], serve, str(tmp_path))
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_run_and_analyze_import_none_of_the_daemon_dependencies(tmp_path: Path) -> None:
    """The base install (no extras) is the recorder and these commands: they must work without any extra."""
    daemon = ["prometheus_client", "opentelemetry", "pynvml", "yaml", "bcrypt"]
    out = without(daemon, "run", "--dir", str(tmp_path / "spool"), "--", sys.executable, "-c", "print('ran')")
    assert out.returncode == 0 and out.stdout.strip() == "ran", out.stderr
    out = without(daemon, "analyze", str(tmp_path))
    assert out.returncode == 1 and "no rank data" in out.stderr, out.stderr


def test_run_without_command_is_a_usage_error() -> None:
    out = frexporter("run")
    assert out.returncode == 2 and "no command" in out.stderr


def test_deep_interval_spaces_the_routine_reads_of_a_busy_rank(tmp_path: Path) -> None:
    """A real rank making steady progress, watched by two exporters: with --deep-interval 0 its FR ring is read
    again on every poll that saw it move; with --deep-interval 1000 the routine reads stop after the first."""
    job = Job(tmp_path, "soak", world=1, env={"JOB_JITTER_SECONDS": "0.05", "JOB_PAUSE_EVERY": "1000000"})
    job.start()
    exporters: dict[str, tuple[int, subprocess.Popen[str]]] = {}
    try:
        job.wait_ready()
        for interval in ("0", "1000"):
            port = free_port()
            exporters[interval] = (port, subprocess.Popen(
                [sys.executable, "-m", "frexporter", "serve", "--dir", str(job.spool), "--listen",
                 f"127.0.0.1:{port}", "--poll-interval", "0.2", "--no-nvml", "--evidence-dir", "",
                 "--deep-interval", interval], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                text=True))

        def rank_status(interval: str) -> dict:
            port, proc = exporters[interval]
            if proc.poll() is not None:
                pytest.fail(f"serve --deep-interval {interval} exited: {proc.stderr.read()}")  # type: ignore[union-attr]
            code, body = http_get(f"http://127.0.0.1:{port}/api/v1/status")
            ranks = json.loads(body)["ranks"] if code == 200 else []
            # A rank is published before its first collective: until then it has no PG to count progress in.
            seen = ranks and ranks[0]["last_deep_read"] is not None and ranks[0]["process_groups"]
            return ranks[0] if seen else {}

        def completed(rank: dict) -> int:
            return max(pg["last_completed_seq"] for pg in rank["process_groups"])

        start = {i: wait_for(lambda i=i: rank_status(i), timeout=30, what=f"a deep read ({i})") for i in exporters}
        reads: dict[str, set[float]] = {i: {s["last_deep_read"]} for i, s in start.items()}

        def observe() -> bool:
            for interval in exporters:
                read = rank_status(interval).get("last_deep_read")  # {} if one status request went unanswered
                if read is not None:
                    reads[interval].add(read)
            return len(reads["0"]) >= 8

        wait_for(observe, timeout=30, interval=0.1, what="eight deep reads with --deep-interval 0")
        now = wait_for(lambda: rank_status("1000"), timeout=30, what="a status answer (1000)")
        moved = completed(now) - completed(start["1000"])
        assert moved > 0, "the rank made no progress: nothing for a deep read to refresh"
        # Not == 1: a poll may catch the same snapshot twice with a collective in flight (a possible stall, read at
        # once whatever the interval), or a loaded machine may leave the heartbeat stale for a poll.
        assert len(reads["1000"]) <= 2, f"{moved} collectives later, --deep-interval 1000 kept reading: {reads}"
    finally:
        for _, proc in exporters.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=20)
        job.stop()
