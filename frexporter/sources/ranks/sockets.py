"""Socket work for the ranks source: pings, deep reads of FR entries, py-spy stacks, and what their answers tell.

A deep read (an FR read over the rank's socket, no GIL needed on the rank's side) is asked only when it tells
something new: a rank or PG not yet mapped, progress that stopped with work in flight, p2p traffic that makes
raw sequence numbers incomparable, or a stale heartbeat; otherwise at most every ``routine_deep_interval``.
Socket work runs on a small pool with a hard per-rank timeout, so one stuck rank never delays the others or a
scrape: a poll waits at most ``rank_timeout`` and a late answer is taken by a later poll. py-spy fetches have a
pool of their own and are never waited for.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from frexporter import reasons, spool
from frexporter.errors import FrexporterError
from frexporter.fr import trace
from frexporter.fr.domain import translate
from frexporter.model import RANK_UNRESPONSIVE, STATE_EXITING
from frexporter.sources import arrivals, pyspy, worker_handlers
from frexporter.sources.base import SourceError
from frexporter.sources.ranks import liveness
from frexporter.sources.ranks.config import RanksConfig
from frexporter.sources.ranks.entries import EntryFeed
from frexporter.sources.ranks.pg_state import predicted_name, snapshot_statuses
from frexporter.sources.ranks.problems import Problems
from frexporter.sources.ranks.track import PGTrack, RankTrack
from frexporter.sources.thresholds import history_samples
from frexporter.spool import Manifest, is_nccl_backend

# Socket failures after which a rank counts as having no live socket (a timeout means a wedged one).
_SOCKET_GONE = (reasons.SOCKET_MISSING, reasons.SOCKET_REFUSED, reasons.SOCKET_UNTRUSTED)


def routine_deep_interval(read_seconds: float | None, config: RanksConfig) -> float:
    """Seconds between routine deep reads (those that only refresh moving values) of a rank whose last read
    took ``read_seconds``: ``deep_interval``, or longer where reads are slow, so that they take at most
    ``deep_read_share`` of the rank's time. The read's duration, measured here, includes the exporter's own
    parsing: an upper bound of what the rank's worker server spent. A ``deep_interval`` of 0 asks for a read
    whenever values move, and gets it."""
    if read_seconds is None or config.deep_read_share <= 0 or config.deep_interval <= 0:
        return config.deep_interval
    return max(config.deep_interval, read_seconds / config.deep_read_share)


def outcome(future: cf.Future[Any]) -> tuple[Any, BaseException | None]:
    """A finished future's result, or its exception, without raising it here: a raised exception's traceback
    takes in this frame, whose locals hold the future, which holds the exception: a cycle that keeps a refused
    answer (tens of MB) alive until the garbage collector runs."""
    error = future.exception()
    return (None, error) if error is not None else (future.result(), None)


def as_source_error(error: BaseException, reason: str, stem: str) -> FrexporterError:
    """``error`` as it is counted: ours as they are; anything else (an answer we do not understand must not
    stop the poll) under ``reason``."""
    if isinstance(error, FrexporterError):
        return error
    return SourceError(reason, f"{stem}: {error!r}")


class SocketScheduler:
    def __init__(self, config: RanksConfig, trust: spool.Trust, problems: Problems, feed: EntryFeed) -> None:
        self.config = config
        self._trust = trust
        self._problems = problems
        self._feed = feed
        self.logged: set[tuple[str, str]] = set()  # (stem, reason) of socket failures already logged
        self._pool = cf.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="frexporter-sock")
        # py-spy fetches are slower than pings and deep reads, are never waited for, and must never hold back a
        # socket thread a poll needs.
        self._stack_pool = cf.ThreadPoolExecutor(max_workers=pyspy.MAX_CONCURRENT,
                                                 thread_name_prefix="frexporter-pyspy")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._stack_pool.shutdown(wait=False, cancel_futures=True)

    def stale(self, track: RankTrack, mono: float) -> bool:
        interval = track.snapshot.interval if track.snapshot is not None else None
        return liveness.stale(track.last_fresh, interval, self.config.poll_interval, mono)

    def forget(self, live_stems: Iterable[str]) -> None:
        """Forget which failures were logged for ranks that left."""
        if self.logged:
            live = set(live_stems)
            self.logged = {key for key in self.logged if key[0] in live}

    # ------------------------------------------------------------------ asking

    def schedule(self, tracks: Iterable[RankTrack], mono: float, usable: Callable[[RankTrack, str], bool],
                 now: float | None = None) -> None:
        """Submit the pings, deep reads and py-spy fetches this poll wants; ``usable(track, socket name)``: whether
        the spool lets that socket be connected to; ``now``: the wall clock, which times the arrivals' reads."""
        tracks = list(tracks)
        stacks_in_flight = sum(1 for t in tracks if t.stack_pending is not None)
        for track in tracks:
            name = track.manifest.socket
            if not name:
                continue
            if track.snapshot is not None and track.snapshot.state == STATE_EXITING:
                continue
            stale = self.stale(track, mono)
            ping = stale and track.ping_pending is None and track.deep_pending is None
            deep = track.deep_pending is None and self._wants_deep_read(track, mono, stale, now)
            stack = stale and stacks_in_flight < pyspy.MAX_CONCURRENT and self._wants_stack(track, mono)
            if not (ping or deep or stack) or not usable(track, name):
                continue
            path = os.path.join(self.config.directory, name)
            if ping:
                track.ping_pending = self._pool.submit(worker_handlers.ping, path, self.config.rank_timeout,
                                                       self._trust)
            if deep:
                track.deep_pending = self._pool.submit(self._deep_read, track.manifest, path)
            if stack:
                track.stack_asked = mono
                fetch = self._stack_pool.submit(pyspy.fetch, path, self.config.stack_timeout, self._trust)
                track.stack_pending = (fetch, track.liveness.wedges)
                stacks_in_flight += 1

    def _wants_stack(self, track: RankTrack, mono: float) -> bool:
        """Whether to ask py-spy for a wedged rank's stack now: once when the wedge is first judged (the last
        poll said unresponsive: a rank that died since has been judged down by its ping), then every
        REFRESH_INTERVAL while it lasts, one fetch per rank at a time."""
        return (self.config.wedged_stacks and track.liveness.status == RANK_UNRESPONSIVE
                and track.stack_pending is None and pyspy.HANDLER in track.manifest.handlers
                and (track.stack_asked is None or mono - track.stack_asked >= pyspy.REFRESH_INTERVAL))

    def _routine_due(self, track: RankTrack, mono: float, now: float | None) -> bool:
        """Whether a routine read (values moved) is due: every ``routine_deep_interval``; with --collective-waits
        also at each arrival read point, so that every node has read each grid instant's block of collectives
        when it is reported (sources/arrivals.py). At the default 15 s interval that is no extra read, only
        the same reads at the same moments on every node, unless reads are slow: then up to ARRIVAL_READ_SHARE of
        the rank's time instead of deep_read_share."""
        interval = routine_deep_interval(track.deep_seconds, self.config)
        if mono - (track.deep_mono or 0.0) >= interval:
            return True
        # The arrivals' reads may take up to ARRIVAL_READ_SHARE of the rank's time (an answer of 120 ms every 15 s
        # at the defaults: a slow node's full ring) before they too are spaced by their cost. The rank's time is
        # until its answer is in: parsing it is the exporter's, which on a node of many ranks parses several
        # rings at once and would otherwise make every full ring look too dear (the soak's ranks lost most
        # instants once their rings filled).
        spent = track.deep_answer_seconds
        affordable = (self.config.deep_read_share <= 0 or spent is None
                      or spent <= arrivals.ARRIVAL_GRID * arrivals.ARRIVAL_READ_SHARE)
        return (self.config.collective_waits and now is not None and affordable
                and track.deep_time is not None and track.deep_time < arrivals.read_point(now))

    def _wants_deep_read(self, track: RankTrack, mono: float, stale: bool, now: float | None = None) -> bool:
        if not track.manifest.recorders:
            return False
        if track.deep_mono is not None and mono - track.deep_mono < self.config.poll_interval * 0.9:
            return False
        if stale:
            return track.socket_alive is not False
        raw = snapshot_statuses(track.snapshot)
        if not raw:
            return False
        if track.deep_mono is None:
            return True
        routine_due = self._routine_due(track, mono, now)
        for recorder, statuses in raw.items():
            known = track.learned_ids.get(recorder, {})
            at_deep = track.deep_raw.get(recorder, {})
            prev = track.prev_raw.get(recorder, {})
            for pg_id, status in statuses.items():
                if pg_id not in known:
                    return True
                if status == at_deep.get(pg_id):
                    continue
                settled = status == prev.get(pg_id)
                pending = status.enqueued > status.completed
                # Work in flight that stopped moving may be a hang: read its entries at once. Anything
                # else that moved since the last read (p2p traffic may have shifted torch's raw
                # counters off the collective domain) is refreshed at most every deep_interval (or further
                # apart where reads are slow: routine_deep_interval).
                if settled and pending:
                    return True
                if routine_due:
                    return True
        return False

    def _deep_read(self, manifest: Manifest, path: str) -> tuple[dict[str, trace.FrDump], float, float]:
        """Every recorder's ring of one rank, how long reading them took, and of that how long the rank took to
        answer (on a socket thread)."""
        started = time.perf_counter()
        answering = 0.0
        dumps = {}
        for recorder in manifest.recorders:
            handler = worker_handlers.BY_RECORDER.get(recorder)
            if handler is None or (manifest.handlers and handler.name not in manifest.handlers):
                continue
            bounds = trace.answer_bounds(manifest.fr_buffer_size, manifest.members_total)
            asked = time.perf_counter()
            body = worker_handlers.call(path, handler, self.config.rank_timeout, max_bytes=bounds.max_bytes,
                                        trust=self._trust)
            answering += time.perf_counter() - asked
            try:
                dumps[recorder] = trace.parse_answer(body, bounds, f"{path} {handler.name}")
            finally:
                del body  # neither while the next recorder is read nor by a refusal's traceback
        return dumps, time.perf_counter() - started, answering

    # ------------------------------------------------------------------ answers

    def settle(self, tracks: Iterable[RankTrack], clock: Callable[[], float], monotonic: Callable[[], float]
               ) -> None:
        """Wait up to ``rank_timeout`` for this poll's pings and deep reads, then take every finished answer."""
        tracks = list(tracks)
        futures = [f for t in tracks for f in (t.deep_pending, t.ping_pending) if f is not None]
        if futures:
            cf.wait(futures, timeout=self.config.rank_timeout)
        now, mono = clock(), monotonic()
        for track in tracks:
            if track.stack_pending is not None and track.stack_pending[0].done():
                self._absorb_stack(track)
            if track.ping_pending is not None and track.ping_pending.done():
                alive, error = outcome(track.ping_pending)
                track.ping_pending = None
                if error is None:
                    track.socket_alive = bool(alive)
                else:
                    reason = error.reason if isinstance(error, FrexporterError) else ""
                    track.socket_alive = reason not in _SOCKET_GONE
                    self.log_once(track, as_source_error(error, reasons.SOCKET_ERROR, track.stem))
            if track.deep_pending is not None and track.deep_pending.done():
                read, error = outcome(track.deep_pending)
                track.deep_pending = None
                if error is None:
                    dumps, track.deep_seconds, track.deep_answer_seconds = read
                    self._absorb_deep(track, dumps, now)
                    track.deep_mono = mono
                    track.socket_alive = True
                else:  # the socket's failure, an answer the parser refused, or one we do not understand
                    if isinstance(error, FrexporterError) and error.reason in _SOCKET_GONE:
                        track.socket_alive = False
                    track.deep_time, track.deep_mono = now, mono  # do not hammer a failing socket every poll
                    self.log_once(track, as_source_error(error, reasons.BAD_RESPONSE, track.stem))

    def _absorb_stack(self, track: RankTrack) -> None:
        """A finished py-spy fetch (never waited for: a poll takes what is done). Its frames stand for the
        wedge they were asked in, as long as that wedge lasts; failures are counted, the rank keeps its last
        own sample."""
        assert track.stack_pending is not None
        (future, wedge), track.stack_pending = track.stack_pending, None
        frames, error = outcome(future)
        if error is not None:  # the socket's failure, py-spy's, or an answer the parser refused or misunderstood
            self.log_once(track, as_source_error(error, reasons.PYSPY_INVALID, track.stem))
            return
        if wedge == track.liveness.wedges and track.liveness.status == RANK_UNRESPONSIVE:
            track.stack_frames = frames

    def _absorb_deep(self, track: RankTrack, dumps: dict[str, trace.FrDump], now: float) -> None:
        track.deep_time = now
        # PG name -> ((whether its entries are in the ring, whether NCCL's), its replayed history): one
        # recorder's per PG, the one its state is judged by where there are several (pg_state.choose)
        histories: dict[str, tuple[tuple[bool, bool], tuple[float, ...]]] = {}
        for recorder, dump in dumps.items():
            views = translate(dump)
            by_pg: dict[int, list[trace.FrEntry]] | None = None
            ids = track.learned_ids.setdefault(recorder, {})
            for pg_id, view in views.items():
                if view.name:
                    ids[pg_id] = view.name
                if view.backend:
                    if is_nccl_backend(view.backend):
                        track.nccl_ids.add((recorder, pg_id))
                    else:
                        track.nccl_ids.discard((recorder, pg_id))
                name = ids.get(pg_id) or predicted_name(track.manifest, recorder, pg_id)
                if name is None:
                    continue
                pg = track.pgs.setdefault(name, PGTrack())
                pg.deep = view
                pg.has_p2p = pg.has_p2p or view.has_p2p
                prefer = (view.known, recorder == spool.RECORDER_NCCL or (recorder, pg_id) in track.nccl_ids)
                if not pg.history_read and (name not in histories or prefer > histories[name][0]):
                    if by_pg is None:
                        by_pg = {}
                        for entry in dump.entries:
                            by_pg.setdefault(entry.pg_id, []).append(entry)
                    period, lag = self._history_grid(track, pg.has_p2p or not view.raw_completes)
                    histories[name] = (prefer, history_samples(by_pg.get(pg_id, ()), period,
                                                               until=pg.memory.watched_since, lag=lag))
            track.deep_raw[recorder] = dict(dump.pg_status)
            missed = self._feed.absorb(track, recorder, dump)
            if missed:
                self.log_once(track, SourceError(
                    reasons.FR_ENTRIES_MISSED, f"{track.stem}: {missed} {recorder} Flight Recorder entries left the "
                    "ring between two deep reads; collective durations and bytes undercount them (raise "
                    "TORCH_FR_BUFFER_SIZE or lower the deep interval)"))
            if dump.repaired_text:
                self.log_once(track, SourceError(reasons.TEXT_REPAIRED, (
                    f"{track.stem}: {dump.repaired_text} strings of its {recorder} Flight Recorder answer were not "
                    "valid UTF-8; shown with U+FFFD in place of what could not be decoded")))
        for name, (_prefer, samples) in histories.items():
            pg = track.pgs[name]
            pg.history_read, pg.seed = True, samples

    def _history_grid(self, track: RankTrack, inexact: bool) -> tuple[float, float]:
        """(period, lag) of the live learner's view of a PG's completed sequence (thresholds.history_samples):
        it sees it once per poll, in counters up to a snapshot interval old; where p2p traffic (or a backend
        without a completion counter) leaves only deep reads to move it, once per routine deep read, whose
        spacing drifts by up to a poll."""
        poll = self.config.poll_interval
        if inexact:
            return max(poll, routine_deep_interval(track.deep_seconds, self.config)), poll
        interval = track.snapshot.interval if track.snapshot is not None else spool.DEFAULT_SNAPSHOT_INTERVAL
        return poll, interval

    def log_once(self, track: RankTrack, err: FrexporterError) -> None:
        """Counted every time; logged once per rank and reason."""
        self._problems.count(err.reason, str(err))
        key = (track.stem, err.reason)
        if key not in self.logged:
            self.logged.add(key)
            self._problems.logs.warning(err.reason, "rank %d of job %s: %s (reason=%s; logged once)",
                                        track.manifest.rank, track.manifest.job_id, err, err.reason)
