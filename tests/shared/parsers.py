"""What both halves of test_parsers.py use: hypothesis strategies for documents gone wrong, and a gloo FR entry."""

from __future__ import annotations

from hypothesis import strategies as st

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30,
)


def mutated(base: dict) -> st.SearchStrategy[dict]:
    """Valid documents with one field replaced by anything: the realistic way files go wrong."""
    return st.builds(lambda key, value: {**base, key: value}, st.sampled_from(sorted(base)), json_values)


GLOO_ENTRY = {
    "record_id": 0, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": 1, "p2p_seq_id": 0,
    "op_id": 1, "profiling_name": "gloo:all_reduce", "time_created_ns": 1795331103554771211,
    "input_sizes": [[4, 3]], "input_dtypes": ["Float"], "output_sizes": [[4, 3]], "output_dtypes": ["Float"],
    "state": "scheduled", "time_discovered_started_ns": 0, "time_discovered_completed_ns": 0, "retired": True,
    "timeout_ms": 1800000, "is_p2p": False,
}
