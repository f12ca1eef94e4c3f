"""Fakes for the GPU boundary.

``FakeGpuBackend`` implements ``GpuBackend`` (values already in base units)
for NvmlSource policy tests. ``FakePynvml`` stands in for the ``pynvml``
module itself, speaking NVML's raw units and raising pynvml's real exception
classes, so ``PynvmlBackend`` conversions are tested without a GPU.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

from frexporter.model import NVLINK_ERROR_TYPES, EccErrors, RemappedRows
from frexporter.sources.nvml import FieldNotSupported, GpuBackendError, GpuLost, XidEvent

GIB = 1 << 30
# NVML's ABI (nvml.h), spelled here: nvidia-ml-py before 12.570, which pyproject.toml still allows, lacks the names.
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
NVML_GPU_RECOVERY_ACTION_NONE = 0


def full_nvlinks(links: int = 18, count: int = 0) -> dict[tuple[int, str], int]:
    return {(link, kind): count for link in range(links) for kind in NVLINK_ERROR_TYPES}


@dataclass
class FakeGpu:
    """One GPU; field names match GpuBackend method names."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    utilization: float = 0.97
    memory: tuple[int, int] = (60 * GIB, 80 * GIB)
    temperature: float = 61.0
    power: float = 612.5
    energy: float = 1.5e6
    sm_clock: float = 1.98e9
    memory_clock: float = 2.619e9
    throttle_reasons: int = 0x04
    ecc_errors: EccErrors = field(default_factory=lambda: EccErrors(corrected=3, uncorrected=0))
    remapped_rows: RemappedRows = field(
        default_factory=lambda: RemappedRows(1, 0, pending=False, failure=False)
    )
    pcie_replays: int = 0
    nvlink_errors: Mapping[tuple[int, str], int] = field(default_factory=full_nvlinks)
    recovery_action: int = 0  # NVML_GPU_RECOVERY_ACTION_NONE
    # Fields that raise FieldNotSupported, as on a model without them.
    unsupported: set[str] = field(default_factory=set)
    # Field -> exception raised on every read.
    errors: dict[str, Exception] = field(default_factory=dict)
    # Every per-device call raises GpuLost once the backend has served more
    # than this many polls (a poll = one device_count() call).
    lost_after_polls: int | None = None


Chaos = Callable[[str], Any]
NORMAL = object()  # what a Chaos hook returns to let the call through


class Hang:
    """A ``Chaos`` hook that blocks calls of ``method`` as a hung driver does (a GPU off the bus, NVSentinel
    #1574): each for ``seconds``, or until ``release()`` where ``seconds`` is None (forever), after ``after`` calls
    that went through. ``raises``, where given, is raised by each blocked call once it unblocks (or at once, with
    ``seconds=0``). ``entered`` counts the blocked calls begun, ``inside`` those not returned yet."""

    def __init__(self, method: str = "device_count", *, seconds: float | None = None, after: int = 0,
                 raises: Exception | None = None) -> None:
        self.method = method
        self.seconds = seconds
        self.after = after
        self.raises = raises
        self.entered = 0
        self.inside = 0
        self._released = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, method: str) -> Any:
        if method != self.method:
            return NORMAL
        with self._lock:
            if self.after > 0:
                self.after -= 1
                return NORMAL
            self.entered += 1
            self.inside += 1
        try:
            if self.seconds != 0:
                self._released.wait(self.seconds)
        finally:
            with self._lock:
                self.inside -= 1
        return self.raises if self.raises is not None else NORMAL

    def release(self) -> None:
        """Every blocked call returns now, and later ones do not block."""
        self._released.set()


class FakeGpuBackend:
    """Scriptable ``GpuBackend``.

    ``library_missing`` makes every init() fail like a node without the
    driver; ``init_errors`` are raised by successive init() calls, then init
    succeeds. ``chaos(method)`` may return an exception (raised), a value
    (returned as is, to feed garbage) or ``NORMAL``.
    """

    def __init__(
        self,
        gpus: Sequence[FakeGpu] = (),
        *,
        library_missing: bool = False,
        init_errors: Sequence[Exception] = (),
        driver: str = "570.86.15",
        chaos: Chaos | None = None,
    ) -> None:
        self.gpus = list(gpus)
        self.library_missing = library_missing
        self.init_errors = list(init_errors)
        self.driver = driver
        self.chaos = chaos
        self.count_error: Exception | None = None
        self.polls = 0
        self.calls: Counter[str] = Counter()
        self.initialized = False
        # Calls the source should never make (e.g. reads before init()); an
        # assert would be swallowed by the source's error handling.
        self.violations: list[str] = []
        self._xids: list[XidEvent] = []

    def inject_xid(self, index: int, xid: int, times: int = 1) -> None:
        self._xids.extend([XidEvent(index, xid)] * times)

    def _enter(self, method: str) -> Any:
        self.calls[method] += 1
        if self.chaos is not None:
            outcome = self.chaos(method)
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome
        return NORMAL

    def init(self) -> None:
        self._enter("init")
        if self.library_missing:
            raise GpuBackendError("library_not_found", "NVML Shared Library Not Found")
        if self.init_errors:
            raise self.init_errors.pop(0)
        self.initialized = True

    def shutdown(self) -> None:
        self._enter("shutdown")
        self.initialized = False

    def driver_version(self) -> str:
        outcome = self._enter("driver_version")
        return self.driver if outcome is NORMAL else outcome

    def device_count(self) -> int:
        outcome = self._enter("device_count")
        if not self.initialized:
            self.violations.append("device_count() before init()")
        if self.count_error is not None:
            raise self.count_error
        self.polls += 1
        return len(self.gpus) if outcome is NORMAL else outcome

    def _read(self, index: int, attr: str) -> Any:
        outcome = self._enter(attr)
        gpu = self.gpus[index]
        if gpu.lost_after_polls is not None and self.polls > gpu.lost_after_polls:
            raise GpuLost()
        if attr in gpu.unsupported:
            raise FieldNotSupported()
        if attr in gpu.errors:
            raise gpu.errors[attr]
        return getattr(gpu, attr) if outcome is NORMAL else outcome

    def identity(self, index: int) -> tuple[str, str]:
        return self._read(index, "uuid"), self._read(index, "name")

    def utilization(self, index: int) -> float:
        return self._read(index, "utilization")

    def memory(self, index: int) -> tuple[int, int]:
        return self._read(index, "memory")

    def temperature(self, index: int) -> float:
        return self._read(index, "temperature")

    def power(self, index: int) -> float:
        return self._read(index, "power")

    def energy(self, index: int) -> float:
        return self._read(index, "energy")

    def sm_clock(self, index: int) -> float:
        return self._read(index, "sm_clock")

    def memory_clock(self, index: int) -> float:
        return self._read(index, "memory_clock")

    def throttle_reasons(self, index: int) -> int:
        return self._read(index, "throttle_reasons")

    def ecc_errors(self, index: int) -> EccErrors:
        return self._read(index, "ecc_errors")

    def remapped_rows(self, index: int) -> RemappedRows:
        return self._read(index, "remapped_rows")

    def pcie_replays(self, index: int) -> int:
        return self._read(index, "pcie_replays")

    def nvlink_errors(self, index: int) -> Mapping[tuple[int, str], int]:
        return self._read(index, "nvlink_errors")

    def recovery_action(self, index: int) -> int:
        return self._read(index, "recovery_action")

    def poll_xid_events(self) -> Sequence[XidEvent]:
        outcome = self._enter("poll_xid_events")
        events, self._xids = self._xids, []
        return events if outcome is NORMAL else outcome


# --- the pynvml module, raw units


@dataclass
class RawGpu:
    """One GPU as NVML reports it: percent, mW, mJ, MHz."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    util_percent: int = 97
    mem_used: int = 60 * GIB
    mem_total: int = 80 * GIB
    temp_c: int = 61
    power_mw: int = 612_500
    energy_mj: int = 1_500_000_000
    sm_mhz: int = 1980
    mem_mhz: int = 2619
    clocks_event_reasons: int = 0x44
    ecc: tuple[int, int] = (3, 0)
    remapped: tuple[int, int, int, int] = (1, 0, 0, 0)
    pcie_replays: int = 2
    nvlinks: int = 18
    # nvmlDeviceGetFieldValues: field id -> (value type NVML_VALUE_TYPE_*, value); a field not listed answers
    # its own nvmlReturn NVML_ERROR_INVALID_ARGUMENT, as a driver that does not know it (an older one) does.
    field_values: dict[int, tuple[int, int | float]] = field(default_factory=lambda: {
        NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, NVML_GPU_RECOVERY_ACTION_NONE),
    })
    # field id -> the per-field nvmlReturn (an NVML error code) instead of its value.
    field_returns: dict[int, int] = field(default_factory=dict)
    # pynvml function name -> NVML error code raised for this GPU.
    fail: dict[str, int] = field(default_factory=dict)


class FakePynvml:
    """Enough of the ``pynvml`` module for ``PynvmlBackend``."""

    def __init__(self, gpus: Sequence[RawGpu], *, library_missing: bool = False) -> None:
        self.gpus = list(gpus)
        self.library_missing = library_missing
        self.events: list[tuple[int, int]] = []  # (index, xid) queued
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        # Constants and exception classes come from the real module; its
        # functions would talk to a real driver, so they do not exist here.
        value = getattr(pynvml, name)
        if name.startswith("nvml") and callable(value):
            raise AttributeError(name)
        return value

    def _error(self, code: int) -> pynvml.NVMLError:
        return pynvml.NVMLError(code)

    def _gpu(self, handle: int, fn: str) -> RawGpu:
        self.calls[fn] += 1
        gpu = self.gpus[handle - 0x1000]
        if fn in gpu.fail:
            raise self._error(gpu.fail[fn])
        return gpu

    def nvmlInit(self) -> None:
        if self.library_missing:
            raise self._error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    def nvmlShutdown(self) -> None:
        pass

    def nvmlSystemGetDriverVersion(self) -> str:
        return "570.86.15"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return 0x1000 + index  # ints cast to c_void_p like real handles

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        return handle - 0x1000

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self._gpu(h, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetName(self, h: int) -> str:
        return self._gpu(h, "nvmlDeviceGetName").name

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=self._gpu(h, "nvmlDeviceGetUtilizationRates").util_percent, memory=10)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        gpu = self._gpu(h, "nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(used=gpu.mem_used, total=gpu.mem_total, free=gpu.mem_total - gpu.mem_used)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._gpu(h, "nvmlDeviceGetTemperature").temp_c

    def nvmlDeviceGetTemperatureV(self, h: int, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._gpu(h, "nvmlDeviceGetTemperatureV").temp_c

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self._gpu(h, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, h: int) -> int:
        return self._gpu(h, "nvmlDeviceGetTotalEnergyConsumption").energy_mj

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        gpu = self._gpu(h, "nvmlDeviceGetClockInfo")
        return {pynvml.NVML_CLOCK_SM: gpu.sm_mhz, pynvml.NVML_CLOCK_MEM: gpu.mem_mhz}[clock]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return self._gpu(h, "nvmlDeviceGetCurrentClocksEventReasons").clocks_event_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: int) -> int:
        return self._gpu(h, "nvmlDeviceGetCurrentClocksThrottleReasons").clocks_event_reasons

    def nvmlDeviceGetTotalEccErrors(self, h: int, error_type: int, counter_type: int) -> int:
        assert counter_type == pynvml.NVML_VOLATILE_ECC
        return self._gpu(h, "nvmlDeviceGetTotalEccErrors").ecc[error_type]

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        return self._gpu(h, "nvmlDeviceGetRemappedRows").remapped

    def nvmlDeviceGetPcieReplayCounter(self, h: int) -> int:
        return self._gpu(h, "nvmlDeviceGetPcieReplayCounter").pcie_replays

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        gpu = self._gpu(h, "nvmlDeviceGetNvLinkState")
        if gpu.nvlinks == 0:
            raise self._error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if link >= gpu.nvlinks:
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return 1

    def nvmlDeviceGetNvLinkErrorCounter(self, h: int, link: int, counter: int) -> int:
        self._gpu(h, "nvmlDeviceGetNvLinkErrorCounter")
        return link * 10 + counter  # distinct per (link, type)

    def nvmlDeviceGetFieldValues(self, h: int, field_ids: list[int]) -> list[SimpleNamespace]:
        # As pynvml's: the call succeeds and every value carries its own nvmlReturn; the union holds garbage
        # (here: no member at all) unless that return is NVML_SUCCESS.
        gpu = self._gpu(h, "nvmlDeviceGetFieldValues")
        members = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
        out = []
        for field_id in field_ids:
            status = gpu.field_returns.get(field_id, pynvml.NVML_SUCCESS)
            if status == pynvml.NVML_SUCCESS and field_id not in gpu.field_values:
                status = pynvml.NVML_ERROR_INVALID_ARGUMENT
            value_type, value = gpu.field_values.get(field_id, (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, 0))
            filled = {members[value_type]: value} if 0 <= value_type < len(members) else {}
            union = SimpleNamespace(**filled) if status == pynvml.NVML_SUCCESS else None
            out.append(SimpleNamespace(fieldId=field_id, scopeId=0, timestamp=0, latencyUsec=0,
                                       valueType=value_type, nvmlReturn=status, value=union))
        return out

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlEventSetFree(self, event_set: str) -> None:
        pass

    def nvmlDeviceGetSupportedEventTypes(self, h: int) -> int:
        return pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeClock

    def nvmlDeviceRegisterEvents(self, h: int, types: int, event_set: str) -> None:
        pass

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> SimpleNamespace:
        assert timeout_ms == 0, "the exporter must never block on the event set"
        if not self.events:
            raise self._error(pynvml.NVML_ERROR_TIMEOUT)
        index, xid = self.events.pop(0)
        return SimpleNamespace(
            device=0x1000 + index, eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=xid
        )
