"""Blame stays with the culprit (issue 25, item 3): a rank that exits, cleanly or not, while its local peers wait
for it in a collective is named (``rank_down``, "exited while rank 0 waits in all_reduce #11"), never the waiter;
and a spool the ranks cannot write to is visible on the exporter's side.

Fake ranks on a fake clock (``tests/fakes/node.py``); the real gloo job is tests/e2e/test_exited_culprit.py."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from frexporter import naming as n
from frexporter import reasons, spool
from frexporter.analysis import VerdictConfig, evaluate, make_analyzer
from frexporter.analysis.kinds import MISSING_RANK, RANK_DOWN_KIND, STALLED
from frexporter.exporter import Exporter
from frexporter.model import RANK_DOWN, RANK_OK, RANK_UNRESPONSIVE, NodeSnapshot, RankState
from frexporter.outputs.api import status_json
from frexporter.recorder.publisher import Publisher
from frexporter.sources.ranks import RanksConfig, RanksSource, liveness
from frexporter.sources.ranks import space as spool_space
from tests import spoolgen
from tests.fakes.node import Node, raw, render
from tests.fakes.rank_states import NOW, idle, pg, rank, waiting
from tests.harness import sample

STUCK = 5.0  # --stuck-after of these nodes: a wait is a verdict this soon
HUNG_SEQ = 11  # the all_reduce rank 0 enters and rank 1 never joins


def _node(node_factory: Callable[..., Node], ranks: int = 2, **config: Any) -> Node:
    node = node_factory(ranks, **config)
    node.exporter = Exporter([(node.source, 1.0)], clock=lambda: node.now, hostname="node-a",
                             analyzer=make_analyzer(VerdictConfig(stuck_after=STUCK)))
    return node


def _poll(node: Node, exiting: dict[int, bool] | None = None, dead: tuple[int, ...] = ()) -> NodeSnapshot:
    """One second on, each live rank's snapshot as its ring says (enqueued and completed apart). ``exiting``: the
    ranks whose snapshot is their goodbye (state ``exiting``), each with its final counters (True, as the
    recorder writes them) or without (False, as older recorders did); ``dead``: ranks whose snapshot is not
    refreshed any more."""
    exiting = exiting or {}
    node.now += 1.0
    node.counter += 1
    gone: set[int] = node.__dict__.setdefault("said_goodbye", set())
    for r in node.rings:
        if r in dead or r in gone:
            continue  # a dead rank writes nothing more; a goodbye is written once
        if r in exiting:
            gone.add(r)
        status = {k: str(v) for k, v in node.dump(r)["pg_status"]["0"].items()}
        extra: dict[str, Any] = {"status": {"fr": {"0": status}}}
        if r in exiting:
            extra = {"status": {"fr": {"0": status}} if exiting[r] else {}, "state": "exiting",
                     "message": "process exiting"}
        snap = spoolgen.snapshot(node.pids[r], counter=node.counter, when=node.now, **extra)
        spool.write_json_atomic(str(node.dir / (spool.rank_stem("job", r) + spool.SNAPSHOT_SUFFIX)), snap)
    return node.exporter.poll_once()


def _steady(node: Node, seq: int = HUNG_SEQ - 1) -> NodeSnapshot:
    """Every rank completed collectives 1..seq, one per poll."""
    snap = None
    for s in range(1, seq + 1):
        for r in node.rings:
            node.rings[r].append(raw(s, s, created=node.now))
        snap = _poll(node)
    assert snap is not None and snap.verdicts == ()
    return snap


def _hang(node: Node, waiters: tuple[int, ...] = (0,)) -> None:
    """``waiters`` enter all_reduce #HUNG_SEQ; the other ranks never do."""
    for r in waiters:
        node.rings[r].append(raw(HUNG_SEQ, HUNG_SEQ, created=node.now, retired=False))


def _kinds(snap: NodeSnapshot) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    return [(v.kind, v.ranks, v.waiting_ranks) for v in snap.verdicts]


# ---------------------------------------------------------------- a clean exit while a peer waits


def test_rank_that_exits_cleanly_while_its_peer_waits_is_named_never_the_waiter(node_factory) -> None:
    node = _node(node_factory)
    _steady(node)
    _hang(node)
    for _ in range(int(STUCK) + 2):  # rank 1 trains on without joining: named once the wait is stuck
        snap = _poll(node)
    assert _kinds(snap) == [(MISSING_RANK, (1,), (0,))]
    # Rank 1 returns from its loop early and exits cleanly: its goodbye snapshot, with its final counters.
    snap = _poll(node, exiting={1: True})
    assert _kinds(snap) == [(RANK_DOWN_KIND, (1,), (0,))]  # it was: stalled [0], "rank 1 is not observed here"
    assert {r.rank: r.status for r in snap.ranks} == {0: RANK_OK, 1: RANK_DOWN}
    (exited,) = [r for r in snap.ranks if r.rank == 1]
    assert exited.exited
    for _ in range(40):  # for as long as rank 0 waits, every poll names rank 1
        assert _kinds(snap) == [(RANK_DOWN_KIND, (1,), (0,))], snap.verdicts
        snap = _poll(node, exiting={1: True})
    (v,) = snap.verdicts
    assert "Rank 1 (host node-a, pid 100001) exited while rank 0 waits in all_reduce #11" in v.summary, v.summary
    assert "not observed here" not in v.summary
    assert v.details["exited"] is True and v.seq == HUNG_SEQ
    # Exported as down: FrexporterRankDown pages for it, and /api/v1/status says why.
    parsed = render(snap)
    assert sample(parsed, n.RANK_UP, job_id="job", rank="1") == 0
    assert sample(parsed, n.VERDICT, kind=RANK_DOWN_KIND, job_id="job") == 1
    (listed,) = [r for r in status_json(snap)["ranks"] if r["rank"] == 1]
    assert (listed["status"], listed["exited"]) == (RANK_DOWN, True)
    # Rank 0 gives up (gloo aborts its wait, the watchdog fires): nobody waits, the exited rank goes at once.
    node.rings[0][-1]["retired"] = True
    node.rings[0][-1]["state"] = "completed"
    snap = _poll(node, exiting={1: True})
    assert [r.rank for r in snap.ranks] == [0] and snap.verdicts == ()


def test_exit_before_the_wait_is_stuck_is_named_at_once(node_factory) -> None:
    node = _node(node_factory)
    _steady(node)
    _hang(node)
    snap = _poll(node, exiting={1: True})  # rank 1 exits the moment rank 0 enters #11
    assert _kinds(snap) == [(RANK_DOWN_KIND, (1,), (0,))]
    for _ in range(int(STUCK) + 5):  # and never turns into "stalled" on rank 0
        snap = _poll(node, exiting={1: True})
        assert _kinds(snap) == [(RANK_DOWN_KIND, (1,), (0,))]


def test_healthy_end_of_a_job_is_no_verdict(node_factory) -> None:
    node = _node(node_factory)
    _steady(node)
    # Both ranks enter and complete the last all_reduce; rank 1 exits first, and rank 0's snapshot still shows
    # its #11 in flight (written a moment before it completed): rank 1 completed #11, it is nobody's culprit.
    node.rings[0].append(raw(HUNG_SEQ, HUNG_SEQ, created=node.now, retired=False))
    node.rings[1].append(raw(HUNG_SEQ, HUNG_SEQ, created=node.now))
    snap = _poll(node, exiting={1: True})
    assert [r.rank for r in snap.ranks] == [0] and snap.verdicts == ()
    node.rings[0][-1]["retired"] = True
    snap = _poll(node, exiting={0: True, 1: True})
    assert snap.ranks == () and snap.verdicts == ()


def test_goodbye_without_counters_is_judged_once_the_waiter_is_seen_waiting_after_it(node_factory) -> None:
    # An older recorder's goodbye carries no counters: rank 1's last known ones may be a snapshot old. It is named
    # once rank 0 is seen still waiting well after rank 1 left (had rank 1 completed #11, rank 0 would have too).
    node = _node(node_factory)
    _steady(node)
    _hang(node)
    snap = _poll(node, exiting={1: False})
    assert [r.rank for r in snap.ranks] == [0]
    for _ in range(int(liveness.EXIT_EVIDENCE_SECONDS) + 1):
        snap = _poll(node, exiting={1: False})
    assert _kinds(snap) == [(RANK_DOWN_KIND, (1,), (0,))]
    for _ in range(int(STUCK) + 5):
        snap = _poll(node, exiting={1: False})
        assert _kinds(snap) == [(RANK_DOWN_KIND, (1,), (0,))]


# ---------------------------------------------------------------- a crash while a peer waits, past the grace


def test_dead_rank_stays_named_past_its_grace_while_a_peer_waits(node_factory) -> None:
    node = _node(node_factory, departed_grace=5.0)
    _steady(node)
    _hang(node)
    node.workers[1].close()  # rank 1 is SIGKILLed: no more snapshots, its worker socket refuses
    for _ in range(30):  # far past its 5 s of grace
        snap = _poll(node, dead=(1,))
    assert _kinds(snap) == [(RANK_DOWN_KIND, (1,), (0,))]
    assert "Rank 1 (host node-a, pid 100001) is down (process gone" in snap.verdicts[0].summary
    (down,) = [r for r in snap.ranks if r.rank == 1]
    assert not down.exited
    # Once nobody waits, the grace is over: it goes.
    node.rings[0][-1]["retired"] = True
    snap = _poll(node, dead=(1,))
    assert [r.rank for r in snap.ranks] == [0] and snap.verdicts == ()


def test_the_hold_ends_with_the_waited_collectives_watchdog_timeout(node_factory) -> None:
    node = _node(node_factory, departed_grace=5.0)
    _steady(node)
    node.rings[0].append(raw(HUNG_SEQ, HUNG_SEQ, created=node.now, retired=False, timeout_ms=20_000))
    _poll(node, exiting={1: True})
    held = 0
    for _ in range(40):
        snap = _poll(node, exiting={1: True})
        if any(r.rank == 1 for r in snap.ranks):
            held += 1
    # Held for the 20 s watchdog timeout of the wait (it is longer than the 5 s grace), then dropped.
    assert 18 <= held <= 21, held
    assert [r.rank for r in snap.ranks] == [0]


# ---------------------------------------------------------------- the pure rule


def _departed(r: int, *pgs: Any) -> RankState:
    return rank(r, *pgs, status=RANK_DOWN, heartbeat_age=3.0, socket_alive=False)


def test_held_names_the_waiters_of_a_collective_the_departed_rank_never_completed() -> None:
    world = (0, 1, 2)
    waiters = [rank(r, waiting("0", world, HUNG_SEQ, age=10.0, desc="default_pg"), heartbeat_age=0.5)
               for r in (0, 2)]
    gone = _departed(1, idle("0", world, HUNG_SEQ - 1, desc="default_pg"))
    hold = liveness.held(gone, final=True, peers=waiters)
    assert hold is not None
    assert (hold.waiters, hold.pg, hold.seq, hold.op, hold.timeout) == ((0, 2), "0", HUNG_SEQ, "all_reduce", 600.0)
    # It completed #11 (its counters are final): nobody waits for it.
    assert liveness.held(_departed(1, idle("0", world, HUNG_SEQ)), final=True, peers=waiters) is None
    # Another job's ranks, or a PG it is not a member of, never hold it.
    assert liveness.held(_departed(1, idle("0", world, HUNG_SEQ - 1)), final=True,
                         peers=[rank(0, waiting("0", world, HUNG_SEQ, 10.0), job="other")]) is None
    assert liveness.held(_departed(1, idle("0", (1, 3), HUNG_SEQ - 1)), final=True,
                         peers=[rank(0, waiting("0", (0, 2), HUNG_SEQ, 10.0))]) is None
    # Counters not final (a crash, an older recorder's goodbye; or it entered #11 and left): only a waiter seen
    # still waiting EXIT_EVIDENCE_SECONDS after its last word (3 s ago) holds it.
    def seen(age: float) -> list[RankState]:
        return [rank(0, waiting("0", world, HUNG_SEQ, 10.0), heartbeat_age=age)]

    assert liveness.held(gone, final=False, peers=seen(3.0 - liveness.EXIT_EVIDENCE_SECONDS + 0.1)) is None
    assert liveness.held(gone, final=False, peers=seen(3.0 - liveness.EXIT_EVIDENCE_SECONDS)) is not None
    entered = _departed(1, pg("0", world, HUNG_SEQ, HUNG_SEQ - 1))
    assert liveness.held(entered, final=True, peers=seen(2.0)) is None
    assert liveness.held(entered, final=True, peers=seen(0.0)) is not None
    # A peer wedged in the wait (its snapshot stale) counts by the deep read that showed it waiting.
    wedged = replace(seen(30.0)[0], status=RANK_UNRESPONSIVE)
    assert liveness.held(gone, final=False, peers=[wedged]) is None
    assert liveness.held(gone, final=False, peers=[replace(wedged, last_deep_read=NOW)]) is not None
    inexact = replace(wedged, pgs=tuple(replace(p, exact=False) for p in wedged.pgs), last_deep_read=NOW)
    assert liveness.held(gone, final=False, peers=[inexact]) is not None
    assert liveness.held(gone, final=False, peers=[replace(wedged, status=RANK_DOWN)]) is None  # not a waiter


def test_engine_phrases_an_exited_culprit() -> None:
    world = (0, 1, 2)
    waiters = [rank(r, waiting("0", world, HUNG_SEQ, age=10.0, desc="default_pg")) for r in (0, 2)]
    gone = _departed(1, idle("0", world, HUNG_SEQ - 1, desc="default_pg"))
    gone = replace(gone, exited=True)
    (v,) = evaluate([*waiters, gone], NOW, VerdictConfig(stuck_after=60.0))
    assert (v.kind, v.ranks, v.waiting_ranks) == (RANK_DOWN_KIND, (1,), (0, 2))
    assert v.summary.startswith("Rank 1 (host node0, pid 1001) exited while ranks 0,2 wait in all_reduce #11 on "
                                "PG 'default_pg' (0)"), v.summary
    # Without it, rank 1 gone from the view: the waiters are "stalled", the wrong ranks named.
    (wrong,) = evaluate(waiters, NOW, VerdictConfig(stuck_after=5.0))
    assert (wrong.kind, wrong.ranks) == (STALLED, (0, 2))


# ---------------------------------------------------------------- a spool the ranks cannot write to


class FakeStatvfs:
    """``os.statvfs`` of the spool's filesystem, as the test sets it."""

    def __init__(self, free_bytes: int, free_inodes: int = 100_000, inodes: int = 1_000_000) -> None:
        self.free_bytes, self.free_inodes, self.inodes = free_bytes, free_inodes, inodes
        self.calls = 0

    def __call__(self, path: Any) -> os.statvfs_result:
        self.calls += 1
        # (bsize, frsize, blocks, bfree, bavail, files, ffree, favail, flag, namemax)
        return os.statvfs_result((4096, 1024, 10 << 20, self.free_bytes // 1024 + 100, self.free_bytes // 1024,
                                  self.inodes, self.free_inodes, self.free_inodes, 0, 255))


def test_full_spool_is_counted_and_said_where_the_operator_looks(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    spool.ensure_dir(str(tmp_path))
    statvfs = FakeStatvfs(free_bytes=512 << 20)
    now = [NOW]
    source = RanksSource(RanksConfig(directory=str(tmp_path)), clock=lambda: now[0], statvfs=statvfs)
    exporter = Exporter([(source, 1.0)], clock=lambda: now[0], hostname="node-a", analyzer=make_analyzer())
    try:
        snap = exporter.poll_once()
        assert statvfs.calls == 1 and reasons.SPOOL_FULL not in snap.sources[0].errors_total
        statvfs.free_bytes = 4096  # the filesystem fills up: a rank's manifest and snapshot no longer fit
        for _ in range(3):
            now[0] += 1
            snap = exporter.poll_once()
        (ranks,) = snap.sources
        assert ranks.up and ranks.errors_total[reasons.SPOOL_FULL] == 3  # once per poll while it lasts
        assert "4096 bytes free" in ranks.last_error and "enospc" in ranks.last_error
        parsed = render(snap)
        assert sample(parsed, n.SOURCE_ERRORS_TOTAL, source="ranks", reason=reasons.SPOOL_FULL) == 3
        (listed,) = status_json(snap)["sources"]
        assert listed["errors_total"][reasons.SPOOL_FULL] == 3 and "bytes free" in listed["last_error"]
        assert sum("spool" in r.getMessage() and "full" in r.getMessage() for r in caplog.records) == 1
        statvfs.free_bytes, statvfs.free_inodes = 512 << 20, 3  # out of inodes is as full
        now[0] += 1
        assert exporter.poll_once().sources[0].errors_total[reasons.SPOOL_FULL] == 4
        statvfs.free_inodes = 100_000
        now[0] += 1
        assert exporter.poll_once().sources[0].errors_total[reasons.SPOOL_FULL] == 4  # room again: no more
        statvfs.inodes = statvfs.free_inodes = 0  # a filesystem without an inode count (btrfs) is not full
        now[0] += 1
        assert exporter.poll_once().sources[0].errors_total[reasons.SPOOL_FULL] == 4
    finally:
        exporter.stop()


def test_a_rank_on_a_full_spool_never_appears_but_the_exporter_says_why(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # ENOSPC simulated where CI cannot mount a small filesystem: every spool write of the recorder fails as on a
    # full disk, and the exporter reads the filesystem's free space through an injected statvfs.
    directory = tmp_path / "spool"
    spool.ensure_dir(str(directory))

    def full(*args: Any, **kw: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(spool, "write_json_atomic", full)
    monkeypatch.setattr(spool.SnapshotMap, "write", full)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    publisher = Publisher(str(directory), "job", 0.2)
    publisher.publish_starting()
    publisher.tick()  # no torch.distributed in this process: the starting heartbeat, which fails too
    assert publisher.errors.get(reasons.STARTING_MANIFEST) == 1  # the rank trains on and counts it
    assert os.listdir(directory) == []  # nothing reached the spool
    statvfs = FakeStatvfs(free_bytes=0, free_inodes=0)
    source = RanksSource(RanksConfig(directory=str(directory)), statvfs=statvfs)
    try:
        reading = source.collect()
        assert reading.ranks == ()
        assert [r for r, _ in reading.problems] == [reasons.SPOOL_FULL]
    finally:
        source.close()


def test_space_rule() -> None:
    def st(free_bytes: int, free_inodes: int, inodes: int = 1000) -> os.statvfs_result:
        return FakeStatvfs(free_bytes, free_inodes, inodes)("/")

    assert spool_space.shortage(st(512 << 20, 1000)) is None
    assert spool_space.shortage(st(spool_space.MIN_FREE_BYTES, spool_space.MIN_FREE_INODES)) is None
    low = spool_space.shortage(st(spool_space.MIN_FREE_BYTES - 1024, 1000))
    assert low is not None and f"{spool_space.MIN_FREE_BYTES - 1024} bytes free" in low
    assert spool_space.shortage(st(512 << 20, spool_space.MIN_FREE_INODES - 1)) is not None
    assert spool_space.shortage(st(512 << 20, 0, inodes=0)) is None


def test_hold_bound() -> None:
    hold = liveness.Hold(waiters=(0,), pg="0", seq=HUNG_SEQ, op="all_reduce", timeout=600.0)
    left = liveness.Liveness(status=RANK_DOWN, departed_at=100.0)
    assert liveness.holds(left, hold, 100.0 + 600.0, departed_grace=300.0)
    assert not liveness.holds(left, hold, 100.0 + 600.1, departed_grace=300.0)
    unknown = liveness.Hold(waiters=(0,), pg="0", seq=HUNG_SEQ, op="", timeout=None)
    assert liveness.holds(left, unknown, 100.0 + 300.0, departed_grace=300.0)
    assert not liveness.holds(left, unknown, 100.0 + 300.1, departed_grace=300.0)
    assert not liveness.holds(left, None, 100.0, departed_grace=300.0)  # nobody waits: not held at all
