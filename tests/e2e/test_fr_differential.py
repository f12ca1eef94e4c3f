"""`frexporter analyze` against torch's own analyzer (fr_trace) on dump cases with known truth.

The cases are PyTorch's analyzer test situations written as dumps, plus hang scenarios
(``tests/fr_cases.py``); each states its truth, reasoned from the scenario. analyze must be right on every
case. fr_trace runs on the same dumps (one subprocess for all cases, its own loader and matcher), but the
tests never assert what fr_trace answers: where it is wrong (file order, unknown backends, cascades, rules
its installed version gets wrong) asserting on it would pin a bug. Its answers feed the committed table
``docs/analyze-vs-fr_trace.md``, which must not drift from what the tools answer today.

Its unit tests are in tests/unit/test_fr_differential.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from frexporter.analysis.kinds import LAGGING_RANK, MISSING_RANK, PAST_MISMATCH
from scripts import fr_compare
from scripts.fr_compare import Comparison
from tests import fr_cases
from tests.fr_cases import Case
from tests.harness import REPO
from tests.shared.fr_differential import CASES, case_named

VERDICT_FIELDS = {"kind", "job_id", "pg", "pg_desc", "ranks", "waiting_ranks", "seq", "op", "since", "age_seconds",
                  "timeout_seconds", "budget_used", "summary", "details", "activity"}


@pytest.fixture(scope="module")
def comparison(tmp_path_factory: pytest.TempPathFactory) -> Comparison:
    return fr_compare.run_all(tmp_path_factory.mktemp("fr_cases"))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_analyze_is_right(comparison: Comparison, case: Case) -> None:
    outcome = next(o for o in comparison.outcomes if o.case.id == case.id)
    truth = "; ".join(e.text() for e in case.truth) or "nothing wrong"
    assert outcome.analyze_right, f"truth: {truth}\nanalyze: {outcome.analyze.text()}"


def test_every_case_got_an_answer_from_fr_trace(comparison: Comparison) -> None:
    # Not what it answered (it is wrong in places, see the table), only that the differential ran at all.
    assert [o.case.id for o in comparison.outcomes] == [c.id for c in CASES]
    assert comparison.torch_version
    answered = [o for o in comparison.outcomes if o.fr_trace.error is None]
    assert len(answered) > len(CASES) // 2, "fr_trace aborted on most cases: the runner is broken, not fr_trace"


def test_the_comparison_table_is_current(comparison: Comparison) -> None:
    problems = fr_compare.check(fr_compare.render(comparison))
    assert not problems, "\n".join(problems) + "\nrun: python scripts/fr_compare.py"


def test_the_check_reports_drift_and_a_missing_table(comparison: Comparison, tmp_path: Path) -> None:
    rendered = fr_compare.render(comparison)
    table = tmp_path / "table.md"
    assert fr_compare.check(rendered, table) == [f"{table}: missing"]
    table.write_text(rendered.replace("✓", "✗", 1), encoding="utf-8")
    problems = fr_compare.check(rendered, table)
    assert problems[0].endswith("differs from what scripts/fr_compare.py generates")
    assert any(line.startswith("-") and "✗" in line for line in problems)
    table.write_text(rendered, encoding="utf-8")
    assert fr_compare.check(rendered, table) == []


def _analyze(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "frexporter", "analyze", str(directory), *args],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_text_shows_hangs_then_past_mismatches_then_lagging_ranks(tmp_path: Path) -> None:
    # A hang (rank 3 never joins #11), a lag (rank 3 still at #10) and a past mismatch (rank 1's #4 in half).
    case = case_named("hang/lagging-then-missing")
    dumps = {rank: json.loads(json.dumps(d)) for rank, d in case.dumps.items()}
    dumps[1]["entries"][3]["output_dtypes"] = ["Half"]
    directory, _ = fr_compare.write_case(Case("mixed", "", "", dumps, ()), tmp_path)
    out = _analyze(directory)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    heads = [line.split(":")[0] for line in lines if line.split(":")[0] in (MISSING_RANK, PAST_MISMATCH,
                                                                             LAGGING_RANK)]
    assert heads == [MISSING_RANK, PAST_MISMATCH, LAGGING_RANK], out.stdout
    assert "1 past mismatch (collectives that completed although their ranks disagreed):" in lines
    assert "1 process group with lagging ranks (not hangs by themselves):" in lines
    assert any(line.startswith("  Rank 1 ran all_reduce #4") and "output dtypes Half" in line for line in lines)
    assert any("Rank 3 lagged" in line and "still at all_reduce #10" in line for line in lines)
    verdicts = json.loads(_analyze(directory, "--json").stdout)
    assert [v["kind"] for v in verdicts] == [MISSING_RANK, PAST_MISMATCH, LAGGING_RANK]
    assert all(set(v) == VERDICT_FIELDS for v in verdicts)  # new kinds, the same fields
    past, lag = verdicts[1], verdicts[2]
    assert (past["ranks"], past["seq"], past["op"], past["waiting_ranks"]) == ([1], 4, "all_reduce", [])
    assert past["details"]["mismatch"]["what"] == "output dtypes"
    assert (lag["ranks"], lag["seq"], lag["details"]["behind"]) == ([3], 10, {"3": 1})
    assert lag["age_seconds"] == pytest.approx(fr_cases.DUMP_TIME - (fr_cases.T0 + 90))


def test_bad_input_is_skipped_with_one_counted_line_per_file(tmp_path: Path) -> None:
    case = case_named("bad/odd-entries")
    directory, _ = fr_compare.write_case(Case("bad", "", "", case.dumps, (), unreadable={4: b"\x80\x04junk"}),
                                         tmp_path)
    (directory / "rank_5").write_text('{"version": "2.10", "entries": [1, 2, {"process_group": 7}]}')
    out = _analyze(directory)
    assert out.returncode == 0, out.stderr
    skipped = [line for line in out.stdout.splitlines() if line.startswith("  skipped: ")]
    assert len(skipped) == 3, out.stdout
    assert any("rank_4: corrupt pickle" in line for line in skipped)
    assert any("rank_1: 1 of 6 entries skipped" in line for line in skipped)
    assert any("rank_5: 3 of 3 entries skipped" in line for line in skipped)
    assert "skipped 1 file and 4 entries; judged the rest:" in out.stdout
    assert "missing_rank: job dump, PG 0 (default_pg), all_reduce #5, culprit rank(s) 3" in out.stdout
