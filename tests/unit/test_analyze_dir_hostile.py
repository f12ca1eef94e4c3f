"""`frexporter analyze DIR` on a directory someone hostile could write: odd verdict.json files, text that would
break or drive a terminal, files whose parse would take gigabytes, a rank dumped twice, and entries that are not
regular files (symbolic links, FIFOs, sockets, directories, devices)."""

from __future__ import annotations

import gc
import json
import os
import pickle
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from frexporter.analysis.verdicts import MISSING_RANK
from frexporter.model import Verdict
from frexporter.postmortem import dumpfiles, report
from tests import fr_cases
from tests.harness import REPO

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
ENV.pop("PYTHONIOENCODING", None)
HOSTILE_DESC = "evil\udc80\nno stuck collective found\x1b]0;title\x07\u202eend"
# Raw control characters (C0 but newline, DEL, C1), bidirectional overrides and isolates, line separators.
RAW_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
SURROGATE_ESCAPE = re.compile(r"\\ud[89a-f][0-9a-f]{2}", re.IGNORECASE)


def _missing_rank_dumps(desc: str = "default_pg", world: tuple[int, ...] = (0, 1, 2)) -> dict[int, dict[str, Any]]:
    """Ranks 0 and 1 of ``world`` wait in all_reduce #3, which rank 2 never joined (its dump is not there)."""
    pg = ("0", desc)
    cfg = fr_cases.config([("0", desc, world)])
    entries = [fr_cases.event("all_reduce", s, ((8,),), at=s, pg=pg) for s in (1, 2)]
    entries.append(fr_cases.event("all_reduce", 3, ((8,),), at=40, pg=pg, state="scheduled"))
    return {r: fr_cases.dump(r, entries, cfg) for r in (0, 1)}


def _write(directory: Path, name: str | bytes, doc: object) -> Path:
    path = Path(os.fsdecode(os.path.join(os.fsencode(directory), os.fsencode(name))))
    path.write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    os.utime(path, (fr_cases.DUMP_TIME, fr_cases.DUMP_TIME))
    return path


def _dump_dir(directory: Path, desc: str = "default_pg") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for rank, doc in _missing_rank_dumps(desc).items():
        _write(directory, f"trace_{rank}", doc)
    return directory


def _kinds(result: report.Report) -> list[tuple[str, tuple[int, ...]]]:
    return [(v.kind, v.ranks) for v in result.verdicts]


def analyze(directory: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "frexporter", "analyze", str(directory), *args],
                          capture_output=True, timeout=120, env=env or ENV)


# --- 1. verdict.json of any shape ----------------------------------------------------------------------------

DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(("content", "says"), [
    (b"[1, 2]", "but a list"), (b"7", "but a number"), (b'"verdict"', "but a string"),
    (b'{"verdict": [1]}', 'a "verdict" that is a list'), (b'{"verdict": "stalled"}', 'a "verdict" that is a string'),
    (DEEP, "nested too deeply"), (b'{"verdict": {"job_id": ' + DEEP + b"}}", "nested too deeply"),
], ids=["list", "number", "string", "verdict-list", "verdict-string", "deep", "deep-job-id"])
def test_a_verdict_json_of_any_shape_is_one_problem_line_and_the_dumps_are_judged(
        tmp_path: Path, content: bytes, says: str) -> None:
    directory = _dump_dir(tmp_path / "bundle")
    (directory / report.EVIDENCE_FILE).write_bytes(content)
    result = report.from_dir(str(directory), 0.0)
    text = report.render_text(result)
    assert _kinds(result) == [(MISSING_RANK, (2,))]
    assert result.recorded is None
    problem = [p for p in result.problems if report.EVIDENCE_FILE in p]
    assert len(problem) == 1 and says in problem[0] and "\n" not in problem[0], result.problems
    assert f"  skipped: {problem[0]}" in text.splitlines()


@pytest.mark.e2e
def test_a_deep_verdict_json_costs_no_traceback_in_the_cli(tmp_path: Path) -> None:
    directory = _dump_dir(tmp_path / "bundle")
    (directory / report.EVIDENCE_FILE).write_bytes(DEEP)
    out = analyze(directory)
    assert out.returncode == 0 and b"Traceback" not in out.stderr, out.stderr
    assert b"verdict.json: invalid JSON (nested too deeply)" in out.stdout


def test_a_recorded_verdict_is_still_shown_with_its_job(tmp_path: Path) -> None:
    directory = _dump_dir(tmp_path / "bundle")
    _write(directory, report.EVIDENCE_FILE, {"verdict": {"kind": "missing_rank", "summary": "rank 2 never came",
                                                          "job_id": "train-7"}, "files": {}})
    result = report.from_dir(str(directory), 0.0)
    assert result.problems == []
    assert [v.job_id for v in result.verdicts] == ["train-7"]
    assert "  evidence bundle recorded by the exporter: missing_rank: rank 2 never came" in report.render_text(result)


# --- 2 and 6. text from dumps, file names and verdict.json, in any locale ------------------------------------

LOCALES = {
    "utf-8": {"LC_ALL": "C.UTF-8"},
    "C": {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"},  # ASCII stdout, surrogateescape
    "ascii": {"LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "ascii"},  # ASCII stdout, strict
}


def _hostile_dir(root: Path) -> Path:
    directory = _dump_dir(root / "dumps", HOSTILE_DESC)
    _write(directory, report.EVIDENCE_FILE, {"verdict": {"kind": "x\x1b[2J", "summary": "s\nno stuck collective "
                                                          "found", "job_id": "job\udc80\x1b[31m"}})
    _write(directory, "bad\n\x1b]0;title\x07_5", b"\x80\x04junk")  # problem lines name the file
    _write(directory, b"undecodable\xff_6", b"\x80\x04junk")
    return directory


def _assert_clean(output: bytes) -> str:
    text = output.decode("utf-8")  # raw bytes of a surrogate (surrogateescape) are not UTF-8
    assert not RAW_CONTROL.search(text), text
    return text


@pytest.mark.e2e
@pytest.mark.parametrize("locale", sorted(LOCALES))
def test_text_output_escapes_what_dumps_file_names_and_verdicts_hold(tmp_path: Path, locale: str) -> None:
    directory = _hostile_dir(tmp_path)
    out = analyze(directory, env={**ENV, **LOCALES[locale]})
    assert out.returncode == 0 and b"Traceback" not in out.stderr, out.stderr
    text = _assert_clean(out.stdout)
    lines = text.splitlines()
    assert "no stuck collective found" not in lines and not any(line.startswith("no stuck") for line in lines)
    hang = [line for line in lines if line.startswith(f"{MISSING_RANK}: ")]
    assert len(hang) == 1 and "\\x0ano stuck collective found\\x1b]0;title\\x07\\u202eend" in hang[0], text
    assert "job job" in hang[0] and "\\x1b[31m" in hang[0]
    assert any("bad\\x0a\\x1b]0;title\\x07_5: " in line for line in lines), text
    assert any("undecodable\\udcff_6: " in line for line in lines), text


@pytest.mark.e2e
@pytest.mark.parametrize("locale", sorted(LOCALES))
def test_problems_on_stderr_are_escaped_when_no_dump_is_usable(tmp_path: Path, locale: str) -> None:
    directory = tmp_path / "only-bad"
    directory.mkdir()
    _write(directory, "bad\n\x1b]0;title\x07_5", b"\x80\x04junk")
    _write(directory, b"undecodable\xff_6", b"\x80\x04junk")
    out = analyze(directory, env={**ENV, **LOCALES[locale]})
    assert out.returncode == 1 and b"Traceback" not in out.stderr, out.stderr
    text = _assert_clean(out.stderr)
    assert "bad\\x0a\\x1b]0;title\\x07_5: " in text and "undecodable\\udcff_6: " in text


@pytest.mark.e2e
@pytest.mark.parametrize("locale", sorted(LOCALES))
def test_json_output_is_valid_json_with_surrogates_repaired(tmp_path: Path, locale: str) -> None:
    directory = _hostile_dir(tmp_path)
    out = analyze(directory, "--json", env={**ENV, **LOCALES[locale]})
    assert out.returncode == 0 and b"Traceback" not in out.stderr, out.stderr
    text = out.stdout.decode("ascii")
    assert not SURROGATE_ESCAPE.search(text), text  # strict parsers refuse a lone surrogate's escape
    verdicts = json.loads(text)
    assert [(v["kind"], v["ranks"], v["job_id"]) for v in verdicts] == [(MISSING_RANK, [2], "job\ufffd\x1b[31m")]
    assert verdicts[0]["pg_desc"] == HOSTILE_DESC.replace("\udc80", "\ufffd")


def test_render_json_repairs_surrogates_anywhere_in_a_verdict() -> None:
    v = Verdict(kind="stalled\udc80", job_id="j", pg="0", pg_desc="d\udcff", ranks=(1,), waiting_ranks=(),
                seq=1, op="all_reduce", since=None, age_seconds=None, timeout_seconds=None, budget_used=None,
                summary="s\ud800", details={"k\udc80": ["v\udc81"]})
    text = report.render_json([v])
    assert not SURROGATE_ESCAPE.search(text) and text.isascii()
    assert json.loads(text)[0]["details"] == {"k\ufffd": ["v\ufffd"]}


# --- 3. memory ---------------------------------------------------------------------------------------------


# The CLI, which writes its own peak RSS (VmHWM: this process image's alone; wait4's ru_maxrss would count the
# parent's pages it was forked or vforked with) and CPU seconds to the file named in FREXPORTER_TEST_USAGE.
MEASURED_CLI = """
import atexit, os, resource, runpy
def usage():
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    ru = resource.getrusage(resource.RUSAGE_SELF)
    with open(os.environ["FREXPORTER_TEST_USAGE"], "w") as f:
        f.write(f"{hwm / 1024} {ru.ru_utime + ru.ru_stime}")
atexit.register(usage)
runpy.run_module("frexporter", run_name="__main__", alter_sys=True)
"""


def _measured(directory: Path, tmp_path: Path) -> tuple[int, str, float, float]:
    """Runs analyze; its exit code, output, peak RSS (MiB) and CPU seconds."""
    usage = tmp_path / "usage.txt"
    out = subprocess.run([sys.executable, "-c", MEASURED_CLI, "analyze", str(directory)], capture_output=True,
                         text=True, timeout=120, env={**ENV, "FREXPORTER_TEST_USAGE": str(usage)})
    peak_mib, cpu = map(float, usage.read_text().split())
    return out.returncode, out.stdout + out.stderr, peak_mib, cpu


MIB = 1024 * 1024


@pytest.mark.e2e
def test_a_64_mb_json_dump_of_empty_objects_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    # json.loads would build 22 million dicts: 1.7 GB peak before the fix.
    n = 64 * MIB // 3
    (tmp_path / "dumps").mkdir()
    (tmp_path / "dumps" / "trace_0").write_bytes(b'{"version": "2.10", "entries": [' + b"{}," * (n - 1) + b"{}]}")
    rc, output, peak_mib, _cpu = _measured(tmp_path / "dumps", tmp_path)
    assert peak_mib < 400, f"peak RSS {peak_mib:.0f} MiB"  # measured: 90 MiB, 64 of them the file's bytes
    assert rc == 1 and "objects and lists (counted before parsing), over the bound" in output, output


@pytest.mark.e2e
def test_a_64_mb_pickle_of_none_opcodes_is_refused_quickly(tmp_path: Path) -> None:
    # Before the fix: 18 s of CPU in the memo-index pass, then 600 MB of stacked references.
    (tmp_path / "dumps").mkdir()
    (tmp_path / "dumps" / "trace_0").write_bytes(b"\x80\x04" + b"N" * (64 * MIB) + b".")
    rc, output, peak_mib, cpu = _measured(tmp_path / "dumps", tmp_path)
    assert peak_mib < 400, f"peak RSS {peak_mib:.0f} MiB"  # measured: 98 MiB
    assert cpu < 5, f"{cpu:.1f} s of CPU"  # measured: 0.4 s, the interpreter's start included
    assert rc == 1 and "values (counted before parsing), over the bound" in output, output


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
    doc = _missing_rank_dumps(world=(0, 1, 2, 3, 4))[0]
    for rank in range(4):
        _write(tmp_path, f"trace_{rank}", doc)
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
    doc = _missing_rank_dumps()[0]
    doc["me"] = doc  # a cycle: only the garbage collector frees it
    _write(tmp_path, "trace_0", pickle.dumps(doc, protocol=2))
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
    dumps = _missing_rank_dumps()
    dumps[0]["pg_config"] = {"0": {**dumps[0]["pg_config"]["0"], "ranks": "[" * 5000 + "]" * 5000}}
    for rank, doc in dumps.items():
        _write(tmp_path, f"trace_{rank}", doc)
    result = report.from_dir(str(tmp_path), 0.0)
    assert _kinds(result) == [(MISSING_RANK, (2,))]  # rank 1's pg_config names the members


# --- 4. a rank dumped twice ----------------------------------------------------------------------------------


def test_a_second_dump_of_a_rank_is_not_counted_as_another_rank(tmp_path: Path) -> None:
    directory = _dump_dir(tmp_path)
    _write(directory, "copy_of_trace_1", _missing_rank_dumps()[1])
    result = report.from_dir(str(directory), 0.0)
    assert len(result.ranks) == 2 and _kinds(result) == [(MISSING_RANK, (2,))]
    assert len(result.problems) == 1, result.problems
    # As many entries in both: the first by name is used.
    assert result.problems[0].startswith(f"{directory}/trace_1: a second dump of rank 1; not used: "
                                         f"{directory}/copy_of_trace_1 is ")
    assert "skipped 1 file; judged the rest:" in report.render_text(result)


def test_of_two_dumps_of_a_rank_the_one_with_more_entries_is_used(tmp_path: Path) -> None:
    directory = _dump_dir(tmp_path)
    shorter = _missing_rank_dumps()[1]
    shorter["entries"] = shorter["entries"][:1]
    _write(directory, "a_1", shorter)
    dumps, problems = dumpfiles.load_dir(str(directory))
    assert [(d.rank, os.path.basename(d.path)) for d in dumps] == [(0, "trace_0"), (1, "trace_1")]
    assert len(problems) == 1
    assert problems[0].startswith(f"{directory}/a_1: a second dump of rank 1; not used: {directory}/trace_1 is ")


# --- 5. entries that are not regular files -------------------------------------------------------------------


def test_entries_that_are_not_regular_files_are_listed_and_never_read(tmp_path: Path) -> None:
    directory = _dump_dir(tmp_path / "dumps")
    secret = _write(tmp_path, "shadow", _missing_rank_dumps()[0] | {"rank": 2})
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
    directory = _dump_dir(tmp_path)
    os.mkfifo(directory / ".pending_2")
    _write(directory, ".partial_2", b"\x80\x04junk")
    dumps, problems = dumpfiles.load_dir(str(directory))
    assert [d.rank for d in dumps] == [0, 1] and problems == []
