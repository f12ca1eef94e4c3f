"""The contract every source keeps: ``collect()`` returns a typed ``Reading`` or raises ``SourceError``.

A source reads one kind of outside state (rank spool files and sockets, NVML) and returns its part of the
node's snapshot in a ``Reading``, together with the problems it met and counted without failing: a corrupt
file, one GPU field that failed. The poll loop merges readings; it never asks a source anything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from frexporter.errors import FrexporterError
from frexporter.model import CollectiveStats, GpuReading, RankState


class SourceError(FrexporterError):
    """A source could not produce its reading (the whole source is down this poll)."""


@dataclass(frozen=True)
class Reading:
    """One source's part of a NodeSnapshot; None where the source does not read that kind of state."""

    ranks: tuple[RankState, ...] | None = None
    # Cumulative since the exporter started; the poll loop keeps the last ones through a failed poll.
    collectives: tuple[CollectiveStats, ...] | None = None
    gpus: GpuReading | None = None
    problems: tuple[tuple[str, str], ...] = ()  # (reason, message) of each problem counted this poll


class Source(Protocol):
    name: str

    def collect(self) -> Reading: ...

    def close(self) -> None: ...
