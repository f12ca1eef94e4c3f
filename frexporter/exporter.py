"""The poll loop: sources -> one immutable NodeSnapshot -> analysis, on its own interval.

Scrapes and API calls only read the latest snapshot (a reference swap), so they
never wait on a source. A failing source is recorded in its SourceStatus and the
rest of the snapshot is still produced.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from frexporter import defaults, reasons
from frexporter.errors import FrexporterError
from frexporter.model import CollectiveStats, GpuReading, NodeSnapshot, RankState, SourceStatus
from frexporter.sources.base import Reading, Source

log = logging.getLogger("frexporter.exporter")


@dataclass
class _SourceTrack:
    source: Source
    interval: float
    last_run: float | None = None  # monotonic
    reading: Reading | None = None  # this poll's, None while the source is down
    # Cumulative counters outlive a failed poll: dropping them would look like a counter reset.
    collectives: tuple[CollectiveStats, ...] = ()
    up: bool = False
    duration: float = 0.0
    errors_total: dict[str, int] | None = None
    last_error: str = ""
    last_success: float | None = None
    down_logged: bool = False


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
    ) -> None:
        self.poll_interval = poll_interval
        self.analyzer = analyzer
        self.clock = clock
        # Source intervals run on a monotonic clock: a wall clock stepped back must not stop polling.
        self.monotonic = monotonic or (time.monotonic if clock is time.time else clock)
        self.hostname = hostname or socket.gethostname()
        self._tracks = [_SourceTrack(source=s, interval=i, errors_total={}) for s, i in sources]
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
        if self._thread is not None:
            self._thread.join(timeout=10)
        for track in self._tracks:
            track.source.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.poll_once()
            except Exception:  # the loop must survive anything a poll throws
                log.exception("poll failed; retrying next interval")
            self._stop.wait(max(0.0, self.poll_interval - (time.monotonic() - started)))

    def poll_once(self) -> NodeSnapshot:
        now, mono = self.clock(), self.monotonic()
        for track in self._tracks:
            if track.last_run is None or mono - track.last_run >= track.interval * 0.95:
                self._collect(track, now)
                track.last_run = mono
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
                    errors_total=dict(t.errors_total or {}),
                    last_error=t.last_error,
                    last_success=t.last_success,
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

    def _collect(self, track: _SourceTrack, now: float) -> None:
        started = time.perf_counter()
        errors = track.errors_total if track.errors_total is not None else {}
        try:
            reading = track.source.collect()
        except FrexporterError as e:
            self._down(track, e.reason, str(e))
            return
        except Exception as e:  # a bug in one source must not take the others down
            self._down(track, reasons.INTERNAL, f"{type(e).__name__}: {e}")
            log.debug("source %s raised", track.source.name, exc_info=True)
            return
        finally:
            track.duration = time.perf_counter() - started
        track.reading, track.up, track.last_success = reading, True, now
        if reading.collectives is not None:
            track.collectives = reading.collectives
        if track.down_logged:
            log.info("source %s recovered", track.source.name)
            track.down_logged = False
        # Problems inside an otherwise good reading (a corrupt rank file, one GPU counter) count too.
        for reason, message in reading.problems:
            errors[reason] = errors.get(reason, 0) + 1
            track.last_error = message
        track.errors_total = errors

    def _down(self, track: _SourceTrack, reason: str, message: str) -> None:
        errors = track.errors_total if track.errors_total is not None else {}
        errors[reason] = errors.get(reason, 0) + 1
        track.errors_total = errors
        track.up = False
        track.reading = None
        track.last_error = message
        if not track.down_logged:
            log.warning("source %s is down: %s", track.source.name, message)
            track.down_logged = True
