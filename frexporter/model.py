"""The exporter's immutable view of one node at one poll.

Sources build it, analysis reads it, outputs render it. Nothing here does I/O.
Sequence numbers are in the collective domain (send/recv factored out) so ranks
can be compared; process groups are named by their cross-rank name.
"""

from __future__ import annotations

import array
import bisect
import functools
import sys
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, overload

# Rank liveness, as the exporter judges it this poll.
RANK_OK = "ok"  # fresh heartbeat
RANK_UNRESPONSIVE = "unresponsive"  # heartbeat stale but the C++ worker server answers: Python is wedged
RANK_DOWN = "down"  # heartbeat stale and the socket is dead
RANK_EXITED = "exited"  # the recorder said goodbye (clean interpreter exit)

# A rank's lifecycle, as its recorder states it in the manifest and in every snapshot (``state``); spelled once
# here for the recorder that writes it, the spool parsers that check it and the sources that read it. Liveness
# (RANK_* above) is the exporter's judgement; this is what the rank says of itself.
STATE_STARTING = "starting"  # install() ran, no process group yet (blocked in or before init_process_group)
STATE_RUNNING = "running"  # identified by its default process group; its snapshots carry every recorder
STATE_EXITING = "exiting"  # last words: the interpreter exits cleanly (the exporter judges the rank exited)
STATE_STOPPED = "stopped"  # last words: the recorder thread died; the rank may train on, unwatched
MANIFEST_STATES = (STATE_STARTING, STATE_RUNNING)  # a manifest with any other state is refused


@functools.total_ordering
class Members(Sequence[int]):
    """A PG's member ranks, sorted and distinct, at 4 bytes each, and one object per distinct member list.

    A tuple of Python ints costs 40 bytes a member: 20 ranks that each list a 131,072-rank WORLD would hold
    100 MB. Here the ranks are packed in one immutable buffer, and ``of`` hands out the object already made
    for the same list, so the ranks of one job share their WORLD. Equal to, and hashed like, the tuple of
    its ranks, so analysis code and tests may mix both.
    """

    __slots__ = ("__weakref__", "_data", "_hash", "_view")

    def __init__(self, data: bytes) -> None:
        self._data = data  # native C ints, sorted ascending, distinct
        self._view = memoryview(data).cast("i")
        self._hash: int | None = None

    _interned: weakref.WeakValueDictionary[bytes, Members] = weakref.WeakValueDictionary()

    @classmethod
    def of(cls, ranks: Iterable[int]) -> Members:
        """Sorted distinct ``ranks`` (each fits a C int, as torch keeps ranks); OverflowError or TypeError otherwise."""
        packed = array.array("i", sorted(set(ranks)))
        if packed and packed[0] < 0:
            raise OverflowError("negative rank")
        data = packed.tobytes()
        found = cls._interned.get(data)
        if found is None:
            found = cls._interned.setdefault(data, cls(data))
        return found

    def __len__(self) -> int:
        return len(self._view)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...

    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        if isinstance(index, slice):
            return tuple(self._view[index])
        return self._view[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._view)

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, int):
            return False
        i = bisect.bisect_left(self._view, value)
        return i < len(self._view) and self._view[i] == value

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(tuple(self._view))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Members):
            return self._data == other._data
        if isinstance(other, tuple):
            return len(other) == len(self._view) and tuple(self._view) == other
        return NotImplemented

    def __lt__(self, other: object) -> bool:
        if isinstance(other, Members):  # arrays compare by value, without a Python int per rank
            return array.array("i", self._data) < array.array("i", other._data)
        if isinstance(other, tuple):
            return tuple(self._view) < other
        return NotImplemented

    def __repr__(self) -> str:
        head = ", ".join(map(str, self._view[:8]))
        return f"Members([{head}{', ...' if len(self._view) > 8 else ''}], n={len(self._view)})"

    def __reduce__(self) -> tuple[Any, ...]:
        return Members, (self._data,)



# What a rank is doing, as the exporter judges it from its snapshot (Activity.state).
# The training thread waits in a torch.distributed call, or its own collective has been in flight longer than
# its PG's normal wait (NCCL, async_op=True: the rank waits wherever it next synchronizes)
ACTIVITY_IN_COLLECTIVE = "in_collective"
# Its Python stands still on one line while its GPU has had work pending (recorder/cuda_probe.py): CUDA's spin
# wait burns a core, so this rank looks busy by its CPU use, but it waits
ACTIVITY_GPU_WAIT = "gpu_wait"
ACTIVITY_BUSY = "busy"  # computing outside collectives
ACTIVITY_IDLE = "idle"  # sleeping, or blocked in I/O, a queue or a lock
ACTIVITY_WEDGED = "wedged"  # heartbeat stale, worker socket alive: its Python cannot sample itself
ACTIVITY_GONE = "gone"  # heartbeat stale, socket dead
ACTIVITY_UNKNOWN = "unknown"  # no stack (the rank is progressing, sampling off, an older recorder) or one CPU sample
ACTIVITY_STATES = (ACTIVITY_IN_COLLECTIVE, ACTIVITY_GPU_WAIT, ACTIVITY_BUSY, ACTIVITY_IDLE, ACTIVITY_WEDGED,
                   ACTIVITY_GONE, ACTIVITY_UNKNOWN)
# Waiting, whatever the CPU use says: these end the busy hold at once (a healthy GPU rank spins at 100 % CPU, so
# it was busy right before it hung).
ACTIVITY_WAITING = (ACTIVITY_IN_COLLECTIVE, ACTIVITY_GPU_WAIT)
# A rank seen busy this recently still counts as busy when judging patience (the node verdict, analyze and
# FrexporterCollectiveDesync's max_over_time(...[1m]), which tests/unit/test_rules.py holds to this): a rank whose
# CPU use hovers at the busy line would otherwise flip between the busy ceiling and the learned threshold.
BUSY_HOLD_SECONDS = 60.0

Frame = tuple[str, str, int]  # (function, file, line)
# Where an activity's frames come from (Activity.frames_source): the rank's own snapshot, or, for a wedged rank
# that cannot sample itself, py-spy run by torch's worker server in the rank (`serve --evidence-stacks`).
FRAMES_RECORDER = "recorder"
FRAMES_PYSPY = "py-spy"


@dataclass(frozen=True)
class Activity:
    """A rank's activity: its state, its training thread's last sampled stack (innermost first), the process's
    CPU use between its last two snapshots, and since when (unix seconds) it has been in this state in
    the same headline function (wedged: since it stopped answering). ``frames_source`` says who sampled the
    frames (FRAMES_RECORDER, FRAMES_PYSPY); py-spy names files relative to their package
    (``torch/distributed/distributed_c10d.py``, ``train.py``)."""

    state: str = ACTIVITY_UNKNOWN
    frames: tuple[Frame, ...] = ()
    cpu_percent: float | None = None
    since: float | None = None
    frames_source: str = FRAMES_RECORDER
    last_busy: float | None = None  # unix seconds the rank was last seen busy (now, while it is)

    def held_busy(self, now: float) -> bool:
        """Busy, or busy within BUSY_HOLD_SECONDS and not waiting now (ACTIVITY_WAITING): a wait on this rank
        gets the --stuck-after patience."""
        if self.state == ACTIVITY_BUSY:
            return True
        return (self.state not in ACTIVITY_WAITING and self.last_busy is not None
                and now - self.last_busy <= BUSY_HOLD_SECONDS)

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state,
                "frames": [{"function": f, "file": p, "line": n} for f, p, n in self.frames],
                "frames_source": self.frames_source, "cpu_percent": self.cpu_percent, "since": self.since}

    def headline(self) -> Frame | None:
        """The frame a person wants named: the innermost outside torch and the standard library (the user's
        code), else the innermost; None without a stack."""
        for frame in self.frames:
            if not is_library_file(frame[1]):
                return frame
        return self.frames[0] if self.frames else None


# The innermost frame's file under these paths: the training thread is in a torch.distributed call.
_DISTRIBUTED_PATHS = ("/torch/distributed/", "/torch/_C/_distributed")


def in_distributed(frames: tuple[Frame, ...]) -> bool:
    """The innermost frame is torch.distributed's: the training thread is inside a collective call."""
    return bool(frames) and any(p in frames[0][1].replace("\\", "/") for p in _DISTRIBUTED_PATHS)


def is_library_file(path: str) -> bool:
    """A frame's file is torch's or the standard library's (judged from the path the rank reported: the
    exporter does not know the rank's interpreter)."""
    if path.startswith("<"):  # <frozen runpy>, <string>
        return True
    p = path.replace("\\", "/")
    if not p.startswith("/") and p[1:3] != ":/":  # not C:/...
        # Relative to its package, as py-spy names files: torch/distributed/..., threading.py, json/decoder.py.
        top = p.split("/", 1)[0].removesuffix(".py")
        return top == "torch" or top in sys.stdlib_module_names
    if "/torch/" in p:
        return True
    if "/site-packages/" in p or "/dist-packages/" in p:
        return False
    return "/lib/python3" in p


UNKNOWN_ACTIVITY = Activity()


@dataclass(frozen=True)
class InflightCollective:
    """One collective enqueued on a rank and not yet completed (from a deep FR read)."""

    seq: int
    op: str
    created: float  # unix seconds
    timeout_seconds: float | None
    input_sizes: tuple[tuple[int, ...], ...] = ()
    input_dtypes: tuple[str, ...] = ()
    output_sizes: tuple[tuple[int, ...], ...] = ()
    output_dtypes: tuple[str, ...] = ()


# A PG's member ranks: packed (Members, as the spool reads them) or a plain tuple (dumps, Prometheus, tests).
RankList = tuple[int, ...] | Members


@dataclass(frozen=True)
class PGState:
    name: str
    desc: str
    ranks: RankList
    backend: str
    last_enqueued: int
    last_started: int
    last_completed: int
    inflight: tuple[InflightCollective, ...]  # oldest first; empty when unknown or none
    inflight_count: int
    timeout_seconds: float | None
    last_progress: float | None  # unix seconds when last_completed last advanced (as observed)
    exact: bool  # False when p2p traffic made the collective-domain values come from an older deep read
    has_p2p: bool
    # Straggler signal: mean seconds this rank enqueued the PG's collectives after the first local member did,
    # over the last ``lateness_samples`` collectives (slowest tenth left out); None without local peers to
    # compare with. See frexporter/sources/collectives.py.
    lateness_seconds: float | None = None
    lateness_samples: int = 0
    # Cross-node straggler signal: mean seconds this rank waited inside the PG's collectives over the last
    # ``wait_samples`` (smallest and largest tenth left out), from its own node's clock or GPU timing; None
    # where FR has no completion (gloo) or before enough samples. The last arriver waits least.
    wait_seconds: float | None = None
    wait_samples: int = 0
    # The same where FR records no completion (gloo): unix seconds, this rank's mean call time over the PG's
    # current block of collectives, which every node picks alike from its own clock (sources/arrivals.py). The last
    # arriver calls latest; ranks on different nodes compare up to the nodes' clock offset.
    arrival_timestamp: float | None = None
    arrival_stamp: float | None = None  # unix seconds the arrival's sample is stamped with (its grid instant's)
    # Seconds a collective of this PG may wait before it counts as stuck, learned from the PG's history
    # (frexporter/sources/thresholds.py); None where nobody learned one (dumps, old series): the fixed one.
    stuck_threshold_seconds: float | None = None
    # The ceiling of that threshold (--stuck-after): what a wait on a culprit that is busy computing gets
    # (docs/detection.md, "Activity decides patience"); None where no exporter set one.
    stuck_ceiling_seconds: float | None = None
    # The PG's normal wait (the quantile the threshold multiplies); None before enough history. A rank whose own
    # collective has been in flight longer than this waits in it, wherever its Python stands (rank_activity).
    normal_wait_seconds: float | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def oldest_inflight(self) -> InflightCollective | None:
        return self.inflight[0] if self.inflight else None


@dataclass(frozen=True)
class RankState:
    job_id: str
    rank: int
    local_rank: int
    world_size: int
    hostname: str
    pid: int
    torch_version: str
    gpu_uuid: str
    status: str  # RANK_*
    heartbeat: float | None  # unix seconds of the last fresh snapshot
    heartbeat_age: float | None
    socket_alive: bool | None  # None: not probed this poll
    pgs: tuple[PGState, ...]
    recorder_errors: Mapping[str, int] = field(default_factory=dict)
    message: str = ""
    last_deep_read: float | None = None
    socket: str = ""  # worker-server socket file name in the spool directory ("" when off)
    # Worker-server handlers this rank may be asked: those its torch offers, less the FR readers of recorders its
    # PGs do not use (sources/worker_handlers.handlers_in_use)
    handlers: tuple[str, ...] = ()
    state: str = STATE_RUNNING  # its manifest's: STATE_STARTING or STATE_RUNNING
    start_time: float = 0.0  # unix seconds the recorder started in this rank
    # Global ranks its launcher started on this rank's node (this one included); () when it did not say.
    node_ranks: tuple[int, ...] = ()
    activity: Activity = UNKNOWN_ACTIVITY
    # Status RANK_DOWN after a clean exit (its goodbye snapshot): a rank that exited while local peers wait for it
    # stays in the view as their culprit, where an exited rank is otherwise dropped (sources/ranks/liveness.held).
    exited: bool = False

    @property
    def up(self) -> bool:
        return self.status in (RANK_OK, RANK_UNRESPONSIVE)


# Upper bounds of frexporter_collective_duration_seconds (seconds): 100 us to 10 min, a factor of 2 to 6 apart,
# 13 finite buckets. Collectives span small latency-bound all_reduces to multi-second all_gathers of large
# shards; anything past 10 min has outlived the default NCCL watchdog anyway.
DURATION_BUCKETS: tuple[float, ...] = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0,
                                       600.0)


# ---------------------------------------------------------------- verdicts (the analysis fills these)


@dataclass(frozen=True)
class Verdict:
    kind: str
    job_id: str
    pg: str  # cross-rank PG name; "" when no PG is involved
    pg_desc: str
    ranks: tuple[int, ...]  # culprits
    waiting_ranks: tuple[int, ...]
    seq: int  # collective-domain seq; NO_SEQ when none
    op: str  # as FR names it; "" when unknown
    since: float | None  # unix seconds
    age_seconds: float | None
    timeout_seconds: float | None
    budget_used: float | None  # age / timeout
    summary: str
    details: Mapping[str, Any] = field(default_factory=dict, hash=False)
    activity: Mapping[str, Activity] = field(default_factory=dict, hash=False)  # culprit rank -> what it does

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "job_id": self.job_id, "pg": self.pg, "pg_desc": self.pg_desc,
            "ranks": list(self.ranks), "waiting_ranks": list(self.waiting_ranks), "seq": self.seq, "op": self.op,
            "since": self.since, "age_seconds": self.age_seconds, "timeout_seconds": self.timeout_seconds,
            "budget_used": self.budget_used, "summary": self.summary, "details": _jsonable(self.details),
            "activity": {rank: a.to_json() for rank, a in self.activity.items()},
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value) if isinstance(value, (set, frozenset)) else value
        return [_jsonable(v) for v in items]
    return value


@dataclass(frozen=True)
class CollectiveStats:
    """Completed collectives of one (job, PG, op) on this node, or of one rank with per-rank durations on.

    Cumulative since the exporter first saw them: each FR entry counts once however many deep reads show it.
    ``bucket_counts[i]`` counts durations <= ``DURATION_BUCKETS[i]`` (cumulative, like Prometheus' ``le``).
    Only entries with a ``duration_ms`` (NCCL with timing) feed the duration fields; ``bytes`` counts every
    completed entry whose input dtypes are known.
    """

    job_id: str
    pg: str
    pg_desc: str
    op: str
    rank: int | None  # None: summed over the node's ranks (the default)
    bucket_counts: tuple[int, ...]
    duration_sum: float
    duration_count: int
    bytes: int


@dataclass(frozen=True)
class SourceStatus:
    name: str
    up: bool
    duration_seconds: float
    errors_total: Mapping[str, int]  # reason -> count since start
    last_error: str = ""
    last_success: float | None = None
    reason: str = ""  # while down: why (a frexporter.reasons value; "" where not known)
    # While down with reason "timeout": the snapshot still carries the source's last good reading, from
    # last_success, because its call has not returned.
    stale: bool = False


@dataclass(frozen=True)
class NodeSnapshot:
    time: float
    hostname: str
    ranks: tuple[RankState, ...]
    sources: tuple[SourceStatus, ...]
    gpus: GpuReading | None = None  # when the NVML source is on and up
    verdicts: tuple[Verdict, ...] = ()
    collectives: tuple[CollectiveStats, ...] = ()

    @staticmethod
    def empty(hostname: str, now: float) -> NodeSnapshot:
        return NodeSnapshot(time=now, hostname=hostname, ranks=(), sources=())


# ---------------------------------------------------------------- GPUs (the NVML source fills these)

NVLINK_ERROR_TYPES = ("replay", "recovery", "crc_flit", "crc_data")

# What the driver says must be done to recover the GPU (NVML's nvmlDeviceGpuRecoveryAction_t, read as the field
# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, driver >= 570): NVML's code -> the `action` label value of
# frexporter_gpu_recovery_action. A code not listed (a newer driver's) is GPU_RECOVERY_ACTION_UNKNOWN.
GPU_RECOVERY_NONE = "none"
GPU_RECOVERY_ACTIONS: Mapping[int, str] = MappingProxyType({
    0: GPU_RECOVERY_NONE,
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
    5: "recover_imex_domain",
    6: "bus_reset",
    7: "system_reboot",
})
GPU_RECOVERY_ACTION_UNKNOWN = "unknown"


def gpu_recovery_action_name(code: int) -> str:
    """The `action` label value of an NVML recovery action code."""
    return GPU_RECOVERY_ACTIONS.get(code, GPU_RECOVERY_ACTION_UNKNOWN)

_EMPTY: Mapping[Any, Any] = MappingProxyType({})


@dataclass(frozen=True)
class EccErrors:
    corrected: int
    uncorrected: int


@dataclass(frozen=True)
class RemappedRows:
    correctable: int
    uncorrectable: int
    pending: bool
    failure: bool


@dataclass(frozen=True)
class GpuState:
    """One GPU at one poll. None means absent (unsupported, failed or lost)."""

    index: int
    uuid: str
    name: str
    lost: bool = False
    utilization_ratio: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    energy_joules: float | None = None
    sm_clock_hertz: float | None = None
    memory_clock_hertz: float | None = None
    throttle_reasons: int | None = None
    ecc_errors: EccErrors | None = None
    remapped_rows: RemappedRows | None = None
    pcie_replays: int | None = None
    nvlink_errors: Mapping[tuple[int, str], int] | None = None
    xid_errors: Mapping[int, int] = field(default_factory=lambda: _EMPTY)
    # NVML's recovery action code (GPU_RECOVERY_ACTIONS); None where the driver (< 570) or the GPU has none.
    recovery_action: int | None = None


@dataclass(frozen=True)
class GpuReading:
    timestamp: float
    gpus: tuple[GpuState, ...]
    driver_version: str | None = None
    # Per-field failures this poll (unsupported fields excluded), by reason.
    field_errors: Mapping[str, int] = field(default_factory=lambda: _EMPTY)

    @property
    def field_error_count(self) -> int:
        return sum(self.field_errors.values())
