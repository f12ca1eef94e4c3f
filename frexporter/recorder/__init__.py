"""In-rank recorder: ``frexporter.recorder.install()`` and nothing else to learn.

Safe to call before or after ``init_process_group``, any number of times, from any
thread; it never raises into the caller. Before the first process group it turns
Flight Recorder on (``TORCH_FR_BUFFER_SIZE``); after, it says once if it was too late.

The spool it writes is private to this uid (directory 0700, files and socket 0600). With
``FREXPORTER_SPOOL_GROUP=1`` it is shared with the directory's group instead (2770, files 0640,
socket 0660), for pods whose exporter runs as another uid in the same fsGroup.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading

from frexporter import spool
from frexporter.recorder import torch_fr
from frexporter.recorder.environment import default_job_id
from frexporter.recorder.publisher import Publisher

__all__ = ["default_job_id", "install"]

log = logging.getLogger("frexporter.recorder")
_lock = threading.Lock()
_publisher: Publisher | None = None


def install(dir: str | None = None, job_id: str | None = None) -> Publisher | None:
    """Turn Flight Recorder on and publish this rank's live state to the spool directory.

    Returns the running publisher, or None when the recorder could not start (the
    reason is logged as a warning; training goes on unaffected).
    """
    global _publisher
    try:
        with _lock:
            if _publisher is not None:
                return _publisher
            directory = dir or spool.default_dir()
            spool.ensure_dir(directory)
            _enable_flight_recorder()
            interval = _interval()
            publisher = Publisher(directory, job_id or os.environ.get("FREXPORTER_JOB_ID"), interval)
            publisher.start()
            atexit.register(publisher.stop)
            _publisher = publisher
            return publisher
    except Exception as e:
        log.warning("frexporter recorder disabled: %s", e)
        return None


def _enable_flight_recorder() -> None:
    dist = sys.modules.get("torch.distributed")
    late = dist is not None and dist.is_available() and dist.is_initialized()
    if not late:
        torch_fr.enable_via_env()
        _enable_nccl_timing()
        return
    if _timing_requested() and not os.environ.get("TORCH_NCCL_ENABLE_TIMING"):
        log.warning("frexporter: FREXPORTER_NCCL_TIMING=1 but install() ran after init_process_group; existing "
                    "NCCL process groups record no durations. Call install() first, or use `frexporter run`.")
    if torch_fr.buffer_size() == 0 and not _fr_on_by_default():
        log.warning(
            "frexporter: install() ran after init_process_group and TORCH_FR_BUFFER_SIZE is unset; "
            "on this torch Flight Recorder is off for existing process groups. Call install() "
            "before init_process_group, or use `frexporter run`."
        )


def _enable_nccl_timing() -> None:
    """``FREXPORTER_NCCL_TIMING=1``: NCCL records start events, so FR entries get ``duration_ms`` (and the
    ``started`` state). Off by default: one more CUDA event per collective, the watchdog computing every
    duration, and torch's own warning (ProcessGroupNCCL.hpp) that it "can increase chances of a watchdog hang"
    through cudaEventElapsedTime. A value the user set for TORCH_NCCL_ENABLE_TIMING wins."""
    if _timing_requested():
        os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")


def _timing_requested() -> bool:
    return os.environ.get("FREXPORTER_NCCL_TIMING", "").strip().lower() in ("1", "true", "yes", "on")


def _fr_on_by_default() -> bool:
    # Flight Recorder's default buffer became 2000 in torch 2.11; there is no runtime flag to ask.
    import torch

    try:
        major, minor = (int(x) for x in str(torch.__version__).split(".")[:2])
    except ValueError:
        return True
    return (major, minor) >= (2, 11)


def _interval() -> float:
    try:
        value = float(os.environ.get("FREXPORTER_SNAPSHOT_INTERVAL", spool.DEFAULT_SNAPSHOT_INTERVAL))
    except ValueError:
        return spool.DEFAULT_SNAPSHOT_INTERVAL
    return min(max(value, 0.05), 60.0)
