"""GPU facts in verdicts: NVML readings of the culprits' and waiting ranks' GPUs, matched by CUDA device UUID."""

from __future__ import annotations

from dataclasses import replace

from frexporter.analysis import MISSING_RANK, STALLED, STRAGGLER, VerdictConfig, evaluate, make_analyzer
from frexporter.analysis.gpu import RECOVERY_PHRASES
from frexporter.model import (
    GPU_RECOVERY_ACTIONS,
    GPU_RECOVERY_NONE,
    RANK_OK,
    EccErrors,
    GpuReading,
    GpuState,
    InflightCollective,
    NodeSnapshot,
    PGState,
    RankState,
    RemappedRows,
)

NOW = 1_800_000_000.0
WORLD = (0, 1, 2, 3)


def uuid(r: int) -> str:
    return f"GPU-{r}1234567-89ab-cdef-0123-456789abcdef"


def state(r: int, enqueued: int, completed: int, age: float = 120.0, lateness: float | None = None) -> RankState:
    inflight = tuple(InflightCollective(seq=s, op="all_reduce", created=NOW - age, timeout_seconds=600.0)
                     for s in range(completed + 1, enqueued + 1))
    pg = PGState(name="0", desc="default_pg", ranks=WORLD, backend="nccl", last_enqueued=enqueued, last_started=-1,
                 last_completed=completed, inflight=inflight, inflight_count=enqueued - completed,
                 timeout_seconds=600.0, last_progress=NOW - age, exact=True, has_p2p=False,
                 lateness_seconds=lateness, lateness_samples=200 if lateness is not None else 0)
    return RankState(job_id="job", rank=r, local_rank=r, world_size=4, hostname="node-a", pid=1000 + r,
                     torch_version="2.13.0+cu128", gpu_uuid=uuid(r), status=RANK_OK, heartbeat=NOW - 0.5,
                     heartbeat_age=0.5, socket_alive=True, pgs=(pg,))


def rank3_missing() -> list[RankState]:
    """Ranks 0-2 wait in all_reduce #11 for 2 minutes; rank 3 never enqueued it."""
    return [state(0, 11, 10), state(1, 11, 10), state(2, 11, 10), state(3, 10, 10)]


def gpu(r: int, **kw: object) -> GpuState:
    values: dict[str, object] = {"utilization_ratio": 1.0, "power_watts": 118.0, "ecc_errors": EccErrors(0, 0),
                                 "remapped_rows": RemappedRows(0, 0, pending=False, failure=False),
                                 "nvlink_errors": {(0, "replay"): 0}, "throttle_reasons": 0x04}
    values.update(kw)
    return GpuState(index=r, uuid=uuid(r), name="NVIDIA H100 80GB HBM3", **values)  # type: ignore[arg-type]


def reading(*gpus: GpuState) -> GpuReading:
    return GpuReading(timestamp=NOW, gpus=gpus, driver_version="570.86.15")


def only(verdicts: tuple) -> object:
    assert len(verdicts) == 1, verdicts
    return verdicts[0]


def test_xid_on_the_culprits_gpu_is_named_in_the_summary() -> None:
    gpus = reading(gpu(0), gpu(1), gpu(2), gpu(3, utilization_ratio=0.0, xid_errors={79: 1}))
    v = only(evaluate(rank3_missing(), NOW, gpus=gpus))
    assert v.kind == MISSING_RANK and v.ranks == (3,)
    assert "GPU: rank 3 on GPU-31234567…: Xid 79" in v.summary
    facts = v.details["gpu"]
    assert facts["culprits"]["3"]["xid_errors"] == {"79": 1}
    assert facts["culprits"]["3"]["uuid"] == uuid(3)
    assert set(facts["waiting"]) == {"0", "1", "2"}
    assert v.to_json()["details"]["gpu"]["facts"][0] == "rank 3 on GPU-31234567…: Xid 79"


def test_waiting_gpus_spinning_in_the_collective() -> None:
    gpus = reading(gpu(0, power_watts=112.0), gpu(1, power_watts=119.6), gpu(2), gpu(3, utilization_ratio=0.35))
    v = only(evaluate(rank3_missing(), NOW, gpus=gpus))
    assert "the waiting ranks' GPUs are 100%+ busy at 112-120 W: a collective kernel spinning on its peer" in v.summary
    assert v.details["gpu"]["waiting_state"] == "busy"
    assert "rank 3 on" not in v.summary  # a healthy culprit GPU has nothing to say


def test_waiting_gpus_idle_means_the_wait_is_on_the_host() -> None:
    idle = {"utilization_ratio": 0.0, "power_watts": 70.0}
    gpus = reading(gpu(0, **idle), gpu(1, **idle), gpu(2, **idle), gpu(3))
    v = only(evaluate(rank3_missing(), NOW, gpus=gpus))
    assert "the waiting ranks' GPUs are idle at 70 W: the wait is on the host side" in v.summary


def test_lost_gpu_ecc_remap_and_nvlink_faults() -> None:
    gpus = reading(gpu(0), gpu(1), gpu(2), gpu(3, lost=True, utilization_ratio=None, power_watts=None,
                                               ecc_errors=EccErrors(corrected=0, uncorrected=2),
                                               remapped_rows=RemappedRows(0, 3, pending=False, failure=True),
                                               nvlink_errors={(0, "replay"): 4, (3, "crc_flit"): 1}))
    v = only(evaluate(rank3_missing(), NOW, gpus=gpus))
    assert ("rank 3 on GPU-31234567…: GPU lost, 2 uncorrected ECC errors, row remapping failed, 5 NVLink errors"
            in v.summary)
    culprit = v.details["gpu"]["culprits"]["3"]
    assert (culprit["lost"], culprit["ecc_uncorrected"], culprit["remapped_rows_failure"],
            culprit["nvlink_errors"]) == (True, 2, True, 5)


def test_stalled_pg_lists_faults_of_every_member() -> None:
    ranks = [state(r, 11, 10) for r in WORLD]
    gpus = reading(gpu(0), gpu(1, xid_errors={74: 3}), gpu(2), gpu(3))
    v = only(evaluate(ranks, NOW, gpus=gpus))
    assert v.kind == STALLED
    assert "rank 1 on GPU-11234567…: Xid 74 x3" in v.summary


def test_straggler_gets_clock_slowdowns() -> None:
    ranks = [state(r, 10, 10, lateness=2.5 if r == 2 else 0.0) for r in WORLD]
    gpus = reading(gpu(0), gpu(1), gpu(2, throttle_reasons=0x04 | 0x40), gpu(3))
    v = only(evaluate(ranks, NOW, gpus=gpus))
    assert v.kind == STRAGGLER and v.ranks == (2,)
    assert "rank 2 on GPU-21234567…: clocks slowed (hw_thermal_slowdown)" in v.summary
    assert "spinning" not in v.summary  # its peers compute between waits: their load says nothing here


def test_power_cap_alone_is_not_a_slowdown_worth_naming() -> None:
    ranks = [state(r, 10, 10, lateness=2.5 if r == 2 else 0.0) for r in WORLD]
    v = only(evaluate(ranks, NOW, gpus=reading(*(gpu(r) for r in WORLD))))
    assert "clocks slowed" not in v.summary


def test_without_nvml_or_matching_gpus_verdicts_are_unchanged() -> None:
    plain = only(evaluate(rank3_missing(), NOW))
    assert "gpu" not in plain.details and "GPU:" not in plain.summary
    elsewhere = reading(replace(gpu(0), uuid="GPU-other-node"))
    assert only(evaluate(rank3_missing(), NOW, gpus=elsewhere)) == plain
    assert only(evaluate(rank3_missing(), NOW, VerdictConfig(), None)) == plain


def test_analyzer_passes_the_snapshots_gpus() -> None:
    snap = NodeSnapshot(time=NOW, hostname="node-a", ranks=tuple(rank3_missing()), sources=(),
                        gpus=reading(gpu(0), gpu(1), gpu(2), gpu(3, xid_errors={79: 2})))
    v = only(make_analyzer()(snap))
    assert "rank 3 on GPU-31234567…: Xid 79 x2" in v.summary


# --- the driver's recovery action (NVML, driver >= 570): a fact of the rank's own GPU


def test_hang_names_the_recovery_action_the_culprits_gpu_asks_for() -> None:
    gpus = reading(gpu(0), gpu(1), gpu(2), gpu(3, recovery_action=1, xid_errors={79: 1}))
    v = only(evaluate(rank3_missing(), NOW, gpus=gpus))
    assert v.kind == MISSING_RANK and v.ranks == (3,)
    assert "GPU: rank 3 on GPU-31234567…: the driver asks for a GPU reset, Xid 79" in v.summary
    assert v.details["gpu"]["culprits"]["3"]["recovery_action"] == "gpu_reset"


def test_straggler_names_the_recovery_action_of_its_own_gpu() -> None:
    ranks = [state(r, 10, 10, lateness=2.5 if r == 2 else 0.0) for r in WORLD]
    gpus = reading(gpu(0), gpu(1), gpu(2, recovery_action=3), gpu(3))
    v = only(evaluate(ranks, NOW, gpus=gpus))
    assert v.kind == STRAGGLER and v.ranks == (2,)
    assert "rank 2 on GPU-21234567…: the driver asks to drain peer-to-peer traffic" in v.summary
    assert v.details["gpu"]["culprits"]["2"]["recovery_action"] == "drain_p2p"


def test_another_ranks_gpu_asking_for_recovery_is_not_the_culprits_fact() -> None:
    # The hang's waiting rank 0 and the straggler's peer rank 0 sit on a GPU that asks for a node reboot:
    # neither verdict blames it on the culprit (each verdict reads its culprits' own GPUs, by UUID).
    asking = gpu(0, recovery_action=2)
    hang = only(evaluate(rank3_missing(), NOW, gpus=reading(asking, gpu(1), gpu(2), gpu(3))))
    ranks = [state(r, 10, 10, lateness=2.5 if r == 2 else 0.0) for r in WORLD]
    straggler = only(evaluate(ranks, NOW, gpus=reading(asking, gpu(1), gpu(2), gpu(3))))
    for v in (hang, straggler):
        assert "reboot" not in v.summary
        assert all("recovery_action" not in w for w in v.details["gpu"]["waiting"].values())


def test_recovery_action_none_or_absent_says_nothing() -> None:
    for action in (0, None):
        v = only(evaluate(rank3_missing(), NOW, gpus=reading(gpu(0), gpu(1), gpu(2), gpu(3, recovery_action=action))))
        assert "driver asks" not in v.summary
        assert v.details["gpu"]["culprits"]["3"]["recovery_action"] == ("none" if action == 0 else None)


def test_a_newer_drivers_recovery_action_is_named_by_its_code() -> None:
    v = only(evaluate(rank3_missing(), NOW, gpus=reading(gpu(0), gpu(1), gpu(2), gpu(3, recovery_action=42))))
    assert "rank 3 on GPU-31234567…: the driver asks for recovery action 42" in v.summary
    assert v.details["gpu"]["culprits"]["3"]["recovery_action"] == "unknown"


def test_every_recovery_action_has_words() -> None:
    assert set(RECOVERY_PHRASES) == set(GPU_RECOVERY_ACTIONS.values()) - {GPU_RECOVERY_NONE}
