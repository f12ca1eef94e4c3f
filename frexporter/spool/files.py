"""Writing spool files atomically, and reading them as untrusted input (no link followed, type by fstat)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Mapping
from typing import Any

from frexporter import reasons
from frexporter.spool.layout import FILE_MODE, SpoolError, file_mode


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
        raise SpoolError(reasons.MISSING, f"{shown}: vanished while reading") from e
    except PermissionError as e:
        raise SpoolError(reasons.PERMISSION, f"{shown}: permission denied") from e
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SpoolError(reasons.FOREIGN, f"{shown}: a symbolic link; refused") from e
        raise SpoolError(reasons.IO, f"{shown}: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SpoolError(reasons.FOREIGN, f"{shown}: not a regular file")
        # A second name may be a file from outside the spool linked in. No name at all is the version a writer
        # replaced between our open and this fstat: its content was the spool's, so it is read like any other.
        if st.st_nlink > 1:
            raise SpoolError(reasons.FOREIGN,
                             f"{shown}: has {st.st_nlink} names (a hard link from elsewhere?); refused")
    except OSError as e:
        os.close(fd)
        raise SpoolError(reasons.IO, f"{shown}: {e.strerror or e}") from e
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
            raise SpoolError(reasons.OVERSIZED, f"{shown}: larger than the {max_bytes} byte limit")
        with open(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise SpoolError(reasons.IO, f"{shown}: {e.strerror or e}") from e
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise SpoolError(reasons.OVERSIZED, f"{shown}: larger than the {max_bytes} byte limit")
    return parse_json_bytes(data, shown), st


def parse_json_bytes(data: bytes, path: str) -> Any:
    if not data:
        raise SpoolError(reasons.TRUNCATED, f"{path}: empty file")
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        reason = reasons.TRUNCATED if data.lstrip()[:1] in (b"{", b"[") else reasons.CORRUPT
        raise SpoolError(reason, f"{path}: not valid JSON ({e})") from e
    except RecursionError as e:  # nesting deeper than the interpreter's stack: no writer of ours does that
        raise SpoolError(reasons.CORRUPT, f"{path}: JSON nested too deeply") from e
