"""Every default of the exporter, spelled once, each next to what it means.

``frexporter serve``'s flags and their help, ``app.ServeConfig`` and the config dataclasses (``RanksConfig``,
``VerdictConfig``, ``ThresholdConfig``, ``OtlpPusher``, ``MetricsServer``) read them from here, under these names
and no others; the chart's values mirror them (tests/e2e/test_helm.py checks the rendered flags), and the docs quote
the CLI's help. The recorder's own defaults stay with the format they belong to (``spool``).
"""

from __future__ import annotations

LISTEN = ":9477"  # HOST:PORT of the HTTP server (every interface); the chart's metrics port
POLL_INTERVAL = 1.0  # seconds between reads of the ranks, independent of scrapes
STUCK_AFTER = 60.0  # seconds a collective may wait on missing ranks before it is a verdict (the learned ceiling)
RANK_TIMEOUT = 2.0  # the longest one rank's socket may hold a poll
# A source call that has not returned by then is abandoned: the source is down (reason "timeout"), its last reading
# is served stale, and it is not called again until that call returns. The ranks source gets RANK_TIMEOUT more, which
# it may wait for wedged ranks. Short enough that a hung NVML holds one poll for this at most.
SOURCE_TIMEOUT = 5.0  # the longest one source's collection may take (the ranks source: on top of RANK_TIMEOUT)
# A deep read of a full 2000-entry gloo ring costs its rank ~20 ms of CPU in torch's C++ worker server
# (docs/recorder-cost.md): reads that only refresh values are spaced this far apart,
DEEP_INTERVAL = 15.0  # least seconds between routine deep reads of one rank's Flight Recorder ring
# or further where a read takes longer (a slower node, a larger ring: TORCH_FR_BUFFER_SIZE=20000 is ten times
# the work), so that routine reads take at most this share of a rank's time. Reads for a stall are never spaced.
DEEP_READ_SHARE = 0.002  # most of a rank's time that routine deep reads may take
DEPARTED_GRACE = 300.0  # seconds a dead rank stays exported
NVML_INTERVAL = 5.0  # seconds between GPU reads: GPU state changes slowly, and NVML calls are not free
VERDICT_CONFIRM_AFTER = 0.0  # seconds a verdict must last before it is logged and its evidence captured
OTLP_INTERVAL = 15.0  # seconds between OTLP pushes
OTLP_TIMEOUT = 10.0  # the longest one OTLP push may take (never more than the interval)
# Open HTTP connections (each holds a thread), kept-alive ones included: one Prometheus (or an HA pair) needs
# one or two, and room is left for curl, probes and 50 concurrent scrapers (benchmarks/load.py).
WEB_MAX_CONNECTIONS = 64  # open HTTP connections at most; more are closed unserved
# Adaptive stuck threshold per process group (docs/detection.md): max(floor, multiple x the learned high
# quantile of the PG's waits and gaps between completions), never above --stuck-after (the ceiling); the
# ceiling until a PG has STUCK_MIN_SAMPLES samples.
STUCK_FLOOR = 10.0  # seconds: the shortest learned stuck threshold
STUCK_MULTIPLE = 3.0  # learned threshold = this x the PG's high quantile of waits and gaps
STUCK_QUANTILE = 0.99  # the high quantile the learned threshold multiplies
STUCK_MIN_SAMPLES = 20  # samples a PG needs before its threshold is learned
STUCK_HISTORY = 1024  # samples kept per PG (the newest): about 17 minutes of a job that completes every poll
# A rank's wait in a collective is exported (frexporter_pg_wait_*) once it has lasted this share of its PG's stuck
# threshold: early enough that the rules, which judge the wait against the threshold themselves, see it before it
# counts; late enough that a healthy job's waits hardly ever show (the learned threshold is at least three times
# their 99th percentile).
WAIT_REPORT_SHARE = 0.5
# Per node and PG, the idle ranks of the lowest seq the exporter writes as desync candidates
# (naming.PG_IDLE_SEQ): the shipped rules keep the same number per PG and shard (their bottomk), so a node's
# others could never be named.
IDLE_CANDIDATES_PER_NODE = 2
DEMO_RANKS = 4  # gloo ranks of `frexporter demo`
