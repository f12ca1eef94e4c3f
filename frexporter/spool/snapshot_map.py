"""The mapped snapshot: the recorder updates it in place, the exporter reads it consistently."""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import zlib
from collections.abc import Callable
from typing import Any

from frexporter import reasons
from frexporter.spool.files import _open_temp, open_regular, parse_json_bytes
from frexporter.spool.layout import SpoolError
from frexporter.spool.limits import MAX_SNAPSHOT_BYTES

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
            raise SpoolError(reasons.OVERSIZED, f"{self.path}: snapshot of {len(payload)} bytes is over the limit")
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
            raise SpoolError(reasons.OVERSIZED, f"{path}: larger than the {max_bytes} byte limit")
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
        raise SpoolError(reasons.IO, f"{path}: {e.strerror or e}") from e
    finally:
        os.close(fd)


def _map_payload(data: bytes, path: str, file_size: int) -> tuple[bytes | None, SpoolError | None]:
    """The payload, or None and what is wrong with this read (the caller reads again: the header's fields are
    stored a byte at a time, so a read that races the writer can see any mix of old and new values)."""
    if len(data) < MAP_HEADER_BYTES:
        raise SpoolError(reasons.TRUNCATED, f"{path}: shorter than its header")
    magic, seq, length, crc = _MAP_HEADER.unpack_from(data)
    if magic != _MAP_MAGIC:
        if magic[:7] == _MAP_MAGIC_PREFIX:
            raise SpoolError(reasons.UNKNOWN_VERSION, f"{path}: mapped snapshot version {magic[7]} is not supported")
        raise SpoolError(reasons.FOREIGN, f"{path}: not a frexporter snapshot")
    if seq % 2:
        return None, SpoolError(reasons.TORN, f"{path}: its writer stopped inside an update")
    if not length:  # never written by an update: a read that raced one (pack_into zeroes a field first)
        return None, SpoolError(reasons.TORN, f"{path}: empty payload")
    end = MAP_HEADER_BYTES + length
    if end > len(data):
        if end <= file_size:  # the length grew between the header's read and this one: a race, not damage
            return None, SpoolError(reasons.TORN, f"{path}: changed while it was read")
        return None, SpoolError(reasons.TRUNCATED, f"{path}: payload of {length} bytes runs past the end of the file")
    payload = data[MAP_HEADER_BYTES:end]
    if zlib.crc32(payload) != crc:
        return None, SpoolError(reasons.TORN, f"{path}: payload does not match its checksum")
    return payload, None
