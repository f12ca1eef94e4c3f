"""The ranks source's settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from frexporter import defaults
from frexporter.sources import pyspy
from frexporter.sources.collectives import DEFAULT_WINDOW
from frexporter.sources.thresholds import ThresholdConfig


@dataclass(frozen=True)
class RanksConfig:
    directory: str
    poll_interval: float = defaults.POLL_INTERVAL
    rank_timeout: float = defaults.RANK_TIMEOUT  # longest any one rank may hold a poll
    deep_interval: float = defaults.DEEP_INTERVAL  # least time between deep reads that only refresh settled values
    deep_read_share: float = defaults.DEEP_READ_SHARE  # ... and longer where reads are slow (routine_deep_interval)
    departed_grace: float = defaults.DEPARTED_GRACE  # keep exporting a dead or exited rank this long
    max_workers: int = 8
    per_rank_durations: bool = False  # collective durations and bytes per rank instead of per node
    straggler_window: int = DEFAULT_WINDOW  # collectives per rank the lateness score averages over
    # Each rank's mean wait inside each PG's collectives (frexporter_rank_collective_wait_seconds, the cross-node
    # straggler signal): one more series per rank and PG, so off by default (docs/durations.md).
    collective_waits: bool = False
    strict_permissions: bool = False  # a spool others may write is not read at all (source down), not just warned
    thresholds: ThresholdConfig = field(default_factory=ThresholdConfig)  # adaptive stuck threshold per PG
    # A wedged rank's training-thread stack from py-spy, through torch's pyspy_dump handler (sources/pyspy.py);
    # `serve --evidence-stacks` turns it on with the evidence bundles' stacks: both need py-spy and ptrace.
    wedged_stacks: bool = False
    stack_timeout: float = pyspy.FETCH_TIMEOUT  # one py-spy fetch, connect to last byte
