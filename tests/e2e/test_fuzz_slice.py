"""A short, deterministic slice of ``benchmarks/fuzz.py``: every parser of outside data, 300 cases each.

Each case must return or raise the parser's documented error type, stay under the per-case CPU budget,
and neither import nor execute anything. The full run (``python -m benchmarks.fuzz --cases 100000``)
uses the same targets and strategies.

Its unit tests are in tests/unit/test_fuzz_slice.py.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from benchmarks import fuzz

CASES = 300
# Crashes found in parsers this suite's author does not own; each entry goes when its owner fixes the parser
# (strict: a fixed parser fails the run until its entry goes).
KNOWN_FAILURES: dict[str, str] = {}
CI_BUDGET_FACTOR = 4.0


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(reason=KNOWN_FAILURES[n], strict=True))
                                  if n in KNOWN_FAILURES else n for n in sorted(fuzz.TARGETS)])
def test_parser_survives_fuzzing(name: str) -> None:
    target = fuzz.TARGETS[name]
    fuzz._warm_up(target)

    @settings(max_examples=CASES, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
    @given(target.strategy())
    def check(data: bytes) -> None:
        # A Failure names the broken contract; hypothesis shrinks the input. The CPU budget is loosened here:
        # CI shares two cores with other tests, and `python -m benchmarks.fuzz` holds the real budget.
        fuzz.run_case(target, data, budget_factor=CI_BUDGET_FACTOR)

    check()
