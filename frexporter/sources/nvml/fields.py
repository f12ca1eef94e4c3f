"""Pure: the fields read from each GPU, and the checks that turn a backend's values into ``GpuState`` fields.

A backend is outside data: a value of the wrong type or out of range raises ``ValueError`` and blanks one
field. ``reason_of`` names the reason (``frexporter.reasons``) any failed read is counted under.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from frexporter import reasons
from frexporter.model import NVLINK_ERROR_TYPES, EccErrors, RemappedRows
from frexporter.sources.nvml.backend import GpuBackendError


def as_number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"not a finite number: {value!r}")
    return float(value)


def as_count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"not a count: {value!r}")
    return value


def _ratio(value: object) -> dict[str, object]:
    ratio = as_number(value)
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio out of range: {ratio}")
    return {"utilization_ratio": ratio}


def _memory(value: object) -> dict[str, object]:
    if not isinstance(value, tuple) or len(value) != 2:
        raise ValueError(f"not (used, total): {value!r}")
    return {"memory_used_bytes": as_count(value[0]), "memory_total_bytes": as_count(value[1])}


def _ecc(value: object) -> dict[str, object]:
    if not isinstance(value, EccErrors):
        raise ValueError(f"not EccErrors: {value!r}")
    return {"ecc_errors": EccErrors(as_count(value.corrected), as_count(value.uncorrected))}


def _remapped(value: object) -> dict[str, object]:
    if not isinstance(value, RemappedRows):
        raise ValueError(f"not RemappedRows: {value!r}")
    rows = RemappedRows(
        as_count(value.correctable), as_count(value.uncorrectable), bool(value.pending), bool(value.failure)
    )
    return {"remapped_rows": rows}


def _nvlink(value: object) -> dict[str, object]:
    if not isinstance(value, Mapping):
        raise ValueError(f"not a mapping: {value!r}")
    out: dict[tuple[int, str], int] = {}
    for key, count in value.items():
        if not (isinstance(key, tuple) and len(key) == 2 and key[1] in NVLINK_ERROR_TYPES):
            raise ValueError(f"bad NVLink key: {key!r}")
        out[(as_count(key[0]), key[1])] = as_count(count)
    return {"nvlink_errors": out}


def _scalar(attr: str, check: Callable[[object], float | int]) -> Callable[[object], dict[str, object]]:
    return lambda value: {attr: check(value)}


# Backend method name -> converter into GpuState fields. The method name is
# also the field name in logs and tests (FakeGpu uses the same names).
FIELDS: tuple[tuple[str, Callable[[object], dict[str, object]]], ...] = (
    ("utilization", _ratio),
    ("memory", _memory),
    ("temperature", _scalar("temperature_celsius", as_number)),
    ("power", _scalar("power_watts", as_number)),
    ("energy", _scalar("energy_joules", as_number)),
    ("sm_clock", _scalar("sm_clock_hertz", as_number)),
    ("memory_clock", _scalar("memory_clock_hertz", as_number)),
    ("throttle_reasons", _scalar("throttle_reasons", as_count)),
    ("ecc_errors", _ecc),
    ("remapped_rows", _remapped),
    ("pcie_replays", _scalar("pcie_replays", as_count)),
    ("nvlink_errors", _nvlink),
    ("recovery_action", _scalar("recovery_action", as_count)),
)


def reason_of(exc: BaseException) -> str:
    if isinstance(exc, GpuBackendError):
        return exc.reason
    if isinstance(exc, ValueError):
        return reasons.INVALID_VALUE
    return reasons.UNKNOWN
