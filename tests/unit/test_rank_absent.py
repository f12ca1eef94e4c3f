"""No rank unseen: ranks publish before their process group, and the ones that never do are named.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_rank_absent.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from frexporter import spool
from frexporter.analysis.absent import find_absent
from frexporter.analysis.kinds import RANK_ABSENT
from frexporter.model import RANK_DOWN, RANK_OK, InflightCollective, PGState, RankState
from frexporter.recorder.environment import launcher_facts
from frexporter.recorder.publisher import Publisher
from frexporter.sources.ranks import RanksConfig, RanksSource

STUCK = 2.0


# ---------------------------------------------------------------- the launcher's facts, bad input


def _manifest(tmp: Path, launcher: object, **extra: object) -> None:
    spool.ensure_dir(str(tmp))
    body = {"format": spool.MANIFEST_FORMAT, "job_id": "j", "rank": 2, "pid": os.getpid(), "start_time": 1.0,
            "state": "starting", "launcher": launcher, **extra}
    (tmp / ("j-rank2" + spool.MANIFEST_SUFFIX)).write_text(json.dumps(body))
    os.chmod(tmp / ("j-rank2" + spool.MANIFEST_SUFFIX), 0o600)


@pytest.mark.parametrize(("launcher", "reason"), [
    ({"rank": 2, "local_rank": 2, "local_world_size": "four"}, spool.LAUNCHER_INVALID),
    ({"rank": 2, "local_rank": 2, "local_world_size": True}, spool.LAUNCHER_INVALID),
    ({"rank": 2, "local_rank": 2, "local_world_size": -4}, spool.LAUNCHER_INVALID),
    ({"rank": 2, "local_rank": 2, "run_id": "x" * (spool.MAX_TEXT_CHARS + 1)}, spool.LIMIT_TEXT),
    ({"rank": 2, "local_rank": 2, "run_id": "caf\udce9"}, spool.LAUNCHER_INVALID),
    ({"rank": 2, "local_rank": 2, "run_id": 7}, spool.LAUNCHER_INVALID),
    ("RANK=2", spool.LAUNCHER_INVALID),
    ({f"k{i}": i for i in range(spool.MAX_LAUNCHER_FIELDS + 1)}, spool.LIMIT_ITEMS),
])
def test_bad_launcher_field_is_dropped_and_counted_never_the_rank(tmp_path: Path, launcher: object,
                                                                  reason: str) -> None:
    _manifest(tmp_path, launcher)
    source = RanksSource(RanksConfig(directory=str(tmp_path)))
    try:
        reading = source.collect()
        (rank,) = reading.ranks
        assert rank.rank == 2 and rank.state == "starting"
        assert reason in [r for r, _ in reading.problems], reading.problems
        again = source.collect()  # the same file again: counted once, not once per poll
        assert again.ranks == reading.ranks and reason not in [r for r, _ in again.problems]
    finally:
        source.close()


def test_missing_launcher_is_no_error_and_old_manifests_read_as_running(tmp_path: Path) -> None:
    parsed = spool.parse_manifest({"format": spool.MANIFEST_FORMAT, "job_id": "j", "rank": 0, "pid": 1})
    assert parsed.state == spool.STATE_RUNNING and parsed.launcher is None and parsed.problems == ()
    with pytest.raises(spool.SpoolError):
        spool.parse_manifest({"format": spool.MANIFEST_FORMAT, "job_id": "j", "rank": 0, "pid": 1, "state": "x"})


def test_launcher_facts_from_torchrun_and_slurm_environments() -> None:
    errors: list[str] = []

    def count(reason: str, exc: BaseException) -> None:
        errors.append(reason)

    torchrun = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
                "TORCHELASTIC_RUN_ID": "r1", "SLURM_PROCID": "0"}
    facts = launcher_facts(torchrun, count)
    assert facts == {"kind": "torchelastic", "rank": 5, "local_rank": 1, "world_size": 8, "local_world_size": 4,
                     "node_rank": 1, "run_id": "r1"}
    assert spool.parse_launcher(facts, "m")[0].node_ranks() == (4, 5, 6, 7)
    slurm = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2(x2)",
             "SLURM_NODEID": "1", "SLURM_JOB_ID": "77"}
    facts = launcher_facts(slurm, count)
    assert facts["kind"] == "slurm" and facts["local_world_size"] == 2
    assert spool.parse_launcher(facts, "m")[0].node_ranks() == (2, 3)
    bad = launcher_facts({"RANK": "0", "LOCAL_RANK": "zero", "TORCHELASTIC_RUN_ID": "x\udcff"}, count)
    assert bad == {"kind": "torchelastic", "rank": 0} and errors == ["launcher_env", "launcher_env"]
    assert launcher_facts({}, count) == {}


# ---------------------------------------------------------------- the recorder before init_process_group

TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0",
            "TORCHELASTIC_RUN_ID": "run-7"}


def test_install_publishes_a_starting_rank_the_exporter_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    spool.ensure_dir(str(tmp_path))
    publisher = Publisher(str(tmp_path), "j", 1.0)
    publisher.publish_starting()  # what start() does before its thread runs
    try:
        stem = spool.rank_stem("j", 3)
        manifest = spool.parse_manifest(json.loads((tmp_path / (stem + spool.MANIFEST_SUFFIX)).read_text()))
        assert (manifest.rank, manifest.state, manifest.world_size, manifest.process_groups) == (
            3, spool.STATE_STARTING, 8, ())
        assert manifest.launcher is not None and manifest.launcher.node_ranks() == (2, 3, 4, 5)
        assert manifest.launcher.run_id == "run-7" and manifest.launcher.kind == "torchelastic"
        snap = spool.parse_snapshot(spool.read_snapshot_map(str(tmp_path / (stem + spool.SNAPSHOT_MAP_SUFFIX))))
        assert snap.state == spool.STATE_STARTING and snap.pid == os.getpid()
        source = RanksSource(RanksConfig(directory=str(tmp_path)))
        try:
            (rank,) = source.collect().ranks
            assert (rank.rank, rank.status, rank.state, rank.node_ranks) == (3, RANK_OK, "starting", (2, 3, 4, 5))
        finally:
            source.close()
    finally:
        publisher.stop()


def test_a_process_inheriting_a_live_ranks_environment_does_not_take_its_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    spool.ensure_dir(str(tmp_path))
    path = tmp_path / (spool.rank_stem("j", 3) + spool.MANIFEST_SUFFIX)
    owner = json.dumps({"format": spool.MANIFEST_FORMAT, "job_id": "j", "rank": 3, "pid": os.getppid()})
    path.write_text(owner)  # the rank itself, alive: this process is, say, its spawned DataLoader worker
    publisher = Publisher(str(tmp_path), "j", 1.0)
    publisher.publish_starting()
    publisher.stop()
    assert path.read_text() == owner
    assert not (tmp_path / (spool.rank_stem("j", 3) + spool.SNAPSHOT_MAP_SUFFIX)).exists()


# ---------------------------------------------------------------- the verdict (pure)


def _rank(rank: int, state: str = "running", start: float = 100.0, status: str = RANK_OK,
          pgs: tuple[PGState, ...] = ()) -> RankState:
    return RankState(job_id="j", rank=rank, local_rank=rank, world_size=8, hostname="h", pid=rank + 10,
                     torch_version="", gpu_uuid="", status=status, heartbeat=None, heartbeat_age=None,
                     socket_alive=None, pgs=pgs, state=state, start_time=start, node_ranks=(0, 1, 2, 3))


def _pg(ranks: tuple[int, ...], created: float | None) -> PGState:
    inflight = (InflightCollective(seq=4, op="allreduce", created=created, timeout_seconds=600.0),) \
        if created is not None else ()
    return PGState(name="0", desc="default_pg", ranks=ranks, backend="gloo", last_enqueued=4 if inflight else 3,
                   last_started=3, last_completed=3, inflight=inflight, inflight_count=len(inflight),
                   timeout_seconds=600.0, last_progress=50.0, exact=True, has_p2p=False)


def test_absent_rank_in_the_rendezvous_names_it_and_its_waiters() -> None:
    ranks = [_rank(0, "starting"), _rank(2, "starting"), _rank(3, "starting", status=RANK_DOWN)]
    assert find_absent(ranks, 100.0 + STUCK - 0.1, STUCK) == []  # not yet stuck_after
    (v,) = find_absent(ranks, 130.0, STUCK)
    assert v.kind == RANK_ABSENT and v.ranks == (1,) and v.waiting_ranks == (0, 2)
    assert v.since == 100.0 and v.age_seconds == 30.0 and "Rank 1" in v.summary


def test_absent_rank_of_a_blocked_collective_and_no_verdict_without_a_wait() -> None:
    world = (0, 1, 2, 3, 4, 5, 6, 7)
    blocked = [_rank(r, pgs=(_pg(world, 110.0),)) for r in (0, 1, 2)]
    (v,) = find_absent(blocked, 130.0, STUCK)
    assert v.ranks == (3,) and v.waiting_ranks == (0, 1, 2) and v.details["waiting_in"] == ["a collective"]
    # Rank 3 gone (exited cleanly, say) while the others are not waiting on anything: no hang, no verdict.
    idle = [_rank(r, pgs=(_pg(world, None),)) for r in (0, 1, 2)]
    assert find_absent(idle, 130.0, STUCK) == []
    # Waiting in a PG that does not include the absent rank: not waiting for it.
    assert find_absent([_rank(r, pgs=(_pg((0, 1, 2), 110.0),)) for r in (0, 1, 2)], 130.0, STUCK) == []
