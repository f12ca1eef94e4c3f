"""What a verdict's culprits are doing: their activity (from the snapshot's ranks, and for a rank waiting on its
GPU that GPU's load from NVML) and one line of summary."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from frexporter.analysis import text
from frexporter.analysis.gpu import by_uuid
from frexporter.model import (
    ACTIVITY_BUSY,
    ACTIVITY_GONE,
    ACTIVITY_GPU_WAIT,
    ACTIVITY_IDLE,
    ACTIVITY_IN_COLLECTIVE,
    ACTIVITY_UNKNOWN,
    ACTIVITY_WEDGED,
    FRAMES_PYSPY,
    UNKNOWN_ACTIVITY,
    Activity,
    RankState,
    in_distributed,
)

if TYPE_CHECKING:
    from frexporter.analysis.verdicts import Verdict

MAX_ACTIVITY_RANKS = 16  # culprits per verdict given an activity (the rest are in the ranks' own objects)
MAX_ACTIVITY_LINES = 2  # culprits described in the summary line


def where(activity: Activity) -> str:
    """'save_checkpoint (train.py:142)' for the headline frame; '' without a stack."""
    frame = activity.headline()
    if frame is None:
        return ""
    function, path, line = frame
    if not path:  # from a metric label: the function alone
        return function
    return f"{function} ({path.replace(chr(92), '/').rsplit('/', 1)[-1]}:{line})"


def gpu_load(state: RankState | None, gpus: Any) -> str:
    """'GPU 3: 100 % utilization at 124 W' for the rank's own GPU (by the UUID its recorder names); ''."""
    gpu = by_uuid(gpus).get(state.gpu_uuid) if state is not None and state.gpu_uuid and gpus is not None else None
    if gpu is None:
        return ""
    if gpu.lost:
        return f"GPU {gpu.index}: lost"
    load = [f"{round(100 * gpu.utilization_ratio)} % utilization" if gpu.utilization_ratio is not None else "",
            f"{round(gpu.power_watts)} W" if gpu.power_watts is not None else ""]
    said = " at ".join(part for part in load if part)
    return f"GPU {gpu.index}: {said}" if said else ""


def describe(rank: int, activity: Activity, now: float, gpu: str = "") -> str:
    """'rank 3 has been busy in save_checkpoint (train.py:142) for 95s, 100 % CPU'; '' when nothing is known.
    ``gpu``: gpu_load's phrase for the rank's GPU, said of a rank waiting on it."""
    at = where(activity)
    cpu = f", {round(activity.cpu_percent)} % CPU" if activity.cpu_percent is not None else ""
    span = f" for {text.seconds(now - activity.since)}" if activity.since is not None else ""
    if activity.state == ACTIVITY_WEDGED:
        if activity.frames_source == FRAMES_PYSPY:
            where_now = f" in {at}" if at else " (no Python frames in its main thread)"
            return (f"rank {rank} has been wedged{span}: its Python cannot run (the GIL held in native code); py-spy "
                    f"finds its main thread{where_now}")
        last = f" (its last sample was in {at})" if at else ""
        return (f"rank {rank} is wedged: its Python cannot run (the GIL held in native code), so it cannot "
                f"sample itself{last}; with --evidence-stacks py-spy reads its stack for the exporter and the "
                "evidence bundle")
    if activity.state == ACTIVITY_IN_COLLECTIVE:
        if activity.frames and not in_distributed(activity.frames):  # NCCL: the call returned, the rank waits on
            return f"rank {rank} has been waiting on its own collective in flight{span}" + (
                f", its Python in {at}" if at else "")
        return f"rank {rank} has been waiting in a collective{span}" + (f", called from {at}" if at else "")
    if activity.state == ACTIVITY_GPU_WAIT:
        return (f"rank {rank} has been waiting on its GPU{span}" + (f" in {at}" if at else "")
                + (f"; {gpu}" if gpu else ""))
    if activity.state in (ACTIVITY_BUSY, ACTIVITY_IDLE) and at:
        return f"rank {rank} has been {activity.state} in {at}{span}{cpu}"
    return ""


def with_activity(verdict: Verdict, ranks: Mapping[tuple[str, int], RankState], now: float,
                  gpus: Any = None) -> Verdict:
    """The verdict with its culprits' activities and, where one says something, a summary line about it
    (``gpus``: the node's GPU reading, for a culprit waiting on its GPU)."""
    acts: dict[str, Activity] = {}
    for rank in verdict.ranks[:MAX_ACTIVITY_RANKS]:
        state = ranks.get((verdict.job_id, rank))
        acts[str(rank)] = state.activity if state is not None else UNKNOWN_ACTIVITY
    lines = [line for rank, act in list(acts.items())[:MAX_ACTIVITY_LINES]
             if act.state not in (ACTIVITY_UNKNOWN, ACTIVITY_GONE)
             and (line := describe(int(rank), act, now, gpu_load(ranks.get((verdict.job_id, int(rank))), gpus)
                                   if act.state == ACTIVITY_GPU_WAIT else ""))]
    summary = verdict.summary
    if lines:
        summary = f"{summary} {'; '.join(lines)[:1].upper()}{'; '.join(lines)[1:]}."
    return replace(verdict, activity=acts, summary=summary)
