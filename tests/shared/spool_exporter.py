"""An exporter over one spool directory, polled by the test (``poll_once``), and what its snapshot says."""

from __future__ import annotations

from pathlib import Path

from frexporter import naming as n
from frexporter.exporter import Exporter
from frexporter.model import RANK_OK
from frexporter.sources.ranks import RanksConfig, RanksSource


def make_exporter(directory: Path, **kw: float) -> tuple[Exporter, RanksSource]:
    config = RanksConfig(directory=str(directory), poll_interval=0.2, rank_timeout=kw.pop("rank_timeout", 0.5))
    source = RanksSource(config)
    return Exporter([(source, 0.0)], poll_interval=0.2), source


def errors_of(exporter: Exporter) -> dict[str, int]:
    return dict(next(s for s in exporter.snapshot.sources if s.name == n.SOURCE_RANKS).errors_total)


def healthy_ranks(exporter: Exporter) -> set[int]:
    return {r.rank for r in exporter.snapshot.ranks if r.status == RANK_OK}
