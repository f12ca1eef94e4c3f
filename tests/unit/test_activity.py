"""The activity classifier (pure), the culprit's line in a verdict, and bad stack/cpu fields in a snapshot."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from frexporter import spool
from frexporter.analysis.culprit_activity import describe
from frexporter.model import BUSY_HOLD_SECONDS, RANK_DOWN, RANK_OK, RANK_UNRESPONSIVE, Activity
from frexporter.sources.rank_activity import BUSY_CPU_PERCENT, classify, next_activity

TORCH_WAIT = ("all_reduce", "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", 2950)
USER = ("save_checkpoint", "/job/train.py", 142)
STDLIB = ("sleep_wrapper", "/usr/lib/python3.11/threading.py", 320)


def test_classify_each_state() -> None:
    assert classify(RANK_DOWN, (USER,), 100.0, False) == "gone"
    assert classify(RANK_UNRESPONSIVE, (USER,), None, True) == "wedged"
    assert classify(RANK_OK, (), 100.0, True) == "unknown"
    assert classify(RANK_OK, (TORCH_WAIT, USER), 3.0, True) == "in_collective"
    # In torch.distributed with nothing in flight (e.g. the rendezvous) is judged by CPU like anything else.
    assert classify(RANK_OK, (TORCH_WAIT, USER), 3.0, False) == "idle"
    # Computing with an async collective in flight is busy, not waiting.
    assert classify(RANK_OK, (USER,), BUSY_CPU_PERCENT + 1, True) == "busy"
    assert classify(RANK_OK, (USER,), BUSY_CPU_PERCENT - 1, True) == "idle"
    assert classify(RANK_OK, (USER,), None, False) == "unknown"


def test_since_carries_over_while_state_and_headline_stay() -> None:
    a = next_activity(None, RANK_OK, (USER,), 99.0, False, 100.0)
    assert (a.state, a.since) == ("busy", 100.0)
    b = next_activity(a, RANK_OK, (("inner", "/job/train.py", 7), USER), 98.0, False, 130.0)
    assert b.since == 130.0  # headline moved to another function: a new episode
    c = next_activity(b, RANK_OK, (("inner", "/job/train.py", 9), USER), 97.0, False, 160.0)
    assert c.since == 130.0  # same function, another line
    d = next_activity(c, RANK_OK, (("inner", "/job/train.py", 9), USER), 1.0, False, 170.0)
    assert (d.state, d.since) == ("idle", 170.0)


def test_last_busy_is_kept_while_not_busy() -> None:
    a = next_activity(None, RANK_OK, (USER,), 1.0, False, 100.0)
    assert (a.state, a.last_busy, a.held_busy(100.0)) == ("idle", None, False)
    b = next_activity(a, RANK_OK, (USER,), 99.0, False, 110.0)
    assert (b.state, b.last_busy, b.held_busy(110.0)) == ("busy", 110.0, True)
    c = next_activity(b, RANK_OK, (USER,), 99.0, False, 120.0)
    assert (c.since, c.last_busy) == (110.0, 120.0)
    d = next_activity(c, RANK_OK, (USER,), 1.0, False, 121.0)
    assert (d.state, d.last_busy) == ("idle", 120.0)
    assert d.held_busy(120.0 + BUSY_HOLD_SECONDS) and not d.held_busy(120.0 + BUSY_HOLD_SECONDS + 1)


def test_headline_skips_torch_and_stdlib() -> None:
    a = Activity(state="in_collective", frames=(TORCH_WAIT, STDLIB, USER), cpu_percent=1.0, since=0.0)
    assert a.headline() == USER
    assert Activity(frames=(TORCH_WAIT,)).headline() == TORCH_WAIT
    assert Activity().headline() is None


def test_describe_lines() -> None:
    busy = Activity(state="busy", frames=(USER,), cpu_percent=100.0, since=5.0)
    assert describe(3, busy, 100.0) == "rank 3 has been busy in save_checkpoint (train.py:142) for 95s, 100 % CPU"
    idle = Activity(state="idle", frames=(STDLIB, ("wait_for_data", "/job/data.py", 40)), cpu_percent=1.0,
                    since=90.0)
    assert describe(2, idle, 100.0).startswith("rank 2 has been idle in wait_for_data (data.py:40)")
    wedged = describe(1, Activity(state="wedged", frames=(USER,)), 100.0)
    assert "cannot sample itself (its last sample was in save_checkpoint (train.py:142))" in wedged
    assert "--evidence-stacks" in wedged
    assert describe(1, Activity(), 100.0) == ""


def _snapshot(**extra: object) -> dict[str, object]:
    return {"format": spool.SNAPSHOT_MAP_FORMAT, "pid": 7, "time": 1.0, "interval": 1.0, "counter": 1,
            "status": {}, "errors": {}, "state": "running", "message": "", **extra}


def test_snapshot_stack_and_cpu_parse() -> None:
    snap = spool.parse_snapshot(_snapshot(cpu=1.5, stack=[list(USER), list(TORCH_WAIT)]))
    assert snap.cpu == 1.5 and snap.stack == (USER, TORCH_WAIT) and snap.problems == ()
    older = spool.parse_snapshot(_snapshot())  # a recorder before stack sampling
    assert older.cpu is None and older.stack == () and older.problems == ()


def test_bad_stack_and_cpu_are_dropped_and_counted_not_fatal() -> None:
    long_text = "x" * (spool.MAX_FRAME_TEXT_CHARS + 1)
    cases = [
        ({"stack": "main"}, spool.SNAPSHOT_FIELD_INVALID),
        ({"stack": [["f", "a.py"]]}, spool.SNAPSHOT_FIELD_INVALID),
        ({"stack": [["f", "a.py", "12"]]}, spool.SNAPSHOT_FIELD_INVALID),
        ({"stack": [["f", "a.py", True]]}, spool.SNAPSHOT_FIELD_INVALID),
        ({"stack": [["f", "a.py", -1]]}, spool.SNAPSHOT_FIELD_INVALID),
        ({"stack": [[1, "a.py", 1]]}, spool.SNAPSHOT_FIELD_INVALID),
        ({"stack": [["f", long_text, 1]]}, spool.LIMIT_TEXT),
        ({"stack": [["f", "a.py", 1]] * (spool.MAX_STACK_FRAMES + 1)}, spool.LIMIT_ITEMS),
        ({"stack": [["f\udcff", "a.py", 1]]}, spool.SNAPSHOT_FIELD_INVALID),
        ({"cpu": "1.0"}, spool.SNAPSHOT_FIELD_INVALID),
        ({"cpu": -1}, spool.SNAPSHOT_FIELD_INVALID),
        ({"cpu": True}, spool.SNAPSHOT_FIELD_INVALID),
    ]
    for extra, reason in cases:
        # Through JSON text, as the exporter reads it (a lone surrogate comes from a \udcff escape).
        obj = json.loads(json.dumps(_snapshot(**extra)))
        snap = spool.parse_snapshot(obj)
        assert [r for r, _ in snap.problems] == [reason], extra
        assert snap.stack == () and snap.pid == 7 and snap.counter == 1  # the rest of the snapshot stands
    nan = spool.parse_snapshot(json.loads(json.dumps(_snapshot()).replace('"pid"', '"cpu": NaN, "pid"')))
    assert nan.cpu is None and [r for r, _ in nan.problems] == [spool.SNAPSHOT_FIELD_INVALID]


def test_recorder_stack_sample_is_bounded_and_parses() -> None:
    """The recorder's own sampler, on this thread's real stack: deep recursion, a long and a non-UTF-8 file name
    and a '%' in a name all come out as a stack the exporter accepts, cut to its bounds."""
    import threading

    from frexporter.recorder.stacks import stack_sampler

    errors: list[str] = []
    sample = stack_sampler(threading.get_ident(), lambda reason, e: errors.append(reason))
    odd = "/" + "d" * 2000 + "/caf\udce9%s.py"
    namespace: dict[str, object] = {}
    exec(compile("def deep_100pct(n, f):\n    return deep_100pct(n - 1, f) if n else f()\n", odd, "exec"),
         namespace)
    out = namespace["deep_100pct"](3 * spool.MAX_STACK_FRAMES, sample)  # type: ignore[operator]
    assert errors == []
    text = json.dumps(_snapshot()).replace('"pid"', f'"stack": [{out.decode()}], "pid"')  # as the recorder splices it
    snap = spool.parse_snapshot(json.loads(text))
    assert snap.problems == ()
    assert len(snap.stack) == spool.MAX_STACK_FRAMES
    function, path, line = snap.stack[1]  # [0] is the sampler's own frame, here on the sampled thread
    assert function == "deep_100pct" and line == 2
    assert path.endswith("/caf\\udce9%s.py") and len(path) == spool.MAX_FRAME_TEXT_CHARS


def test_stacks_can_be_turned_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from frexporter.recorder.publisher import Publisher
    from frexporter.recorder.stacks import stacks_enabled

    assert stacks_enabled({}) and stacks_enabled({"FREXPORTER_STACKS": "1"})
    assert not any(stacks_enabled({"FREXPORTER_STACKS": v}) for v in ("0", "false", "No", " off "))
    monkeypatch.setenv("FREXPORTER_STACKS", "0")
    assert Publisher(str(tmp_path), "j", 1.0)._sample_stack() == b""
    monkeypatch.delenv("FREXPORTER_STACKS")
    # The recorder samples the main thread, which is the one running this test.
    assert b'"test_stacks_can_be_turned_off"' in Publisher(str(tmp_path), "j", 1.0)._sample_stack()


def test_recorder_stack_sample_lines_follow_the_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames are kept encoded per code object and instruction offset: one frame sampled at two lines, and again
    at the first, reports each line; a cache that overflows starts over and still reports them right."""
    import threading

    from frexporter.recorder import stacks

    def lines_of(sample: Callable[[], bytes]) -> list[int]:
        first = sample()  # three call sites of one code object, the last one sampled twice
        second = sample()
        again = [sample() for _ in range(2)]
        return [json.loads(f"[{raw.decode()}]")[1][2] for raw in (first, second, *again)]

    here = lines_of.__code__.co_firstlineno
    expected = [here + 1, here + 2, here + 3, here + 3]
    assert lines_of(stacks.stack_sampler(threading.get_ident(), lambda reason, e: None)) == expected
    monkeypatch.setattr(stacks, "STACK_CACHE_MAX", 2)
    assert lines_of(stacks.stack_sampler(threading.get_ident(), lambda reason, e: None)) == expected
