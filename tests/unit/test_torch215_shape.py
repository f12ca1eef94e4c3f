"""Flight Recorder as torch 2.15 writes it, from literals (no torch 2.15 exists to run).

torch 2.15 makes ``nccl`` build ProcessGroupNCCL2, which names itself ``nccl2`` (pytorch#192281), and records it
through the backend-agnostic FlightRecorderHook (pytorch#189363, #190738, #192233): its entries are named
``nccl2:<op>``; a backend without a completion hook has them retired as soon as issued, ``state`` "scheduled"
for ever, no ``duration_ms``, ``time_discovered_*`` 0; the hook's ``pg_status`` counts ``op_id`` in
``last_enqueued_collective``, never sets ``last_started_collective``, and sets ``last_completed_collective``
only from a completion hook (-1 for ever without one). With a completion hook (nccl2's), an entry is retired
and "completed" at once, with the duration the backend measured; a failed one is never retired.
docs/durations.md says what of this no test here can show.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from frexporter import spool
from frexporter.analysis.kinds import MISSING_RANK
from frexporter.fr.domain import translate
from frexporter.fr.trace import parse_dump, parse_entry
from frexporter.postmortem import report
from frexporter.recorder import torch_fr
from frexporter.sources.collectives import EntryCursor
from frexporter.sources.ranks import pg_state
from frexporter.spool import PGEntry, RawPGStatus
from tests import fr_cases, spoolgen
from tests.fakes.node import T0, Node, raw
from tests.shared.analyze_dir_hostile import write_file

NCCL2 = "nccl2:all_reduce"


def hooked(rid: int, seq: int, *, issued: bool = True, completion_hook: bool = False,
           duration: float | None = None, **kw: Any) -> dict[str, Any]:
    """An entry of torch 2.15's FlightRecorderHook: retired at issue without a completion hook; with one,
    retired and "completed" together once the backend saw it finish (``issued`` then says it did)."""
    state = "completed" if completion_hook and issued else "scheduled"
    return raw(rid, seq, op=NCCL2, retired=issued, state=state, duration=duration, **kw)


def status(op_id: int, completed: int = -1) -> dict[str, str]:
    return {"last_enqueued_collective": str(op_id), "last_started_collective": "-1",
            "last_completed_collective": str(completed)}


def dump215(entries: list[dict[str, Any]], op_id: int, completed: int = -1) -> dict[str, Any]:
    return {"version": "2.10", "comm_lib_version": "2.27.5",
            "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
            "pg_status": {"0": status(op_id, completed)}, "entries": entries}


# ---------------------------------------------------------------- entries: counted once, none lost


@pytest.mark.parametrize("recorder_is_nccl", [False, True], ids=["generic-recorder", "nccl-recorder"])
def test_entries_retired_at_issue_count_like_gloo_wherever_they_land(recorder_is_nccl: bool) -> None:
    cursor = EntryCursor(nccl=recorder_is_nccl)
    ring = [parse_entry(hooked(i, i + 1)) for i in range(3)] + [parse_entry(hooked(3, 4, issued=False))]
    settled, _, _ = cursor.take(ring)
    # Stock NCCL's rule ("retired without completing: timed out") would have dropped all three.
    assert [e.record_id for e in settled] == [0, 1, 2]
    assert all(e.duration_ms is None for e in settled)
    ring[3] = parse_entry(hooked(3, 4))
    assert [e.record_id for e in cursor.take(ring)[0]] == [3]  # counted once it is retired, once only


def test_a_completion_hook_gives_completed_entries_with_durations() -> None:
    cursor = EntryCursor(nccl=True)
    ring = [parse_entry(hooked(0, 1, completion_hook=True, duration=3.5)),
            parse_entry(hooked(1, 2, completion_hook=True, issued=False))]  # failed or in flight: never retired
    settled, _, _ = cursor.take(ring)
    assert [(e.record_id, e.duration_ms) for e in settled] == [(0, 3.5)]


def test_stock_nccl_still_drops_what_it_retired_without_completing() -> None:
    cursor = EntryCursor(nccl=True)
    ring = [parse_entry(raw(0, 1, op="nccl:all_reduce", state="completed")),
            parse_entry(raw(1, 2, op="nccl:all_reduce", state="scheduled"))]  # timed out
    assert [e.record_id for e in cursor.take(ring)[0]] == [0]


def test_the_backend_is_read_from_the_profiling_name() -> None:
    assert parse_entry(hooked(0, 1)).backend == "nccl2"
    assert parse_entry(raw(0, 1, op="nccl:send 0->1", p2p=True)).backend == "nccl"
    assert parse_entry(raw(0, 1, op="all_reduce")).backend == ""
    assert [spool.is_nccl_backend(b) for b in ("nccl", "nccl2", "NCCL", "nccl-legacy", "gloo", "ucc", "")] == [
        True, True, True, True, False, False, False]


# ---------------------------------------------------------------- a deep read, and the counters between reads


def test_a_deep_read_tells_completion_where_the_counters_never_do() -> None:
    # op_id runs ahead of the collective seq (the hook counts every op); nothing ever sets last_completed.
    dump = parse_dump(dump215([hooked(i, i + 1) for i in range(5)], op_id=12))
    view = translate(dump)[0]
    assert (view.enqueued, view.completed, view.started, view.inflight) == (5, 5, -1, ())
    assert view.known and view.backend == "nccl2" and not view.raw_completes
    hang = parse_dump(dump215([hooked(i, i + 1) for i in range(4)] + [hooked(4, 5, issued=False)], op_id=12))
    view = translate(hang)[0]
    assert (view.enqueued, view.completed, [c.seq for c in view.inflight]) == (5, 4, [5])


def test_stock_nccl_completed_before_its_watchdog_moved_the_counter_keeps_its_counters() -> None:
    # As torch 2.11's NCCL dumped it on an H200 right after four all_reduces: "completed", not yet retired, and
    # last_completed_collective still -1 (its watchdog moves it, then retires the entries, on its next loop).
    entries = [raw(i, i + 1, op="nccl:all_reduce", state="completed", retired=False) for i in range(4)]
    view = translate(parse_dump(dump215(entries, op_id=4)))[0]
    assert view.raw_completes and view.completed == 4


def test_a_pg_whose_counters_moved_since_the_deep_read_keeps_the_read_values() -> None:
    view = translate(parse_dump(dump215([hooked(i, i + 1) for i in range(5)], op_id=5)))[0]
    assert not view.has_p2p  # op_id and seq agree here: nothing but the completion counter gives it away
    entry = PGEntry(name="0", desc="default_pg", ranks=(0, 1), backend="cuda:nccl2", local_ids={"fr": 0})
    moved = RawPGStatus(enqueued=7, started=-1, completed=-1)  # two more issued since the read
    state, _ = pg_state.pg_state(entry, "fr", moved, view, False, pg_state.PGMemory(), T0, 0.0)
    # Read from the counters, the PG would show collective -1 completed and 8 in flight: a hang from the start.
    assert (state.last_enqueued, state.last_completed, state.inflight_count, state.exact) == (5, 5, 0, False)


def test_a_hang_caught_by_a_deep_read_stays_in_flight_until_the_rank_issues_more() -> None:
    view = translate(parse_dump(dump215([hooked(0, 1), hooked(1, 2, issued=False)], op_id=2)))[0]
    entry = PGEntry(name="0", desc="default_pg", ranks=(0, 1), backend="cuda:nccl2")
    same = RawPGStatus(enqueued=2, started=-1, completed=-1)
    state, _ = pg_state.pg_state(entry, "fr", same, view, False, pg_state.PGMemory(), T0, 0.0)
    assert [c.seq for c in state.inflight] == [2] and state.last_completed == 1
    on = RawPGStatus(enqueued=3, started=-1, completed=-1)  # it issued more: what was in flight was issued
    state, _ = pg_state.pg_state(entry, "fr", on, view, False, pg_state.PGMemory(), T0, 0.0)
    assert state.inflight == ()


def test_choose_prefers_the_pg_id_an_nccl_backend_recorded() -> None:
    # A cpu:gloo,cuda:nccl2 group: gloo's half and the hook's half both report under the group's name.
    m = spool.parse_manifest(spoolgen.manifest("job", 0, world=2, recorders=["fr"]))
    raw_status = {"fr": {0: RawPGStatus(3, -1, 3), 1: RawPGStatus(9, -1, -1)}}
    learned = {"fr": {0: "0", 1: "0"}}
    assert pg_state.choose(raw_status, learned, m)["0"][1] == 0
    assert pg_state.choose(raw_status, learned, m, {("fr", 1)})["0"][1] == 1


def test_a_node_of_hooked_ranks_counts_every_collective_and_sees_no_hang(tmp_path: Path) -> None:
    class Node215(Node):
        """The fake node's ranks as torch 2.15 writes them: nccl2 PGs, counters the hook keeps."""

        def start_rank(self, r: int) -> None:
            stem = spool.rank_stem("job", r)
            sock = spool.socket_name(stem)
            m = spoolgen.manifest("job", r, world=len(self.rings), socket=sock, pid=self.pids[r],
                                  handlers=["ping", "fr_trace_json", "dump_nccl_trace_json"], recorders=["fr"])
            m["process_groups"][0]["backend"] = "cuda:nccl2"
            spool.write_json_atomic(str(self.dir / (stem + spool.MANIFEST_SUFFIX)), m)
            from tests.fakes.node import FakeWorker
            self.workers.append(FakeWorker(str(self.dir / sock), lambda r=r: self.dump(r)))  # type: ignore[misc]

        def dump(self, r: int) -> dict[str, Any]:
            return dump215(self.rings[r], op_id=max((e["op_id"] for e in self.rings[r]), default=0))

        def poll(self) -> Any:
            self.now += 1.0
            self.counter += 1
            for r, ring in self.rings.items():
                snap = spoolgen.snapshot(self.pids[r], counter=self.counter, when=self.now)
                snap["status"] = {"fr": {"0": status(max((e["op_id"] for e in ring), default=0))}}
                spool.write_json_atomic(str(self.dir / (spool.rank_stem("job", r) + spool.SNAPSHOT_SUFFIX)), snap)
            return self.exporter.poll_once()

    node = Node215(tmp_path / "node", 2)
    try:
        for r in (0, 1):
            node.rings[r] = [hooked(i, i + 1) for i in range(3)]
        snap = node.poll()
        for r in (0, 1):
            node.rings[r] += [hooked(i, i + 1) for i in range(3, 6)]
        for _ in range(3):
            snap = node.poll()
        for rank in snap.ranks:
            (pg,) = rank.pgs
            assert (pg.backend, pg.last_completed, pg.inflight_count, pg.inflight) == ("cuda:nccl2", 6, 0, ())
        assert [(c.op, c.bytes) for c in snap.collectives] == [("all_reduce", 2 * 6 * 48)]  # each counted once
        assert snap.verdicts == ()
    finally:
        node.close()


# ---------------------------------------------------------------- the recorder's choice of recorders


@pytest.mark.parametrize(("configs", "expected"), [
    (["cuda:nccl2"], ("fr",)),  # the hook writes nccl2's entries to the generic recorder
    (["cpu:gloo,cuda:nccl2"], ("fr",)),
    (["cuda:nccl"], ("nccl",)),  # stock ProcessGroupNCCL (torch before 2.15, or TORCH_DIST_USE_NCCL2=0)
    (["cuda:nccl-legacy"], ("nccl",)),
    (["cpu:gloo,cuda:nccl"], ("fr", "nccl")),
    (["cuda:ucc"], ("fr", "nccl")),  # unknown: every available recorder
])
def test_recorders_in_use(configs: list[str], expected: tuple[str, ...]) -> None:
    assert torch_fr.recorders_in_use(("fr", "nccl"), configs) == expected


class _Backend:
    def __init__(self, name: str) -> None:
        self._name = name

    def name(self) -> str:
        return self._name


class _PG:
    """A process group whose backends name themselves; ``_get_backend`` raises for a device it has none for."""

    def __init__(self, **backends: str) -> None:
        self.backends = backends

    def _get_backend(self, device: str) -> _Backend:
        return _Backend(self.backends[device])


class _Torch:
    @staticmethod
    def device(name: str) -> str:
        return name


def test_the_pg_table_names_each_backend_as_torch_built_it() -> None:
    # torch 2.15: "nccl" builds ProcessGroupNCCL2, which names itself nccl2 (and is recorded elsewhere).
    assert torch_fr._backend_config(_PG(cpu="gloo", cuda="nccl2"), "cpu:gloo,cuda:nccl", _Torch) == \
        "cpu:gloo,cuda:nccl2"
    assert torch_fr._backend_config(_PG(cuda="nccl"), "cuda:nccl-legacy", _Torch) == "cuda:nccl"
    assert torch_fr._backend_config(_PG(), "cuda:nccl", _Torch) == "cuda:nccl"  # cannot ask: as configured
    assert torch_fr._backend_config(_PG(cuda=""), "cuda:nccl", _Torch) == "cuda:nccl"
    assert torch_fr._backend_config(_PG(), "", _Torch) == ""
    assert torch_fr._backend_config(_PG(), "gloo", _Torch) == "gloo"


# ---------------------------------------------------------------- `frexporter analyze` on 2.15 dumps


def _write215(directory: Path, ranks: dict[int, list[dict[str, Any]]]) -> Path:
    directory.mkdir()
    cfg = fr_cases.config([("0", "default_pg", (0, 1, 2))])
    for rank, entries in ranks.items():
        doc = fr_cases.dump(rank, entries, cfg, version="2.10")
        doc["pg_status"] = {"0": status(max((e["op_id"] for e in entries), default=0) + 7)}
        write_file(directory, f"nccl2_rank{rank}.json", doc)
    return directory


def _hook_event(seq: int, *, issued: bool = True, at: float | None = None) -> dict[str, Any]:
    return fr_cases.event("all_reduce", seq, ((8,),), at=seq if at is None else at, backend="nccl2",
                          state="scheduled", retired=issued)


def test_analyze_finds_the_rank_that_never_joined(tmp_path: Path) -> None:
    done = [_hook_event(s) for s in (1, 2, 3)]
    directory = _write215(tmp_path / "dumps", {0: [*done, _hook_event(4, issued=False, at=40)],
                                               1: [*done, _hook_event(4, issued=False, at=40)], 2: done})
    result = report.from_dir(str(directory), 0.0)
    assert result.problems == []
    assert [(v.kind, v.ranks, v.seq) for v in result.verdicts] == [(MISSING_RANK, (2,), 4)]


def test_analyze_of_a_healthy_job_says_nothing(tmp_path: Path) -> None:
    done = [_hook_event(s) for s in (1, 2, 3, 4)]
    directory = _write215(tmp_path / "dumps", {0: done, 1: done, 2: done[:3]})  # rank 2 not there yet: retired
    result = report.from_dir(str(directory), 0.0)
    assert result.problems == [] and result.verdicts == ()
