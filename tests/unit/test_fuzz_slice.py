"""A short, deterministic slice of ``benchmarks/fuzz.py``: every parser of outside data, 300 cases each.

Each case must return or raise the parser's documented error type, stay under the per-case CPU budget,
and neither import nor execute anything. The full run (``python -m benchmarks.fuzz --cases 100000``)
uses the same targets and strategies.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_fuzz_slice.py.
"""

from __future__ import annotations

import pickle
import pickletools

import pytest

from benchmarks import fuzz


@pytest.mark.parametrize("name", sorted(fuzz.TARGETS))
def test_seeds_pass(name: str) -> None:
    """The valid files every strategy mutates are themselves accepted, so the fuzzing starts from real input."""
    target = fuzz.TARGETS[name]
    fuzz._warm_up(target)
    outcomes = [fuzz.run_case(target, seed, check_budget=False)[0] for seed in target.seeds()]
    assert "ok" in outcomes, outcomes


def _names_code(data: bytes) -> bool:
    """Whether a pickle asks for a global (a function or class): what the restricted unpickler refuses."""
    try:
        return any(op.name in ("GLOBAL", "STACK_GLOBAL", "INST") for op, _arg, _pos in pickletools.genops(data))
    except ValueError:
        return False


HOSTILE = fuzz.hostile_pickles()


@pytest.mark.parametrize("index", range(len(HOSTILE)))
def test_hostile_pickles_are_refused_without_running_anything(index: int) -> None:
    data = HOSTILE[index]
    for name in ("dumpfiles.safe_loads", "dumpfiles.decode"):
        # Raises on a call, an import, a hang or a case over budget (DAG and memo-reference bombs).
        fuzz.run_case(fuzz.TARGETS[name], data)
    if _names_code(data):
        with pytest.raises(pickle.UnpicklingError, match="refusing to load"):
            fuzz.dumpfiles.safe_loads(data)
