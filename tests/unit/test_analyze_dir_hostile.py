"""`frexporter analyze DIR` on a directory someone hostile could write: odd verdict.json files, text that would
break or drive a terminal, files whose parse would take gigabytes, a rank dumped twice, and entries that are not
regular files (symbolic links, FIFOs, sockets, directories, devices).

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_analyze_dir_hostile.py."""

from __future__ import annotations

import gc
import json
import os
import pickle
import socket
import stat
from pathlib import Path

import pytest

from frexporter.analysis.kinds import MISSING_RANK
from frexporter.model import Verdict
from frexporter.postmortem import dumpfiles, report
from tests import fr_cases
from tests.shared.analyze_dir_hostile import DEEP, SURROGATE_ESCAPE, dump_dir, missing_rank_dumps, write_file


def _kinds(result: report.Report) -> list[tuple[str, tuple[int, ...]]]:
    return [(v.kind, v.ranks) for v in result.verdicts]


# --- 1. verdict.json of any shape ----------------------------------------------------------------------------


@pytest.mark.parametrize(("content", "says"), [
    (b"[1, 2]", "but a list"), (b"7", "but a number"), (b'"verdict"', "but a string"),
    (b'{"verdict": [1]}', 'a "verdict" that is a list'), (b'{"verdict": "stalled"}', 'a "verdict" that is a string'),
    (DEEP, "nested too deeply"), (b'{"verdict": {"job_id": ' + DEEP + b"}}", "nested too deeply"),
], ids=["list", "number", "string", "verdict-list", "verdict-string", "deep", "deep-job-id"])
def test_a_verdict_json_of_any_shape_is_one_problem_line_and_the_dumps_are_judged(
        tmp_path: Path, content: bytes, says: str) -> None:
    directory = dump_dir(tmp_path / "bundle")
    (directory / report.EVIDENCE_FILE).write_bytes(content)
    result = report.from_dir(str(directory), 0.0)
    text = report.render_text(result)
    assert _kinds(result) == [(MISSING_RANK, (2,))]
    assert result.recorded is None
    problem = [p for p in result.problems if report.EVIDENCE_FILE in p]
    assert len(problem) == 1 and says in problem[0] and "\n" not in problem[0], result.problems
    assert f"  skipped: {problem[0]}" in text.splitlines()


def test_a_recorded_verdict_is_still_shown_with_its_job(tmp_path: Path) -> None:
    directory = dump_dir(tmp_path / "bundle")
    write_file(directory, report.EVIDENCE_FILE, {"verdict": {"kind": "missing_rank", "summary": "rank 2 never came",
                                                          "job_id": "train-7"}, "files": {}})
    result = report.from_dir(str(directory), 0.0)
    assert result.problems == []
    assert [v.job_id for v in result.verdicts] == ["train-7"]
    assert "  evidence bundle recorded by the exporter: missing_rank: rank 2 never came" in report.render_text(result)


def test_render_json_repairs_surrogates_anywhere_in_a_verdict() -> None:
    v = Verdict(kind="stalled\udc80", job_id="j", pg="0", pg_desc="d\udcff", ranks=(1,), waiting_ranks=(),
                seq=1, op="all_reduce", since=None, age_seconds=None, timeout_seconds=None, budget_used=None,
                summary="s\ud800", details={"k\udc80": ["v\udc81"]})
    text = report.render_json([v])
    assert not SURROGATE_ESCAPE.search(text) and text.isascii()
    assert json.loads(text)[0]["details"] == {"k\ufffd": ["v\ufffd"]}


ONE_PAST = {  # the bound, and a file one past it
    "json-strings": ("MAX_FILE_STRINGS", lambda n: b'{"entries": [' + b'"ab",' * n + b'""]}'),
    "json-values": ("MAX_JSON_VALUES", lambda n: b'{"entries": [' + b"0," * n + b"0]}"),
    "json-keys": ("MAX_JSON_KEYS", lambda n: b'{"entries": [], "x": {' + b'"":0,' * n + b'"":0}}'),
    "pickle-lists": ("MAX_FILE_CONTAINERS", lambda n: b"\x80\x04" + b"]" * (n + 1) + b"."),
    "pickle-strings": ("MAX_FILE_STRINGS", lambda n: b"\x80\x04" + b"\x8c\x00" * (n + 1) + b"."),
    "pickle-numbers": ("MAX_FILE_NUMBERS", lambda n: b"\x80\x04" + b"M\xff\xff" * (n + 1) + b"."),
    "pickle-values": ("MAX_PICKLE_VALUES", lambda n: b"\x80\x04" + b"N" * (n + 1) + b"."),
}


@pytest.mark.parametrize("bound", sorted(ONE_PAST))
def test_each_bound_refuses_a_file_one_past_it(bound: str) -> None:
    name, build = ONE_PAST[bound]
    n = getattr(dumpfiles, name)
    with pytest.raises(dumpfiles.DumpError, match=rf" \(counted before parsing\), over the bound of {n} that "):
        dumpfiles.decode(build(n), "f")


def test_a_full_ring_of_torch_shaped_entries_passes_the_counts() -> None:
    entry = {"record_id": 99999, "pg_id": 0, **fr_cases.event("all_reduce", 99999, ((1024, 1024),)),
             "thread_name": "python", "thread_id": "140266446781312", "time_discovered_started_ns": 0}
    head = b'{"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": ['
    assert dumpfiles.check_json(head + b",".join([json.dumps(entry).encode()] * dumpfiles.trace.MAX_ENTRIES)
                                + b"]}") is None
    # torch's pickler memoizes what entries share (text, frames), as pickle does here
    ring = [dict(entry, record_id=i) for i in range(dumpfiles.trace.MAX_ENTRIES)]
    assert dumpfiles.check_pickle(pickle.dumps({"version": "2.10", "entries": ring}, protocol=2)) is None


def test_a_json_dump_is_bounded_by_its_decoded_text() -> None:
    # json.loads decodes the bytes first: one character past U+FFFF makes every character take 4 bytes.
    data = b'{"entries": [], "pad": "\xf0\x9f\x98\x80' + b"x" * (dumpfiles.MAX_JSON_BYTES // 4) + b'"}'
    assert "(4 a character decoded), over the bound" in (dumpfiles.check_json(data) or "")
    assert dumpfiles.check_json(data.replace(b"\xf0\x9f\x98\x80", b"y")) is None


def test_parsed_dumps_share_their_text_and_are_bounded_in_all(tmp_path: Path) -> None:
    doc = missing_rank_dumps(world=(0, 1, 2, 3, 4))[0]
    for rank in range(4):
        write_file(tmp_path, f"trace_{rank}", doc)
    dumps, problems = dumpfiles.load_dir(str(tmp_path))
    assert problems == []
    descs = {id(e.pg_desc) for d in dumps for e in d.dump.entries}
    sizes = {id(e.input_sizes) for d in dumps for e in d.dump.entries}
    assert len(descs) == 1 and len(sizes) == 1  # one object for the 12 entries of 4 files
    shared = dumpfiles._Interner()
    _dump, per_file = dumpfiles._compact(dumpfiles.parse_file(json.dumps(doc).encode(), "f"), shared)
    three_files = shared.bytes + 3 * per_file
    dumps, problems = dumpfiles.load_dir(str(tmp_path), max_parsed_bytes=three_files + per_file // 2)
    assert [d.rank for d in dumps] == [0, 1, 2]
    assert len(problems) == 1 and problems[0].startswith(f"{tmp_path}/trace_3: not used: with it the parsed dumps")


def test_a_pickle_that_holds_itself_leaves_no_garbage(tmp_path: Path) -> None:
    doc = missing_rank_dumps()[0]
    doc["me"] = doc  # a cycle: only the garbage collector frees it
    write_file(tmp_path, "trace_0", pickle.dumps(doc, protocol=2))
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # as while a long run of files is parsed: no automatic collection frees it
    try:
        dumps, problems = dumpfiles.load_dir(str(tmp_path))
        assert [d.rank for d in dumps] == [0] and problems == []
        assert gc.collect() == 0
    finally:
        if enabled:
            gc.enable()


def test_a_pg_config_ranks_text_nested_past_the_stack_names_no_members(tmp_path: Path) -> None:
    # json.loads of this text recursed past the stack (RecursionError) before the fix.
    dumps = missing_rank_dumps()
    dumps[0]["pg_config"] = {"0": {**dumps[0]["pg_config"]["0"], "ranks": "[" * 5000 + "]" * 5000}}
    for rank, doc in dumps.items():
        write_file(tmp_path, f"trace_{rank}", doc)
    result = report.from_dir(str(tmp_path), 0.0)
    assert _kinds(result) == [(MISSING_RANK, (2,))]  # rank 1's pg_config names the members


# --- 4. a rank dumped twice ----------------------------------------------------------------------------------


def test_a_second_dump_of_a_rank_is_not_counted_as_another_rank(tmp_path: Path) -> None:
    directory = dump_dir(tmp_path)
    write_file(directory, "copy_of_trace_1", missing_rank_dumps()[1])
    result = report.from_dir(str(directory), 0.0)
    assert len(result.ranks) == 2 and _kinds(result) == [(MISSING_RANK, (2,))]
    assert len(result.problems) == 1, result.problems
    # As many entries in both: the first by name is used.
    assert result.problems[0].startswith(f"{directory}/trace_1: a second dump of rank 1; not used: "
                                         f"{directory}/copy_of_trace_1 is ")
    assert "skipped 1 file; judged the rest:" in report.render_text(result)


def test_of_two_dumps_of_a_rank_the_one_with_more_entries_is_used(tmp_path: Path) -> None:
    directory = dump_dir(tmp_path)
    shorter = missing_rank_dumps()[1]
    shorter["entries"] = shorter["entries"][:1]
    write_file(directory, "a_1", shorter)
    dumps, problems = dumpfiles.load_dir(str(directory))
    assert [(d.rank, os.path.basename(d.path)) for d in dumps] == [(0, "trace_0"), (1, "trace_1")]
    assert len(problems) == 1
    assert problems[0].startswith(f"{directory}/a_1: a second dump of rank 1; not used: {directory}/trace_1 is ")


# --- 5. entries that are not regular files -------------------------------------------------------------------


def test_entries_that_are_not_regular_files_are_listed_and_never_read(tmp_path: Path) -> None:
    directory = dump_dir(tmp_path / "dumps")
    secret = write_file(tmp_path, "shadow", missing_rank_dumps()[0] | {"rank": 2})
    os.symlink(secret, directory / "trace_2")  # would be rank 2 if followed
    os.symlink(secret, directory / report.EVIDENCE_FILE)
    os.mkfifo(directory / "trace_3")  # opening it for reading would block until a writer came
    os.mkdir(directory / "trace_4")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(directory / "s_5"))
        kinds = {"trace_2": "a symbolic link", report.EVIDENCE_FILE: "a symbolic link", "trace_3": "a FIFO",
                 "trace_4": "a directory", "s_5": "a socket"}
        try:
            os.mknod(directory / "trace_6", 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
            kinds["trace_6"] = "a character device"
        except PermissionError:
            pass  # no CAP_MKNOD here
        result = report.from_dir(str(directory), 0.0)
    assert len(result.ranks) == 2 and _kinds(result) == [(MISSING_RANK, (2,))]
    assert sorted(result.problems) == sorted(f"{directory}/{name}: {kind}, not a regular file; not read"
                                             for name, kind in kinds.items())
    assert result.recorded is None


def test_a_dump_swapped_for_a_fifo_or_a_link_after_listing_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo_0")
    with pytest.raises(dumpfiles.DumpError, match="a FIFO, not a regular file"):
        dumpfiles.read_regular(str(tmp_path / "fifo_0"), "fifo_0", 1024)  # O_NONBLOCK: no writer, no wait
    os.symlink("/etc/passwd", tmp_path / "link_0")
    with pytest.raises(dumpfiles.DumpError, match="a symbolic link, not followed"):
        dumpfiles.read_regular(str(tmp_path / "link_0"), "link_0", 1 << 20)


def test_hidden_entries_are_passed_over_silently(tmp_path: Path) -> None:
    directory = dump_dir(tmp_path)
    os.mkfifo(directory / ".pending_2")
    write_file(directory, ".partial_2", b"\x80\x04junk")
    dumps, problems = dumpfiles.load_dir(str(directory))
    assert [d.rank for d in dumps] == [0, 1] and problems == []
