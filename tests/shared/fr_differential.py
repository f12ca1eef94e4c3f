"""What both halves of test_fr_differential.py use: the dump cases of tests/fr_cases.py, by id."""

from __future__ import annotations

from tests import fr_cases
from tests.fr_cases import Case

CASES = fr_cases.all_cases()


def case_named(case_id: str) -> Case:
    return next(c for c in CASES if c.id == case_id)
