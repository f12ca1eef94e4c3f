"""In-rank recorder: ``frexporter.recorder.install()`` and nothing else to learn.

Safe to call before or after ``init_process_group``, any number of times, from any
thread; it never raises into the caller. Before the first process group it turns
Flight Recorder on (``TORCH_FR_BUFFER_SIZE``); after, it says once if it was too late.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading

from frexporter import spool
from frexporter.recorder import fr
from frexporter.recorder.publisher import Publisher, default_job_id

__all__ = ["default_job_id", "install", "installed"]

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


def installed() -> Publisher | None:
    return _publisher


def _enable_flight_recorder() -> None:
    dist = sys.modules.get("torch.distributed")
    late = dist is not None and dist.is_available() and dist.is_initialized()
    if not late:
        fr.enable_via_env()
        return
    if fr.buffer_size() == 0 and not _fr_on_by_default():
        log.warning(
            "frexporter: install() ran after init_process_group and TORCH_FR_BUFFER_SIZE is unset; "
            "on this torch Flight Recorder is off for existing process groups. Call install() "
            "before init_process_group, or use `frexporter run`."
        )


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
        value = float(os.environ.get("FREXPORTER_SNAPSHOT_INTERVAL", "1.0"))
    except ValueError:
        return 1.0
    return min(max(value, 0.05), 60.0)
