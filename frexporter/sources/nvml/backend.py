"""The GPU hardware boundary: the ``GpuBackend`` protocol, the ``XidEvent`` it reports, and the errors it raises.

Every method returns values in base units (bytes, celsius, watts, joules, hertz, ratio 0..1) or raises a
``GpuBackendError``; ``FieldNotSupported`` means "this model has no such reading" and becomes an absent field,
``GpuLost`` marks the GPU lost. ``PynvmlBackend`` implements it over the driver, ``tests/fakes/gpu.py`` for CI.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from frexporter import reasons
from frexporter.errors import FrexporterError
from frexporter.model import EccErrors, RemappedRows


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

    def recovery_action(self, index: int) -> int:
        """NVML's GPU recovery action code (``model.GPU_RECOVERY_ACTIONS``; 0: none needed). Drivers before 570
        do not know the field: ``FieldNotSupported``."""
        ...

    def poll_xid_events(self) -> Sequence[XidEvent]:
        """Critical Xid events since the last call; never blocks."""
        ...
