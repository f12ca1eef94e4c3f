"""What a rank says cannot break or forge the exporter's log lines.

A host name holding a newline and a whole forged log line, a PG description holding a newline and an ESC
sequence: `frexporter serve` logs the verdict that names them, and every line of its log still begins with a
timestamp it wrote (or is indented under one), and no raw control character reaches the terminal.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from frexporter import spool
from tests import spoolgen
from tests.harness import REPO, free_port, wait_for

FORGED = "2026-11-26 00:00:00,000 CRITICAL frexporter: FORGED LINE"
HOSTILE_HOST = "node-a\n" + FORGED
HOSTILE_DESC = "train\n\x1b]0;pwned\x07\x1b[2J"
HOSTILE_JOB = "job\x1b[31m\u2028" + FORGED
LINE_START = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ [\w.]+: |    )")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_rank_strings_cannot_forge_or_break_log_lines(tmp_path: Path) -> None:
    pid = _dead_pid()
    groups = spoolgen.manifest(HOSTILE_JOB, 0)["process_groups"]
    groups[0]["desc"] = HOSTILE_DESC
    manifest = spoolgen.manifest(HOSTILE_JOB, 0, pid=pid, hostname=HOSTILE_HOST, process_groups=groups)
    stem = spool.rank_stem(HOSTILE_JOB, 0)
    spool.write_json_atomic(str(tmp_path / (stem + spool.MANIFEST_SUFFIX)), manifest)
    spoolgen.write_snapshot(tmp_path, stem, spoolgen.snapshot(pid, when=time.time() - 30))
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "frexporter", "serve", "--dir", str(tmp_path), "--listen",
                                 f"127.0.0.1:{free_port()}", "--poll-interval", "0.2", "--no-nvml",
                                 "--evidence-dir", ""], env={**os.environ, "PYTHONPATH": str(REPO)},
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: b"verdict rank_down" in log.read_bytes(), timeout=30, what="the rank_down verdict line")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    text = log.read_bytes().decode("utf-8")
    assert "\x1b" not in text and "\x07" not in text and "\u2028" not in text
    lines = text.splitlines()
    assert not [line for line in lines if not LINE_START.match(line)], text
    assert not [line for line in lines if line.startswith(FORGED)]
    verdict = next(line for line in lines if "verdict rank_down" in line)
    assert "node-a\\x0a" + FORGED in verdict  # shown, escaped, on the verdict's own line
