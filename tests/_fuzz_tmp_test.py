from hypothesis import given, settings, strategies as st
import tests.test_verdicts as t

@settings(max_examples=6000, deadline=None)
@given(t.rank_sets(), st.sampled_from((0.0, 60.0)), st.booleans())
def test_fuzz(states, stuck_after, complete):
    t.test_property_culprits_are_members_and_never_waiters.hypothesis.inner_test(states, stuck_after, complete)
