"""The spool's layout: file names and suffixes, format ids, modes, recorder names, the directory itself.

Per rank (``stem`` = sanitized job id + rank):
  ``<stem>.manifest.json``  identity and process-group table, rewritten when PGs change
  ``<stem>.snapshot.map``   heartbeat + torch's status, updated in place (``snapshot_map``); recorders before 0.2
                            wrote ``<stem>.snapshot.json`` instead
  ``s<hash>.sock``          torch's C++ worker server (named by hash: unix socket paths are short)
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import tempfile

from frexporter.errors import FrexporterError

MANIFEST_FORMAT = "frexporter.manifest/1"
SNAPSHOT_FORMAT = "frexporter.snapshot/1"  # a JSON file, rewritten per snapshot (recorders before 0.2)
# A memory-mapped file the recorder updates in place (no syscall per snapshot); its JSON payload's
# ``status`` holds torch's own ``_dump_*_json`` answer per recorder rather than just its ``pg_status``.
SNAPSHOT_MAP_FORMAT = "frexporter.snapshot/2"
MANIFEST_SUFFIX = ".manifest.json"
SNAPSHOT_SUFFIX = ".snapshot.json"
SNAPSHOT_MAP_SUFFIX = ".snapshot.map"
SOCKET_SUFFIX = ".sock"
EVIDENCE_DIRNAME = "evidence"  # the exporter's default evidence location inside the spool directory

# The recorder's snapshot interval unless FREXPORTER_SNAPSHOT_INTERVAL says otherwise; the exporter assumes it
# for a rank that has written its manifest but not yet its first snapshot (which states its own interval).
DEFAULT_SNAPSHOT_INTERVAL = 1.0
# Private mode (the default): one uid runs the ranks and the exporter.
DIR_MODE = 0o700
FILE_MODE = 0o600
SOCKET_MODE = 0o600
# Group mode (FREXPORTER_SPOOL_GROUP=1), for Kubernetes pods whose trainer and exporter run as different
# uids that share a group (fsGroup): setgid so every file takes the directory's group, sockets group-writable
# because connecting to a unix socket needs write permission.
GROUP_ENV = "FREXPORTER_SPOOL_GROUP"
GROUP_DIR_MODE = 0o2770
GROUP_FILE_MODE = 0o640
GROUP_SOCKET_MODE = 0o660

# Recorder names as they appear in snapshots: torch keeps one FR ring per kind.
RECORDER_FR = "fr"  # the generic recorder (gloo and others), ``_dump_fr_trace*``
RECORDER_NCCL = "nccl"  # ``_dump_nccl_trace*`` in CUDA builds

# Backend names (in a PG's backend config, ``cpu:gloo,cuda:nccl``, and before the colon of an FR entry's
# ``profiling_name``) of the NCCL family: stock ProcessGroupNCCL names itself "nccl" (registered as "nccl", and
# as "nccl-legacy" from torch 2.15); torch 2.15 makes "nccl" build ProcessGroupNCCL2, which names itself "nccl2"
# (pytorch#192281), and records it through the backend-agnostic FlightRecorderHook (pytorch#189363, #192233)
# rather than in the NCCL recorder; "nccl-lazy", and out-of-tree "ncclx", are NCCL too.
NATIVE_NCCL_BACKENDS = frozenset({"nccl", "nccl-legacy"})  # stock ProcessGroupNCCL: its own recorder


def is_nccl_backend(name: str) -> bool:
    """Whether a backend name (``nccl``, ``nccl2``, ``NCCL``) is of the NCCL family: the PG's collectives run on
    GPUs, the recorder to prefer where a PG has several."""
    return name.strip().lower().startswith("nccl")

_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")
# torch keeps every counter, id and timestamp in 64 bits; a bigger number is garbage that would overflow
# float() in the outputs, so the parsers refuse it here.
INT_MIN, INT_MAX = -(2**63), 2**63 - 1


class SpoolError(FrexporterError):
    """A spool file could not be used; ``reason`` is a bounded label value."""


def default_dir() -> str:
    """``$FREXPORTER_DIR``, else a per-user directory under the system temp dir."""
    env = os.environ.get("FREXPORTER_DIR")
    if env:
        return env
    return os.path.join(tempfile.gettempdir(), f"frexporter-{os.getuid()}")


def rank_stem(job_id: str, rank: int) -> str:
    safe = _SAFE.sub("_", job_id)[:64] or "job"
    return f"{safe}.r{rank}"


def socket_name(stem: str) -> str:
    # AF_UNIX paths are limited to about 107 bytes; a short hash keeps deep spool paths usable.
    return "s" + hashlib.sha1(stem.encode()).hexdigest()[:12] + SOCKET_SUFFIX


def group_mode() -> bool:
    """Whether the spool is shared by a group (``FREXPORTER_SPOOL_GROUP=1``) rather than private to one user."""
    return os.environ.get(GROUP_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def dir_mode() -> int:
    return GROUP_DIR_MODE if group_mode() else DIR_MODE


def file_mode() -> int:
    return GROUP_FILE_MODE if group_mode() else FILE_MODE


def socket_mode() -> int:
    return GROUP_SOCKET_MODE if group_mode() else SOCKET_MODE


def ensure_dir(path: str) -> None:
    """Create the spool directory private to this user (0700), or to its group in group mode (2770)."""
    mode = dir_mode()
    os.makedirs(path, mode=mode & 0o777, exist_ok=True)
    st = os.stat(path)
    # mkdir drops the setgid bit and applies the umask: set the mode explicitly when the directory is ours.
    if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)
