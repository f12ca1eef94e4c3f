"""`frexporter analyze DIR` on a directory someone hostile could write: odd verdict.json files, text that would
break or drive a terminal, files whose parse would take gigabytes, a rank dumped twice, and entries that are not
regular files (symbolic links, FIFOs, sockets, directories, devices).

Its unit tests are in tests/unit/test_analyze_dir_hostile.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from frexporter.analysis.kinds import MISSING_RANK
from frexporter.postmortem import report
from tests.harness import REPO
from tests.shared.analyze_dir_hostile import DEEP, SURROGATE_ESCAPE, dump_dir, write_file

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
ENV.pop("PYTHONIOENCODING", None)
HOSTILE_DESC = "evil\udc80\nno stuck collective found\x1b]0;title\x07\u202eend"
# Raw control characters (C0 but newline, DEL, C1), bidirectional overrides and isolates, line separators.
RAW_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def analyze(directory: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "frexporter", "analyze", str(directory), *args],
                          capture_output=True, timeout=120, env=env or ENV)


# --- 1. verdict.json of any shape ----------------------------------------------------------------------------


def test_a_deep_verdict_json_costs_no_traceback_in_the_cli(tmp_path: Path) -> None:
    directory = dump_dir(tmp_path / "bundle")
    (directory / report.EVIDENCE_FILE).write_bytes(DEEP)
    out = analyze(directory)
    assert out.returncode == 0 and b"Traceback" not in out.stderr, out.stderr
    assert b"verdict.json: invalid JSON (nested too deeply)" in out.stdout


# --- 2 and 6. text from dumps, file names and verdict.json, in any locale ------------------------------------

LOCALES = {
    "utf-8": {"LC_ALL": "C.UTF-8"},
    "C": {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"},  # ASCII stdout, surrogateescape
    "ascii": {"LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "ascii"},  # ASCII stdout, strict
}


def _hostile_dir(root: Path) -> Path:
    directory = dump_dir(root / "dumps", HOSTILE_DESC)
    write_file(directory, report.EVIDENCE_FILE, {"verdict": {"kind": "x\x1b[2J", "summary": "s\nno stuck collective "
                                                          "found", "job_id": "job\udc80\x1b[31m"}})
    write_file(directory, "bad\n\x1b]0;title\x07_5", b"\x80\x04junk")  # problem lines name the file
    write_file(directory, b"undecodable\xff_6", b"\x80\x04junk")
    return directory


def _assert_clean(output: bytes) -> str:
    text = output.decode("utf-8")  # raw bytes of a surrogate (surrogateescape) are not UTF-8
    assert not RAW_CONTROL.search(text), text
    return text


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


@pytest.mark.parametrize("locale", sorted(LOCALES))
def test_problems_on_stderr_are_escaped_when_no_dump_is_usable(tmp_path: Path, locale: str) -> None:
    directory = tmp_path / "only-bad"
    directory.mkdir()
    write_file(directory, "bad\n\x1b]0;title\x07_5", b"\x80\x04junk")
    write_file(directory, b"undecodable\xff_6", b"\x80\x04junk")
    out = analyze(directory, env={**ENV, **LOCALES[locale]})
    assert out.returncode == 1 and b"Traceback" not in out.stderr, out.stderr
    text = _assert_clean(out.stderr)
    assert "bad\\x0a\\x1b]0;title\\x07_5: " in text and "undecodable\\udcff_6: " in text


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


def test_a_64_mb_json_dump_of_empty_objects_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    # json.loads would build 22 million dicts: 1.7 GB peak before the fix.
    n = 64 * MIB // 3
    (tmp_path / "dumps").mkdir()
    (tmp_path / "dumps" / "trace_0").write_bytes(b'{"version": "2.10", "entries": [' + b"{}," * (n - 1) + b"{}]}")
    rc, output, peak_mib, _cpu = _measured(tmp_path / "dumps", tmp_path)
    assert peak_mib < 400, f"peak RSS {peak_mib:.0f} MiB"  # measured: 90 MiB, 64 of them the file's bytes
    assert rc == 1 and "objects and lists (counted before parsing), over the bound" in output, output


def test_a_64_mb_pickle_of_none_opcodes_is_refused_quickly(tmp_path: Path) -> None:
    # Before the fix: 18 s of CPU in the memo-index pass, then 600 MB of stacked references.
    (tmp_path / "dumps").mkdir()
    (tmp_path / "dumps" / "trace_0").write_bytes(b"\x80\x04" + b"N" * (64 * MIB) + b".")
    rc, output, peak_mib, cpu = _measured(tmp_path / "dumps", tmp_path)
    assert peak_mib < 400, f"peak RSS {peak_mib:.0f} MiB"  # measured: 98 MiB
    assert cpu < 5, f"{cpu:.1f} s of CPU"  # measured: 0.4 s, the interpreter's start included
    assert rc == 1 and "values (counted before parsing), over the bound" in output, output
