"""What a spool file may hold: bytes, and what it parses into. Beyond a bound the file is refused whole."""

from __future__ import annotations

MAX_MANIFEST_BYTES = 4 * 1024 * 1024
MAX_SNAPSHOT_BYTES = 1024 * 1024
# Ranks one exporter tracks: a node runs a few dozen at most, and anyone who can write the spool could
# otherwise make it parse and keep state for as many manifests as the file system holds.
MAX_RANKS_PER_NODE = 1024
# Bounds on what a file parses into: the byte limits cap a file, not its parsed size (4 MiB of compact JSON
# is 470,000 ranks). A file past a bound is refused whole with one of reasons.LIMIT_REASONS, never cut
# short: a member list cut short would give wrong verdicts. The bounds leave room for the largest real jobs.
MAX_PG_MEMBERS = 1 << 17  # members of one PG: the WORLD of a 131,072-rank job
MAX_MANIFEST_MEMBERS = 1 << 19  # members over all PGs of one rank (WORLD and a few more groups that large)
MAX_PGS = 4096  # process groups per rank, and pg_status entries per recorder
MAX_RANK = 2**31 - 1  # torch keeps ranks in C ints
MAX_TEXT_CHARS = 256  # job id, hostname, PG name/desc/backend, versions, GPU UUID, socket, names in lists
MAX_NAMES = 64  # handlers, recorders, backends of a manifest; recorders in a PG's local_ids
MAX_RECORDERS = 8  # recorders in one snapshot (torch keeps two: fr and nccl)
MAX_ERROR_KINDS = 64  # entries of a snapshot's recorder error map
MAX_ERROR_KIND_CHARS = 64  # an error kind is a label value
MAX_LAUNCHER_FIELDS = 16  # entries of a manifest's launcher map; the recorder writes 8
MAX_MESSAGE_CHARS = 500  # a snapshot's human message: cut there (text for people, identifies nothing)
# A snapshot's sample of the training thread's stack: frames kept (innermost first; the recorder stops
# walking there, deeper callers are not named), and characters per frame string (the recorder keeps the
# head of a function name and the tail of a file path). 32 frames reach from a collective's wait well
# past the training loop's own functions and keep the sample's cost in the snapshot's GIL budget.
MAX_STACK_FRAMES = 32
MAX_FRAME_TEXT_CHARS = 512
