"""The spool is untrusted input: bounds on what a file parses into, and on what the exporter serves.

A spool file's byte limit caps bytes, not parsed size: 4 MiB of compact JSON is 470,000 ranks in one member
list. Past a parser bound the whole file is refused with a counted reason (``spool.LIMIT_REASONS``) and the
other ranks are served as before; /api/v1/status and / list up to their own bounds, flagged where cut.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_spool_bounds.py.
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from benchmarks import fuzz
from frexporter import spool
from frexporter.analysis.verdicts import Verdict
from frexporter.fr import trace
from frexporter.model import RANK_OK, NodeSnapshot, PGState, RankState
from frexporter.outputs import api
from frexporter.spool import Members, SpoolError
from tests import spoolgen
from tests.fakes.node import FakeWorker
from tests.harness import REPO
from tests.shared.spool_bounds import write_manifest
from tests.shared.spool_exporter import errors_of, healthy_ranks, make_exporter

# ---------------------------------------------------------------- every parser bound

# The reason one past each bound is refused with (None: accepted, the value is cut); fuzz.py makes the files.
MANIFEST_REASONS = {
    "members": spool.LIMIT_MEMBERS, "total_members": spool.LIMIT_MEMBERS, "groups": spool.LIMIT_ITEMS,
    "rank_value": "invalid", "local_ids": spool.LIMIT_ITEMS,
    **{f"text_{f}": spool.LIMIT_TEXT for f in fuzz._TEXT_FIELDS},
    **{f"pg_{f}": spool.LIMIT_TEXT for f in ("name", "desc", "backend")},
    **{f"list_{f}": spool.LIMIT_ITEMS for f in fuzz._NAME_LISTS},
    **{f"name_{f}": spool.LIMIT_TEXT for f in fuzz._NAME_LISTS},
}
SNAPSHOT_REASONS = {
    "pg_status": spool.LIMIT_ITEMS, "recorders": spool.LIMIT_ITEMS, "recorder_name": spool.LIMIT_TEXT,
    "errors": spool.LIMIT_ITEMS, "error_kind": spool.LIMIT_TEXT, "state": spool.LIMIT_TEXT, "message": None,
}
DUMP_REASONS = {
    "entries": spool.LIMIT_ITEMS, "tensors": spool.LIMIT_ITEMS, "dims": spool.LIMIT_ITEMS, "dtypes": spool.LIMIT_ITEMS,
    "dtype": spool.LIMIT_TEXT, "pg_name": spool.LIMIT_TEXT, "pg_desc": spool.LIMIT_TEXT, "op": spool.LIMIT_TEXT,
    "state": spool.LIMIT_TEXT, "pg_status": spool.LIMIT_ITEMS, "pg_config": spool.LIMIT_ITEMS,
    "pg_config_keys": spool.LIMIT_ITEMS, "pg_config_key": spool.LIMIT_TEXT,
}
PARSERS: dict[str, Callable[[Any], Any]] = {"manifest": spool.parse_manifest, "snapshot": spool.parse_snapshot,
                                            "snapshot_map": spool.parse_snapshot, "dump": trace.parse_dump}
CASES = [(kind, case, reason) for kind, reasons in (("manifest", MANIFEST_REASONS), ("snapshot", SNAPSHOT_REASONS),
                                                    ("snapshot_map", SNAPSHOT_REASONS), ("dump", DUMP_REASONS))
         for case, reason in sorted(reasons.items())]


def test_every_generated_bound_has_an_expected_reason() -> None:
    assert set(MANIFEST_REASONS) == set(fuzz.MANIFEST_BOUNDS)
    assert set(SNAPSHOT_REASONS) == set(fuzz.SNAPSHOT_BOUNDS)
    assert set(DUMP_REASONS) == set(fuzz.DUMP_BOUNDS)


@pytest.mark.parametrize(("kind", "case", "reason"), CASES, ids=[f"{k}-{c}" for k, c, _ in CASES])
def test_at_the_bound_accepted_one_past_refused(kind: str, case: str, reason: str | None) -> None:
    parse = PARSERS[kind]
    if (kind, case) != ("dump", "entries"):  # parsing a full ring at the bound: see the next test
        parse(json.loads(json.dumps(fuzz.bound_doc(kind, case, 0))))
    over = json.loads(json.dumps(fuzz.bound_doc(kind, case, 1)))
    if reason is None:
        parse(over)
        return
    with pytest.raises(SpoolError) as e:
        parse(over)
    assert e.value.reason == reason


@pytest.mark.parametrize("over", [0, 1])
def test_shared_size_lists_are_charged_for_every_use(over: int) -> None:
    """A pickle can give every entry one list of 1024 shapes: converted once, counted per entry."""
    obj = fuzz.dumpfiles.decode(fuzz.size_values_pickle(over), "memo")
    if over:
        with pytest.raises(SpoolError) as e:
            trace.parse_dump(obj)
        assert e.value.reason == spool.LIMIT_ITEMS
    else:
        dump = trace.parse_dump(obj)
        assert len({id(entry.input_sizes) for entry in dump.entries}) == 1


# ---------------------------------------------------------------- counted, and the other ranks served


def bad_manifest(case: str) -> dict[str, Any]:
    return {**fuzz.MANIFEST_BOUNDS[case](spoolgen.manifest("job", 9), 1), "job_id": "job", "rank": 9}


@pytest.mark.parametrize("case", ["members", "total_members", "groups", "text_hostname", "list_handlers"])
def test_a_manifest_past_a_bound_is_counted_once_and_the_others_served(tmp_path: Path, case: str) -> None:
    for r in (0, 1):
        spoolgen.write_rank(tmp_path, "job", r)
    write_manifest(tmp_path, bad_manifest(case))
    exporter, source = make_exporter(tmp_path)
    try:
        for counter in range(2, 5):
            for r in (0, 1):
                spoolgen.refresh(tmp_path, "job", r, counter)
            exporter.poll_once()
        assert errors_of(exporter) == {MANIFEST_REASONS[case]: 1}  # once per file version, not per poll
        assert healthy_ranks(exporter) == {0, 1}
    finally:
        source.close()


@pytest.mark.parametrize("mapped", [False, True])
def test_a_snapshot_past_a_bound_is_counted_and_the_others_served(tmp_path: Path, mapped: bool) -> None:
    for r in (0, 1, 2):
        spoolgen.write_rank(tmp_path, "job", r, mapped=mapped)
    doc = fuzz.SNAPSHOT_BOUNDS["pg_status"](spoolgen.snapshot(100002, counter=2), 1)
    spoolgen.write_snapshot(tmp_path, spool.rank_stem("job", 2), doc, mapped)
    exporter, source = make_exporter(tmp_path)
    try:
        exporter.poll_once()
        assert errors_of(exporter) == {spool.LIMIT_ITEMS: 1}
        assert healthy_ranks(exporter) >= {0, 1}
    finally:
        source.close()


def test_a_deep_read_past_the_entry_bound_is_refused_and_counted(tmp_path: Path) -> None:
    sock = spoolgen.own_socket("job", 1)
    spoolgen.write_rank(tmp_path, "job", 0)
    spoolgen.write_rank(tmp_path, "job", 1, socket=sock)
    worker = FakeWorker(str(tmp_path / sock), lambda: {"version": "2.10", "pg_status": {},
                                                       "entries": [0] * (trace.MAX_ENTRIES + 1)})
    exporter, source = make_exporter(tmp_path)
    try:
        exporter.poll_once()
        assert worker.reads == 1
        assert errors_of(exporter) == {spool.LIMIT_ITEMS: 1}
        assert healthy_ranks(exporter) == {0, 1}
    finally:
        source.close()
        worker.close()


# ---------------------------------------------------------------- packed, shared member lists


def test_ranks_of_one_job_share_their_member_list() -> None:
    world = list(range(spool.MAX_PG_MEMBERS))
    parsed = []
    for r in range(3):
        doc = spoolgen.manifest("job", r)
        doc["process_groups"][0]["ranks"] = list(reversed(world))  # parsed sorted, whatever the order written
        parsed.append(spool.parse_manifest(json.loads(json.dumps(doc))).process_groups[0].ranks)
    assert parsed[0] is parsed[1] is parsed[2]
    members = parsed[0]
    assert members == tuple(world) and tuple(world) == members and hash(members) == hash(tuple(world))
    assert len(members) == spool.MAX_PG_MEMBERS and members[:3] == (0, 1, 2) and members[-1] == world[-1]
    assert 77 in members and spool.MAX_PG_MEMBERS not in members and -1 not in members
    assert Members.of([3, 1, 3]) == (1, 3) and Members.of([]) == () and Members.of([2]) > (1, 5)


def test_distinct_member_lists_cost_a_few_bytes_a_member() -> None:
    docs = []
    for r in range(5):
        doc = spoolgen.manifest("job", r)
        doc["process_groups"][0]["ranks"] = list(range(r, r + spool.MAX_PG_MEMBERS))
        docs.append(json.loads(json.dumps(doc)))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = [spool.parse_manifest(doc) for doc in docs]
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len({id(m.process_groups[0].ranks) for m in kept}) == 5
    # A tuple of Python ints would hold 40 bytes a member.
    assert held < 5 * spool.MAX_PG_MEMBERS * 8, held


# ---------------------------------------------------------------- what the pages list


def _pg(name: str, members: Members, inflight: int = 0) -> PGState:
    return PGState(name=name, desc="d" * spool.MAX_TEXT_CHARS, ranks=members, backend="cpu:gloo", last_enqueued=10,
                   last_started=-1, last_completed=10 - inflight, inflight=(), inflight_count=inflight,
                   timeout_seconds=600.0, last_progress=None, exact=True, has_p2p=False)


def _rank(r: int, pgs: tuple[PGState, ...]) -> RankState:
    return RankState(job_id="j" * spool.MAX_TEXT_CHARS, rank=r, local_rank=r, world_size=spool.MAX_PG_MEMBERS,
                     hostname="h", pid=r + 1, torch_version="2.13", gpu_uuid="", status=RANK_OK, heartbeat=1.0,
                     heartbeat_age=0.0, socket_alive=None, pgs=pgs)


def test_status_and_page_are_bounded_for_any_snapshot() -> None:
    world = Members.of(range(spool.MAX_PG_MEMBERS))
    pgs = tuple(_pg(str(i), world, inflight=1) for i in range(api.MAX_LISTED_RANK_PGS + 1))
    many = list(range(spool.MAX_PG_MEMBERS))
    verdicts = tuple(Verdict(kind="stalled", job_id="j", pg=str(i), pg_desc="", ranks=(0,), waiting_ranks=tuple(many),
                             seq=10, op="all_reduce", since=0.0, age_seconds=1.0, timeout_seconds=600.0,
                             budget_used=0.0, summary="s", details={"unobserved_ranks": many})
                     for i in range(api.MAX_LISTED_VERDICTS + 1))
    ranks = tuple(_rank(r, pgs) for r in range(api.MAX_LISTED_RANKS + 1))
    snap = NodeSnapshot(time=1.0, hostname="node", ranks=ranks, sources=(), verdicts=verdicts)
    status = api.status_json(snap)

    assert (len(status["ranks"]), status["ranks_total"], status["ranks_truncated"]) == (
        api.MAX_LISTED_RANKS, api.MAX_LISTED_RANKS + 1, True)
    listed = [pg for r in status["ranks"] for pg in r["process_groups"]]
    assert len(listed) == api.MAX_LISTED_PGS
    assert all(len(r["process_groups"]) <= api.MAX_LISTED_RANK_PGS for r in status["ranks"])
    assert all(r["process_groups_truncated"] and r["process_groups_total"] == len(pgs) for r in status["ranks"])
    assert {(pg["size"], len(pg["ranks"]), pg["ranks_truncated"]) for pg in listed} == {
        (spool.MAX_PG_MEMBERS, api.MAX_LISTED_MEMBERS, True)}
    # The node view sums up the listed (rank, PG) pairs: ranks 0-3 list 256 groups each, the same 256.
    assert sum(len(g["local_ranks"]) for g in status["process_groups"]) == api.MAX_LISTED_PGS
    assert len(status["process_groups"]) == api.MAX_LISTED_RANK_PGS and status["process_groups_truncated"]
    assert all(g["local_ranks_truncated"] for g in status["process_groups"])
    assert (len(status["verdicts"]), status["verdicts_truncated"]) == (api.MAX_LISTED_VERDICTS, True)
    v = status["verdicts"][0]
    assert len(v["waiting_ranks"]) == len(v["details"]["unobserved_ranks"]) == api.MAX_LISTED_ITEMS
    assert v["waiting_ranks_truncated"] and v["details"]["unobserved_ranks_truncated"]
    # As served (indented): each PG listed in either view costs under 2 KiB, and the verdicts less than that.
    assert len(json.dumps(status, indent=1)) < 3 * api.MAX_LISTED_PGS * 2 * 1024
    page = api.status_html(snap)
    # A row per listed PG; a rank with none listed gets a row of its own, a cut list a row that says so.
    assert page.count("<tr>") <= api.MAX_LISTED_PGS + 2 * api.MAX_LISTED_RANKS + 2 and len(page) < 1024 * 1024


def test_small_nodes_are_listed_whole() -> None:
    pg = _pg("0", Members.of(range(8)))
    snap = NodeSnapshot(time=1.0, hostname="node", ranks=(_rank(0, (pg,)), _rank(1, (pg,))), sources=())
    status = api.status_json(snap)
    assert not status["ranks_truncated"] and not status["process_groups_truncated"]
    assert [(p["ranks"], p["ranks_truncated"], p["size"]) for r in status["ranks"] for p in r["process_groups"]] == [
        (list(range(8)), False, 8)] * 2
    assert not any(r["process_groups_truncated"] for r in status["ranks"])


def test_security_page_documents_the_bounds_and_reasons() -> None:
    text = (REPO / "SECURITY.md").read_text()
    for reason in spool.LIMIT_REASONS:
        assert f"`{reason}`" in text
    for value in (spool.MAX_PG_MEMBERS, spool.MAX_MANIFEST_MEMBERS, spool.MAX_PGS, trace.MAX_ENTRIES,
                  api.MAX_LISTED_MEMBERS, api.MAX_LISTED_PGS):
        assert f"{value:,}" in text, value
