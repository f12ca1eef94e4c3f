"""NvmlSource policy and GPU metric families, against fakes of the GPU boundary.

Its unit tests are in tests/unit/test_nvml.py."""

from __future__ import annotations

import subprocess
import sys

import pynvml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frexporter import naming as n
from frexporter.model import EccErrors, GpuReading, RemappedRows
from frexporter.sources.base import SourceError
from frexporter.sources.nvml import FieldNotSupported, GpuBackendError, GpuLost, XidEvent
from tests.fakes.gpu import NORMAL, FakeGpu, FakeGpuBackend
from tests.harness import require_tool
from tests.shared.nvml import FakeClock, exposition, full_reading, make_source

# --- exposition


def test_exposition_passes_promtool() -> None:
    text = exposition(full_reading())
    assert n.GPU_ENERGY_JOULES_TOTAL.encode() + b"{" in text
    assert b"# TYPE " + n.GPU_XID_ERRORS_TOTAL.encode() + b" counter" in text
    promtool = require_tool("promtool", "Debian: apt-get install prometheus")
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_importing_the_gpu_path_loads_neither_pynvml_nor_torch() -> None:
    code = (
        "import sys, frexporter.sources.nvml, frexporter.outputs.gpu_metrics; "
        "sys.exit(sorted({'pynvml', 'torch'} & set(sys.modules)) or 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# --- property: nothing but SourceError escapes collect()


def _errors() -> st.SearchStrategy[Exception]:
    factories = [
        lambda: GpuBackendError("timeout"),
        lambda: GpuBackendError("driver"),
        lambda: GpuBackendError("library_not_found"),
        lambda: GpuBackendError("no_permission"),
        FieldNotSupported,
        GpuLost,
        lambda: RuntimeError("boom"),
        lambda: ValueError("bad"),
        lambda: KeyError("k"),
        lambda: OSError("io"),
        lambda: TypeError("t"),
        lambda: ZeroDivisionError(),
        lambda: pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN),
    ]
    return st.sampled_from(factories).map(lambda make: make())


_GARBAGE = st.sampled_from(
    [
        None,
        "",
        "text",
        -1,
        2.5,
        float("nan"),
        float("inf"),
        True,
        (1,),
        (1, -2),
        {},
        {("x", "replay"): 1},
        {(0, "bogus"): 1},
        [XidEvent(0, 13), "junk", XidEvent(-1, 5), XidEvent(0, True)],
        EccErrors(-1, 0),
        RemappedRows(0, 0, pending=True, failure=False),
        object(),
    ]
)
_WHOLE_SOURCE_REASONS = {"library_not_found", "driver", "init_failed", "timeout", "no_permission", "unknown"}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_backend_failures_only_raise_source_error(data: st.DataObject) -> None:
    outcome = st.one_of(st.just("ok"), st.just("ok"), st.just("ok"), st.just("raise"), st.just("garbage"))

    def chaos(method: str) -> object:
        kind = data.draw(outcome, label=method)
        if kind == "raise":
            return data.draw(_errors())
        if kind == "garbage":
            return data.draw(_GARBAGE)
        return NORMAL

    clock = FakeClock()
    backend = FakeGpuBackend([FakeGpu("GPU-a"), FakeGpu("GPU-b", lost_after_polls=1)], chaos=chaos)
    backend.inject_xid(0, 79)
    source = make_source(backend, clock)
    for _ in range(4):
        try:
            reading = source.read()
        except SourceError as exc:
            assert exc.reason in _WHOLE_SOURCE_REASONS
        else:
            assert isinstance(reading, GpuReading)
            exposition(reading)  # whatever got through must render
        clock.advance(120.0)
    assert not backend.violations
