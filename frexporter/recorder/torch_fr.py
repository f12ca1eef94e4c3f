"""Access to torch's Flight Recorder from inside a rank, by feature detection (torch 2.5+).

Only cheap calls live here: ``pg_status`` without collectives (about 0.1 ms of GIL
on torch 2.13) and the process-group table. Full dumps hold the GIL for tens of
milliseconds and are left to the exporter, which reads them over the C++ worker
server without the GIL.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from typing import Any

from frexporter import spool

DEFAULT_BUFFER_SIZE = 2000
BUFFER_ENV_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def enable_via_env(size: int = DEFAULT_BUFFER_SIZE) -> bool:
    """Turn FR on for process groups created from now on; returns False if the user chose a size."""
    if any(os.environ.get(v) for v in BUFFER_ENV_VARS):
        return False
    for var in BUFFER_ENV_VARS:
        os.environ[var] = str(size)
    return True


def buffer_size() -> int:
    for var in BUFFER_ENV_VARS:
        try:
            return int(os.environ[var])
        except (KeyError, ValueError):
            continue
    return 0


def _c10d() -> Any:
    import torch._C._distributed_c10d as c10d_ext

    return c10d_ext


def available_recorders() -> tuple[str, ...]:
    ext = _c10d()
    found = []
    if hasattr(ext, "_dump_fr_trace_json"):
        found.append(spool.RECORDER_FR)
    if hasattr(ext, "_dump_nccl_trace_json"):
        found.append(spool.RECORDER_NCCL)
    return tuple(found)


def backend_recorder(backend: str) -> str | None:
    """The recorder that keeps a backend's entries: stock NCCL (``nccl``, ``nccl-legacy``) has its own on CUDA
    builds; gloo's go to the generic one, and so do those of an NCCL-family backend that torch records through its
    FlightRecorderHook (``nccl2``, what ``nccl`` builds from torch 2.15: pytorch#189363, #190738). None for a
    backend not known here."""
    name = backend.strip().lower()
    if name == "gloo":
        return spool.RECORDER_FR
    if name in spool.NATIVE_NCCL_BACKENDS:
        return spool.RECORDER_NCCL
    if spool.is_nccl_backend(name):
        return spool.RECORDER_FR
    return None


def recorders_in_use(available: tuple[str, ...], backends: Iterable[str]) -> tuple[str, ...]:
    """The available recorders that this rank's process groups (their backend configs, ``cuda:nccl``,
    ``cpu:gloo,cuda:nccl``, ``cuda:nccl2``) can write to: each one read costs the snapshot a status call under the
    GIL, and an NCCL-only job on a CUDA build would pay for an empty gloo recorder too. A backend not known here
    (ucc, mpi, a custom one, or none given) keeps every available recorder, and so does a choice that would leave
    none (a torch that records NCCL in the generic recorder)."""
    needed = set()
    for config in backends:
        for part in config.split(","):
            recorder = backend_recorder(part.rsplit(":", 1)[-1])
            if recorder is None:
                return available
            needed.add(recorder)
    return tuple(r for r in available if r in needed) or available


def _backend_config(pg: Any, config: str, torch: Any) -> str:
    """A PG's backend config (``cpu:gloo,cuda:nccl``) with each backend named as the backend torch built names
    itself: from torch 2.15 ``nccl`` builds ProcessGroupNCCL2, which names itself ``nccl2`` and is recorded
    elsewhere than stock NCCL (``recorders_in_use``). A part whose backend cannot be asked stays as it is."""
    parts = []
    for part in config.split(","):
        device, colon, name = part.rpartition(":")
        if colon and device:
            with contextlib.suppress(Exception):
                built = pg._get_backend(torch.device(device.strip())).name()
                if isinstance(built, str) and built.strip():
                    name = built.strip()
        parts.append(f"{device}{colon}{name}")
    return ",".join(parts)


class StatusReader:
    """torch's status JSON per recorder, without collectives, unparsed: the snapshot embeds it as it is
    (parsing and re-encoding it would hold the GIL longer; the exporter parses and checks it).

    It runs once a second from cold caches, where every attribute lookup shows (a few microseconds each on
    a VM), so torch's functions are looked up once and called positionally.
    """

    def __init__(self, recorders: tuple[str, ...]) -> None:
        ext = _c10d()
        self.recorders = recorders
        self._dumpers = tuple(
            ext._dump_fr_trace_json if recorder == spool.RECORDER_FR else ext._dump_nccl_trace_json
            for recorder in recorders)

    def read(self) -> tuple[bytes, ...]:
        out = []
        for dump in self._dumpers:
            raw = dump(False)  # includeCollectives=False: pg_status and pg_config only
            if raw[:1] != b"{" or raw[-1:] != b"}":
                raw = checked_status(raw)
            out.append(raw)
        return tuple(out)

    @property
    def dumpers(self) -> tuple[Any, ...]:
        """torch's status functions, in ``recorders`` order: call ``dump(False)``, and pass what does not
        look like a JSON object through ``checked_status``."""
        return self._dumpers


def checked_status(raw: Any) -> bytes:
    """torch's status as bytes of one JSON object, or ValueError: it is spliced into the snapshot unparsed,
    and anything but an object would make the whole snapshot unreadable."""
    if type(raw) is not bytes:
        raw = raw.encode() if isinstance(raw, str) else bytes(raw)
    raw = raw.strip()
    if raw[:1] != b"{" or raw[-1:] != b"}":
        raise ValueError(f"torch's status is not a JSON object ({raw[:40]!r})")
    return raw


def handler_names() -> tuple[str, ...]:
    ext = _c10d()
    getter = getattr(ext, "_get_handler_names", None)
    if getter is None:
        return ()
    return tuple(getter())


def start_worker_server(path: str) -> Any:
    """Start torch's C++ worker server on a unix socket; torch refuses an existing path."""
    ext = _c10d()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = ext._WorkerServer(path, -1)
    os.chmod(path, spool.socket_mode())  # 0600, or 0660 in group mode so the exporter's group can connect
    return server


def world() -> Any:
    """torch's process-group registry (a module global, assigned once); ``len(world().pg_names)`` is a cheap
    change detector for the PG table, and 0 once ``destroy_process_group()`` has emptied it."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._world


def pg_table() -> list[dict[str, Any]]:
    """Rebuild the PG table from Python state; gloo's own ``pg_config`` is broken in 2.8-2.13.

    The local pg id that keys ``pg_status`` is predicted from creation order (each
    backend instance takes the next id, and a process only creates backends for
    groups it belongs to); NCCL exposes its uid directly. The exporter confirms the
    prediction from FR entries whenever it reads them.
    """
    import torch
    from torch.distributed import distributed_c10d as c10d

    groups = []
    for index, (pg, name) in enumerate(list(c10d._world.pg_names.items())):
        ranks = sorted(int(r) for r in c10d._world.pg_group_ranks.get(pg, {}))
        backend = _backend_config(pg, str(c10d._world.pg_backend_config.get(pg, "")), torch)
        local_ids: dict[str, int] = {spool.RECORDER_FR: index}
        uid = getattr(c10d, "_get_process_group_uid", None)
        if uid is not None:
            try:
                nccl_uid = int(uid(pg))
                if nccl_uid >= 0:
                    local_ids[spool.RECORDER_NCCL] = nccl_uid
            except Exception:
                pass
        timeout = None
        with contextlib.suppress(Exception):
            timeout = pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        groups.append(
            {
                "name": str(name),
                "desc": str(getattr(pg, "group_desc", "") or ""),
                "ranks": ranks,
                "backend": backend,
                "local_ids": local_ids,
                "timeout_seconds": timeout,
            }
        )
    return groups
