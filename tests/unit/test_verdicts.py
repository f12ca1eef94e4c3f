"""The verdict engine on synthetic rank states: who is blamed, who waits, and what the summary says.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_verdicts.py."""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from frexporter.analysis import (
    MISMATCH_KIND,
    MISSING_RANK,
    NO_SEQ,
    RANK_DOWN_KIND,
    RANK_UNRESPONSIVE_KIND,
    STALLED,
    Verdict,
    VerdictConfig,
    VerdictTracker,
    budget_left,
    evaluate,
    with_oldest_start,
)
from frexporter.model import RANK_DOWN, RANK_EXITED, RANK_UNRESPONSIVE, InflightCollective, RankState
from tests.fakes.rank_states import NODE, NOW, TP, WORLD4, entry, idle, pg, rank, tp_missing_rank_3, waiting

WHOLE_JOB = VerdictConfig(stuck_after=60.0, complete_view=True)


def with_rank3(status: str, heartbeat_age: float, **kw: object) -> list[RankState]:
    """Ranks 0-2 wait at #42 for 95s; rank 3, never there, is in the given state."""
    return [*tp_missing_rank_3()[:3],
            rank(3, idle(TP, WORLD4, 41), status=status, heartbeat_age=heartbeat_age, **kw)]  # type: ignore[arg-type]


def only(verdicts: tuple[Verdict, ...]) -> Verdict:
    assert len(verdicts) == 1, [v.summary for v in verdicts]
    return verdicts[0]


# --- healthy jobs stay silent -------------------------------------------------------------------------------


def test_healthy_skew_below_stuck_after_is_no_verdict() -> None:
    assert evaluate(tp_missing_rank_3(age=59.0), NOW, NODE) == ()


def test_ranks_a_few_seqs_apart_in_a_healthy_job_is_no_verdict() -> None:
    states = [
        rank(0, pg(TP, WORLD4, 45, 42, (entry(43, 2.0), entry(44, 1.0), entry(45, 0.5)), desc="tp")),
        rank(1, pg(TP, WORLD4, 44, 43, (entry(44, 1.0),), desc="tp")),
        rank(2, idle(TP, WORLD4, 43, desc="tp")),
        rank(3, idle(TP, WORLD4, 42, desc="tp")),
    ]
    assert evaluate(states, NOW, NODE) == ()


def test_p2p_carrying_pg_with_equal_collective_seqs_is_no_verdict() -> None:
    # Raw pg_status differs across pipeline ranks; the collective domain is equal and nothing is in flight.
    states = [rank(r, pg("pp", WORLD4, 7, 7, exact=r % 2 == 0, has_p2p=True)) for r in WORLD4]
    assert evaluate(states, NOW, NODE) == ()
    assert evaluate(states, NOW, WHOLE_JOB) == ()


def test_p2p_pg_wait_counts_only_as_long_as_a_deep_read_proves_it() -> None:
    # Inexact values come from the last deep read: an entry seen in flight 10s after it was created is not
    # proof of a 95s wait, whatever the clock says now.
    def states(deep_read_age: float) -> list[RankState]:
        stale = pg("pp", WORLD4, 42, 41, (entry(42, 95.0),), exact=False, has_p2p=True)
        return [rank(r, stale, last_deep_read=NOW - deep_read_age) for r in (0, 1, 2)] + [
            rank(3, pg("pp", WORLD4, 41, 41, exact=False, has_p2p=True), last_deep_read=NOW - deep_read_age)]

    assert evaluate(states(deep_read_age=85.0), NOW, NODE) == ()
    v = only(evaluate(states(deep_read_age=1.0), NOW, NODE))
    assert (v.kind, v.ranks, v.details["inexact_ranks"]) == (MISSING_RANK, (3,), [0, 1, 2, 3])


def test_restart_with_small_seqs_is_no_verdict() -> None:
    states = [rank(r, waiting("0", WORLD4, 2, 3.0)) for r in (0, 1, 2)] + [rank(3, idle("0", WORLD4, 1))]
    assert evaluate(states, NOW, NODE) == ()


def test_old_and_new_incarnations_mixed_is_no_verdict() -> None:
    # Rank 0 still shows the previous run's hang; ranks 1-3 restarted and are at seq 2.
    states = [rank(0, waiting("0", WORLD4, 5001, 900.0))] + [rank(r, idle("0", WORLD4, 2)) for r in (1, 2, 3)]
    assert evaluate(states, NOW, WHOLE_JOB) == ()
    # ... or the other way round: a live rank already completed the seq the others wait for.
    states = [rank(0, waiting("0", WORLD4, 3, 900.0))] + [rank(r, idle("0", WORLD4, 7)) for r in (1, 2, 3)]
    assert evaluate(states, NOW, WHOLE_JOB) == ()


def test_no_start_time_means_not_judged() -> None:
    # Metrics without an oldest-start time: an old last_progress must not make a fresh wait look hung.
    states = [rank(r, pg(TP, WORLD4, 42, 41, desc="tp")) for r in (0, 1, 2)] + [rank(3, idle(TP, WORLD4, 41))]
    assert evaluate(states, NOW, WHOLE_JOB) == ()


# --- missing_rank -------------------------------------------------------------------------------------------


def test_missing_rank_names_culprit_waiters_collective_and_budget() -> None:
    v = only(evaluate(tp_missing_rank_3(), NOW, NODE))
    assert (v.kind, v.job_id, v.pg, v.pg_desc) == (MISSING_RANK, "job", TP, "tp")
    assert v.ranks == (3,)
    assert v.waiting_ranks == (0, 1, 2)
    assert (v.seq, v.op) == (42, "all_reduce")
    assert v.since == NOW - 95.0
    assert v.age_seconds == 95.0
    assert v.timeout_seconds == 600.0
    assert v.budget_used == 95.0 / 600.0
    assert budget_left(v) == 505.0
    assert v.summary == ("Rank 3 never joined all_reduce #42 on PG 'tp' (2c4f…); ranks 0,1,2 have waited 95s, "
                         "505s left before the 600s watchdog timeout.")
    assert v.details["hosts"] == {"3": "node0"}


def test_missing_rank_since_is_the_oldest_waiter() -> None:
    states = [rank(0, waiting(TP, WORLD4, 42, 120.0)), rank(1, waiting(TP, WORLD4, 42, 70.0)),
              rank(2, waiting(TP, WORLD4, 42, 10.0)), rank(3, idle(TP, WORLD4, 41))]
    v = only(evaluate(states, NOW, NODE))
    assert (v.ranks, v.waiting_ranks, v.since) == ((3,), (0, 1, 2), NOW - 120.0)


def test_rank_without_the_pg_counts_as_never_joined() -> None:
    # NCCL creates a PG lazily: a rank that never ran a collective on it does not report it.
    states = [rank(r, waiting("1", (2, 3), 1, 95.0)) for r in (2,)] + [rank(3)]
    v = only(evaluate(states, NOW, NODE))
    assert (v.kind, v.ranks, v.waiting_ranks, v.seq) == (MISSING_RANK, (3,), (2,), 1)


def test_node_view_does_not_blame_ranks_on_other_nodes() -> None:
    world8 = tuple(range(8))
    states = [rank(r, waiting("0", world8, 42, 95.0, desc="default_pg")) for r in WORLD4]
    v = only(evaluate(states, NOW, NODE))
    assert v.kind == STALLED
    assert v.ranks == WORLD4  # this node vouches for its own ranks only
    assert v.waiting_ranks == ()
    assert v.details["unobserved_ranks"] == [4, 5, 6, 7]
    assert v.summary == ("Ranks 0-3 of PG 'default_pg' (0) (all observed here) joined all_reduce #42 and none has "
                         "completed it for 95s; ranks 4-7 are not observed here: check them in the cross-node view; "
                         "505s left before the 600s watchdog timeout.")


def test_node_view_blames_only_its_own_missing_rank() -> None:
    world8 = tuple(range(8))
    states = [rank(r, waiting("0", world8, 42, 95.0)) for r in (0, 1, 3)] + [rank(2, idle("0", world8, 41))]
    v = only(evaluate(states, NOW, NODE))
    assert (v.kind, v.ranks, v.waiting_ranks) == (MISSING_RANK, (2,), (0, 1, 3))
    assert v.details["unobserved_ranks"] == [4, 5, 6, 7]


def test_complete_view_blames_members_without_data() -> None:
    world8 = tuple(range(8))
    states = [rank(r, waiting("0", world8, 42, 95.0)) for r in range(7)]
    v = only(evaluate(states, NOW, WHOLE_JOB))
    assert (v.kind, v.ranks, v.waiting_ranks) == (MISSING_RANK, (7,), tuple(range(7)))
    assert v.details["unobserved_ranks"] == [7]
    assert "(no data from rank 7)" in v.summary


def test_metrics_only_input_via_oldest_start() -> None:
    # What `analyze --prometheus` rebuilds: counts and an oldest start time, no entries.
    bare = [pg(TP, WORLD4, 42, 41, desc="tp") for _ in (0, 1, 2)]
    states = [rank(r, with_oldest_start(p, NOW - 95.0)) for r, p in enumerate(bare)]
    states.append(rank(3, with_oldest_start(idle(TP, WORLD4, 41, desc="tp"), None)))
    v = only(evaluate(states, NOW, WHOLE_JOB))
    assert (v.kind, v.ranks, v.waiting_ranks, v.seq, v.op, v.timeout_seconds) == (
        MISSING_RANK, (3,), (0, 1, 2), 42, "", 600.0)
    assert v.summary.startswith("Rank 3 never joined collective #42 on PG 'tp' (2c4f…);")


def test_post_mortem_dump_with_zero_stuck_after() -> None:
    v = only(evaluate(tp_missing_rank_3(age=700.0), NOW, VerdictConfig(stuck_after=0.0, complete_view=True)))
    assert v.ranks == (3,)
    assert budget_left(v) == -100.0
    assert v.summary.endswith("100s past the 600s watchdog timeout.")


# --- mismatch -----------------------------------------------------------------------------------------------


def mismatch_case(culprit_entry: InflightCollective, normal: InflightCollective | None = None,
                  ranks: tuple[int, ...] = WORLD4, culprit: int = 3) -> Verdict:
    normal = normal or entry(42, 95.0)
    states = [rank(r, pg(TP, ranks, 42, 41, (culprit_entry if r == culprit else normal,), desc="tp"))
              for r in ranks]
    return only(evaluate(states, NOW, NODE))


def test_mismatch_on_op() -> None:
    v = mismatch_case(entry(42, 95.0, op="all_gather", outs=((16,),)))
    assert (v.kind, v.ranks, v.waiting_ranks, v.op) == (MISMATCH_KIND, (3,), (0, 1, 2), "all_reduce")
    assert v.summary == ("Rank 3 called all_gather #42 on PG 'tp' (2c4f…) where ranks 0,1,2 called all_reduce; "
                         "ranks 0,1,2 have waited 95s, 505s left before the 600s watchdog timeout.")
    assert v.details["mismatch"]["what"] == "op"
    assert v.details["mismatch"]["entries"]["3"]["op"] == "all_gather"


def test_mismatch_on_sizes() -> None:
    v = mismatch_case(entry(42, 95.0, ins=((5,),)))
    assert (v.kind, v.ranks, v.waiting_ranks) == (MISMATCH_KIND, (3,), (0, 1, 2))
    assert v.details["mismatch"]["what"] == "input sizes"
    assert v.summary.startswith(
        "Rank 3 joined all_reduce #42 on PG 'tp' (2c4f…) with input sizes [[5]] where ranks 0,1,2 have [[4]];")


def test_mismatch_tie_blames_ranks_that_differ_from_the_lowest() -> None:
    v = mismatch_case(entry(42, 95.0, ins=((5,),)), ranks=(0, 1), culprit=1)
    assert (v.ranks, v.waiting_ranks) == ((1,), (0,))


def test_mismatch_on_dtype() -> None:
    v = mismatch_case(entry(42, 95.0, dtype="Half"))
    assert (v.kind, v.ranks) == (MISMATCH_KIND, (3,))
    assert v.details["mismatch"]["what"] == "input dtypes"
    assert "with input dtypes Half where ranks 0,1,2 have Float" in v.summary


def test_all_gather_sizes_follow_the_group_size() -> None:
    good = entry(42, 95.0, op="all_gather", ins=((4,),), outs=((16,),))
    listed = entry(42, 95.0, op="all_gather", ins=((4,),), outs=((4,),) * 4)  # list form: one output per peer
    assert only(evaluate([rank(r, pg(TP, WORLD4, 42, 41, (good,))) for r in WORLD4], NOW, NODE)).kind == STALLED
    assert only(evaluate([rank(r, pg(TP, WORLD4, 42, 41, (listed,))) for r in WORLD4], NOW, NODE)).kind == STALLED
    v = mismatch_case(entry(42, 95.0, op="all_gather", ins=((4,),), outs=((12,),)), normal=good, culprit=2)
    assert (v.kind, v.ranks, v.details["mismatch"]["what"]) == (MISMATCH_KIND, (2,), "output sizes")
    wrong = entry(42, 95.0, op="all_gather", ins=((4,),), outs=((12,),))
    v = only(evaluate([rank(r, pg(TP, WORLD4, 42, 41, (wrong,))) for r in WORLD4], NOW, NODE))
    assert (v.kind, v.ranks, v.details["mismatch"]["what"]) == (MISMATCH_KIND, WORLD4, "syntax")


def test_all_reduce_input_must_equal_output() -> None:
    v = mismatch_case(entry(42, 95.0, ins=((4,),), outs=((5,),)), normal=entry(42, 95.0, outs=((4,),)))
    assert v.ranks == (3,)


def test_exempt_ops_do_not_mismatch_on_sizes() -> None:
    root = entry(42, 95.0, op="scatter", ins=((4,), (4,)), outs=((4,),))
    leaf = entry(42, 95.0, op="scatter", ins=(), outs=((4,),))
    states = [rank(r, pg(TP, WORLD4, 42, 41, (root if r == 0 else leaf,))) for r in WORLD4]
    assert only(evaluate(states, NOW, NODE)).kind == STALLED
    a2a = [entry(42, 95.0, op="all_to_all", ins=((r + 1,),), outs=((4 - r,),)) for r in WORLD4]
    states = [rank(r, pg(TP, WORLD4, 42, 41, (a2a[r],))) for r in WORLD4]
    assert only(evaluate(states, NOW, NODE)).kind == STALLED


def test_unknown_op_cannot_mismatch() -> None:
    states = [rank(r, with_oldest_start(pg(TP, WORLD4, 42, 41), NOW - 95.0)) for r in WORLD4]
    assert only(evaluate(states, NOW, WHOLE_JOB)).kind == STALLED


# --- stalled ------------------------------------------------------------------------------------------------


def test_stalled_when_everyone_joined_and_nothing_completes() -> None:
    states = [rank(r, waiting(TP, WORLD4, 42, 95.0, desc="tp")) for r in WORLD4]
    v = only(evaluate(states, NOW, WHOLE_JOB))
    assert (v.kind, v.ranks, v.waiting_ranks, v.seq, v.op) == (STALLED, WORLD4, (), 42, "all_reduce")
    assert v.summary == ("All 4 ranks of PG 'tp' (2c4f…) joined all_reduce #42 and none has completed it for 95s: "
                         "suspect the network or a GPU of ranks 0-3; 505s left before the 600s watchdog timeout.")


# --- down and wedged ranks ----------------------------------------------------------------------------------


def test_rank_down_is_the_root_of_the_hang_it_causes() -> None:
    states = with_rank3(RANK_DOWN, 100.0, socket_alive=False)
    v = only(evaluate(states, NOW, NODE))
    assert (v.kind, v.pg, v.seq, v.op, v.ranks, v.waiting_ranks) == (RANK_DOWN_KIND, TP, 42, "all_reduce", (3,),
                                                                       (0, 1, 2))
    assert v.summary == ("Rank 3 (host node0, pid 1003) is down (process gone, last heartbeat 100s ago); ranks 0,1,2 "
                         "have waited 95s for it in all_reduce #42 on PG 'tp' (2c4f…), 505s left before the 600s "
                         "watchdog timeout.")


def test_rank_down_that_had_joined_still_blocks() -> None:
    states = [rank(r, waiting(TP, WORLD4, 42, 95.0)) for r in WORLD4]
    states[1] = rank(1, waiting(TP, WORLD4, 42, 95.0), status=RANK_DOWN, heartbeat_age=90.0)
    v = only(evaluate(states, NOW, NODE))
    assert (v.kind, v.ranks, v.waiting_ranks) == (RANK_DOWN_KIND, (1,), (0, 2, 3))


def test_rank_down_with_nobody_waiting_names_no_pg() -> None:
    states = [rank(r, idle(TP, WORLD4, 41)) for r in (0, 1, 2)]
    states.append(rank(3, idle(TP, WORLD4, 41), status=RANK_DOWN, heartbeat_age=30.0, socket_alive=False))
    v = only(evaluate(states, NOW, NODE))
    assert (v.kind, v.pg, v.seq, v.ranks, v.waiting_ranks, v.timeout_seconds) == (
        RANK_DOWN_KIND, "", NO_SEQ, (3,), (), None)
    assert v.summary == ("Rank 3 (host node0, pid 1003) is down (process gone, last heartbeat 30s ago); "
                         "no collective waits on it yet.")


def test_rank_down_attaches_before_stuck_after_and_keeps_other_culprits() -> None:
    world8 = tuple(range(8))
    states = [rank(r, waiting("0", world8, 9, 20.0)) for r in range(6)]
    states += [rank(6, idle("0", world8, 8), status=RANK_DOWN, heartbeat_age=15.0), rank(7, idle("0", world8, 8))]
    v = only(evaluate(states, NOW, NODE))  # rank 7 is not blamed yet: 20s < stuck_after
    assert (v.kind, v.pg, v.ranks) == (RANK_DOWN_KIND, "0", (6,))
    states = [rank(r, waiting("0", world8, 9, 95.0)) for r in range(6)] + states[6:]
    kinds = {(v.kind, v.ranks) for v in evaluate(states, NOW, NODE)}
    assert kinds == {(RANK_DOWN_KIND, (6,)), (MISSING_RANK, (7,))}


def test_rank_unresponsive_after_stuck_after_only() -> None:
    wedged = with_rank3(RANK_UNRESPONSIVE, 75.0)
    v = only(evaluate(wedged, NOW, NODE))
    assert (v.kind, v.ranks, v.waiting_ranks, v.seq) == (RANK_UNRESPONSIVE_KIND, (3,), (0, 1, 2), 42)
    assert v.summary.startswith("Rank 3 (host node0, pid 1003) is unresponsive: its Python has been wedged for 75s "
                                "(heartbeat stale, worker socket alive); ranks 0,1,2 have waited 95s for it in "
                                "all_reduce #42")
    fresh = with_rank3(RANK_UNRESPONSIVE, 10.0)
    assert only(evaluate(fresh, NOW, NODE)).kind == MISSING_RANK
    alone = [rank(3, idle(TP, WORLD4, 41), status=RANK_UNRESPONSIVE, heartbeat_age=75.0)]
    assert only(evaluate(alone, NOW, NODE)).pg == ""


def test_ranks_wedged_inside_a_blocked_wait_are_victims_not_causes() -> None:
    states = [rank(r, waiting(TP, WORLD4, 42, 95.0), status=RANK_UNRESPONSIVE, heartbeat_age=90.0) for r in (0, 1)]
    states += [rank(2, waiting(TP, WORLD4, 42, 95.0)), rank(3, idle(TP, WORLD4, 41))]
    v = only(evaluate(states, NOW, NODE))
    assert (v.kind, v.ranks, v.waiting_ranks) == (MISSING_RANK, (3,), (0, 1, 2))


def test_exited_rank_is_no_verdict_by_itself() -> None:
    assert evaluate([rank(0, idle("0", (0, 1), 5), status=RANK_EXITED)], NOW, NODE) == ()


# --- cascades and cycles ------------------------------------------------------------------------------------


def cascade(rank3_in_world: bool, rank3_wait: float = 95.0) -> list[RankState]:
    """Rank 3 skipped the all_reduce on subgroup [2,3]; rank 2 waits there; ranks 0,1 wait in WORLD."""
    sub = "1"
    world3 = waiting("0", WORLD4, 10, rank3_wait, desc="default_pg") if rank3_in_world else idle("0", WORLD4, 9)
    return [
        rank(0, waiting("0", WORLD4, 10, 95.0, desc="default_pg")),
        rank(1, waiting("0", WORLD4, 10, 95.0, desc="default_pg")),
        rank(2, idle("0", WORLD4, 9, desc="default_pg"), waiting(sub, (2, 3), 5, 80.0, desc="pair23")),
        rank(3, world3, idle(sub, (2, 3), 4, desc="pair23")),
    ]


def test_cascade_names_the_root_rank() -> None:
    v = only(evaluate(cascade(rank3_in_world=False), NOW, NODE))
    assert (v.kind, v.pg, v.pg_desc, v.seq) == (MISSING_RANK, "1", "pair23", 5)
    assert v.ranks == (3,)
    assert v.waiting_ranks == (0, 1, 2)
    assert v.details["blocked_pgs"] == ["0"]
    assert v.age_seconds == 95.0  # the longest wait in the chain, nearest to its watchdog
    assert v.summary == ("Rank 3 never joined all_reduce #5 on PG 'pair23' (1); ranks 0,1,2 have waited 95s "
                         "(also blocking PG 'default_pg' (0)), 505s left before the 600s watchdog timeout.")


def test_cascade_root_is_stable_while_the_upstream_wait_is_still_young() -> None:
    states = cascade(rank3_in_world=False)
    states[2] = rank(2, idle("0", WORLD4, 9), waiting("1", (2, 3), 5, 30.0))  # sub wait not stuck by itself
    v = only(evaluate(states, NOW, NODE))
    assert (v.pg, v.ranks, v.waiting_ranks) == ("1", (3,), (0, 1, 2))


def test_cycle_names_the_rank_missing_from_the_oldest_wait() -> None:
    # The real shape of a skipped collective: rank 2 entered the pair all_reduce (80 s ago) before rank 3, having
    # skipped it, entered WORLD's next all_reduce (70 s ago).
    states = cascade(rank3_in_world=True, rank3_wait=70.0)
    states[0] = rank(0, waiting("0", WORLD4, 10, 70.0, desc="default_pg"))
    states[1] = rank(1, waiting("0", WORLD4, 10, 70.0, desc="default_pg"))
    v = only(evaluate(states, NOW, NODE))
    assert (v.kind, v.pg, v.seq, v.ranks, v.waiting_ranks) == (MISSING_RANK, "1", 5, (3,), (0, 1, 2))
    assert v.details["cycle_ranks"] == [2, 3]
    assert v.summary.startswith("Rank 3 never joined all_reduce #5 on PG 'pair23' (1), which has waited longest, "
                                "and went on into other collectives: a deadlock")


def test_cycle_with_equal_start_times_is_reported_once_as_a_deadlock() -> None:
    states = cascade(rank3_in_world=True)
    states[2] = rank(2, idle("0", WORLD4, 9, desc="default_pg"), waiting("1", (2, 3), 5, 95.0, desc="pair23"))
    v = only(evaluate(states, NOW, NODE))
    assert (v.kind, v.pg, v.ranks, v.waiting_ranks) == (MISSING_RANK, "1", (2, 3), (0, 1))
    assert {e["pg"] for e in v.details["deadlock"]} == {"0", "1"}
    assert v.summary == (
        "Ranks 2,3 deadlock, each waiting in a collective another never joined (rank 3 in all_reduce #10 on "
        "PG 'default_pg' (0) for rank 2; rank 2 in all_reduce #5 on PG 'pair23' (1) for rank 3): they issued "
        "collectives in different orders; ranks 0,1 have waited 95s, 505s left before the 600s watchdog timeout.")


def test_three_rank_ring_terminates() -> None:
    ring = {"a": (0, 1), "b": (1, 2), "c": (0, 2)}
    states = [
        rank(0, waiting("a", ring["a"], 3, 95.0), idle("c", ring["c"], 2)),
        rank(1, waiting("b", ring["b"], 3, 95.0), idle("a", ring["a"], 2)),
        rank(2, waiting("c", ring["c"], 3, 95.0), idle("b", ring["b"], 2)),
    ]
    v = only(evaluate(states, NOW, NODE))
    assert v.kind == MISSING_RANK
    assert len(v.details["deadlock"]) == 3
    assert set(v.ranks) | set(v.waiting_ranks) == {0, 1, 2}


# --- output shape and ordering ------------------------------------------------------------------------------


def test_to_json_has_exactly_the_contract_fields() -> None:
    v = only(evaluate(tp_missing_rank_3(), NOW, NODE))
    doc = json.loads(json.dumps(v.to_json()))
    assert list(doc) == ["kind", "job_id", "pg", "pg_desc", "ranks", "waiting_ranks", "seq", "op", "since",
                         "age_seconds", "timeout_seconds", "budget_used", "summary", "details", "activity"]
    assert doc["ranks"] == [3] and doc["waiting_ranks"] == [0, 1, 2]
    # Ranks without a sampled stack: the culprit's activity is unknown, and the summary says nothing of it.
    assert doc["activity"] == {"3": {"state": "unknown", "frames": [], "frames_source": "recorder", "cpu_percent": None,
                                     "since": None}}


def test_order_is_deterministic_and_jobs_are_separate() -> None:
    states = [rank(s.rank, *s.pgs, job=job) for job in ("b", "a") for s in tp_missing_rank_3()]
    states += [rank(9, status=RANK_DOWN, heartbeat_age=80.0, job="a")]
    first = evaluate(states, NOW, NODE)
    random.Random(4).shuffle(states)
    assert evaluate(states, NOW, NODE) == first
    assert [(v.job_id, v.pg, v.kind) for v in first] == [("a", "", RANK_DOWN_KIND), ("a", TP, MISSING_RANK),
                                                         ("b", TP, MISSING_RANK)]


# --- VerdictTracker -----------------------------------------------------------------------------------------


def test_tracker_reports_appear_once_and_clear_once() -> None:
    tracker = VerdictTracker()
    states = tp_missing_rank_3(age=95.0)  # the waits began at NOW - 95
    assert tracker.update(evaluate(states, NOW - 60, NODE), NOW - 60).appeared == ()  # 35s: not yet
    first = tracker.update(evaluate(states, NOW, NODE), NOW)
    assert [v.ranks for v in first.appeared] == [(3,)] and first.cleared == ()
    later = tracker.update(evaluate(states, NOW + 5, NODE), NOW + 5)
    assert later.appeared == () and later.cleared == ()
    assert later.active[0].age_seconds == 100.0  # same key, refreshed evidence
    gone = tracker.update((), NOW + 6)
    assert [v.ranks for v in gone.cleared] == [(3,)] and gone.active == ()


def test_tracker_confirm_and_clear_windows_absorb_flapping() -> None:
    tracker = VerdictTracker(confirm_after=2.0, clear_after=3.0)
    v = only(evaluate(tp_missing_rank_3(), NOW, NODE))
    assert tracker.update([v], 0.0).appeared == ()
    assert tracker.update([], 1.0).cleared == ()  # a blip never confirmed: nothing to log
    assert tracker.update([v], 2.0).appeared == ()
    assert tracker.update([v], 4.0).appeared == (v,)
    assert tracker.update([], 5.0).cleared == ()  # one missed poll is not a clear
    assert tracker.update([v], 6.0).appeared == ()
    assert tracker.update([], 8.0).cleared == ()
    assert tracker.update([], 9.0).cleared == (v,)


def test_tracker_new_seq_is_a_new_verdict() -> None:
    tracker = VerdictTracker()
    tracker.update(evaluate(tp_missing_rank_3(), NOW, NODE), NOW)
    moved = [rank(r, waiting(TP, WORLD4, 43, 95.0, desc="tp")) for r in (0, 1, 2)]
    update = tracker.update(evaluate([*moved, rank(3, idle(TP, WORLD4, 42))], NOW + 100, NODE), NOW + 100)
    assert [v.seq for v in update.appeared] == [43] and [v.seq for v in update.cleared] == [42]


@st.composite
def healthy_jobs(draw: st.DrawFn) -> list[RankState]:
    """Ranks legitimately apart: nobody completed what another has not enqueued, every wait is young."""
    world = draw(st.integers(2, 8))
    base = draw(st.integers(1, 10_000))
    enqueued = [base + draw(st.integers(0, 3)) for _ in range(world)]
    states = []
    for r in range(world):
        completed = draw(st.integers(min(enqueued) - 2, min(enqueued))) if enqueued[r] > base else enqueued[r]
        completed = min(completed, enqueued[r])
        entries = tuple(entry(s, draw(st.floats(0, 59.0))) for s in range(completed + 1, enqueued[r] + 1))
        states.append(rank(r, pg("0", tuple(range(world)), enqueued[r], completed, entries)))
    return states


@settings(max_examples=300, deadline=None)
@given(healthy_jobs(), st.booleans())
def test_property_healthy_skew_is_never_a_verdict(states: list[RankState], complete: bool) -> None:
    assert evaluate(states, NOW, VerdictConfig(stuck_after=60.0, complete_view=complete)) == ()


def test_dump_completion_lag_on_two_ranks_still_names_the_missing_one() -> None:
    """gloo marks a finished barrier completed late: two of three dumps still show it in flight."""
    from frexporter.postmortem.dumpfiles import _settle_completion_lag

    world = (0, 1, 2)
    lagging = pg("0", world, 5, 3, (entry(4, 0.5, op="barrier"), entry(5, 0.4)))
    states = _settle_completion_lag((rank(0, lagging), rank(1, lagging), rank(2, idle("0", world, 4))))
    assert [(p.last_completed, [e.seq for e in p.inflight]) for s in states for p in s.pgs] == [
        (4, [5]), (4, [5]), (4, [])]
    v = only(evaluate(list(states), NOW, VerdictConfig(stuck_after=0.0, complete_view=True)))
    assert (v.kind, v.ranks, v.waiting_ranks, v.seq) == ("missing_rank", (2,), (0, 1), 5)
