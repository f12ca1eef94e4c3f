"""The spool directory: the on-disk contract between the in-rank recorder and the exporter.

One place defines file names, the versioned JSON formats, the size limits and the
validation, so that writer and reader cannot drift. Everything read here comes
from another process and is treated as untrusted: bounded in size, parsed with
``json`` only, every field type-checked.

Per rank (``stem`` = sanitized job id + rank):
  ``<stem>.manifest.json``  identity and process-group table, rewritten when PGs change
  ``<stem>.snapshot.json``  heartbeat + raw ``pg_status``, rewritten every snapshot interval
  ``s<hash>.sock``          torch's C++ worker server (named by hash: unix socket paths are short)
"""

from __future__ import annotations

import array
import bisect
import contextlib
import errno
import functools
import hashlib
import json
import math
import mmap
import os
import re
import stat
import struct
import tempfile
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

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

MAX_MANIFEST_BYTES = 4 * 1024 * 1024
MAX_SNAPSHOT_BYTES = 1024 * 1024
# Ranks one exporter tracks: a node runs a few dozen at most, and anyone who can write the spool could
# otherwise make it parse and keep state for as many manifests as the file system holds.
MAX_RANKS_PER_NODE = 1024
# Bounds on what a file parses into: the byte limits cap a file, not its parsed size (4 MiB of compact JSON
# is 470,000 ranks). A file past a bound is refused whole with one of LIMIT_REASONS, never cut short: a
# member list cut short would give wrong verdicts. The bounds leave room for the largest real jobs.
MAX_PG_MEMBERS = 1 << 17  # members of one PG: the WORLD of a 131,072-rank job
MAX_MANIFEST_MEMBERS = 1 << 19  # members over all PGs of one rank (WORLD and a few more groups that large)
MAX_PGS = 4096  # process groups per rank, and pg_status entries per recorder
MAX_RANK = 2**31 - 1  # torch keeps ranks in C ints
MAX_TEXT_CHARS = 256  # job id, hostname, PG name/desc/backend, versions, GPU UUID, socket, names in lists
MAX_NAMES = 64  # handlers, recorders, backends of a manifest; recorders in a PG's local_ids
MAX_RECORDERS = 8  # recorders in one snapshot (torch keeps two: fr and nccl)
MAX_ERROR_KINDS = 64  # entries of a snapshot's recorder error map
MAX_ERROR_KIND_CHARS = 64  # an error kind is a label value
MAX_MESSAGE_CHARS = 500  # a snapshot's human message: cut there (text for people, identifies nothing)
# For stack sampling, which no file holds yet: frames kept per stack, and characters per frame string
# (function, file name); a stack past them is to be cut, and say so.
MAX_STACK_FRAMES = 256
MAX_FRAME_TEXT_CHARS = 512
# The reasons a file past a bound is refused with (frexporter_source_errors_total{reason}).
LIMIT_MEMBERS = "limit_members"  # a PG's member list, or all member lists of one manifest
LIMIT_ITEMS = "limit_items"  # any other list or map: PGs, pg_status entries, names, error kinds, FR entries
LIMIT_TEXT = "limit_text"  # a string past its length bound
LIMIT_REASONS = (LIMIT_MEMBERS, LIMIT_ITEMS, LIMIT_TEXT)
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

_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")
# torch keeps every counter, id and timestamp in 64 bits; a bigger number is garbage that would overflow
# float() in the outputs, so the parsers refuse it here.
INT_MIN, INT_MAX = -(2**63), 2**63 - 1


class SpoolError(Exception):
    """A spool file could not be used; ``reason`` is a bounded label value."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


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


@dataclass(frozen=True)
class PermissionProblem:
    """One way the spool is more open than the recorder would make it, with the command that fixes it."""

    path: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}; fix: {self.fix}"


MAX_CHECKED_ENTRIES = 10000


@dataclass(frozen=True)
class Trust:
    """Who may own the spool and its sockets, as check_permissions judges it: this user or root in private
    mode; in group mode, one of this process's groups."""

    group: bool
    uid: int
    gids: frozenset[int]

    @staticmethod
    def current(group: bool | None = None, uid: int | None = None, gids: set[int] | None = None) -> Trust:
        return Trust(group=group_mode() if group is None else group, uid=os.getuid() if uid is None else uid,
                     gids=frozenset({os.getgid(), *os.getgroups()} if gids is None else gids))

    def owns(self, st: os.stat_result) -> bool:
        return st.st_gid in self.gids if self.group else st.st_uid in (self.uid, 0)

    def dir_fix(self, directory: str) -> str:
        return f"chmod {GROUP_DIR_MODE:o} {directory}" if self.group else f"chmod {DIR_MODE:o} {directory}"


def check_permissions(directory: str, group: bool | None = None, uid: int | None = None,
                      gids: set[int] | None = None) -> list[PermissionProblem]:
    """What an exporter about to trust ``directory`` should know: who else can plant or read rank files.

    A rank's files decide what the exporter reports, and its socket answers Flight Recorder dumps to
    whoever connects, so the directory must not be writable by others and the files not readable by
    everyone. Private mode wants the directory owned by this user (or root, which provisions it); group
    mode (``group`` defaults to FREXPORTER_SPOOL_GROUP) wants it group-owned by one of this process's groups.
    A missing directory is no problem: the ranks create it.
    """
    trust = Trust.current(group, uid, gids)
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        return []
    except OSError as e:
        return [PermissionProblem(directory, f"cannot be inspected ({e.strerror or e})",
                                  "give this user search permission on the directory and its parents")]
    if not stat.S_ISDIR(st.st_mode):
        return [PermissionProblem(directory, "is not a directory", "remove it, or point --dir at a directory")]
    return directory_problems(directory, st, trust) + _check_entries(directory, want_group=trust.group)


def directory_problems(directory: str, st: os.stat_result, trust: Trust) -> list[PermissionProblem]:
    """check_permissions' verdict on the directory itself, from a stat of it: the exporter re-checks an fstat
    of its open directory every poll."""
    problems = []
    mode = stat.S_IMODE(st.st_mode)
    want = trust.dir_fix(directory)
    if not trust.owns(st):
        if trust.group:
            problems.append(PermissionProblem(
                directory, f"group-mode spool belongs to group {st.st_gid}, which this process is not in",
                f"chgrp GROUP {directory} (the pods' fsGroup), or run the exporter with that group "
                "(supplementalGroups)"))
        else:
            problems.append(PermissionProblem(
                directory, f"owned by uid {st.st_uid}, not by this user (uid {trust.uid}) or root",
                f"chown {trust.uid} {directory}, run the exporter as uid {st.st_uid}, or share it by group "
                f"({GROUP_ENV}=1 on both sides)"))
    if mode & stat.S_IWOTH:
        problems.append(PermissionProblem(
            directory, f"world-writable (mode {mode:o}): any local user can plant a fake rank or replace a socket",
            want))
    elif mode & stat.S_IWGRP and not trust.group:
        problems.append(PermissionProblem(
            directory, f"group-writable (mode {mode:o}) in private mode: the group can plant a fake rank",
            f"{want}, or set {GROUP_ENV}=1 on the ranks and the exporter to share it by group on purpose"))
    return problems


def writable_by_anyone(path: str, st: os.stat_result) -> PermissionProblem | None:
    """A rank file or socket every local user may change (or, for a socket, connect to), from a stat the
    exporter makes anyway when it uses the file."""
    mode = stat.S_IMODE(st.st_mode)
    if not mode & stat.S_IWOTH:
        return None
    if stat.S_ISSOCK(st.st_mode):
        return PermissionProblem(path, f"a socket writable by every local user (mode {mode:o}): anyone can "
                                       "connect and read the rank's Flight Recorder dumps", f"chmod o-rwx {path}")
    return PermissionProblem(path, f"writable by every local user (mode {mode:o}): anyone can change what this "
                                   "rank reports", f"chmod o-rwx {path}")


def socket_problem(st: os.stat_result, trust: Trust) -> str | None:
    """Why a spool entry (an lstat of it) must not be connected to, or None: only a socket itself (never a
    link to one, nor a hard link that may be another service's) whose owner the spool's mode trusts."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link, not a socket"
    if not stat.S_ISSOCK(st.st_mode):
        return "not a socket"
    if st.st_nlink != 1:
        return f"a socket with {st.st_nlink} hard links (may be another service's)"
    if not trust.owns(st):
        if trust.group:
            return f"a socket of group {st.st_gid}, which this process is not in"
        return f"a socket owned by uid {st.st_uid}, not by this user (uid {trust.uid}) or root"
    return None


def _check_entries(directory: str, want_group: bool) -> list[PermissionProblem]:
    exposed: list[str] = []
    try:
        with os.scandir(directory) as entries:
            for i, entry in enumerate(entries):
                if i >= MAX_CHECKED_ENTRIES:
                    break
                if not entry.name.endswith((MANIFEST_SUFFIX, SNAPSHOT_SUFFIX, SNAPSHOT_MAP_SUFFIX, SOCKET_SUFFIX)):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # a rank replaced it meanwhile
                if (stat.S_ISREG(st.st_mode) or stat.S_ISSOCK(st.st_mode)) and st.st_mode & stat.S_IRWXO:
                    exposed.append(entry.name)
    except OSError:
        return []  # unreadable: the ranks source reports that as its own error
    if not exposed:
        return []
    modes = f"{GROUP_FILE_MODE:o} (sockets {GROUP_SOCKET_MODE:o})" if want_group else f"{FILE_MODE:o}"
    example = os.path.join(directory, sorted(exposed)[0])
    more = f" and {len(exposed) - 1} more" if len(exposed) > 1 else ""
    return [PermissionProblem(
        example + more, "open to every local user: rank files and sockets (Flight Recorder dumps) leak to anyone",
        f"chmod o-rwx {directory}/*; the recorder creates them {modes}")]


def _open_temp(path: str, access: int) -> tuple[int, str]:
    """A new private file next to ``path``, to be renamed onto it: (fd, its name).

    The name is fixed per target and process (no spool suffix: the exporter skips it); O_EXCL and
    O_NOFOLLOW still refuse a file or link someone else planted there. fchmod only in group mode, where
    a umask could strip the group bit.
    """
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".tmp-{name}.{os.getpid()}")
    mode = file_mode()
    flags = access | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(tmp, flags, mode)
    except FileExistsError:
        # Left by a write this process did not finish (an exception between open and rename), or planted.
        os.unlink(tmp)
        fd = os.open(tmp, flags, mode)
    if mode != FILE_MODE:
        try:
            os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
    return fd, tmp


def write_json_atomic(path: str, payload: Mapping[str, Any]) -> None:
    """Write-then-rename so a reader never sees a half-written file; mode 0600 (0640 in group mode).

    Every syscall here releases the GIL, and on a rank whose training thread wants the GIL back each one
    costs a hand-off; so this makes as few as it can: open, write, close, rename.
    """
    data = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()
    fd, tmp = _open_temp(path, os.O_WRONLY)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)


def open_regular(name: str, dir_fd: int | None = None, what: str | None = None) -> tuple[int, os.stat_result]:
    """A descriptor of the regular file ``name`` (relative to ``dir_fd`` when given) and its fstat.

    Everything in the spool can be replaced by whoever may write it, between any check and any use: the file
    is judged by what was opened, never by an earlier lstat of its name. O_NOFOLLOW refuses a link (to a file
    elsewhere, readable by the exporter's user but not by the planter); O_NONBLOCK keeps a planted FIFO from
    blocking the poll in open(); the fstat refuses anything but a regular file, and a file with a second name
    (a hard link can make a file from outside the spool appear in it).
    """
    shown = what or name
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError as e:
        raise SpoolError("missing", f"{shown}: vanished while reading") from e
    except PermissionError as e:
        raise SpoolError("permission", f"{shown}: permission denied") from e
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SpoolError("foreign", f"{shown}: a symbolic link; refused") from e
        raise SpoolError("io", f"{shown}: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SpoolError("foreign", f"{shown}: not a regular file")
        if st.st_nlink != 1:
            raise SpoolError("foreign", f"{shown}: has {st.st_nlink} names (a hard link from elsewhere?); refused")
    except OSError as e:
        os.close(fd)
        raise SpoolError("io", f"{shown}: {e.strerror or e}") from e
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_json_file(path: str, max_bytes: int) -> Any:
    """Read a bounded JSON file, mapping every failure to a SpoolError with a reason."""
    return read_json_at(path, max_bytes)[0]


def read_json_at(name: str, max_bytes: int, dir_fd: int | None = None,
                 what: str | None = None) -> tuple[Any, os.stat_result]:
    """``read_json_file`` of ``name`` relative to ``dir_fd``, and the fstat of the file that was read."""
    shown = what or name
    fd, st = open_regular(name, dir_fd, shown)
    try:
        if st.st_size > max_bytes:
            raise SpoolError("oversized", f"{shown}: larger than the {max_bytes} byte limit")
        with open(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise SpoolError("io", f"{shown}: {e.strerror or e}") from e
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise SpoolError("oversized", f"{shown}: larger than the {max_bytes} byte limit")
    return parse_json_bytes(data, shown), st


def parse_json_bytes(data: bytes, path: str) -> Any:
    if not data:
        raise SpoolError("truncated", f"{path}: empty file")
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        reason = "truncated" if data.lstrip()[:1] in (b"{", b"[") else "corrupt"
        raise SpoolError(reason, f"{path}: not valid JSON ({e})") from e
    except RecursionError as e:  # nesting deeper than the interpreter's stack: no writer of ours does that
        raise SpoolError("corrupt", f"{path}: JSON nested too deeply") from e


# ---------------------------------------------------------------- the mapped snapshot
#
# Layout (little-endian): magic (8 bytes), sequence (u64, odd while the writer is inside an update),
# payload length (u32), CRC-32 of the payload (u32), then the payload (JSON) in a preallocated area. A reader
# retries while the sequence is odd or the CRC does not match (a torn read: the writer is mid-update, or
# its stores became visible out of order on a weakly ordered CPU).

_MAP_MAGIC = b"FRXSNAP\x02"
_MAP_MAGIC_PREFIX = _MAP_MAGIC[:7]
_MAP_HEADER = struct.Struct("<8sQII")
_MAP_SEQ = struct.Struct("<Q")
_MAP_LENGTH_CRC = struct.Struct("<II")
MAP_HEADER_BYTES = _MAP_HEADER.size
MAP_INITIAL_CAPACITY = 64 * 1024
_MAP_READ_ATTEMPTS = 5


class SnapshotMap:
    """The recorder's snapshot file, updated in place through a shared mapping.

    A per-snapshot file write costs four syscalls, and each syscall hands the GIL to the training thread
    and back (tens of microseconds apiece on a busy VM); an update of the mapping is a memory copy under
    one short hold of the GIL. The file is created full size (zeros written, not a sparse file), so
    updates never fault in new blocks: no ENOSPC and no SIGBUS once it exists.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._mm: mmap.mmap | None = None
        self._seq = 0
        self._ino = -1
        self._update: Callable[[bytes], bool] = _no_mapping

    def write(self, payload: bytes) -> None:
        if not self._update(payload):
            self._grow(payload)

    def updater(self) -> Callable[[bytes], bool]:
        """The in-place update of the current mapping as one function with its constants bound, for a caller
        that updates once a second from cold caches (where every lookup and call costs microseconds).
        ``update(payload)`` writes nothing and is False when the payload does not fit or the mapping has been
        closed or replaced since: ``write`` then makes the file anew, and a new updater is due."""
        return self._update

    def _bind(self, mm: mmap.mmap) -> Callable[[bytes], bool]:
        capacity = len(mm) - MAP_HEADER_BYTES
        start = MAP_HEADER_BYTES
        pack_seq, pack_length_crc, crc32 = _MAP_SEQ.pack_into, _MAP_LENGTH_CRC.pack_into, zlib.crc32

        def update(payload: bytes) -> bool:
            size = len(payload)
            if size > capacity or self._mm is not mm:
                return False
            # An odd sequence marks the update in progress. Each field is stored on its own, in this order:
            # struct.pack_into zeroes its whole span before it fills it in, and a zeroed sequence reads as
            # even, so the length and checksum must never be zeroed while the sequence is.
            seq = self._seq + 1
            pack_seq(mm, 8, seq)
            pack_length_crc(mm, 16, size, crc32(payload))
            mm[start:start + size] = payload
            self._seq = seq = seq + 1
            pack_seq(mm, 8, seq)
            return True

        return update

    def _grow(self, payload: bytes) -> None:
        need = MAP_HEADER_BYTES + len(payload)
        if need > MAX_SNAPSHOT_BYTES + MAP_HEADER_BYTES:
            raise SpoolError("oversized", f"{self.path}: snapshot of {len(payload)} bytes is over the limit")
        size = MAP_INITIAL_CAPACITY
        while size < need:
            size *= 2
        self._create(min(size, MAX_SNAPSHOT_BYTES + MAP_HEADER_BYTES), payload)

    def gone(self) -> bool:
        """True when the file is no longer ours to update: removed, or replaced (a syscall: call it seldom)."""
        if self._mm is None:
            return False
        try:
            return os.stat(self.path).st_ino != self._ino
        except OSError:
            return True

    def close(self) -> None:
        self._update = _no_mapping
        if self._mm is not None:
            with contextlib.suppress(Exception):
                self._mm.close()
            self._mm = None

    def _create(self, size: int, payload: bytes) -> None:
        """A new file, full size, that appears under its name with ``payload`` already in it."""
        fd, tmp = _open_temp(self.path, os.O_RDWR)
        try:
            try:
                zeros = memoryview(bytes(size))
                while zeros:  # real blocks, so that later updates cannot fail for want of space
                    zeros = zeros[os.write(fd, zeros):]
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                ino = os.fstat(fd).st_ino
            finally:
                os.close(fd)
            self._seq += 2  # even: a complete snapshot from the start
            _MAP_HEADER.pack_into(mm, 0, _MAP_MAGIC, self._seq, len(payload), zlib.crc32(payload))
            mm[MAP_HEADER_BYTES:MAP_HEADER_BYTES + len(payload)] = payload
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.close()
        self._mm, self._ino = mm, ino
        self._update = self._bind(mm)


def _no_mapping(payload: bytes) -> bool:
    return False


def read_snapshot_map(path: str, max_bytes: int = MAX_SNAPSHOT_BYTES) -> Any:
    """The JSON object in a mapped snapshot file, read consistently; every failure is a SpoolError."""
    return read_snapshot_map_if_new(path, None, max_bytes)[1]


def read_snapshot_map_if_new(path: str, known: tuple[int, int] | None,
                             max_bytes: int = MAX_SNAPSHOT_BYTES) -> tuple[tuple[int, int], Any]:
    """``((inode, sequence), object)``; the object is None when ``known`` is still the file's key (nothing
    new since: the exporter polls faster than ranks snapshot, and parsing is the costly part)."""
    key, obj, _ = read_snapshot_map_at(path, known, max_bytes)
    return key, obj


def read_snapshot_map_at(name: str, known: tuple[int, int] | None, max_bytes: int = MAX_SNAPSHOT_BYTES,
                         dir_fd: int | None = None, what: str | None = None
                         ) -> tuple[tuple[int, int], Any, os.stat_result]:
    """``read_snapshot_map_if_new`` of ``name`` relative to ``dir_fd``, plus the fstat of the file read (the
    exporter checks its mode on that, at no extra syscall)."""
    path = what or name
    fd, st = open_regular(name, dir_fd, path)
    try:
        if st.st_size > max_bytes + MAP_HEADER_BYTES:
            raise SpoolError("oversized", f"{path}: larger than the {max_bytes} byte limit")
        problem: SpoolError | None = None
        for _ in range(_MAP_READ_ATTEMPTS):
            # The header first: most polls find nothing new, and the file is far larger than its payload.
            head = os.pread(fd, MAP_HEADER_BYTES, 0)
            length = 0
            if len(head) == MAP_HEADER_BYTES and head[:8] == _MAP_MAGIC:
                seq = _MAP_SEQ.unpack_from(head, 8)[0]
                if known == (st.st_ino, seq) and seq % 2 == 0:
                    return known, None, st
                length = _MAP_LENGTH_CRC.unpack_from(head, 16)[0]
            data = os.pread(fd, min(st.st_size, MAP_HEADER_BYTES + length), 0)
            payload, problem = _map_payload(data, path, st.st_size)
            if payload is not None:
                key = (st.st_ino, _MAP_SEQ.unpack_from(data, 8)[0])
                return key, (None if key == known else parse_json_bytes(payload, path)), st
        assert problem is not None
        raise SpoolError(problem.reason, f"{problem} ({_MAP_READ_ATTEMPTS} reads in a row)")
    except OSError as e:
        raise SpoolError("io", f"{path}: {e.strerror or e}") from e
    finally:
        os.close(fd)


def _map_payload(data: bytes, path: str, file_size: int) -> tuple[bytes | None, SpoolError | None]:
    """The payload, or None and what is wrong with this read (the caller reads again: the header's fields are
    stored a byte at a time, so a read that races the writer can see any mix of old and new values)."""
    if len(data) < MAP_HEADER_BYTES:
        raise SpoolError("truncated", f"{path}: shorter than its header")
    magic, seq, length, crc = _MAP_HEADER.unpack_from(data)
    if magic != _MAP_MAGIC:
        if magic[:7] == _MAP_MAGIC_PREFIX:
            raise SpoolError("unknown_version", f"{path}: mapped snapshot version {magic[7]} is not supported")
        raise SpoolError("foreign", f"{path}: not a frexporter snapshot")
    if seq % 2:
        return None, SpoolError("torn", f"{path}: its writer stopped inside an update")
    if not length:  # never written by an update: a read that raced one (pack_into zeroes a field first)
        return None, SpoolError("torn", f"{path}: empty payload")
    end = MAP_HEADER_BYTES + length
    if end > len(data):
        if end <= file_size:  # the length grew between the header's read and this one: a race, not damage
            return None, SpoolError("torn", f"{path}: changed while it was read")
        return None, SpoolError("truncated", f"{path}: payload of {length} bytes runs past the end of the file")
    payload = data[MAP_HEADER_BYTES:end]
    if zlib.crc32(payload) != crc:
        return None, SpoolError("torn", f"{path}: payload does not match its checksum")
    return payload, None


# ---------------------------------------------------------------- typed views


@functools.total_ordering
class Members(Sequence[int]):
    """A PG's member ranks, sorted and distinct, at 4 bytes each, and one object per distinct member list.

    A tuple of Python ints costs 40 bytes a member: 20 ranks that each list a 131,072-rank WORLD would hold
    100 MB. Here the ranks are packed in one immutable buffer, and ``of`` hands out the object already made
    for the same list, so the ranks of one job share their WORLD. Equal to, and hashed like, the tuple of
    its ranks, so analysis code and tests may mix both.
    """

    __slots__ = ("__weakref__", "_data", "_hash", "_view")

    def __init__(self, data: bytes) -> None:
        self._data = data  # native C ints, sorted ascending, distinct
        self._view = memoryview(data).cast("i")
        self._hash: int | None = None

    _interned: weakref.WeakValueDictionary[bytes, Members] = weakref.WeakValueDictionary()

    @classmethod
    def of(cls, ranks: Iterable[int]) -> Members:
        """Sorted distinct ``ranks`` (each in 0..MAX_RANK); OverflowError or TypeError otherwise."""
        packed = array.array("i", sorted(set(ranks)))
        if packed and packed[0] < 0:
            raise OverflowError("negative rank")
        data = packed.tobytes()
        found = cls._interned.get(data)
        if found is None:
            found = cls._interned.setdefault(data, cls(data))
        return found

    def __len__(self) -> int:
        return len(self._view)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...

    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        if isinstance(index, slice):
            return tuple(self._view[index])
        return self._view[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._view)

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, int):
            return False
        i = bisect.bisect_left(self._view, value)
        return i < len(self._view) and self._view[i] == value

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(tuple(self._view))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Members):
            return self._data == other._data
        if isinstance(other, tuple):
            return len(other) == len(self._view) and tuple(self._view) == other
        return NotImplemented

    def __lt__(self, other: object) -> bool:
        if isinstance(other, Members):  # arrays compare by value, without a Python int per rank
            return array.array("i", self._data) < array.array("i", other._data)
        if isinstance(other, tuple):
            return tuple(self._view) < other
        return NotImplemented

    def __repr__(self) -> str:
        head = ", ".join(map(str, self._view[:8]))
        return f"Members([{head}{', ...' if len(self._view) > 8 else ''}], n={len(self._view)})"

    def __reduce__(self) -> tuple[Any, ...]:
        return Members, (self._data,)



@dataclass(frozen=True)
class PGEntry:
    """One process group as the rank sees it; ``name`` + ``ranks`` is the cross-rank identity."""

    name: str
    desc: str
    ranks: Members | tuple[int, ...]
    backend: str
    local_ids: Mapping[str, int] = field(default_factory=dict)  # recorder -> predicted local pg id
    timeout_seconds: float | None = None


@dataclass(frozen=True)
class Manifest:
    job_id: str
    rank: int
    local_rank: int
    world_size: int
    pid: int
    hostname: str
    start_time: float
    torch_version: str
    backends: tuple[str, ...]
    gpu_uuid: str
    socket: str  # file name inside the spool directory, "" when the worker server is off
    handlers: tuple[str, ...]
    recorders: tuple[str, ...]
    fr_buffer_size: int
    process_groups: tuple[PGEntry, ...]
    generation: int


@dataclass(frozen=True)
class RawPGStatus:
    """``pg_status`` of one local pg id, in torch's own (mixed) sequence domain."""

    enqueued: int
    started: int
    completed: int


@dataclass(frozen=True)
class Snapshot:
    pid: int
    time: float
    interval: float
    counter: int
    status: Mapping[str, Mapping[int, RawPGStatus]]  # recorder -> local pg id -> status
    errors: Mapping[str, int]
    state: str  # "running", "exiting", "stopped"
    message: str


class _Fields:
    """Typed access to an untrusted JSON object; every miss is a SpoolError('invalid'), every string and
    list past its bound a SpoolError with a LIMIT_REASONS reason."""

    def __init__(self, obj: Any, what: str) -> None:
        if not isinstance(obj, dict):
            raise SpoolError("invalid", f"{what}: expected an object, got {type(obj).__name__}")
        self.obj = obj
        self.what = what

    def _get(self, key: str, types: tuple[type, ...], default: Any) -> Any:
        if key not in self.obj:
            if default is _REQUIRED:
                raise SpoolError("invalid", f"{self.what}: missing field {key!r}")
            return default
        value = self.obj[key]
        # bool is an int subclass; a manifest that says rank=true is malformed.
        if isinstance(value, bool) and bool not in types:
            raise SpoolError("invalid", f"{self.what}: field {key!r} has the wrong type")
        if not isinstance(value, types):
            raise SpoolError("invalid", f"{self.what}: field {key!r} has the wrong type")
        return value

    def str(self, key: str, default: Any = None, limit: int = MAX_TEXT_CHARS) -> str:
        return _bounded_text(self._get(key, (str,), _REQUIRED if default is None else default), limit,
                             f"{self.what}: field {key!r}")

    def int(self, key: str, default: Any = None) -> int:
        value = self._get(key, (int,), _REQUIRED if default is None else default)
        if not INT_MIN <= value <= INT_MAX:
            raise SpoolError("invalid", f"{self.what}: field {key!r} is out of range")
        return value

    def num(self, key: str, default: Any = None) -> float:
        value = _finite(self._get(key, (int, float), _REQUIRED if default is None else default))
        if value is None:
            raise SpoolError("invalid", f"{self.what}: field {key!r} is not a finite number")
        return value

    def list(self, key: str, default: Any = None, limit: int | None = None) -> list[Any]:
        value = self._get(key, (list,), _REQUIRED if default is None else default)
        if limit is not None and len(value) > limit:
            raise SpoolError(LIMIT_ITEMS, f"{self.what}: field {key!r} has {len(value)} items, over the "
                                          f"bound of {limit}")
        return value

    def dict(self, key: str, default: Any = None, limit: int | None = None) -> dict[str, Any]:
        value = self._get(key, (dict,), _REQUIRED if default is None else default)
        if limit is not None and len(value) > limit:
            raise SpoolError(LIMIT_ITEMS, f"{self.what}: field {key!r} has {len(value)} entries, over the "
                                          f"bound of {limit}")
        return value

    def names(self, key: str) -> tuple[str, ...]:
        """A list of short strings (handlers, recorders, backends)."""
        out = []
        for i, name in enumerate(self.list(key, [], limit=MAX_NAMES)):
            if not isinstance(name, str):
                raise SpoolError("invalid", f"{self.what}: {key}[{i}] is not a string")
            out.append(_bounded_text(name, MAX_TEXT_CHARS, f"{self.what}: {key}[{i}]"))
        return tuple(out)


def _bounded_text(value: str, limit: int, what: str) -> str:
    if len(value) > limit:
        raise SpoolError(LIMIT_TEXT, f"{what} is {len(value)} characters long, over the bound of {limit}")
    return value


_REQUIRED = object()


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or None (JSON admits NaN, Infinity and ints too big for a float)."""
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return out if math.isfinite(out) else None


def _show(value: Any) -> str:
    """A key of untrusted data for a message: repr() of a pickled bignum raises, of a container can be huge."""
    if isinstance(value, str):
        return repr(value[:64])
    if isinstance(value, int) and INT_MIN <= value <= INT_MAX:
        return repr(value)
    return f"<{type(value).__name__}>"


def _int64(value: Any) -> int:
    """A counter of torch's (an int, or a string of one in JSON dumps) that fits in 64 bits."""
    out = int(value)
    if not INT_MIN <= out <= INT_MAX:
        raise ValueError("out of the 64-bit range")
    return out


def _check_format(obj: Any, expected: str, what: str) -> None:
    fmt = obj.get("format") if isinstance(obj, dict) else None
    if not isinstance(fmt, str) or not fmt.startswith("frexporter."):
        raise SpoolError("foreign", f"{what}: not a frexporter file")
    if fmt != expected:
        raise SpoolError("unknown_version", f"{what}: format {fmt[:64]!r} is not supported (want {expected!r})")


def parse_manifest(obj: Any, what: str = "manifest") -> Manifest:
    _check_format(obj, MANIFEST_FORMAT, what)
    f = _Fields(obj, what)
    raw_pgs = f.list("process_groups", [], limit=MAX_PGS)
    total = 0
    for i, raw in enumerate(raw_pgs):
        # Counted before any list is parsed: a file over the bound costs no more than reading it.
        ranks = raw.get("ranks") if isinstance(raw, dict) else None
        if isinstance(ranks, list):
            if len(ranks) > MAX_PG_MEMBERS:
                raise SpoolError(LIMIT_MEMBERS, f"{what}: process_groups[{i}] lists {len(ranks)} members, "
                                                f"over the bound of {MAX_PG_MEMBERS}")
            total += len(ranks)
    if total > MAX_MANIFEST_MEMBERS:
        raise SpoolError(LIMIT_MEMBERS, f"{what}: its process groups list {total} members in all, over the "
                                        f"bound of {MAX_MANIFEST_MEMBERS}")
    pgs = [_parse_pg(raw, f"{what}: process_groups[{i}]") for i, raw in enumerate(raw_pgs)]
    rank = f.int("rank")
    if rank < 0:
        raise SpoolError("invalid", f"{what}: rank must be >= 0")
    return Manifest(
        job_id=f.str("job_id"),
        rank=rank,
        local_rank=f.int("local_rank", -1),
        world_size=f.int("world_size", 0),
        pid=f.int("pid"),
        hostname=f.str("hostname", ""),
        start_time=f.num("start_time", 0.0),
        torch_version=f.str("torch_version", ""),
        backends=f.names("backends"),
        gpu_uuid=f.str("gpu_uuid", ""),
        socket=os.path.basename(f.str("socket", "")),
        handlers=f.names("handlers"),
        recorders=f.names("recorders"),
        fr_buffer_size=f.int("fr_buffer_size", 0),
        process_groups=tuple(pgs),
        generation=f.int("generation", 0),
    )


def _parse_pg(raw: Any, what: str) -> PGEntry:
    p = _Fields(raw, what)
    ranks = p.list("ranks")
    # type() rather than isinstance(): bool is an int subclass, and rank true is no rank.
    if not set(map(type, ranks)) <= {int}:
        raise SpoolError("invalid", f"{what}.ranks must be non-negative integers")
    try:
        members = Members.of(ranks)
    except OverflowError as e:
        raise SpoolError("invalid", f"{what}.ranks must be integers from 0 to {MAX_RANK}") from e
    local_ids = {}
    for k, v in p.dict("local_ids", {}, limit=MAX_NAMES).items():
        if isinstance(v, int) and not isinstance(v, bool):
            local_ids[_bounded_text(k, MAX_TEXT_CHARS, f"{what}.local_ids key")] = v
    raw_timeout = p.obj.get("timeout_seconds")
    timeout = _finite(raw_timeout) if isinstance(raw_timeout, (int, float)) else None
    return PGEntry(
        name=p.str("name"),
        desc=p.str("desc", ""),
        ranks=members,
        backend=p.str("backend", ""),
        local_ids=local_ids,
        timeout_seconds=timeout if timeout is not None and timeout > 0 else None,
    )


def parse_pg_status(raw: Any, what: str) -> dict[int, RawPGStatus]:
    """torch's ``pg_status``: ints in pickle dumps, strings in JSON dumps; accept both."""
    if not isinstance(raw, dict):
        raise SpoolError("invalid", f"{what}: pg_status must be an object")
    if len(raw) > MAX_PGS:
        raise SpoolError(LIMIT_ITEMS, f"{what}: pg_status has {len(raw)} entries, over the bound of {MAX_PGS}")
    out: dict[int, RawPGStatus] = {}
    for key, val in raw.items():
        try:
            pg_id = _int64(key)
            if not isinstance(val, dict):
                raise TypeError
            out[pg_id] = RawPGStatus(
                enqueued=_int64(val.get("last_enqueued_collective", -1)),
                started=_int64(val.get("last_started_collective", -1)),
                completed=_int64(val.get("last_completed_collective", -1)),
            )
        except (TypeError, ValueError, OverflowError) as e:
            raise SpoolError("invalid", f"{what}: pg_status[{_show(key)}] is malformed") from e
    return out


def parse_snapshot(obj: Any, what: str = "snapshot") -> Snapshot:
    fmt = obj.get("format") if isinstance(obj, dict) else None
    mapped = fmt == SNAPSHOT_MAP_FORMAT
    _check_format(obj, SNAPSHOT_MAP_FORMAT if mapped else SNAPSHOT_FORMAT, what)
    f = _Fields(obj, what)
    status = {}
    for recorder, raw in f.dict("status", {}, limit=MAX_RECORDERS).items():
        _bounded_text(recorder, MAX_TEXT_CHARS, f"{what}: recorder name")
        if mapped:  # torch's whole answer; its pg_status is what we use
            raw = _Fields(raw, f"{what}: status.{recorder}").dict("pg_status", {})
        status[recorder] = parse_pg_status(raw, f"{what}: status.{recorder}")
    errors = {}
    for kind, count in f.dict("errors", {}, limit=MAX_ERROR_KINDS).items():
        # A label value: cutting it could merge two kinds.
        _bounded_text(kind, MAX_ERROR_KIND_CHARS, f"{what}: error kind")
        if isinstance(count, int) and not isinstance(count, bool) and 0 <= count <= INT_MAX:
            errors[kind] = count
    return Snapshot(
        pid=f.int("pid"),
        time=f.num("time"),
        interval=max(0.05, f.num("interval", 1.0)),
        counter=f.int("counter", 0),
        status=status,
        errors=errors,
        state=f.str("state", "running"),
        message=f.str("message", "", limit=MAX_SNAPSHOT_BYTES)[:MAX_MESSAGE_CHARS],
    )
