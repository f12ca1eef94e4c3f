"""The verdict engine on synthetic rank states: who is blamed, who waits, and what the summary says.

Its unit tests are in tests/unit/test_verdicts.py."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from frexporter.analysis import (
    RANK_DOWN_KIND,
    RANK_UNRESPONSIVE_KIND,
    VerdictConfig,
    evaluate,
)
from frexporter.model import RANK_DOWN, RANK_EXITED, RANK_OK, RANK_UNRESPONSIVE, InflightCollective, PGState, RankState
from tests.fakes.rank_states import NOW

# --- property: never raise, blame only members, never blame a waiter ----------------------------------------

PG_NAMES = ("0", "1", "2")
OPS = ("all_reduce", "all_gather", "broadcast", "", "reduce_scatter")


@st.composite
def pg_states(draw: st.DrawFn, world: int) -> PGState:
    name = draw(st.sampled_from(PG_NAMES))
    members = tuple(sorted(draw(st.sets(st.integers(0, world - 1), max_size=world))))
    completed = draw(st.integers(-1, 12))
    enqueued = completed + draw(st.integers(-1, 3))
    n = draw(st.integers(0, 3))
    inflight = tuple(
        InflightCollective(seq=completed + 1 + i, op=draw(st.sampled_from(OPS)),
                           created=NOW - draw(st.floats(-10, 2000, allow_nan=False)),
                           timeout_seconds=draw(st.sampled_from((None, 0.0, 600.0))),
                           input_sizes=draw(st.sampled_from(((), ((4,),), ((5,),), ((),)))),
                           input_dtypes=draw(st.sampled_from(((), ("Float",), ("Half",)))),
                           output_sizes=draw(st.sampled_from(((), ((4,),), ((16,),), ((4,),) * 4))),
                           output_dtypes=draw(st.sampled_from(((), ("Float",)))))
        for i in range(n))
    return PGState(name=name, desc=draw(st.sampled_from(("", "tp", "undefined"))), ranks=members, backend="gloo",
                   last_enqueued=enqueued, last_started=-1, last_completed=completed, inflight=inflight,
                   inflight_count=max(0, enqueued - completed), timeout_seconds=draw(st.sampled_from((None, 600.0))),
                   last_progress=None, exact=draw(st.booleans()), has_p2p=draw(st.booleans()))


@st.composite
def rank_sets(draw: st.DrawFn) -> list[RankState]:
    world = draw(st.integers(1, 6))
    present = sorted(draw(st.sets(st.integers(0, world - 1), min_size=1)))
    out = []
    for r in present:
        hb = draw(st.one_of(st.none(), st.floats(0, 500, allow_nan=False)))
        out.append(RankState(job_id=draw(st.sampled_from(("job", "job", "other"))), rank=r, local_rank=r,
                             world_size=world, hostname="h", pid=r, torch_version="2.13", gpu_uuid="",
                             status=draw(st.sampled_from((RANK_OK, RANK_OK, RANK_DOWN, RANK_UNRESPONSIVE,
                                                          RANK_EXITED, "weird"))),
                             heartbeat=None if hb is None else NOW - hb, heartbeat_age=hb,
                             socket_alive=draw(st.sampled_from((None, True, False))),
                             pgs=tuple(draw(st.lists(pg_states(world), max_size=3)))))
    return out


def members_of(states: list[RankState], job: str, name: str) -> set[int]:
    out: set[int] = set()
    for s in states:
        if s.job_id == job:
            for p in s.pgs:
                if p.name == name:
                    out |= set(p.ranks) | {s.rank}
    return out


@settings(max_examples=400, deadline=None)
@given(rank_sets(), st.sampled_from((0.0, 60.0)), st.booleans())
def test_property_culprits_are_members_and_never_waiters(states: list[RankState], stuck_after: float,
                                                         complete: bool) -> None:
    verdicts = evaluate(states, NOW, VerdictConfig(stuck_after=stuck_after, complete_view=complete))
    for v in verdicts:
        assert v.ranks, v
        assert not set(v.ranks) & set(v.waiting_ranks), v
        if v.pg:
            assert set(v.ranks) <= members_of(states, v.job_id, v.pg), v
        else:
            assert v.kind in (RANK_DOWN_KIND, RANK_UNRESPONSIVE_KIND)
        assert v.summary.endswith(".")
        json.dumps(v.to_json())
    assert list(verdicts) == sorted(verdicts, key=lambda v: (v.job_id, v.pg, v.kind, v.ranks, v.seq))
