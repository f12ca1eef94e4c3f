"""The training thread's stack, sampled by the recorder's thread for its snapshot (names and lines only)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from typing import Any

from frexporter import reasons, spool

# Encoded frames (per code object and instruction offset) the stack sampler keeps; past this it starts over (a
# stalled rank's stacks touch a few hundred, a long-lived job may compile many more functions).
STACK_CACHE_MAX = 16384


def stacks_enabled(environ: Mapping[str, str]) -> bool:
    """FREXPORTER_STACKS=0 (or false, no, off) turns the stack sampling off: activity is then ``unknown``
    unless the rank is wedged or gone (no frame tells a collective from computing or waiting)."""
    return environ.get("FREXPORTER_STACKS", "1").strip().lower() not in ("0", "false", "no", "off")


def _no_stack() -> bytes:
    return b""


def stack_sampler(thread_id: int | None, count_error: Callable[[str, BaseException], None]
                  ) -> Callable[[], bytes]:
    """A function giving the stack of thread ``thread_id`` (the training thread) as the JSON items of the
    snapshot's ``stack`` list: ``["function","file",line]`` per frame, innermost first, at most
    ``spool.MAX_STACK_FRAMES``. Names and lines only: never a local or an argument.

    It runs in the snapshot under the GIL, from cold caches, on every frame of a stalled rank's stack (up to
    32 of them), so a frame must cost next to nothing: each frame's encoded item is kept per code object and
    instruction offset (``f_lasti``), which fixes its line. A frame then costs two dictionary lookups; the
    line table is decoded (``f_lineno``) only for an offset not seen before. The code objects are held so
    that their ids are not reused. A failure is counted once and turns sampling off (an empty stack) rather
    than costing every snapshot.
    """
    frames = sys._current_frames
    limit, chars = spool.MAX_STACK_FRAMES, spool.MAX_FRAME_TEXT_CHARS
    # id(code) -> (code, its encoded item as a format awaiting the line, {offset: encoded item})
    cache: dict[int, tuple[Any, bytes, dict[int, bytes]]] = {}
    size = 0  # items kept in all the offset maps
    broken = False

    def utf8(text: str) -> str:  # a file name that was not UTF-8 holds lone surrogates: the exporter refuses those
        return text.encode("utf-8", "backslashreplace").decode("utf-8")

    def encode(code: Any) -> bytes:
        name = utf8(getattr(code, "co_qualname", code.co_name))[:chars]
        path = utf8(code.co_filename)[-chars:]  # the tail names the file; the head is the install prefix
        return json.dumps([name, path]).encode()[:-1].replace(b"%", b"%%") + b",%d]"

    def sample() -> bytes:
        nonlocal broken, size
        if broken:
            return b""
        try:
            frame = frames().get(thread_id)  # type: ignore[arg-type]
            out: list[bytes] = []
            add = out.append
            while frame is not None:
                code = frame.f_code
                hit = cache.get(id(code))
                if hit is None or hit[0] is not code:
                    hit = cache[id(code)] = (code, encode(code), {})
                lasti = frame.f_lasti
                item = hit[2].get(lasti)
                if item is None:
                    if size >= STACK_CACHE_MAX:  # every code kept has an item: this bounds both
                        cache.clear()
                        size = 0
                        hit = cache[id(code)] = (code, hit[1], {})
                    item = hit[2][lasti] = hit[1] % (frame.f_lineno or 0)
                    size += 1
                add(item)
                if len(out) >= limit:
                    break
                frame = frame.f_back
            return b",".join(out)
        except Exception as e:
            broken = True
            count_error(reasons.STACK_SAMPLE, e)
            return b""

    return sample
