"""The in-rank recorder: idempotent, never raises, never imports torch on its own, reports its own failures.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_recorder.py."""

from __future__ import annotations

from frexporter import spool


def test_only_the_recorders_that_the_process_groups_use_are_read() -> None:
    """Each recorder read is a status call under the GIL in every snapshot: an NCCL-only job on a CUDA build reads
    NCCL's alone; a cpu:gloo,cuda:nccl group needs both; a backend it cannot place keeps every recorder."""
    from frexporter.recorder.torch_fr import recorders_in_use

    both = (spool.RECORDER_FR, spool.RECORDER_NCCL)
    assert recorders_in_use(both, ["cuda:nccl"]) == (spool.RECORDER_NCCL,)
    assert recorders_in_use(both, ["cpu:gloo,cuda:gloo"]) == (spool.RECORDER_FR,)
    assert recorders_in_use(both, ["cuda:nccl", "cpu:gloo,cuda:gloo"]) == both  # a gloo side group
    assert recorders_in_use(both, ["cpu:gloo,cuda:nccl"]) == both
    assert recorders_in_use(both, ["cuda:nccl", "cpu:ucc,cuda:ucc"]) == both
    assert recorders_in_use(both, [""]) == both and recorders_in_use(both, []) == both
    # A torch without NCCL's own recorder (a CPU build, or one that records NCCL in the generic one).
    assert recorders_in_use((spool.RECORDER_FR,), ["cuda:nccl"]) == (spool.RECORDER_FR,)
    assert recorders_in_use((spool.RECORDER_FR,), ["cpu:gloo,cuda:gloo"]) == (spool.RECORDER_FR,)
