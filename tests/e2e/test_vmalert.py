"""vmalert fires what Prometheus fires: the shipped rules, the same jobs, VictoriaMetrics and Prometheus at once.

Four jobs and faults of tests/workers/job.py, as tests/e2e/test_alerts_e2e.py runs them (and benchmarks/detection.py
the op mismatch that stalls a PG), each under its own job_id, publish to one spool read by one exporter on the port
the session's Prometheus scrapes (tests/promstack.py); vmagent scrapes the same port for victoria-metrics, where
vmalert evaluates the same rule file at the same scale (tests/vmstack.py) and sends to the same Alertmanager, so
that both engines' notifications reach one webhook receiver, vmalert's labelled ruler="vmalert". The four run at
once (the stacks and the exporter are shared, the slowest case, FrexporterRankAbsent's scaled "for: 5m", decides the
wall time); each case is one test, which asserts that its alert fires on both engines, with the same labels (less
those vmalert adds: ruler, alertgroup), the same summary and the same description but for its durations, and that
neither engine fires anything for the job that the other does not.

vmalert's notifications come later than Prometheus': it evaluates one interval in the past (vmstack's
-datasource.lookback), and victoria-metrics 1.79 shows a new series (the in-flight ages of a collective that hangs,
the desync culprits vmalert records and reads back) to a query that asked for it before it was searchable, as
vmalert does every evaluation, only 6-10 s after it arrived (measured; 1-1.5 s when nothing asked first; no flag
changes it, -search.disableCache included). The cross-node alerts pay that once per recording rule they read through
(vmalert reads each back from victoria-metrics): the shard tier's per-rank in-flight ages, then its per-PG exports
(docs/scale.md, "Tiers"). VM_LAG_S bounds the lag.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from frexporter.app import App, ServeConfig, build_app
from tests.harness import EXPORTER_OPTIONS, Job, require_tool, wait_for
from tests.promstack import Notification, PromStack
from tests.rulefile import alert_for, desync_timing
from tests.vmstack import BINARIES, ENGINE_LABELS, INSTALL_HINT, RULER, RULER_LABEL, VmStack, running_vmstack

PROMETHEUS = "prometheus"
POLL_S = 0.2
JOB_TIMEOUT_S = 200.0  # gloo's timeout in the hung jobs: far beyond the test, and beyond FrexporterWatchdogBudget's
READY_TIMEOUT_S = 120.0  # eleven ranks importing torch at once on two cores
SEEN_TIMEOUT_S = 40.0  # both engines see every rank up (a new series can take 10 s to show in victoria-metrics)
# vmalert's lag behind Prometheus at the webhook: its lookback, twice a new series' delay in victoria-metrics (up to
# 10 s, see above) and a few scrape, evaluation and notification rounds on a busy machine. Measured with the tiered
# rules: 1.3 s (FrexporterRankDown), 26 s (FrexporterCollectiveStalled), 21 s (FrexporterRankAbsent), 27 s (desync);
# with the rules before the tiers, which read fewer records: 1-2, 6-7, 8-10 and 16-17 s.
VM_LAG_S = 35.0


def _touch_and_wait(tag: str, marker: str, rank: int) -> Callable[[Job], float]:
    def inject(job: Job) -> float:
        job.touch(tag)
        job.wait_ready(marker, ranks=[rank], timeout=15)
        return job.marker(rank, marker).stat().st_mtime  # when the rank acted on it

    return inject


def _kill_rank_1(job: Job) -> float:
    job.touch("kill")
    wait_for(lambda: job.procs[1].poll() is not None, timeout=10, what="rank 1 killed")
    return time.time()


@dataclass(frozen=True)
class Case:
    name: str
    alert: str
    scenario: str
    world: int
    # Labels the alert must carry on both engines (the culprit the scenario makes, as test_alerts_e2e asserts it).
    expect: dict[str, str]
    env: dict[str, str] = field(default_factory=dict)
    inject: Callable[[Job], float] | None = None  # the fault, once every rank is seen up; returns when it took effect
    absent: tuple[int, ...] = ()  # ranks that never report (they die before the recorder starts)

    @property
    def job_id(self) -> str:
        return f"vm-{self.name}"


CASES = (
    # Rank 3 skips an all_reduce on its pair PG: the root of a cascade (ranks 0-2 wait too, for it or for rank 2).
    Case("desync", "FrexporterCollectiveDesync", "pair_skip", 4,
         {"rank": "3", "pg_desc": "pair23", "culprit_state": "in_collective", "severity": "warning"},
         {"JOB_TIMEOUT": f"{JOB_TIMEOUT_S:g}", "JOB_STEP_SECONDS": "0.5"}, _touch_and_wait("skip", "skipped", 3)),
    # The last rank all_gathers while the others all_reduce: every rank joined the same seq, none completes.
    Case("stalled", "FrexporterCollectiveStalled", "op_mismatch", 3, {"pg_desc": "default_pg", "severity": "warning"},
         {"JOB_TIMEOUT": f"{JOB_TIMEOUT_S:g}", "JOB_STEP_SECONDS": "0.2"},
         _touch_and_wait("mismatch", "mismatched", 2)),
    Case("rank-down", "FrexporterRankDown", "kill", 2, {"rank": "1", "severity": "critical"}, inject=_kill_rank_1),
    # torchrun-like: rank 1 exits before install(); ranks 0 and 2 wait in init_process_group.
    Case("rank-absent", "FrexporterRankAbsent", "pre_init_fail", 3, {"severity": "warning"}, absent=(1,)),
)


@pytest.fixture(scope="module")
def vmstack(promstack: PromStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VmStack]:
    for name in BINARIES:
        require_tool(name, INSTALL_HINT)
    # Scrapes what the session's Prometheus scrapes; notifies its Alertmanager (one webhook for both engines).
    with running_vmstack(tmp_path_factory.mktemp("vmstack"), promstack.exporter_ports, promstack.am_url,
                         scale=promstack.scale, interval=promstack.interval) as stack:
        yield stack


def _sees(engine: PromStack | VmStack, want: dict[str, int]) -> bool:
    """Whether ``engine`` counts as many ranks up per job_id as ``want``, and no other job (asserts)."""
    found = engine.query('count by (job_id) (frexporter_rank_up{job_id=~"vm-.+"} == 1)')
    got = {s["metric"].get("job_id", ""): int(s["value"][1]) for s in found}
    assert got == want, got
    return True


@pytest.fixture(scope="module")
def faults(
    promstack: PromStack, vmstack: VmStack, tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, float]]:
    """Every case's job started, seen up by both engines, and its fault injected: when the fault took effect, per
    case (rank-absent: when both engines saw the ranks that report)."""
    tmp = tmp_path_factory.mktemp("vmalert")
    spool = tmp / "spool"  # one node: the jobs' ranks all publish here, one exporter reads them
    jobs = {case.name: Job(tmp / case.name, case.scenario, case.world, job_id=case.job_id,
                           env={**case.env, "FREXPORTER_DIR": str(spool)}, launcher_env=bool(case.absent))
            for case in CASES}
    app: App | None = None
    try:
        for job in jobs.values():
            job.start()
        for case in CASES:
            if not case.absent:  # with a rank absent, the others never get past init_process_group
                jobs[case.name].wait_ready(timeout=READY_TIMEOUT_S)
        since = time.time()
        threshold, _ = desync_timing(promstack.scale)
        # stuck_after at the rules' threshold, as in test_alerts_e2e: the verdicts the descriptions quote are there.
        app = build_app(ServeConfig(directory=str(spool), host="127.0.0.1",
                                    **{**EXPORTER_OPTIONS, "port": promstack.exporter_port, "stuck_after": threshold}))
        app.start()
        promstack.wait_target_up(since)
        vmstack.wait_target_up(since)
        want = {case.job_id: case.world - len(case.absent) for case in CASES}
        for engine in (promstack, vmstack):
            wait_for(functools.partial(_sees, engine, want), timeout=SEEN_TIMEOUT_S, interval=POLL_S,
                     what=f"{type(engine).__name__} to see every rank up")
        seen_at = time.time()
        yield {case.name: case.inject(jobs[case.name]) if case.inject else seen_at for case in CASES}
    finally:
        if app is not None:
            app.stop()
        for case in CASES:
            if case.absent:  # blocked in init_process_group, deaf to the stop file
                for proc in jobs[case.name].procs:
                    if proc.poll() is None:
                        proc.kill()
        for job in jobs.values():
            job.stop()


Key = tuple[tuple[str, str], ...]


def _key(labels: dict[str, str]) -> Key:
    """An alert's identity across engines: its labels less those the engine adds."""
    return tuple(sorted((k, v) for k, v in labels.items() if k not in ENGINE_LABELS))


def _fired(promstack: PromStack, job_id: str) -> dict[str, dict[Key, Notification]]:
    """Per engine, the first firing notification of every alert of the job that reached the webhook."""
    out: dict[str, dict[Key, Notification]] = {PROMETHEUS: {}, RULER: {}}
    for note in promstack.webhook.notifications(job_id=job_id):
        if note.status == "firing":
            out[note.labels.get(RULER_LABEL, PROMETHEUS)].setdefault(_key(note.labels), note)
    return out


def _describe(fired: dict[str, dict[Key, Notification]]) -> str:
    return "; ".join(f"{engine}: {[dict(key) for key in notes] or 'nothing'}" for engine, notes in fired.items())


# humanizeDuration's output ("5.15s", "1m 2s", "450ms"): the only part of a description the engines' timing changes.
_DURATION = re.compile(r"\b(?:\d+[dhm] )*\d+(?:\.\d+)?(?:ms|s|m|h|d)\b")


def _mask_durations(text: str) -> str:
    return _DURATION.sub("<duration>", text)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_vmalert_fires_what_prometheus_fires(
    case: Case, faults: dict[str, float], promstack: PromStack, capsys: pytest.CaptureFixture[str],
) -> None:
    injected_at = faults[case.name]
    hold = alert_for(case.alert, promstack.scale)

    def ours(fired: dict[str, dict[Key, Notification]]) -> dict[str, list[Notification]]:
        return {engine: [n for n in notes.values() if n.labels["alertname"] == case.alert]
                for engine, notes in fired.items()}

    def prometheus_fired() -> dict[str, dict[Key, Notification]]:
        fired = _fired(promstack, case.job_id)
        assert ours(fired)[PROMETHEUS], _describe(fired)
        return fired

    # Prometheus' side is tests/e2e/test_alerts_e2e.py's to time; here it only needs to come.
    wait_for(prometheus_fired, timeout=hold + 60.0, interval=POLL_S,
             what=f"Prometheus' {case.alert} for {case.job_id} at the webhook")

    def same_on_both() -> dict[str, dict[Key, Notification]]:
        fired = _fired(promstack, case.job_id)
        assert ours(fired)[RULER], _describe(fired)
        assert fired[PROMETHEUS].keys() == fired[RULER].keys(), _describe(fired)
        return fired

    fired = wait_for(same_on_both, timeout=VM_LAG_S, interval=POLL_S,
                     what=f"vmalert to fire for {case.job_id} what Prometheus fired")
    by_engine = ours(fired)
    for prom_note in by_engine[PROMETHEUS]:
        vm_note = fired[RULER][_key(prom_note.labels)]
        labels = dict(_key(prom_note.labels))
        assert {k: labels.get(k) for k in case.expect} == case.expect, labels
        assert vm_note.annotations["summary"] == prom_note.annotations["summary"], (prom_note, vm_note)
        assert _mask_durations(vm_note.annotations["description"]) == _mask_durations(
            prom_note.annotations["description"]), (prom_note.annotations, vm_note.annotations)
    first = {engine: min(n.received for n in notes) for engine, notes in by_engine.items()}
    assert first[RULER] - first[PROMETHEUS] <= VM_LAG_S, first
    with capsys.disabled():
        print(f"\n[vmalert] {case.alert} x{len(by_engine[PROMETHEUS])}: Prometheus "
              f"{first[PROMETHEUS] - injected_at:.1f}s after the fault, vmalert "
              f"{first[RULER] - first[PROMETHEUS]:+.1f}s after Prometheus (for {hold:g}s)")
