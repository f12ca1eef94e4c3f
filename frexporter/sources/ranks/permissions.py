"""The spool's permissions and ``--strict-permissions``: decided and reported here, and nowhere else.

Every poll the directory's owner and mode are judged on an fstat of the open directory (one syscall), and every
rank file or socket that anyone may write on the stat it gets anyway. The spool's first read also scans for
rank files and sockets open to every user: the ranks' privacy rather than what this exporter reads, so without
``--strict-permissions`` they are warned about once, not counted.

Under ``--strict-permissions`` any problem is a refusal: the poll raises ``SourceError(unsafe_permissions)``
and the spool is not read while it lasts (the source is down; ``serve`` maps a refusal of the first read to
exit status 2). Otherwise each problem is counted and logged once while it lasts; one fixed and back is
reported again.
"""

from __future__ import annotations

import os

from frexporter import reasons, spool
from frexporter.sources.base import SourceError
from frexporter.sources.ranks.problems import Problems
from frexporter.spool import PermissionProblem

REASON = reasons.UNSAFE_PERMISSIONS  # what this policy counts (cli.py reads its count by it)


class PermissionPolicy:
    def __init__(self, directory: str, strict: bool, trust: spool.Trust, problems: Problems) -> None:
        self.directory = directory
        self.strict = strict
        self._trust = trust
        self._problems = problems
        self._found: list[PermissionProblem] = []  # this poll's
        self._known: set[str] = set()  # those reported, for as long as they last
        self._first_read = True  # until the spool has been read once (under strict: read and accepted)

    def start(self, st: os.stat_result) -> None:
        """The poll's first look, at an fstat of the open directory."""
        self._found = spool.directory_problems(self.directory, st, self._trust)
        if self._first_read:
            exposed = self._open_to_everyone()
            if self.strict:
                self._found += exposed
            else:
                for problem in exposed:
                    self._problems.logs.warning(REASON, "unsafe spool permissions: %s (not counted: the ranks' "
                                                        "privacy; --strict-permissions refuses to read the spool)",
                                                problem)
        self._refuse_if_strict()
        self._first_read = False

    def note(self, path: str, st: os.stat_result) -> None:
        """A rank file, from the stat the reader made of it."""
        problem = spool.writable_by_anyone(path, st)
        if problem is not None:
            self._found.append(problem)

    def socket_allowed(self, path: str, st: os.stat_result) -> bool:
        """Whether a rank's socket (an lstat of it) may be connected to as far as its mode goes."""
        problem = spool.writable_by_anyone(path, st)
        if problem is None:
            return True
        self._found.append(problem)
        return not self.strict

    def settle(self) -> None:
        """The end of the poll's look: a refusal, else every problem not reported yet counted and logged."""
        self._refuse_if_strict()
        current = set()
        for problem in self._found:
            key = str(problem)
            current.add(key)
            if key not in self._known:
                self._problems.count(REASON, f"unsafe spool permissions: {problem}")
                self._problems.logs.warning(REASON, "unsafe spool permissions: %s (reason=unsafe_permissions; "
                                                    "--strict-permissions stops reading the spool while it lasts)",
                                            problem)
        self._known = current

    def _refuse_if_strict(self) -> None:
        if self.strict and self._found:
            problems = self._found
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise SourceError(REASON, f"unsafe spool permissions: {problems[0]}{more}; --strict-permissions: the "
                                      "spool is not read until this is fixed")

    def _open_to_everyone(self) -> list[PermissionProblem]:
        """Rank files and sockets every local user may open (one scan of the directory, on its first read)."""
        problems = spool.check_permissions(self.directory, group=self._trust.group, uid=self._trust.uid,
                                           gids=set(self._trust.gids))
        return [p for p in problems if p.path != self.directory]
