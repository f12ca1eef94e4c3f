"""The evidence directory and the files of a bundle, trusting no path in them.

The default evidence directory sits in the spool, which the ranks (other users in group mode) can write, so
nothing here trusts a path: the directory is opened without following a symlink and must belong to this user
(or root), every file is created relative to a directory descriptor with ``O_EXCL | O_NOFOLLOW`` inside a
freshly made bundle with an unguessable name, and a bundle counts as this exporter's only when its
``verdict.json`` carries this exporter's HMAC of the bundle's name.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Iterator

from frexporter import reasons, spool
from frexporter.errors import FrexporterError

VERDICT_FILE = "verdict.json"
MAX_VERDICT_FILE_BYTES = 1024 * 1024
# The per-directory secret that marks bundles as ours (0600, made by the exporter). A dot name: the listing,
# `frexporter analyze` and the ranks source all pass over it.
KEY_FILE = ".frexporter-key"
KEY_BYTES = 32
# Inside an evidence directory others may write: where this user's bundles go, +uid.
PRIVATE_PREFIX = "frexporter-"
MARKER_FIELD = "bundle"  # verdict.json: {"name": <bundle name>, "mac": HMAC-SHA256(key, name)}

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
# O_NONBLOCK: a FIFO planted under a file name must not block open(); fstat then refuses it.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC


class EvidenceRefused(FrexporterError):
    """The evidence directory (or something in it) is not safe to use; ``reason`` is a bounded label value."""



def _open_leaf(parent_fd: int, leaf: str, what: str, create: bool) -> tuple[int, bool]:
    """(descriptor, made now) of directory ``leaf`` under ``parent_fd``, never through a symlink."""
    made = False
    if create:
        try:
            os.mkdir(leaf, spool.DIR_MODE, dir_fd=parent_fd)
            made = True
        except FileExistsError:
            pass
    try:
        fd = os.open(leaf, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        if stat.S_ISLNK(os.stat(leaf, dir_fd=parent_fd, follow_symlinks=False).st_mode):
            raise EvidenceRefused(reasons.SYMLINK, f"{what}: a symbolic link; refused") from e
        raise EvidenceRefused(reasons.NOT_A_DIRECTORY, f"{what}: not a directory") from e
    try:
        st = os.fstat(fd)
        # Root may have provisioned it (a Kubernetes emptyDir, /var/lib/...): only root can make a root-owned
        # directory, and root is trusted anyway. Anyone else's is theirs to swap out under us, and so is one
        # that replaced ours between mkdir and open.
        if st.st_uid != os.geteuid() and (made or st.st_uid != 0):
            raise EvidenceRefused(reasons.FOREIGN_OWNER, f"{what}: owned by uid {st.st_uid}, not by this user "
                                                         f"(uid {os.geteuid()}) or root")
        if made:
            os.fchmod(fd, spool.DIR_MODE)  # mkdir applied the umask
    except BaseException:
        os.close(fd)
        raise
    return fd, made


def open_configured(directory: str, create: bool) -> tuple[int, bool]:
    parent, leaf = os.path.split(os.path.abspath(directory))
    if not leaf:
        raise EvidenceRefused(reasons.NOT_A_DIRECTORY, f"{directory}: not a usable evidence directory")
    if create:
        os.makedirs(parent, mode=spool.DIR_MODE, exist_ok=True)
    parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    try:
        return _open_leaf(parent_fd, leaf, directory, create)
    finally:
        os.close(parent_fd)


def private_name() -> str:
    return f"{PRIVATE_PREFIX}{os.geteuid()}"


def open_evidence_dir(directory: str, create: bool = True) -> tuple[int, str]:
    """(descriptor, path) of the directory bundles go to; raises EvidenceRefused or OSError.

    Only the last component of ``directory`` is checked: its parent is the spool or a directory an administrator
    named. That component must be a directory, not a symlink, owned by this user or root. If it already existed
    writable by others (a Kubernetes emptyDir is 0777 or 2777; an older exporter made ``<spool>/evidence`` 2770
    in group mode), bundles go to a private ``frexporter-<uid>`` directory made inside it: nothing is written
    straight into a directory others can write, and no mode this exporter did not set is changed.
    """
    fd, made = open_configured(directory, create)
    if made or not os.fstat(fd).st_mode & 0o022:
        return fd, directory
    private = os.path.join(directory, private_name())
    try:
        sub, made = _open_leaf(fd, os.path.basename(private), private, create)
    finally:
        os.close(fd)
    st = os.fstat(sub)
    if not made and (st.st_uid != os.geteuid() or st.st_mode & 0o077):
        os.close(sub)
        raise EvidenceRefused(reasons.FOREIGN_OWNER if st.st_uid != os.geteuid() else reasons.WRITABLE_BY_OTHERS,
                              f"{private}: not a private directory of this user (uid {st.st_uid}, mode "
                              f"{stat.S_IMODE(st.st_mode):o})")
    return sub, private


def bundle_key(dir_fd: int, directory: str) -> bytes:
    """The directory's bundle key, made on first use: a private regular file of ours, KEY_BYTES long."""
    try:
        fd = os.open(KEY_FILE, _CREATE_FLAGS, spool.FILE_MODE, dir_fd=dir_fd)
    except FileExistsError:
        pass
    else:
        try:
            os.write(fd, secrets.token_bytes(KEY_BYTES))
        finally:
            os.close(fd)
    what = os.path.join(directory, KEY_FILE)
    try:
        fd = os.open(KEY_FILE, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise EvidenceRefused(reasons.SYMLINK, f"{what}: a symbolic link; refused") from e
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise EvidenceRefused(reasons.FOREIGN_OWNER, f"{what}: owned by uid {st.st_uid}, not by this user")
        if (not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_mode & 0o077
                or st.st_size != KEY_BYTES):
            raise EvidenceRefused(reasons.UNSAFE_KEY, f"{what}: not a private {KEY_BYTES}-byte file of this "
                                                      "exporter; remove it and the next capture makes a new one")
        data = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != KEY_BYTES:
        raise EvidenceRefused(reasons.UNSAFE_KEY, f"{what}: short read")
    return data


def mac(key: bytes, name: str) -> str:
    return hmac.new(key, b"frexporter-evidence-bundle\0" + name.encode(), hashlib.sha256).hexdigest()


def write_at(dir_fd: int, name: str, data: bytes | bytearray) -> None:
    # O_EXCL: a name planted in the bundle (a symlink to a file elsewhere) fails here instead of being followed.
    fd = os.open(name, _CREATE_FLAGS, spool.FILE_MODE, dir_fd=dir_fd)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def read_at(dir_fd: int, name: str, max_bytes: int, what: str) -> tuple[os.stat_result, bytes]:
    """A regular file's status and (bounded) bytes, never through a symlink; SpoolError with a reason otherwise."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError as e:
        raise spool.SpoolError(reasons.MISSING, f"{what}: missing") from e
    except OSError as e:
        reason = reasons.SYMLINK if e.errno == errno.ELOOP else reasons.IO
        raise spool.SpoolError(reason, f"{what}: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise spool.SpoolError(reasons.FOREIGN, f"{what}: not a regular file")
        if st.st_size > max_bytes:
            raise spool.SpoolError(reasons.OVERSIZED, f"{what}: larger than the {max_bytes} byte limit")
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as e:
        raise spool.SpoolError(reasons.IO, f"{what}: {e.strerror or e}") from e
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise spool.SpoolError(reasons.OVERSIZED, f"{what}: larger than the {max_bytes} byte limit")
    return st, data


@contextlib.contextmanager
def opened_dir(name: str, dir_fd: int) -> Iterator[int]:
    fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def our_bundle(bundle_fd: int, name: str, key: bytes) -> float | None:
    """When the open directory ``bundle_fd`` is a bundle this exporter wrote under ``name``: its capture time."""
    if os.fstat(bundle_fd).st_uid != os.geteuid():
        return None
    try:
        st, data = read_at(bundle_fd, VERDICT_FILE, MAX_VERDICT_FILE_BYTES, name)
        doc = spool.parse_json_bytes(data, name)
    except spool.SpoolError:
        return None
    if st.st_uid != os.geteuid() or not isinstance(doc, dict):
        return None
    marker = doc.get(MARKER_FIELD)
    if not isinstance(marker, dict) or marker.get("name") != name or not isinstance(marker.get("mac"), str):
        return None
    if not hmac.compare_digest(marker["mac"].encode(), mac(key, name).encode()):
        return None
    captured = doc.get("captured_at")
    return float(captured) if isinstance(captured, (int, float)) and not isinstance(captured, bool) else 0.0
