"""The spool's files -> rank tracks: scan, manifests, snapshots, and which sockets may be connected to.

Cheap every poll: one directory descriptor, one scan, an lstat per manifest (re-read only when it changed), one
open + fstat + pread per mapped snapshot (a JSON one is re-read when its lstat changed). Everything in the spool
is untrusted (whoever may write it can plant, link or swap any name): files are opened relative to the
directory's descriptor, never through a link, and judged by an fstat of what was opened. A bad file is counted
once per version of it, not once per poll; permissions are judged by ``permissions.PermissionPolicy``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import replace

from frexporter import reasons, spool
from frexporter.sources.base import SourceError
from frexporter.sources.ranks.permissions import PermissionPolicy
from frexporter.sources.ranks.problems import Problems
from frexporter.sources.ranks.track import FileSig, RankTrack
from frexporter.spool import Manifest, Snapshot, SpoolError

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


class SpoolReader:
    def __init__(self, directory: str, permissions: PermissionPolicy, trust: spool.Trust, problems: Problems,
                 clock: Callable[[], float], monotonic: Callable[[], float]) -> None:
        self.directory = directory
        self.permissions = permissions
        self._trust = trust
        self._problems = problems
        self._clock = clock
        self._monotonic = monotonic
        # Per name in the spool, (version, reason) of what was reported (version None: a name that is not a spool
        # file's, counted once). Entries go when their name leaves the spool.
        self.bad_files: dict[str, tuple[FileSig | None, str]] = {}

    @contextlib.contextmanager
    def opened(self) -> Iterator[int]:
        """The spool directory, opened once per poll: every name in it is resolved against this descriptor.

        Its own path may go through links (the administrator's choice); names inside it never do."""
        directory = self.directory
        try:
            dfd = os.open(directory, _DIR_FLAGS)
        except FileNotFoundError as e:
            raise SourceError(reasons.DIR_MISSING, f"spool directory {directory} does not exist") from e
        except PermissionError as e:
            raise SourceError(reasons.PERMISSION, f"spool directory {directory}: permission denied") from e
        except OSError as e:
            raise SourceError(reasons.IO, f"spool directory {directory}: {e.strerror or e}") from e
        try:
            yield dfd
        finally:
            os.close(dfd)

    def read(self, dfd: int, ranks: dict[str, RankTrack]) -> dict[str, os.DirEntry]:
        """What changed in the spool, into ``ranks`` (tracks made, updated and dropped); the directory's entries.

        Raises SourceError where the directory cannot be read, or is refused (--strict-permissions)."""
        try:
            st = os.fstat(dfd)
        except OSError as e:
            raise SourceError(reasons.IO, f"spool directory {self.directory}: {e.strerror or e}") from e
        self.permissions.start(st)
        try:
            with os.scandir(dfd) as it:
                entries = {e.name: e for e in it}
        except OSError as e:
            raise SourceError(reasons.IO, f"spool directory {self.directory}: {e.strerror or e}") from e
        for name in [name for name in self.bad_files if name not in entries]:
            del self.bad_files[name]
        self._load_manifests(dfd, entries, ranks)
        for track in ranks.values():
            self._load_snapshot(dfd, track, entries)
        return entries

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _report(self, name: str, sig: FileSig | None, err: SpoolError | SourceError) -> None:
        """Count and log a bad file once per version of that file, not once per poll."""
        known = self.bad_files.get(name)
        if known is not None and known[0] == sig and known[1] == err.reason:
            return
        self.bad_files[name] = (sig, err.reason)
        self._problems.add(err.reason, str(err))

    # ------------------------------------------------------------------ manifests

    def _own_socket(self, manifest: Manifest, stem: str, path: str) -> Manifest:
        """``manifest`` as used: the socket it names must be the one the recorder makes for this file's stem,
        or another rank's socket (its pings, FR entries and stacks) would be shown as this rank's."""
        own = spool.socket_name(stem)
        if not manifest.socket or manifest.socket == own:
            return manifest
        self._problems.add(reasons.SOCKET_MISMATCH, f"{path}: names the socket {manifest.socket[:64]!r}, not its "
                                                   f"own {own}; its socket is not used")
        return replace(manifest, socket="")

    def _load_manifests(self, dfd: int, entries: dict[str, os.DirEntry], ranks: dict[str, RankTrack]) -> None:
        seen_stems = set()
        for name, entry in entries.items():
            if (name.startswith(".") or name == spool.EVIDENCE_DIRNAME
                    or name.endswith((spool.SNAPSHOT_SUFFIX, spool.SNAPSHOT_MAP_SUFFIX, spool.SOCKET_SUFFIX))):
                continue
            path = self._path(name)
            if not name.endswith(spool.MANIFEST_SUFFIX):
                # Not a spool file's name: counted once per name, without a syscall (there may be any number).
                if name not in self.bad_files:
                    self._report(name, None, SpoolError(reasons.FOREIGN,
                                                        f"{path}: not a frexporter spool file; ignored"))
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            sig = FileSig.of(st)
            stem = name[: -len(spool.MANIFEST_SUFFIX)]
            seen_stems.add(stem)
            if stat.S_ISLNK(st.st_mode):
                self._report(name, sig, SpoolError(reasons.FOREIGN, f"{path}: a symbolic link; refused"))
                continue
            if not stat.S_ISREG(st.st_mode):
                self._report(name, sig, SpoolError(reasons.FOREIGN, f"{path}: not a regular file; ignored"))
                continue
            self.permissions.note(path, st)
            track = ranks.get(stem)
            if track is not None and track.manifest_sig == sig:
                continue
            known = self.bad_files.get(name)
            if known is not None and known[0] == sig and known[1] != reasons.TOO_MANY_RANKS:
                continue
            if track is None and len(ranks) >= spool.MAX_RANKS_PER_NODE:
                limit = spool.MAX_RANKS_PER_NODE
                self._report(name, sig, SpoolError(reasons.TOO_MANY_RANKS,
                                                   f"{path}: ignored, this exporter already tracks {limit} ranks"))
                continue
            try:
                # What was opened decides, not the lstat above: the name may have been swapped since.
                obj, st = spool.read_json_at(name, spool.MAX_MANIFEST_BYTES, dfd, path)
                sig = FileSig.of(st)
                manifest = spool.parse_manifest(obj, path)
            except SpoolError as e:
                self._report(name, sig, e)
                continue
            self.bad_files.pop(name, None)
            for reason, message in manifest.problems:  # dropped or repaired fields; the rest of the rank stands
                self._problems.add(reason, message)
            manifest = self._own_socket(manifest, stem, path)
            if track is None or track.manifest.pid != manifest.pid or track.manifest.start_time != manifest.start_time:
                if track is not None:
                    self._problems.logs.log(logging.INFO, "restarted", "rank %d of job %s restarted (pid %d -> %d); "
                                            "state reset", manifest.rank, manifest.job_id, track.manifest.pid,
                                            manifest.pid)
                # Until its first snapshot, a rank counts as fresh from when it wrote its manifest: the
                # recorder writes both in one tick, and a rank caught between the two is starting, not wedged.
                born = self._monotonic() - max(0.0, self._clock() - sig.mtime_ns / 1e9)
                ranks[stem] = RankTrack(stem=stem, manifest=manifest, manifest_sig=sig, last_fresh=born)
            else:
                track.manifest = manifest
                track.manifest_sig = sig
        for stem in [stem for stem in ranks if stem not in seen_stems]:
            del ranks[stem]

    # ------------------------------------------------------------------ snapshots

    def _load_snapshot(self, dfd: int, track: RankTrack, entries: dict[str, os.DirEntry]) -> None:
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
        sig: FileSig | None = None
        try:
            if mapped:
                if entry.is_symlink():  # from the directory entry's type: no syscall
                    raise SpoolError(reasons.FOREIGN, f"{path}: a symbolic link; refused")
                key, obj, st = spool.read_snapshot_map_at(name, track.snapshot_map_key, dir_fd=dfd, what=path)
                sig = FileSig.of(st)
                self.permissions.note(path, st)
                if obj is None:
                    return
                track.snapshot_map_key = key
            else:
                st = entry.stat(follow_symlinks=False)
                sig = FileSig.of(st)
                if stat.S_ISLNK(st.st_mode):
                    raise SpoolError(reasons.FOREIGN, f"{path}: a symbolic link; refused")
                self.permissions.note(path, st)
                known = self.bad_files.get(name)
                if sig == track.snapshot_sig or (known is not None and known[0] == sig):
                    return
                obj, st = spool.read_json_at(name, spool.MAX_SNAPSHOT_BYTES, dfd, path)
                sig = FileSig.of(st)
            snap = spool.parse_snapshot(obj, path)
        except SpoolError as e:
            self._report(name, sig or _lstat_sig(entry), e)
            return
        except OSError:
            return  # gone since the scan
        track.snapshot_sig = sig
        self.bad_files.pop(name, None)
        if snap.pid != track.manifest.pid:
            return  # a snapshot of a previous incarnation, or of a rank that restarted before its manifest
        if track.snapshot is None:
            # First sight (e.g. the exporter restarted mid-hang): trust the rank's own timestamp, both
            # processes read the same node clock.
            track.last_fresh = self._monotonic() - max(0.0, self._clock() - snap.time)
        elif snap.counter != track.snapshot.counter:
            track.last_fresh = self._monotonic()
        for reason, message in snap.problems:  # dropped optional fields (stack, cpu); the rest stands
            self._problems.add(reason, message)
        _absorb_cpu(track, snap)
        track.snapshot = snap

    # ------------------------------------------------------------------ sockets

    def socket_usable(self, track: RankTrack, name: str, entry: os.DirEntry | None) -> bool:
        """Whether a rank's socket may be connected to: a socket (not a link to one) owned as the spool's mode
        expects. The connecting thread checks again and verifies the peer; this check refuses a bad socket once
        per version, without a thread or a connection. A missing one is left to the connect (socket_missing)."""
        if not name.endswith(spool.SOCKET_SUFFIX):
            # Not a socket's name (a manifest may name any file in the spool): a fault of this manifest version.
            manifest = track.stem + spool.MANIFEST_SUFFIX
            self._report(manifest, track.manifest_sig, SourceError(
                reasons.SOCKET_UNTRUSTED, f"{self._path(manifest)}: its socket {name[:64]!r} is not named "
                                          f"*{spool.SOCKET_SUFFIX}; not connecting"))
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
            self._report(name, FileSig.of(st), SourceError(reasons.SOCKET_UNTRUSTED,
                                                           f"{path}: {problem}; not connecting"))
            track.socket_alive = False
            return False
        self.bad_files.pop(name, None)
        return self.permissions.socket_allowed(path, st)


def _lstat_sig(entry: os.DirEntry) -> FileSig | None:
    try:
        return FileSig.of(entry.stat(follow_symlinks=False))
    except OSError:
        return None


def _absorb_cpu(track: RankTrack, snap: Snapshot) -> None:
    """CPU use between this snapshot and the last one that carried the process's CPU time."""
    if snap.cpu is None:
        return
    prev = track.cpu_sample
    if prev is not None and snap.time > prev[0] and snap.cpu >= prev[1]:
        track.cpu_percent = round(100.0 * (snap.cpu - prev[1]) / (snap.time - prev[0]), 1)
    elif prev is not None and (snap.time != prev[0] or snap.cpu != prev[1]):
        track.cpu_percent = None  # the clock went back or a new process: start over
    track.cpu_sample = (snap.time, snap.cpu)
