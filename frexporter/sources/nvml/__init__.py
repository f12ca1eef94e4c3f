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

Modules, in the direction data flows (each imports only those before it):

- ``backend.py``: the contract (``GpuBackend``, ``XidEvent`` and the error types);
- ``pynvml_backend.py``: ``PynvmlBackend``, the contract over nvidia-ml-py (NVML units and errors translated);
- ``fields.py``: pure: the fields read per GPU, each backend value checked and turned into ``GpuState`` fields;
- ``source.py``: ``NvmlSource``, the policy above.

Every module logs as ``frexporter.sources.nvml``, the name the source's log lines have always had.
"""

from __future__ import annotations

from frexporter.sources.nvml.backend import FieldNotSupported, GpuBackend, GpuBackendError, GpuLost, XidEvent
from frexporter.sources.nvml.pynvml_backend import PynvmlBackend
from frexporter.sources.nvml.source import NvmlSource

__all__ = ["FieldNotSupported", "GpuBackend", "GpuBackendError", "GpuLost", "NvmlSource", "PynvmlBackend", "XidEvent"]
