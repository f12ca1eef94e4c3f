"""Every ``reason`` frexporter counts, spelled once.

A reason is the ``reason`` label of ``frexporter_source_errors_total{source, reason}`` (or, in the last section,
of ``frexporter_rank_recorder_errors_total``): a short token from this fixed set, so the label stays bounded
whatever a hostile spool, socket or GPU does, and one failure is counted the same way wherever it is met.
``FrexporterError(reason, message)`` (``SpoolError``, ``SourceError``, ...) carries one; so does each
``(reason, message)`` problem a parser or source counts without failing.

Each constant is named after its value (``LIMIT_TEXT = "limit_text"``) and says what it counts. A new reason is
added here and to SECURITY.md's table of reasons; tests/unit/test_reasons.py fails on a reason spelled as a literal
anywhere else, and on one missing from the table. Changing a value renames a label value that dashboards and
alerts may match: don't.
"""

from __future__ import annotations

# ---------------------------------------------------------------- spool files and dumps: refused whole

INVALID = "invalid"  # a field missing, of the wrong type, out of range, or a state not known
FOREIGN = "foreign"  # not a frexporter (or Flight Recorder) file, a symbolic or hard link, or not a regular file
CORRUPT = "corrupt"  # not JSON, or JSON nested deeper than the parser allows
TRUNCATED = "truncated"  # an empty file, JSON that ends early, or a mapped snapshot shorter than it says
OVERSIZED = "oversized"  # a file, socket answer or py-spy dump over its byte bound
MISSING = "missing"  # a file that vanished between its listing and its read
IO = "io"  # any other OS error reading the spool, or writing an evidence bundle
PERMISSION = "permission"  # a spool file, directory or socket this user may not open
TORN = "torn"  # a mapped snapshot caught mid-update or failing its checksum on every retry
UNKNOWN_VERSION = "unknown_version"  # a format version this exporter does not read (a newer recorder)

# Bounds on what a file or answer parses into (spool/limits.py); the file is refused whole, never cut short.
LIMIT_MEMBERS = "limit_members"  # a PG's member list, or all member lists of one manifest
LIMIT_ITEMS = "limit_items"  # any other list or map: PGs, pg_status entries, names, error kinds, FR entries
LIMIT_TEXT = "limit_text"  # a string past its length bound
LIMIT_REASONS = (LIMIT_MEMBERS, LIMIT_ITEMS, LIMIT_TEXT)

# ---------------------------------------------------------------- spool files: one field dropped or repaired

LAUNCHER_INVALID = "launcher_invalid"  # a manifest's launcher field of the wrong type, out of range or not UTF-8
SNAPSHOT_FIELD_INVALID = "snapshot_field_invalid"  # a snapshot's cpu or stack malformed; dropped, the rest stands
# A string with lone surrogates (bytes that were not UTF-8) kept with each one replaced by U+FFFD: refusing the
# file would lose an honest rank, keeping the string would fail every render of /metrics.
TEXT_REPAIRED = "text_repaired"  # a string repaired to valid UTF-8

# ---------------------------------------------------------------- the spool directory and its ranks

DIR_MISSING = "dir_missing"  # the spool directory does not exist (yet): the ranks source is down
TOO_MANY_RANKS = "too_many_ranks"  # a rank file past the number of ranks tracked; ignored
SOCKET_MISMATCH = "socket_mismatch"  # a manifest naming a socket that is not its own stem's; served without one
SOCKET_UNTRUSTED = "socket_untrusted"  # a socket not connected to: a link, another owner, or a foreign peer
UNSAFE_PERMISSIONS = "unsafe_permissions"  # a spool directory, rank file or socket others may write
# Once per poll while it lasts (sources/ranks/space.py): ranks starting now cannot write their manifest, so none of them
# is seen here, and the running ones count enospc.
SPOOL_FULL = "spool_full"  # the spool's filesystem has under 1 MiB or 64 inodes free for unprivileged users

# ---------------------------------------------------------------- a rank's worker socket

SOCKET_MISSING = "socket_missing"  # the socket file is gone
SOCKET_REFUSED = "socket_refused"  # nothing listens on it (the rank is gone)
SOCKET_TIMEOUT = "socket_timeout"  # no connection or no whole answer within the deadline
SOCKET_ERROR = "socket_error"  # any other socket failure
BAD_RESPONSE = "bad_response"  # an answer that is not the HTTP or JSON it should be
HANDLER_MISSING = "handler_missing"  # the rank's torch does not offer the handler asked for
HANDLER_FAILED = "handler_failed"  # the handler answered with an HTTP error
FR_ENTRIES_MISSED = "fr_entries_missed"  # Flight Recorder entries that left the ring between two deep reads
PYSPY_INVALID = "pyspy_invalid"  # a py-spy dump not UTF-8, not py-spy's format, or with no main thread
PYSPY_FAILED = "pyspy_failed"  # py-spy ran and failed (not on the rank's PATH, ptrace refused, ...)

# ---------------------------------------------------------------- evidence bundles (source="evidence")

SYMLINK = "symlink"  # the evidence directory (or its key file) is a symbolic link
FOREIGN_OWNER = "foreign_owner"  # the evidence directory or a bundle is owned by another user
NOT_A_DIRECTORY = "not_a_directory"  # the evidence directory is not a directory
WRITABLE_BY_OTHERS = "writable_by_others"  # our private directory inside a shared one is not private
UNSAFE_KEY = "unsafe_key"  # the bundle key file is not a private regular file of ours
DEADLINE = "deadline"  # a capture's time ran out before every rank was read
QUEUE_FULL = "queue_full"  # a capture not made: the capture queue is full
RANK_REPEAT = "rank_repeat"  # a capture not made: the rank was captured within the limit's window
RATE_LIMITED = "rate_limited"  # a capture not made: the node-wide captures per window are spent
PRUNE = "prune"  # a bundle of ours that could not be listed or removed

# ---------------------------------------------------------------- GPUs (source="nvml")

LIBRARY_NOT_FOUND = "library_not_found"  # no NVML library (libnvidia-ml.so.1, or pynvml not installed)
DRIVER = "driver"  # the NVIDIA driver not loaded, not matching, or gone while running
INIT_FAILED = "init_failed"  # NVML's init failed for any other reason
NOT_SUPPORTED = "not_supported"  # a reading this GPU model does not offer (not counted per field)
GPU_LOST = "gpu_lost"  # a GPU fell off the bus or needs a reset
NO_PERMISSION = "no_permission"  # NVML refused a call for lack of permission
INVALID_VALUE = "invalid_value"  # NVML returned a value that is not a number of the expected kind
UNKNOWN = "unknown"  # any other NVML error

# ---------------------------------------------------------------- the exporter itself

EXPORT_FAILED = "export_failed"  # an OTLP push the collector refused or that could not reach it
INTERNAL = "internal"  # a bug on our side: a source or an OTLP push raised something unexpected
# Any source (--source-timeout: the call is abandoned, the source down and its last reading served stale until
# it returns), or NVML itself answering NVML_ERROR_TIMEOUT.
TIMEOUT = "timeout"  # a source that did not answer within its deadline, or an NVML call that timed out

# ---------------------------------------------------------------- inside the rank
# The reason label of frexporter_rank_recorder_errors_total. The recorder also counts a spool write's reason
# (above), an OSError by its errno name, and anything else by its exception type.

STARTING_MANIFEST = "starting_manifest"  # the starting manifest (before any process group) could not be written
SPOOL_RECREATE = "spool_recreate"  # the spool directory was removed and publishing in a new one failed
WORKER_SERVER = "worker_server"  # torch's worker server could not be started
STACK_SAMPLE = "stack_sample"  # sampling the training thread's stack failed
CUDA_PROBE = "cuda_probe"  # asking CUDA whether the rank's GPU has work pending failed, hung or answered garbage
LAUNCHER_ENV = "launcher_env"  # a launcher variable (RANK, SLURM_NTASKS, ...) not an integer, too long or not UTF-8
