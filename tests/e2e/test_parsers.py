"""Parsers of outside data (spool files, FR dumps, worker-server answers) never raise anything unexpected.

Its unit tests are in tests/unit/test_parsers.py."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from frexporter import spool
from frexporter.fr import trace
from frexporter.spool import SpoolError
from tests import spoolgen
from tests.shared.parsers import GLOO_ENTRY, json_values, mutated


@settings(max_examples=300, deadline=None)
@given(st.one_of(json_values, mutated(spoolgen.manifest("j", 1, pgs=2))))
def test_manifest_parser_only_raises_spool_errors(doc: object) -> None:
    try:
        m = spool.parse_manifest(doc)
    except SpoolError:
        return
    assert isinstance(m.rank, int) and m.rank >= 0
    assert all(isinstance(r, int) for pg in m.process_groups for r in pg.ranks)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(json_values, mutated(GLOO_ENTRY)), max_size=6), json_values)
def test_fr_dump_parser_drops_bad_entries(entries: list, status: object) -> None:
    doc = {"version": "2.10", "pg_status": status, "entries": entries}
    try:
        dump = trace.parse_dump(doc)
    except SpoolError:
        return
    assert len(dump.entries) + dump.dropped_entries == len(entries)
