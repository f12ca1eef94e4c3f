"""NvmlSource policy and GPU metric families, against fakes of the GPU boundary.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_nvml.py."""

from __future__ import annotations

import ctypes
import logging
import time
from collections import Counter

import pynvml
import pytest

from frexporter import naming as n
from frexporter.model import GPU_RECOVERY_ACTIONS, EccErrors, GpuReading, RemappedRows
from frexporter.outputs.gpu_metrics import gpu_metric_families
from frexporter.sources.base import SourceError
from frexporter.sources.nvml import GpuBackendError, GpuLost, NvmlSource, PynvmlBackend
from tests.fakes.gpu import (
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION,
    FakeGpu,
    FakeGpuBackend,
    FakePynvml,
    RawGpu,
    full_nvlinks,
)
from tests.shared.nvml import FakeClock, exposition, full_reading, make_source

LOGGER = "frexporter.sources.nvml"
SERIES_BUDGET_PER_GPU = 30  # docs/architecture.md, Budgets


def samples_by_name(reading: GpuReading, **kwargs: bool) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in gpu_metric_families(reading, **kwargs):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def series_per_gpu(reading: GpuReading, **kwargs: bool) -> Counter[str]:
    return Counter(
        sample.labels[n.L_GPU]
        for family in gpu_metric_families(reading, **kwargs)
        for sample in family.samples
    )


def warnings(caplog: pytest.LogCaptureFixture, text: str = "") -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


# --- units and values


def test_pynvml_backend_converts_nvml_units_to_base_units() -> None:
    fake = FakePynvml([RawGpu("GPU-aaa")])
    gpu = make_source(PynvmlBackend(fake)).read().gpus[0]
    assert (gpu.index, gpu.uuid, gpu.name, gpu.lost) == (0, "GPU-aaa", "NVIDIA H100 80GB HBM3", False)
    assert gpu.utilization_ratio == pytest.approx(0.97)
    assert (gpu.memory_used_bytes, gpu.memory_total_bytes) == (60 << 30, 80 << 30)
    assert gpu.temperature_celsius == 61.0
    assert gpu.power_watts == pytest.approx(612.5)  # from mW
    assert gpu.energy_joules == pytest.approx(1_500_000.0)  # from mJ
    assert gpu.sm_clock_hertz == pytest.approx(1.98e9)  # from MHz
    assert gpu.memory_clock_hertz == pytest.approx(2.619e9)
    assert gpu.throttle_reasons == 0x44
    assert gpu.ecc_errors == EccErrors(corrected=3, uncorrected=0)
    assert gpu.remapped_rows == RemappedRows(1, 0, pending=False, failure=False)
    assert gpu.pcie_replays == 2
    assert gpu.nvlink_errors is not None and len(gpu.nvlink_errors) == 18 * 4
    assert gpu.nvlink_errors[(17, "crc_data")] == 17 * 10 + pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA
    assert gpu.recovery_action == 0  # NVML_GPU_RECOVERY_ACTION_NONE


def test_pynvml_backend_maps_nvml_errors_and_probes_nvlinks_once() -> None:
    raw = [
        RawGpu(
            "GPU-old",
            nvlinks=0,
            fail={
                "nvmlDeviceGetTotalEccErrors": pynvml.NVML_ERROR_NOT_SUPPORTED,
                "nvmlDeviceGetCurrentClocksEventReasons": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
                "nvmlDeviceGetPowerUsage": pynvml.NVML_ERROR_NO_PERMISSION,
                "nvmlDeviceGetTemperature": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
            },
        ),
        RawGpu("GPU-gone", fail={"nvmlDeviceGetUUID": pynvml.NVML_ERROR_GPU_IS_LOST}),
    ]
    fake = FakePynvml(raw)
    source = make_source(PynvmlBackend(fake))
    for _ in range(3):
        reading = source.read()
    old, gone = reading.gpus
    assert old.ecc_errors is None and old.nvlink_errors is None  # unsupported: absent
    assert old.throttle_reasons == 0x44  # fell back to the pre-535 function
    assert old.temperature_celsius == 61.0  # and to the CUDA 14 one
    assert old.power_watts is None
    assert dict(reading.field_errors) == {"no_permission": 1}
    assert gone.lost and gone.uuid == ""
    # Links that exist are found once per init, not probed on every poll.
    assert fake.calls["nvmlDeviceGetNvLinkState"] == pynvml.NVML_NVLINK_MAX_LINKS


def test_fake_backend_reading_has_every_field() -> None:
    reading = make_source(FakeGpuBackend([FakeGpu("GPU-a"), FakeGpu("GPU-b")])).read()
    assert [g.uuid for g in reading.gpus] == ["GPU-a", "GPU-b"]
    assert reading.driver_version == "570.86.15"
    assert reading.timestamp == 1_700_000_000.0
    assert reading.field_error_count == 0
    names = samples_by_name(reading)
    assert names[n.GPU_UTILIZATION_RATIO][0] == ({n.L_GPU: "0", n.L_GPU_UUID: "GPU-a"}, 0.97)
    assert names[n.GPU_INFO][1] == (
        {
            n.L_GPU: "1",
            n.L_GPU_UUID: "GPU-b",
            n.L_NAME: "NVIDIA H100 80GB HBM3",
            n.L_DRIVER_VERSION: "570.86.15",
        },
        1.0,
    )
    assert names[n.GPU_ENERGY_JOULES_TOTAL][0][1] == 1.5e6
    active = {
        labels[n.L_REASON]: value for labels, value in names[n.GPU_THROTTLE_REASONS] if labels[n.L_GPU] == "0"
    }
    assert active == {
        "sw_power_cap": 1.0,
        "hw_slowdown": 0.0,
        "sw_thermal_slowdown": 0.0,
        "hw_thermal_slowdown": 0.0,
        "hw_power_brake_slowdown": 0.0,
    }
    assert names[n.GPU_LOST] == [
        ({n.L_GPU: "0", n.L_GPU_UUID: "GPU-a"}, 0.0),
        ({n.L_GPU: "1", n.L_GPU_UUID: "GPU-b"}, 0.0),
    ]


# --- unsupported, failing and lost


def test_unsupported_fields_are_absent_without_error_storm(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    unsupported = {"ecc_errors", "remapped_rows", "nvlink_errors", "pcie_replays", "energy", "recovery_action"}
    backend = FakeGpuBackend(
        [FakeGpu("GPU-a", unsupported=unsupported), FakeGpu("GPU-b", unsupported=unsupported)]
    )
    source = make_source(backend)
    for _ in range(50):
        reading = source.read()
        assert reading.field_error_count == 0
    assert not warnings(caplog)
    debug_lines = [r for r in caplog.records if "not supported" in r.getMessage()]
    assert len(debug_lines) == 2 * len(unsupported)  # one per field per GPU, ever
    names = samples_by_name(reading)
    for absent in (n.GPU_ECC_ERRORS_TOTAL, n.GPU_REMAPPED_ROWS, n.GPU_REMAPPED_ROWS_PENDING):
        assert absent not in names
    assert n.GPU_PCIE_REPLAY_TOTAL not in names
    assert n.GPU_NVLINK_ERRORS_TOTAL not in names
    assert n.GPU_ENERGY_JOULES_TOTAL not in names
    assert n.GPU_RECOVERY_ACTION not in names
    assert len(names[n.GPU_TEMPERATURE_CELSIUS]) == 2


def test_failing_field_is_counted_and_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    gpu = FakeGpu("GPU-a", errors={"temperature": GpuBackendError("timeout", "NVML: Timeout")})
    source = make_source(FakeGpuBackend([gpu, FakeGpu("GPU-b")]))
    for _ in range(20):
        reading = source.read()
        assert dict(reading.field_errors) == {"timeout": 1}
    assert reading.gpus[0].temperature_celsius is None
    assert reading.gpus[0].power_watts == 612.5  # the rest of the GPU still read
    assert reading.gpus[1].temperature_celsius == 61.0
    assert len(warnings(caplog, "temperature")) == 1


def test_gpu_lost_mid_run_keeps_the_others(caplog: pytest.LogCaptureFixture) -> None:
    backend = FakeGpuBackend([FakeGpu("GPU-a"), FakeGpu("GPU-b", lost_after_polls=3), FakeGpu("GPU-c")])
    backend.inject_xid(1, 79)
    source = make_source(backend)
    readings = [source.read() for _ in range(10)]
    assert [r.gpus[1].lost for r in readings[:4]] == [False, False, False, True]
    last = readings[-1]
    a, b, c = last.gpus
    assert not a.lost and not c.lost and a.temperature_celsius == 61.0 and c.power_watts == 612.5
    # The lost GPU keeps its identity and its counters; its readings go absent.
    assert (b.uuid, b.name, b.temperature_celsius, dict(b.xid_errors)) == (
        "GPU-b",
        "NVIDIA H100 80GB HBM3",
        None,
        {79: 1},
    )
    assert last.field_error_count == 0  # lost is a state, not a field error
    names = samples_by_name(last)
    assert {labels[n.L_GPU_UUID]: v for labels, v in names[n.GPU_LOST]} == {
        "GPU-a": 0.0,
        "GPU-b": 1.0,
        "GPU-c": 0.0,
    }
    assert {labels[n.L_GPU] for labels, _ in names[n.GPU_TEMPERATURE_CELSIUS]} == {"0", "2"}
    assert len(warnings(caplog, "is lost")) == 1


# --- whole-source failures


def test_library_missing_raises_source_error_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    clock = FakeClock()
    backend = FakeGpuBackend([FakeGpu("GPU-a")], library_missing=True)
    source = make_source(backend, clock)
    for _ in range(600):  # ten minutes at a 1 s poll
        with pytest.raises(SourceError) as info:
            source.read()
        assert info.value.reason == "library_not_found"
        assert "NVIDIA driver mounted" in str(info.value)
        clock.advance(1.0)
    assert len(warnings(caplog, "NVML library not found")) == 1
    assert len(warnings(caplog)) == 1
    # Backoff: 1, 2, 4, ... capped at 60 s, not one dlopen per poll.
    assert backend.calls["init"] <= 16


def test_init_failure_retries_with_backoff_then_recovers(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    errors = [GpuBackendError("driver", "Driver Not Loaded")] * 3
    backend = FakeGpuBackend([FakeGpu("GPU-a")], init_errors=errors)
    source = make_source(backend, clock)
    outcomes = []
    for _ in range(20):
        try:
            source.read()
            outcomes.append("ok")
        except SourceError as exc:
            outcomes.append(exc.reason)
        clock.advance(1.0)
    assert backend.calls["init"] == 4  # at t=0, 1, 3, 7
    assert outcomes[:7] == ["driver"] * 7 and outcomes[7:] == ["ok"] * 13
    assert len(warnings(caplog, "driver not usable")) == 1
    assert len(warnings(caplog, "recovered")) == 1


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (GpuBackendError("library_not_found"), "library_not_found"),
        (GpuBackendError("driver"), "driver"),
        (GpuBackendError("timeout"), "init_failed"),
        (GpuLost(), "init_failed"),
        (RuntimeError("bug in a backend"), "init_failed"),
    ],
)
def test_init_failure_reasons(error: Exception, reason: str) -> None:
    with pytest.raises(SourceError) as info:
        make_source(FakeGpuBackend(init_errors=[error])).read()
    assert info.value.reason == reason


def test_driver_gone_mid_run_reinitializes(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    backend = FakeGpuBackend([FakeGpu("GPU-a")])
    source = make_source(backend, clock)
    source.read()
    backend.count_error = GpuBackendError("driver", "Uninitialized")
    with pytest.raises(SourceError) as info:
        source.read()
    assert info.value.reason == "driver"
    assert backend.calls["shutdown"] == 1 and not backend.initialized
    backend.count_error = None
    clock.advance(5.0)
    assert source.read().gpus[0].uuid == "GPU-a"
    assert backend.calls["init"] == 2
    assert len(warnings(caplog, "enumeration failed")) == 1
    assert len(warnings(caplog, "recovered")) == 1
    assert not backend.violations


# --- counters


def test_xid_counts_accumulate_across_polls() -> None:
    backend = FakeGpuBackend([FakeGpu("GPU-a"), FakeGpu("GPU-b")])
    source = make_source(backend)
    backend.inject_xid(0, 79, times=2)
    first = source.read()
    backend.inject_xid(0, 13)
    backend.inject_xid(1, 48)
    second = source.read()
    third = source.read()  # no new events: counts stay
    assert dict(first.gpus[0].xid_errors) == {79: 2}
    assert dict(second.gpus[0].xid_errors) == {79: 2, 13: 1}
    assert dict(third.gpus[0].xid_errors) == {79: 2, 13: 1}
    assert dict(third.gpus[1].xid_errors) == {48: 1}
    xids = {
        (labels[n.L_GPU], labels[n.L_XID]): v for labels, v in samples_by_name(third)[n.GPU_XID_ERRORS_TOTAL]
    }
    assert xids == {("0", "13"): 1.0, ("0", "79"): 2.0, ("1", "48"): 1.0}


def test_pynvml_backend_drains_xid_events_without_blocking() -> None:
    fake = FakePynvml([RawGpu("GPU-a"), RawGpu("GPU-b")])
    source = make_source(PynvmlBackend(fake))
    source.read()
    fake.events += [(1, 79), (1, 79), (0, 31)]
    reading = source.read()
    assert dict(reading.gpus[1].xid_errors) == {79: 2}
    assert dict(reading.gpus[0].xid_errors) == {31: 1}
    assert not fake.events


def test_nvlink_sum_does_not_drop_when_a_link_stops_reading() -> None:
    gpu = FakeGpu("GPU-a", nvlink_errors=full_nvlinks(links=4, count=5))
    source = make_source(FakeGpuBackend([gpu]))
    source.read()
    gpu.nvlink_errors = {key: 6 for key in full_nvlinks(links=3)}  # link 3 unreadable now
    totals = {
        labels[n.L_TYPE]: v for labels, v in samples_by_name(source.read())[n.GPU_NVLINK_ERRORS_TOTAL]
    }
    assert totals == {"replay": 23.0, "recovery": 23.0, "crc_flit": 23.0, "crc_data": 23.0}


# --- the recovery action (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, driver >= 570)

RECOVERY_FIELD = NVML_FI_DEV_GET_GPU_RECOVERY_ACTION


def recovery_gpu(uuid: str = "GPU-a", value: float = 0, value_type: int = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT,
                 **kw: object) -> RawGpu:
    return RawGpu(uuid, field_values={RECOVERY_FIELD: (value_type, value)}, **kw)  # type: ignore[arg-type]


def test_recovery_actions_are_nvmls() -> None:
    # nvidia-ml-py names them from 12.570 on; the lowest version pyproject.toml allows does not.
    assert getattr(pynvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", RECOVERY_FIELD) == RECOVERY_FIELD
    prefix = "NVML_GPU_RECOVERY_ACTION_"
    named = {v: k.removeprefix(prefix).lower() for k, v in vars(pynvml).items() if k.startswith(prefix)}
    # A code the exporter does not name yet is exported as "unknown"; the ones it names are NVML's names.
    assert all(GPU_RECOVERY_ACTIONS.get(code, name) == name for code, name in named.items()), named


# nvml.h's nvmlDeviceGpuRecoveryAction_t: NVML_GPU_RECOVERY_ACTION_NONE = 0, ..._SYSTEM_REBOOT = 7.
@pytest.mark.parametrize(("code", "action"), [
    (0, "none"),
    (1, "gpu_reset"),
    (2, "node_reboot"),
    (3, "drain_p2p"),
    (4, "drain_and_reset"),
    (5, "recover_imex_domain"),
    (6, "bus_reset"),
    (7, "system_reboot"),
    (42, "unknown"),  # a newer driver's action: one series still, never a field error
])
def test_recovery_action_is_one_series_naming_the_action(code: int, action: str) -> None:
    fake = FakePynvml([recovery_gpu("GPU-a", code), RawGpu("GPU-b")])
    reading = make_source(PynvmlBackend(fake)).read()
    assert reading.gpus[0].recovery_action == code
    assert reading.field_error_count == 0
    assert samples_by_name(reading)[n.GPU_RECOVERY_ACTION] == [
        ({n.L_GPU: "0", n.L_GPU_UUID: "GPU-a", n.L_ACTION: action}, 1.0),
        ({n.L_GPU: "1", n.L_GPU_UUID: "GPU-b", n.L_ACTION: "none"}, 1.0),
    ]


def test_recovery_action_follows_the_driver_from_poll_to_poll() -> None:
    raw = recovery_gpu("GPU-a", 0)
    source = make_source(PynvmlBackend(FakePynvml([raw])))
    actions = []
    for code in (0, 1, 1, 0):
        raw.field_values[RECOVERY_FIELD] = (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, code)
        actions.append([labels[n.L_ACTION] for labels, _ in samples_by_name(source.read())[n.GPU_RECOVERY_ACTION]])
    assert actions == [["none"], ["gpu_reset"], ["gpu_reset"], ["none"]]


@pytest.mark.parametrize("value_type", [pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, pynvml.NVML_VALUE_TYPE_SIGNED_INT,
                                        pynvml.NVML_VALUE_TYPE_DOUBLE])
def test_recovery_action_is_read_from_the_member_its_value_type_names(value_type: int) -> None:
    value = 2.0 if value_type == pynvml.NVML_VALUE_TYPE_DOUBLE else 2
    reading = make_source(PynvmlBackend(FakePynvml([recovery_gpu(value=value, value_type=value_type)]))).read()
    assert reading.gpus[0].recovery_action == 2  # NVML_GPU_RECOVERY_ACTION_NODE_REBOOT


@pytest.mark.parametrize("raw", [
    RawGpu("GPU-a", field_values={}),  # a driver before 570: the field's own nvmlReturn is INVALID_ARGUMENT
    RawGpu("GPU-a", field_returns={RECOVERY_FIELD: pynvml.NVML_ERROR_NOT_SUPPORTED}),
    # a libnvidia-ml without the function: pynvml raises FunctionNotFound for the whole call
    RawGpu("GPU-a", fail={"nvmlDeviceGetFieldValues": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND}),
], ids=["field-unknown", "not-supported", "no-function"])
def test_recovery_action_absent_without_error_where_the_driver_has_none(
    raw: RawGpu, caplog: pytest.LogCaptureFixture
) -> None:
    source = make_source(PynvmlBackend(FakePynvml([raw])))
    for _ in range(20):
        reading = source.read()
        assert reading.field_error_count == 0  # benchmarks/gpu_smoke.py fails on field errors: not on this
    assert reading.gpus[0].recovery_action is None
    assert reading.gpus[0].temperature_celsius == 61.0
    assert n.GPU_RECOVERY_ACTION not in samples_by_name(reading)
    assert not warnings(caplog)


def test_recovery_action_failures_are_field_errors_or_a_lost_gpu(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakePynvml([
        RawGpu("GPU-slow", field_returns={RECOVERY_FIELD: pynvml.NVML_ERROR_TIMEOUT}),
        recovery_gpu("GPU-garbage", value=1, value_type=99),
        RawGpu("GPU-gone", field_returns={RECOVERY_FIELD: pynvml.NVML_ERROR_GPU_IS_LOST}),
    ])
    source = make_source(PynvmlBackend(fake))
    for _ in range(3):
        reading = source.read()
    slow, garbage, gone = reading.gpus
    assert slow.recovery_action is None and garbage.recovery_action is None
    assert dict(reading.field_errors) == {"timeout": 1, "invalid_value": 1}
    assert gone.lost
    assert len(warnings(caplog, "recovery_action")) == 2  # once per GPU and reason, not per poll


# --- exposition


def test_series_per_gpu_within_budget() -> None:
    reading = full_reading()
    per_gpu = series_per_gpu(reading)
    assert len(per_gpu) == 8
    # 27 fixed series (the recovery action is one, whatever the action) + 2 Xid codes seen; 18 NVLinks summed
    # per type.
    assert set(per_gpu.values()) == {29}
    assert max(per_gpu.values()) <= SERIES_BUDGET_PER_GPU
    # Per-link NVLink series are opt-in: 18 links x 4 types instead of 4.
    assert set(series_per_gpu(reading, nvlink_per_link=True).values()) == {29 - 4 + 18 * 4}


def test_families_are_fresh_per_call() -> None:
    reading = full_reading(2)
    assert exposition(reading) == exposition(reading)


# --- the real library


def _nvml_library_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_real_pynvml_backend() -> None:
    source = NvmlSource(PynvmlBackend())
    try:
        if _nvml_library_present():
            # A GPU machine: the real path must read every GPU.
            reading = source.read()
            assert reading.gpus and all(g.uuid.startswith("GPU-") for g in reading.gpus)
            assert any(g.memory_total_bytes for g in reading.gpus)
            major = int((reading.driver_version or "0").split(".")[0])
            if major >= 570:  # the driver knows the recovery action: read through nvmlDeviceGetFieldValues
                assert all(g.recovery_action is not None for g in reading.gpus if not g.lost)
            return
        started = time.monotonic()
        with pytest.raises(SourceError) as info:
            source.read()
        assert info.value.reason == "library_not_found"
        assert time.monotonic() - started < 2.0
    finally:
        source.close()


def test_close_shuts_nvml_down() -> None:
    backend = FakeGpuBackend([FakeGpu("GPU-a")])
    source = make_source(backend)
    source.read()
    source.close()
    assert backend.calls["shutdown"] == 1 and not backend.initialized
