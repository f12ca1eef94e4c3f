"""The ranks source: spool directory + worker-server sockets -> RankState per local rank.

Cheap path every poll: ``stat`` the spool files and re-read only what changed.
Everything in the spool is untrusted (whoever may write it can plant, link or swap
any name): files are opened relative to a descriptor of the directory, never through
a link, and judged by an fstat of what was opened; sockets are connected to only
when they are what the spool's mode expects; the directory's permissions are checked
on every poll; warnings are rate-limited per reason while every error is counted.
Deep path (an FR read over the rank's socket, no GIL needed on the rank's side)
only when it tells something new: a rank or PG not yet mapped, progress that
stopped with work in flight, p2p traffic that makes raw sequence numbers
incomparable, or a stale heartbeat. Socket work runs on a small pool with a hard
per-rank timeout, so one stuck rank never delays the others or a scrape.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from frexporter import defaults, spool
from frexporter.errors import FrexporterError
from frexporter.fr import trace
from frexporter.fr.domain import DeepView, translate
from frexporter.model import (
    FRAMES_PYSPY,
    FRAMES_RECORDER,
    RANK_DOWN,
    RANK_EXITED,
    RANK_OK,
    RANK_UNRESPONSIVE,
    Activity,
    CollectiveStats,
    Frame,
    InflightCollective,
    PGState,
    RankState,
)
from frexporter.sources import activity, pyspy, worker_client
from frexporter.sources.base import Reading, SourceError
from frexporter.sources.collectives import DEFAULT_WINDOW, CollectiveAccumulator, EntryCursor, GroupKey, LatenessTracker
from frexporter.sources.thresholds import ThresholdConfig, ThresholdLearner
from frexporter.spool import Manifest, PermissionProblem, PGEntry, RawPGStatus, Snapshot, SpoolError

log = logging.getLogger("frexporter.ranks")

# Warnings logged per reason and window; the rest are counted as ever (frexporter_source_errors_total stays
# exact) and summed up in one line when the window ends: a spool full of junk must not fill the log too.
LOG_BURST = 10
LOG_WINDOW = 60.0
# Socket failures after which a rank counts as having no live socket (a timeout means a wedged one).
_SOCKET_GONE = ("socket_missing", "socket_refused", "socket_untrusted")
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)

# Which worker-server handler returns which recorder's entries (GIL-free C++ handlers only).
DEEP_HANDLERS = {
    spool.RECORDER_FR: ("fr_trace_json", ""),
    spool.RECORDER_NCCL: ("dump_nccl_trace_json", "includecollectives=true&onlyactive=false"),
}
DEFAULT_DEEP_INTERVAL = defaults.DEEP_INTERVAL


@dataclass(frozen=True)
class RanksConfig:
    directory: str
    poll_interval: float = defaults.POLL_INTERVAL
    rank_timeout: float = defaults.RANK_TIMEOUT  # longest any one rank may hold a poll
    deep_interval: float = DEFAULT_DEEP_INTERVAL  # least time between deep reads that only refresh settled values
    deep_read_share: float = defaults.DEEP_READ_SHARE  # ... and longer where reads are slow (routine_deep_interval)
    departed_grace: float = defaults.DEPARTED_GRACE  # keep exporting a dead or exited rank this long
    max_workers: int = 8
    per_rank_durations: bool = False  # collective durations and bytes per rank instead of per node
    straggler_window: int = DEFAULT_WINDOW  # collectives per rank the lateness score averages over
    strict_permissions: bool = False  # a spool others may write is not read at all (source down), not just warned
    thresholds: ThresholdConfig = field(default_factory=ThresholdConfig)  # adaptive stuck threshold per PG
    # A wedged rank's training-thread stack from py-spy, through torch's pyspy_dump handler (sources/pyspy.py);
    # `serve --evidence-stacks` turns it on with the evidence bundles' stacks: both need py-spy and ptrace.
    wedged_stacks: bool = False
    stack_timeout: float = pyspy.FETCH_TIMEOUT  # one py-spy fetch, connect to last byte


@dataclass
class _FileSig:
    """What identifies a file version without reading it."""

    ino: int = -1
    size: int = -1
    mtime_ns: int = -1

    @staticmethod
    def of(st: os.stat_result) -> _FileSig:
        return _FileSig(st.st_ino, st.st_size, st.st_mtime_ns)


def _outcome(future: cf.Future[Any]) -> tuple[Any, BaseException | None]:
    """A finished future's result, or its exception, without raising it here: a raised exception's traceback
    takes in this frame, whose locals hold the future, which holds the exception: a cycle that keeps a refused
    answer (tens of MB) alive until the garbage collector runs."""
    error = future.exception()
    return (None, error) if error is not None else (future.result(), None)


def _as_source_error(error: BaseException, reason: str, stem: str) -> FrexporterError:
    """``error`` as it is counted: ours as they are; anything else (an answer we do not understand must not
    stop the poll) under ``reason``."""
    if isinstance(error, FrexporterError):
        return error
    return SourceError(reason, f"{stem}: {error!r}")


class _Throttle:
    """Warnings rate-limited per key (a reason: a small fixed set), ``burst`` per ``window`` seconds."""

    def __init__(self, logger: logging.Logger, monotonic: Callable[[], float], burst: int = LOG_BURST,
                 window: float = LOG_WINDOW) -> None:
        self._log = logger
        self._monotonic = monotonic
        self.burst = burst
        self.window = window
        self._windows: dict[str, list[Any]] = {}  # key -> [start, logged, held back]

    def log(self, level: int, key: str, msg: str, *args: object) -> None:
        now = self._monotonic()
        window = self._windows.get(key)
        if window is None or now - window[0] >= self.window:
            if window is not None:
                self._summarise(key, window, now)
            window = self._windows[key] = [now, 0, 0]
        if window[1] < self.burst:
            window[1] += 1
            self._log.log(level, msg, *args)
        else:
            window[2] += 1

    def warning(self, key: str, msg: str, *args: object) -> None:
        self.log(logging.WARNING, key, msg, *args)

    def flush(self) -> None:
        """Sum up the windows that have ended (called once per poll)."""
        now = self._monotonic()
        for key, window in list(self._windows.items()):
            if now - window[0] >= self.window:
                self._summarise(key, window, now)
                del self._windows[key]

    def _summarise(self, key: str, window: list[Any], now: float) -> None:
        if window[2]:
            self._log.warning("%d more like these (%s) in the last %.0f s were not logged; "
                              "frexporter_source_errors_total counts every one", window[2], key, now - window[0])


def routine_deep_interval(read_seconds: float | None, config: RanksConfig) -> float:
    """Seconds between routine deep reads (those that only refresh moving values) of a rank whose last read
    took ``read_seconds``: ``deep_interval``, or longer where reads are slow, so that they take at most
    ``deep_read_share`` of the rank's time. The read's duration, measured here, includes the exporter's own
    parsing: an upper bound of what the rank's worker server spent. A ``deep_interval`` of 0 asks for a read
    whenever values move, and gets it."""
    if read_seconds is None or config.deep_read_share <= 0 or config.deep_interval <= 0:
        return config.deep_interval
    return max(config.deep_interval, read_seconds / config.deep_read_share)


@dataclass
class _PGTrack:
    deep: DeepView | None = None
    has_p2p: bool = False
    last_completed: int | None = None
    last_progress: float | None = None
    progress_mono: float | None = None  # the monotonic time of the last advance (or first sight): gap samples
    # (seq, created) of an in-flight entry -> its age in seconds and our monotonic time when first seen
    seen_inflight: dict[tuple[int, float], tuple[float, float]] = field(default_factory=dict)


@dataclass
class _RankTrack:
    stem: str
    manifest: Manifest
    manifest_sig: _FileSig
    snapshot: Snapshot | None = None
    snapshot_sig: _FileSig = field(default_factory=_FileSig)
    snapshot_map_key: tuple[int, int] | None = None  # (inode, sequence) of the mapped snapshot last parsed
    last_fresh: float | None = None  # our clock when a new snapshot counter was last seen
    deep_raw: dict[str, dict[int, RawPGStatus]] = field(default_factory=dict)  # recorder -> raw at deep read
    deep_time: float | None = None  # wall clock of the last deep read (exported)
    deep_mono: float | None = None  # the same moment on the monotonic clock (spacing decisions)
    deep_seconds: float | None = None  # how long the last deep read took (request to parsed answer)
    deep_pending: cf.Future | None = None
    ping_pending: cf.Future | None = None
    socket_alive: bool | None = None
    learned_ids: dict[str, dict[int, str]] = field(default_factory=dict)  # recorder -> pg id -> name
    pgs: dict[str, _PGTrack] = field(default_factory=dict)  # pg name -> track
    prev_raw: dict[str, dict[int, RawPGStatus]] = field(default_factory=dict)
    departed_at: float | None = None
    cursors: dict[str, EntryCursor] = field(default_factory=dict)  # recorder -> entries already handed over
    group_keys: dict[tuple[str, str], GroupKey] = field(default_factory=dict)  # see RanksSource._group_keys
    group_keys_of: Manifest | None = None
    cpu_sample: tuple[float, float] | None = None  # (snapshot time, process CPU seconds) of the last snapshot
    cpu_percent: float | None = None  # CPU use between the last two snapshots that carried it
    activity: Activity | None = None
    status: str | None = None  # liveness as judged at the last poll (model.RANK_*)
    wedges: int = 0  # wedges seen so far: a py-spy answer belongs to the wedge it was asked in
    stack_pending: tuple[cf.Future, int] | None = None  # a py-spy fetch in flight, and its wedge
    stack_asked: float | None = None  # monotonic time of this wedge's last py-spy fetch
    stack_frames: tuple[Frame, ...] | None = None  # py-spy's training-thread frames in this wedge


class RanksSource:
    name = "ranks"

    def __init__(self, config: RanksConfig, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] | None = None) -> None:
        self.config = config
        self.clock = clock
        # Intervals (freshness, read spacing, grace) run on a monotonic clock so that a wall-clock jump
        # (NTP step, VM resume) neither makes every rank look stale nor every collective look old. A test
        # that fakes the wall clock gets the same fake for intervals unless it passes its own.
        self.monotonic = monotonic or (time.monotonic if clock is time.time else clock)
        self._ranks: dict[str, _RankTrack] = {}
        # Per name in the spool, (version, reason) of what was reported (version None: a name that is not a spool
        # file's, counted once). Entries go when their name leaves the spool, as do those of _logged.
        self._bad_files: dict[str, tuple[_FileSig | None, str]] = {}
        self._logged: set[tuple[str, str]] = set()  # (stem, reason) of socket failures already logged
        self._trust = spool.Trust.current()
        self._throttle = _Throttle(log, self.monotonic)
        self._problems: list[PermissionProblem] = []  # permission problems found in this poll
        self._problems_known: set[str] = set()  # those reported, for as long as they last
        self._pool = cf.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="frexporter-sock")
        # py-spy fetches have a pool of their own: they are slower than pings and deep reads, are never waited
        # for, and must never hold back a socket thread a poll needs.
        self._stack_pool = cf.ThreadPoolExecutor(max_workers=pyspy.MAX_CONCURRENT,
                                                 thread_name_prefix="frexporter-pyspy")
        self.errors: list[tuple[str, str]] = []  # (reason, message) of the current poll
        self._collectives = CollectiveAccumulator(per_rank=config.per_rank_durations)
        self._lateness = LatenessTracker(window=config.straggler_window)
        self._thresholds = ThresholdLearner(config.thresholds)
        # Completed collectives so far (durations, bytes), as of the last collect(); the exporter puts them
        # in NodeSnapshot.collectives.
        self.collectives: tuple[CollectiveStats, ...] = ()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._stack_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ poll

    def collect(self) -> Reading:
        ranks = self.read_ranks()
        return Reading(ranks=ranks, collectives=self.collectives, problems=tuple(self.errors))

    def read_ranks(self) -> tuple[RankState, ...]:
        """Every local rank's state this poll; ``errors`` and ``collectives`` are updated alongside."""
        self.errors = []
        self._throttle.flush()
        now = self.clock()
        mono = self.monotonic()
        dfd = self._open_dir()
        try:
            self._check_directory(dfd)
            entries = self._scan(dfd)
            self._forget_vanished(entries)
            self._load_manifests(dfd, entries)
            if self._logged:
                self._logged = {key for key in self._logged if key[0] in self._ranks}
            for track in self._ranks.values():
                self._load_snapshot(dfd, track, entries)
            self._schedule_socket_work(mono, entries)
            self._settle_permissions()
        finally:
            os.close(dfd)
        self._await_socket_work()
        tracks = sorted(self._ranks.values(), key=lambda t: (t.manifest.job_id, t.manifest.rank))
        states = tuple(s for s in (self._rank_state(track, now, mono) for track in tracks) if s is not None)
        # A PG no exported rank lists any more (destroyed, its job gone) takes its history with it.
        self._thresholds.retain((s.job_id, pg.name) for s in states for pg in s.pgs)
        live_jobs = {t.manifest.job_id for t in self._ranks.values()}
        self._collectives.forget_jobs(live_jobs)
        self._lateness.forget({key for t in self._ranks.values() for key in self._group_keys(t).values()})
        self.collectives = self._collectives.snapshot()
        return states

    # ------------------------------------------------------------------ files

    def _path(self, name: str) -> str:
        return os.path.join(self.config.directory, name)

    def _open_dir(self) -> int:
        """The spool directory, opened once per poll: every name in it is resolved against this descriptor.

        Its own path may go through links (the administrator's choice); names inside it never do."""
        directory = self.config.directory
        try:
            return os.open(directory, _DIR_FLAGS)
        except FileNotFoundError as e:
            raise SourceError("dir_missing", f"spool directory {directory} does not exist") from e
        except PermissionError as e:
            raise SourceError("permission", f"spool directory {directory}: permission denied") from e
        except OSError as e:
            raise SourceError("io", f"spool directory {directory}: {e.strerror or e}") from e

    def _scan(self, dfd: int) -> dict[str, os.DirEntry]:
        try:
            with os.scandir(dfd) as it:
                return {e.name: e for e in it}
        except OSError as e:
            raise SourceError("io", f"spool directory {self.config.directory}: {e.strerror or e}") from e

    def _forget_vanished(self, entries: dict[str, os.DirEntry]) -> None:
        gone = [name for name in self._bad_files if name not in entries]
        for name in gone:
            del self._bad_files[name]

    # ------------------------------------------------------------------ permissions

    def _check_directory(self, dfd: int) -> None:
        """check_permissions' rules for the directory, on an fstat of the open descriptor: one syscall a poll.
        (Rank files open to every user are the ranks' privacy, not what this exporter reads: ``serve`` reports
        those when it starts; here only files anyone may write count, from the stat each one gets anyway.)"""
        try:
            st = os.fstat(dfd)
        except OSError as e:
            raise SourceError("io", f"spool directory {self.config.directory}: {e.strerror or e}") from e
        self._problems = spool.directory_problems(self.config.directory, st, self._trust)
        if self.config.strict_permissions and self._problems:
            raise self._unsafe(self._problems)

    def _note_mode(self, path: str, st: os.stat_result) -> None:
        problem = spool.writable_by_anyone(path, st)
        if problem is not None:
            self._problems.append(problem)

    def _unsafe(self, problems: list[PermissionProblem]) -> SourceError:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return SourceError("unsafe_permissions", f"unsafe spool permissions: {problems[0]}{more}; "
                                                 "--strict-permissions: the spool is not read until this is fixed")

    def _settle_permissions(self) -> None:
        """Problems found in this poll: a refusal under --strict-permissions, else counted and logged once while
        they last (a problem fixed and back is reported again)."""
        if self.config.strict_permissions and self._problems:
            raise self._unsafe(self._problems)
        current = set()
        for problem in self._problems:
            key = str(problem)
            current.add(key)
            if key not in self._problems_known:
                self.errors.append(("unsafe_permissions", f"unsafe spool permissions: {problem}"))
                self._throttle.warning("unsafe_permissions", "unsafe spool permissions: %s (reason=unsafe_permissions;"
                                       " --strict-permissions stops reading the spool while it lasts)", problem)
        self._problems_known = current

    # ------------------------------------------------------------------ files

    def _report(self, name: str, sig: _FileSig | None, err: SpoolError | SourceError) -> None:
        """Count and log a bad file once per version of that file, not once per poll."""
        known = self._bad_files.get(name)
        if known is not None and known[0] == sig and known[1] == err.reason:
            return
        self._bad_files[name] = (sig, err.reason)
        self.errors.append((err.reason, str(err)))
        self._throttle.warning(err.reason, "%s (reason=%s)", err, err.reason)

    def _own_socket(self, manifest: Manifest, stem: str, path: str) -> Manifest:
        """``manifest`` as used: the socket it names must be the one the recorder makes for this file's stem,
        or another rank's socket (its pings, FR entries and stacks) would be shown as this rank's."""
        own = spool.socket_name(stem)
        if not manifest.socket or manifest.socket == own:
            return manifest
        reason = "socket_mismatch"
        message = f"{path}: names the socket {manifest.socket[:64]!r}, not its own {own}; its socket is not used"
        self.errors.append((reason, message))
        self._throttle.warning(reason, "%s (reason=%s)", message, reason)
        return replace(manifest, socket="")

    def _load_manifests(self, dfd: int, entries: dict[str, os.DirEntry]) -> None:
        seen_stems = set()
        for name, entry in entries.items():
            if (name.startswith(".") or name == spool.EVIDENCE_DIRNAME
                    or name.endswith((spool.SNAPSHOT_SUFFIX, spool.SNAPSHOT_MAP_SUFFIX, spool.SOCKET_SUFFIX))):
                continue
            path = self._path(name)
            if not name.endswith(spool.MANIFEST_SUFFIX):
                # Not a spool file's name: counted once per name, without a syscall (there may be any number).
                if name not in self._bad_files:
                    self._report(name, None, SpoolError("foreign", f"{path}: not a frexporter spool file; ignored"))
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            sig = _FileSig.of(st)
            stem = name[: -len(spool.MANIFEST_SUFFIX)]
            seen_stems.add(stem)
            if stat.S_ISLNK(st.st_mode):
                self._report(name, sig, SpoolError("foreign", f"{path}: a symbolic link; refused"))
                continue
            if not stat.S_ISREG(st.st_mode):
                self._report(name, sig, SpoolError("foreign", f"{path}: not a regular file; ignored"))
                continue
            self._note_mode(path, st)
            track = self._ranks.get(stem)
            if track is not None and track.manifest_sig == sig:
                continue
            known = self._bad_files.get(name)
            if known is not None and known[0] == sig and known[1] != "too_many_ranks":
                continue
            if track is None and len(self._ranks) >= spool.MAX_RANKS_PER_NODE:
                limit = spool.MAX_RANKS_PER_NODE
                self._report(name, sig, SpoolError("too_many_ranks",
                                                   f"{path}: ignored, this exporter already tracks {limit} ranks"))
                continue
            try:
                # What was opened decides, not the lstat above: the name may have been swapped since.
                obj, st = spool.read_json_at(name, spool.MAX_MANIFEST_BYTES, dfd, path)
                sig = _FileSig.of(st)
                manifest = spool.parse_manifest(obj, path)
            except SpoolError as e:
                self._report(name, sig, e)
                continue
            self._bad_files.pop(name, None)
            for reason, message in manifest.problems:  # dropped or repaired fields; the rest of the rank stands
                self.errors.append((reason, message))
                self._throttle.warning(reason, "%s (reason=%s)", message, reason)
            manifest = self._own_socket(manifest, stem, path)
            if track is None or track.manifest.pid != manifest.pid or track.manifest.start_time != manifest.start_time:
                if track is not None:
                    self._throttle.log(logging.INFO, "restarted", "rank %d of job %s restarted (pid %d -> %d); "
                                       "state reset", manifest.rank, manifest.job_id, track.manifest.pid, manifest.pid)
                # Until its first snapshot, a rank counts as fresh from when it wrote its manifest: the
                # recorder writes both in one tick, and a rank caught between the two is starting, not wedged.
                born = self.monotonic() - max(0.0, self.clock() - sig.mtime_ns / 1e9)
                self._ranks[stem] = _RankTrack(stem=stem, manifest=manifest, manifest_sig=sig, last_fresh=born)
            else:
                track.manifest = manifest
                track.manifest_sig = sig
        for stem in list(self._ranks):
            if stem not in seen_stems:
                del self._ranks[stem]

    def _load_snapshot(self, dfd: int, track: _RankTrack, entries: dict[str, os.DirEntry]) -> None:
        # A mapped snapshot changes in place (no new mtime to go by): read it every poll, one open + fstat +
        # pread of its header. A JSON one (recorders before the mapped format) is replaced per snapshot: read
        # it when its lstat changed.
        name = track.stem + spool.SNAPSHOT_MAP_SUFFIX
        entry = entries.get(name)
        mapped = entry is not None
        if entry is None:
            name = track.stem + spool.SNAPSHOT_SUFFIX
            entry = entries.get(name)
            if entry is None:
                return
        path = self._path(name)
        sig: _FileSig | None = None
        try:
            if mapped:
                if entry.is_symlink():  # from the directory entry's type: no syscall
                    raise SpoolError("foreign", f"{path}: a symbolic link; refused")
                key, obj, st = spool.read_snapshot_map_at(name, track.snapshot_map_key, dir_fd=dfd, what=path)
                sig = _FileSig.of(st)
                self._note_mode(path, st)
                if obj is None:
                    return
                track.snapshot_map_key = key
            else:
                st = entry.stat(follow_symlinks=False)
                sig = _FileSig.of(st)
                if stat.S_ISLNK(st.st_mode):
                    raise SpoolError("foreign", f"{path}: a symbolic link; refused")
                self._note_mode(path, st)
                known = self._bad_files.get(name)
                if sig == track.snapshot_sig or (known is not None and known[0] == sig):
                    return
                obj, st = spool.read_json_at(name, spool.MAX_SNAPSHOT_BYTES, dfd, path)
                sig = _FileSig.of(st)
            snap = spool.parse_snapshot(obj, path)
        except SpoolError as e:
            self._report(name, sig or self._lstat_sig(entry), e)
            return
        except OSError:
            return  # gone since the scan
        track.snapshot_sig = sig
        self._bad_files.pop(name, None)
        if snap.pid != track.manifest.pid:
            return  # a snapshot of a previous incarnation, or of a rank that restarted before its manifest
        if track.snapshot is None:
            # First sight (e.g. the exporter restarted mid-hang): trust the rank's own timestamp, both
            # processes read the same node clock.
            track.last_fresh = self.monotonic() - max(0.0, self.clock() - snap.time)
        elif snap.counter != track.snapshot.counter:
            track.last_fresh = self.monotonic()
        for reason, message in snap.problems:  # dropped optional fields (stack, cpu); the rest stands
            self.errors.append((reason, message))
            self._throttle.warning(reason, "%s (reason=%s)", message, reason)
        _absorb_cpu(track, snap)
        track.snapshot = snap

    @staticmethod
    def _lstat_sig(entry: os.DirEntry) -> _FileSig | None:
        try:
            return _FileSig.of(entry.stat(follow_symlinks=False))
        except OSError:
            return None

    # ------------------------------------------------------------------ sockets

    def _stale(self, track: _RankTrack, mono: float) -> bool:
        snap = track.snapshot
        if track.last_fresh is None:
            return True
        interval = snap.interval if snap is not None else spool.DEFAULT_SNAPSHOT_INTERVAL
        allowed = max(3 * interval, 1.0) + self.config.poll_interval
        return mono - track.last_fresh > allowed

    def _schedule_socket_work(self, mono: float, entries: dict[str, os.DirEntry]) -> None:
        stacks_in_flight = sum(1 for t in self._ranks.values() if t.stack_pending is not None)
        for track in self._ranks.values():
            name = track.manifest.socket
            if not name:
                continue
            if track.snapshot is not None and track.snapshot.state == "exiting":
                continue
            stale = self._stale(track, mono)
            ping = stale and track.ping_pending is None and track.deep_pending is None
            deep = track.deep_pending is None and self._wants_deep_read(track, mono, stale)
            stack = stale and stacks_in_flight < pyspy.MAX_CONCURRENT and self._wants_stack(track, mono)
            if not (ping or deep or stack) or not self._socket_usable(track, name, entries.get(name)):
                continue
            path = self._path(name)
            if ping:
                track.ping_pending = self._pool.submit(worker_client.ping, path, self.config.rank_timeout, self._trust)
            if deep:
                track.deep_pending = self._pool.submit(self._deep_read, track.manifest, path)
            if stack:
                track.stack_asked = mono
                fetch = self._stack_pool.submit(pyspy.fetch, path, self.config.stack_timeout, self._trust)
                track.stack_pending = (fetch, track.wedges)
                stacks_in_flight += 1

    def _wants_stack(self, track: _RankTrack, mono: float) -> bool:
        """Whether to ask py-spy for a wedged rank's stack now: once when the wedge is first judged (the last
        poll said unresponsive: a rank that died since has been judged down by its ping), then every
        REFRESH_INTERVAL while it lasts, one fetch per rank at a time."""
        return (self.config.wedged_stacks and track.status == RANK_UNRESPONSIVE and track.stack_pending is None
                and pyspy.HANDLER in track.manifest.handlers
                and (track.stack_asked is None or mono - track.stack_asked >= pyspy.REFRESH_INTERVAL))

    def _socket_usable(self, track: _RankTrack, name: str, entry: os.DirEntry | None) -> bool:
        """Whether a rank's socket may be connected to: a socket (not a link to one) owned as the spool's mode
        expects. The connecting thread checks again and verifies the peer; this check refuses a bad socket once
        per version, without a thread or a connection. A missing one is left to the connect (socket_missing)."""
        if not name.endswith(spool.SOCKET_SUFFIX):
            # Not a socket's name (a manifest may name any file in the spool): a fault of this manifest version.
            self._report(track.stem + spool.MANIFEST_SUFFIX, track.manifest_sig, SourceError(
                "socket_untrusted", f"{self._path(track.stem + spool.MANIFEST_SUFFIX)}: its socket {name[:64]!r} "
                                    f"is not named *{spool.SOCKET_SUFFIX}; not connecting"))
            track.socket_alive = False
            return False
        if entry is None:
            return True
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            return True
        path = self._path(name)
        problem = spool.socket_problem(st, self._trust)
        if problem is not None:
            self._report(name, _FileSig.of(st), SourceError("socket_untrusted", f"{path}: {problem}; not connecting"))
            track.socket_alive = False
            return False
        self._bad_files.pop(name, None)
        exposed = spool.writable_by_anyone(path, st)
        if exposed is not None:
            self._problems.append(exposed)
            return not self.config.strict_permissions
        return True

    def _wants_deep_read(self, track: _RankTrack, mono: float, stale: bool) -> bool:
        if not track.manifest.recorders:
            return False
        if track.deep_mono is not None and mono - track.deep_mono < self.config.poll_interval * 0.9:
            return False
        if stale:
            return track.socket_alive is not False
        raw = self._current_raw(track)
        if not raw:
            return False
        if track.deep_mono is None:
            return True
        routine_due = mono - track.deep_mono >= routine_deep_interval(track.deep_seconds, self.config)
        for recorder, statuses in raw.items():
            known = track.learned_ids.get(recorder, {})
            at_deep = track.deep_raw.get(recorder, {})
            prev = track.prev_raw.get(recorder, {})
            for pg_id, status in statuses.items():
                if pg_id not in known:
                    return True
                if status == at_deep.get(pg_id):
                    continue
                settled = status == prev.get(pg_id)
                pending = status.enqueued > status.completed
                # Work in flight that stopped moving may be a hang: read its entries at once. Anything
                # else that moved since the last read (p2p traffic may have shifted torch's raw
                # counters off the collective domain) is refreshed at most every deep_interval (or further
                # apart where reads are slow: routine_deep_interval).
                if settled and pending:
                    return True
                if routine_due:
                    return True
        return False

    def _deep_read(self, manifest: Manifest, path: str) -> tuple[dict[str, trace.FrDump], float]:
        """Every recorder's ring of one rank, and how long reading them took."""
        started = time.perf_counter()
        dumps = {}
        for recorder in manifest.recorders:
            handler, query = DEEP_HANDLERS.get(recorder, ("", ""))
            if not handler or (manifest.handlers and handler not in manifest.handlers):
                continue
            bounds = trace.answer_bounds(manifest.fr_buffer_size, manifest.members_total)
            body = worker_client.post(path, handler, self.config.rank_timeout, query, max_bytes=bounds.max_bytes,
                                      trust=self._trust)
            try:
                dumps[recorder] = trace.parse_answer(body, bounds, f"{path} {handler}")
            finally:
                del body  # neither while the next recorder is read nor by a refusal's traceback
        return dumps, time.perf_counter() - started

    def _await_socket_work(self) -> None:
        futures = [f for t in self._ranks.values() for f in (t.deep_pending, t.ping_pending) if f is not None]
        if futures:
            cf.wait(futures, timeout=self.config.rank_timeout)
        now, mono = self.clock(), self.monotonic()
        for track in self._ranks.values():
            if track.stack_pending is not None and track.stack_pending[0].done():
                self._absorb_stack(track)
            if track.ping_pending is not None and track.ping_pending.done():
                alive, error = _outcome(track.ping_pending)
                track.ping_pending = None
                if error is None:
                    track.socket_alive = bool(alive)
                else:
                    reason = error.reason if isinstance(error, FrexporterError) else ""
                    track.socket_alive = reason not in _SOCKET_GONE
                    self._log_once(track, _as_source_error(error, "socket_error", track.stem))
            if track.deep_pending is not None and track.deep_pending.done():
                read, error = _outcome(track.deep_pending)
                track.deep_pending = None
                if error is None:
                    dumps, track.deep_seconds = read
                    self._absorb_deep(track, dumps, now)
                    track.deep_mono = mono
                    track.socket_alive = True
                else:  # the socket's failure, an answer the parser refused, or one we do not understand
                    if isinstance(error, FrexporterError) and error.reason in _SOCKET_GONE:
                        track.socket_alive = False
                    track.deep_time, track.deep_mono = now, mono  # do not hammer a failing socket every poll
                    self._log_once(track, _as_source_error(error, "bad_response", track.stem))

    def _absorb_stack(self, track: _RankTrack) -> None:
        """A finished py-spy fetch (never waited for: a poll takes what is done). Its frames stand for the
        wedge they were asked in, as long as that wedge lasts; failures are counted, the rank keeps its last
        own sample."""
        assert track.stack_pending is not None
        (future, wedge), track.stack_pending = track.stack_pending, None
        frames, error = _outcome(future)
        if error is not None:  # the socket's failure, py-spy's, or an answer the parser refused or misunderstood
            self._log_once(track, _as_source_error(error, pyspy.REASON_INVALID, track.stem))
            return
        if wedge == track.wedges and track.status == RANK_UNRESPONSIVE:
            track.stack_frames = frames

    def _log_once(self, track: _RankTrack, err: FrexporterError) -> None:
        self.errors.append((err.reason, str(err)))
        key = (track.stem, err.reason)
        if key not in self._logged:
            self._logged.add(key)
            self._throttle.warning(err.reason, "rank %d of job %s: %s (reason=%s; logged once)", track.manifest.rank,
                                   track.manifest.job_id, err, err.reason)

    def _absorb_deep(self, track: _RankTrack, dumps: dict[str, trace.FrDump], now: float) -> None:
        track.deep_time = now
        for recorder, dump in dumps.items():
            views = translate(dump)
            ids = track.learned_ids.setdefault(recorder, {})
            for pg_id, view in views.items():
                if view.name:
                    ids[pg_id] = view.name
                name = ids.get(pg_id) or self._predicted_name(track.manifest, recorder, pg_id)
                if name is None:
                    continue
                pg = track.pgs.setdefault(name, _PGTrack())
                pg.deep = view
                pg.has_p2p = pg.has_p2p or view.has_p2p
            track.deep_raw[recorder] = dict(dump.pg_status)
            self._absorb_entries(track, recorder, dump)
            if dump.repaired_text:
                self._log_once(track, SourceError(spool.TEXT_REPAIRED, (
                    f"{track.stem}: {dump.repaired_text} strings of its {recorder} Flight Recorder answer were not "
                    "valid UTF-8; shown with U+FFFD in place of what could not be decoded")))

    def _absorb_entries(self, track: _RankTrack, recorder: str, dump: trace.FrDump) -> None:
        """Feed entries not seen before to the duration/bytes counters and the lateness tracker, once each."""
        cursor = track.cursors.setdefault(recorder, EntryCursor(nccl=recorder == spool.RECORDER_NCCL))
        settled, fresh, missed = cursor.take(dump.entries)
        m = track.manifest
        table = {pg.name: pg for pg in m.process_groups}
        for entry in settled:
            if entry.pg_name:
                pg_entry = table.get(entry.pg_name)
                self._collectives.add(m.job_id, m.rank, pg_entry.desc if pg_entry else entry.pg_desc, entry)
        by_pg: dict[str, list[trace.FrEntry]] = {}
        for entry in fresh:
            if entry.pg_name in table:
                by_pg.setdefault(entry.pg_name, []).append(entry)
        keys = self._group_keys(track)
        for name, entries in by_pg.items():
            key = keys.get((recorder, name))
            if key is not None:
                self._lateness.observe(key, self._local_members(key), m.rank, entries)
        if missed:
            self._log_once(track, SourceError(
                "fr_entries_missed", f"{track.stem}: {missed} {recorder} Flight Recorder entries left the ring "
                "between two deep reads; collective durations and bytes undercount them (raise "
                "TORCH_FR_BUFFER_SIZE or lower the deep interval)"))

    @staticmethod
    def _group_keys(track: _RankTrack) -> dict[tuple[str, str], GroupKey]:
        """(recorder, PG name) -> lateness group key, built once per manifest version: the member list of a
        WORLD group can hold thousands of ranks, too many to hash on every poll."""
        m = track.manifest
        if track.group_keys_of is not m:
            # Per recorder: a cpu:gloo,cuda:nccl group counts collective seqs separately in each backend.
            # The spool keeps member lists sorted, so equal groups hash equal.
            track.group_keys = {(recorder, pg.name): (m.job_id, pg.name, hash(pg.ranks), recorder)
                                for recorder in m.recorders for pg in m.process_groups}
            track.group_keys_of = m
        return track.group_keys

    def _local_members(self, key: GroupKey) -> dict[int, int]:
        """Local rank -> pid of every rank on this node whose PG table lists the group ``key``."""
        return {t.manifest.rank: t.manifest.pid for t in self._ranks.values()
                if self._group_keys(t).get((key[3], key[1])) == key}

    # ------------------------------------------------------------------ state

    @staticmethod
    def _predicted_name(manifest: Manifest, recorder: str, pg_id: int) -> str | None:
        for pg in manifest.process_groups:
            if pg.local_ids.get(recorder) == pg_id:
                return pg.name
        return None

    def _pg_track_for(self, track: _RankTrack, recorder: str, pg_id: int) -> _PGTrack:
        name = track.learned_ids.get(recorder, {}).get(pg_id) or self._predicted_name(
            track.manifest, recorder, pg_id)
        return track.pgs.setdefault(name or f"?{recorder}:{pg_id}", _PGTrack())

    def _current_raw(self, track: _RankTrack) -> dict[str, dict[int, RawPGStatus]]:
        if track.snapshot is None:
            return {}
        return {recorder: dict(statuses) for recorder, statuses in track.snapshot.status.items()}

    def _rank_state(self, track: _RankTrack, now: float, mono: float) -> RankState | None:
        m = track.manifest
        snap = track.snapshot
        stale = self._stale(track, mono)
        if snap is not None and snap.state == "exiting":
            status = RANK_EXITED
        elif not stale:
            status = RANK_OK
        elif track.socket_alive:
            status = RANK_UNRESPONSIVE
        elif track.socket_alive is None and snap is None and now - m.start_time < self.config.rank_timeout * 3:
            status = RANK_OK  # just started: the first snapshot is on its way
        else:
            status = RANK_DOWN
        if status == RANK_UNRESPONSIVE and track.status != RANK_UNRESPONSIVE:
            track.wedges += 1  # a new wedge: py-spy is asked afresh, an answer for an earlier one is dropped
            track.stack_asked = track.stack_frames = None
        elif status != RANK_UNRESPONSIVE:
            track.stack_asked = track.stack_frames = None
        track.status = status
        if status in (RANK_OK, RANK_UNRESPONSIVE):
            track.departed_at = None
        elif track.departed_at is None:
            track.departed_at = mono
        # A clean exit is the normal end of a job, not an outage: stop exporting the rank at once.
        if status == RANK_EXITED:
            return None
        if track.departed_at is not None and mono - track.departed_at > self.config.departed_grace:
            return None

        raw = self._current_raw(track)
        if status == RANK_UNRESPONSIVE and track.deep_raw:
            # Python is wedged but its C++ worker server answered: that pg_status is the fresh one.
            raw = {r: dict(s) for r, s in track.deep_raw.items()}
        pgs = self._pg_states(track, raw, now, mono)
        track.prev_raw = raw
        heartbeat = snap.time if snap is not None else None
        frames, source = (snap.stack if snap is not None else ()), FRAMES_RECORDER
        if track.stack_frames is not None:  # wedged, and py-spy answered for this wedge
            frames, source = track.stack_frames, FRAMES_PYSPY
        track.activity = activity.next_activity(
            track.activity, status, frames, track.cpu_percent, any(pg.inflight_count > 0 for pg in pgs), now,
            source)
        return RankState(
            job_id=m.job_id,
            rank=m.rank,
            local_rank=m.local_rank,
            world_size=m.world_size,
            hostname=m.hostname,
            pid=m.pid,
            torch_version=m.torch_version,
            gpu_uuid=m.gpu_uuid,
            status=status,
            heartbeat=heartbeat,
            heartbeat_age=max(0.0, now - heartbeat) if heartbeat is not None else None,
            socket_alive=track.socket_alive,
            pgs=pgs,
            recorder_errors=dict(snap.errors) if snap is not None else {},
            message=snap.message if snap is not None else "",
            last_deep_read=track.deep_time,
            socket=m.socket,
            handlers=m.handlers,
            state=m.state,
            start_time=m.start_time,
            node_ranks=m.launcher.node_ranks() if m.launcher is not None else (),
            activity=track.activity,
        )

    def _pg_states(self, track: _RankTrack, raw: dict[str, dict[int, RawPGStatus]], now: float, mono: float
                   ) -> tuple[PGState, ...]:
        table = {pg.name: pg for pg in track.manifest.process_groups}
        # NCCL's recorder is the one that sees GPU collectives; prefer it where a PG has both.
        chosen: dict[str, tuple[str, int, RawPGStatus]] = {}
        for recorder in sorted(raw, key=lambda r: r != spool.RECORDER_NCCL):
            for pg_id, status in raw[recorder].items():
                name = track.learned_ids.get(recorder, {}).get(pg_id) or self._predicted_name(
                    track.manifest, recorder, pg_id)
                if name is None or name in chosen:
                    continue
                chosen[name] = (recorder, pg_id, status)
        out = []
        keys = self._group_keys(track) if self._lateness.scored else {}
        for name, (recorder, _pg_id, status) in sorted(chosen.items()):
            entry = table.get(name) or PGEntry(name=name, desc="", ranks=(), backend=recorder)
            pg = track.pgs.setdefault(name, _PGTrack())
            prev_completed, prev_seen = pg.last_completed, pg.seen_inflight
            state = self._pg_state(entry, pg, status, recorder, track, now, mono)
            state = self._learn(track.manifest.job_id, pg, state, prev_completed, prev_seen, mono)
            key = keys.get((recorder, name))
            if key is not None:
                lateness, samples = self._lateness.score(key, track.manifest.rank)
                if lateness is not None:
                    state = replace(state, lateness_seconds=lateness, lateness_samples=samples)
            out.append(state)
        return tuple(out)

    def _learn(self, job_id: str, pg: _PGTrack, state: PGState, prev_completed: int | None,
               prev_seen: dict[tuple[int, float], tuple[float, float]], mono: float) -> PGState:
        """Feed this poll's evidence of the PG's normal wait to the learner; the state with its threshold.

        Only a forward move of the completed sequence is a sample: a first sight or a counter that went back
        (the rank restarted) restarts the gap instead, so neither a restart's downtime nor a clock step is
        learned as a normal pause."""
        key = (job_id, state.name)
        completed = state.last_completed
        if prev_completed is None or completed < prev_completed or pg.progress_mono is None:
            pg.progress_mono = mono
        elif completed > prev_completed:
            self._thresholds.observe(key, mono - pg.progress_mono)
            for (seq, _created), (age, first_mono) in prev_seen.items():
                if prev_completed < seq <= completed:  # seen in flight, now complete: its wait, at most
                    self._thresholds.observe(key, age + max(0.0, mono - first_mono))
            pg.progress_mono = mono
        return replace(state, stuck_threshold_seconds=self._thresholds.threshold(key),
                       stuck_ceiling_seconds=self._thresholds.config.ceiling)

    @staticmethod
    def _pg_state(entry: PGEntry, pg: _PGTrack, status: RawPGStatus, recorder: str, track: _RankTrack,
                  now: float, mono: float) -> PGState:
        deep = pg.deep
        exact = True
        inflight: tuple[InflightCollective, ...] = ()
        if deep is not None and deep.known and deep.raw == status:
            enqueued, started, completed = deep.enqueued, deep.started, deep.completed
            inflight = deep.inflight
        elif not pg.has_p2p:
            enqueued, started, completed = status.enqueued, status.started, status.completed
            if deep is not None:
                inflight = tuple(c for c in deep.inflight if completed < c.seq <= enqueued)
        else:
            assert deep is not None
            enqueued, started, completed = deep.enqueued, deep.started, deep.completed
            exact = False
            # p2p traffic keeps torch's raw counters off the collective domain, so values stay as of the last
            # deep read. Its in-flight entries are still in flight only while nothing completed since: once
            # the rank completes anything, reporting them would show a finished collective waiting for ever
            # longer (a phantom wait the desync alert would page on).
            inflight = deep.inflight if status.completed == deep.raw.completed else ()
        inflight = _steady_ages(pg, inflight, now, mono)
        if pg.last_completed is not None and completed != pg.last_completed:
            pg.last_progress = now
        elif pg.last_progress is None and deep is not None and deep.completed_created is not None and completed > 0:
            pg.last_progress = min(now, deep.completed_created)  # first sight: a lower bound from FR
        pg.last_completed = completed
        timeout = entry.timeout_seconds
        if deep is not None and deep.timeout_seconds:
            timeout = deep.timeout_seconds
        desc = entry.desc or (deep.desc if deep is not None else "")
        return PGState(
            name=entry.name,
            desc=desc,
            ranks=entry.ranks,
            backend=entry.backend or recorder,
            last_enqueued=enqueued,
            last_started=started,
            last_completed=completed,
            inflight=inflight,
            inflight_count=max(0, enqueued - completed) if exact or inflight else max(
                0, min(enqueued - completed, status.enqueued - status.completed)),
            timeout_seconds=timeout,
            last_progress=pg.last_progress,
            exact=exact,
            has_p2p=pg.has_p2p,
        )


def _absorb_cpu(track: _RankTrack, snap: Snapshot) -> None:
    """CPU use between this snapshot and the last one that carried the process's CPU time."""
    if snap.cpu is None:
        return
    prev = track.cpu_sample
    if prev is not None and snap.time > prev[0] and snap.cpu >= prev[1]:
        track.cpu_percent = round(100.0 * (snap.cpu - prev[1]) / (snap.time - prev[0]), 1)
    elif prev is not None and (snap.time != prev[0] or snap.cpu != prev[1]):
        track.cpu_percent = None  # the clock went back or a new process: start over
    track.cpu_sample = (snap.time, snap.cpu)


def _steady_ages(pg: _PGTrack, inflight: tuple[InflightCollective, ...], now: float, mono: float
                 ) -> tuple[InflightCollective, ...]:
    """In-flight entries whose ``created`` survives wall-clock jumps.

    FR stamps entries with the wall clock. From the first time we see an entry its age grows with the
    monotonic clock instead, and ``created`` is restated as ``now - age``: a clock stepped forward an hour
    must not make a 2-second-old collective look an hour old (a false verdict) or the reverse.
    """
    seen: dict[tuple[int, float], tuple[float, float]] = {}
    out = []
    for entry in inflight:
        key = (entry.seq, entry.created)
        first = pg.seen_inflight.get(key) or (max(0.0, now - entry.created), mono)
        seen[key] = first
        created = now - (first[0] + max(0.0, mono - first[1]))
        out.append(entry if abs(created - entry.created) < 1e-3 else replace(entry, created=created))
    pg.seen_inflight = seen
    return tuple(out)
