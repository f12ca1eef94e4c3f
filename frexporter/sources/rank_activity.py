"""What a rank is doing, from its liveness, its sampled stack, its CPU use and its in-flight collectives.

Pure: no I/O, no clock (the caller passes the time); the ranks source keeps the previous activity per rank.
"""

from __future__ import annotations

from frexporter.model import (
    ACTIVITY_BUSY,
    ACTIVITY_GONE,
    ACTIVITY_IDLE,
    ACTIVITY_IN_COLLECTIVE,
    ACTIVITY_UNKNOWN,
    ACTIVITY_WEDGED,
    FRAMES_RECORDER,
    RANK_DOWN,
    RANK_UNRESPONSIVE,
    Activity,
    Frame,
)

# Process CPU (percent of one core) above which a rank outside collectives is computing, not waiting. A rank
# blocked in a sleep, a queue or I/O uses a few percent (its background threads); one computing in Python
# uses a whole core.
BUSY_CPU_PERCENT = 50.0
# The innermost frame's file under these paths: the training thread is in a torch.distributed call.
_DISTRIBUTED_PATHS = ("/torch/distributed/", "/torch/_C/_distributed")


def in_distributed(frames: tuple[Frame, ...]) -> bool:
    return bool(frames) and any(p in frames[0][1].replace("\\", "/") for p in _DISTRIBUTED_PATHS)


def classify(status: str, frames: tuple[Frame, ...], cpu_percent: float | None, inflight: bool) -> str:
    """The activity state (model.ACTIVITY_STATES) of a rank whose liveness is ``status`` (model.RANK_*)."""
    if status == RANK_DOWN:
        return ACTIVITY_GONE
    if status == RANK_UNRESPONSIVE:
        return ACTIVITY_WEDGED  # its stack (its last own sample, or py-spy's) is shown, not judged
    if not frames:
        return ACTIVITY_UNKNOWN
    if inflight and in_distributed(frames):
        return ACTIVITY_IN_COLLECTIVE
    if cpu_percent is None:
        return ACTIVITY_UNKNOWN  # one CPU sample so far: busy and idle look alike
    return ACTIVITY_BUSY if cpu_percent > BUSY_CPU_PERCENT else ACTIVITY_IDLE


def next_activity(previous: Activity | None, status: str, frames: tuple[Frame, ...], cpu_percent: float | None,
                  inflight: bool, now: float, frames_source: str = FRAMES_RECORDER) -> Activity:
    """This poll's activity; ``since`` carries over while the state and the headline function stay the same,
    and through a whole wedge (its frames change from the rank's last own sample to py-spy's, the wedge does
    not); ``last_busy`` carries over while the rank is not busy."""
    state = classify(status, frames, cpu_percent, inflight)
    last_busy = now if state == ACTIVITY_BUSY else previous.last_busy if previous is not None else None
    current = Activity(state=state, frames=frames, cpu_percent=cpu_percent, since=now, frames_source=frames_source,
                       last_busy=last_busy)
    if previous is not None and previous.state == state and previous.since is not None:
        old, new = previous.headline(), current.headline()
        if state == ACTIVITY_WEDGED or (old and old[:2]) == (new and new[:2]):
            return Activity(state=state, frames=frames, cpu_percent=cpu_percent, since=previous.since,
                            frames_source=frames_source, last_busy=last_busy)
    return current
