"""A wedged rank's training-thread stack, from py-spy run by torch's worker server in the rank.

A rank whose main thread holds the GIL in native code cannot sample itself. torch's worker server answers
``pyspy_dump`` from C++ without the GIL: it runs ``py-spy dump --pid <the rank's pid>`` inside the rank (as
the rank's user, in its container; py-spy must be on the rank's PATH and ptrace permitted there) and returns
py-spy's text. torch's only other stack handler, ``dump_traceback``, takes the GIL, so a wedged rank never
answers it.

That text is untrusted (whoever can write the spool can answer on a rank's socket): it is read with the
bounds of the recorder's own samples (spool.MAX_STACK_FRAMES innermost frames, spool.MAX_FRAME_TEXT_CHARS
per name), and anything else is a SourceError whose reason the ranks source counts.
"""

from __future__ import annotations

import re

from frexporter import reasons, spool
from frexporter.model import Frame
from frexporter.sources import worker_handlers
from frexporter.sources.base import SourceError

# The handler, its query and its answer bound are in the worker-server table (worker_handlers.PYSPY_DUMP).
HANDLER = worker_handlers.PYSPY_DUMP.name
MAX_DUMP_BYTES = worker_handlers.PYSPY_DUMP.max_bytes
FETCH_TIMEOUT = 5.0  # one fetch, connect to last byte; py-spy itself takes 10-50 ms
# A wedge gets one fetch when it is first seen, then one per this many seconds while it lasts: the rank may
# move from one native call to another without releasing the GIL.
REFRESH_INTERVAL = 60.0
MAX_CONCURRENT = 2  # fetches in flight, node-wide (each one is a py-spy process in a rank)

# What a fetch fails with, besides worker_client's socket reasons and reasons.LIMIT_TEXT (a function or file
# name past spool.MAX_FRAME_TEXT_CHARS); the old names, kept for callers.
REASON_INVALID = reasons.PYSPY_INVALID
REASON_FAILED = reasons.PYSPY_FAILED

MAIN_THREAD_NAME = "MainThread"
# console's styling, when something in the rank's environment forces it on (CLICOLOR_FORCE).
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PROCESS = re.compile(r"Process (\d{1,10}): ")
_THREAD = re.compile(r'Thread (\S{1,32})(?: \([a-z+]{1,16}\))?(?:: "(.*)")?')
_MAX_FRAME_LINE = 2 * spool.MAX_FRAME_TEXT_CHARS + 32  # indent, " (", ":", a line number, ")"


def fetch(path: str, timeout: float = FETCH_TIMEOUT, trust: spool.Trust | None = None) -> tuple[Frame, ...]:
    """The training thread's frames, innermost first, from the rank behind socket ``path``; SourceError."""
    try:
        body = worker_handlers.call(path, worker_handlers.PYSPY_DUMP, timeout, trust=trust)
    except SourceError as e:
        if e.reason == reasons.HANDLER_FAILED:  # py-spy's own message is in it: bounded and repr'd by worker_client
            raise SourceError(reasons.PYSPY_FAILED, f"{e} (is py-spy on the rank's PATH, and ptrace permitted in "
                                                    "its container?)") from e
        raise
    return parse_dump(body, path)


def parse_dump(data: bytes | bytearray, what: str) -> tuple[Frame, ...]:
    """The main thread's frames in py-spy's ``dump`` text, innermost first, at most spool.MAX_STACK_FRAMES.

    The main thread is the one whose id is the process's pid (py-spy names threads by their native id, and
    the main thread's is the pid), else the one named MainThread. Only the first process is read (py-spy's
    --subprocesses appends its children). Lines outside a thread (py-spy's headers, its locals) are passed
    over; a frame line of the main thread that is not ``function (file[:line])`` refuses the dump.
    """
    if len(data) > MAX_DUMP_BYTES:
        raise SourceError(reasons.OVERSIZED, f"{what}: py-spy dump larger than {MAX_DUMP_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SourceError(reasons.PYSPY_INVALID, f"{what}: py-spy dump is not UTF-8") from e
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    pid: str | None = None
    by_pid: list[Frame] | None = None
    by_name: list[Frame] | None = None
    current: list[Frame] | None = None  # the frames being read, when this thread may be the main one
    reading = False  # inside a thread's section
    for raw in text.split("\n"):
        line = raw.rstrip("\r")
        if pid is None:
            match = _PROCESS.match(line)
            if match is not None:
                pid = match.group(1)
            continue
        if line.startswith("Process ") and _PROCESS.match(line):
            break  # a subprocess's dump
        if line.startswith("Thread "):
            reading = True
            current = None
            match = _THREAD.fullmatch(line)
            if match is None:
                raise SourceError(reasons.PYSPY_INVALID, f"{what}: not a py-spy thread line: {line[:80]!r}")
            if match.group(1) == pid and by_pid is None:
                current = by_pid = []
            elif match.group(2) == MAIN_THREAD_NAME and by_name is None:
                current = by_name = []
            continue
        if not reading or not line.startswith("    ") or line.startswith("        "):
            continue  # headers, blank lines, locals (--locals), separators
        if current is not None and len(current) < spool.MAX_STACK_FRAMES:
            current.append(_frame(line[4:], what))
    if pid is None:
        raise SourceError(reasons.PYSPY_INVALID, f"{what}: not a py-spy dump (no 'Process <pid>:' line)")
    frames = by_pid if by_pid is not None else by_name
    if frames is None:
        raise SourceError(reasons.PYSPY_INVALID, f"{what}: no main thread in py-spy's dump")
    return tuple(frames)


def _frame(body: str, what: str) -> Frame:
    """'function (file:line)', 'function (file)' (no line: a native frame) -> (function, file, line)."""
    if len(body) > _MAX_FRAME_LINE:
        raise SourceError(reasons.LIMIT_TEXT, f"{what}: a py-spy frame of {len(body)} characters, over the bound")
    function, sep, rest = body.partition(" (")
    if not sep or not rest.endswith(")") or not function:
        raise SourceError(reasons.PYSPY_INVALID, f"{what}: not a py-spy frame line: {body[:80]!r}")
    rest = rest[:-1]
    path, colon, number = rest.rpartition(":")
    if colon and number.isascii() and number.isdigit() and len(number) <= 18:
        line = int(number)
    else:
        path, line = rest, 0
    if not path:
        raise SourceError(reasons.PYSPY_INVALID, f"{what}: a py-spy frame without a file: {body[:80]!r}")
    if len(function) > spool.MAX_FRAME_TEXT_CHARS or len(path) > spool.MAX_FRAME_TEXT_CHARS:
        raise SourceError(reasons.LIMIT_TEXT, f"{what}: a py-spy frame has a name over the bound of "
                                              f"{spool.MAX_FRAME_TEXT_CHARS} characters")
    return function, path, line
