"""Verdicts on real gloo jobs: in the API, as series, on the page, logged once, with evidence analyze can read."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from frexporter import naming as n
from frexporter.app import ServeConfig, build_app
from frexporter.model import NodeSnapshot
from tests.harness import REPO, metrics, sample, wait_for


def test_missing_rank_verdict_everywhere_with_evidence(job_factory, exporter_factory,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="frexporter")
    job = job_factory("blocked", 2, env={"JOB_TIMEOUT": "120"})
    job.wait_ready()
    exp = exporter_factory(job.spool, stuck_after=2.0)
    verdicts = wait_for(lambda: exp.snapshot.verdicts, timeout=20, what="a verdict")
    (v,) = verdicts
    assert (v.kind, v.pg, v.pg_desc, v.ranks, v.waiting_ranks, v.seq, v.op) == (
        "missing_rank", "0", "default_pg", (1,), (0,), 4, "all_reduce")
    assert v.timeout_seconds == 120 and 0 < v.budget_used < 0.5
    assert v.summary.startswith("Rank 1 never joined all_reduce #4 on PG 'default_pg' (0); rank 0 has waited")

    status = json.loads(exp.get("/api/v1/status"))
    (api,) = status["verdicts"]
    assert {k: api[k] for k in ("kind", "pg", "ranks", "waiting_ranks", "seq", "op")} == {
        "kind": "missing_rank", "pg": "0", "ranks": [1], "waiting_ranks": [0], "seq": 4, "op": "all_reduce"}
    assert {"since", "age_seconds", "timeout_seconds", "summary", "job_id", "pg_desc"} <= set(api)
    parsed = metrics(exp.get("/metrics"))
    assert sample(parsed, n.VERDICT, job_id="job", pg="0", rank="1", kind="missing_rank", op="all_reduce",
                  seq="4") == 1
    assert len(parsed[n.VERDICT]) == 1  # one series per culprit, none for the waiting rank
    # The waits the rules read: the waiting rank's, on the seq it waits on, with its PG's limits; none for the
    # culprit, which waits in nothing.
    assert [labels["rank"] for labels, _ in parsed[n.PG_WAIT_START_TIMESTAMP_SECONDS]] == ["0"]
    assert sample(parsed, n.PG_WAIT_SEQ, job_id="job", pg="0", rank="0") == 4
    assert sample(parsed, n.PG_WAIT_GROUP_SIZE, job_id="job", pg="0", rank="0") == 2
    limits = {labels[n.L_LIMIT]: value for labels, value in parsed[n.PG_WAIT_LIMIT_SECONDS]}
    assert limits[n.WAIT_LIMIT_TIMEOUT] == 120 and 0 < limits[n.WAIT_LIMIT_STUCK] <= limits[n.WAIT_LIMIT_CEILING] == 2
    assert "Rank 1 never joined" in exp.get("/")

    bundle_root = job.spool / "evidence"
    bundle = wait_for(lambda: next(bundle_root.glob("*/verdict.json"), None) if bundle_root.exists() else None,
                      timeout=20, what="evidence bundle").parent
    files = sorted(p.name for p in bundle.iterdir())
    # The recorders the ranks' PGs use, as their snapshots read them: gloo's generic one only, on a CPU build and
    # on a CUDA build alike (whose torch also offers an NCCL recorder, empty in a gloo job: never saved).
    assert files == ["fr_rank0.json", "fr_rank1.json", "verdict.json"]
    assert (bundle.stat().st_mode & 0o777) == 0o700
    out = subprocess.run([sys.executable, "-m", "frexporter", "analyze", str(bundle), "--json"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    (post,) = json.loads(out.stdout)
    assert (post["kind"], post["ranks"], post["seq"], post["job_id"]) == ("missing_rank", [1], 4, "job")

    appeared = [r for r in caplog.records
                if r.name == "frexporter.outputs.verdict_events" and "never joined" in r.getMessage()]
    assert len(appeared) == 1  # logged once, not once per poll
    job.touch("stop")
    wait_for(lambda: not exp.snapshot.verdicts, timeout=20, what="verdict cleared after the job ended")
    wait_for(lambda: any("verdict cleared" in r.getMessage() for r in caplog.records), timeout=5)


def test_healthy_job_with_skew_below_threshold_has_no_verdict(job_factory) -> None:
    job = job_factory("p2p", 3)
    job.wait_ready()
    stuck_after, poll_interval, rank_timeout = 2.0, 0.2, 1.0
    observe = 2 * stuck_after  # long enough for a false stall to become a verdict, twice over
    app = build_app(ServeConfig(directory=str(job.spool), port=0, poll_interval=poll_interval,
                                rank_timeout=rank_timeout, sources=(n.SOURCE_RANKS,), deep_interval=1.0,
                                stuck_after=stuck_after, evidence_dir=""))
    polls: list[NodeSnapshot] = []
    app.exporter.poll_listeners.append(polls.append)  # every poll from the first, not only the latest

    def observed() -> float:
        times = [snap.time for snap in polls if len(snap.ranks) == job.world]
        return times[-1] - times[0] if times else 0.0

    app.start()
    try:
        # The window, plus a few polls to see every rank, each allowed its whole rank timeout.
        wait_for(lambda: observed() >= observe, timeout=observe + 10 * (poll_interval + rank_timeout),
                 what=f"{observe:g} s of polls that see all {job.world} ranks")
    finally:
        app.stop()
    assert len(polls) >= observe / (poll_interval + rank_timeout)
    with_verdicts = [(snap.time, snap.verdicts) for snap in polls if snap.verdicts]
    assert with_verdicts == [], f"{len(with_verdicts)} of {len(polls)} polls had a verdict"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_demo_finds_the_culprit_and_cleans_up() -> None:
    before = set(os.listdir(tempfile.gettempdir()))
    # In a session of its own: the demo's ranks inherit its process group, which names exactly this run's
    # processes (a pattern match on command lines would see other runs' demos too).
    demo = subprocess.Popen([sys.executable, "-m", "frexporter", "demo"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                            start_new_session=True)
    try:
        stdout, stderr = demo.communicate(timeout=90)
        assert demo.returncode == 0, stdout + stderr
        assert "VERDICT" in stdout and "culprit rank(s) 3" in stdout and "done: culprit found" in stdout
        assert "culprit activity: rank 3 " in stdout  # what the culprit is doing, from its sampled stack
        leftovers = {p for p in set(os.listdir(tempfile.gettempdir())) - before if p.startswith("frexporter-demo")}
        assert leftovers == set()
        assert not _group_alive(demo.pid), "a process of the demo outlived it"
    finally:
        if _group_alive(demo.pid):
            os.killpg(demo.pid, signal.SIGKILL)
        demo.wait(timeout=10)


def test_exporter_restarted_during_a_hang_has_the_verdict_back_within_two_polls(job_factory,
                                                                                  exporter_factory) -> None:
    job = job_factory("blocked", 2, env={"JOB_TIMEOUT": "120"})
    job.wait_ready()
    first = exporter_factory(job.spool, stuck_after=2.0)
    wait_for(lambda: first.snapshot.verdicts, timeout=20, what="a verdict")
    first.app.stop()

    app = build_app(ServeConfig(directory=str(job.spool), port=0, poll_interval=0.2, rank_timeout=1.0,
                                sources=(n.SOURCE_RANKS,), stuck_after=2.0, evidence_dir=""))
    verdicts_per_poll: list[tuple] = []
    app.exporter.poll_listeners.append(lambda snap: verdicts_per_poll.append(snap.verdicts))
    app.start()
    try:
        wait_for(lambda: len(verdicts_per_poll) >= 2, timeout=10, what="two polls")
    finally:
        app.stop()
    # The rank's FR entries carry their creation times, so the age is known from the first deep read on.
    first_with = next(i for i, v in enumerate(verdicts_per_poll) if v)
    assert first_with < 2, verdicts_per_poll[:3]
    assert verdicts_per_poll[first_with][0].ranks == (1,)


@pytest.mark.parametrize(("mode", "state", "function"), [("busy", "busy", "culprit_busy_checkpoint"),
                                                          ("idle", "idle", "culprit_idle_wait_for_data")])
def test_culprit_activity_busy_or_idle(job_factory, exporter_factory, mode: str, state: str, function: str) -> None:
    job = job_factory("culprit", 2, env={"JOB_CULPRIT": mode, "JOB_TIMEOUT": "120"})
    job.wait_ready()
    exp = exporter_factory(job.spool, stuck_after=2.0)

    def culprit_activity() -> object:
        for v in exp.snapshot.verdicts:
            act = v.activity.get("1")
            if v.kind == "missing_rank" and v.ranks == (1,) and act is not None and act.state == state:
                return v
        return None

    v = wait_for(culprit_activity, timeout=30, what=f"a missing_rank verdict whose culprit is {state}")
    act = v.activity["1"]
    assert function in [f[0] for f in act.frames]
    assert act.headline()[0] == function  # the user's function, not the stdlib's sleep or a torch frame
    assert f"rank 1 has been {state} in {function} (job.py:" in v.summary.lower()
    assert (act.cpu_percent > 50) == (state == "busy")

    status = json.loads(exp.get("/api/v1/status"))
    (api,) = [a for a in status["verdicts"] if a["kind"] == "missing_rank"]
    assert set(api["activity"]) == {"1"}
    assert api["activity"]["1"]["state"] == state
    assert function in [f["function"] for f in api["activity"]["1"]["frames"]]
    assert set(api["activity"]["1"]) == {"state", "frames", "frames_source", "cpu_percent", "since"}
    assert api["activity"]["1"]["frames_source"] == "recorder"
    ranks = {r["rank"]: r for r in status["ranks"]}
    assert function in [f["function"] for f in ranks[1]["activity"]["frames"]]
    # The waiting rank is in the collective: its innermost frame is torch.distributed's.
    assert ranks[0]["activity"]["state"] == "in_collective"
    parsed = metrics(exp.get("/metrics"))
    assert sample(parsed, n.VERDICT, rank="1", kind="missing_rank", culprit_state=state,
                  culprit_function=function) == 1
    job.touch("stop")
