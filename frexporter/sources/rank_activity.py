"""What a rank is doing, from its liveness, its sampled stack, its CPU use, its in-flight collectives and whether
its GPU has work pending while its stack stands still.

Pure: no I/O, no clock (the caller passes the time); the ranks source keeps the previous activity per rank.

A rank waits when its training thread sits in a torch.distributed call (gloo's way), when its own collective
has been in flight longer than its PG's normal wait (NCCL's way: the call returns at once and the rank waits
wherever it next synchronizes; gloo's ``async_op=True`` too), or when it stands on one line with its GPU busy
(CUDA's spin wait burns a core, so CPU use alone would call it busy). Only then do CPU use and the stack decide
between busy and idle.
"""

from __future__ import annotations

from collections.abc import Iterable

from frexporter.model import (
    ACTIVITY_BUSY,
    ACTIVITY_GONE,
    ACTIVITY_GPU_WAIT,
    ACTIVITY_IDLE,
    ACTIVITY_IN_COLLECTIVE,
    ACTIVITY_UNKNOWN,
    ACTIVITY_WEDGED,
    FRAMES_RECORDER,
    RANK_DOWN,
    RANK_UNRESPONSIVE,
    Activity,
    Frame,
    PGState,
    in_distributed,
)

# Process CPU (percent of one core) above which a rank outside collectives is computing, not waiting. A rank
# blocked in a sleep, a queue or I/O uses a few percent (its background threads); one computing in Python
# uses a whole core.
BUSY_CPU_PERCENT = 50.0
# Seconds a rank's own collective must have been in flight, at least, before the rank counts as waiting in it
# when its PG has no learned normal wait yet (or a shorter one): a collective queued behind the step's compute
# on an NCCL stream is in flight for part of every step.
IN_COLLECTIVE_AFTER = 2.0
# Seconds the recorder must have seen the rank's GPU with work pending, its stack standing still, before the
# rank counts as waiting on its GPU: a healthy step syncs (loss.item()) for a fraction of a second.
GPU_WAIT_AFTER = 2.0


def own_collective_wait(pgs: Iterable[PGState], now: float) -> float | None:
    """Seconds the rank's longest-waiting own collective has been in flight past the point where it counts as
    waiting (its PG's normal wait, at least IN_COLLECTIVE_AFTER); None when none has (or none is known: the
    ages come from deep reads, which the exporter makes as soon as in-flight work stops moving)."""
    longest = None
    for pg in pgs:
        oldest = pg.oldest_inflight
        if oldest is None or pg.inflight_count <= 0:
            continue
        over = now - oldest.created - max(IN_COLLECTIVE_AFTER, pg.normal_wait_seconds or 0.0)
        if over >= 0.0 and (longest is None or over > longest):
            longest = over
    return longest


def classify(status: str, frames: tuple[Frame, ...], cpu_percent: float | None, inflight: bool,
             own_wait: float | None = None, gpu_wait: float | None = None) -> str:
    """The activity state (model.ACTIVITY_STATES) of a rank whose liveness is ``status`` (model.RANK_*).

    ``own_wait``: own_collective_wait's answer; ``gpu_wait``: seconds the recorder has seen the rank's GPU
    with work pending while its stack stood still (None: not seen, or no GPU)."""
    if status == RANK_DOWN:
        return ACTIVITY_GONE
    if status == RANK_UNRESPONSIVE:
        return ACTIVITY_WEDGED  # its stack (its last own sample, or py-spy's) is shown, not judged
    if own_wait is not None:
        return ACTIVITY_IN_COLLECTIVE  # whatever its CPU use and wherever its Python stands
    if not frames:
        return ACTIVITY_UNKNOWN
    if inflight and in_distributed(frames):
        return ACTIVITY_IN_COLLECTIVE
    if gpu_wait is not None and gpu_wait >= GPU_WAIT_AFTER:
        return ACTIVITY_GPU_WAIT
    if cpu_percent is None:
        return ACTIVITY_UNKNOWN  # one CPU sample so far: busy and idle look alike
    return ACTIVITY_BUSY if cpu_percent > BUSY_CPU_PERCENT else ACTIVITY_IDLE


def next_activity(previous: Activity | None, status: str, frames: tuple[Frame, ...], cpu_percent: float | None,
                  inflight: bool, now: float, frames_source: str = FRAMES_RECORDER, *, own_wait: float | None = None,
                  gpu_wait: float | None = None) -> Activity:
    """This poll's activity; ``since`` carries over while the state and the headline function stay the same,
    and through a whole wedge (its frames change from the rank's last own sample to py-spy's, the wedge does
    not); ``last_busy`` carries over while the rank is not busy."""
    state = classify(status, frames, cpu_percent, inflight, own_wait, gpu_wait)
    last_busy = now if state == ACTIVITY_BUSY else previous.last_busy if previous is not None else None
    current = Activity(state=state, frames=frames, cpu_percent=cpu_percent, since=now, frames_source=frames_source,
                       last_busy=last_busy)
    if previous is not None and previous.state == state and previous.since is not None:
        old, new = previous.headline(), current.headline()
        if state == ACTIVITY_WEDGED or (old and old[:2]) == (new and new[:2]):
            return Activity(state=state, frames=frames, cpu_percent=cpu_percent, since=previous.since,
                            frames_source=frames_source, last_busy=last_busy)
    return current
