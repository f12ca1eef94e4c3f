"""Dump files on disk -> ``RankDump``s: the only module of ``dumpfiles`` that touches the file system.

Whoever can write the directory can plant entries in it: a file is read only when it is a regular file
(never through a symbolic link, never blocking on a FIFO); its bytes are bounded before they are parsed
(``bounds``); files are parsed one at a time, each into its compact parsed form (``interning``), and what all
of them keep is bounded by MAX_PARSED_BYTES. A second file for one rank is not used.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from frexporter.postmortem.dumpfiles.bounds import MAX_DUMP_BYTES, MAX_PARSED_BYTES
from frexporter.postmortem.dumpfiles.decoding import DumpError, RankDump, decode, parse_decoded, parse_file, rank_of
from frexporter.postmortem.dumpfiles.interning import Interner, compact

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def read_regular(name: str, what: str, limit: int, dir_fd: int | None = None) -> tuple[bytes, float]:
    """The bytes and mtime of the regular file ``name`` (relative to ``dir_fd``), at most ``limit`` of them.

    A symbolic link is not followed (O_NOFOLLOW), a FIFO cannot block the open (O_NONBLOCK), and what was
    opened is checked to be a regular file (fstat), so an entry swapped after it was listed is refused too.
    """
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise DumpError(f"{what}: a symbolic link, not followed") from e
        raise DumpError(f"{what}: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DumpError(f"{what}: {_kind(st.st_mode)}, not a regular file; not read")
        if st.st_size > limit:
            raise DumpError(f"{what}: {st.st_size} bytes, over the bound of {limit}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(st.st_size + 1)
            if len(data) > st.st_size:  # it grew after fstat
                data += f.read(limit + 1 - len(data))
    except OSError as e:
        raise DumpError(f"{what}: {e.strerror or e}") from e
    finally:
        os.close(fd)
    if len(data) > limit:
        raise DumpError(f"{what}: over the bound of {limit} bytes")
    return data, st.st_mtime


def load_file(path: str) -> RankDump:
    rank = rank_of(path)
    if rank is None:
        raise DumpError(f"{path}: no rank number at the end of the file name (torch names dumps <prefix><rank>)")
    data, mtime = read_regular(path, path, MAX_DUMP_BYTES)
    return RankDump(rank=rank, path=path, dump=parse_file(data, path), mtime=mtime)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while dumps are parsed (a parse makes millions of objects, none in a
    cycle, and each batch of them would start a collection that walks everything kept so far); on again as it
    was. Cycles a file does leave (a pickle may hold itself) are collected after that file."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class _Held:
    dump: RankDump
    cost: int


class _Loader:
    """The dumps of one directory, read one file at a time, with the problems of those passed over."""

    def __init__(self, directory: str, dir_fd: int, max_parsed_bytes: int) -> None:
        self.directory, self.dir_fd, self.max_parsed_bytes = directory, dir_fd, max_parsed_bytes
        self.held: dict[int, _Held] = {}
        self.problems: list[str] = []
        self.shared = Interner()
        self.kept_bytes = 0  # beyond the shared objects

    def add(self, name: str, skip: Callable[[str], bool]) -> None:
        path = os.path.join(self.directory, name)
        try:
            st = os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
        except OSError as e:
            self.problems.append(f"{path}: {e.strerror or e}")
            return
        if not stat.S_ISREG(st.st_mode):
            self.problems.append(f"{path}: {_kind(st.st_mode)}, not a regular file; not read")
        elif not skip(name):
            try:
                self._load(name, path)
            except DumpError as e:
                self.problems.append(str(e))
            gc.collect(0)  # this file's cycles, if it left any: only its own objects are this young

    def _load(self, name: str, path: str) -> None:
        rank = rank_of(name)
        if rank is None:
            raise DumpError(f"{path}: no rank number at the end of the file name (torch names dumps <prefix><rank>)")
        data, mtime = read_regular(name, path, MAX_DUMP_BYTES, self.dir_fd)
        obj = decode(data, path)
        del data  # gone before the tree is parsed, and the tree before the next file is read
        parsed = parse_decoded(obj, path)
        del obj
        dump, cost = compact(parsed, self.shared)
        del parsed
        new = RankDump(rank=rank, path=path, dump=dump, mtime=mtime)
        held = self.held.get(rank)
        if held is not None and len(dump.entries) <= len(held.dump.dump.entries):
            raise DumpError(_duplicate(path, rank, held.dump.path))
        total = self.shared.bytes + self.kept_bytes + cost - (held.cost if held else 0)
        if total > self.max_parsed_bytes:
            raise DumpError(
                f"{path}: not used: with it the parsed dumps would hold about {total >> 20} MiB, over "
                f"the bound of {self.max_parsed_bytes >> 20} MiB for all of them"
            )
        if held is not None:
            self.problems.append(_duplicate(held.dump.path, rank, path))
            self.kept_bytes -= held.cost
        self.held[rank] = _Held(new, cost)
        self.kept_bytes += cost

    def dumps(self) -> list[RankDump]:
        return [h.dump for h in self.held.values()]


def _duplicate(path: str, rank: int, used: str) -> str:
    return (
        f"{path}: a second dump of rank {rank}; not used: {used} is (one dump a rank: the one with more "
        "entries, else the first by name)"
    )


def _no_skip(name: str) -> bool:
    return False


def load_dir(
    directory: str, skip: Callable[[str], bool] = _no_skip, max_parsed_bytes: int = MAX_PARSED_BYTES
) -> tuple[list[RankDump], list[str]]:
    """Every usable dump in a directory, one a rank, plus one message per entry passed over: a file that is
    not a dump, is past a bound or is a second dump of a rank, and every entry that is not a regular file.
    Hidden entries (``.name``) are passed over silently, and so are the regular files ``skip`` names (the
    other files of an evidence bundle)."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise DumpError(f"{directory}: {e.strerror or e}") from e
    try:
        loader = _Loader(directory, dir_fd, max_parsed_bytes)
        with _collector_paused():
            for name in sorted(os.listdir(dir_fd)):
                if not name.startswith("."):
                    loader.add(name, skip)
    except OSError as e:
        raise DumpError(f"{directory}: {e.strerror or e}") from e
    finally:
        os.close(dir_fd)
    return sorted(loader.dumps(), key=lambda d: d.rank), loader.problems
