"""GPU state from NVML, behind a small backend interface.

``GpuBackend`` is the hardware boundary: ``PynvmlBackend`` talks to the real
driver (``pynvml`` imported lazily, so the exporter starts on GPU-less nodes),
``tests/fakes/gpu.py`` scripts it for CI. ``NvmlSource`` holds the policy:
which failures take the whole source down (``SourceError``), which only blank
one field, retry with backoff, log once per state change, and accumulate Xid
events into counters.

Backend contract: every method returns values in base units (bytes, celsius,
watts, joules, hertz, ratio 0..1) or raises a ``GpuBackendError``;
``FieldNotSupported`` means "this model has no such reading" and becomes an
absent field, ``GpuLost`` marks the GPU lost.
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

from frexporter import naming, reasons
from frexporter.errors import FrexporterError
from frexporter.model import NVLINK_ERROR_TYPES, EccErrors, GpuReading, GpuState, RemappedRows
from frexporter.sources.base import Reading, SourceError

log = logging.getLogger(__name__)


class GpuBackendError(FrexporterError):
    """A backend call failed; ``reason`` is one of the GPU reasons in frexporter.reasons (the ``reason`` label of
    frexporter_source_errors_total, for whole-source and per-field failures)."""


class FieldNotSupported(GpuBackendError):
    def __init__(self, message: str = "not supported") -> None:
        super().__init__(reasons.NOT_SUPPORTED, message)


class GpuLost(GpuBackendError):
    def __init__(self, message: str = "GPU is lost") -> None:
        super().__init__(reasons.GPU_LOST, message)


@dataclass(frozen=True)
class XidEvent:
    index: int
    xid: int


class GpuBackend(Protocol):
    """The hardware boundary. Per-device methods take the NVML index."""

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def driver_version(self) -> str: ...
    def device_count(self) -> int: ...
    def identity(self, index: int) -> tuple[str, str]:
        """(uuid, product name)."""
        ...

    def utilization(self, index: int) -> float: ...
    def memory(self, index: int) -> tuple[int, int]:
        """(used, total) bytes."""
        ...

    def temperature(self, index: int) -> float: ...
    def power(self, index: int) -> float: ...
    def energy(self, index: int) -> float:
        """Joules consumed since the driver loaded."""
        ...

    def sm_clock(self, index: int) -> float: ...
    def memory_clock(self, index: int) -> float: ...
    def throttle_reasons(self, index: int) -> int:
        """NVML's clock-event (throttle) reasons bitmask."""
        ...

    def ecc_errors(self, index: int) -> EccErrors: ...
    def remapped_rows(self, index: int) -> RemappedRows: ...
    def pcie_replays(self, index: int) -> int: ...
    def nvlink_errors(self, index: int) -> Mapping[tuple[int, str], int]:
        """(link, type) -> count, type in NVLINK_ERROR_TYPES."""
        ...

    def poll_xid_events(self) -> Sequence[XidEvent]:
        """Critical Xid events since the last call; never blocks."""
        ...


# --- value checks: a backend is outside data; a bad value blanks one field.


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"not a finite number: {value!r}")
    return float(value)


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"not a count: {value!r}")
    return value


def _ratio(value: object) -> dict[str, object]:
    ratio = _number(value)
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio out of range: {ratio}")
    return {"utilization_ratio": ratio}


def _memory(value: object) -> dict[str, object]:
    if not isinstance(value, tuple) or len(value) != 2:
        raise ValueError(f"not (used, total): {value!r}")
    return {"memory_used_bytes": _count(value[0]), "memory_total_bytes": _count(value[1])}


def _ecc(value: object) -> dict[str, object]:
    if not isinstance(value, EccErrors):
        raise ValueError(f"not EccErrors: {value!r}")
    return {"ecc_errors": EccErrors(_count(value.corrected), _count(value.uncorrected))}


def _remapped(value: object) -> dict[str, object]:
    if not isinstance(value, RemappedRows):
        raise ValueError(f"not RemappedRows: {value!r}")
    rows = RemappedRows(
        _count(value.correctable), _count(value.uncorrectable), bool(value.pending), bool(value.failure)
    )
    return {"remapped_rows": rows}


def _nvlink(value: object) -> dict[str, object]:
    if not isinstance(value, Mapping):
        raise ValueError(f"not a mapping: {value!r}")
    out: dict[tuple[int, str], int] = {}
    for key, count in value.items():
        if not (isinstance(key, tuple) and len(key) == 2 and key[1] in NVLINK_ERROR_TYPES):
            raise ValueError(f"bad NVLink key: {key!r}")
        out[(_count(key[0]), key[1])] = _count(count)
    return {"nvlink_errors": out}


def _scalar(attr: str, check: Callable[[object], float | int]) -> Callable[[object], dict[str, object]]:
    return lambda value: {attr: check(value)}


# Backend method name -> converter into GpuState fields. The method name is
# also the field name in logs and tests (FakeGpu uses the same names).
_FIELDS: tuple[tuple[str, Callable[[object], dict[str, object]]], ...] = (
    ("utilization", _ratio),
    ("memory", _memory),
    ("temperature", _scalar("temperature_celsius", _number)),
    ("power", _scalar("power_watts", _number)),
    ("energy", _scalar("energy_joules", _number)),
    ("sm_clock", _scalar("sm_clock_hertz", _number)),
    ("memory_clock", _scalar("memory_clock_hertz", _number)),
    ("throttle_reasons", _scalar("throttle_reasons", _count)),
    ("ecc_errors", _ecc),
    ("remapped_rows", _remapped),
    ("pcie_replays", _scalar("pcie_replays", _count)),
    ("nvlink_errors", _nvlink),
)


def _reason_of(exc: BaseException) -> str:
    if isinstance(exc, GpuBackendError):
        return exc.reason
    if isinstance(exc, ValueError):
        return reasons.INVALID_VALUE
    return reasons.UNKNOWN


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
        problems = tuple((reason, f"{count} GPU field reads failed ({reason})")
                         for reason, count in gpus.field_errors.items() for _ in range(count))
        return Reading(gpus=gpus, problems=problems)

    def read(self) -> GpuReading:
        """Every GPU, once; raises SourceError when NVML as a whole is unusable."""
        with self._lock:
            if not self._initialized:
                self._init()
            try:
                count = _count(self._backend.device_count())
            except Exception as exc:
                raise self._fail_running(exc) from exc
            errors: Counter[str] = Counter()
            partial = [self._read_gpu(index, errors) for index in range(count)]
            self._poll_xids(errors)
            gpus = tuple(
                GpuState(**kwargs, xid_errors=MappingProxyType(dict(self._xid.get(key, {}))))
                for key, kwargs in partial
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
            reason = _reason_of(exc)
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
        reason = _reason_of(exc)
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
        for method, convert in _FIELDS:
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
        reason = _reason_of(exc)
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

    def _monotonic_nvlink(
        self, key: str, current: dict[tuple[int, str], int]
    ) -> Mapping[tuple[int, str], int]:
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
                index, xid = _count(event.index), _count(event.xid)
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


# --- the real backend

# NVML error code names -> reasons; looked up on the module at call time.
_NVML_REASONS = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": reasons.LIBRARY_NOT_FOUND,
    "NVML_ERROR_DRIVER_NOT_LOADED": reasons.DRIVER,
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": reasons.DRIVER,
    "NVML_ERROR_UNINITIALIZED": reasons.DRIVER,
    "NVML_ERROR_NOT_SUPPORTED": reasons.NOT_SUPPORTED,
    "NVML_ERROR_FUNCTION_NOT_FOUND": reasons.NOT_SUPPORTED,
    "NVML_ERROR_GPU_IS_LOST": reasons.GPU_LOST,
    "NVML_ERROR_RESET_REQUIRED": reasons.GPU_LOST,
    "NVML_ERROR_GPU_NOT_FOUND": reasons.GPU_LOST,
    "NVML_ERROR_NO_PERMISSION": reasons.NO_PERMISSION,
    "NVML_ERROR_TIMEOUT": reasons.TIMEOUT,
}
_NVLINK_COUNTERS = (
    ("NVML_NVLINK_ERROR_DL_REPLAY", "replay"),
    ("NVML_NVLINK_ERROR_DL_RECOVERY", "recovery"),
    ("NVML_NVLINK_ERROR_DL_CRC_FLIT", "crc_flit"),
    ("NVML_NVLINK_ERROR_DL_CRC_DATA", "crc_data"),
)
# Bounds the drain of the event set per poll; a storm is still counted next poll.
_MAX_EVENTS_PER_POLL = 256


def _translate(nv: Any, exc: Exception) -> GpuBackendError:
    if isinstance(exc, GpuBackendError):
        return exc
    if isinstance(exc, getattr(nv, "NVMLError", ())):
        code = getattr(exc, "value", None)
        reason = next(
            (r for name, r in _NVML_REASONS.items() if getattr(nv, name, object()) == code), reasons.UNKNOWN
        )
        if reason == reasons.NOT_SUPPORTED:
            return FieldNotSupported(str(exc))
        if reason == reasons.GPU_LOST:
            return GpuLost(str(exc))
        return GpuBackendError(reason, f"NVML: {exc}")
    if isinstance(exc, getattr(nv, "NVMLLibraryMismatchError", ())):
        return GpuBackendError(reasons.DRIVER, f"pynvml does not match the driver: {exc}")
    return GpuBackendError(reasons.UNKNOWN, f"{type(exc).__name__}: {exc}")


def _handle_address(handle: object) -> int | None:
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value  # type: ignore[arg-type]
    except (TypeError, ctypes.ArgumentError):
        return None


class PynvmlBackend:
    """``GpuBackend`` over nvidia-ml-py, converting NVML units to base units.

    ``module`` replaces ``pynvml`` (tests pass a fake with NVML's raw units).
    """

    def __init__(self, module: Any = None) -> None:
        self._module = module
        self._handles: dict[int, Any] = {}
        self._by_address: dict[int, int] = {}
        self._nvlinks: dict[int, tuple[int, ...]] = {}
        self._event_set: Any = None

    def _nv(self) -> Any:
        if self._module is None:
            try:
                import pynvml  # lazy: GPU-less nodes and tests never need it
            except ImportError as exc:
                raise GpuBackendError(
                    reasons.LIBRARY_NOT_FOUND, "nvidia-ml-py (pynvml) is not installed"
                ) from exc
            self._module = pynvml
        return self._module

    def _call(self, name: str, *args: Any) -> Any:
        nv = self._nv()
        try:
            return getattr(nv, name)(*args)
        except Exception as exc:
            raise _translate(nv, exc) from exc

    def _call_first(self, names: tuple[str, ...], *args: Any) -> Any:
        # NVML renames functions across driver generations; use the first
        # one that both pynvml and the driver know.
        nv = self._nv()
        unsupported: GpuBackendError = FieldNotSupported(f"pynvml has none of {names}")
        for name in names:
            if not hasattr(nv, name):
                continue
            try:
                return self._call(name, *args)
            except FieldNotSupported as exc:
                unsupported = exc
        raise unsupported

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            handle = self._call("nvmlDeviceGetHandleByIndex", index)
            self._handles[index] = handle
            address = _handle_address(handle)
            if address is not None:
                self._by_address[address] = index
        return self._handles[index]

    def init(self) -> None:
        self._forget()
        self._call("nvmlInit")
        try:
            self._register_xid_events()
        except Exception as exc:
            # Metrics work without Xid counters; don't fail (and leak) an init.
            log.info("NVML Xid events unavailable: %s", exc)

    def shutdown(self) -> None:
        nv = self._nv()
        if self._event_set is not None:
            try:
                nv.nvmlEventSetFree(self._event_set)
            except Exception:
                log.debug("nvmlEventSetFree failed", exc_info=True)
        self._forget()
        self._call("nvmlShutdown")

    def _forget(self) -> None:
        # Handles and probes are only valid for one nvmlInit.
        self._event_set = None
        self._handles.clear()
        self._by_address.clear()
        self._nvlinks.clear()

    def driver_version(self) -> str:
        return str(self._call("nvmlSystemGetDriverVersion"))

    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount"))

    def identity(self, index: int) -> tuple[str, str]:
        handle = self._handle(index)
        return str(self._call("nvmlDeviceGetUUID", handle)), str(self._call("nvmlDeviceGetName", handle))

    def utilization(self, index: int) -> float:
        return self._call("nvmlDeviceGetUtilizationRates", self._handle(index)).gpu / 100.0

    def memory(self, index: int) -> tuple[int, int]:
        info = self._call("nvmlDeviceGetMemoryInfo", self._handle(index))
        return int(info.used), int(info.total)

    def temperature(self, index: int) -> float:
        sensor = self._nv().NVML_TEMPERATURE_GPU
        # nvmlDeviceGetTemperature is deprecated (gone in CUDA 14 drivers).
        names = ("nvmlDeviceGetTemperature", "nvmlDeviceGetTemperatureV")
        return float(self._call_first(names, self._handle(index), sensor))

    def power(self, index: int) -> float:
        return self._call("nvmlDeviceGetPowerUsage", self._handle(index)) / 1000.0  # mW

    def energy(self, index: int) -> float:
        return self._call("nvmlDeviceGetTotalEnergyConsumption", self._handle(index)) / 1000.0  # mJ

    def sm_clock(self, index: int) -> float:
        return (
            self._call("nvmlDeviceGetClockInfo", self._handle(index), self._nv().NVML_CLOCK_SM) * 1e6
        )  # MHz

    def memory_clock(self, index: int) -> float:
        return self._call("nvmlDeviceGetClockInfo", self._handle(index), self._nv().NVML_CLOCK_MEM) * 1e6

    def throttle_reasons(self, index: int) -> int:
        handle = self._handle(index)
        try:
            return int(self._call("nvmlDeviceGetCurrentClocksEventReasons", handle))
        except FieldNotSupported:
            # Drivers before 535 only know the older name of the same bitmask.
            return int(self._call("nvmlDeviceGetCurrentClocksThrottleReasons", handle))

    def ecc_errors(self, index: int) -> EccErrors:
        # Volatile: counts since the driver loaded, updated live (aggregate
        # counts are flushed to the inforom lazily). A driver reload is a
        # counter reset, which Prometheus handles.
        nv, handle = self._nv(), self._handle(index)
        get = "nvmlDeviceGetTotalEccErrors"
        return EccErrors(
            corrected=int(self._call(get, handle, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC)),
            uncorrected=int(
                self._call(get, handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
            ),
        )

    def remapped_rows(self, index: int) -> RemappedRows:
        correctable, uncorrectable, pending, failure = self._call(
            "nvmlDeviceGetRemappedRows", self._handle(index)
        )
        return RemappedRows(int(correctable), int(uncorrectable), bool(pending), bool(failure))

    def pcie_replays(self, index: int) -> int:
        return int(self._call("nvmlDeviceGetPcieReplayCounter", self._handle(index)))

    def nvlink_errors(self, index: int) -> Mapping[tuple[int, str], int]:
        nv, handle = self._nv(), self._handle(index)
        links = self._nvlink_candidates(index, handle)
        if not links:
            raise FieldNotSupported("no NVLink")
        out: dict[tuple[int, str], int] = {}
        for link in links:
            for const, kind in _NVLINK_COUNTERS:
                try:
                    out[(link, kind)] = int(
                        self._call("nvmlDeviceGetNvLinkErrorCounter", handle, link, getattr(nv, const))
                    )
                except FieldNotSupported:
                    continue
        return out

    def _nvlink_candidates(self, index: int, handle: Any) -> tuple[int, ...]:
        # Which links exist is fixed per device: probe once per init, not 18+
        # failing calls per poll on PCIe parts.
        if index not in self._nvlinks:
            found = []
            for link in range(int(getattr(self._nv(), "NVML_NVLINK_MAX_LINKS", 18))):
                try:
                    self._call("nvmlDeviceGetNvLinkState", handle, link)
                except GpuLost:
                    raise
                except GpuBackendError:
                    continue
                found.append(link)
            self._nvlinks[index] = tuple(found)
        return self._nvlinks[index]

    def _register_xid_events(self) -> None:
        nv = self._nv()
        xid = nv.nvmlEventTypeXidCriticalError
        try:
            event_set = nv.nvmlEventSetCreate()
        except Exception as exc:
            log.info("NVML event set unavailable, no Xid counters: %s", exc)
            return
        registered = 0
        try:
            count = self.device_count()
        except GpuBackendError:
            count = 0  # collect() reports the enumeration failure itself
        for index in range(count):
            try:
                handle = self._handle(index)
                if self._call("nvmlDeviceGetSupportedEventTypes", handle) & xid:
                    self._call("nvmlDeviceRegisterEvents", handle, xid, event_set)
                    registered += 1
            except GpuBackendError as exc:
                log.info("GPU %d: no Xid events (%s)", index, exc)
        if registered:
            self._event_set = event_set
        else:
            nv.nvmlEventSetFree(event_set)

    def poll_xid_events(self) -> Sequence[XidEvent]:
        if self._event_set is None:
            return ()
        nv = self._nv()
        events: list[XidEvent] = []
        for _ in range(_MAX_EVENTS_PER_POLL):
            try:
                data = nv.nvmlEventSetWait_v2(self._event_set, 0)
            except nv.NVMLError_Timeout:
                break
            except Exception as exc:
                raise _translate(nv, exc) from exc
            if data.eventType & nv.nvmlEventTypeXidCriticalError:
                events.append(XidEvent(self._index_of(data.device), int(data.eventData)))
        return events

    def _index_of(self, handle: Any) -> int:
        address = _handle_address(handle)
        if address is not None and address in self._by_address:
            return self._by_address[address]
        # Handles from events are fresh ctypes objects; fall back to asking.
        return int(self._call("nvmlDeviceGetIndex", handle))
