"""The core contract on real gloo jobs: exact collective-domain progress per rank and PG."""

from __future__ import annotations

import json

from frexporter import naming as n
from frexporter.model import RANK_DOWN, RANK_OK, RANK_UNRESPONSIVE
from tests.harness import metrics, sample, wait_for


def pg_values(exp, rank: int) -> dict[str, tuple[str, int, int, int]]:
    state = exp.rank(rank)
    if state is None:
        return {}
    return {pg.desc: (pg.name, pg.last_enqueued, pg.last_completed, pg.inflight_count) for pg in state.pgs}


def test_exact_sequences_per_rank_and_pg_with_local_sync_subgroup(job_factory, exporter_factory) -> None:
    job = job_factory("counts", 3)
    job.wait_ready()
    exp = exporter_factory(job.spool)
    expected = {
        0: {"default_pg": (5, 5, 0), "pair01": (3, 3, 0), "parity": (2, 2, 0)},
        1: {"default_pg": (5, 5, 0), "pair01": (3, 3, 0), "parity": (2, 2, 0)},
        2: {"default_pg": (5, 5, 0), "parity": (2, 2, 0)},
    }

    def seen() -> bool:
        return all({d: v[1:] for d, v in pg_values(exp, r).items()} == want for r, want in expected.items())

    wait_for(seen, timeout=20, what="exact per-rank sequences")
    names = {r: {d: v[0] for d, v in pg_values(exp, r).items()} for r in range(3)}
    # Cross-rank identity is the group name: WORLD is "0", new_group numbers, local-sync groups hash.
    assert names[0]["default_pg"] == names[1]["default_pg"] == names[2]["default_pg"] == "0"
    assert names[0]["pair01"] == names[1]["pair01"]
    assert names[0]["parity"] == names[2]["parity"] != names[1]["parity"]  # {0,2} vs {1}

    parsed = metrics(exp.get("/metrics"))
    for rank, pgs in expected.items():
        for desc, (enq, done, inflight) in pgs.items():
            pg = names[rank][desc]
            labels = {"job_id": "job", "rank": str(rank), "pg": pg, "pg_desc": desc}
            assert sample(parsed, n.PG_LAST_ENQUEUED_SEQ, **labels) == enq
            assert sample(parsed, n.PG_LAST_COMPLETED_SEQ, **labels) == done
            assert sample(parsed, n.PG_INFLIGHT_COLLECTIVES, **labels) == inflight
    # Static PG facts once per node, without a rank: two "parity" groups ({0,2} and {1}) by cross-rank name.
    assert sample(parsed, n.PG_INFO, pg=names[0]["parity"], pg_desc="parity", size="2") == 1
    assert sample(parsed, n.PG_INFO, pg=names[1]["parity"], pg_desc="parity", size="1") == 1
    assert len(parsed[n.PG_INFO]) == len({(desc, pg) for pgs in names.values() for desc, pg in pgs.items()})
    assert all(n.L_RANK not in labels for labels, _ in parsed[n.PG_INFO])
    assert sample(parsed, n.RANK_UP, job_id="job", rank="2") == 1
    assert sample(parsed, n.RANK_INFO, rank="1", world_size="3") == 1
    assert sample(parsed, n.SOURCE_UP, source="ranks") == 1
    assert n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS not in parsed or not parsed[
        n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS]


def test_send_recv_traffic_shows_no_skew(job_factory, exporter_factory) -> None:
    job = job_factory("p2p", 3)
    job.wait_ready()
    exp = exporter_factory(job.spool)

    def equal() -> bool:
        values = [pg_values(exp, r).get("default_pg") for r in range(3)]
        return all(v is not None and v[1:] == (4, 4, 0) for v in values)

    wait_for(equal, timeout=20, what="4 collectives on every rank despite send/recv")
    # torch's own counters disagree across ranks here; the exporter must not.
    assert any(pg.has_p2p for pg in exp.rank(0).pgs)
    status = json.loads(exp.get("/api/v1/status"))
    world = next(g for g in status["process_groups"] if g["pg_desc"] == "default_pg")
    assert world["enqueued_skew"] == 0


def test_rank_blocked_in_collective(job_factory, exporter_factory) -> None:
    job = job_factory("blocked", 2, env={"JOB_TIMEOUT": "120"})
    job.wait_ready()
    exp = exporter_factory(job.spool)

    def blocked():
        r0, r1 = exp.rank(0), exp.rank(1)
        pg = r0 and next((p for p in r0.pgs if p.desc == "default_pg"), None)
        # Rank 1's recorder publishes on its own schedule: wait for its state too before reading /metrics.
        idle = r1 and next((p for p in r1.pgs if p.desc == "default_pg" and p.last_completed == 3), None)
        return pg if idle and pg and pg.inflight_count == 1 and pg.oldest_inflight is not None else None

    pg = wait_for(blocked, timeout=20, what="rank 0 in flight and rank 1 idle after 3 collectives")
    assert (pg.last_enqueued, pg.last_completed) == (4, 3)
    assert pg.oldest_inflight.op == "all_reduce" and pg.oldest_inflight.seq == 4
    assert pg.timeout_seconds == 120
    parsed = metrics(exp.get("/metrics"))
    labels = {"rank": "0", "pg_desc": "default_pg"}
    start = sample(parsed, n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS, **labels)
    assert start is not None and abs(start - pg.oldest_inflight.created) < 1e-3
    assert sample(parsed, n.PG_TIMEOUT_SECONDS, pg_desc="default_pg") == 120
    assert all(n.L_RANK not in labels for labels, _ in parsed[n.PG_TIMEOUT_SECONDS])
    assert sample(parsed, n.PG_INFLIGHT_COLLECTIVES, **labels) == 1
    assert sample(parsed, n.PG_INFLIGHT_COLLECTIVES, rank="1", pg_desc="default_pg") == 0
    assert sample(parsed, n.PG_LAST_COMPLETED_SEQ, rank="1", pg_desc="default_pg") == 3


def test_rank_holding_the_gil_is_still_exported(job_factory, exporter_factory) -> None:
    job = job_factory("gil", 2, env={"JOB_GIL_SECONDS": "8"})
    job.wait_ready()
    exp = exporter_factory(job.spool)
    # Parked after its collectives, the rank samples its own stack (it makes no progress): wedge it after that.
    wait_for(lambda: exp.rank(0) and exp.rank(0).status == RANK_OK and exp.rank(0).pgs
             and exp.rank(0).activity.frames, timeout=20, what="rank 0 healthy, with its own stack sampled")
    job.touch("wedge")
    job.wait_ready("wedged", ranks=[0], timeout=20)
    state = wait_for(lambda: exp.rank(0) if exp.rank(0).status == RANK_UNRESPONSIVE else None, timeout=6,
                     what="rank 0 unresponsive while its main thread holds the GIL")
    assert state.up and state.socket_alive
    # It cannot sample itself: its activity is wedged, with the last stack it sampled (in the wait loop
    # or the C call's caller, both in the rank's script).
    assert state.activity.state == "wedged"
    assert any(f[1].endswith("job.py") for f in state.activity.frames), state.activity.frames
    world = next(p for p in state.pgs if p.desc == "default_pg")
    assert (world.last_enqueued, world.last_completed) == (2, 2)
    # The worker server answered from C++ while Python was wedged: a deep read happened during the wedge.
    wedged_at = job.marker(0, "wedged").stat().st_mtime
    wait_for(lambda: (exp.rank(0).last_deep_read or 0) > wedged_at, timeout=5, what="deep read during wedge")
    parsed = metrics(exp.get("/metrics"))
    assert sample(parsed, n.RANK_UP, rank="0") == 1
    heartbeat = sample(parsed, n.RANK_HEARTBEAT_TIMESTAMP_SECONDS, rank="0")
    assert heartbeat is not None and exp.snapshot.time - heartbeat > 1.0
    assert sample(parsed, n.PG_LAST_COMPLETED_SEQ, rank="0", pg_desc="default_pg") == 2
    job.wait_ready("unwedged", ranks=[0], timeout=20)
    wait_for(lambda: exp.rank(0).status == RANK_OK, timeout=10, what="rank 0 fresh again")


def test_sigkilled_rank_is_down(job_factory, exporter_factory) -> None:
    job = job_factory("kill", 2)
    job.wait_ready()
    exp = exporter_factory(job.spool)
    wait_for(lambda: exp.rank(1) and exp.rank(1).status == RANK_OK, timeout=20, what="rank 1 seen alive")
    job.touch("kill")
    wait_for(lambda: job.procs[1].poll() is not None, timeout=20, what="rank 1 killed")
    wait_for(lambda: exp.rank(1) and exp.rank(1).status == RANK_DOWN, timeout=10, what="rank 1 down")
    parsed = metrics(exp.get("/metrics"))
    assert sample(parsed, n.RANK_UP, rank="1") == 0
    assert sample(parsed, n.RANK_UP, rank="0") == 1
    status = json.loads(exp.get("/api/v1/status"))
    assert {r["rank"]: r["up"] for r in status["ranks"]} == {0: True, 1: False}
