"""Sources: everything the exporter reads from outside, one module each, registered in ``SOURCES``.

Each source keeps the contract of ``base.Source`` (``collect()`` returns a typed ``Reading``). ``serve``
turns every entry into a ``--source.NAME`` / ``--no-source.NAME`` flag, in the manner of node_exporter's
collectors; ``app.build_app`` creates the enabled ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from frexporter import naming


@dataclass(frozen=True)
class SourceInfo:
    name: str
    help: str
    enabled_by_default: bool = True


SOURCES: tuple[SourceInfo, ...] = (
    SourceInfo(naming.SOURCE_RANKS, "the ranks that publish to the spool directory (files and worker sockets)"),
    SourceInfo(naming.SOURCE_NVML, "GPU state from NVML (needs the NVIDIA driver and nvidia-ml-py)"),
)
DEFAULT_SOURCES: frozenset[str] = frozenset(s.name for s in SOURCES if s.enabled_by_default)
