"""The poll loop: sources -> one immutable NodeSnapshot -> analysis, on its own interval.

Scrapes and API calls only read the latest snapshot (a reference swap), so they
never wait on a source. A failing source is recorded in its SourceStatus and the
rest of the snapshot is still produced.

Each source is collected on its own worker thread, with a deadline: a poll asks the
sources at once and waits for each up to its deadline; one past it is down
(``timeout``), its last reading is served stale, and its hung call is abandoned,
never repeated until it returns (docs/architecture.md, *Threads*).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from frexporter import defaults, reasons
from frexporter.errors import FrexporterError
from frexporter.model import CollectiveStats, GpuReading, NodeSnapshot, RankState, SourceStatus
from frexporter.sources.base import Reading, Source

log = logging.getLogger("frexporter.exporter")


@dataclass(frozen=True)
class _Answer:
    """What one call of a source's ``collect()`` came back with: a reading, or why it failed (strings, not the
    exception, which would pin the frames of the call)."""

    reading: Reading | None
    reason: str
    message: str
    duration: float


@dataclass
class _SourceTrack:
    source: Source
    interval: float
    deadline: float  # seconds one call may take
    last_run: float | None = None  # the exporter's monotonic clock, when the source was last asked
    # The latest good reading: None while the source is down with an error; kept, stale, while a call hangs.
    reading: Reading | None = None
    # Cumulative counters outlive a failed poll: dropping them would look like a counter reset.
    collectives: tuple[CollectiveStats, ...] = ()
    up: bool = False
    reason: str = ""  # why it is down
    stale: bool = False  # down with a call past its deadline, its last good reading still served
    duration: float = 0.0
    errors_total: dict[str, int] = field(default_factory=dict)
    last_error: str = ""
    last_success: float | None = None
    down_logged: bool = False
    # Shared with the source's worker thread, under Exporter._answers: a call is asked (requested), running, then
    # answered; the poll takes the answer in. asked_at (time.monotonic()) is set from the ask to the take.
    worker: threading.Thread | None = None
    asked_at: float | None = None
    requested: bool = False
    running: bool = False
    answer: _Answer | None = None
    closing: bool = False
    # Poll-thread only: the call in progress passed its deadline and was counted; whether a poll waits for this
    # source's answer (not after a call that missed its deadline, until one meets it again).
    timed_out: bool = False
    waited: bool = True


# A worker with nothing to do for this long ends; the next call starts another (exporters made and dropped by
# tests, or a source polled rarely, hold no thread).
WORKER_IDLE_EXIT = 60.0


def _call(source: Source) -> _Answer:
    started = time.perf_counter()
    try:
        reading = source.collect()
    except FrexporterError as e:
        return _Answer(None, e.reason, str(e), time.perf_counter() - started)
    except Exception as e:  # a bug in one source must not take the others down
        log.debug("source %s raised", source.name, exc_info=True)
        return _Answer(None, reasons.INTERNAL, f"{type(e).__name__}: {e}", time.perf_counter() - started)
    return _Answer(reading, "", "", time.perf_counter() - started)


def _serve_calls(track: _SourceTrack, answers: threading.Condition) -> None:
    """A source's worker thread: one ``collect()`` at a time, when the poll asks. It holds the track and its
    source, never the exporter, so an exporter whose source hangs for good can still be dropped."""
    source = track.source
    while True:
        with answers:
            idle_until = time.monotonic() + WORKER_IDLE_EXIT
            while not (track.requested or track.closing):
                left = idle_until - time.monotonic()
                if left <= 0:
                    track.worker = None
                    return
                answers.wait(left)
            if track.closing:  # the exporter stopped: it closes the source itself, no call runs now
                track.worker = None
                return
            track.requested, track.running = False, True
        try:
            answer = _call(source)
        except BaseException:  # SystemExit in the source: the worker ends, and says so rather than hang the track
            with answers:
                track.running, track.worker = False, None
                track.answer = _Answer(None, reasons.INTERNAL, "the source's worker thread ended", 0.0)
                answers.notify_all()
            raise
        with answers:
            track.running, track.answer = False, answer
            answers.notify_all()
            close = track.closing  # stopped while the call ran: the source is closed here, after it
            if close:
                track.worker = None
        if close:
            _close(source)
            return


def _close(source: Source) -> None:
    try:
        source.close()
    except Exception:
        log.warning("closing source %s failed", source.name, exc_info=True)


Analyzer = Callable[[NodeSnapshot], tuple[Any, ...]]


class Exporter:
    def __init__(
        self,
        sources: list[tuple[Source, float]],
        poll_interval: float = defaults.POLL_INTERVAL,
        analyzer: Analyzer | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] | None = None,
        hostname: str | None = None,
        source_timeout: float = defaults.SOURCE_TIMEOUT,
        timeouts: Mapping[str, float] | None = None,
    ) -> None:
        """``source_timeout``: the longest one call of a source's ``collect()`` may take, unless ``timeouts``
        (by source name) gives that source its own."""
        timeouts = timeouts or {}
        for value in (source_timeout, *timeouts.values()):
            if not value > 0:
                raise ValueError(f"a source timeout must be positive, not {value!r}")
        self.poll_interval = poll_interval
        self.analyzer = analyzer
        self.clock = clock
        # Source intervals run on a monotonic clock: a wall clock stepped back must not stop polling.
        self.monotonic = monotonic or (time.monotonic if clock is time.time else clock)
        self.hostname = hostname or socket.gethostname()
        # Deadlines run on the real monotonic clock, whatever clocks a test injects: the poll really waits.
        self._tracks = [_SourceTrack(source=s, interval=i, deadline=timeouts.get(s.name, source_timeout))
                        for s, i in sources]
        # Guards the tracks' worker fields; notified when a worker answers and when the exporter stops.
        self._answers = threading.Condition()
        self._snapshot = NodeSnapshot.empty(self.hostname, clock())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.polls = 0
        self.poll_listeners: list[Callable[[NodeSnapshot], None]] = []
        # Outputs that can fail on their own (an OTLP push) report their health here; it is exported in the
        # frexporter_source_* families next to the sources', so one alert and one panel cover every part.
        self.output_statuses: list[Callable[[], SourceStatus]] = []

    @property
    def snapshot(self) -> NodeSnapshot:
        return self._snapshot

    # ------------------------------------------------------------------ loop

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="frexporter-poll", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._answers:
            self._answers.notify_all()  # a poll waiting for answers stops waiting
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._answers:
            for track in self._tracks:
                track.closing = True
            hung = [t for t in self._tracks if t.running]
            self._answers.notify_all()
        for track in self._tracks:
            if track not in hung:
                _close(track.source)
        for track in hung:
            # Closing it now would wait for the hung call (NVML's lock) or race it: its worker closes it if the
            # call ever returns, and dies with the process otherwise.
            log.warning("source %s is still in a call; it is closed when that returns", track.source.name)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.poll_once()
            except Exception:  # the loop must survive anything a poll throws
                log.exception("poll failed; retrying next interval")
            self._stop.wait(max(0.0, self.poll_interval - (time.monotonic() - started)))

    def poll_once(self) -> NodeSnapshot:
        """Ask every source that is due (and not still in a call) at once, wait for their answers up to each
        one's deadline, and publish one snapshot of whatever the sources have: a source past its deadline is
        down (``timeout``) with its last reading served stale, and is not asked again until its call returns."""
        now, mono = self.clock(), self.monotonic()
        with self._answers:
            for track in self._tracks:
                self._take(track, now)  # an answer that came after its poll stopped waiting
            asked = []
            for track in self._tracks:
                if track.asked_at is None and (track.last_run is None
                                               or mono - track.last_run >= track.interval * 0.95):
                    self._ask(track)
                    track.last_run = mono
                    if track.waited:
                        asked.append(track)
            self._wait(asked)
            for track in self._tracks:
                self._take(track, now)
        ranks: tuple[RankState, ...] = ()
        collectives: tuple[CollectiveStats, ...] = ()
        gpus: GpuReading | None = None
        for track in self._tracks:
            collectives += track.collectives
            reading = track.reading
            if reading is None:
                continue
            if reading.ranks is not None:
                ranks += reading.ranks
            if reading.gpus is not None:
                gpus = reading.gpus
        snapshot = NodeSnapshot(
            time=now,
            hostname=self.hostname,
            ranks=ranks,
            sources=tuple(
                SourceStatus(
                    name=t.source.name,
                    up=t.up,
                    duration_seconds=t.duration,
                    errors_total=dict(t.errors_total),
                    last_error=t.last_error,
                    last_success=t.last_success,
                    reason="" if t.up else t.reason,
                    stale=t.stale,
                )
                for t in self._tracks
            )
            + tuple(self._output_statuses()),
            gpus=gpus,
            collectives=collectives,
        )
        if self.analyzer is not None:
            try:
                snapshot = replace(snapshot, verdicts=self.analyzer(snapshot))
            except Exception:
                log.exception("verdict analysis failed; serving the snapshot without verdicts")
        self._snapshot = snapshot
        self.polls += 1
        for listener in self.poll_listeners:
            try:
                listener(snapshot)
            except Exception:
                log.exception("poll listener failed")
        return snapshot

    def _output_statuses(self) -> list[SourceStatus]:
        out = []
        for status in self.output_statuses:
            try:
                out.append(status())
            except Exception:
                log.exception("source status callback failed")
        return out

    # ------------------------------------------------------------------ a source's calls (under _answers)

    def _ask(self, track: _SourceTrack) -> None:
        track.asked_at = time.monotonic()
        track.requested = True
        if track.worker is None:
            track.worker = threading.Thread(target=_serve_calls, args=(track, self._answers),
                                            name=f"frexporter-source-{track.source.name}", daemon=True)
            track.worker.start()
        self._answers.notify_all()

    def _wait(self, asked: list[_SourceTrack]) -> None:
        """Until every source asked this poll has answered or passed its deadline (they run at once: the wait
        is the slowest one's, at most the timeout), or the exporter stops."""
        while not self._stop.is_set():
            now = time.monotonic()
            deadlines = [t.asked_at + t.deadline for t in asked
                         if t.answer is None and t.asked_at is not None]
            pending = [d for d in deadlines if d > now]
            if not pending:
                return
            self._answers.wait(min(pending) - now)

    def _take(self, track: _SourceTrack, now: float) -> None:
        """Take a finished call in, or mark a call past its deadline down, once."""
        if track.asked_at is None:
            return
        answer = track.answer
        if answer is None:
            elapsed = time.monotonic() - track.asked_at
            if elapsed >= track.deadline:
                track.duration = elapsed  # grows while the call hangs
                if not track.timed_out:
                    track.timed_out, track.waited = True, False
                    self._timeout(track, elapsed)
            return
        track.answer, track.asked_at = None, None
        track.duration = answer.duration
        late = answer.duration >= track.deadline
        if late and not track.timed_out:  # it ended past its deadline between two polls: counted now
            self._timeout(track, answer.duration)
        track.timed_out, track.waited = False, not late
        if answer.reading is None:
            self._down(track, answer.reason, answer.message)
            return
        reading = answer.reading
        track.reading, track.stale, track.last_success = reading, False, now
        if reading.collectives is not None:
            track.collectives = reading.collectives
        if late:
            # Its reading is served, but a source that answers only past its deadline is not up.
            track.up, track.reason = False, reasons.TIMEOUT
            track.last_error = (f"answered after {answer.duration:.1f}s, past its {track.deadline:g}s "
                                "deadline (--source-timeout)")
        else:
            track.up, track.reason = True, ""
            if track.down_logged:
                log.info("source %s recovered", track.source.name)
                track.down_logged = False
        # Problems inside an otherwise good reading (a corrupt rank file, one GPU counter) count too.
        errors = track.errors_total
        for reason, message in reading.problems:
            errors[reason] = errors.get(reason, 0) + 1
            track.last_error = message

    def _timeout(self, track: _SourceTrack, elapsed: float) -> None:
        errors = track.errors_total
        errors[reasons.TIMEOUT] = errors.get(reasons.TIMEOUT, 0) + 1
        track.up, track.reason = False, reasons.TIMEOUT
        track.stale = track.reading is not None  # the last good reading is still served, and says how old it is
        track.last_error = (f"no answer within {track.deadline:g}s (--source-timeout); the call is "
                            "abandoned and the source not asked again until it returns")
        if not track.down_logged:
            log.warning("source %s is down: no answer after %.1fs; %s", track.source.name, elapsed,
                        "serving its last reading" if track.stale else "nothing of it is served")
            track.down_logged = True

    def _down(self, track: _SourceTrack, reason: str, message: str) -> None:
        errors = track.errors_total
        errors[reason] = errors.get(reason, 0) + 1
        track.up, track.reason, track.stale = False, reason, False
        track.reading = None
        track.last_error = message
        if not track.down_logged:
            log.warning("source %s is down: %s", track.source.name, message)
            track.down_logged = True
