"""Wall-clock jumps (NTP steps, VM resume) neither age collectives falsely nor make ranks look stale."""

from __future__ import annotations

from pathlib import Path

from frexporter import spool
from frexporter.analysis import VerdictConfig, make_analyzer
from frexporter.exporter import Exporter
from frexporter.model import RANK_OK
from frexporter.sources.ranks import RanksConfig, RanksSource
from tests import spoolgen
from tests.fakes.node import T0, Node, raw


class Clocks:
    def __init__(self) -> None:
        self.wall = T0 + 100.0
        self.mono = 1000.0


def test_forward_jump_does_not_turn_a_young_wait_into_a_verdict(tmp_path: Path) -> None:
    clocks = Clocks()
    node = Node(tmp_path / "n", 2)
    try:
        # Rank 0 entered all_reduce #2 at T0+100; rank 1 has not (yet).
        node.rings[0] = [raw(0, 1), raw(1, 2, created=T0 + 100.0, retired=False)]
        node.rings[1] = [raw(0, 1)]
        node.source.close()
        node.source = RanksSource(RanksConfig(str(node.dir), poll_interval=1.0, rank_timeout=2.0, deep_interval=0.0),
                                  clock=lambda: clocks.wall, monotonic=lambda: clocks.mono)
        node.exporter = Exporter([(node.source, 1.0)], clock=lambda: clocks.wall, monotonic=lambda: clocks.mono,
                                 hostname="node-a",
                                 analyzer=make_analyzer(VerdictConfig(stuck_after=60.0)))

        counter = 0

        def poll(wall_step: float, mono_step: float):
            nonlocal counter
            clocks.wall += wall_step
            clocks.mono += mono_step
            counter += 1
            for r in (0, 1):
                # The ranks' own pg_status: rank 0 has #2 in flight, rank 1 finished #1.
                status = {"0": {"last_enqueued_collective": 2 - r, "last_started_collective": -1,
                                "last_completed_collective": 1}}
                snap = spoolgen.snapshot(node.pids[r], counter=counter, when=clocks.wall, status={"fr": status})
                spool.write_json_atomic(str(node.dir / (spool.rank_stem("job", r) + spool.SNAPSHOT_SUFFIX)), snap)
            return node.exporter.poll_once()

        snap = poll(2.0, 2.0)
        pg = next(p for p in snap.ranks[0].pgs if p.name == "0")
        assert abs((snap.time - pg.oldest_inflight.created) - 2.0) < 0.01
        snap = poll(3600.0, 1.0)  # the wall clock steps an hour forward; one real second passed
        assert snap.verdicts == ()
        assert all(r.status == RANK_OK for r in snap.ranks)
        pg = next(p for p in snap.ranks[0].pgs if p.name == "0")
        assert abs((snap.time - pg.oldest_inflight.created) - 3.0) < 0.01  # the real age, not an hour
        snap = poll(-1800.0, 1.0)  # and back half an hour: ages never go backwards either
        pg = next(p for p in snap.ranks[0].pgs if p.name == "0")
        assert abs((snap.time - pg.oldest_inflight.created) - 4.0) < 0.01
        for _ in range(60):
            snap = poll(1.0, 1.0)
        (v,) = snap.verdicts  # after a real minute it is a verdict
        assert (v.kind, v.ranks, v.seq) == ("missing_rank", (1,), 2)
    finally:
        node.close()
