"""Helpers that more than one test module uses: ``tests/shared/X.py`` holds what both halves of a topic share,
tests/unit/test_X.py and tests/e2e/test_X.py (and ``layering``, ``spool_exporter``, ``series_budget``: what other
modules import)."""
