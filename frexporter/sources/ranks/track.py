"""What the ranks source keeps of each rank between polls, grouped by the module that writes it (named)."""

from __future__ import annotations

import concurrent.futures as cf
import os
from dataclasses import dataclass, field

from frexporter.fr.domain import DeepView
from frexporter.model import Activity, Frame
from frexporter.sources.collectives import EntryCursor, GroupKey
from frexporter.sources.ranks.liveness import Liveness
from frexporter.sources.ranks.pg_state import PGMemory
from frexporter.spool import Manifest, RawPGStatus, Snapshot


@dataclass
class FileSig:
    """What identifies a file version without reading it."""

    ino: int = -1
    size: int = -1
    mtime_ns: int = -1

    @staticmethod
    def of(st: os.stat_result) -> FileSig:
        return FileSig(st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class PGTrack:
    deep: DeepView | None = None  # sockets: the PG as of the last deep read
    has_p2p: bool = False  # sockets: p2p traffic seen in some deep read
    memory: PGMemory = field(default_factory=PGMemory)  # source: what its state carries to the next poll
    history_read: bool = False  # sockets: a deep read replayed its ring's history (thresholds.history_samples)
    seed: tuple[float, ...] | None = None  # ... whose samples the source hands the learner once (seed), then None


@dataclass
class RankTrack:
    # spool_reader: the files
    stem: str
    manifest: Manifest
    manifest_sig: FileSig
    snapshot: Snapshot | None = None
    snapshot_sig: FileSig = field(default_factory=FileSig)
    snapshot_map_key: tuple[int, int] | None = None  # (inode, sequence) of the mapped snapshot last parsed
    last_fresh: float | None = None  # our monotonic clock when a new snapshot counter was last seen
    cpu_sample: tuple[float, float] | None = None  # (snapshot time, process CPU seconds) of the last snapshot
    cpu_percent: float | None = None  # CPU use between the last two snapshots that carried it
    # sockets: pings, deep reads and py-spy fetches, and what they told
    socket_alive: bool | None = None
    ping_pending: cf.Future | None = None
    deep_pending: cf.Future | None = None
    deep_raw: dict[str, dict[int, RawPGStatus]] = field(default_factory=dict)  # recorder -> raw at deep read
    deep_time: float | None = None  # wall clock of the last deep read (exported)
    deep_mono: float | None = None  # the same moment on the monotonic clock (spacing decisions)
    deep_seconds: float | None = None  # how long the last deep read took (request to parsed answer)
    deep_answer_seconds: float | None = None  # of that, until the rank's answer was in (the rank's own share)
    learned_ids: dict[str, dict[int, str]] = field(default_factory=dict)  # recorder -> pg id -> name
    # (recorder, pg id) whose entries an NCCL-family backend recorded (pg_state.choose prefers them)
    nccl_ids: set[tuple[str, int]] = field(default_factory=set)
    pgs: dict[str, PGTrack] = field(default_factory=dict)  # pg name -> track
    stack_pending: tuple[cf.Future, int] | None = None  # a py-spy fetch in flight, and its wedge
    stack_asked: float | None = None  # monotonic time of this wedge's last py-spy fetch
    stack_frames: tuple[Frame, ...] | None = None  # py-spy's training-thread frames in this wedge
    # entries: FR entries already handed to the accumulators, and the rank's lateness groups
    cursors: dict[str, EntryCursor] = field(default_factory=dict)  # recorder -> cursor
    group_keys: dict[tuple[str, str], GroupKey] = field(default_factory=dict)  # see EntryFeed.group_keys
    group_keys_of: Manifest | None = None
    # source: liveness and what was exported
    liveness: Liveness = field(default_factory=Liveness)
    prev_raw: dict[str, dict[int, RawPGStatus]] = field(default_factory=dict)  # the statuses last judged
    activity: Activity | None = None
