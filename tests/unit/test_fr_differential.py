"""`frexporter analyze` against torch's own analyzer (fr_trace) on dump cases with known truth.

The cases are PyTorch's analyzer test situations written as dumps, plus hang scenarios
(``tests/fr_cases.py``); each states its truth, reasoned from the scenario. analyze must be right on every
case. fr_trace runs on the same dumps (one subprocess for all cases, its own loader and matcher), but the
tests never assert what fr_trace answers: where it is wrong (file order, unknown backends, cascades, rules
its installed version gets wrong) asserting on it would pin a bug. Its answers feed the committed table
``docs/analyze-vs-fr_trace.md``, which must not drift from what the tools answer today.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_fr_differential.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from frexporter.analysis import history
from frexporter.analysis.kinds import LAGGING_RANK, MISMATCH_KIND, MISSING_RANK, PAST_MISMATCH
from frexporter.postmortem import report
from scripts import fr_compare
from scripts.fr_compare import Answer, Item
from tests import fr_cases
from tests.fr_cases import Case, Expect
from tests.shared.fr_differential import case_named


def test_scoring_demands_every_item_and_nothing_else() -> None:
    truth = (Expect(MISSING_RANK, "0", 5, (3,)),)
    right = Item(MISSING_RANK, "0", 5, (3,), "missing_rank")
    assert fr_compare.is_right(truth, Answer((right,)))
    assert not fr_compare.is_right(truth, Answer(()))
    assert not fr_compare.is_right(truth, Answer((right, Item(MISSING_RANK, "0", 5, (2,), "missing_rank"))))
    assert not fr_compare.is_right(truth, Answer((Item(MISSING_RANK, "0", 5, (2, 3), "missing_rank"),)))
    assert not fr_compare.is_right(truth, Answer((right,), error="aborted"))
    assert fr_compare.is_right((), Answer(()))
    tie = (Expect(PAST_MISMATCH, "0", 1, (0, 1), among=True),)
    assert fr_compare.is_right(tie, Answer((Item(PAST_MISMATCH, "0", 1, (1,), "past_mismatch"),)))
    assert not fr_compare.is_right(tie, Answer((Item(PAST_MISMATCH, "0", 1, (2,), "past_mismatch"),)))
    # fr_trace does not tell past from present, and says nothing about a stall.
    seen = fr_compare.as_fr_trace_sees_it((*tie, Expect(fr_cases.STALLED, "1", 4, (0, 1))))
    assert seen == [Expect(MISMATCH_KIND, "0", 1, (0, 1), among=True)]


# --- the judgments the cases rely on, at their edges ----------------------------------------------------------


def _verdicts(tmp_path: Path, dumps: dict[int, dict[str, Any]]) -> list[tuple[str, str, int, tuple[int, ...]]]:
    directory, _ = fr_compare.write_case(Case("edge", "", "", dumps, ()), tmp_path)
    return [(v.kind, v.pg, v.seq, v.ranks) for v in report.from_dir(str(directory), 0.0).verdicts]


def _last_all_reduce(states: dict[int, str], at: float = 40.0, retired: dict[int, bool] | None = None,
                     ) -> dict[int, dict[str, Any]]:
    cfg = fr_cases.config([fr_cases.world(tuple(states))])
    done = [fr_cases.event("all_reduce", s, ((8,),), at=s) for s in (1, 2)]
    return {r: fr_cases.dump(r, [*done, fr_cases.event("all_reduce", 3, ((8,),), at=at, state=state,
                                                       retired=None if retired is None else retired[r])], cfg)
            for r, state in states.items()}


def test_a_lag_needs_the_backend_to_have_seen_completion(tmp_path: Path) -> None:
    lagging = {0: "completed", 1: "completed", 2: "scheduled"}
    assert _verdicts(tmp_path / "nccl", _last_all_reduce(lagging)) == [(LAGGING_RANK, "0", 3, (2,))]
    # gloo retires work a moment after the caller wakes and never says "completed": not a lag.
    gloo = _last_all_reduce({0: "scheduled", 1: "scheduled", 2: "scheduled"}, retired={0: True, 1: True, 2: False})
    assert _verdicts(tmp_path / "gloo", gloo) == []


def test_a_lag_shorter_than_the_watchdog_can_notice_is_not_reported(tmp_path: Path) -> None:
    seconds_before_dump = fr_cases.DUMP_TIME - fr_cases.T0
    lagging = {0: "completed", 1: "scheduled"}
    just_now = _last_all_reduce(lagging, at=seconds_before_dump - history.LAG_MIN_SECONDS / 2)
    assert _verdicts(tmp_path / "fresh", just_now) == []
    older = _last_all_reduce(lagging, at=seconds_before_dump - history.LAG_MIN_SECONDS * 2)
    assert _verdicts(tmp_path / "old", older) == [(LAGGING_RANK, "0", 3, (1,))]


def _p2p(op: str, p2p_seq: int, at: float, state: str) -> dict[str, Any]:
    return fr_cases.event(op, 2, ((8,),), is_p2p=True, p2p_seq=p2p_seq, at=at, state=state)


def test_a_pending_send_waits_only_for_a_peer_that_posted_nothing_since(tmp_path: Path) -> None:
    base = [fr_cases.event("all_reduce", s, ((8,),), at=s) for s in (1, 2)]
    send = _p2p("send 0->1", 1, 10, "scheduled")
    never = fr_cases.pair([*base, send], base)
    assert _verdicts(tmp_path / "never", never) == [(MISSING_RANK, "0", 1, (1,))]
    # Both sides posted: the transfer itself is in flight, nobody is missing.
    both = fr_cases.pair([*base, send], [*base, _p2p("recv 1<-0", 1, 10, "scheduled")])
    assert _verdicts(tmp_path / "both", both) == []
    # The peer's recv already completed: the send's completion was not recorded yet.
    done = fr_cases.pair([*base, send], [*base, _p2p("recv 1<-0", 1, 11, "completed")])
    assert _verdicts(tmp_path / "done", done) == []


def test_same_named_groups_stay_apart_when_some_ranks_lack_a_pg_config(tmp_path: Path) -> None:
    dumps = {r: json.loads(json.dumps(d)) for r, d in case_named("hang/split-group").dumps.items()}
    for rank in (2, 3):
        dumps[rank]["pg_config"] = {"": {"name": "", "desc": "", "ranks": ""}}  # as gloo writes it (torch 2.8+)
    assert _verdicts(tmp_path, dumps) == [(MISSING_RANK, "1", 3, (3,))]
