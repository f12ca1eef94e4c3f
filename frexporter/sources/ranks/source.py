"""The ranks source: spool directory + worker-server sockets -> one ``Reading`` per poll.

This module only orders one poll; each step has its own module:

- ``spool_reader``: scan, manifests, snapshots, which sockets may be used (``permissions``: the spool's
  permissions and ``--strict-permissions``);
- ``sockets``: pings, deep reads and py-spy stacks on their pools, and what their answers tell;
- ``entries``: FR entries to collective durations, bytes and lateness;
- ``liveness`` and ``pg_state`` (pure): each rank's status and PGs, and the samples each PG's stuck threshold is
  learned from (``sources/thresholds.py``); a departed rank its live peers still wait for is held (``liveness.held``);
- ``space`` (pure): whether the spool's filesystem has room for a rank to publish.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace

from frexporter import reasons, spool
from frexporter.model import FRAMES_PYSPY, FRAMES_RECORDER, RANK_DOWN, RANK_EXITED, STATE_EXITING, PGState, RankState
from frexporter.sources import rank_activity
from frexporter.sources.base import Reading
from frexporter.sources.ranks import liveness, pg_state, space
from frexporter.sources.ranks.config import RanksConfig
from frexporter.sources.ranks.entries import EntryFeed
from frexporter.sources.ranks.permissions import PermissionPolicy
from frexporter.sources.ranks.problems import Problems
from frexporter.sources.ranks.sockets import SocketScheduler
from frexporter.sources.ranks.spool_reader import SpoolReader
from frexporter.sources.ranks.track import PGTrack, RankTrack
from frexporter.sources.thresholds import ThresholdLearner
from frexporter.spool import PGEntry

log = logging.getLogger("frexporter.ranks")


class RanksSource:
    name = "ranks"

    def __init__(self, config: RanksConfig, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] | None = None,
                 statvfs: Callable[[int], os.statvfs_result] = os.statvfs) -> None:
        """``statvfs``: of the open spool directory, once per poll (a test passes the filesystem it wants)."""
        self.config = config
        self._clock = clock
        # Intervals (freshness, read spacing, grace) run on a monotonic clock so that a wall-clock jump
        # (NTP step, VM resume) neither makes every rank look stale nor every collective look old. A test
        # that fakes the wall clock gets the same fake for intervals unless it passes its own.
        self._monotonic = monotonic or (time.monotonic if clock is time.time else clock)
        self._ranks: dict[str, RankTrack] = {}
        trust = spool.Trust.current()
        self._problems = Problems(log, self._monotonic)
        permissions = PermissionPolicy(config.directory, config.strict_permissions, trust, self._problems)
        self._spool = SpoolReader(config.directory, permissions, trust, self._problems, clock, self._monotonic)
        self._feed = EntryFeed(self._ranks, per_rank=config.per_rank_durations, window=config.straggler_window,
                               waits=config.collective_waits)
        self._collective_waits = config.collective_waits
        self._sockets = SocketScheduler(config, trust, self._problems, self._feed)
        self._thresholds = ThresholdLearner(config.thresholds)
        self._statvfs = statvfs
        self._spool_full = False  # as of the last poll: its start and end are logged, each poll counted

    def close(self) -> None:
        self._sockets.close()

    def collect(self) -> Reading:
        """Every local rank's state this poll, the collectives completed so far, and the problems counted."""
        self._problems.start_poll()
        now = self._clock()
        mono = self._monotonic()
        with self._spool.opened() as dfd:
            entries = self._spool.read(dfd, self._ranks)
            self._sockets.forget(self._ranks)
            self._sockets.schedule(self._ranks.values(), mono,
                                   lambda track, name: self._spool.socket_usable(track, name, entries.get(name)),
                                   now=now)
            self._spool.permissions.settle()
            self._check_space(dfd)
        self._sockets.settle(self._ranks.values(), self._clock, self._monotonic)
        tracks = sorted(self._ranks.values(), key=lambda t: (t.manifest.job_id, t.manifest.rank))
        states = self._states(tracks, now, mono)
        # A PG no exported rank lists any more (destroyed, its job gone) takes its history with it.
        self._thresholds.retain((s.job_id, pg.name) for s in states for pg in s.pgs)
        self._feed.retain(self._ranks.values())
        return Reading(ranks=states, collectives=self._feed.snapshot(), problems=tuple(self._problems.items))

    def _check_space(self, dfd: int) -> None:
        """Count a spool the ranks cannot write to, once per poll while it lasts (a failed statvfs says nothing)."""
        try:
            short = space.shortage(self._statvfs(dfd))
        except OSError:
            return
        if short is not None:
            self._problems.count(reasons.SPOOL_FULL, f"{self.config.directory}: {short}")
            if not self._spool_full:
                log.warning("%s: %s (counted as reason=%s once per poll while it lasts)", self.config.directory,
                            short, reasons.SPOOL_FULL)
        elif self._spool_full:
            log.info("%s: the spool's filesystem has room again", self.config.directory)
        self._spool_full = short is not None

    def _states(self, tracks: list[RankTrack], now: float, mono: float) -> tuple[RankState, ...]:
        """The exported ranks: the live and recently dead ones, and the departed ones their live peers wait for."""
        states: list[RankState] = []
        departed: list[RankTrack] = []
        for track in tracks:
            status = self._judge(track, now, mono)
            if liveness.exported(track.liveness, mono, self.config.departed_grace):
                states.append(self._rank_state(track, status, now, mono))
            elif track.liveness.departed_at is not None:
                departed.append(track)
        if not departed:
            return tuple(states)
        # A departed rank stays, down, while a live local peer waits for it: dropped, it would leave the peers
        # waiting on nobody here ("stalled", the innocent waiters named). Only jobs with a wait are looked at.
        waiting = {s.job_id for s in states if s.up and any(pg.last_enqueued > pg.last_completed for pg in s.pgs)}
        held = False
        for track in departed:
            if track.manifest.job_id not in waiting:
                continue
            state = self._rank_state(track, RANK_DOWN, now, mono, keep_last=True)
            snap = track.snapshot
            final = snap is not None and snap.state == STATE_EXITING and bool(snap.status)
            hold = liveness.held(state, final, (s for s in states if s.up))
            if liveness.holds(track.liveness, hold, mono, self.config.departed_grace):
                states.append(replace(state, exited=track.liveness.status == RANK_EXITED))
                held = True
        if held:
            states.sort(key=lambda s: (s.job_id, s.rank))
        return tuple(states)

    def _judge(self, track: RankTrack, now: float, mono: float) -> str:
        """The rank's status this poll (model.RANK_*), its liveness advanced."""
        m, snap = track.manifest, track.snapshot
        status = liveness.judge(exiting=snap is not None and snap.state == STATE_EXITING,
                                stale=self._sockets.stale(track, mono), socket_alive=track.socket_alive,
                                has_snapshot=snap is not None, since_start=now - m.start_time,
                                rank_timeout=self.config.rank_timeout)
        before = track.liveness.status
        track.liveness = liveness.advance(track.liveness, status, mono)
        if not liveness.same_wedge(before, status):
            track.stack_asked = track.stack_frames = None  # py-spy is asked afresh; an earlier wedge's answer drops
        return status

    def _rank_state(self, track: RankTrack, status: str, now: float, mono: float,
                    keep_last: bool = False) -> RankState:
        """``keep_last``: a departed rank whose last snapshot carries no counters (a goodbye from an older
        recorder) keeps the ones last judged."""
        m, snap = track.manifest, track.snapshot
        raw = pg_state.judged_statuses(status, snap, track.deep_raw)
        if keep_last and not raw:
            raw = track.prev_raw
        pgs = self._pg_states(track, raw, now, mono)
        track.prev_raw = raw
        frames, source = (snap.stack if snap is not None else ()), FRAMES_RECORDER
        if track.stack_frames is not None:  # wedged, and py-spy answered for this wedge
            frames, source = track.stack_frames, FRAMES_PYSPY
        track.activity = rank_activity.next_activity(
            track.activity, status, frames, track.cpu_percent, any(pg.inflight_count > 0 for pg in pgs), now,
            source, own_wait=rank_activity.own_collective_wait(pgs, now),
            gpu_wait=snap.gpu_wait[1] if snap is not None and snap.gpu_wait is not None else None)
        return liveness.rank_state(m, snap, status, track.socket_alive, pgs, track.deep_time, track.activity, now)

    def _pg_states(self, track: RankTrack, raw: pg_state.Statuses, now: float, mono: float) -> tuple[PGState, ...]:
        table = {pg.name: pg for pg in track.manifest.process_groups}
        out = []
        for name, (recorder, _pg_id, status) in sorted(pg_state.choose(raw, track.learned_ids, track.manifest,
                                                                        track.nccl_ids).items()):
            entry = table.get(name) or PGEntry(name=name, desc="", ranks=(), backend=recorder)
            pg = track.pgs.setdefault(name, PGTrack())
            state, memory = pg_state.pg_state(entry, recorder, status, pg.deep, pg.has_p2p, pg.memory, now, mono)
            samples, progress_mono = pg_state.threshold_samples(pg.memory, state.last_completed, mono)
            pg.memory = replace(memory, progress_mono=progress_mono)
            key = (track.manifest.job_id, state.name)
            for seconds in samples:
                self._thresholds.observe(key, seconds)
            if pg.seed is not None:  # the history before we watched, from the rank's first deep read
                self._thresholds.seed(key, pg.seed)
                pg.seed = None
            state = replace(state, stuck_threshold_seconds=self._thresholds.threshold(key),
                            stuck_ceiling_seconds=self._thresholds.config.ceiling,
                            normal_wait_seconds=self._thresholds.normal_wait(key))
            lateness = self._feed.lateness(track, recorder, name)
            if lateness is not None:
                state = replace(state, lateness_seconds=lateness[0], lateness_samples=lateness[1])
            if self._collective_waits:
                wait = self._feed.wait(track, recorder, name)
                if wait is not None:
                    state = replace(state, wait_seconds=wait[0], wait_samples=wait[1])
                arrival = self._feed.arrival(track, recorder, name, now)
                if arrival is not None:
                    state = replace(state, arrival_timestamp=arrival[0], arrival_stamp=arrival[1])
            out.append(state)
        return tuple(out)
