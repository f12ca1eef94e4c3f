"""What the rank's environment says about it: its job id and its launcher's facts (torchrun, Slurm).

Everything here is read from variables a launcher or a user set, and is untrusted text: undecodable bytes are
escaped (safetext.from_environment), integers checked, failures counted, never raised.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from frexporter import reasons, safetext, spool

# Launcher environment variables, per launcher, as the manifest's launcher fields (torchrun first).
LAUNCHER_ENV: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("torchelastic", (("rank", "RANK"), ("local_rank", "LOCAL_RANK"), ("world_size", "WORLD_SIZE"),
                      ("local_world_size", "LOCAL_WORLD_SIZE"), ("node_rank", "GROUP_RANK"),
                      ("run_id", "TORCHELASTIC_RUN_ID"))),
    ("slurm", (("rank", "SLURM_PROCID"), ("local_rank", "SLURM_LOCALID"), ("world_size", "SLURM_NTASKS"),
               ("local_world_size", "SLURM_NTASKS_PER_NODE"), ("node_rank", "SLURM_NODEID"),
               ("run_id", "SLURM_JOB_ID"))),
)
_LAUNCHER_TEXT_FIELDS = ("run_id",)


def default_job_id() -> str:
    for var in ("FREXPORTER_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "JOB_ID"):
        value = os.environ.get(var)
        if value and value != "none":
            return safetext.from_environment(value)
    return "default"


def launcher_facts(environ: Mapping[str, str], count_error: Callable[[str, BaseException], None]) -> dict[str, Any]:
    """The first launcher whose rank variable is set, as the manifest's ``launcher`` fields; a variable that
    does not parse (not an integer, not UTF-8, too long) is dropped and counted, never raised."""
    for kind, fields in LAUNCHER_ENV:
        if fields[0][1] not in environ:
            continue
        out: dict[str, Any] = {"kind": kind}
        for key, var in fields:
            raw = environ.get(var)
            if raw is None:
                continue
            try:
                if len(raw) > spool.MAX_TEXT_CHARS:
                    raise ValueError(f"{var} is {len(raw)} characters long")
                raw.encode("utf-8")  # undecodable bytes arrive as lone surrogates
                if key in _LAUNCHER_TEXT_FIELDS:
                    out[key] = raw
                else:
                    # SLURM_NTASKS_PER_NODE may read "4(x2)": 4 tasks on each of 2 nodes.
                    value = int(raw.split("(", 1)[0])
                    if not 0 <= value <= spool.MAX_RANK:
                        raise ValueError(f"{var} is out of range")
                    out[key] = value
            except (ValueError, UnicodeEncodeError) as e:
                count_error(reasons.LAUNCHER_ENV, e)
        return out
    return {}


def held_by_other(manifest_path: str) -> bool:
    """The manifest names a live process other than this one."""
    try:
        with open(manifest_path, "rb") as f:
            pid = json.loads(f.read(spool.MAX_MANIFEST_BYTES)).get("pid")
    except (OSError, ValueError, AttributeError):
        return False
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # alive, another user's
    return True


def env_int(name: str, default: int) -> int:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return default
