"""An evidence bundle reads the recorders the rank's snapshot reads: those its manifest says its PGs use.

A gloo-only job on a CUDA build of torch offers both FR handlers (the generic recorder's and NCCL's); its recorder
reads, and its manifest lists, only the generic one. Its bundle once held ``nccl_rank0.json`` too (an empty
ring). No torch and no socket here: the worker-server call is replaced by one that records what it was asked.
"""

from __future__ import annotations

from typing import Any

import pytest

from frexporter import spool
from frexporter.model import RANK_OK, Verdict
from frexporter.sources import worker_handlers
from frexporter.sources.evidence_capture import read_evidence
from frexporter.sources.ranks import liveness
from tests import spoolgen

CUDA_HANDLERS = ["ping", "fr_trace_json", "dump_nccl_trace_json", "pyspy_dump"]  # what a CUDA build offers
VERDICT = Verdict(kind="missing_rank", job_id="job", pg="0", pg_desc="default_pg", ranks=(1,), waiting_ranks=(0,),
                  seq=4, op="all_reduce", since=None, age_seconds=None, timeout_seconds=None, budget_used=None,
                  summary="rank 1 never joined")


def _bundle(monkeypatch: pytest.MonkeyPatch, recorders: list[str], handlers: list[str] = CUDA_HANDLERS
            ) -> tuple[list[str], list[str]]:
    """(the bundle's file names, the handlers asked) for a 2-rank job whose manifests list ``recorders``."""
    asked: list[str] = []

    def call(path: str, handler: worker_handlers.Handler, timeout: float, *args: Any, **kw: Any) -> bytes:
        asked.append(handler.name)
        return b'{"version": "2.10", "pg_status": {}, "entries": []}'

    monkeypatch.setattr(worker_handlers, "call", call)
    ranks = []
    for r in (0, 1):
        doc = spoolgen.manifest("job", r, world=2, socket=spoolgen.own_socket("job", r), handlers=handlers,
                                recorders=recorders)
        ranks.append(liveness.rank_state(spool.parse_manifest(doc), None, RANK_OK, True, (), None, None, 0.0))
    files = [f.name for f in read_evidence(VERDICT, ranks, "/nonexistent", stacks=False, timeout=1.0,
                                           started=0.0, within=float("inf"), max_bytes=1 << 20, note=_no_note)]
    return files, asked


def _no_note(reason: str, message: str) -> None:
    raise AssertionError(f"{reason}: {message}")


def test_a_gloo_only_job_on_a_cuda_build_saves_the_generic_recorder_only(monkeypatch: pytest.MonkeyPatch) -> None:
    files, asked = _bundle(monkeypatch, [spool.RECORDER_FR])
    assert files == ["fr_rank1.json", "fr_rank0.json"]  # the culprit first
    assert asked == ["fr_trace_json", "fr_trace_json"]


def test_an_nccl_only_job_saves_the_nccl_recorder_only(monkeypatch: pytest.MonkeyPatch) -> None:
    files, _ = _bundle(monkeypatch, [spool.RECORDER_NCCL])
    assert files == ["nccl_rank1.json", "nccl_rank0.json"]


def test_a_mixed_job_saves_both_recorders(monkeypatch: pytest.MonkeyPatch) -> None:
    files, _ = _bundle(monkeypatch, [spool.RECORDER_FR, spool.RECORDER_NCCL])
    assert files == ["fr_rank1.json", "nccl_rank1.json", "fr_rank0.json", "nccl_rank0.json"]


def test_a_manifest_that_names_no_recorder_keeps_every_ring_it_offers(monkeypatch: pytest.MonkeyPatch) -> None:
    # It says nothing of its recorders (a "starting" manifest lists no handler either): nothing is left out.
    files, _ = _bundle(monkeypatch, [])
    assert files == ["fr_rank1.json", "nccl_rank1.json", "fr_rank0.json", "nccl_rank0.json"]
    assert _bundle(monkeypatch, [], handlers=[]) == ([], [])


def test_the_other_handlers_stay_listed() -> None:
    listed = ("ping", "fr_trace_json", "dump_nccl_trace_json", "pyspy_dump", "dump_traceback")
    assert worker_handlers.handlers_in_use(listed, [spool.RECORDER_FR]) == (
        "ping", "fr_trace_json", "pyspy_dump", "dump_traceback")
    assert worker_handlers.handlers_in_use(listed, [spool.RECORDER_NCCL, spool.RECORDER_FR]) == listed
