"""`frexporter analyze` on torch's own dump files from real gloo jobs, evidence bundles, and hostile pickles."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from frexporter.postmortem import dumpfiles
from tests.harness import REPO, free_port

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
DUMPER = REPO / "tests" / "workers" / "dumper.py"


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "frexporter", "analyze", *args], capture_output=True, text=True,
                          timeout=120, env=ENV)


@pytest.fixture(scope="module")
def real_dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dumps")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(DUMPER), str(r), "3", port, str(out)], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(3)]
    for p in procs:
        output = p.communicate(timeout=120)[0]
        assert p.returncode == 0, output.decode(errors="replace")[-2000:]
    return out


def test_analyze_names_the_rank_missing_from_real_gloo_dumps(real_dumps: Path) -> None:
    assert sorted(p.name for p in real_dumps.iterdir()) == ["rank_trace_0", "rank_trace_1", "rank_trace_2"]
    assert (real_dumps / "rank_trace_0").read_bytes()[:1] == b"\x80"  # a real pickle, as torch writes on timeout
    out = analyze(str(real_dumps), "--json")
    assert out.returncode == 0, out.stderr
    verdicts = json.loads(out.stdout)
    assert len(verdicts) == 1
    v = verdicts[0]
    assert (v["kind"], v["pg"], v["pg_desc"], v["ranks"], v["waiting_ranks"], v["op"]) == (
        "missing_rank", "0", "default_pg", [2], [0, 1], "all_reduce")
    assert v["seq"] == 5  # 3 all_reduces + barrier on WORLD, then the one rank 2 never joined
    assert v["timeout_seconds"] == 60
    text = analyze(str(real_dumps))
    assert text.returncode == 0 and "culprit rank(s) 2" in text.stdout


def test_analyze_shows_a_wait_below_the_threshold_rather_than_nothing(real_dumps: Path) -> None:
    out = analyze(str(real_dumps), "--stuck-after", "100000")
    assert out.returncode == 0, out.stderr
    assert "no stuck collective found" not in out.stdout
    assert "waiting: job dump, PG 0 (default_pg), all_reduce #5: ranks 0,1 wait on rank(s) 2 for " in out.stdout
    assert "s (threshold 100000s)" in out.stdout, out.stdout


def test_gloo_dump_with_broken_pg_config_still_maps_groups(real_dumps: Path) -> None:
    dumps, problems = dumpfiles.load_dir(str(real_dumps))
    assert problems == []
    # torch 2.8-2.13 gloo writes one '' key here; names come from the entries instead.
    assert all(set(d.dump.pg_config) <= {""} for d in dumps)
    states = dumpfiles.rank_states(dumps)
    everyone = {pg.desc: pg.ranks for pg in states[0].pgs}
    assert everyone == {"default_pg": (0, 1, 2), "everyone": (0, 1, 2)}


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    payload = {"version": "2.10", "pg_status": {}, "entries": [_Evil(marker)]}
    (dumps / "trace_0").write_bytes(pickle.dumps(payload))
    out = analyze(str(dumps))
    assert out.returncode == 1
    assert "refusing to load posix.system" in out.stderr
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError, match="refusing to load"):
        dumpfiles.safe_loads(pickle.dumps(_Evil(marker)))
    assert not marker.exists()


def test_analyze_rejects_garbage_with_clear_messages(tmp_path: Path) -> None:
    (tmp_path / "trace_0").write_bytes(b"\x80\x04garbage")
    (tmp_path / "trace_1").write_text("{not json")
    (tmp_path / "notes").write_text("hello")
    out = analyze(str(tmp_path))
    assert out.returncode == 1
    lines = out.stderr.splitlines()
    assert any("trace_0: " in line and "pickle" in line for line in lines), out.stderr
    assert any("trace_1: invalid JSON" in line for line in lines), out.stderr
    assert "no rank number" in out.stderr
    assert analyze().returncode == 2
    assert "either DIR or --prometheus" in analyze().stderr
