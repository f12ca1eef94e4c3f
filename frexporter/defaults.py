"""Every default of the exporter that more than one place needs, spelled once.

The CLI shows them in its help, ``build_app`` and the config dataclasses take them, the chart's values
mirror them (tests/test_helm.py checks the rendered flags), and the docs quote the CLI's help.
"""

from __future__ import annotations

LISTEN = ":9477"
POLL_INTERVAL = 1.0  # seconds between reads of the ranks, independent of scrapes
STUCK_AFTER = 60.0  # seconds a collective may wait on missing ranks before it is a verdict
RANK_TIMEOUT = 2.0  # the longest one rank's socket may hold a poll
# A deep read of a full 2000-entry gloo ring costs its rank ~20 ms of CPU in torch's C++ worker server
# (docs/recorder-cost.md): reads that only refresh values are spaced this far apart,
DEEP_INTERVAL = 15.0
# or further where a read takes longer (a slower node, a larger ring: TORCH_FR_BUFFER_SIZE=20000 is ten times
# the work), so that routine reads take at most this share of a rank's time. Reads for a stall are never spaced.
DEEP_READ_SHARE = 0.002
DEPARTED_GRACE = 300.0  # seconds a dead rank stays exported
NVML_INTERVAL = 5.0  # GPU state changes slowly, and NVML calls are not free
OTLP_INTERVAL = 15.0
# Open HTTP connections (each holds a thread), kept-alive ones included: one Prometheus (or an HA pair) needs
# one or two, and room is left for curl, probes and 50 concurrent scrapers (benchmarks/load.py).
WEB_MAX_CONNECTIONS = 64
# Adaptive stuck threshold per process group (docs/detection.md): max(floor, multiple x the learned high
# quantile of the PG's waits and gaps between completions), never above --stuck-after (the ceiling); the
# ceiling until a PG has STUCK_MIN_SAMPLES samples.
STUCK_FLOOR = 10.0
STUCK_MULTIPLE = 3.0
STUCK_QUANTILE = 0.99
STUCK_MIN_SAMPLES = 20
STUCK_HISTORY = 1024  # samples kept per PG (the newest): about 17 minutes of a job that completes every poll
