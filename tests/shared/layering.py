"""The import rules of tests/unit/test_layering.py that other tests check too."""

from __future__ import annotations

# Standard-library modules that reach files, sockets, processes, threads, clocks or log handlers.
IMPURE_MODULES = frozenset({
    "asyncio", "concurrent", "ctypes", "datetime", "fcntl", "glob", "http", "io", "logging", "mmap",
    "multiprocessing", "os", "pathlib", "pickle", "random", "select", "selectors", "shelve", "shutil", "signal",
    "socket", "socketserver", "sqlite3", "ssl", "subprocess", "sys", "tempfile", "threading", "time", "urllib",
})
