"""A PG with send/recv traffic between deep reads: no phantom in-flight wait once the rank moved on."""

from __future__ import annotations

from pathlib import Path

from frexporter import spool
from frexporter.sources.ranks import RanksConfig, RanksSource
from tests import spoolgen
from tests.fakes.node import T0, FakeWorker, raw


def test_inflight_from_an_old_deep_read_is_dropped_once_the_rank_completes_more(tmp_path: Path) -> None:
    clock = [T0 + 10.0]
    stem = spool.rank_stem("job", 0)
    sock = str(tmp_path / spool.socket_name(stem))
    spool.write_json_atomic(str(tmp_path / (stem + spool.MANIFEST_SUFFIX)),
                            spoolgen.manifest("job", 0, world=1, socket=spool.socket_name(stem)))
    # gloo: op_id 2 went to a send (not recorded); collective #2 is op 3 and in flight at the deep read.
    ring = [raw(0, 1), {**raw(1, 2, created=T0 + 9.0, retired=False), "op_id": 3}]
    worker = FakeWorker(sock, lambda: {"version": "2.10", "entries": ring, "pg_status": {
        "0": {"last_enqueued_collective": 3, "last_started_collective": -1, "last_completed_collective": 1}}})
    source = RanksSource(RanksConfig(str(tmp_path), poll_interval=1.0, deep_interval=1000.0), clock=lambda: clock[0])

    def poll(enqueued: int, completed: int, counter: int):
        clock[0] += 1.0
        status = {"fr": {"0": {"last_enqueued_collective": enqueued, "last_started_collective": -1,
                                "last_completed_collective": completed}}}
        spool.write_json_atomic(str(tmp_path / (stem + spool.SNAPSHOT_SUFFIX)),
                                spoolgen.snapshot(100000, counter=counter, when=clock[0], status=status))
        (rank,) = source.collect().ranks
        return next(pg for pg in rank.pgs if pg.name == "0")

    try:
        pg = poll(3, 1, 1)
        assert (pg.last_enqueued, pg.last_completed, pg.has_p2p) == (2, 1, True)
        assert pg.oldest_inflight is not None and pg.oldest_inflight.seq == 2
        pg = poll(3, 1, 2)  # no progress yet: still the same wait, as read
        assert pg.oldest_inflight is not None
        pg = poll(9, 9, 3)  # the rank went on (more sends and collectives); no new deep read yet
        assert pg.oldest_inflight is None and pg.inflight_count == 0 and not pg.exact
    finally:
        source.close()
        worker.close()
