"""Prometheus metric families for one ``GpuReading``.

Every series carries ``gpu`` (NVML index) and ``gpu_uuid``. Absent fields
produce no sample. At defaults a fully instrumented GPU has 27 series plus one
per distinct Xid code it has raised (budget: 30, docs/architecture.md):

- 8 scalars (utilization, memory used/total, temperature, power, energy,
  SM/memory clock), 5 throttle reasons, 2 ECC, 4 remapped rows,
  1 PCIe replay, 4 NVLink error types, 1 recovery action, ``lost`` and ``info``.

Choices a user relies on:

- ``frexporter_gpu_throttle_reasons{reason}`` is a 0/1 gauge, always present
  for the five reasons that mean "slowed down by something other than the
  workload" (power cap, thermal, hardware slowdown, power brake). Fixed series
  let alerts say ``max_over_time(...[5m]) == 1`` without absent() tricks, and
  PromQL has no bitwise AND to test a bitmask. Benign bits (idle, sync boost,
  application or display clock settings) are not exported.
- ``frexporter_gpu_nvlink_errors_total{type}`` sums all links per type:
  18 links x 4 types would be 72 series per GPU. ``nvlink_per_link=True``
  adds a ``link`` label for debugging a node.
- ``frexporter_gpu_xid_errors_total{xid}`` counts Xid events by code since the
  exporter started; a code's series appears with its first event.
- ``frexporter_gpu_recovery_action{action}`` is one series per GPU, valued 1,
  whose ``action`` is what the driver asks for now (``none``, ``gpu_reset``,
  ``node_reboot``, ``drain_p2p``, ``drain_and_reset``, ...: model.GPU_RECOVERY_ACTIONS).
  A series per possible action (a full state set) would cost 8 series per GPU,
  over the budget; one series keeps alerts as readable
  (``frexporter_gpu_recovery_action{action!="none"} == 1``). A change of action
  ends one series and starts another. Absent on drivers before 570.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from frexporter import naming as n
from frexporter.model import NVLINK_ERROR_TYPES, GpuReading, GpuState, gpu_recovery_action_name

# Label value -> NVML clocks-event reason bit (nvmlClocksEventReason*).
THROTTLE_REASONS: tuple[tuple[str, int], ...] = (
    ("sw_power_cap", 0x04),
    ("hw_slowdown", 0x08),
    ("sw_thermal_slowdown", 0x20),
    ("hw_thermal_slowdown", 0x40),
    ("hw_power_brake_slowdown", 0x80),
)

# (extra label values, value) for one GPU.
_Samples = Iterable[tuple[tuple[str, ...], float]]


def _one(value: float | None) -> _Samples:
    return () if value is None else (((), float(value)),)


def _throttle(gpu: GpuState) -> _Samples:
    mask = gpu.throttle_reasons
    if mask is None:
        return ()
    return (((reason,), 1.0 if mask & bit else 0.0) for reason, bit in THROTTLE_REASONS)


def _ecc(gpu: GpuState) -> _Samples:
    ecc = gpu.ecc_errors
    if ecc is None:
        return ()
    return ((("corrected",), ecc.corrected), (("uncorrected",), ecc.uncorrected))


def _remapped(gpu: GpuState) -> _Samples:
    rows = gpu.remapped_rows
    if rows is None:
        return ()
    return ((("correctable",), rows.correctable), (("uncorrectable",), rows.uncorrectable))


def _remap_pending(gpu: GpuState) -> _Samples:
    return () if gpu.remapped_rows is None else _one(float(gpu.remapped_rows.pending))


def _remap_failed(gpu: GpuState) -> _Samples:
    return () if gpu.remapped_rows is None else _one(float(gpu.remapped_rows.failure))


def _nvlink_per_type(gpu: GpuState) -> _Samples:
    errors = gpu.nvlink_errors
    if errors is None:
        return ()
    totals = dict.fromkeys(NVLINK_ERROR_TYPES, 0)
    for (_, kind), count in errors.items():
        totals[kind] += count
    return (((kind,), total) for kind, total in totals.items())


def _nvlink_per_link(gpu: GpuState) -> _Samples:
    errors = gpu.nvlink_errors or {}
    return (((str(link), kind), count) for (link, kind), count in sorted(errors.items()))


def _recovery_action(gpu: GpuState) -> _Samples:
    code = gpu.recovery_action
    return () if code is None else (((gpu_recovery_action_name(code),), 1.0),)


def _xid(gpu: GpuState) -> _Samples:
    return (((str(code),), count) for code, count in sorted(gpu.xid_errors.items()))


class _Family(NamedTuple):
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily]
    name: str
    documentation: str
    labels: tuple[str, ...]
    samples: Callable[[GpuState], _Samples]


_G, _C = GaugeMetricFamily, CounterMetricFamily
_FAMILIES: tuple[_Family, ...] = (
    _Family(
        _G,
        n.GPU_LOST,
        "1 when NVML reports the GPU lost (fallen off the bus); its other readings are absent.",
        (),
        lambda g: _one(float(g.lost)),
    ),
    _Family(
        _G,
        n.GPU_UTILIZATION_RATIO,
        "Fraction of the last sample period a kernel was running (NVML utilization.gpu).",
        (),
        lambda g: _one(g.utilization_ratio),
    ),
    _Family(
        _G, n.GPU_MEMORY_USED_BYTES, "Device memory in use, bytes.", (), lambda g: _one(g.memory_used_bytes)
    ),
    _Family(
        _G, n.GPU_MEMORY_TOTAL_BYTES, "Device memory size, bytes.", (), lambda g: _one(g.memory_total_bytes)
    ),
    _Family(
        _G,
        n.GPU_TEMPERATURE_CELSIUS,
        "GPU core temperature, degrees Celsius.",
        (),
        lambda g: _one(g.temperature_celsius),
    ),
    _Family(_G, n.GPU_POWER_WATTS, "Board power draw, watts.", (), lambda g: _one(g.power_watts)),
    _Family(
        _C,
        n.GPU_ENERGY_JOULES_TOTAL,
        "Energy consumed since the driver loaded, joules.",
        (),
        lambda g: _one(g.energy_joules),
    ),
    _Family(_G, n.GPU_SM_CLOCK_HERTZ, "Current SM clock, hertz.", (), lambda g: _one(g.sm_clock_hertz)),
    _Family(
        _G, n.GPU_MEMORY_CLOCK_HERTZ, "Current memory clock, hertz.", (), lambda g: _one(g.memory_clock_hertz)
    ),
    _Family(
        _G,
        n.GPU_THROTTLE_REASONS,
        "1 while clocks are held down for this reason (NVML clocks-event reasons).",
        (n.L_REASON,),
        _throttle,
    ),
    _Family(
        _C,
        n.GPU_ECC_ERRORS_TOTAL,
        "ECC memory errors since the driver loaded (volatile counters).",
        (n.L_TYPE,),
        _ecc,
    ),
    _Family(
        _G,
        n.GPU_REMAPPED_ROWS,
        "Memory rows remapped, by the error type that caused the remap.",
        (n.L_TYPE,),
        _remapped,
    ),
    _Family(
        _G,
        n.GPU_REMAPPED_ROWS_PENDING,
        "1 when a row remap is pending: the GPU needs a reset.",
        (),
        _remap_pending,
    ),
    _Family(
        _G, n.GPU_REMAPPED_ROWS_FAILED, "1 when a row remap failed: the GPU needs service.", (), _remap_failed
    ),
    _Family(
        _C,
        n.GPU_PCIE_REPLAY_TOTAL,
        "PCIe replays (link-level retransmissions).",
        (),
        lambda g: _one(g.pcie_replays),
    ),
    _Family(
        _G,
        n.GPU_RECOVERY_ACTION,
        "1 for the recovery action the driver asks for now (none, gpu_reset, node_reboot, drain_p2p, "
        "drain_and_reset, ...; NVML, driver >= 570).",
        (n.L_ACTION,),
        _recovery_action,
    ),
    _Family(
        _C,
        n.GPU_XID_ERRORS_TOTAL,
        "Critical Xid events by code since the exporter started.",
        (n.L_XID,),
        _xid,
    ),
)
_NVLINK_HELP = "NVLink data-link errors by type ({})."


def gpu_metric_families(reading: GpuReading, *, nvlink_per_link: bool = False) -> Iterator[Metric]:
    """Fresh families for ``reading``; families without a sample are left out."""
    gpus = reading.gpus
    info = GaugeMetricFamily(
        n.GPU_INFO, "GPU identity; value 1.", labels=(*n.GPU_LABELS, n.L_NAME, n.L_DRIVER_VERSION)
    )
    for gpu in gpus:
        info.add_metric((str(gpu.index), gpu.uuid, gpu.name, reading.driver_version or ""), 1.0)
    if gpus:
        yield info
    nvlink_labels, nvlink_samples, scope = (
        ((n.L_LINK, n.L_TYPE), _nvlink_per_link, "per link")
        if nvlink_per_link
        else ((n.L_TYPE,), _nvlink_per_type, "summed over links")
    )
    nvlink = _Family(_C, n.GPU_NVLINK_ERRORS_TOTAL, _NVLINK_HELP.format(scope), nvlink_labels, nvlink_samples)
    for spec in (*_FAMILIES, nvlink):
        family = spec.kind(spec.name, spec.documentation, labels=(*n.GPU_LABELS, *spec.labels))
        for gpu in gpus:
            base = (str(gpu.index), gpu.uuid)
            for labels, value in spec.samples(gpu):
                family.add_metric((*base, *labels), value)
        if family.samples:
            yield family
