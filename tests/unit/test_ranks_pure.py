"""The ranks source's pure rules on literals: liveness (sources/ranks/liveness.py), PG state and the samples a
PG's stuck threshold is learned from (sources/ranks/pg_state.py). No spool, no socket, no clock."""

from __future__ import annotations

import pytest

from frexporter.fr.domain import DeepView
from frexporter.model import RANK_DOWN, RANK_EXITED, RANK_OK, RANK_UNRESPONSIVE, InflightCollective
from frexporter.sources.ranks import liveness, pg_state
from frexporter.sources.ranks.liveness import Liveness
from frexporter.sources.ranks.pg_state import PGMemory
from frexporter.spool import RECORDER_FR, RECORDER_NCCL, Manifest, PGEntry, RawPGStatus, Snapshot

NOW = 1_700_000_000.0  # wall clock
MONO = 5000.0  # monotonic clock
ENTRY = PGEntry(name="0", desc="default_pg", ranks=(0, 1), backend="cpu:gloo", local_ids={RECORDER_FR: 0},
                timeout_seconds=1800.0)


def raw(enqueued: int, completed: int, started: int = -1) -> RawPGStatus:
    return RawPGStatus(enqueued=enqueued, started=started, completed=completed)


def waiting(seq: int, created: float) -> InflightCollective:
    return InflightCollective(seq=seq, op="all_reduce", created=created, timeout_seconds=1800.0)


def deep(status: RawPGStatus, enqueued: int, completed: int, inflight: tuple[InflightCollective, ...] = (),
         has_p2p: bool = False, completed_created: float | None = None) -> DeepView:
    return DeepView(pg_id=0, name="0", desc="default_pg", raw=status, enqueued=enqueued, started=-1,
                    completed=completed, inflight=inflight, has_p2p=has_p2p, timeout_seconds=600.0, known=True,
                    completed_created=completed_created)


def manifest(*groups: PGEntry) -> Manifest:
    return Manifest(job_id="job", rank=0, local_rank=0, world_size=2, pid=42, hostname="node-a", start_time=1.0,
                    torch_version="2.13.0", backends=("cpu:gloo",), gpu_uuid="", socket="", handlers=(),
                    recorders=(RECORDER_FR,), fr_buffer_size=2000, process_groups=groups or (ENTRY,), generation=1)


def snapshot(status: RawPGStatus, state: str = "running") -> Snapshot:
    return Snapshot(pid=42, time=NOW, interval=1.0, counter=7, status={RECORDER_FR: {0: status}}, errors={},
                    state=state, message="")


# ---------------------------------------------------------------- liveness


def test_stale_after_three_intervals_and_a_poll() -> None:
    assert liveness.stale(None, 1.0, 1.0, MONO)  # never fresh
    assert not liveness.stale(MONO - 4.0, 1.0, 1.0, MONO)  # 3 x 1 s + one 1 s poll: not yet
    assert liveness.stale(MONO - 4.01, 1.0, 1.0, MONO)
    assert not liveness.stale(MONO - 1.9, 0.2, 1.0, MONO)  # a fast recorder still gets 1 s + the poll
    assert liveness.stale(MONO - 2.01, 0.2, 1.0, MONO)
    assert not liveness.stale(MONO - 3.9, None, 1.0, MONO)  # no snapshot yet: the default interval


@pytest.mark.parametrize(("exiting", "stale", "socket_alive", "has_snapshot", "since_start", "want"), [
    (True, True, True, True, 100.0, RANK_EXITED),  # a clean exit, whatever else
    (False, False, None, True, 100.0, RANK_OK),  # a fresh heartbeat
    (False, True, True, True, 100.0, RANK_UNRESPONSIVE),  # stale, and the C++ worker server answers
    (False, True, False, True, 100.0, RANK_DOWN),  # stale, socket gone
    (False, True, None, True, 100.0, RANK_DOWN),  # stale, socket never answered
    (False, True, None, False, 5.0, RANK_OK),  # just started: its first snapshot is on its way
    (False, True, None, False, 7.0, RANK_DOWN),  # ... but not for longer than three rank timeouts
    (False, True, False, False, 1.0, RANK_DOWN),  # a socket known dead is no start-up
])
def test_judge(exiting: bool, stale: bool, socket_alive: bool | None, has_snapshot: bool, since_start: float,
               want: str) -> None:
    assert liveness.judge(exiting=exiting, stale=stale, socket_alive=socket_alive, has_snapshot=has_snapshot,
                          since_start=since_start, rank_timeout=2.0) == want


def test_wedges_are_counted_once_each_and_stacks_stand_only_within_one() -> None:
    ok = liveness.advance(Liveness(), RANK_OK, MONO)
    assert ok == Liveness(status=RANK_OK, wedges=0, departed_at=None)
    wedged = liveness.advance(ok, RANK_UNRESPONSIVE, MONO + 1)
    still = liveness.advance(wedged, RANK_UNRESPONSIVE, MONO + 2)
    assert (wedged.wedges, still.wedges) == (1, 1)
    assert liveness.advance(liveness.advance(still, RANK_OK, MONO + 3), RANK_UNRESPONSIVE, MONO + 4).wedges == 2
    assert liveness.same_wedge(RANK_UNRESPONSIVE, RANK_UNRESPONSIVE)
    assert not liveness.same_wedge(RANK_OK, RANK_UNRESPONSIVE)  # a new wedge: py-spy asked afresh
    assert not liveness.same_wedge(None, RANK_UNRESPONSIVE)
    assert not liveness.same_wedge(RANK_UNRESPONSIVE, RANK_DOWN)


def test_a_departed_rank_is_shown_for_the_grace_and_an_exited_one_not_at_all() -> None:
    down = liveness.advance(Liveness(status=RANK_OK), RANK_DOWN, MONO)
    assert down.departed_at == MONO
    later = liveness.advance(down, RANK_DOWN, MONO + 20)
    assert later.departed_at == MONO  # from when it first went
    assert liveness.exported(later, MONO + 30, departed_grace=30.0)
    assert not liveness.exported(later, MONO + 30.1, departed_grace=30.0)
    back = liveness.advance(later, RANK_UNRESPONSIVE, MONO + 40)
    assert back.departed_at is None and liveness.exported(back, MONO + 1000, departed_grace=30.0)
    exited = liveness.advance(Liveness(status=RANK_OK), RANK_EXITED, MONO)
    assert not liveness.exported(exited, MONO, departed_grace=30.0)


def test_rank_state_from_values() -> None:
    snap = snapshot(raw(10, 10))
    state = liveness.rank_state(manifest(), snap, RANK_OK, True, (), NOW - 5, None, NOW + 2.5)
    assert (state.job_id, state.rank, state.status, state.heartbeat, state.heartbeat_age) == (
        "job", 0, RANK_OK, NOW, 2.5)
    assert state.socket_alive and state.last_deep_read == NOW - 5
    none = liveness.rank_state(manifest(), None, RANK_DOWN, None, (), None, None, NOW)
    assert (none.heartbeat, none.heartbeat_age, none.message, none.recorder_errors) == (None, None, "", {})


# ---------------------------------------------------------------- which counters, which name


def test_a_wedged_rank_is_judged_by_its_last_deep_read() -> None:
    snap = snapshot(raw(10, 9))
    deep_raw = {RECORDER_FR: {0: raw(12, 11)}}
    assert pg_state.judged_statuses(RANK_OK, snap, deep_raw) == {RECORDER_FR: {0: raw(10, 9)}}
    assert pg_state.judged_statuses(RANK_UNRESPONSIVE, snap, deep_raw) == deep_raw
    assert pg_state.judged_statuses(RANK_UNRESPONSIVE, snap, {}) == {RECORDER_FR: {0: raw(10, 9)}}
    assert pg_state.judged_statuses(RANK_DOWN, None, deep_raw) == {}


def test_names_as_learned_else_predicted_and_nccl_preferred() -> None:
    both = PGEntry(name="5", desc="tp", ranks=(0, 1), backend="cpu:gloo,cuda:nccl",
                   local_ids={RECORDER_FR: 1, RECORDER_NCCL: 3})
    m = manifest(ENTRY, both)
    assert pg_state.predicted_name(m, RECORDER_NCCL, 3) == "5" and pg_state.predicted_name(m, RECORDER_FR, 9) is None
    assert pg_state.pg_name({RECORDER_FR: {9: "learned"}}, m, RECORDER_FR, 9) == "learned"
    statuses = {RECORDER_FR: {0: raw(1, 1), 1: raw(2, 2), 7: raw(3, 3)}, RECORDER_NCCL: {3: raw(4, 4)}}
    assert pg_state.choose(statuses, {}, m) == {"0": (RECORDER_FR, 0, raw(1, 1)),
                                                "5": (RECORDER_NCCL, 3, raw(4, 4))}  # id 7: no name, left out


# ---------------------------------------------------------------- one PG's state


def test_counters_only() -> None:
    state, memory = pg_state.pg_state(ENTRY, RECORDER_FR, raw(12, 10), None, False, PGMemory(), NOW, MONO)
    assert (state.last_enqueued, state.last_completed, state.inflight_count, state.exact) == (12, 10, 2, True)
    assert state.inflight == () and state.timeout_seconds == 1800.0 and state.backend == "cpu:gloo"
    assert state.last_progress is None  # first sight, nothing to bound it with
    assert memory == PGMemory(last_completed=10, last_progress=None, seen_inflight={}, watched_since=NOW)


def test_the_deep_read_speaks_for_the_counters_it_saw() -> None:
    status = raw(11, 10)
    view = deep(status, enqueued=6, completed=5, inflight=(waiting(6, NOW - 3),), completed_created=NOW - 7)
    state, memory = pg_state.pg_state(ENTRY, RECORDER_FR, status, view, False, PGMemory(), NOW, MONO)
    assert (state.last_enqueued, state.last_completed, state.inflight_count) == (6, 5, 1)  # the collective domain
    assert state.oldest_inflight is not None and state.oldest_inflight.seq == 6
    assert state.timeout_seconds == 600.0  # the dump's own timeout wins over the manifest's
    assert state.last_progress == NOW - 7  # first sight: bounded by FR's newest completed collective
    assert memory.seen_inflight == {(6, NOW - 3): (3.0, MONO)}


def test_raw_counters_moved_past_the_deep_read_keep_only_what_is_still_in_flight() -> None:
    view = deep(raw(11, 10), enqueued=11, completed=10, inflight=(waiting(11, NOW - 1),))
    state, _ = pg_state.pg_state(ENTRY, RECORDER_FR, raw(13, 11), view, False, PGMemory(), NOW, MONO)
    assert (state.last_completed, state.inflight_count, state.inflight) == (11, 2, ())


def test_p2p_keeps_the_deep_values_and_drops_its_waits_once_the_rank_completes_more() -> None:
    view = deep(raw(9, 5), enqueued=3, completed=2, inflight=(waiting(3, NOW - 2),), has_p2p=True)
    # A send enqueued since the deep read: torch's raw counters moved off the collective domain.
    state, _ = pg_state.pg_state(ENTRY, RECORDER_FR, raw(10, 5), view, True, PGMemory(), NOW, MONO)
    assert (state.last_completed, state.exact, len(state.inflight), state.inflight_count) == (2, False, 1, 1)
    moved, _ = pg_state.pg_state(ENTRY, RECORDER_FR, raw(12, 8), view, True, PGMemory(), NOW, MONO)
    assert (moved.last_completed, moved.exact, moved.inflight, moved.inflight_count) == (2, False, (), 1)


def test_progress_is_stamped_when_the_completed_count_moves() -> None:
    before = PGMemory(last_completed=10, last_progress=NOW - 100)
    same, kept = pg_state.pg_state(ENTRY, RECORDER_FR, raw(11, 10), None, False, before, NOW, MONO)
    moved, _ = pg_state.pg_state(ENTRY, RECORDER_FR, raw(12, 11), None, False, kept, NOW + 1, MONO + 1)
    assert (same.last_progress, moved.last_progress) == (NOW - 100, NOW + 1)


def test_in_flight_ages_grow_with_the_monotonic_clock_across_a_wall_clock_step() -> None:
    entry = waiting(6, NOW - 2)
    seen = {(6, NOW - 2): (2.0, MONO)}
    # An hour's NTP step forward, 5 monotonic seconds later: the wait is 7 s old, not an hour.
    ages, still = pg_state.steady_ages(seen, (entry,), NOW + 3600 + 5, MONO + 5)
    assert ages[0].created == pytest.approx(NOW + 3600 + 5 - 7.0) and still == seen
    assert pg_state.steady_ages(seen, (), NOW, MONO) == ((), {})  # gone from flight: forgotten


# ---------------------------------------------------------------- threshold samples


def test_threshold_samples_come_only_from_forward_progress() -> None:
    assert pg_state.threshold_samples(PGMemory(), 10, MONO) == ((), MONO)  # first sight: the gap starts
    before = PGMemory(last_completed=10, progress_mono=MONO - 4)
    assert pg_state.threshold_samples(before, 10, MONO) == ((), MONO - 4)  # no progress: the gap goes on
    assert pg_state.threshold_samples(before, 3, MONO) == ((), MONO)  # restarted: no sample, a new gap
    seen = {(11, NOW - 1): (1.0, MONO - 3), (12, NOW): (0.5, MONO - 1), (14, NOW): (0.0, MONO)}
    samples, progress = pg_state.threshold_samples(
        PGMemory(last_completed=10, progress_mono=MONO - 4, seen_inflight=seen), 12, MONO)
    # The gap since the last advance, then each wait seen in flight that completed: age then + time since.
    assert samples == (4.0, 4.0, 1.5) and progress == MONO
