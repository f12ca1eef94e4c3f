"""The container image as it ships, built and run: the repository's Dockerfile (no second file) built by
scripts/build_image.sh with podman from a base made of Debian packages (mmdebstrap), passed as its BASE_IMAGE.

No container runs here (no runtime works in this sandbox: `setrlimit RLIMIT_NOFILE` is refused), so the test
does what a runtime would with the built image's own config: it mounts the image's filesystem (`podman image
mount`), binds it read-only into a private mount namespace (the chart's readOnlyRootFilesystem), adds /dev,
/proc and the spool (read-only, as the chart mounts it), and runs the image's ENTRYPOINT + CMD there with
chroot as the image's USER, with the image's ENV and nothing else. Root is needed (mounts, chroot --userspec),
as CI has.

The image is built once per run (module fixture, about a minute on two cores), in its own podman storage under
a temporary directory that goes when the module ends.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

import frexporter
from frexporter import spool
from tests import spoolgen
from tests.harness import REPO, free_port, require, require_tool, try_get, wait_for

TAG = "localhost/frexporter:e2e"
JOB_ID = "image-test"
VALUES = REPO / "helm" / "frexporter" / "values.yaml"
BUILD_TIMEOUT = 900  # mmdebstrap + the build's pip installs from PyPI; about a minute here

# Runs in a new private mount namespace (unshare -m): the image's tree bound read-only at $1, /dev and /proc
# added, the spool ($3, if any) bound read-only at $4 inside it, then chroot into it as $5 with exactly the
# environment and argv that follow (env -i). Every mount goes with the namespace when the command exits.
IN_IMAGE = """set -e
root=$1 image=$2 spool=$3 spool_at=$4 user=$5; shift 5
mount --bind "$image" "$root"
mount -o remount,bind,ro "$root"
mount --rbind /dev "$root/dev"
mount -t proc proc "$root/proc"
if [ -n "$spool" ]; then
  mount --bind "$spool" "$root$spool_at"
  mount -o remount,bind,ro "$root$spool_at"
fi
exec chroot --userspec="$user" "$root" env -i "$@"
"""


@dataclass(frozen=True)
class Image:
    tag: str
    mountpoint: Path  # the image's filesystem, from `podman image mount`: never written to
    inspect: dict[str, Any]  # `podman image inspect`

    @property
    def config(self) -> dict[str, Any]:
        return dict(self.inspect["Config"])

    @property
    def env(self) -> list[str]:
        return list(self.config.get("Env") or [])

    def env_value(self, key: str) -> str:
        values = [e.partition("=")[2] for e in self.env if e.partition("=")[0] == key]
        assert values, f"the image sets no {key}: {self.env}"
        return values[-1]

    def argv(self, root: Path, command: list[str], spool_dir: Path | None = None, user: str | None = None) -> list[str]:
        """``command`` as the image's user would run it in a container of this image (``user`` overrides)."""
        spool_at = self.env_value("FREXPORTER_DIR")
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", IN_IMAGE, "sh", str(root),
                str(self.mountpoint), str(spool_dir or ""), spool_at, user or self.config["User"], *self.env,
                *command]


def podman(storage: Path, *args: str, timeout: float = 120) -> str:
    argv = ["podman", "--storage-driver=vfs", "--root", str(storage / "storage"), "--runroot", str(storage / "run"),
            *args]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(args)}: {out.stdout[-2000:]}{out.stderr[-3000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def image() -> Iterator[Image]:
    require(os.geteuid() == 0, "building and mounting the image needs root (mmdebstrap, mounts, chroot)")
    for tool, package in (("podman", "podman"), ("mmdebstrap", "mmdebstrap"), ("unshare", "util-linux"),
                          ("chroot", "coreutils")):
        require_tool(tool, f"apt-get install {package}; scripts/setup.sh --test installs it")
    storage = Path(tempfile.mkdtemp(prefix="frexporter-image-"))
    try:
        out = subprocess.run([str(REPO / "scripts" / "build_image.sh"), "--root", str(storage), "--tag", TAG],
                             capture_output=True, text=True, timeout=BUILD_TIMEOUT, cwd=REPO)
        assert out.returncode == 0, f"scripts/build_image.sh failed:\n{out.stdout[-3000:]}{out.stderr[-6000:]}"
        assert out.stdout.strip().splitlines()[-1] == TAG
        (inspect,) = json.loads(podman(storage, "image", "inspect", TAG))
        mountpoint = Path(podman(storage, "image", "mount", TAG).strip())
        try:
            yield Image(TAG, mountpoint, inspect)
        finally:
            podman(storage, "image", "unmount", TAG)
    finally:
        shutil.rmtree(storage, ignore_errors=True)


def run_in(image: Image, tmp_path: Path, command: list[str]) -> subprocess.CompletedProcess[str]:
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    return subprocess.run(image.argv(root, command), capture_output=True, text=True, timeout=120)


def test_image_config_matches_the_chart(image: Image) -> None:
    """What the chart's pods rely on: a numeric non-root USER (runAsNonRoot can only check a number) that is
    the chart's runAsUser, the frexporter entrypoint with `serve`, the metrics port, the spool path."""
    values = yaml.safe_load(VALUES.read_text(encoding="utf-8"))
    user = image.config["User"]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, f"the image must run as a numeric non-root uid, not {user!r}"
    assert (int(uid), int(gid)) == (values["securityContext"]["runAsUser"], values["securityContext"]["runAsGroup"])
    assert image.config["Entrypoint"] == ["frexporter"]
    assert image.config["Cmd"] == ["serve"]
    assert f"{values['exporter']['port']}/tcp" in image.config["ExposedPorts"]
    assert image.env_value("FREXPORTER_DIR") == values["spool"]["mountPath"]
    healthcheck = image.inspect.get("Healthcheck") or image.config.get("Healthcheck") or {}
    assert "/healthz" in " ".join(healthcheck.get("Test") or []), f"no HEALTHCHECK kept: {healthcheck}"
    # The user exists in the image (tools that resolve the uid, and `ps` in a debug session, find a name).
    passwd = (image.mountpoint / "etc" / "passwd").read_text(encoding="utf-8")
    assert any(line.split(":")[2:4] == [uid, gid] for line in passwd.splitlines()), passwd


def test_image_holds_no_torch(image: Image, tmp_path: Path) -> None:
    out = run_in(image, tmp_path, ["python", "-c", "import importlib.util, sys; import frexporter; "
                                   "print(importlib.util.find_spec('torch'), frexporter.__file__, sys.prefix)"])
    assert out.returncode == 0, out.stderr
    found, module, prefix = out.stdout.split()
    assert found == "None", "torch is importable in the image"
    assert module.startswith(prefix + "/"), "frexporter is not the venv's"
    # Nor anywhere else on disk (another interpreter's site-packages).
    torches = [p for p in image.mountpoint.glob("**/*-packages/torch*") if not p.is_symlink()]
    assert torches == []


def test_entrypoint_version(image: Image, tmp_path: Path) -> None:
    out = run_in(image, tmp_path, [*image.config["Entrypoint"], "--version"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"frexporter {frexporter.__version__}"


def uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid in /proc/{pid}/status")


def test_entrypoint_serves_a_spool(image: Image, tmp_path: Path) -> None:
    """ENTRYPOINT + CMD with the chart's flags, on a read-only root and a read-only spool holding one rank:
    /metrics shows the rank, the HEALTHCHECK command passes, SIGTERM ends it cleanly."""
    uid, _, gid = image.config["User"].partition(":")
    spool_dir = tmp_path / "spool"
    spoolgen.write_rank(spool_dir, JOB_ID, 0, world=1, pid=os.getpid())
    # The ranks' files as the exporter finds them where the chart runs the ranks as its uid (without group mode).
    os.chmod(spool_dir, spool.DIR_MODE)
    for path in (spool_dir, *spool_dir.iterdir()):
        os.chown(path, int(uid), int(gid))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    root = tmp_path / "root"
    root.mkdir()
    command = [*image.config["Entrypoint"], *image.config["Cmd"], "--dir", image.env_value("FREXPORTER_DIR"),
               "--listen", f"127.0.0.1:{port}", "--evidence-dir", ""]
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(image.argv(root, command, spool_dir), stdout=out, stderr=subprocess.STDOUT)
    try:
        def scraped() -> str | None:
            if proc.poll() is not None:  # not an AssertionError: wait_for would keep polling to its deadline
                raise RuntimeError(f"serve exited {proc.returncode}:\n{log.read_text()[-4000:]}")
            answer = try_get(base + "/metrics")
            return answer[1] if answer and answer[0] == 200 and f'job_id="{JOB_ID}"' in answer[1] else None

        text = wait_for(scraped, timeout=60, what="the rank in the image's /metrics")
        # unshare, sh, chroot and env exec one another: the process is the exporter itself, as the image's user.
        assert uid_of(proc.pid) == int(uid)
        lines = text.splitlines()
        assert f'frexporter_build_info{{version="{frexporter.__version__}"}} 1.0' in lines
        assert 'frexporter_source_up{source="ranks"} 1.0' in lines
        assert any(ln.startswith("frexporter_rank_info{") and f'job_id="{JOB_ID}"' in ln for ln in lines)
        healthcheck = image.inspect.get("Healthcheck") or image.config["Healthcheck"]
        assert healthcheck["Test"][0] == "CMD"
        check = run_in(image, tmp_path, [f"FREXPORTER_HEALTHCHECK_URL={base}/healthz", *healthcheck["Test"][1:]])
        assert check.returncode == 0, check.stderr
        proc.terminate()  # what the kubelet sends
        assert proc.wait(timeout=15) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=15)
