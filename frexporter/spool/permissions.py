"""Who else can plant or read rank files: the checks ``serve`` makes at start and on every poll."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from frexporter.spool.layout import (
    DIR_MODE,
    FILE_MODE,
    GROUP_DIR_MODE,
    GROUP_ENV,
    GROUP_FILE_MODE,
    GROUP_SOCKET_MODE,
    MANIFEST_SUFFIX,
    SNAPSHOT_MAP_SUFFIX,
    SNAPSHOT_SUFFIX,
    SOCKET_SUFFIX,
    group_mode,
)


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
