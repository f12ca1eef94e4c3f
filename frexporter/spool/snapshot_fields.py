"""A snapshot's optional fields, parsed leniently: a malformed one is dropped whole and reported as
(reason, message), never failing the snapshot (a stack or a GPU wait must not cost a rank its other metrics)."""

from __future__ import annotations

from typing import Any

from frexporter import reasons, safetext
from frexporter.spool.layout import INT_MAX
from frexporter.spool.limits import MAX_FRAME_TEXT_CHARS, MAX_STACK_FRAMES

Problems = tuple[tuple[str, str], ...]
# The longest GPU wait a snapshot may state (a week, in milliseconds): past it the field is garbage.
MAX_GPU_WAIT_MS = 7 * 24 * 3600 * 1000
MAX_CUDA_DEVICE = 1 << 16


def parse_stack(raw: Any, what: str) -> tuple[tuple[tuple[str, str, int], ...], Problems]:
    """A snapshot's ``stack``: frames as (function, file, line), innermost first."""
    if raw is None:
        return (), ()
    if not isinstance(raw, list):
        return (), ((reasons.SNAPSHOT_FIELD_INVALID, f"{what}: stack is not a list; dropped"),)
    if len(raw) > MAX_STACK_FRAMES:
        return (), (
            (
                reasons.LIMIT_ITEMS,
                f"{what}: stack has {len(raw)} frames, over the bound of {MAX_STACK_FRAMES}; dropped",
            ),
        )
    out = []
    for i, frame in enumerate(raw):
        if (
            not isinstance(frame, list)
            or len(frame) != 3
            or not isinstance(frame[0], str)
            or not isinstance(frame[1], str)
            or type(frame[2]) is not int
            or not 0 <= frame[2] <= INT_MAX
        ):
            return (), ((reasons.SNAPSHOT_FIELD_INVALID, f"{what}: stack[{i}] is not [function, file, line]; dropped"),)
        if len(frame[0]) > MAX_FRAME_TEXT_CHARS or len(frame[1]) > MAX_FRAME_TEXT_CHARS:
            return (), (
                (
                    reasons.LIMIT_TEXT,
                    f"{what}: stack[{i}] has a string over the bound of {MAX_FRAME_TEXT_CHARS} characters; dropped",
                ),
            )
        if not safetext.is_valid(frame[0]) or not safetext.is_valid(frame[1]):
            return (), ((reasons.SNAPSHOT_FIELD_INVALID, f"{what}: stack[{i}] is not UTF-8; dropped"),)
        out.append((frame[0], frame[1], frame[2]))
    return tuple(out), ()


def parse_gpu_wait(raw: Any, what: str) -> tuple[tuple[int, float] | None, Problems]:
    """A snapshot's ``gpu_wait``: ``[]`` (none) or ``[device, milliseconds]`` -> (device, seconds) or None."""
    if raw is None or raw == []:
        return None, ()
    if (
        not isinstance(raw, list)
        or len(raw) != 2
        or any(type(v) is not int for v in raw)
        or not 0 <= raw[0] < MAX_CUDA_DEVICE
        or not 0 <= raw[1] <= MAX_GPU_WAIT_MS
    ):
        return None, ((reasons.SNAPSHOT_FIELD_INVALID, f"{what}: gpu_wait is not [device, milliseconds]; dropped"),)
    return (raw[0], raw[1] / 1000.0), ()
