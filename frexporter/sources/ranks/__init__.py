"""The ranks source: the spool directory and the ranks' worker-server sockets -> RankState per local rank.

``RanksSource.collect()`` is its whole interface (``source.py`` orders one poll; each step has its own module).
The other names are for benchmarks and tests that reason about its rules.
"""

from __future__ import annotations

from frexporter.sources.ranks.config import RanksConfig
from frexporter.sources.ranks.problems import LOG_BURST, LOG_WINDOW
from frexporter.sources.ranks.sockets import routine_deep_interval
from frexporter.sources.ranks.source import RanksSource

__all__ = ["LOG_BURST", "LOG_WINDOW", "RanksConfig", "RanksSource", "routine_deep_interval"]
