"""FR entries of deep reads -> collective durations and bytes, each rank's lateness and its waits: every entry once."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from frexporter import spool
from frexporter.fr import trace
from frexporter.model import CollectiveStats
from frexporter.sources.arrivals import ArrivalTracker
from frexporter.sources.collectives import CollectiveAccumulator, EntryCursor, GroupKey, LatenessTracker, WaitTracker
from frexporter.sources.ranks.track import RankTrack


class EntryFeed:
    def __init__(self, ranks: Mapping[str, RankTrack], per_rank: bool, window: int, waits: bool = False) -> None:
        self._ranks = ranks  # every tracked rank: a group's local members
        self._collectives = CollectiveAccumulator(per_rank=per_rank)
        self._lateness = LatenessTracker(window=window)
        # --collective-waits: the cross-node straggler signals, a rank's waits where FR records completion
        # (NCCL), its arrivals where it does not (gloo).
        self._waits = WaitTracker(window=window) if waits else None
        self._arrivals = ArrivalTracker() if waits else None

    def absorb(self, track: RankTrack, recorder: str, dump: trace.FrDump) -> int:
        """Feed entries not seen before to the duration/bytes counters and the lateness tracker, once each; the
        number of entries that left the ring unseen since the last read."""
        cursor = track.cursors.setdefault(recorder, EntryCursor(nccl=recorder == spool.RECORDER_NCCL))
        settled, fresh, missed = cursor.take(dump.entries)
        m = track.manifest
        table = {pg.name: pg for pg in m.process_groups}
        for entry in settled:
            if entry.pg_name:
                pg_entry = table.get(entry.pg_name)
                self._collectives.add(m.job_id, m.rank, pg_entry.desc if pg_entry else entry.pg_desc, entry)
        if self._waits is not None:
            self._observe_waits(self._waits, track, recorder, settled)
        by_pg: dict[str, list[trace.FrEntry]] = {}
        for entry in fresh:
            if entry.pg_name in table:
                by_pg.setdefault(entry.pg_name, []).append(entry)
        keys = group_keys(track)
        for name, entries in by_pg.items():
            key = keys.get((recorder, name))
            if key is not None:
                self._lateness.observe(key, self._local_members(key), m.rank, entries)
                if self._arrivals is not None and recorder != spool.RECORDER_NCCL:
                    self._arrivals.observe(key, m.rank, m.pid, entries)
        return missed

    @staticmethod
    def _observe_waits(waits: WaitTracker, track: RankTrack, recorder: str, settled: list[trace.FrEntry]) -> None:
        """Settled entries, per PG of the rank's manifest, to the wait tracker."""
        names = {pg.name for pg in track.manifest.process_groups}
        by_pg: dict[str, list[trace.FrEntry]] = {}
        for entry in settled:
            if entry.pg_name in names:
                by_pg.setdefault(entry.pg_name, []).append(entry)
        keys = group_keys(track)
        for name, entries in by_pg.items():
            key = keys.get((recorder, name))
            if key is not None:
                waits.observe(key, track.manifest.rank, track.manifest.pid, entries)

    def lateness(self, track: RankTrack, recorder: str, pg_name: str) -> tuple[float, int] | None:
        """(seconds, samples) of the rank's lateness in a PG, once there is a score."""
        if not self._lateness.scored:
            return None
        key = group_keys(track).get((recorder, pg_name))
        if key is None:
            return None
        lateness, samples = self._lateness.score(key, track.manifest.rank)
        return None if lateness is None else (lateness, samples)

    def wait(self, track: RankTrack, recorder: str, pg_name: str) -> tuple[float, int] | None:
        """(seconds, samples) of the rank's mean wait inside the PG's recent collectives, once there is one."""
        if self._waits is None:  # off (the default): asked for every rank's every PG on every poll
            return None
        key = group_keys(track).get((recorder, pg_name))
        if key is None:
            return None
        wait, samples = self._waits.score(key, track.manifest.rank)
        return None if wait is None else (wait, samples)

    def arrival(self, track: RankTrack, recorder: str, pg_name: str, now: float) -> tuple[float, float] | None:
        """(unix seconds: the rank's mean call time over the PG's block due at ``now``, the sample's stamp):
        sources/arrivals.py."""
        if self._arrivals is None:
            return None
        key = group_keys(track).get((recorder, pg_name))
        return None if key is None else self._arrivals.arrival(key, track.manifest.rank, now)

    def retain(self, tracks: Iterable[RankTrack]) -> None:
        """Forget the jobs and groups no tracked rank belongs to any more."""
        tracks = list(tracks)
        self._collectives.forget_jobs({t.manifest.job_id for t in tracks})
        live = {key for t in tracks for key in group_keys(t).values()}
        self._lateness.forget(live)
        if self._waits is not None:
            self._waits.forget(live)
        if self._arrivals is not None:
            self._arrivals.forget(live)

    def snapshot(self) -> tuple[CollectiveStats, ...]:
        """Completed collectives so far (durations, bytes)."""
        return self._collectives.snapshot()

    def _local_members(self, key: GroupKey) -> dict[int, int]:
        """Local rank -> pid of every rank on this node whose PG table lists the group ``key``."""
        return {t.manifest.rank: t.manifest.pid for t in self._ranks.values()
                if group_keys(t).get((key[3], key[1])) == key}


def group_keys(track: RankTrack) -> dict[tuple[str, str], GroupKey]:
    """(recorder, PG name) -> lateness group key, built once per manifest version: the member list of a WORLD
    group can hold thousands of ranks, too many to hash on every poll."""
    m = track.manifest
    if track.group_keys_of is not m:
        # Per recorder: a cpu:gloo,cuda:nccl group counts collective seqs separately in each backend.
        # The spool keeps member lists sorted, so equal groups hash equal.
        track.group_keys = {(recorder, pg.name): (m.job_id, pg.name, hash(pg.ranks), recorder)
                            for recorder in m.recorders for pg in m.process_groups}
        track.group_keys_of = m
    return track.group_keys
