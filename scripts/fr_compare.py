#!/usr/bin/env python3
"""Compare `frexporter analyze` with torch's fr_trace on dump cases with known truth; write or check the table.

    python scripts/fr_compare.py            # (re)write docs/analyze-vs-fr_trace.md
    python scripts/fr_compare.py --check    # change nothing; exit 1 with a diff when the table drifted

The cases and their truth are in ``tests/fr_cases.py``. For each case the dumps are written twice: as
pickles for fr_trace (it reads nothing else) and as JSON or pickle for analyze. analyze runs in this
process (what ``frexporter analyze DIR`` calls); fr_trace runs in one subprocess of ``--python`` (default:
this interpreter, which must have torch) for all cases: see ``scripts/fr_trace_batch.py``.

Each tool's answer is reduced to items (kind, PG, seq, ranks) and scored against the truth: right when
every expected item is there and nothing else is. fr_trace has no notion of a stall, a past mismatch or a
lag, so its answer is read in its own terms: silence is its answer to "all joined and matched" (a stall),
a type, size or dtype error to any mismatch, past or not, and a state mismatch to a lagging rank, which it
is right about only when it names the lagging rank rather than the ones that completed.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout: this tree's frexporter and cases, never an installed copy
    sys.path.insert(0, str(REPO))

from frexporter.analysis.text import rank_list  # noqa: E402
from frexporter.postmortem import report  # noqa: E402
from tests import fr_cases  # noqa: E402
from tests.fr_cases import LAGGING, MISMATCH, MISSING, PAST, STALLED, Case, Expect  # noqa: E402

DOC = REPO / "docs" / "analyze-vs-fr_trace.md"
BATCH = REPO / "scripts" / "fr_trace_batch.py"
FILE_PREFIX = "rank_"


@dataclass(frozen=True)
class Item:
    """One thing a tool reported, reduced for scoring."""

    kind: str
    pg: str
    seq: int
    ranks: tuple[int, ...]
    label: str  # how the tool itself names it

    def text(self) -> str:
        return f"{self.label} {rank_list(self.ranks) or '-'} @ PG {self.pg} #{self.seq}"


@dataclass(frozen=True)
class Answer:
    items: tuple[Item, ...]
    error: str | None = None  # the tool gave no answer at all (fr_trace aborted)
    note: str = ""  # e.g. what analyze skipped

    def text(self) -> str:
        if self.error is not None:
            return f"aborted: {self.error}"
        said = "; ".join(i.text() for i in self.items) or "nothing"
        return f"{said} ({self.note})" if self.note else said


@dataclass(frozen=True)
class Outcome:
    case: Case
    analyze: Answer
    fr_trace: Answer
    analyze_right: bool
    fr_trace_right: bool


@dataclass(frozen=True)
class Comparison:
    outcomes: tuple[Outcome, ...]
    torch_version: str  # of the torch whose fr_trace answered


# --- writing the dumps --------------------------------------------------------------------------------------


def write_case(case: Case, root: Path) -> tuple[Path, Path]:
    """The case's dumps as files: ``root/analyze`` (JSON or pickle) and ``root/fr_trace`` (pickle)."""
    an, fr = root / "analyze", root / "fr_trace"
    for d in (an, fr):
        d.mkdir(parents=True)
    for rank, data in case.dumps.items():
        pickled = pickle.dumps(data, protocol=4)  # our own plain-data dict: what torch writes
        (fr / f"{FILE_PREFIX}{rank}").write_bytes(pickled)
        readable = json.dumps(data).encode() if case.analyze_format == "json" else pickled
        (an / f"{FILE_PREFIX}{rank}").write_bytes(readable)
    for rank, raw in case.unreadable.items():
        for d in (an, fr):
            (d / f"{FILE_PREFIX}{rank}").write_bytes(raw)
    for d in (an, fr):
        for f in d.iterdir():
            os.utime(f, (fr_cases.DUMP_TIME, fr_cases.DUMP_TIME))
    return an, fr


# --- the two tools ------------------------------------------------------------------------------------------


def run_analyze(directory: Path) -> Answer:
    result = report.from_dir(str(directory), 0.0)
    items = tuple(Item(v.kind, v.pg, v.seq, tuple(v.ranks), v.kind) for v in result.verdicts)
    skipped = []
    if result.skipped_files:
        skipped.append(f"{result.skipped_files} file{'s' if result.skipped_files > 1 else ''}")
    if result.skipped_entries:
        skipped.append(f"{result.skipped_entries} entr{'ies' if result.skipped_entries > 1 else 'y'}")
    return Answer(items, note=f"skipped {' and '.join(skipped)}" if skipped else "")


# fr_trace's MatchState per culprit -> the truth kind it speaks to.
_FR_KIND = {
    "COLLECTIVE_TYPE_MISMATCH": (MISMATCH, "TYPE"),
    "SIZE_OR_SYNTAX_MISMATCH": (MISMATCH, "SIZE"),
    "COLLECTIVE_DTYPE_MISMATCH": (MISMATCH, "DTYPE"),
    "COLLECTIVE_STATE_MISMATCH": (LAGGING, "STATE"),
}


def _fr_answer(raw: dict[str, Any], directory: Path) -> Answer:
    if raw["aborted"] is not None:
        return Answer((), error=raw["aborted"].replace(str(directory), "DIR"))
    items = []
    for c in raw["flagged"]:
        if c["missing"]:
            items.append(Item(MISSING, c["pg"], c["seq"], tuple(c["missing"]), "missing"))
        by_state: dict[str, list[int]] = {}
        for rank, state in c["errors"].items():
            by_state.setdefault(state, []).append(int(rank))
        for state, ranks in sorted(by_state.items()):
            kind, label = _FR_KIND.get(state, ("other", state))
            items.append(Item(kind, c["pg"], c["seq"], tuple(sorted(ranks)), label))
    return Answer(tuple(items))


def run_fr_trace(jobs: Sequence[tuple[Case, Path]], python: str) -> tuple[dict[str, Answer], str]:
    spec = []
    for case, directory in jobs:
        order = case.order or tuple(sorted(case.dumps.keys() | case.unreadable.keys()))
        spec.append({"id": case.id, "dir": str(directory), "order": [f"{FILE_PREFIX}{r}" for r in order]})
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    # A fixed hash seed: fr_trace prints sets of strings in its abort messages, which go into the table.
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONHASHSEED": "0"}
    try:
        out = subprocess.run([python, str(BATCH), f.name], capture_output=True, text=True, timeout=600,
                             check=False, env=env)
    finally:
        os.unlink(f.name)
    if out.returncode != 0:
        raise RuntimeError(f"fr_trace batch failed ({out.returncode}): {out.stderr[-2000:]}")
    directories = {case.id: directory for case, directory in jobs}
    result = json.loads(out.stdout)
    return {raw["id"]: _fr_answer(raw, directories[raw["id"]]) for raw in result["answers"]}, result["torch"]


# --- scoring ------------------------------------------------------------------------------------------------


def _fits(expect: Expect, item: Item) -> bool:
    if (expect.kind, expect.pg, expect.seq) != (item.kind, item.pg, item.seq):
        return False
    if expect.among:
        return bool(item.ranks) and set(item.ranks) <= set(expect.ranks)
    return item.ranks == expect.ranks


def is_right(truth: Iterable[Expect], answer: Answer) -> bool:
    """Every expected item reported once, and nothing else."""
    if answer.error is not None:
        return False
    left = list(answer.items)
    for expect in truth:
        match = next((i for i in left if _fits(expect, i)), None)
        if match is None:
            return False
        left.remove(match)
    return not left


def as_fr_trace_sees_it(truth: Iterable[Expect]) -> list[Expect]:
    """The truth in fr_trace's terms: it says nothing on a stall and does not tell past from present."""
    out = []
    for e in truth:
        if e.kind == STALLED:
            continue
        out.append(Expect(MISMATCH, e.pg, e.seq, e.ranks, e.among) if e.kind == PAST else e)
    return out


def run_all(workdir: Path, python: str = sys.executable, cases: Sequence[Case] | None = None) -> Comparison:
    cases = list(cases if cases is not None else fr_cases.all_cases())
    dirs = {}
    for i, case in enumerate(cases):
        dirs[case.id] = write_case(case, workdir / f"case{i:03d}")
    fr, version = run_fr_trace([(c, dirs[c.id][1]) for c in cases], python)
    out = []
    for case in cases:
        an = run_analyze(dirs[case.id][0])
        out.append(Outcome(case, an, fr[case.id], is_right(case.truth, an),
                           is_right(as_fr_trace_sees_it(case.truth), fr[case.id])))
    return Comparison(tuple(out), version)


# --- the table ----------------------------------------------------------------------------------------------

HEADER = """\
# `frexporter analyze` and torch's fr_trace, case by case

Generated by `python scripts/fr_compare.py` from the cases in `tests/fr_cases.py`; `tests/e2e/test_fr_differential.py`
fails when this file and the tools' answers drift apart. Do not edit by hand.

Each case is a set of per-rank Flight Recorder dumps with a known truth: the situations of PyTorch's own
analyzer tests (`test/distributed/flight_recorder/test_fr_analysis.py`), written as dumps, completed and
still in flight, and hang scenarios. fr_trace is torch {torch}'s `torch.distributed.flight_recorder.fr_trace`
with default flags, reading the files in rank order unless the case says otherwise; analyze is `frexporter
analyze DIR`.

A tool is right (✓) when it reports every item of the truth and nothing else. fr_trace is read in its own
terms: it has no stall, past mismatch or lag, so silence is its answer to a collective everyone joined,
a type, size or dtype error answers any mismatch, past or present, and a state mismatch answers a lagging
rank when it names that rank (not the ones that completed). `one of 0,1`: two ranks disagree with no
majority, so naming either is right. `#N` of a send or recv is its p2p seq, of anything else its collective seq.

**analyze: {an} of {n} right. fr_trace: {fr} of {n} right.**

| case | situation | truth | fr_trace | analyze |
|---|---|---|---|---|
"""

FOOTER = """
## Where they differ, and why

- **Dumps fr_trace cannot read.** fr_trace stops the whole run on one unknown backend name (`nccl2`, `c10d`, a
  name with a colon), one entry it cannot parse, a `recv` from any source, a missing or unreadable dump
  file (unless `--allow-incomplete-ranks`). analyze judges what it can, lists each skipped file or entry on
  one line with a count, and blames a rank without a dump as one that never joined.
- **File order.** fr_trace compares every rank's entry with the first file's; when that rank is the odd one
  out it names everyone else. analyze compares each rank with the largest group of ranks that agree, and a
  rank whose own entry contradicts itself (input and output sizes or dtypes) is named even against a
  single well-formed peer.
- **Cascades.** fr_trace lists every collective with missing ranks; ranks that are missing only because
  they wait elsewhere are listed too. analyze follows who waits for whom across process groups, and from a
  send or recv to the peer that never posted its counterpart, and names the root (or the rank that went
  off order first, for a deadlock).
- **Hang or history.** fr_trace does not tell a collective still in flight from one that completed.
  analyze reports hangs (the frontier of each process group: `missing_rank`, `mismatch`, `stalled`) apart
  from past mismatches (`past_mismatch`: completed although the ranks disagreed, results suspect) and
  lagging ranks (`lagging_rank`: still at a collective peers saw complete, judged from NCCL's `completed`
  state only, since gloo marks completion late on every rank).
- **Rules fr_trace's installed version gets wrong**: `_all_gather_base` output numel is not checked (the
  rule names `all_gather_base`), uneven `all_to_all_single` splits count as a size mismatch, list-form
  `all_gather`/`reduce_scatter` (one buffer per rank) are compared by their first buffer only.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(comparison: Comparison) -> str:
    outcomes = comparison.outcomes
    n = len(outcomes)
    lines = [HEADER.format(torch=comparison.torch_version, n=n, an=sum(o.analyze_right for o in outcomes),
                           fr=sum(o.fr_trace_right for o in outcomes))]
    for o in outcomes:
        truth = "; ".join(e.text() for e in o.case.truth) or "nothing wrong"
        mark = {True: "✓", False: "✗"}
        lines.append(f"| `{o.case.id}` | {_cell(o.case.what)} ({o.case.source}) | {_cell(truth)} | "
                     f"{mark[o.fr_trace_right]} {_cell(o.fr_trace.text())} | "
                     f"{mark[o.analyze_right]} {_cell(o.analyze.text())} |\n")
    return "".join(lines) + FOOTER


def check(rendered: str, path: Path = DOC, max_diff_lines: int = 60) -> list[str]:
    """Problems (empty when the committed table equals ``rendered``)."""
    if not path.exists():
        return [f"{path}: missing"]
    current = path.read_text(encoding="utf-8")
    if current == rendered:
        return []
    diff = list(difflib.unified_diff(current.splitlines(), rendered.splitlines(), str(path), "generated",
                                     lineterm=""))
    shown = diff[:max_diff_lines] + ([f"... {len(diff) - max_diff_lines} more lines"]
                                     if len(diff) > max_diff_lines else [])
    return [f"{path}: differs from what scripts/fr_compare.py generates", *shown]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the table drifted")
    parser.add_argument("--out", type=Path, default=DOC, help=f"the table (default {DOC.relative_to(REPO)})")
    parser.add_argument("--python", default=sys.executable, help="interpreter with torch, to run fr_trace")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rendered = render(run_all(Path(tmp), args.python))
    if args.check:
        problems = check(rendered, args.out)
        for line in problems:
            print(line, file=sys.stderr)
        return 1 if problems else 0
    args.out.write_text(rendered, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
