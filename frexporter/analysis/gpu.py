"""GPU facts behind a verdict: what NVML says about the culprits' and the waiting ranks' GPUs (pure).

A rank names its CUDA device by UUID in its manifest (``RankState.gpu_uuid``); the NVML reading of the same
node (``GpuReading``) is matched by UUID, so only ranks on this node get GPU facts. What counts as a fact:

- the culprit's GPU is lost (fell off the bus) or reported Xid events (NVML delivers Xid events that happen
  after the exporter registered for them, so every one counted is new since the exporter started);
- the driver asks for a recovery action (a GPU reset, a node reboot, a drain: NVML's own word, driver >= 570);
- uncorrected ECC errors, a failed or pending row remapping, NVLink errors (driver counters since it
  loaded, so possibly old: they are evidence, not proof);
- for a straggler, a GPU that slows its clocks for heat or power;
- the waiting ranks' GPUs: NCCL waits in a kernel that spins on its peer, so a waiting GPU shows up to 100%
  utilization while doing no math (at modest power); a waiting GPU near 0% waits on the host side (gloo,
  or the collective never launched).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from frexporter.model import GPU_RECOVERY_NONE, RankState, gpu_recovery_action_name

MAX_RANKS = 16  # ranks with GPU details kept per verdict
BUSY = 0.9  # utilization at or above which a waiting GPU counts as spinning
IDLE = 0.1  # at or below which it counts as idle
# NVML clock-event reasons that mean "slowed for heat or power" (same bits as frexporter_gpu_throttle_reasons).
SLOWDOWN_REASONS: tuple[tuple[str, int], ...] = (
    ("hw_slowdown", 0x08), ("sw_thermal_slowdown", 0x20), ("hw_thermal_slowdown", 0x40),
    ("hw_power_brake_slowdown", 0x80),
)


# NVML's recovery action (model.GPU_RECOVERY_ACTIONS, every one but none) -> what the driver asks for, in a
# verdict's words.
RECOVERY_PHRASES: dict[str, str] = {
    "gpu_reset": "the driver asks for a GPU reset",
    "node_reboot": "the driver asks for a node reboot",
    "drain_p2p": "the driver asks to drain peer-to-peer traffic",
    "drain_and_reset": "the driver asks to drain peer-to-peer traffic and reset the GPU",
    "recover_imex_domain": "the driver asks to recover the IMEX domain",
    "bus_reset": "the driver asks for a PCIe bus reset",
    "system_reboot": "the driver asks for a system reboot",
}


def recovery_phrase(code: int | None) -> str:
    """What the driver asks for, in words; "" when it asks for nothing or does not say (None: driver < 570)."""
    if code is None:
        return ""
    name = gpu_recovery_action_name(code)
    if name == GPU_RECOVERY_NONE:
        return ""
    return RECOVERY_PHRASES.get(name, f"the driver asks for recovery action {code}")


def by_uuid(gpus: Any) -> dict[str, Any]:
    """A GPU reading's GPUs by UUID (how ranks name theirs)."""
    return {g.uuid: g for g in getattr(gpus, "gpus", ()) or () if getattr(g, "uuid", "")}


def _faults(gpu: Any, slowdown: bool) -> list[str]:
    """Short phrases, most decisive first."""
    out = []
    if gpu.lost:
        out.append("GPU lost")
    recovery = recovery_phrase(gpu.recovery_action)
    if recovery:
        out.append(recovery)
    for xid, count in sorted(gpu.xid_errors.items()):
        out.append(f"Xid {xid}" + (f" x{count}" if count > 1 else ""))
    if gpu.ecc_errors is not None and gpu.ecc_errors.uncorrected:
        out.append(f"{gpu.ecc_errors.uncorrected} uncorrected ECC errors")
    rows = gpu.remapped_rows
    if rows is not None and rows.failure:
        out.append("row remapping failed")
    elif rows is not None and rows.pending:
        out.append("row remapping pending (reset needed)")
    nvlink = sum((gpu.nvlink_errors or {}).values())
    if nvlink:
        out.append(f"{nvlink} NVLink errors")
    if slowdown and gpu.throttle_reasons:
        reasons = [name for name, bit in SLOWDOWN_REASONS if gpu.throttle_reasons & bit]
        if reasons:
            out.append("clocks slowed (" + ", ".join(reasons) + ")")
    return out


def _reading(gpu: Any) -> dict[str, Any]:
    rows = gpu.remapped_rows
    return {
        "uuid": gpu.uuid, "index": gpu.index, "lost": gpu.lost,
        "xid_errors": {str(k): v for k, v in sorted(gpu.xid_errors.items())},
        "ecc_uncorrected": gpu.ecc_errors.uncorrected if gpu.ecc_errors is not None else None,
        "remapped_rows_failure": rows.failure if rows is not None else None,
        "remapped_rows_pending": rows.pending if rows is not None else None,
        "nvlink_errors": sum(gpu.nvlink_errors.values()) if gpu.nvlink_errors is not None else None,
        "utilization_ratio": gpu.utilization_ratio, "power_watts": gpu.power_watts,
        "throttle_reasons": gpu.throttle_reasons,
        "recovery_action": (gpu_recovery_action_name(gpu.recovery_action)
                            if gpu.recovery_action is not None else None),
    }


def short_uuid(uuid: str) -> str:
    return uuid if len(uuid) <= 12 else uuid[:12] + "…"


def gpu_facts(job_id: str, culprits: Iterable[int], waiting: Iterable[int], ranks: Mapping[tuple[str, int], RankState],
              gpus: Any, hang: bool = True) -> tuple[str, dict[str, Any]]:
    """(sentence to append to the summary, ``details["gpu"]``); ("", {}) when no involved rank's GPU is known.

    ``hang``: the waiting ranks are blocked (their GPUs' load says how); False for a straggler, whose peers
    keep computing between waits, so their load says nothing and the culprit's clock slowdowns do instead.
    """
    slowdown = not hang
    gpus_by_uuid = by_uuid(gpus)
    if not gpus_by_uuid:
        return "", {}

    def gpu_of(rank: int) -> Any:
        state = ranks.get((job_id, rank))
        return gpus_by_uuid.get(state.gpu_uuid) if state is not None and state.gpu_uuid else None

    details: dict[str, Any] = {"culprits": {}, "waiting": {}}
    phrases = []
    for r in list(culprits)[:MAX_RANKS]:
        gpu = gpu_of(r)
        if gpu is None:
            continue
        details["culprits"][str(r)] = _reading(gpu)
        faults = _faults(gpu, slowdown)
        if faults:
            phrases.append(f"rank {r} on {short_uuid(gpu.uuid)}: {', '.join(faults)}")
    waiting_gpus = []
    for r in list(waiting)[:MAX_RANKS]:
        gpu = gpu_of(r)
        if gpu is None:
            continue
        details["waiting"][str(r)] = {"uuid": gpu.uuid, "utilization_ratio": gpu.utilization_ratio,
                                      "power_watts": gpu.power_watts, "lost": gpu.lost}
        waiting_gpus.append(gpu)
    if not details["culprits"] and not details["waiting"]:
        return "", {}
    utils = [g.utilization_ratio for g in waiting_gpus if g.utilization_ratio is not None and not g.lost]
    if hang and utils and len(utils) == len(waiting_gpus):
        power = [g.power_watts for g in waiting_gpus if g.power_watts is not None]
        at = f" at {_range(power)} W" if power else ""
        who = "the waiting ranks' GPUs are" if len(utils) > 1 else "the waiting rank's GPU is"
        if min(utils) >= BUSY:
            details["waiting_state"] = "busy"
            phrases.append(f"{who} {round(100 * min(utils))}%+ busy{at}: a collective kernel spinning on its "
                           "peer, not computing")
        elif max(utils) <= IDLE:
            details["waiting_state"] = "idle"
            phrases.append(f"{who} idle{at}: the wait is on the host side")
    details["facts"] = phrases
    return ("GPU: " + "; ".join(phrases) + ".") if phrases else "", details


def _range(values: list[float]) -> str:
    low, high = round(min(values)), round(max(values))
    return f"{low}" if low == high else f"{low}-{high}"
