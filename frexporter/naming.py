"""Every metric and label name frexporter exports, spelled once.

Outputs (Prometheus, OTLP), alert rules tests and dashboards import from here;
nothing else in the package writes a metric name as a string literal.
"""

from __future__ import annotations

PREFIX = "frexporter_"

# Labels
L_JOB_ID = "job_id"
L_RANK = "rank"
L_LOCAL_RANK = "local_rank"
L_WORLD_SIZE = "world_size"
L_HOSTNAME = "hostname"
L_PID = "pid"
L_TORCH_VERSION = "torch_version"
L_GPU_UUID = "gpu_uuid"
L_GPU = "gpu"
L_PG = "pg"
L_PG_DESC = "pg_desc"
L_SIZE = "size"
L_OP = "op"
L_KIND = "kind"
L_SEQ = "seq"
# frexporter_verdict: what the culprit rank is doing (model.ACTIVITY_STATES) and its headline function
# (the first frame outside torch and the standard library, cut to MAX_FUNCTION_LABEL_CHARS; "" when unknown).
L_CULPRIT_STATE = "culprit_state"
L_CULPRIT_FUNCTION = "culprit_function"
MAX_FUNCTION_LABEL_CHARS = 64
L_SOURCE = "source"
L_REASON = "reason"
L_VERSION = "version"
L_BACKEND = "backend"

# Build and exporter self-observability
BUILD_INFO = PREFIX + "build_info"
SOURCE_UP = PREFIX + "source_up"
SOURCE_DURATION_SECONDS = PREFIX + "source_duration_seconds"
SOURCE_ERRORS_TOTAL = PREFIX + "source_errors_total"
SOURCE_LAST_SUCCESS_TIMESTAMP_SECONDS = PREFIX + "source_last_success_timestamp_seconds"
# The node's clock when the exporter polled: the time every other series of the scrape was read at. The rules
# take a node's timestamps (heartbeat, in-flight start) from this, never from Prometheus' time(), so that a
# node whose clock is off neither pages nor hides a page (frexporter/rules/frexporter.rules.yml).
POLL_TIMESTAMP_SECONDS = PREFIX + "poll_timestamp_seconds"
# The HTTP server's own (outputs/http_metrics.py): connections closed unserved at the connection cap.
HTTP_CONNECTIONS_REJECTED_TOTAL = PREFIX + "http_connections_rejected_total"

# Ranks
RANK_INFO = PREFIX + "rank_info"
RANK_UP = PREFIX + "rank_up"
RANK_HEARTBEAT_TIMESTAMP_SECONDS = PREFIX + "rank_heartbeat_timestamp_seconds"
RANK_RECORDER_ERRORS_TOTAL = PREFIX + "rank_recorder_errors_total"
# What the rank is doing (label `state`, one of model.ACTIVITY_STATES; one series per rank, the current
# state), valued the unix time that state began. The desync rule holds a busy culprit to the ceiling.
RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS = PREFIX + "rank_activity_since_timestamp_seconds"
L_STATE = "state"
# Per job and node: the world size its local ranks state, so that rules can count the ranks reporting
# (frexporter_rank_info, over every node) against the ranks expected (FrexporterRankAbsent).
JOB_WORLD_SIZE = PREFIX + "job_world_size"

# Process groups. The seqs, in-flight and progress series are per rank; a PG's static facts (info,
# timeout) are the same on every rank, so they are exported once per node, without `rank`: per rank they
# would cost 2 series per PG per rank for nothing (docs/architecture.md, Budgets: at most 40 series per rank).
PG_INFO = PREFIX + "pg_info"
PG_LAST_ENQUEUED_SEQ = PREFIX + "pg_last_enqueued_seq"
PG_LAST_STARTED_SEQ = PREFIX + "pg_last_started_seq"
PG_LAST_COMPLETED_SEQ = PREFIX + "pg_last_completed_seq"
PG_INFLIGHT_COLLECTIVES = PREFIX + "pg_inflight_collectives"
PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS = PREFIX + "pg_oldest_inflight_start_timestamp_seconds"
PG_TIMEOUT_SECONDS = PREFIX + "pg_timeout_seconds"
PG_STUCK_THRESHOLD_SECONDS = PREFIX + "pg_stuck_threshold_seconds"  # learned, docs/detection.md
PG_STUCK_CEILING_SECONDS = PREFIX + "pg_stuck_ceiling_seconds"  # --stuck-after: a busy culprit's threshold
PG_LAST_PROGRESS_TIMESTAMP_SECONDS = PREFIX + "pg_last_progress_timestamp_seconds"
# Waits: per rank and PG, only while the rank is up and its oldest in-flight collective has waited a share of the
# PG's stuck threshold (defaults.WAIT_REPORT_SHARE) on this node's clock. Absent for the short waits of a healthy
# job, so rules that look for stuck collectives read a handful of series instead of every rank's seqs
# (docs/scale.md, "Waits").
PG_WAIT_START_TIMESTAMP_SECONDS = PREFIX + "pg_wait_start_timestamp_seconds"  # when the wait began
PG_WAIT_SEQ = PREFIX + "pg_wait_seq"  # the collective waited on: the completed seq + 1
PG_WAIT_LIMIT_SECONDS = PREFIX + "pg_wait_limit_seconds"  # label `limit`: one of WAIT_LIMITS
PG_WAIT_GROUP_SIZE = PREFIX + "pg_wait_group_size"  # ranks in the PG: a stall is a wait of every one
L_LIMIT = "limit"
WAIT_LIMIT_STUCK = "stuck"  # the PG's stuck threshold
WAIT_LIMIT_CEILING = "ceiling"  # its ceiling, a busy culprit's threshold (--stuck-after)
WAIT_LIMIT_TIMEOUT = "timeout"  # its watchdog timeout
WAIT_LIMITS = (WAIT_LIMIT_STUCK, WAIT_LIMIT_CEILING, WAIT_LIMIT_TIMEOUT)
# Idle ranks, the desync's candidate culprits: per rank and PG, only while the rank has no collective of the PG
# enqueued and not completed and its completed seq has not advanced for the same share of the PG's stuck threshold
# (or never has), and per node and PG only the defaults.IDLE_CANDIDATES_PER_NODE such ranks of the lowest seq. Its
# value is the rank's last enqueued seq. Absent while a job's PGs all run collectives, so the desync rule reads a
# handful of series instead of every rank's seqs (docs/scale.md, "Waits").
PG_IDLE_SEQ = PREFIX + "pg_idle_seq"

# Collectives
COLLECTIVE_DURATION_SECONDS = PREFIX + "collective_duration_seconds"
COLLECTIVE_BYTES_TOTAL = PREFIX + "collective_bytes_total"

# Straggler signal (per rank and PG, in seconds).
RANK_STRAGGLER_LATENESS_SECONDS = PREFIX + "rank_straggler_lateness_seconds"
# Cross-node straggler signal (per rank and PG, seconds): mean wait inside the PG's recent collectives.
RANK_COLLECTIVE_WAIT_SECONDS = PREFIX + "rank_collective_wait_seconds"
# The same where FR records no completion (gloo): unix time, the rank's mean call time over the PG's current block.
RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS = PREFIX + "rank_collective_arrival_timestamp_seconds"
# Deprecated: the same value under its first name, which hid its unit. Exported alongside the new name for one
# release (CHANGELOG.md), then removed together with this constant.
RANK_STRAGGLER_SCORE_DEPRECATED = PREFIX + "rank_straggler_score"

# Verdicts
VERDICT = PREFIX + "verdict"

# Label sets, so that adapters and tests agree on order.
RANK_LABELS = (L_JOB_ID, L_RANK)
JOB_LABELS = (L_JOB_ID,)
PG_LABELS = (L_JOB_ID, L_RANK, L_PG, L_PG_DESC)
RANK_ACTIVITY_LABELS = (L_JOB_ID, L_RANK, L_STATE)
RANK_INFO_LABELS = (
    L_JOB_ID,
    L_RANK,
    L_LOCAL_RANK,
    L_WORLD_SIZE,
    L_HOSTNAME,
    L_PID,
    L_TORCH_VERSION,
    L_GPU_UUID,
)
PG_WAIT_LIMIT_LABELS = (*PG_LABELS, L_LIMIT)
PG_IDLE_LABELS = (*PG_LABELS, L_HOSTNAME)  # the host travels with the candidate to the alert's text
PG_STATIC_LABELS = (L_JOB_ID, L_PG, L_PG_DESC)  # per node: the timeout, the stuck threshold
PG_INFO_LABELS = (*PG_STATIC_LABELS, L_SIZE, L_BACKEND)
VERDICT_LABELS = (L_JOB_ID, L_PG, L_PG_DESC, L_RANK, L_KIND, L_OP, L_SEQ, L_CULPRIT_STATE, L_CULPRIT_FUNCTION)
COLLECTIVE_LABELS = (L_JOB_ID, L_PG, L_PG_DESC, L_OP)  # per node (the default)
COLLECTIVE_RANK_LABELS = (L_JOB_ID, L_RANK, L_PG, L_PG_DESC, L_OP)  # per rank (opt-in)
SOURCE_LABELS = (L_SOURCE,)
SOURCE_ERROR_LABELS = (L_SOURCE, L_REASON)

# Sources
SOURCE_RANKS = "ranks"
SOURCE_NVML = "nvml"
SOURCE_EVIDENCE = "evidence"  # evidence capture: up while its directory is usable; errors = captures lost

# GPUs (NVML source; frexporter/outputs/gpu_metrics.py). Labels `gpu` (NVML
# index) and `gpu_uuid` on every series.
L_NAME = "name"
L_DRIVER_VERSION = "driver_version"
L_TYPE = "type"
L_LINK = "link"
L_XID = "xid"
L_ACTION = "action"
GPU_LABELS = (L_GPU, L_GPU_UUID)
GPU_INFO = PREFIX + "gpu_info"
GPU_LOST = PREFIX + "gpu_lost"
GPU_UTILIZATION_RATIO = PREFIX + "gpu_utilization_ratio"
GPU_MEMORY_USED_BYTES = PREFIX + "gpu_memory_used_bytes"
GPU_MEMORY_TOTAL_BYTES = PREFIX + "gpu_memory_total_bytes"
GPU_TEMPERATURE_CELSIUS = PREFIX + "gpu_temperature_celsius"
GPU_POWER_WATTS = PREFIX + "gpu_power_watts"
GPU_ENERGY_JOULES_TOTAL = PREFIX + "gpu_energy_joules_total"
GPU_SM_CLOCK_HERTZ = PREFIX + "gpu_sm_clock_hertz"
GPU_MEMORY_CLOCK_HERTZ = PREFIX + "gpu_memory_clock_hertz"
GPU_THROTTLE_REASONS = PREFIX + "gpu_throttle_reasons"
GPU_ECC_ERRORS_TOTAL = PREFIX + "gpu_ecc_errors_total"
GPU_REMAPPED_ROWS = PREFIX + "gpu_remapped_rows"
GPU_REMAPPED_ROWS_PENDING = PREFIX + "gpu_remapped_rows_pending"
GPU_REMAPPED_ROWS_FAILED = PREFIX + "gpu_remapped_rows_failed"
GPU_PCIE_REPLAY_TOTAL = PREFIX + "gpu_pcie_replay_total"
GPU_NVLINK_ERRORS_TOTAL = PREFIX + "gpu_nvlink_errors_total"
GPU_XID_ERRORS_TOTAL = PREFIX + "gpu_xid_errors_total"
# What the driver asks for to recover the GPU (label `action`, model.GPU_RECOVERY_ACTIONS; one series per GPU,
# the current action, value 1), absent where the driver (< 570) has no such field.
GPU_RECOVERY_ACTION = PREFIX + "gpu_recovery_action"

# Where the exporter runs (Kubernetes downward API); outputs/identity.py.
EXPORTER_INFO = PREFIX + "exporter_info"
EXPORTER_IDENTITY_MISSING = PREFIX + "exporter_identity_missing"
L_POD = "pod"
L_NAMESPACE = "namespace"
L_NODE = "node"
L_LABEL = "label"
