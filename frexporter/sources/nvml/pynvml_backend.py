"""``PynvmlBackend``: the ``GpuBackend`` contract over nvidia-ml-py (``pynvml``), the only module that calls NVML.

It converts NVML's units to base units and NVML's errors to ``GpuBackendError`` reasons, picks whichever name
of a renamed NVML function the driver knows, probes NVLinks once per init, and drains the Xid event set
without blocking. ``pynvml`` is imported on first use, so GPU-less nodes and tests never load it.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from frexporter import reasons
from frexporter.model import EccErrors, RemappedRows
from frexporter.sources.nvml.backend import FieldNotSupported, GpuBackendError, GpuLost, XidEvent

log = logging.getLogger("frexporter.sources.nvml")  # the package's name, as the source's lines have always had

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
# nvmlDeviceGetFieldValues fills a union; a value's valueType (NVML_VALUE_TYPE_*, 0..6) names its member.
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
# The field ids are NVML's ABI: the number serves a pynvml too old to name them.
_FI_GPU_RECOVERY_ACTION = ("NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", 230)  # driver >= 570


def _translate(nv: Any, exc: Exception) -> GpuBackendError:
    if isinstance(exc, GpuBackendError):
        return exc
    if isinstance(exc, getattr(nv, "NVMLError", ())):
        code = getattr(exc, "value", None)
        reason = next((r for name, r in _NVML_REASONS.items() if getattr(nv, name, object()) == code), reasons.UNKNOWN)
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
                raise GpuBackendError(reasons.LIBRARY_NOT_FOUND, "nvidia-ml-py (pynvml) is not installed") from exc
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
        return self._call("nvmlDeviceGetClockInfo", self._handle(index), self._nv().NVML_CLOCK_SM) * 1e6  # MHz

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
            uncorrected=int(self._call(get, handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)),
        )

    def remapped_rows(self, index: int) -> RemappedRows:
        correctable, uncorrectable, pending, failure = self._call("nvmlDeviceGetRemappedRows", self._handle(index))
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

    def recovery_action(self, index: int) -> int:
        value = self._field_value(index, *_FI_GPU_RECOVERY_ACTION)
        if isinstance(value, float):
            if not value.is_integer():
                raise GpuBackendError(reasons.INVALID_VALUE, f"recovery action is not a code: {value!r}")
            return int(value)
        return value

    def _field_value(self, index: int, name: str, number: int) -> int | float:
        """One field of ``nvmlDeviceGetFieldValues``. The call succeeds when any value was filled; each value's
        own ``nvmlReturn`` says whether it is valid (its union is garbage otherwise). A driver that does not know
        the field id (older than the field) answers INVALID_ARGUMENT for it (seen on 580 for ids past its last),
        a GPU without the reading NOT_SUPPORTED: both are "not supported", never a field error."""
        nv = self._nv()
        field_id = int(getattr(nv, name, number))
        values = self._call_first(("nvmlDeviceGetFieldValues",), self._handle(index), [field_id])
        value = values[0]
        status = int(value.nvmlReturn)
        if status != nv.NVML_SUCCESS:
            if status == nv.NVML_ERROR_INVALID_ARGUMENT:
                raise FieldNotSupported(f"the driver does not know {name}")
            raise _translate(nv, nv.NVMLError(status))
        value_type = int(value.valueType)
        if not 0 <= value_type < len(_VALUE_MEMBERS):
            raise GpuBackendError(reasons.INVALID_VALUE, f"{name}: unknown NVML value type {value_type}")
        raw = getattr(value.value, _VALUE_MEMBERS[value_type])
        return float(raw) if value_type == 0 else int(raw)

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
