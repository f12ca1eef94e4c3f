"""Sources: everything the exporter reads from outside, one module each, registered in ``SOURCES``.

Each source keeps the contract of ``base.Source`` (``collect()`` returns a typed ``Reading``). ``serve``
turns every entry into a ``--source.NAME`` / ``--no-source.NAME`` flag, in the manner of node_exporter's
collectors; ``app.build_app`` creates the enabled ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from frexporter import defaults, naming

if TYPE_CHECKING:
    from frexporter.sources.base import Source


class SourceSettings(Protocol):
    """What a source is built from: the fields of ``app.ServeConfig`` the factories read."""

    @property
    def directory(self) -> str: ...
    @property
    def poll_interval(self) -> float: ...
    @property
    def rank_timeout(self) -> float: ...
    @property
    def deep_interval(self) -> float: ...
    @property
    def per_rank_durations(self) -> bool: ...
    @property
    def collective_waits(self) -> bool: ...
    @property
    def strict_permissions(self) -> bool: ...
    @property
    def evidence_stacks(self) -> bool: ...
    @property
    def stuck_after(self) -> float: ...
    @property
    def stuck_floor(self) -> float: ...
    @property
    def stuck_multiple(self) -> float: ...
    @property
    def source_timeout(self) -> float: ...


@dataclass(frozen=True)
class BuiltSource:
    """A source made from the settings, how often the poll asks it, and how long one call of it may take."""

    source: Source
    interval: float
    deadline: float


@dataclass(frozen=True)
class SourceInfo:
    """One row per source, as node_exporter's ``registerCollector(name, default, factory)``: the flag
    (``--[no-]source.NAME``, its help, on by default or not) and the constructor come from it."""

    name: str
    help: str
    make: Callable[[SourceSettings], BuiltSource]
    enabled_by_default: bool = True


def _ranks(settings: SourceSettings) -> BuiltSource:
    from frexporter.sources.ranks import RanksConfig, RanksSource
    from frexporter.sources.thresholds import ThresholdConfig

    config = RanksConfig(
        directory=settings.directory, poll_interval=settings.poll_interval, rank_timeout=settings.rank_timeout,
        deep_interval=settings.deep_interval, per_rank_durations=settings.per_rank_durations,
        collective_waits=settings.collective_waits,
        strict_permissions=settings.strict_permissions, wedged_stacks=settings.evidence_stacks,
        thresholds=ThresholdConfig(ceiling=settings.stuck_after, floor=settings.stuck_floor,
                                   multiple=settings.stuck_multiple),
    )
    # It may wait rank_timeout for wedged ranks on top of its own work: a deadline that did not allow for it
    # would call a node with one wedged rank hung.
    return BuiltSource(RanksSource(config), settings.poll_interval, settings.rank_timeout + settings.source_timeout)


def _nvml(settings: SourceSettings) -> BuiltSource:
    from frexporter.sources.nvml import NvmlSource  # pynvml itself is imported on the first read

    return BuiltSource(NvmlSource(), max(settings.poll_interval, defaults.NVML_INTERVAL), settings.source_timeout)


SOURCES: tuple[SourceInfo, ...] = (
    SourceInfo(naming.SOURCE_RANKS, "the ranks that publish to the spool directory (files and worker sockets)",
               _ranks),
    SourceInfo(naming.SOURCE_NVML, "GPU state from NVML (needs the NVIDIA driver and nvidia-ml-py)", _nvml),
)
DEFAULT_SOURCES: frozenset[str] = frozenset(s.name for s in SOURCES if s.enabled_by_default)
