"""A wedged rank's stack from py-spy (torch's ``pyspy_dump``): the parser on real py-spy output and on garbage, the
activity it makes, and how the ranks source asks for it (once per wedge, never holding a poll, a few at a time).
The live end-to-end test is tests/e2e/test_wedged_stacks_live.py.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_wedged_stacks.py."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from frexporter import spool
from frexporter.analysis.culprit_activity import describe
from frexporter.model import FRAMES_PYSPY, FRAMES_RECORDER, RANK_OK, RANK_UNRESPONSIVE, Activity, RankState
from frexporter.sources import pyspy
from frexporter.sources.base import SourceError
from frexporter.sources.rank_activity import next_activity
from tests import spoolgen
from tests.harness import REPO, wait_for
from tests.shared.wedged_stacks import OWN_SAMPLE, Rig, ScriptedWorker

GOLDEN = REPO / "tests" / "golden" / "pyspy"
# Real py-spy 0.4 output: torch's pyspy_dump answer for tests/workers/job.py's rank holding the GIL in C, and
# `py-spy dump --nonblocking` of a process 43 frames deep (a non-ASCII function name, a thread named with quotes),
# the same with --native (C frames, no line numbers), and forced colours (CLICOLOR_FORCE=1).
WEDGED = (GOLDEN / "wedged.txt").read_bytes()
DEEP = (GOLDEN / "deep.txt").read_bytes()
NATIVE = (GOLDEN / "native.txt").read_bytes()
COLOR = (GOLDEN / "color.txt").read_bytes()


def test_real_dumps_parse_to_the_main_threads_innermost_frames() -> None:
    assert pyspy.parse_dump(WEDGED, "w") == (("hold_gil", "job.py", 54), ("<module>", "job.py", 106))
    deep = pyspy.parse_dump(DEEP, "d")
    assert len(deep) == spool.MAX_STACK_FRAMES  # 43 in the dump: the innermost kept, as the recorder keeps them
    assert deep[0] == ("rekursion_ü", "deep.py", 11) and set(deep[1:]) == {("rekursion_ü", "deep.py", 13)}
    assert pyspy.parse_dump(COLOR, "c") == deep
    native = pyspy.parse_dump(NATIVE, "n")
    assert native[:3] == (("clock_nanosleep", "libc.so.6", 0), ("nanosleep", "libc.so.6", 0),
                          ("usleep", "libc.so.6", 0))
    assert len(native) == spool.MAX_STACK_FRAMES


def test_main_thread_by_pid_else_by_name_and_only_the_first_process() -> None:
    text = WEDGED.decode()
    head, rest = text.split("Thread 23934", 1)
    main, other = rest.split("Thread 23943", 1)
    # Listed after another thread: found by its id, the process's pid.
    main_last = f"{head}Thread 23943{other}Thread 23934{main}"
    assert pyspy.parse_dump(main_last.encode(), "x")[0] == ("hold_gil", "job.py", 54)
    # Threads named by pthread ids (py-spy without native ids): the one named MainThread.
    hex_ids = text.replace("Thread 23934", "Thread 0x7F3A1C2B4740").replace("Thread 23943", "Thread 0x7F3A0D1FF640")
    assert pyspy.parse_dump(hex_ids.encode(), "x")[0] == ("hold_gil", "job.py", 54)
    # --subprocesses appends children's dumps, whose main threads are never taken for the rank's.
    child = text.replace("23934", "999").replace("hold_gil", "child_fn")
    both = f"{text}\n{'-' * 80}\n{child}"
    assert pyspy.parse_dump(both.encode(), "x")[0] == ("hold_gil", "job.py", 54)
    anonymous = hex_ids.replace('"MainThread"', '"renamed"')
    with pytest.raises(SourceError) as e:
        pyspy.parse_dump(f"{anonymous}\n{'-' * 80}\n{child}".encode(), "x")
    assert e.value.reason == pyspy.REASON_INVALID


def test_locals_and_blank_lines_are_passed_over() -> None:
    text = WEDGED.decode().replace("    hold_gil (job.py:54)\n", "    hold_gil (job.py:54)\n        Arguments:\n"
                                   "            seconds: 12.0\n\n")
    assert pyspy.parse_dump(text.encode(), "x")[:2] == (("hold_gil", "job.py", 54), ("<module>", "job.py", 106))


GARBAGE = {
    "not utf-8": (b"Process 1: x\n\xff\xfe\n", pyspy.REASON_INVALID),
    "binary": (bytes(range(256)) * 4, pyspy.REASON_INVALID),
    "empty": (b"", pyspy.REASON_INVALID),
    "a shell error": (b"sh: 1: py-spy: not found\n", pyspy.REASON_INVALID),
    "py-spy's permission error": (b"Permission Denied: Try running again with elevated permissions by going "
                                  b"'sudo env \"PATH=$PATH\" !!'\n", pyspy.REASON_INVALID),
    "html": (b"<html><body>Process 1: </body></html>", pyspy.REASON_INVALID),
    "no main thread": (WEDGED.replace(b"Thread 23934 (idle): \"MainThread\"", b"Thread 5 (idle): \"w\""),
                       pyspy.REASON_INVALID),
    "bad thread line": (WEDGED.replace(b"Thread 23934 (idle)", b"Thread 23934 (idle) extra"), pyspy.REASON_INVALID),
    "bad frame": (WEDGED.replace(b"hold_gil (job.py:54)", b"hold_gil job.py:54"), pyspy.REASON_INVALID),
    "frame without file": (WEDGED.replace(b"hold_gil (job.py:54)", b"hold_gil ()"), pyspy.REASON_INVALID),
    "long function": (WEDGED.replace(b"hold_gil", b"f" * (spool.MAX_FRAME_TEXT_CHARS + 1)), spool.LIMIT_TEXT),
    "long file": (WEDGED.replace(b"job.py:54", b"d/" * 300 + b"job.py:54"), spool.LIMIT_TEXT),
    "long line": (WEDGED.replace(b"hold_gil", b"f (" * 2000), spool.LIMIT_TEXT),
    "oversized": (WEDGED + b"    x (y.py:1)\n" * (pyspy.MAX_DUMP_BYTES // 15), "oversized"),
}


@pytest.mark.parametrize("case", sorted(GARBAGE))
def test_garbage_is_a_counted_reason_never_a_crash(case: str) -> None:
    data, reason = GARBAGE[case]
    with pytest.raises(SourceError) as e:
        pyspy.parse_dump(data, "rank0.sock")
    assert e.value.reason == reason


def test_odd_but_bounded_frames_parse() -> None:
    odd = WEDGED.replace(b"hold_gil (job.py:54)", b"Foo.<locals>.<lambda> (dir (copy)/my:file.py:7)") \
        .replace(b"<module> (job.py:106)", b"<module> (job.py:99999999999999999999)")
    frames = pyspy.parse_dump(odd, "x")
    assert frames[0] == ("Foo.<locals>.<lambda>", "dir (copy)/my:file.py", 7)
    assert frames[1] == ("<module>", "job.py:99999999999999999999", 0)  # not a line number we keep: part of the name


def test_py_spy_names_keep_torch_and_the_standard_library_out_of_the_headline() -> None:
    frames = (("wait", "torch/distributed/distributed_c10d.py", 10), ("get", "queue.py", 180),
              ("decode", "json/decoder.py", 337), ("train_step", "train.py", 42), ("<module>", "train.py", 99))
    assert Activity(state="wedged", frames=frames, frames_source=FRAMES_PYSPY).headline() == frames[3]
    assert Activity(frames=(("f", "transformers/trainer.py", 1),)).headline()[1] == "transformers/trainer.py"
    assert Activity(frames=(("f", "C:/venv/Lib/site-packages/torch/x.py", 1), ("g", "C:/job/t.py", 2))
                    ).headline()[0] == "g"


def test_wedged_text_and_since_across_sources() -> None:
    own = next_activity(None, RANK_UNRESPONSIVE, (OWN_SAMPLE,), None, False, 100.0)
    assert (own.state, own.frames_source, own.since) == ("wedged", FRAMES_RECORDER, 100.0)
    assert "cannot sample itself (its last sample was in idle (job.py:47))" in describe(0, own, 110.0)
    assert "--evidence-stacks" in describe(0, own, 110.0)
    spied = next_activity(own, RANK_UNRESPONSIVE, pyspy.parse_dump(WEDGED, "w"), None, False, 101.0, FRAMES_PYSPY)
    # Another function, the same wedge: since stays when it stopped answering.
    assert (spied.state, spied.frames_source, spied.since) == ("wedged", FRAMES_PYSPY, 100.0)
    assert describe(0, spied, 130.0) == ("rank 0 has been wedged for 30s: its Python cannot run (the GIL held in "
                                         "native code); py-spy finds its main thread in hold_gil (job.py:54)")
    assert spied.to_json()["frames_source"] == "py-spy"
    back = next_activity(spied, RANK_OK, (OWN_SAMPLE,), 1.0, False, 140.0)
    assert (back.state, back.frames_source, back.since) == ("idle", FRAMES_RECORDER, 140.0)


# ------------------------------------------------------------------ the ranks source, over real sockets


def spied(r: Rig, rank: int = 0) -> RankState:
    return wait_for(lambda: (s := r.poll().get(rank)) and s.activity.frames_source == FRAMES_PYSPY and s,
                    timeout=10, what="py-spy's frames in the activity")


def test_one_fetch_per_wedge_a_slow_refresh_and_a_new_wedge_asks_again(rig) -> None:
    r = rig({"ping": (200, b"pong"), pyspy.HANDLER: (200, WEDGED)})
    first = r.poll()[0]
    assert first.status == RANK_UNRESPONSIVE and first.activity.state == "wedged"
    assert (first.activity.frames, first.activity.frames_source) == ((OWN_SAMPLE,), FRAMES_RECORDER)
    state = spied(r)
    assert state.status == RANK_UNRESPONSIVE and state.activity.state == "wedged"
    assert state.activity.frames == (("hold_gil", "job.py", 54), ("<module>", "job.py", 106))
    for _ in range(20):
        assert r.poll()[0].activity.frames_source == FRAMES_PYSPY
    assert r.calls() == 1
    r.offset += pyspy.REFRESH_INTERVAL
    wait_for(lambda: r.poll() and r.calls() == 2, timeout=10, what="the refresh")
    for _ in range(5):
        r.poll()
    assert r.calls() == 2
    # It recovers: its own samples again, py-spy's frames dropped.
    spoolgen.refresh(r.tmp, "job", 0, counter=2)
    back = r.poll()[0]
    assert back.status == RANK_OK and back.activity.frames_source == FRAMES_RECORDER
    # A new wedge is asked about at once, without waiting for the refresh interval.
    r.offset += 10.0
    wait_for(lambda: r.poll()[0].status == RANK_UNRESPONSIVE, timeout=10, what="wedged again")
    spied(r)
    assert r.calls() == 3
    assert not r.errors


def test_failing_py_spy_is_counted_once_per_wedge_and_the_own_sample_stays(rig) -> None:
    r = rig({"ping": (200, b"pong"), pyspy.HANDLER: (500, b"sh: 1: py-spy: not found\n")})
    wait_for(lambda: r.poll() and r.errors[pyspy.REASON_FAILED], timeout=10, what="py-spy's failure counted")
    for _ in range(10):
        state = r.poll()[0]
    assert state.activity.state == "wedged" and state.activity.frames == (OWN_SAMPLE,)
    assert state.activity.frames_source == FRAMES_RECORDER
    assert r.errors == Counter({pyspy.REASON_FAILED: 1}) and r.calls() == 1


@pytest.mark.parametrize("answer,reason", [((200, b"\xff\xfegarbage"), pyspy.REASON_INVALID),
                                           ((200, b"Process 1: x\n" + b"y" * (pyspy.MAX_DUMP_BYTES + 70_000)),
                                            "oversized"),
                                           ((404, b""), "handler_missing")])
def test_bad_answers_through_the_socket(rig, answer: tuple[int, bytes], reason: str) -> None:
    r = rig({"ping": (200, b"pong"), pyspy.HANDLER: answer})
    wait_for(lambda: r.poll() and r.errors[reason], timeout=10, what=reason)
    assert r.poll()[0].activity.frames == (OWN_SAMPLE,)
    assert r.errors == Counter({reason: 1})


def test_off_without_the_flag_or_the_handler(rig) -> None:
    off = rig({"ping": (200, b"pong"), pyspy.HANDLER: (200, WEDGED)}, wedged_stacks=False)
    for _ in range(5):
        assert off.poll()[0].activity.frames_source == FRAMES_RECORDER
    assert off.calls() == 0
    unlisted = rig({"ping": (200, b"pong"), pyspy.HANDLER: (200, WEDGED)}, handlers=("ping",))
    for _ in range(5):
        assert unlisted.poll()[0].status == RANK_UNRESPONSIVE
    assert unlisted.calls() == 0


# ------------------------------------------------------------------ evidence bundles


def test_evidence_reads_culprits_first_their_stacks_and_no_dump_past_the_bound(tmp_path: Path) -> None:
    from frexporter.analysis import Verdict
    from frexporter.sources.evidence_capture import read_evidence

    handlers = ("ping", "fr_trace_json", pyspy.HANDLER)
    ranks = [RankState(job_id="job", rank=r, local_rank=r, world_size=2, hostname="node-a", pid=100 + r,
                       torch_version="2.13.0", gpu_uuid="", status=RANK_UNRESPONSIVE, heartbeat=None,
                       heartbeat_age=None, socket_alive=True, pgs=(), socket=f"w{r}.sock", handlers=handlers)
             for r in (0, 1)]
    stuck = Verdict(kind="missing_rank", job_id="job", pg="0", pg_desc="default_pg", ranks=(1,), waiting_ranks=(0,),
                    seq=5, op="all_reduce", since=None, age_seconds=None, timeout_seconds=None, budget_used=None,
                    summary="rank 1 never joined")
    shared = {"open": 0, "most": 0}

    def read(answers: dict[str, tuple[int, bytes] | None], stacks: bool) -> tuple[list[tuple[str, int]], list[str]]:
        workers = [ScriptedWorker(tmp_path / f"w{r}.sock", answers, shared) for r in (0, 1)]
        notes: list[str] = []
        try:
            files = [(f.name, len(f.body)) for f in read_evidence(
                stuck, ranks, str(tmp_path), stacks=stacks, timeout=2.0, started=time.monotonic(), within=10.0,
                max_bytes=1 << 30, note=lambda reason, _message: notes.append(reason))]
        finally:
            for worker in workers:
                worker.close()
            for r in (0, 1):
                (tmp_path / f"w{r}.sock").unlink()
        return files, notes

    fr = (200, b'{"entries": []}')
    files, notes = read({"fr_trace_json": fr, pyspy.HANDLER: (200, WEDGED)}, stacks=True)
    assert files == [("fr_rank1.json", 15), ("stacks_rank1.txt", len(WEDGED)), ("fr_rank0.json", 15)] and not notes
    assert read({"fr_trace_json": fr, pyspy.HANDLER: (200, WEDGED)}, stacks=False)[0] == [
        ("fr_rank1.json", 15), ("fr_rank0.json", 15)]
    # The stack is read with py-spy's bound, as the ranks source reads it.
    files, notes = read({"fr_trace_json": fr, pyspy.HANDLER: (200, b"x" * (pyspy.MAX_DUMP_BYTES + 70_000))},
                        stacks=True)
    assert [name for name, _ in files] == ["fr_rank1.json", "fr_rank0.json"] and notes == ["oversized"]
