"""`frexporter run -- COMMAND`: the recorder in every rank without a code change.

A directory holding our ``sitecustomize.py`` goes first on PYTHONPATH, so every
Python process the command starts (torchrun's workers included) imports it; it
turns Flight Recorder on before the first process group and starts the recorder.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from frexporter import spool

SITE_DIR = str(Path(__file__).parent / "site")


def recorder_env(directory: str | None, job_id: str | None, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["FREXPORTER_DIR"] = directory or env.get("FREXPORTER_DIR") or spool.default_dir()
    if job_id:
        env["FREXPORTER_JOB_ID"] = job_id
    # frexporter itself must be importable by the sitecustomize, wherever it is installed.
    package_root = str(Path(__file__).parents[2])
    parts = [SITE_DIR, package_root, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    return env


def run_with_recorder(argv: list[str], directory: str | None = None, job_id: str | None = None) -> int:
    env = recorder_env(directory, job_id)
    spool.ensure_dir(env["FREXPORTER_DIR"])
    proc = subprocess.Popen(argv, env=env)
    # Forward termination so a launcher under us shuts its ranks down cleanly.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: proc.send_signal(s))
    return proc.wait()
