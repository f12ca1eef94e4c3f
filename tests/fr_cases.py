"""Flight Recorder dump cases with known truth, for comparing `frexporter analyze` with torch's fr_trace.

Three families:

- ``torch:`` the situations of PyTorch's own analyzer tests
  (``test/distributed/flight_recorder/test_fr_analysis.py``): pairs of events they match, every collective
  type, backend names, the ``build_db`` cases (split sub-groups, coalesced groups), and the later additions
  (op variants, list-form shapes, uneven all_to_all, recv from any source). Those tests call the matcher on
  two events; here each situation is written as whole per-rank dumps, once as collectives that completed
  and, where it means something else, once still in flight.
- ``hang:`` hang scenarios: cascades through sub-groups, cross-PG deadlock, split groups, coalesced ops,
  p2p, all_to_all, a lagging rank (the 8-rank ``_ALLGATHER_BASE`` at SeqNum 19962 of a public SkyRL NCCL
  timeout report: 7 ranks completed it, one did not), and bad input (a missing or unreadable dump, odd
  entries, dumps without ``pg_id``).

Each case states its truth as a list of ``Expect``: what a correct post-mortem reports. An empty truth
means nothing is wrong. The truth is reasoned from the scenario, never taken from either tool.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

DUMP_TIME = 1_700_000_000.0  # every case's files carry this mtime; entries are created before it
T0 = DUMP_TIME - 700.0  # first entry of a case; a hang's oldest entry is ~700 s old at the dump
TIMEOUT_MS = 600_000

# Truth kinds: the verdict kinds of `frexporter analyze`, reasoned independently of it.
MISSING = "missing_rank"  # ranks never joined the collective (a hang)
MISMATCH = "mismatch"  # ranks joined different ops, sizes or dtypes (a hang)
STALLED = "stalled"  # everyone joined the same collective and none completed it (a hang)
PAST = "past_mismatch"  # a collective completed although its ranks disagreed (not a hang)
LAGGING = "lagging_rank"  # a rank still at a collective its peers completed (not a hang)


@dataclass(frozen=True)
class Expect:
    kind: str
    pg: str
    seq: int
    ranks: tuple[int, ...]
    # Two ranks that disagree with no majority: either may be wrong, so naming any of them is right.
    among: bool = False

    def text(self) -> str:
        ranks = ",".join(map(str, self.ranks))
        who = f"one of {ranks}" if self.among else ranks
        return f"{self.kind} {who} @ PG {self.pg} #{self.seq}"


@dataclass
class Case:
    id: str
    source: str  # where the situation comes from
    what: str  # one line: the situation and why the truth is what it is
    dumps: dict[int, dict[str, Any]]  # rank -> the dump object as torch writes it
    truth: tuple[Expect, ...]
    order: tuple[int, ...] | None = None  # the order fr_trace reads the files in (default: by rank)
    analyze_format: str = "json"  # analyze reads "json" or "pickle" files; fr_trace always pickles
    unreadable: dict[int, bytes] = field(default_factory=dict)  # ranks whose file is not a dump at all


# --- building dumps -----------------------------------------------------------------------------------------

PG0 = ("0", "default_pg")


def event(op: str, seq: int, ins: Sequence[Sequence[int]] = ((4, 4),), outs: Sequence[Sequence[int]] | None = None,
          *, pg: tuple[str, str] = PG0, state: str = "completed", in_dtype: Any = "float32",
          out_dtype: Any = None, backend: str = "nccl", p2p_seq: int = 0, at: float = 0.0,
          is_p2p: bool = False, pg_id: int | None = 0, retired: bool | None = None) -> dict[str, Any]:
    """One FR entry. Dtypes may be a string (as torch's analyzer tests write them) or a list (as torch does).
    ``at``: seconds after ``T0``. ``pg_id=None`` leaves the key out (torch before 2.5, hand-made dumps)."""
    entry: dict[str, Any] = {
        "profiling_name": f"{backend}:{op}" if backend else op,
        "process_group": pg,
        "collective_seq_id": seq,
        "p2p_seq_id": p2p_seq,
        "op_id": seq,
        "state": state,
        "input_sizes": [list(s) for s in ins],
        "output_sizes": [list(s) for s in (ins if outs is None else outs)],
        "input_dtypes": in_dtype,
        "output_dtypes": in_dtype if out_dtype is None else out_dtype,
        "time_created_ns": int((T0 + at) * 1e9),
        "timeout_ms": TIMEOUT_MS,
        "is_p2p": is_p2p,
        "frames": [],
        "retired": (state == "completed") if retired is None else retired,
    }
    if pg_id is not None:
        entry["pg_id"] = pg_id
    return entry


def config(groups: Iterable[tuple[str, str, Sequence[int]]]) -> dict[str, dict[str, str]]:
    return {name: {"name": name, "desc": desc, "ranks": str(list(ranks))} for name, desc, ranks in groups}


def dump(rank: int, entries: Iterable[dict[str, Any]], pg_config: dict[str, dict[str, str]],
         version: str = "2.8") -> dict[str, Any]:
    numbered = []
    for i, e in enumerate(entries):
        numbered.append({"record_id": i, **e})
    return {"version": version, "rank": rank, "pg_config": pg_config, "entries": numbered}


def world(ranks: Sequence[int], desc: str = "default_pg") -> tuple[str, str, Sequence[int]]:
    return ("0", desc, ranks)


def same_dumps(ranks: Sequence[int], entries: Sequence[dict[str, Any]],
               groups: Iterable[tuple[str, str, Sequence[int]]]) -> dict[int, dict[str, Any]]:
    cfg = config(groups)
    return {r: dump(r, entries, cfg) for r in ranks}


def pair(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]],
         groups: Iterable[tuple[str, str, Sequence[int]]] = (world((0, 1)),)) -> dict[int, dict[str, Any]]:
    cfg = config(groups)
    return {0: dump(0, a, cfg), 1: dump(1, b, cfg)}


def with_state(entries: Sequence[dict[str, Any]], state: str) -> list[dict[str, Any]]:
    return [{**e, "state": state, "retired": state == "completed"} for e in entries]


# --- torch's analyzer tests, as dumps -----------------------------------------------------------------------

SRC_EVENT = "torch test_match_one_event"
SRC_ALL = "torch test_all_events"
SRC_BACKEND = "torch FlightRecorderOpBackendTest"
SRC_DB = "torch testBuildDB"
SRC_LATER = "torch test_fr_analysis (later)"


def _all_reduce(seq: int, **kw: Any) -> dict[str, Any]:
    return event("all_reduce", seq, **kw)


def _pairwise() -> list[Case]:
    """The event pairs of ``test_match_one_event``: rank 0 records the first event, rank 1 the second."""
    cases = []

    def both(cid: str, what: str, a: dict[str, Any], b: dict[str, Any], past: tuple[Expect, ...],
             inflight: tuple[Expect, ...] | None) -> None:
        cases.append(Case(cid, SRC_EVENT, what, pair([a], [b]), past))
        if inflight is not None:
            running = with_state([a, b], "scheduled")
            cases.append(Case(f"{cid}/in-flight", SRC_EVENT, f"{what}; still in flight",
                              pair([running[0]], [running[1]]), inflight))

    e1 = _all_reduce(1)
    both("pair/all_reduce-same", "identical all_reduce on both ranks", e1, e1, (),
         (Expect(STALLED, "0", 1, (0, 1)),))
    both("pair/all_reduce-vs-all_gather", "rank 1 calls all_gather where rank 0 calls all_reduce; its all_gather "
         "is also malformed on its own (output 16 elements, a 2-rank gather of 16 needs 32)",
         e1, event("all_gather", 1), (Expect(PAST, "0", 1, (1,)),), (Expect(MISMATCH, "0", 1, (1,)),))
    a2a = event("all_to_all", 1)
    both("pair/all_to_all-same", "identical all_to_all on both ranks (fr_trace: UNDECIDED, then sums numel)",
         a2a, a2a, (), (Expect(STALLED, "0", 1, (0, 1)),))
    both("pair/input-size", "rank 1's all_reduce has input [5,4] but output [4,4]: wrong on its own and "
         "against rank 0", e1, _all_reduce(1, ins=((5, 4),), outs=((4, 4),)),
         (Expect(PAST, "0", 1, (1,)),), (Expect(MISMATCH, "0", 1, (1,)),))
    both("pair/output-size", "rank 1's all_reduce has output [5,4] for input [4,4]",
         e1, _all_reduce(1, outs=((5, 4),)), (Expect(PAST, "0", 1, (1,)),), (Expect(MISMATCH, "0", 1, (1,)),))
    e7 = _all_reduce(1, outs=((5, 4),))
    both("pair/both-malformed", "both ranks record the same malformed all_reduce (input [4,4], output [5,4]): "
         "both entries are wrong", e7, e7, (Expect(PAST, "0", 1, (0, 1)),), (Expect(MISMATCH, "0", 1, (0, 1)),))
    lag = pair([_all_reduce(1, state="scheduled")], [_all_reduce(1, state="completed")])
    what = "rank 1 saw all_reduce #1 complete, rank 0 still has it scheduled: rank 0 lags (not a hang)"
    cases.append(Case("pair/state-lag", SRC_EVENT, what, lag, (Expect(LAGGING, "0", 1, (0,)),)))
    cases.append(Case("pair/state-lag/rank-1-read-first", SRC_EVENT, f"{what}; fr_trace reads rank 1's file first",
                      lag, (Expect(LAGGING, "0", 1, (0,)),), order=(1, 0)))
    both("pair/dtype", "rank 0's all_reduce has float32 in, float16 out; rank 1's is consistent",
         _all_reduce(1, out_dtype="float16"), e1, (Expect(PAST, "0", 1, (0,)),), (Expect(MISMATCH, "0", 1, (0,)),))
    root = event("gather", 1, ins=((4, 4),), outs=((4, 4), (4, 4)))
    cases.append(Case("pair/gather-root-and-leaf", SRC_EVENT, "gather: root has one output per rank, the other "
                      "rank none and an empty output dtype",
                      pair([root], [event("gather", 1, outs=((),), out_dtype="")]), ()))
    cases.append(Case("pair/gather-leaf-with-output", SRC_EVENT, "gather: the non-root rank records one output "
                      "and an empty output dtype", pair([root], [event("gather", 1, out_dtype="")]), ()))
    return cases


# Every collective name of torch's analyzer (types.COLLECTIVES as of torch 2.13), written out here.
COLLECTIVE_NAMES = (
    "ALLGATHER_coalesced", "REDUCE_SCATTER_coalesced", "_all_gather_base", "_broadcast_oop", "_reduce_oop",
    "_reduce_scatter_base", "all_gather", "all_gather_into_tensor_coalesced", "all_gather_single", "all_gather_v",
    "all_reduce", "all_reduce_barrier", "all_to_all", "all_to_all_single", "all_to_all_v_single",
    "allreduce_coalesced", "barrier", "broadcast", "gather", "new_window", "reduce", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_tensor_coalesced", "reduce_scatter_v", "scatter", "split",
)


def _every_collective() -> Case:
    entries = []
    for seq, name in enumerate(COLLECTIVE_NAMES, start=1):
        ins, outs = ((4, 4),), ((4, 4),)
        if name in ("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced"):
            outs = ((8,),)  # 16 elements in, a 2-rank reduce_scatter leaves 8 on each
        if name in ("all_gather", "_all_gather_base", "all_gather_into_tensor_coalesced"):
            outs = ((32,),)
        entries.append(event(name, seq, ins, outs))
    return Case("all-collectives", SRC_ALL, f"each of the {len(COLLECTIVE_NAMES)} collective types, identical on "
                "both ranks, completed", same_dumps((0, 1), entries, (world((0, 1)),)), ())


def _backends() -> list[Case]:
    known = [_all_reduce(seq, backend=b) for seq, b in enumerate(("nccl", "ncclx", "gloo", "xccl"), start=1)]
    hook = [
        _all_reduce(1, backend="nccl2"),
        event("broadcast", 2, backend="c10d"),
        _all_reduce(3, backend="weird:backend"),
    ]
    hang = [_all_reduce(1, backend="unknown_backend")]
    return [
        Case("backend/known", SRC_BACKEND, "all_reduce under nccl, ncclx, gloo and xccl",
             same_dumps((0, 1), known, (world((0, 1)),)), ()),
        Case("backend/unknown-then-hang", SRC_BACKEND, "a completed all_reduce under an unknown backend name, then "
             "rank 1 never joins all_reduce #2", pair([*hang, _all_reduce(2, state="scheduled", at=10)], hang),
             (Expect(MISSING, "0", 2, (1,)),)),
        Case("backend/hook-names", SRC_LATER, "backend names the c10d hook writes (nccl2, c10d, one with a colon) "
             "and a p2p pair under nccl2", pair(
                 [*hook, event("send 0->1", 3, backend="nccl2", is_p2p=True, p2p_seq=1)],
                 [*hook, event("recv 1<-0", 3, backend="nccl2", is_p2p=True, p2p_seq=1)]), ()),
    ]


SUB_SPLIT = (world((0, 1)),)


def _split_config(rank: int) -> dict[str, dict[str, str]]:
    """testBuildDB's layout: WORLD of 2, and a PG named "1" that holds only rank 0 on rank 0, only rank 1 on
    rank 1 (two groups, one name: what ``split_group`` produces)."""
    return config([world((0, 1)), ("1", "sub_pg", (rank,))])


def _db(entries0: Sequence[dict[str, Any]], entries1: Sequence[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {0: dump(0, entries0, _split_config(0)), 1: dump(1, entries1, _split_config(1))}


def _build_db_cases() -> list[Case]:
    def e(op: str, ins: Sequence[Sequence[int]] = ((4, 4),), outs: Sequence[Sequence[int]] | None = None,
          pg: tuple[str, str] = ("0", "default")) -> dict[str, Any]:
        # testBuildDB records everything at seq 0 without a pg_id, dtypes as strings, all completed.
        return event(op, 0, ins, outs, pg=pg, pg_id=None)

    sub = e("all_reduce", ((5, 5),), pg=("1", "sub_pg"))
    bcast = [e("broadcast"), e("broadcast"), e("coalesced", ((),))]
    oop0 = [e("_broadcast_oop"), e("_broadcast_oop", ((5, 5),)), e("ALLGATHER_coalesced", ((),))]
    oop1 = [e("_broadcast_oop"), e("_broadcast_oop"), e("ALLGATHER_coalesced", ((),))]
    reduce = [e("_reduce_oop"), e("_reduce_oop"), e("REDUCE_SCATTER_coalesced", ((),))]
    oop_what = ("two _broadcast_oop coalesced under one seq; the second has [5,5] on rank 0, [4,4] on rank 1 "
                "(two ranks: no majority)")
    return [
        Case("db/all_reduce-and-split-sub_pg", SRC_DB, "all_reduce on WORLD, then on PG '1', which is a "
             "different one-rank group on each rank", _db([e("all_reduce"), sub], [e("all_reduce"), sub]), ()),
        Case("db/allreduce_coalesced", SRC_DB, "one allreduce_coalesced on both ranks",
             _db([e("allreduce_coalesced")], [e("allreduce_coalesced")]), ()),
        Case("db/broadcast-coalesced", SRC_DB, "two broadcasts coalesced under one seq", _db(bcast, bcast), ()),
        Case("db/broadcast_oop-size", SRC_DB, f"{oop_what}; completed", _db(oop0, oop1),
             (Expect(PAST, "0", 0, (0, 1), among=True),), analyze_format="pickle"),
        Case("db/broadcast_oop-size/in-flight", SRC_DB, f"{oop_what}; still in flight",
             _db(with_state(oop0, "scheduled"), with_state(oop1, "scheduled")),
             (Expect(MISMATCH, "0", 0, (0, 1), among=True),)),
        Case("db/reduce_oop-coalesced", SRC_DB, "two _reduce_oop coalesced under one seq", _db(reduce, reduce), ()),
        Case("db/empty-coalesced-on-rank-0", SRC_DB, "rank 0's coalesced call was empty (it recorded only the "
             "all_reduce), rank 1 recorded a coalesced reduce under the same seq",
             _db([e("all_reduce")], [e("all_reduce"), *reduce]), ()),
    ]


def _later_cases() -> list[Case]:
    variants = [("all_gather", "_all_gather_base", ((8,),), ((16,),)),
                ("all_reduce", "allreduce_coalesced", ((8,),), ((8,),)),
                ("reduce_scatter", "_reduce_scatter_base", ((16,),), ((8,),)),
                ("all_to_all", "all_to_all_single", ((8,),), ((8,),))]
    a = [event(x, seq, ins, outs) for seq, (x, _, ins, outs) in enumerate(variants, start=1)]
    b = [event(y, seq, ins, outs) for seq, (_, y, ins, outs) in enumerate(variants, start=1)]
    shapes = [_all_reduce(1, ins=((8,),)), event("reduce", 2, ((8,),)), event("all_gather", 3, ((8,),), ((8,), (8,))),
              event("reduce_scatter", 4, ((8,), (8,)), ((8,),)),
              event("allreduce_coalesced", 5, ((8,), (4,)), in_dtype=["Float", "Float"])]
    return [
        Case("later/op-variants", SRC_LATER, "rank 0 calls all_gather, all_reduce, reduce_scatter, all_to_all; "
             "rank 1 the variant of each (_all_gather_base, allreduce_coalesced, _reduce_scatter_base, "
             "all_to_all_single): four different ops", pair(a, b),
             tuple(Expect(PAST, "0", seq, (0, 1), among=True) for seq in range(1, 5))),
        Case("later/_all_gather_base-numel", SRC_LATER, "_all_gather_base of 8 elements into 24 on 2 ranks, on "
             "both: wrong on both", same_dumps((0, 1), [event("_all_gather_base", 1, ((8,),), ((24,),))],
                                                (world((0, 1)),)), (Expect(PAST, "0", 1, (0, 1)),)),
        Case("later/all_to_all_single-uneven", SRC_LATER, "all_to_all_single with uneven splits (8->12, 12->8): "
             "fine", pair([event("all_to_all_single", 1, ((8,),), ((12,),))],
                          [event("all_to_all_single", 1, ((12,),), ((8,),))]), ()),
        Case("later/recv-any-source", SRC_LATER, "a send matched by a recv from any source ('recv 1<-?')",
             pair([event("send 0->1", 0, ((8,),), is_p2p=True, p2p_seq=1)],
                  [event("recv 1<-?", 0, ((8,),), is_p2p=True, p2p_seq=1)]), ()),
        Case("later/hook-shapes", SRC_LATER, "shapes the c10d hook records: in-place buffers, list-form all_gather "
             "and reduce_scatter (one buffer per rank), dtype lists", same_dumps((0, 1), shapes, SUB_SPLIT), ()),
        Case("later/all_gather-list-too-long", SRC_LATER, "list-form all_gather with 3 outputs on a 2-rank group, "
             "on both", same_dumps((0, 1), [event("all_gather", 1, ((8,),), ((8,), (8,), (8,)))], SUB_SPLIT),
             (Expect(PAST, "0", 1, (0, 1)),)),
        Case("later/reduce_scatter-list-too-long", SRC_LATER, "list-form reduce_scatter with 3 inputs on a 2-rank "
             "group, on both", same_dumps((0, 1), [event("reduce_scatter", 1, ((8,), (8,), (8,)), ((8,),))],
                                          SUB_SPLIT), (Expect(PAST, "0", 1, (0, 1)),)),
        Case("later/flattened-wrong-numel", SRC_LATER, "all_gather 8 -> 17 and reduce_scatter 17 -> 8 on a 2-rank "
             "group, on both", same_dumps((0, 1), [event("all_gather", 1, ((8,),), ((17,),)),
                                                   event("reduce_scatter", 2, ((17,),), ((8,),))], SUB_SPLIT),
             (Expect(PAST, "0", 1, (0, 1)), Expect(PAST, "0", 2, (0, 1)))),
    ]


# --- hang scenarios -----------------------------------------------------------------------------------------

SRC_HANG = "hang scenario"
W4 = (0, 1, 2, 3)


def _history(n: int, pg: tuple[str, str] = PG0, pg_id: int = 0, start: int = 1, op: str = "all_reduce",
             at: float = 0.0) -> list[dict[str, Any]]:
    """``n`` completed collectives, seq ``start`` on."""
    return [event(op, start + i, ((1024,),), pg=pg, pg_id=pg_id, in_dtype=["Float"], at=at + i)
            for i in range(n)]


def _hung(op: str, seq: int, *, pg: tuple[str, str] = PG0, pg_id: int = 0, at: float = 100.0,
          ins: Sequence[Sequence[int]] = ((1024,),), outs: Sequence[Sequence[int]] | None = None,
          state: str = "scheduled") -> dict[str, Any]:
    return event(op, seq, ins, outs, pg=pg, pg_id=pg_id, state=state, in_dtype=["Float"], at=at)


def _hangs() -> list[Case]:
    cases = []
    tp = ("1", "tp")
    groups = [world(W4), ("1", "tp", (2, 3))]
    cfg = config(groups)
    base = _history(4)
    sub = _history(1, pg=tp, pg_id=1, at=5)

    # Rank 3 is stuck in its own code: rank 2 waits for it in tp all_reduce #2, ranks 0,1 in WORLD #5 for both.
    cascade = {r: dump(r, [*base, _hung("all_reduce", 5, at=120)], cfg) for r in (0, 1)}
    cascade[2] = dump(2, [*base, *sub, _hung("all_reduce", 2, pg=tp, pg_id=1, at=100)], cfg)
    cascade[3] = dump(3, [*base, *sub], cfg)
    cases.append(Case("hang/subgroup-cascade", SRC_HANG, "rank 3 stops: rank 2 waits for it on tp #2, ranks 0,1 "
                      "wait on WORLD #5 for ranks 2 and 3; the root is rank 3 alone", cascade,
                      (Expect(MISSING, "1", 2, (3,)),)))

    # Rank 3 skips tp #2 and goes on to WORLD #5, where rank 2 (stuck in tp #2) never arrives: a deadlock.
    deadlock = {r: dump(r, [*base, _hung("all_reduce", 5, at=120)], cfg) for r in (0, 1)}
    deadlock[2] = dump(2, [*base, *sub, _hung("all_reduce", 2, pg=tp, pg_id=1, at=100)], cfg)
    deadlock[3] = dump(3, [*base, *sub, _hung("all_reduce", 5, at=110)], cfg)
    cases.append(Case("hang/cross-pg-deadlock", SRC_HANG, "rank 3 skips tp #2 and enters WORLD #5; rank 2 waits in "
                      "tp #2 for it, so never reaches WORLD #5: rank 3 went off order first", deadlock,
                      (Expect(MISSING, "1", 2, (3,)),)))

    # split_group: two groups named "1", {0,1} and {2,3}. Rank 3 never joins its #3.
    split = ("1", "dp")
    split_cfg = {r: config([world(W4), ("1", "dp", (0, 1) if r < 2 else (2, 3))]) for r in W4}
    dp = _history(2, pg=split, pg_id=1, at=10)
    split_dumps = {r: dump(r, [*base, *dp, event("all_reduce", 3, ((1024,),), pg=split, pg_id=1,
                                                 in_dtype=["Float"], at=20)], split_cfg[r]) for r in (0, 1)}
    split_dumps[2] = dump(2, [*base, *dp, _hung("all_reduce", 3, pg=split, pg_id=1)], split_cfg[2])
    split_dumps[3] = dump(3, [*base, *dp], split_cfg[3])
    cases.append(Case("hang/split-group", SRC_HANG, "split_group gives {0,1} and {2,3} the same PG name '1'; "
                      "{0,1} completed #3, rank 2 waits in #3, rank 3 never joined it", split_dumps,
                      (Expect(MISSING, "1", 3, (3,)),)))

    # A coalesced pair of broadcasts in flight; rank 2's second buffer has another size.
    def coalesced(rank: int) -> list[dict[str, Any]]:
        second = ((2048,),) if rank == 2 else ((1024,),)
        return [_hung("_broadcast_oop", 7), _hung("_broadcast_oop", 7, ins=second),
                _hung("coalesced", 7, ins=((),))]
    cases.append(Case("hang/coalesced-size", SRC_HANG, "two _broadcast_oop coalesced under #7, in flight; rank 2's "
                      "second buffer is 2048 elements, everyone else's 1024",
                      {r: dump(r, [*_history(6), *coalesced(r)], config([world(W4)])) for r in W4},
                      (Expect(MISMATCH, "0", 7, (2,)),), analyze_format="pickle"))

    # Rank 0's own entry contradicts itself; rank 1's is well-formed. Two ranks, yet only one can be wrong.
    cases.append(Case("hang/self-inconsistent-rank-0", SRC_HANG, "all_reduce #3 in flight; rank 0 records 1024 "
                      "elements in, 2048 out (impossible for an all_reduce), rank 1 1024 and 1024",
                      pair([*_history(2), _hung("all_reduce", 3, outs=((2048,),))],
                           [*_history(2), _hung("all_reduce", 3)]),
                      (Expect(MISMATCH, "0", 3, (0,)),)))

    # p2p entries carry the collective seq current when they were issued (3 here) and their own p2p seq.
    def p2p(op: str, p2p_seq: int, at: float, state: str = "completed") -> dict[str, Any]:
        return event(op, 3, ((1024,),), is_p2p=True, p2p_seq=p2p_seq, at=at, state=state, in_dtype=["Float"])
    send, recv = p2p("send 0->1", 1, 3), p2p("recv 1<-0", 1, 3)
    cases.append(Case("hang/p2p-then-missing", SRC_HANG, "rank 0 sends to rank 1 (completed), then rank 1 never "
                      "joins all_reduce #4", pair([*_history(3), send, _hung("all_reduce", 4)], [*_history(3), recv]),
                      (Expect(MISSING, "0", 4, (1,)),)))
    stuck_send = [*_history(3), send, p2p("send 0->1", 2, 100, state="scheduled")]
    cases.append(Case("hang/p2p-recv-never-posted", SRC_HANG, "rank 0 is in send 0->1 (p2p #2); rank 1 never posts "
                      "the recv (stuck in its own code)", pair(stuck_send, [*_history(3), recv]),
                      (Expect(MISSING, "0", 2, (1,)),)))
    cases.append(Case("hang/p2p-deadlock", SRC_HANG, "rank 0 is in send 0->1 (p2p #2); rank 1 skipped the recv "
                      "and waits in all_reduce #4, which rank 0 never reaches: rank 1 went off order",
                      pair(stuck_send, [*_history(3), recv, _hung("all_reduce", 4, at=110)]),
                      (Expect(MISSING, "0", 2, (1,)),)))

    # all_to_all: uneven splits are legal; rank 3 never joins #3.
    def a2a(rank: int) -> dict[str, Any]:
        return _hung("all_to_all_single", 3, ins=((1000 + 10 * rank,),), outs=((1030 - 10 * rank,),))
    w4 = config([world(W4)])
    cases.append(Case("hang/all_to_all-missing", SRC_HANG, "all_to_all_single #3 with uneven splits on ranks 0-2; "
                      "rank 3 never joins", {r: dump(r, [*_history(2), *([a2a(r)] if r < 3 else [])], w4)
                                             for r in W4}, (Expect(MISSING, "0", 3, (3,)),)))
    cases.append(Case("hang/all_to_all-stalled", SRC_HANG, "all_to_all_single #3 with uneven splits, every rank in "
                      "it, none completes: a stall, not a size mismatch",
                      {r: dump(r, [*_history(2), a2a(r)], w4) for r in W4}, (Expect(STALLED, "0", 3, W4),)))

    # The SkyRL report: 8 ranks, _ALLGATHER_BASE (FR: _all_gather_base) SeqNum 19962; 7 completed it.
    w8 = tuple(range(8))
    cfg8 = config([world(w8)])

    def skyrl(rank: int) -> dict[str, Any]:
        done = [event("_all_gather_base", 19950 + i, ((4096,),), ((32768,),), in_dtype=["BFloat16"], at=i)
                for i in range(12)]
        last = event("_all_gather_base", 19962, ((4096,),), ((32768,),), in_dtype=["BFloat16"], at=40,
                     state="scheduled" if rank == 5 else "completed")
        return dump(rank, [*done, last], cfg8, version="2.10")
    sky = {r: skyrl(r) for r in w8}
    what = "8 ranks, _all_gather_base #19962 (the NCCL watchdog's _ALLGATHER_BASE): 7 completed it, rank 5 did not"
    cases.append(Case("hang/skyrl-allgather-19962", SRC_HANG, what, sky, (Expect(LAGGING, "0", 19962, (5,)),)))
    cases.append(Case("hang/skyrl-allgather-19962/rank-5-read-first", SRC_HANG, f"{what}; fr_trace reads rank 5's "
                      "file first", sky, (Expect(LAGGING, "0", 19962, (5,)),), order=(5, 0, 1, 2, 3, 4, 6, 7)))

    # Rank 3 lags at #10 (peers completed it) and so never joins #11, where the peers now wait.
    def lag(rank: int) -> dict[str, Any]:
        tail = ([_hung("all_reduce", 10, at=90)] if rank == 3 else
                [event("all_reduce", 10, ((1024,),), in_dtype=["Float"], at=90), _hung("all_reduce", 11, at=95)])
        return dump(rank, [*_history(9), *tail], w4)
    cases.append(Case("hang/lagging-then-missing", SRC_HANG, "rank 3 still at #10, which ranks 0-2 completed; they "
                      "wait for it in #11", {r: lag(r) for r in W4},
                      (Expect(MISSING, "0", 11, (3,)), Expect(LAGGING, "0", 10, (3,)))))

    # Bad input.
    waiting = [*_history(4), _hung("all_reduce", 5)]
    cases.append(Case("bad/missing-dump", SRC_HANG, "rank 3 died before dumping; ranks 0-2 wait in #5",
                      {r: dump(r, waiting, w4) for r in (0, 1, 2)}, (Expect(MISSING, "0", 5, (3,)),)))
    cases.append(Case("bad/unreadable-dump", SRC_HANG, "rank 3's file is not a dump (truncated); ranks 0-2 wait "
                      "in #5", {r: dump(r, waiting, w4) for r in (0, 1, 2)}, (Expect(MISSING, "0", 5, (3,)),),
                      unreadable={3: b"\x80\x04\x95truncated"}))
    odd = dump(1, waiting, w4)
    odd["entries"].insert(1, ["not", "an", "entry"])
    del odd["entries"][2]["time_created_ns"]
    cases.append(Case("bad/odd-entries", SRC_HANG, "rank 1's dump holds a list where an entry belongs and an entry "
                      "without time_created_ns; rank 3 never joins #5",
                      {0: dump(0, waiting, w4), 1: odd, 2: dump(2, waiting, w4), 3: dump(3, _history(4), w4)},
                      (Expect(MISSING, "0", 5, (3,)),)))

    # No pg_id (torch before 2.5, hand-made): the PG name must group the entries.
    groups3 = config([world((0, 1, 2)), ("1", "pair", (1, 2))])
    pair_pg = ("1", "pair")

    def no_id(rank: int) -> dict[str, Any]:
        entries = [event("all_reduce", s, ((64,),), pg_id=None, at=s) for s in (1, 2, 3)]
        if rank > 0:
            entries.append(event("all_reduce", 1, ((64,),), pg=pair_pg, pg_id=None, at=4))
        if rank == 2:
            entries.append(event("all_reduce", 2, ((64,),), pg=pair_pg, pg_id=None, at=100, state="scheduled"))
        return dump(rank, entries, groups3, version="2.4")
    cases.append(Case("bad/no-pg_id", SRC_HANG, "entries without pg_id in two PGs; rank 2 waits in PG 'pair' #2, "
                      "rank 1 never joins it", {r: no_id(r) for r in (0, 1, 2)},
                      (Expect(MISSING, "1", 2, (1,)),)))
    return cases


def all_cases() -> list[Case]:
    cases = [*_pairwise(), _every_collective(), *_backends(), *_build_db_cases(), *_later_cases(), *_hangs()]
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    return cases
