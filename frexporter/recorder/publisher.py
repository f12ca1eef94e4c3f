"""The recorder's background thread: manifest, periodic snapshot, worker server.

Everything here runs off the training thread and swallows its own failures: an
error is counted in the snapshot (so the exporter exports it) and logged once per
kind; the thread itself reports its own death in a last snapshot.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from frexporter import reasons, safetext, spool
from frexporter.model import STATE_EXITING, STATE_RUNNING, STATE_STARTING, STATE_STOPPED
from frexporter.recorder import cuda_probe, torch_fr
from frexporter.recorder.environment import default_job_id, env_int, held_by_other, launcher_facts
from frexporter.recorder.stacks import _no_stack, stack_sampler, stacks_enabled

log = logging.getLogger("frexporter.recorder")

# Snapshots between checks that this rank's files are still there: updates of the mapped snapshot go on
# into a removed file without an error, and another rank may have recreated the directory meanwhile. The check
# is two stat calls, and each hands the GIL to the training thread and back: a snapshot that checks holds the
# GIL longer than the rest put together (benchmarks/recorder_costs), so few do (30 s apart at the default
# interval, a removed spool is back within that).
SPOOL_CHECK_EVERY = 30
# Snapshots between checks that torch has not replaced its process-group table (one attribute lookup).
PG_TABLE_CHECK_EVERY = 5
# Seconds between checks for the default process group while this rank is not identified yet, so that its
# full manifest is out within this long of init_process_group (a rank that dies at step 0 is still seen).
# Each check is a module lookup and is_initialized(), under a microsecond (benchmarks/startup_death.py);
# it stops once identified.
IDENTIFY_POLL = 0.05
class Publisher:
    def __init__(self, directory: str, job_id: str | None, interval: float) -> None:
        self.directory = directory
        # Text from the environment (or the caller) may hold undecodable bytes as lone surrogates; written as
        # escapes, so the manifest is valid UTF-8 and every node spells the same bytes the same way.
        self.job_id_hint = safetext.from_environment(job_id) if job_id else job_id
        self._interval = interval
        self.errors: dict[str, int] = {}
        self._logged: set[str] = set()
        # A bare lock, held until stop(): waiting on it with a timeout is one C call, where Event.wait runs
        # Condition's Python code under the GIL at every wake-up.
        self._stop = threading.Lock()
        self._stop.acquire()
        self._thread = threading.Thread(target=self._main, name="frexporter-recorder", daemon=True)
        self._server: Any = None
        self._stem = ""
        self._manifest: dict[str, Any] | None = None
        self._pg_count = -1
        self._generation = 0
        self._counter = 0
        self._status: torch_fr.StatusReader | None = None
        self._world: Any = None
        self._pg_names: Any = None  # self._world.pg_names
        self._map = spool.SnapshotMap("")  # the real one once the rank is known (_identify)
        self._format: bytes | None = None  # the snapshot's bytes format while running (_snapshot_format)
        self._snapshot: Callable[[], bool] | None = None  # the steady state's whole tick (_bind_snapshot)
        self._closed = False  # stop() has written the last words: no running snapshot may follow them
        self._pid = os.getpid()
        self._write_lock = threading.Lock()
        self.start_time = time.time()
        self._launcher: dict[str, Any] = {}
        self._starting = False  # a starting manifest is out: this rank is known before its process group
        self._last_starting = 0.0
        self._sample_stack = (stack_sampler(threading.main_thread().ident, self._count_error)
                              if stacks_enabled(os.environ) else _no_stack)
        # Asked only while the stack stands still (recorder/cuda_probe.py): is the rank waiting on its GPU?
        self._gpu = cuda_probe.CudaProbe(self._count_error)
        self._gpu_uuid_known = False  # the manifest names the rank's GPU (known once the rank touched CUDA)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.publish_starting()
        self._thread.start()

    def publish_starting(self) -> None:
        """Before any process group: publish what the launcher says this rank is (state ``starting``), so that
        a rank that dies in or before init_process_group, or waits there for a missing peer, is seen."""
        try:
            self._launcher = launcher_facts(os.environ, self._count_error)
            rank = self._launcher.get("rank")
            dist = sys.modules.get("torch.distributed")
            initialized = getattr(dist, "is_initialized", None)
            if rank is None or (dist is not None and initialized is not None and dist.is_available() and initialized()):
                return  # nothing to name the rank by, or install() came late: the first tick identifies it
            job_id = self.job_id_hint or default_job_id()
            stem = spool.rank_stem(job_id, rank)
            if held_by_other(os.path.join(self.directory, stem + spool.MANIFEST_SUFFIX)):
                return  # a child of the rank (a spawned worker) inherits its environment, not its identity
            self._stem = stem
            self._map = spool.SnapshotMap(self._path(spool.SNAPSHOT_MAP_SUFFIX))
            self._manifest = {
                "format": spool.MANIFEST_FORMAT, "job_id": job_id, "rank": rank,
                "local_rank": self._launcher.get("local_rank", env_int("LOCAL_RANK", -1)),
                "world_size": self._launcher.get("world_size", 0), "pid": self._pid,
                "hostname": safetext.from_environment(socket.gethostname()), "start_time": self.start_time,
                "backends": [],
                "socket": "", "handlers": [], "recorders": [], "process_groups": [],
                "state": STATE_STARTING, "launcher": self._launcher,
            }
            spool.write_json_atomic(self._path(spool.MANIFEST_SUFFIX), self._manifest)
            with self._write_lock:
                self._write_snapshot((), state=STATE_STARTING)
            self._last_starting = time.monotonic()
            self._starting = True
        except Exception as e:
            self._count_error(reasons.STARTING_MANIFEST, e)

    def stop(self, state: str = STATE_EXITING) -> None:
        """Called at interpreter exit: tell the exporter this was a clean exit, not a crash."""
        if os.getpid() != self._pid:
            return  # a forked child (a DataLoader worker) exiting: not this rank, and its files are the parent's
        with contextlib.suppress(RuntimeError):  # already released by an earlier stop()
            self._stop.release()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, 2 * self.interval))
        # The thread may still be inside a snapshot if join timed out: two writers interleaving their updates
        # could leave a payload under the other's checksum, so the last word waits for the lock (a while).
        if self._stem and self._write_lock.acquire(timeout=1.0):
            try:
                self._closed = True
                with contextlib.suppress(Exception):  # at exit the disk may be full or the dir gone
                    self._write_snapshot(self._final_status(), state=state, message="process exiting")
                self._map.close()  # a snapshot still under way finds its mapping gone and writes nothing
            finally:
                self._write_lock.release()
        self._gpu.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.shutdown()
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.directory, spool.socket_name(self._stem)))
            self._server = None

    def _final_status(self) -> tuple[bytes, ...]:
        """torch's counters as the rank leaves, for its last words: what its peers wait for that it never completed
        is then known for certain (sources/ranks/liveness.held). Nothing where there is no process group (never
        made, or destroyed) or torch fails to answer."""
        try:
            if self._status is None or self._world is None or not len(self._world.pg_names):
                return ()
            return self._status.read()
        except Exception:
            return ()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def interval(self) -> float:
        return self._interval

    @interval.setter
    def interval(self, seconds: float) -> None:
        self._interval = seconds
        self._format = self._snapshot = None  # the snapshot states its interval

    # ------------------------------------------------------------ loop

    def _main(self) -> None:
        try:
            # Until identified, look for the default process group often (a cheap check); the steady state's
            # loop below is then the same as if this one had never run.
            while True:
                self.tick()
                if self._world is not None:
                    break
                if self._stop.acquire(True, IDENTIFY_POLL if self._identifying() else self._interval):
                    return
            while not self._stop.acquire(True, self._interval):
                self.tick()
        except BaseException as e:  # the thread must say why it died, never vanish silently
            log.exception("frexporter recorder thread died; this rank's state is no longer published")
            if self._stem and self._write_lock.acquire(timeout=1.0):
                try:
                    with contextlib.suppress(Exception):
                        self._write_snapshot((), state=STATE_STOPPED, message=f"recorder thread died: {e!r}")
                finally:
                    self._write_lock.release()

    def tick(self) -> None:
        try:
            snapshot = self._snapshot
            if snapshot is not None and snapshot():
                return
            self._tick()
        except spool.SpoolError as e:
            self._count_error(e.reason, e)
        except OSError as e:
            # errno names are stable, bounded reasons: ENOSPC (disk full) reads better than OSError.
            self._count_error(errno.errorcode.get(e.errno or 0, type(e).__name__).lower(), e)
            if isinstance(e, FileNotFoundError):
                self._recreate_spool()
        except Exception as e:
            self._count_error(type(e).__name__, e)

    def _tick(self) -> None:
        """Everything but the steady state: identification, manifests, a snapshot file made anew."""
        if self._world is None:
            # Never import torch ourselves: under `frexporter run` every Python process of the
            # job (launchers, tools) runs this thread, and only training ranks have torch loaded.
            dist = sys.modules.get("torch.distributed")
            # getattr: the module may be mid-import on the main thread.
            initialized = getattr(dist, "is_initialized", None)
            if dist is None or initialized is None or not dist.is_available() or not initialized():
                if self._starting and time.monotonic() - self._last_starting >= self._interval:
                    self._last_starting = time.monotonic()
                    with self._write_lock:  # the heartbeat of a rank still in (or before) init_process_group
                        self._write_snapshot((), state=STATE_STARTING)
                return
            self._identify(dist)
        # From here on the PG table's size stands in for is_initialized(), one lookup instead of four:
        # destroy_process_group() empties it, and a new init_process_group() changes it.
        self._pg_names = self._world.pg_names  # torch 2.13 clears its table, but a version may replace it
        count = len(self._pg_names)
        if not count:
            # Destroyed: no snapshots until a new init, whose table is then described anew.
            self._pg_count, self._snapshot = 0, None
            return
        if count != self._pg_count or self._learn_gpu_uuid():
            self._pg_count = count
            self._write_manifest()
        assert self._status is not None
        status = self._status.read()
        with self._write_lock:
            self._write_snapshot(status)
        self._check_spool()
        if self._format is not None and not self._closed:
            self._snapshot = self._bind_snapshot()

    def _check_spool(self) -> None:
        if self._map.gone() or not os.path.exists(self._path(spool.MANIFEST_SUFFIX)):
            # Someone removed the spool directory (another rank may already have recreated it).
            self._recreate_spool()

    def _bind_snapshot(self) -> Callable[[], bool]:
        """The steady state's whole tick as one function over bound locals.

        It runs under the GIL once a second from cold caches, where each attribute lookup, method call and
        frame costs microseconds (the three-method path it replaces took ~14 us more per snapshot here). It
        is True when it published; False, having published nothing, when the slow path must run instead
        (the PG table changed, the mapped file must be made anew), and it is bound again after that.
        """
        assert self._status is not None and self._format is not None
        world, names, count, fmt, lock = self._world, self._pg_names, self._pg_count, self._format, self._write_lock
        update, time_ns, checked = self._map.updater(), time.time_ns, torch_fr.checked_status
        dumpers = self._status.dumpers
        dump = dumpers[0] if len(dumpers) == 1 else None
        read = self._status.read
        stack, cpu_ns, gpu = self._sample_stack, time.process_time_ns, self._gpu.sample
        cuda, cuda_ready, gpu_known = cuda_probe.torch_cuda, cuda_probe.cuda_ready, self._gpu_uuid_known

        # The stack is sampled only when torch's status is what it was at the previous snapshot: no collective
        # was enqueued or completed since, so this rank may be one the others wait for (computing, waiting, or
        # blocked in a collective itself). A rank that progresses is nobody's culprit, and training pays
        # nothing for its stack: one comparison of bytes. The first snapshot of a binding samples (the one before
        # it, written whole, did too): a rank parked since then keeps a stack in every snapshot.
        # The GPU probe is asked only when a stack was sampled: frozen when it is the previous sample's.
        last: list[Any] = [None]
        last_stack = [b""]

        def gpu_wait(frames: bytes) -> bytes:
            if frames:
                frozen, last_stack[0] = frames == last_stack[0], frames
                return gpu(frozen)
            if last_stack[0]:
                last_stack[0] = b""
                return gpu(False)
            return b""

        def snapshot() -> bool:
            if len(names) != count:
                return False
            n = self._counter + 1
            if dump is not None:
                raw = dump(False)  # includeCollectives=False: pg_status and pg_config only
                if raw[:1] != b"{" or raw[-1:] != b"}":
                    raw = checked(raw)
                frames = stack() if raw == last[0] or last[0] is None else b""
                payload = fmt % (n, time_ns(), cpu_ns(), frames, gpu_wait(frames), raw)
                last[0] = raw
            else:
                raws = read()
                frames = stack() if raws == last[0] or last[0] is None else b""
                payload = fmt % (n, time_ns(), cpu_ns(), frames, gpu_wait(frames), *raws)
                last[0] = raws
            with lock:
                if not update(payload):  # also after stop(): it closes the map under this lock
                    return False
                self._counter = n
            if n % PG_TABLE_CHECK_EVERY == 0 and (world.pg_names is not names
                                                  or (not gpu_known and cuda_ready(cuda()))):
                self._snapshot = None  # torch 2.13 clears its table; a version may replace it; the GPU to name
            if n % SPOOL_CHECK_EVERY == 0:
                self._check_spool()
            return True

        return snapshot

    def _recreate_spool(self) -> None:
        """The spool directory vanished (cleaned up, volume remounted): start publishing again."""
        if self._manifest is None:
            return
        try:
            spool.ensure_dir(self.directory)
            path = os.path.join(self.directory, spool.socket_name(self._stem))
            if self._server is not None and not os.path.exists(path):
                # The old socket file went with the directory; an unlinked socket cannot be reached.
                with contextlib.suppress(Exception):
                    self._server.shutdown()
                self._server = None
            if self._server is None and self._manifest.get("socket"):
                self._server = torch_fr.start_worker_server(path)
            self._pg_count = -1  # rewrite the manifest on the next tick
            self._map.close()  # and create the snapshot file anew
            self._snapshot = None
            log.warning("frexporter recorder: spool directory %s was removed; publishing again", self.directory)
        except Exception as e:
            self._count_error(reasons.SPOOL_RECREATE, e)

    # ------------------------------------------------------------ pieces

    def _identifying(self) -> bool:
        """Poll fast for the process group: this rank said it is starting, or has torch.distributed loaded."""
        return self._starting or "torch.distributed" in sys.modules

    def _identify(self, dist: Any) -> None:
        rank = dist.get_rank()
        job_id = self.job_id_hint or default_job_id()
        stem = spool.rank_stem(job_id, rank)
        if stem != self._stem:
            if self._stem:  # the launcher's rank was not the process group's: its starting files are wrong
                self._map.close()
                for suffix in (spool.MANIFEST_SUFFIX, spool.SNAPSHOT_MAP_SUFFIX):
                    with contextlib.suppress(OSError):
                        os.unlink(self._path(suffix))
            self._stem = stem
            self._map = spool.SnapshotMap(self._path(spool.SNAPSHOT_MAP_SUFFIX))
        self._starting = False
        sock_name = ""
        try:
            path = os.path.join(self.directory, spool.socket_name(self._stem))
            self._server = torch_fr.start_worker_server(path)
            sock_name = os.path.basename(path)
        except Exception as e:
            self._count_error(reasons.WORKER_SERVER, e)
        import torch

        self._manifest = {
            "format": spool.MANIFEST_FORMAT,
            "job_id": job_id,
            "rank": rank,
            "local_rank": env_int("LOCAL_RANK", -1),
            "world_size": dist.get_world_size(),
            "pid": os.getpid(),
            "hostname": safetext.from_environment(socket.gethostname()),
            "start_time": self.start_time,
            "torch_version": str(torch.__version__),
            "backends": [],
            "gpu_uuid": "",  # _learn_gpu_uuid, once the rank has touched its GPU
            "socket": sock_name,
            "handlers": list(torch_fr.handler_names()),
            "recorders": [],  # _write_manifest: the ones its process groups use, with the reader for them
            "fr_buffer_size": torch_fr.buffer_size(),
            "state": STATE_RUNNING,
        }
        if self._launcher:
            self._manifest["launcher"] = self._launcher
        self._world = torch_fr.world()  # last: set means identified
        self._pg_names = self._world.pg_names

    def _learn_gpu_uuid(self) -> bool:
        """True when the manifest has just learned the UUID of the rank's GPU (to be written again)."""
        if self._gpu_uuid_known or self._manifest is None:
            return False
        cuda = cuda_probe.torch_cuda()
        if not cuda_probe.cuda_ready(cuda):
            return False
        self._gpu_uuid_known = True  # asked once: a failure is counted, not retried every snapshot
        try:
            device = cuda_probe.rank_device(cuda, os.environ)
            uuid = cuda_probe.device_uuid(cuda, device) if device is not None else ""
        except Exception as e:
            self._count_error(reasons.CUDA_PROBE, e)
            return False
        if device is None:
            self._gpu_uuid_known = False  # initialized, but no memory on a device yet: ask again later
            return False
        self._manifest["gpu_uuid"] = safetext.from_environment(uuid)[:spool.MAX_FRAME_TEXT_CHARS]
        return True

    def _write_manifest(self) -> None:
        assert self._manifest is not None
        self._generation += 1
        groups = torch_fr.pg_table()
        recorders = torch_fr.recorders_in_use(torch_fr.available_recorders(), (g["backend"] for g in groups))
        if self._status is None or recorders != self._status.recorders:
            self._status = torch_fr.StatusReader(recorders)
            self._format = self._snapshot = None  # the snapshot has a slot per recorder
        self._manifest["recorders"] = list(recorders)
        self._manifest["process_groups"] = groups
        self._manifest["backends"] = sorted({g["backend"] for g in groups if g["backend"]})
        self._manifest["generation"] = self._generation
        spool.write_json_atomic(self._path(spool.MANIFEST_SUFFIX), self._manifest)

    def _write_snapshot(self, status: tuple[bytes, ...], state: str = STATE_RUNNING, message: str = "") -> None:
        """Update the mapped snapshot; ``status`` is torch's JSON per recorder (in ``StatusReader.recorders``
        order), spliced in unparsed.

        This runs under the GIL once a second with cold caches, where each Python operation costs microseconds,
        so the snapshot is one bytes format whose constant parts (format, pid, interval, state, errors,
        recorder names) are encoded once and reused until one of them changes.
        """
        if self._closed and state == STATE_RUNNING:
            return  # stop() came first (the thread outlived its join): its last words stand
        self._counter += 1
        fmt = self._format
        if fmt is None or state != STATE_RUNNING:  # running snapshots carry every recorder; last words carry none
            fmt = self._snapshot_format(state, message, len(status))
            if state == STATE_RUNNING:
                self._format = fmt
        self._map.write(fmt % (self._counter, time.time_ns(), time.process_time_ns(), self._sample_stack(), b"",
                               *status))

    def _snapshot_format(self, state: str, message: str, slots: int) -> bytes:
        head = json.dumps({
            "format": spool.SNAPSHOT_MAP_FORMAT, "pid": self._pid, "interval": self._interval,
            "errors": self.errors, "state": state, "message": message,
        }, separators=(",", ":")).encode()
        recorders = self._status.recorders if self._status is not None else ()
        body = b",".join(json.dumps(recorder).encode().replace(b"%", b"%%") + b":%s"
                         for recorder in recorders[:slots])
        # The time as integer nanoseconds with a JSON exponent: integer formatting is cheaper cold than a float's.
        # "cpu": the process's CPU seconds so far; "stack": the training thread's frames (stack_sampler);
        # "gpu_wait": [device, milliseconds] while that stack stands still with work pending on the rank's GPU.
        return head[:-1].replace(b"%", b"%%") + (b',"counter":%%d,"time":%%de-9,"cpu":%%de-9,"stack":[%%s],'
                                                 b'"gpu_wait":[%%s],"status":{%s}}' % body)

    def _path(self, suffix: str) -> str:
        return os.path.join(self.directory, self._stem + suffix)

    def _count_error(self, reason: str, exc: BaseException) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + 1
        self._format = self._snapshot = None  # the snapshot carries the counts
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("frexporter recorder: %s: %s (further errors of this kind are counted, not logged)",
                        reason, exc)


