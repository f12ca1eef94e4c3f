"""``NvmlSource``: the policy over a ``GpuBackend``, one reading of every GPU per ``collect()``.

Which failures take the whole source down (``SourceError``) and which only blank one field, retry with
backoff, a log line once per state change, and Xid events accumulated into counters. What a field's value
may be is ``fields.py``'s; the backend is ``PynvmlBackend`` unless one is given.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from frexporter import naming, reasons
from frexporter.model import GpuReading, GpuState
from frexporter.sources.base import Reading, SourceError
from frexporter.sources.nvml.backend import GpuBackend, GpuLost, XidEvent
from frexporter.sources.nvml.fields import FIELDS, as_count, reason_of
from frexporter.sources.nvml.pynvml_backend import PynvmlBackend

log = logging.getLogger("frexporter.sources.nvml")  # the package's name, as the source's lines have always had


_DOWN_MESSAGES = {
    reasons.LIBRARY_NOT_FOUND: (
        "NVML library not found (libnvidia-ml.so.1): GPU metrics disabled; "
        "is the NVIDIA driver mounted into this container?"
    ),
    reasons.DRIVER: "NVIDIA driver not usable ({exc}): GPU metrics disabled",
    reasons.INIT_FAILED: "NVML init failed ({exc}): GPU metrics disabled",
}


class NvmlSource:
    """Reads every GPU once per ``collect()``; see the module docstring."""

    name = naming.SOURCE_NVML

    def __init__(
        self,
        backend: GpuBackend | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        retry_min_seconds: float = 1.0,
        retry_max_seconds: float = 60.0,
    ) -> None:
        self._backend: GpuBackend = backend if backend is not None else PynvmlBackend()
        self._clock = clock
        self._wall_clock = wall_clock
        self._retry_min = retry_min_seconds
        self._retry_max = retry_max_seconds
        self._backoff = retry_min_seconds
        self._next_attempt = -math.inf
        self._lock = threading.Lock()
        self._initialized = False
        self._driver_version: str | None = None
        self._down: tuple[str, str] | None = None  # (reason, message) while down
        self._ever_up = False
        self._identity: dict[int, tuple[str, str]] = {}  # index -> last (uuid, name)
        # Keyed by GPU key (uuid, or index until a uuid is known) so counters
        # survive a re-init where a lost GPU vanishes and indexes shift.
        self._lost: set[str] = set()
        self._xid: dict[str, Counter[int]] = {}
        self._nvlink_last: dict[str, dict[tuple[int, str], int]] = {}
        self._logged: set[tuple[str, str, str]] = set()

    def collect(self) -> Reading:
        gpus = self.read()
        problems = tuple(
            (reason, f"{count} GPU field reads failed ({reason})")
            for reason, count in gpus.field_errors.items()
            for _ in range(count)
        )
        return Reading(gpus=gpus, problems=problems)

    def read(self) -> GpuReading:
        """Every GPU, once; raises SourceError when NVML as a whole is unusable."""
        with self._lock:
            if not self._initialized:
                self._init()
            try:
                count = as_count(self._backend.device_count())
            except Exception as exc:
                raise self._fail_running(exc) from exc
            errors: Counter[str] = Counter()
            partial = [self._read_gpu(index, errors) for index in range(count)]
            self._poll_xids(errors)
            gpus = tuple(
                GpuState(**kwargs, xid_errors=MappingProxyType(dict(self._xid.get(key, {})))) for key, kwargs in partial
            )
            self._mark_up(count)
            return GpuReading(
                timestamp=self._wall_clock(),
                gpus=gpus,
                driver_version=self._driver_version,
                field_errors=MappingProxyType(dict(errors)),
            )

    def close(self) -> None:
        with self._lock:
            self._teardown()

    # --- whole-source state

    def _init(self) -> None:
        now = self._clock()
        if now < self._next_attempt and self._down is not None:
            # Backing off: report the same failure without touching NVML.
            raise SourceError(*self._down)
        try:
            self._backend.init()
        except Exception as exc:
            reason = reason_of(exc)
            if reason not in (reasons.LIBRARY_NOT_FOUND, reasons.DRIVER):
                reason = reasons.INIT_FAILED
            self._next_attempt = now + self._backoff
            self._backoff = min(self._backoff * 2, self._retry_max)
            raise self._go_down(reason, _DOWN_MESSAGES[reason].format(exc=exc)) from exc
        self._initialized = True
        try:
            version = self._backend.driver_version()
            self._driver_version = version if isinstance(version, str) and version else None
        except Exception:
            self._driver_version = None

    def _fail_running(self, exc: Exception) -> SourceError:
        reason = reason_of(exc)
        if reason in (reasons.DRIVER, reasons.LIBRARY_NOT_FOUND, reasons.GPU_LOST):
            # The driver went away under us: start over, with backoff.
            self._teardown()
            self._next_attempt = self._clock() + self._backoff
            reason = reasons.DRIVER
        elif reason not in (reasons.TIMEOUT, reasons.NO_PERMISSION):
            reason = reasons.UNKNOWN
        return self._go_down(reason, f"NVML device enumeration failed ({exc}): GPU metrics disabled")

    def _go_down(self, reason: str, message: str) -> SourceError:
        if self._down is None or self._down[0] != reason:
            log.warning("%s; retrying with backoff (up to %gs)", message, self._retry_max)
        # Keep strings, not the exception: a stored exception would pin frames.
        self._down = (reason, message)
        return SourceError(reason, message)

    def _mark_up(self, count: int) -> None:
        self._backoff = self._retry_min
        if self._down is not None:
            # WARNING, not INFO, so that whoever saw the outage sees its end.
            log.warning("NVML recovered: GPU metrics enabled again (%d GPUs)", count)
        elif not self._ever_up:
            log.info("NVML up: %d GPUs, driver %s", count, self._driver_version or "unknown")
        self._down = None
        self._ever_up = True

    def _teardown(self) -> None:
        if self._initialized:
            try:
                self._backend.shutdown()
            except Exception:
                log.debug("NVML shutdown failed", exc_info=True)
        self._initialized = False
        # Indexes may name other GPUs after a re-init (a lost one drops out).
        self._identity.clear()

    # --- per GPU

    def _read_gpu(self, index: int, errors: Counter[str]) -> tuple[str, dict[str, Any]]:
        try:
            uuid, name = self._backend.identity(index)
            if not isinstance(uuid, str) or not isinstance(name, str):
                raise ValueError(f"bad identity: {(uuid, name)!r}")
            self._identity[index] = (uuid, name)
        except GpuLost:
            return self._lost_gpu(index)
        except Exception as exc:
            uuid, name = self._identity.get(index, ("", ""))
            self._field_failed(_key(index, uuid), "identity", exc, errors)
        key = _key(index, uuid)
        values: dict[str, Any] = {"index": index, "uuid": uuid, "name": name}
        for method, convert in FIELDS:
            try:
                values.update(convert(getattr(self._backend, method)(index)))
            except GpuLost:
                return self._lost_gpu(index)
            except Exception as exc:
                self._field_failed(key, method, exc, errors)
        if "nvlink_errors" in values:
            values["nvlink_errors"] = self._monotonic_nvlink(key, values["nvlink_errors"])
        if key in self._lost:
            self._lost.discard(key)
            log.warning("GPU %d (%s) readable again", index, uuid)
        return key, values

    def _lost_gpu(self, index: int) -> tuple[str, dict[str, Any]]:
        uuid, name = self._identity.get(index, ("", ""))
        key = _key(index, uuid)
        if key not in self._lost:
            self._lost.add(key)
            log.warning(
                "GPU %d (%s) is lost (fallen off the bus?); other GPUs are still read",
                index,
                uuid or "uuid unknown",
            )
        return key, {"index": index, "uuid": uuid, "name": name, "lost": True}

    def _field_failed(self, key: str, method: str, exc: Exception, errors: Counter[str]) -> None:
        reason = reason_of(exc)
        once = (key, method, reason) not in self._logged
        self._logged.add((key, method, reason))
        if reason == reasons.NOT_SUPPORTED:
            # A model without the reading: expected, silent after one debug line.
            if once:
                log.debug("GPU %s: %s not supported, skipped", key, method)
            return
        errors[reason] += 1
        log.log(
            logging.WARNING if once else logging.DEBUG,
            "GPU %s: reading %s failed (%s): %s",
            key,
            method,
            reason,
            exc,
        )

    def _monotonic_nvlink(self, key: str, current: dict[tuple[int, str], int]) -> Mapping[tuple[int, str], int]:
        # A link that reads this poll and not the next must not make the
        # per-type sum drop (Prometheus would see a counter reset): keep its
        # last value.
        merged = {**self._nvlink_last.get(key, {}), **current}
        self._nvlink_last[key] = merged
        return MappingProxyType(merged)

    def _poll_xids(self, errors: Counter[str]) -> None:
        try:
            events = list(self._backend.poll_xid_events())
        except Exception as exc:
            self._field_failed("*", "xid_events", exc, errors)
            return
        for event in events:
            try:
                if not isinstance(event, XidEvent):
                    raise ValueError(f"not an XidEvent: {event!r}")
                index, xid = as_count(event.index), as_count(event.xid)
            except ValueError as exc:
                self._field_failed("*", "xid_events", exc, errors)
                continue
            uuid, _ = self._identity.get(index, ("", ""))
            key = _key(index, uuid)
            self._xid.setdefault(key, Counter())[xid] += 1
            # First of each code per GPU at WARNING; a storm of one code is in
            # the counter (and the kernel log), not in ours.
            once = (key, "xid", str(xid)) not in self._logged
            self._logged.add((key, "xid", str(xid)))
            log.log(
                logging.WARNING if once else logging.DEBUG,
                "GPU %d (%s): Xid %d",
                index,
                uuid or "uuid unknown",
                xid,
            )


def _key(index: int, uuid: str) -> str:
    return uuid or f"index:{index}"
